"""An ImageFolder tree of objects in a bucket (`dsc compile s3://bucket/images/ OUT`): listed, never mounted.

One LIST of the prefix (every page of it) gives each object's key, size and ETag; ImageFolder's rules
(`discover.label_tree`) then apply to the keys as to a folder's paths, in the order a walk of the folder
gives (depth-first, entries sorted by name: keys sorted by their '/'-separated parts), so the records are
the bytes a compile of a folder holding the same files makes. A source is its key below the prefix
(`class/file.jpg`), its stamp "size:ETag" (what `--resume` must find unchanged). Hidden names and
objects that are not images are passed over, as in a folder; a key the S3 client cannot list as a path
(an empty, '.' or '..' part, a control character) stops the discovery with one line naming it. A label
table's paths (`discover_listed`) are looked up among the same objects, as `labels` looks them up in a folder.

A worker GETs its own chunk's objects (`read_chunk`): one larger than any image within --max-pixels is
skipped unread, as a file is; one changed since the LIST (`If-Match` its ETag, and its size) or deleted
is skipped, named: the records are those of the objects the listing (and so the plan) names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from dsc.compiler import labels
from dsc.compiler.discover import Discovery, Found, Tree, is_image_name, label_tree
from dsc.errors import CompileError, ImageError
from dsc.storage.object_file import get_listed, head, split_prefix

GONE = "the object was deleted after the listing; not read"
CHANGED = "the object changed after the listing (another ETag or size); not read: compile again to take it"


class StoredObject(NamedTuple):
    """One source as a worker needs it: small and picklable."""

    name: str  # the key below the prefix: the record's source
    size: int
    etag: str


@dataclass
class BucketFolder(Discovery):
    """A `Discovery` of objects: `objects[i]` is `sources[i]` as the LIST saw it; `root` is the prefix's URL."""

    objects: list[StoredObject] = field(default_factory=list)


@dataclass(frozen=True)
class ObjectChunk:
    """One unit of work for a worker: some sources of the tree, by slot."""

    root: str  # s3://bucket/prefix
    tasks: list[tuple[int, StoredObject]]  # (slot, the object as listed)


def is_hidden(name: str) -> bool:
    return any(part.startswith(".") for part in name.split("/"))


def _spelled(url: str) -> str:
    """The prefix's URL as the bucket names it (`S3://b//p/` is s3://b/p): each object's is it, '/', its key."""
    bucket, prefix = split_prefix(url.rstrip("/"))
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def _listed(root: str) -> dict[str, StoredObject]:
    """Every object under the prefix by name (a key that cannot be listed: `Bucket.list` names it)."""
    from dsc.storage.bucket import Bucket

    return {i.name: StoredObject(i.name, i.size, i.etag) for i in Bucket(root).list() if i.name}


def _stamp(listed: StoredObject) -> str:
    return f"{listed.size}:{listed.etag}"


def _walk_order(names) -> list[str]:
    """Names in the order a walk of the folder lists them: depth-first, each folder's entries by name ("b/x.png"
    before "b.png", though the key "b.png" sorts first)."""
    return sorted(names, key=lambda name: name.split("/"))


def discover(url: str, classes: list[str] | None = None, skip_unknown: bool = False,
             on_found: Callable[[int], None] | None = None) -> BucketFolder:
    """The images of the tree under `url`, labelled and ordered as `discover.discover` orders a folder's."""
    root = _spelled(url)
    objects = _listed(root)
    visible = _walk_order(name for name in objects if not is_hidden(name))
    if not visible:
        raise CompileError(f"{root} holds no objects at all: is the prefix right?")
    below: dict[str, list[str]] = {}  # class folder -> its images, in a walk's order
    for name in visible:
        folder, slash, _ = name.partition("/")
        if slash:
            below.setdefault(folder, [])
            if is_image_name(name.rpartition("/")[2]):
                below[folder].append(name)
    top = [name for name in visible if "/" not in name and is_image_name(name)]

    def stamps(names: list[str]) -> list[str]:
        return [_stamp(objects[n]) for n in names]

    found = label_tree(root, sorted(below), top, lambda folder: Found(below[folder], stamps(below[folder])),
                       lambda: (top, stamps(top), []), classes, skip_unknown)
    if on_found:
        on_found(len(found.sources))
    return BucketFolder(**vars(found), objects=[objects[s] for s in found.sources])


