"""Archive sources: compile from WebDataset tar shards, Parquet files and zip archives in place.

SRC names archives (`archive_sources`): a `.tar`, `.zip` or `.parquet` file, a folder of `.tar` or
`.parquet` files, a glob, or a WebDataset brace pattern (`train-{000000..000146}.tar`). `discover`
lists their samples (headers, directories and metadata only: `common` says what each format
module does) into the same `Discovery` a folder gives, each source named `ARCHIVE#MEMBER`
(ARCHIVE relative to the archives' folder), labels resolved by the folder's rules and ordered as
a folder's are: by label, then archive and member order. The same given as an `s3://` URL (an
object, a prefix holding the archives, a glob or a brace pattern over object names) lists the
bucket (`remote_archives`) and reads every archive by ranged GETs (`dsc.storage.object_file`);
ARCHIVE is then relative to the archives' common prefix. `chunks` groups the pending slots by
the format's unit of work, in stored order; `read_chunk` streams one chunk's bytes to a worker.
An `s3://` prefix that is no set of archives is an image folder of objects (`bucket_folder`).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path

import numpy as np

from dsc.compiler.discover import WALK_THREADS, Discovery, is_image_name
from dsc.compiler.labels import LABEL_COLUMN, MAX_INTEGER_LABEL, Table, classes_without_records, table_fields
from dsc.compiler.sources import bucket_folder, parquet_files, tar_shards, zip_archive
from dsc.compiler.sources.common import ARCHIVE_ERRNOS, ArchiveChunk, Listing, Member, repeated
from dsc.errors import CompileError, ImageError
from dsc.format import UNLABELED, field_name_problem
from dsc.storage.object_file import head, is_url, list_folder, list_prefix

__all__ = ["ArchiveDiscovery", "archive_sources", "chunks", "discover", "read_chunk", "read_source"]

FORMATS = {"tar": tar_shards, "zip": zip_archive, "parquet": parquet_files}
SUFFIXES = {".tar": "tar", ".zip": "zip", ".parquet": "parquet"}
FOLDER_KINDS = ("tar", "parquet")  # a folder of these is a set of archives; a folder of zips is not
SPLITTABLE = {"tar": True, "zip": True, "parquet": False}  # a Parquet row group is read whole: one chunk
ORDER = "by label, then archive name and the order of samples in the archive"
MAX_PATTERN_NAMES = 1_000_000  # archives one brace range may name: a typo must not build a billion names
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


@dataclass
class ArchiveDiscovery(Discovery):
    """A `Discovery` of archive members: `members[i]` locates `sources[i]` in `archives[members[i].archive]`."""

    kind: str = ""
    archives: list[str] = field(default_factory=list)  # absolute paths or s3:// URLs
    members: list[Member] = field(default_factory=list)
    options: list[tuple] = field(default_factory=list)  # per archive: the format's read options


def expand_braces(pattern: str) -> list[str]:
    """A WebDataset (bash) brace pattern's names in order: `{000..012}` zero-padded ranges, `{a,b}` lists."""
    match = _BRACES.search(pattern)
    if match is None:
        return [pattern]
    head, body, tail = pattern[:match.start()], match.group(1), pattern[match.end():]
    numbers = _RANGE.match(body)
    if numbers:
        a, b = numbers.groups()
        if abs(int(b) - int(a)) >= MAX_PATTERN_NAMES:
            raise CompileError(f"the pattern's range {{{body}}} names more than {MAX_PATTERN_NAMES:,} archives")
        width = len(a) if a.lstrip("-").startswith("0") or len(a) == len(b) else 0
        step = 1 if int(b) >= int(a) else -1
        items = [f"{k:0{width}d}" for k in range(int(a), int(b) + step, step)]
    else:
        items = body.split(",")
    return [name for item in items for name in expand_braces(head + item + tail)]


def _kind_of(paths: list[Path] | list[str], what: str) -> str:
    kinds = {SUFFIXES.get(Path(p).suffix.lower()) for p in paths}
    if len(kinds) != 1 or None in kinds:
        raise CompileError(f"{what} names {len(paths)} files that are not all .tar, all .zip or all .parquet "
                           f"(e.g. {Path(paths[0]).name})")
    return kinds.pop()


