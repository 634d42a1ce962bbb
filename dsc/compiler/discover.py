"""Discover: walk an ImageFolder tree into a sorted list of (source, label).

Labels are the sorted class-folder names, 0..K-1, as torchvision's ImageFolder gives
them, except that hidden folders (``.ipynb_checkpoints``) are never classes. A folder
with images and no class folders is *unlabeled* (label -1). A fixed vocabulary (`classes`,
e.g. the training split's) gives its own indices instead: a class without a folder keeps its
index, a folder outside it is an error or, with `skip_unknown`, skipped.

The walk also notes each file's size and modification time (the plan's fingerprint of the
sources, see `journal.source_listing`), so no second pass stats every source. Class folders
are walked by WALK_THREADS threads: on a network file system each stat is a round trip, and
the threads overlap them (the calls release the GIL). `on_found(n)` hears of every n images
found as each folder is listed, so a progress bar can count while a long walk runs. The same rules
(`label_tree`) label the objects of a prefix in a bucket (`sources.bucket_folder`).
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsc.errors import CompileError
from dsc.format import FieldEntry
from dsc.storage import is_dataset

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".bmp", ".gif", ".webp",
                              ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"})
WALK_THREADS = 16  # class folders walked at once: overlaps the round trips of a network file system


@dataclass
class Discovery:
    """What `discover` found: sources relative to `root`, '/'-separated, sorted by (label, path)."""

    root: Path
    sources: list[str]
    labels: np.ndarray
    classes: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)
    stamps: list[str] = field(default_factory=list)  # per source: "size:mtime_ns" at discovery
    fields: list[tuple[FieldEntry, np.ndarray]] = field(default_factory=list)  # per source, from a label table
    ignored: int = 0  # images in the folder that a label table does not list

    @property
    def labeled(self) -> bool:
        return bool(self.classes)


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


OnFound = Callable[[int], None]  # "n more images found"


@dataclass
class Found:
    """What one walk collected (one per class folder, so walks can run in parallel)."""

    sources: list[str] = field(default_factory=list)
    stamps: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    on_found: OnFound | None = None  # told of each folder's images as it is listed


def _serialized(on_found: OnFound | None) -> OnFound | None:
    """`on_found` called by one walk thread at a time (a progress bar's counter is not thread-safe)."""
    if on_found is None:
        return None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            on_found(n)
    return report


def _stamp(entry: os.DirEntry) -> str:
    """The file's "size:mtime_ns": a resume compares it to name a source that changed."""
    try:
        st = entry.stat()
    except OSError:
        return "missing"
    return f"{st.st_size}:{st.st_mtime_ns}"


def _walk(top: Path, rel: str, ancestors: frozenset[tuple[int, int]], found: Found) -> None:
    """Collect image files below `top` recursively, following symlinks but never a loop.

    Only a folder that is its own ancestor is a loop: a folder reached twice by different
    paths (two classes linking one shared folder) is listed under both, as ImageFolder does.
    """
    try:
        st = top.stat()
        if (st.st_dev, st.st_ino) in ancestors:
            return
        ancestors = ancestors | {(st.st_dev, st.st_ino)}
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        found.skipped.append((rel or ".", f"cannot list folder: {e.strerror or e}"))
        return
    images_here = 0  # reported once the folder is listed (sub-folders report their own)
    for entry in entries:
        if entry.name.startswith("."):
            continue
        child = f"{rel}/{entry.name}" if rel else entry.name
        try:
            is_dir = entry.is_dir()
            is_file = entry.is_file()
        except OSError as e:
            found.skipped.append((child, f"cannot stat: {e.strerror or e}"))
            continue
        if is_dir:
            _walk(Path(entry.path), child, ancestors, found)
        elif is_image_name(entry.name):
            if is_file:
                found.sources.append(child)
                found.stamps.append(_stamp(entry))
                images_here += 1
            elif entry.is_symlink() and not os.path.exists(entry.path):
                found.skipped.append((child, "broken symbolic link (its target does not exist)"))
            else:
                found.skipped.append((child, "not a regular file (a device, pipe or socket)"))
    if found.on_found and images_here:
        found.on_found(images_here)


@dataclass(frozen=True)
class Tree:
    """Where a label table's images are looked up (`labels.discover_listed`): a folder, or the objects of a
    prefix in a bucket (`sources.bucket_folder`)."""

    root: Path | str
    images: Callable[[OnFound | None], tuple[list[str], list[str], list[tuple[str, str]]]]  # as `list_images`
    stamp: Callable[[str], str | None]  # a listed source's stamp; None when it is not there


def folder_tree(root: Path) -> Tree:
    return Tree(root, lambda on_found: list_images(root, on_found), lambda source: _file_stamp(root / source))


def _file_stamp(path: Path) -> str | None:
    """A listed file's "size:mtime_ns" (as the walk stamps it), or None when it is not a regular file."""
    try:
        st = path.stat()
    except OSError:
        return None
    return f"{st.st_size}:{st.st_mtime_ns}" if stat.S_ISREG(st.st_mode) else None


def printable(source: str) -> str:
    """A source path as valid UTF-8 text for the manifest (undecodable bytes as \\xNN)."""
    return os.fsencode(source).decode("utf-8", "backslashreplace")


def list_images(root: Path, on_found: OnFound | None = None) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Every image file below `root` (relative, '/'-separated, depth-first by name), their stamps,
    and what was skipped."""
    found = Found(on_found=on_found)
    _walk(root, "", frozenset(), found)  # adds the root itself
    return found.sources, found.stamps, found.skipped


def check_source_folder(root: Path) -> list[os.DirEntry]:
    """The entries of SRC, sorted by name; CompileError when it is not a readable folder."""
    try:
        if not root.exists():
            raise CompileError(f"source folder {root} does not exist")
        if not root.is_dir():
            raise CompileError(f"source {root} is not a folder")
    except OSError as e:  # a name too long, a folder above that may not be searched
        raise CompileError(f"cannot open source folder {root}: {e.strerror or e}") from e
    if is_dataset(root):
        raise CompileError(f"source {root} is a compiled dsc dataset, not an image folder; did you swap SRC and OUT?")
    try:
        return sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise CompileError(f"cannot list source folder {root}: {e.strerror or e}") from e


def discover(root: str | os.PathLike, classes: list[str] | None = None, skip_unknown: bool = False,
             on_found: OnFound | None = None) -> Discovery:
    """List every image under `root`; raise CompileError when there is nothing to compile.

    `classes` fixes the vocabulary (label k is classes[k]); without it, the class folders are it.
    `on_found(n)` is called as n more images are found (from one walk thread at a time)."""
    root = Path(root)
    on_found = _serialized(on_found)
    top = check_source_folder(root)
    folders = [e.name for e in top if not e.name.startswith(".") and e.is_dir()]
    root_id = frozenset({(root.stat().st_dev, root.stat().st_ino)})  # a link back to SRC is a loop too
    return label_tree(root, folders, [e.name for e in top if e.is_file() and is_image_name(e.name)],
                      lambda name: _walk_class(root, name, root_id, on_found),
                      lambda: list_images(root, on_found), classes, skip_unknown)


def label_tree(root: Path | str, folders: list[str], beside: list[str], walk: Callable[[str], Found],
               flat: Callable[[], tuple[list[str], list[str], list[tuple[str, str]]]],
               classes: list[str] | None, skip_unknown: bool) -> Discovery:
    """ImageFolder's rules over a tree, a folder's or a bucket's (`sources.bucket_folder`): `folders` are the
    class folders found at the top (not hidden), `beside` the images beside them, `walk(name)` lists one
    class folder, `flat()` the whole tree of an unlabeled one."""
    for name in folders:
        if not name.isprintable() or os.fsencode(name) != name.encode("utf-8", "surrogateescape"):
            raise CompileError(f"class folder {os.fsencode(name)!r} in {root} has a name that is not valid "
                               "UTF-8; rename it (class names are stored as text)")
    sources: list[str] = []
    stamps: list[str] = []
    labels: list[int] = []
    skipped: list[tuple[str, str]] = []
    empty: list[str] = []
    unknown = [name for name in folders if classes is not None and name not in classes]
    if unknown and not skip_unknown:
        raise CompileError(f"class folder(s) {', '.join(map(repr, unknown[:10]))} in {root} are not among the "
                           f"{len(classes)} given classes; add them to the classes, or pass --skip-unknown-classes "
                           "to leave them out")
    skipped += [(name, "class folder not among the given classes") for name in unknown]
    if classes is None:
        classes = folders
    if folders or classes:
        present = [name for name in classes if name in folders]
        with ThreadPoolExecutor(max(1, min(WALK_THREADS, len(present)))) as pool:
            walks = dict(zip(present, pool.map(walk, present)))
        for label, name in enumerate(classes):
            found = walks.get(name, Found())
            if not found.sources and not found.skipped:  # truly empty, not unreadable
                empty.append(name)
            sources += found.sources
            stamps += found.stamps
            labels += [label] * len(found.sources)
            skipped += found.skipped
        skipped += [(name, "not inside a class folder") for name in beside]
    else:
        sources, stamps, skipped = flat()  # unlabeled
        labels = [-1] * len(sources)
    outside = [source for source, reason in skipped if reason == "not inside a class folder"]
    if not sources and outside:
        raise CompileError(f"the {len(outside)} image(s) directly in {root} are outside every class folder, and "
                           "the class folders hold none: move the images into class folders, or remove the empty "
                           "folders to compile them unlabeled")
    if not sources:
        raise CompileError(f"no images found in {root} (looked for {', '.join(sorted(IMAGE_EXTENSIONS))}, "
                           "in class sub-folders or directly in the folder)")
    return Discovery(root, sources, np.asarray(labels, dtype=np.int64), list(classes), skipped, empty, stamps)


def _walk_class(root: Path, name: str, ancestors: frozenset[tuple[int, int]], on_found: OnFound | None) -> Found:
    found = Found(on_found=on_found)
    _walk(root / name, name, ancestors, found)
    return found