def discover_listed(url: str, table: str | os.PathLike, kinds: dict[str, str] | None, classes: list[str] | None,
                    skip_unknown: bool, reference: dict[str, tuple[str, tuple[str, ...]]],
                    on_found: Callable[[int], None] | None) -> BucketFolder:
    """A label table's rows whose image is an object under `url` (paths relative to the prefix), as
    `labels.discover_listed` takes them from a folder."""
    root = _spelled(url)
    objects = _listed(root)
    walked = _walk_order(n for n in objects if not is_hidden(n) and is_image_name(n.rpartition("/")[2]))

    def images(on_found: Callable[[int], None] | None) -> tuple[list[str], list[str], list[tuple[str, str]]]:
        if on_found and walked:
            on_found(len(walked))
        return walked, [_stamp(objects[n]) for n in walked], []

    tree = Tree(root, images, lambda source: _stamp(objects[source]) if source in objects else None)
    found = labels.discover_listed(root, table, kinds, classes, skip_unknown, reference, on_found, tree)
    return BucketFolder(**vars(found), objects=[objects[s] for s in found.sources])


def check_apart(src: str, out: str) -> None:
    """SRC and OUT, both in a bucket, must not contain each other, as folders must not: a compile never lists
    its own output as sources (a resume would find a new class folder in it)."""
    s, o = f"{_spelled(src)}/", f"{_spelled(out)}/"
    if s == o:
        raise CompileError(f"the source and the output are the same prefix, {src}; give OUT another name")
    if o.startswith(s):
        raise CompileError(f"output {out} must not be inside the source prefix {src}")
    if s.startswith(o):
        raise CompileError(f"the source {src} must not be inside the output {out}")


def chunks(found: BucketFolder, order: np.ndarray, slots: list[int], size: int) -> Iterator[ObjectChunk]:
    """The pending `slots` as chunks of at most `size` consecutive ones."""
    for start in range(0, len(slots), size):
        yield ObjectChunk(str(found.root), [(slot, found.objects[order[slot]]) for slot in slots[start:start + size]])


def read_chunk(chunk: ObjectChunk, max_bytes: int,
               too_large: Callable[[int], ImageError]) -> Iterator[tuple[int, bytes | ImageError]]:
    """(slot, the object's bytes or why they were not read) for each task of the chunk, one GET each (retried
    as every request is); an object over `max_bytes` is not read (`too_large(size)` says why, as for a file);
    a failure a retry cannot fix stops the compile, to be resumed."""
    for slot, listed in chunk.tasks:
        if listed.size > max_bytes:
            yield slot, too_large(listed.size)
            continue
        try:
            data = get_listed(f"{chunk.root}/{listed.name}", listed.size, listed.etag)
        except FileNotFoundError:
            yield slot, ImageError(GONE)
            continue
        yield slot, ImageError(CHANGED) if data is None else data


def read_object(root: str, name: str, max_bytes: int) -> bytes:
    """One source's bytes read again (`dsc verify --decode`); ImageError when it is gone, too large or
    replaced while it was read."""
    url = f"{root.rstrip('/')}/{name}"
    try:
        size, stamp = head(url)
        if size > max_bytes:
            raise ImageError(f"the object is {size} bytes, more than any image within --max-pixels can need")
        data = get_listed(url, size, stamp.partition(":")[2])
    except FileNotFoundError:
        raise ImageError("no such object in the bucket any more") from None
    if data is None:
        raise ImageError("the object changed while it was read")
    return data