def remote_archives(url: str) -> tuple[str, str, list[str]] | None:
    """(format, the archives' common prefix, their URLs sorted) of an `s3://` SRC: one object, a prefix
    holding .tar or .parquet objects (not below it), or a glob or brace pattern over object names; one
    LIST of the folder before the first pattern character (a HEAD for one object). None for a prefix that
    is an image folder by the folder's rule (sub-folders, images, or no archives: `bucket_folder`)."""
    if _BRACES.search(url) or glob.has_magic(url):
        names = expand_braces(url)
        literal = os.path.commonprefix([re.split(r"[*?[]", n, maxsplit=1)[0] for n in names])
        listed = {u for u, _, _ in list_prefix(literal)}
        found, missing = [], []
        for name in names:
            if glob.has_magic(name):  # a glob's * stays inside one folder, as it does on disk
                found += sorted(u for u in fnmatch.filter(listed, name) if u.count("/") == name.count("/"))
            elif name in listed:
                found.append(name)
            else:
                missing.append(name)
        if not found or missing:
            raise CompileError(f"the pattern {url} names no objects" if not found else
                               f"{len(missing)} of the {len(names)} objects the pattern {url} names do not exist, "
                               f"e.g. {missing[0]}")
        return _kind_of(found, f"the pattern {url}"), posixpath.dirname(os.path.commonprefix(found)), found
    if Path(url).suffix.lower() in SUFFIXES:
        try:
            head(url)
        except FileNotFoundError:
            raise CompileError(f"source {url} does not exist (no such object in the bucket)") from None
        return SUFFIXES[Path(url).suffix.lower()], posixpath.dirname(url), [url]
    folder = url.rstrip("/") + "/"
    listed, subfolders = list_folder(folder)
    names = [u[len(folder):] for u in listed if not u[len(folder):].startswith(".")]
    archives = [folder + n for n in names if SUFFIXES.get(Path(n).suffix.lower()) in FOLDER_KINDS]
    if not archives or any(not s.startswith(".") for s in subfolders) or any(map(is_image_name, names)):
        return None  # an image folder of objects, as a local folder is one (`bucket_folder`)
    return _kind_of(archives, f"the prefix {url}"), folder.rstrip("/"), archives


def archive_sources(src: str | os.PathLike) -> tuple[str, Path | str, list[Path] | list[str]] | None:
    """(format, the archives' folder, the archives sorted) when SRC names archives, else None (an image
    folder, local or `s3://`); for an `s3://` SRC, their common prefix and URLs."""
    text, path = os.fspath(src), Path(src)
    if is_url(text):
        return remote_archives(text)
    if not path.exists() and (_BRACES.search(text) or glob.has_magic(text)):
        names = [p for name in expand_braces(text) for p in (sorted(glob.glob(name)) if glob.has_magic(name)
                                                              else [name])]
        missing = [n for n in names if not Path(n).is_file()]
        if not names or missing:
            raise CompileError(f"the pattern {text} names no files" if not names else
                               f"{len(missing)} of the {len(names)} files the pattern {text} names do not exist, "
                               f"e.g. {missing[0]}")
        paths = [Path(n).absolute() for n in names]
        return _kind_of(paths, f"the pattern {text}"), Path(os.path.commonpath([p.parent for p in paths])), paths
    if path.suffix.lower() in SUFFIXES and not path.is_dir():
        if not path.is_file():
            raise CompileError(f"source {path} does not exist" if not path.exists() else
                               f"source {path} is not a regular file")
        return SUFFIXES[path.suffix.lower()], path.absolute().parent, [path.absolute()]
    if not path.is_dir():
        return None
    try:
        entries = [e for e in os.scandir(path) if not e.name.startswith(".")]
    except OSError:
        return None  # discover says why
    archives = sorted(Path(e.path).absolute() for e in entries
                      if e.is_file() and SUFFIXES.get(Path(e.name).suffix.lower()) in FOLDER_KINDS)
    if not archives or any(e.is_dir() or is_image_name(e.name) for e in entries):
        return None
    return _kind_of(archives, f"the folder {path}"), path.absolute(), archives


