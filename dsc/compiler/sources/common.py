"""What every archive format shares: how a sample is located, named and labelled.

A format module (`tar_shards`, `zip_archive`, `parquet_files`) has three verbs: `list_archive`
lists one archive's samples cheaply at discovery (tar headers, the zip directory, Parquet
metadata and its label column: never the images), `read_members` streams the encoded bytes
of some of its members to a worker, one unit of work (a run of tar or zip members, a Parquet
row group) at a time, and `find_member` locates one member by its name again (`dsc verify
--decode`). Nothing is ever extracted: member names are only names. Each opens its archive with
`open_archive`, a local file or an object in a bucket (`s3://`, read by ranges), and reads a
member at its offset with `read_at`.
"""

from __future__ import annotations

import errno
import os
import posixpath
from dataclasses import dataclass, field
from typing import BinaryIO, NamedTuple

from dsc.errors import ImageError
from dsc.storage.object_file import READ_AHEAD_BYTES, ObjectFile, is_url

# Why a read of an archive is the archive's fault (skipped) rather than the machine's (the compile stops,
# to be resumed): the same errors as for a source file (dsc.compiler.write.SOURCE_ERRNOS).
ARCHIVE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP,
                            errno.ENAMETOOLONG, errno.ENXIO, errno.ENODEV})
MAX_LABEL_MEMBER_BYTES = 1 << 20  # a .cls/.txt/.json label member is a few bytes: a larger one is not read
# The image member chosen for a sample, in this order of preference (webdataset's own extensions first).
IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "jpe", "jfif", "bmp", "gif", "tif", "tiff", "ppm", "pgm", "pbm", "pnm")


def open_archive(path: str | os.PathLike, until: int | None = None, read_ahead: int = READ_AHEAD_BYTES) -> BinaryIO:
    """An archive opened for reading: a local file, or an `s3://` object read by ranged GETs, ahead
    by `read_ahead` bytes but not past `until` (where the caller's reads end), when given."""
    text = os.fspath(path)
    return ObjectFile(text, read_ahead, until) if is_url(text) else open(text, "rb")


def archive_size(f: BinaryIO) -> int:
    """The size of an archive `open_archive` opened."""
    return f.size if isinstance(f, ObjectFile) else os.fstat(f.fileno()).st_size


def read_at(f: BinaryIO, size: int, offset: int) -> bytes:
    """Up to `size` bytes at `offset` of an archive `open_archive` opened (fewer at its end)."""
    return f.pread(size, offset) if isinstance(f, ObjectFile) else os.pread(f.fileno(), size, offset)


class Member(NamedTuple):
    """Where a sample's image is, as a worker needs it: small and picklable."""

    archive: int  # index into the discovery's archives
    unit: int  # the unit of work inside the archive: a Parquet row group; 0 for tar and zip
    position: int  # tar: data offset; zip: local header offset; Parquet: row within the row group
    size: int = 0  # stored bytes (tar, zip); 0 for Parquet
    extra: tuple = ()  # zip: (method, uncompressed size, CRC-32)


def repeated(name: str, k: int) -> str:
    """How a skip names the k-th member called `name` (k >= 2): not `name` itself, which names the first."""
    return f"{name} (copy {k})"


@dataclass
class Sample:
    """One sample of an archive: the name of its image member, where it is, its label as stored."""

    name: str
    member: Member
    label: int | str | None = None
    values: dict[str, object] = field(default_factory=dict)  # `--column` name -> its value as stored ("": none)


@dataclass
class Listing:
    """What `list_archive` found in one archive. `names` are the class names the archive itself
    declares (a Parquet ClassLabel's, a zip's class folders), or None."""

    samples: list[Sample] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (member name, or "" for the archive; reason)
    names: list[str] | None = None
    options: tuple = ()  # what a worker needs to read it (Parquet: the image column)


@dataclass(frozen=True)
class ArchiveChunk:
    """One unit of work for a worker: some members of one archive, in the order they are stored."""

    kind: str  # a key of dsc.compiler.sources.FORMATS
    path: str  # the archive: an absolute path or an s3:// URL
    tasks: list[tuple[int, Member]]  # (slot, member)
    options: tuple = ()  # the format's read options (Parquet: the image column)


def unsafe_name(name: str) -> str | None:
    """Why a member name cannot name a source, or None: absolute, climbing out (`..`), or holding
    control characters. Such members are skipped (never extracted anywhere: dsc extracts nothing)."""
    if not name or name.startswith("/") or "\\" in name[:1]:
        return "unsafe member name (an absolute path); not read"
    if ".." in posixpath.normpath(name).split("/") or ".." in name.split("/"):
        return "unsafe member name (it climbs out of the archive with '..'); not read"
    if not name.isprintable():
        return "unsafe member name (it holds control characters); not read"
    return None


def too_large(size: int, max_bytes: int) -> ImageError:
    """The folder compile's verdict on a file too large to be an image within --max-pixels."""
    return ImageError(f"member is {size} bytes, more than any image within --max-pixels can need "
                      f"({max_bytes} bytes); not read")


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's grouping: (key, suffix) = the name up to the first dot of its basename, and the rest
    in lower case ("a/b.seg.png" -> ("a/b", "seg.png"))."""
    folder, _, base = name.rpartition("/")
    stem, dot, suffix = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), suffix.lower() if dot else ""