def _stamp(path: Path | str) -> str:
    """What changes when an archive does: size and mtime of a file, size and ETag of an object."""
    if isinstance(path, str):
        try:
            return head(path)[1]
        except FileNotFoundError:  # gone since it was listed: its samples are skipped already
            return "gone"
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _relative(path: Path | str, root: Path | str) -> str:
    return path[len(root) + 1:] if isinstance(path, str) else path.relative_to(root).as_posix()


def discover(src: str | os.PathLike, classes: list[str] | None = None, skip_unknown: bool = False,
             label_key: str | None = None, image_column: str | None = None,
             on_found: Callable[[int], None] | None = None, columns: dict[str, str] | None = None,
             reference: dict[str, tuple[str, tuple[str, ...]]] | None = None) -> ArchiveDiscovery:
    """Every sample of the archives SRC names, labelled, in the folder's order; CompileError when none.
    `columns` ({NAME: KIND}, `--column`) become typed fields: a Parquet column, a tar member suffix
    (its text) or `json:FIELD` of the sample's .json member, parsed as a label table's columns are;
    `reference` (another split's fields, `--classes-from`) fixes the vocabularies, as for a table."""
    kind, root, paths = archive_sources(src)
    columns = columns or {}
    if kind == "zip" and columns:
        raise CompileError("--column is for tar and Parquet sources; a zip's members are images only")
    names_of = {spec: _field_name(spec, kind) for spec in columns}
    if len(set(names_of.values())) < len(names_of):
        raise CompileError(f"--column: two of {', '.join(columns)} make the same field; give each once")
    if kind == "zip" and (label_key or image_column):
        raise CompileError("--label-key and --image-column are for tar and Parquet sources; a zip holds an "
                           "ImageFolder tree, labelled by its class folders")
    if kind == "tar" and image_column:
        raise CompileError("--image-column is for Parquet sources; a tar sample's image is its first image member")
    listings = _listings(FORMATS[kind], paths, label_key, image_column, on_found, tuple(columns))
    names = [_relative(p, root) for p in paths]
    skipped = [(f"{name}#{member}" if member else name, reason)
               for name, listing in zip(names, listings) for member, reason in listing.skipped]
    with ThreadPoolExecutor(max(1, min(WALK_THREADS, len(paths)))) as pool:  # HEADs of objects overlap
        stamps = list(pool.map(_stamp, paths))
    samples = [(f"{name}#{s.name}", s.member._replace(archive=a), s.label, stamps[a], s.values)
               for a, (name, listing) in enumerate(zip(names, listings)) for s in listing.samples]
    declared = _declared(kind, listings)
    labels, vocabulary, reasons = resolve_labels([s[2] for s in samples], declared, classes, skip_unknown)
    if label_key and not vocabulary:
        raise CompileError(f"no sample of {src} has a label where --label-key {label_key} says")
    skipped += [(s[0], reasons[i]) for i, s in enumerate(samples) if i in reasons]
    keep = [i for i in range(len(samples)) if i not in reasons]
    keep.sort(key=lambda i: labels[i])  # stable: archive and member order within a label
    if not keep:
        example = f", e.g. {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise CompileError(f"no images found in {src} ({len(paths)} {kind} archive(s), "
                           f"{len(skipped)} skipped{example})")
    kept_labels = np.asarray([labels[i] for i in keep], dtype=np.int64)
    gaps = vocabulary and classes is None and declared is None and isinstance(samples[keep[0]][2], int)
    sources = [samples[i][0] for i in keep]
    table = Table(os.fspath(src), sources, list(range(1, len(keep) + 1)),
                  {names_of[spec]: [samples[i][4][spec] for i in keep] for spec in columns}, by_source=True)
    fields = table_fields(table, {names_of[spec]: k for spec, k in columns.items()}, reference or {})
    return ArchiveDiscovery(root, sources, kept_labels, vocabulary, skipped,
                            [] if gaps else classes_without_records(kept_labels, vocabulary),
                            [samples[i][3] for i in keep], fields, kind=kind, archives=[str(p) for p in paths],
                            members=[samples[i][1] for i in keep], options=[listing.options for listing in listings])


def unique_names(listing: Listing) -> Listing:
    """The listing with one sample per member name: a record's source (ARCHIVE#MEMBER) must name one member,
    so a later member of a name already taken (a tar appended to, a zip with a repeated entry) is skipped."""
    seen: dict[str, int] = {}
    kept = []
    for sample in listing.samples:
        if sample.name in seen:
            seen[sample.name] += 1
            listing.skipped.append((repeated(sample.name, seen[sample.name]), "another member of this name comes "
                                    "first in the archive (a record's source must name one member; the first is kept)"))
        else:
            seen[sample.name] = 1
            kept.append(sample)
    listing.samples[:] = kept
    return listing


def _field_name(spec: str, kind: str) -> str:
    """The field a `--column` spec makes: a Parquet column's name, a tar member's suffix, `json:FIELD`'s FIELD."""
    name = (spec.partition(":")[2] or spec) if kind == "tar" else spec
    problem = (f"{name!r} is the label (give --label-key to choose where it is)" if name == LABEL_COLUMN
               else field_name_problem(name))
    if problem:
        raise CompileError(f"--column {spec}: {problem}")
    return name


def _listings(module, paths: list[Path] | list[str], label_key: str | None, image_column: str | None,
              on_found: Callable[[int], None] | None, fields: tuple[str, ...] = ()) -> list[Listing]:
    """Each archive's listing, WALK_THREADS at a time (their reads overlap), `on_found` told in this
    thread as each comes in order; an unreadable archive is a skip."""
    def listed(path: Path | str) -> Listing:
        try:
            return unique_names(module.list_archive(path, label_key, image_column, *((fields,) if fields else ())))
        except OSError as e:
            return Listing(skipped=[("", f"cannot read archive: {e.strerror or e}")])

    listings = []
    with ThreadPoolExecutor(max(1, min(WALK_THREADS, len(paths)))) as pool:
        for listing in pool.map(listed, paths):
            listings.append(listing)
            if on_found and listing.samples:
                on_found(len(listing.samples))
    return listings


def _declared(kind: str, listings: list[Listing]) -> list[str] | None:
    """The class names the archives give: the class folders of every zip, or the ClassLabel's names
    (the files of one dataset share its features)."""
    if kind == "zip":
        return sorted(set().union(*(listing.names or () for listing in listings))) or None
    return next((listing.names for listing in listings if listing.names), None)


def resolve_labels(raw: list[int | str | None], declared: list[str] | None, vocabulary: list[str] | None,
                   skip_unknown: bool) -> tuple[list[int], list[str], dict[int, str]]:
    """Labels as stored (integers: indices, kept as given; text: class names) → (label per sample, the
    classes, {sample: why it is skipped}). `declared` are the names the archive gives (a ClassLabel's, a
    zip's class folders); `vocabulary` the user's (--classes), which wins. No labels at all: unlabeled."""
    present = [v for v in raw if v is not None]
    if not present:
        return [UNLABELED] * len(raw), [], {}
    if any(isinstance(v, int) for v in present) and any(isinstance(v, str) for v in present):
        raise CompileError("the labels mix integers and class names; give --label-key to pick one member or column")
    reasons: dict[int, str] = {}
    integers = isinstance(present[0], int)
    if integers:
        for i, v in enumerate(raw):
            if v is not None and not UNLABELED <= v <= MAX_INTEGER_LABEL:
                reasons[i] = f"label {v} is outside {UNLABELED}..{MAX_INTEGER_LABEL}"
        if declared is not None:  # a ClassLabel: the integers index its names
            for i, v in enumerate(raw):
                if v is not None and v >= len(declared):
                    reasons.setdefault(i, f"label {v} is not among the {len(declared)} names of its ClassLabel")
            raw = [declared[v] if v is not None and i not in reasons and v >= 0 else
                   (v if v == UNLABELED else None) for i, v in enumerate(raw)]
            integers = False
    if integers:
        values = [v for i, v in enumerate(raw) if v is not None and i not in reasons]
        classes = vocabulary or [str(k) for k in range(max(values, default=-1) + 1)]
        index = {k: k for k in range(len(classes))}
    else:
        classes = vocabulary or declared or sorted({v for v in raw if isinstance(v, str)})
        index = {name: k for k, name in enumerate(classes)}
    labels, unknown = [], []
    for i, v in enumerate(raw):
        if v == UNLABELED:
            labels.append(UNLABELED)
        elif v is None:
            labels.append(UNLABELED)
            reasons.setdefault(i, "no label")
        elif v in index:
            labels.append(index[v])
        else:
            labels.append(UNLABELED)
            unknown.append(i)
            reasons.setdefault(i, f"class {v!r} is not among the {len(classes)} classes")
    if unknown and vocabulary is not None and not skip_unknown:
        shown = sorted({str(raw[i]) for i in unknown})
        raise CompileError(f"class(es) {', '.join(map(repr, shown[:10]))} are not among the {len(classes)} given "
                           "classes; add them to the classes, or pass --skip-unknown-classes to leave them out")
    return labels, list(classes), reasons


def chunks(found: ArchiveDiscovery, order: np.ndarray, slots: list[int], size: int) -> Iterator[ArchiveChunk]:
    """The pending `slots` as chunks of one unit each (a run of at most `size` members of one tar or zip,
    a Parquet row group), members in stored order, so every archive is read front to back."""
    pending = sorted(((found.members[order[slot]], slot) for slot in slots), key=lambda item: item[0])
    splittable = SPLITTABLE[found.kind]
    for (archive, _), group in groupby(pending, key=lambda item: (item[0].archive, item[0].unit)):
        tasks = [(slot, member) for member, slot in group]
        step = size if splittable else len(tasks)
        for start in range(0, len(tasks), step):
            yield ArchiveChunk(found.kind, found.archives[archive], tasks[start:start + step],
                               found.options[archive])


def read_chunk(chunk: ArchiveChunk, max_bytes: int) -> Iterator[tuple[int, bytes | ImageError]]:
    """(slot, the member's bytes or why they cannot be read) for each task of the chunk, in its order.
    An archive gone or unreadable is every member's fault (skipped); any other OSError (EIO, EMFILE)
    stops the compile, to be resumed."""
    slots, done = [slot for slot, _ in chunk.tasks], 0
    try:
        for data in FORMATS[chunk.kind].read_members(chunk.path, [m for _, m in chunk.tasks], max_bytes,
                                                     chunk.options):
            yield slots[done], data
            done += 1
    except OSError as e:
        if e.errno not in ARCHIVE_ERRNOS:
            raise
        error = ImageError(f"cannot read archive: {e.strerror or e}")
        yield from ((slot, error) for slot in slots[done:])


def read_source(root: str | os.PathLike, source: str, max_bytes: int) -> bytes | None:
    """The bytes of one compiled source named `ARCHIVE#MEMBER` (for `dsc verify --decode`), or under an
    `s3://` root of an image folder's object; None when `source` names no member of an archive under a local
    `root` (then it is a file's path). ImageError when the member or object is gone or unreadable."""
    at, remote = source.find("#"), is_url(os.fspath(root))
    while at >= 0:
        archive = f"{os.fspath(root).rstrip('/')}/{source[:at]}" if remote else Path(root) / source[:at]
        kind = SUFFIXES.get(Path(archive).suffix.lower())
        if kind and (remote or archive.is_file()):
            try:
                found = FORMATS[kind].find_member(archive, source[at + 1:])
            except (OSError, ValueError, CompileError) as e:  # pyarrow's errors are ValueErrors or OSErrors
                raise ImageError(f"cannot read {source[:at]}: {e}") from e
            if found is None:
                raise ImageError(f"{source[:at]} has no member {source[at + 1:]!r} any more")
            member, options = found
            chunk = ArchiveChunk(kind, str(archive), [(0, member)], options)
            data = next(read_chunk(chunk, max_bytes))[1]
            if isinstance(data, ImageError):
                raise data
            return data
        at = source.find("#", at + 1)
    return bucket_folder.read_object(os.fspath(root), source, max_bytes) if remote else None
