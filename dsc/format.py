"""The dsc dataset format, version 1.5: the only module that knows the on-disk layout.

The contract is ``formats.md`` at the repository root; this module uses the same
names for the same things. In short::

    OUT/
      manifest.json         written last: its presence means the dataset is complete
      shards/00000.bin ...  raw uint8 records [n, H, W, 3] back to back, no header
      labels.bin            int64 LE  [count]
      sizes.bin             uint32 LE [count, 2]  original (height, width), EXIF-oriented
      source_offsets.bin    uint64 LE [count + 1] byte ranges of each record's path in sources.bin
      sources.bin           source paths relative to SRC, '/'-separated, as the file system's bytes
      skipped.jsonl         (1.1) every skipped source; the manifest keeps only the first ones
      fields/NAME.bin       (1.1) one typed per-record value per field: [count, *shape], little-endian
      warnings.bin          (1.2, only when a record has one) uint16 LE [count] decoder warnings per record
      checksums.bin         (1.3, optional) uint32 LE [count]: CRC-32 of each record's bytes
      shard_table.bin       (1.4) each shard's SHA-256, 32 raw bytes a shard (`with_shard_table`, `ShardList`)
      class_counts.bin      (1.5) int64 LE [K + 1]: a segment's records labeled -1, then each class
      versions/00000002.json (1.3) the manifest of version 2 (an append), committed create-only
      appends/<16 hex>/...  (1.3) the files an append wrote (its shards, a new index), named by its versions
      builds/<16 hex>/...   (1.3, object storage) the files a compile into a bucket wrote, same names

Versions (1.3): version 1 is the compile; `dsc append` commits version N+1 by creating
`versions/NNNNNNNN.json` (never replacing one), which lists every file of that version. Files
are never rewritten, so a reader that opened version N keeps reading exactly N; the latest
version is the highest-numbered manifest in `versions/`, else `manifest.json` (which dsc also
refreshes to a copy of the latest, for readers that do not know versions). A compile into a bucket
commits its build (`builds/<tag>/`) the same way; with --force as version N+1, a replacement.

Shard tables (1.4): the manifest no longer lists the shards (~150 bytes each: 60 MB at 400k
shards, parsed by every process); its `shard_tables` say which folder holds each run of shards and
which rows of a table file hold their SHA-256s, and `ShardList` makes a shard's entry when asked.

Index segments (1.5): the per-record files (index, fields, checksums, warnings) are listed by `segments`, each
those of one run of records with its class counts (`Segment`, `with_segment`), so an append writes a segment
of its new records and lists the earlier ones unchanged; a version before 1.5 is one segment
(`Manifest.index_segments`).

The manifest (formats.md, "manifest.json") names every other file with its size and SHA-256,
and (1.2) carries its own SHA-256, taken with that value as 64 '0's (`sealed`, `seal_problem`);
record i lives in shard i // records_per_shard at byte (i % records_per_shard) * H * W * 3.

Readers validate before they trust: the manifest's size, keys and types, its version, every
file name (a plain relative path), every count against every stored file's size
(`parse_manifest`), then the index and field values, a bounded piece at a time (`check_index`)
— only then are the files memory-mapped. This module does no I/O of its own: the store that
holds the dataset (`dsc.storage`) hands it bytes, sizes and values, and the compiler writes
the payloads it builds here (`index_payloads`, `field_payload`, `skip_list_payload`).
"""

from __future__ import annotations

import bisect
import contextvars
import functools
import hashlib
import json
import operator
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dsc.errors import DatasetError, UnsupportedVersionError, quoted

try:  # zlib's CRC-32, the same numbers ~3.7x faster (zlib-ng, in the s3 extra: a cold read checks all it fetches)
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:
    from zlib import crc32 as _crc32

FORMAT_NAME = "dsc"
FORMAT_VERSION = "1.5"  # MAJOR.MINOR: a reader refuses another MAJOR; MINOR only adds keys.
MANIFEST_FILE = "manifest.json"
SHARD_DIR = "shards"
LABELS_FILE = "labels.bin"
SIZES_FILE = "sizes.bin"
SOURCE_OFFSETS_FILE = "source_offsets.bin"
SOURCES_FILE = "sources.bin"
SKIP_LIST_FILE = "skipped.jsonl"  # 1.1: every skipped source, one JSON object a line
SEAL_KEY = "manifest_sha256"  # 1.2: the manifest's own SHA-256, computed with this value as 64 '0's
_SEAL_PLACEHOLDER = "0" * 64
WARNINGS_FILE = "warnings.bin"  # 1.2: decoder warnings per record (a kept but damaged source)
CHECKSUMS_FILE = "checksums.bin"  # 1.3: CRC-32 per record, so a fetched byte range can be checked on its own
SHARD_TABLE_FILE = "shard_table.bin"  # 1.4: each shard's SHA-256, 32 raw bytes a shard: the manifest stays small
CLASS_COUNTS_FILE = "class_counts.bin"  # 1.5: a segment's records per label (-1 first), so info need not count
DIGEST_BYTES = 32  # a raw SHA-256
SKIPPED_IN_MANIFEST = 100  # 1.1: the manifest's "skipped" holds only the first ones (it must stay small)
INDEX_FILES = {"labels": LABELS_FILE, "sizes": SIZES_FILE,
               "source_offsets": SOURCE_OFFSETS_FILE, "sources": SOURCES_FILE}

FIELD_DIR = "fields"
VERSIONS_DIR = "versions"  # 1.3: versions/NNNNNNNN.json, version N's manifest (N >= 1)
VERSION_DIGITS = 8
MAX_DATASET_VERSION = 10 ** VERSION_DIGITS - 1
APPENDS_DIR = "appends"  # 1.3: appends/<APPEND_TAG_HEX hex digits>/<a dataset file name>: an append's files
APPEND_TAG_HEX = 16
ABANDONED_AFTER_S = 24 * 3600.0  # (1.3) a writer's uncommitted files this old, where no lock tells, are abandoned
BUILDS_DIR = "builds"  # 1.3, object storage: builds/<tag as an append's>/<a dataset file name>: a compile's files

CHANNELS = 3  # records are RGB
RECORD_DTYPE = np.dtype(np.uint8)
LABEL_DTYPE = np.dtype("<i8")
SIZE_DTYPE = np.dtype("<u4")
OFFSET_DTYPE = np.dtype("<u8")
# "No label": every record of a folder without class sub-folders (classes empty), and in a labeled
# dataset a record whose integer label in a label table is -1 (an ignore value, as given)
UNLABELED = -1
WARNING_DTYPE = np.dtype("<u2")
CHECKSUM_DTYPE = np.dtype("<u4")  # record_crc: zlib's CRC-32 of the record's H*W*3 bytes
COUNT_DTYPE = np.dtype("<i8")  # 1.5: class_counts.bin, [K_s + 1]: records labeled -1, then 0 .. K_s - 1
# Per-record fields (1.1): each kind has one on-disk dtype. class: an index into the field's
# classes; multilabel: multi-hot [K] over its classes; float / int: numbers.
FIELD_DTYPES = {"class": np.dtype("<i8"), "multilabel": np.dtype("u1"), "float": np.dtype("<f4"),
                "int": np.dtype("<i8")}
RESERVED_FIELD_NAMES = ("image", "label", "index", "size")  # what every batch already holds
MAX_FIELD_NAME = 64
MAX_FIELD_VALUES = 1 << 16  # values per record in one field
MAX_MANIFEST_BYTES = 64 << 20  # refuse to parse more: a manifest is small, even with many skips
MAX_SIDE = 1 << 16  # records are thumbnails for training, not posters
MAX_RECORDS = 1 << 40  # records in a dataset, and so in one shard (formats.md: 2^40)
SCAN_ITEMS = 1 << 20  # index values checked this many at a time: bounded memory at open
# compile.decode (informative): how far the compiler let libjpeg-turbo scale JPEGs down in the
# DCT domain; a manifest without the key was made before it existed, by today's "fast".
DECODE_MODES = ("faithful", "fast")
DECODE_MODE_UNRECORDED = "fast"
# compile.alpha: what became of transparent pixels (the choice of `--alpha`, by its name here).
ALPHA = {"black": "composited onto black", "white": "composited onto white",
         "drop": "dropped: the stored RGB of every pixel"}
DCT_SCALING = {
    "faithful": "none: JPEGs are decoded at full size",
    "fast": "1/2, 1/4 or 1/8 when the source is at least that many times the size the fit needs",
}


@dataclass(frozen=True)
class FileEntry:
    """A file of the dataset, with its exact size and SHA-256."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardEntry(FileEntry):
    """A shard file: `records` records of `record_bytes` each, nothing else."""

    records: int = 0


@dataclass(frozen=True)
class ShardTable(FileEntry):
    """(1.4) Shards [first, first + count) are the files `folder/NNNNN.bin` (NNNNN: the shard's number,
    as `shard_file` writes it); their SHA-256s are rows row .. row + count - 1 of this file, 32 raw bytes
    each (one file may back several tables, and hold rows a later version no longer uses)."""

    first: int = 0
    count: int = 0
    row: int = 0
    folder: str = SHARD_DIR

    def file_of(self, shard: int) -> str:
        return f"{self.folder}/{shard_file(shard).rsplit('/', 1)[1]}"


class ShardList(Sequence):
    """(1.4) The shards' entries, made when asked for from the record arithmetic and the shard tables'
    digests (32 bytes a shard), instead of one object per shard parsed out of the manifest."""

    def __init__(self, count: int, records_per_shard: int, record_bytes: int, tables: tuple[ShardTable, ...],
                 digests: bytes) -> None:
        self.count, self.per_shard, self.record_bytes = count, records_per_shard, record_bytes
        self.tables, self.digests = tables, digests
        self._firsts = [t.first for t in tables]

    def __len__(self) -> int:
        return shard_count(self.count, self.per_shard)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return tuple(self[i] for i in range(*k.indices(len(self))))
        k = operator.index(k)
        k = k + len(self) if k < 0 else k
        if not 0 <= k < len(self):
            raise IndexError(f"shard {k} of {len(self)}")
        table = self.tables[bisect.bisect_right(self._firsts, k) - 1]
        records = min(self.per_shard, self.count - k * self.per_shard)
        digest = self.digests[k * DIGEST_BYTES:(k + 1) * DIGEST_BYTES].hex()
        return ShardEntry(table.file_of(k), records * self.record_bytes, digest, records)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None


@dataclass(frozen=True)
class FieldEntry(FileEntry):
    """A per-record field file (1.1): `[count, *shape]` values of its kind's dtype, no header."""

    name: str = ""
    kind: str = ""
    shape: tuple[int, ...] = ()
    classes: tuple[str, ...] = ()

    @property
    def dtype(self) -> np.dtype:
        return FIELD_DTYPES[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "dtype": self.dtype.str, "shape": list(self.shape),
                "classes": list(self.classes), "file": self.file, "bytes": self.bytes, "sha256": self.sha256}


def field_name_problem(name: Any) -> str | None:
    """Why `name` cannot name a field (it becomes a batch key and a file name), or None."""
    if not isinstance(name, str) or not name or len(name) > MAX_FIELD_NAME or not name.isascii() \
            or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
        return (f"{quoted(name, 80)} is not a valid field name (letters, digits and '_', starting with a letter or "
                f"'_', at most {MAX_FIELD_NAME} characters)")
    if name in RESERVED_FIELD_NAMES:
        return f"{name!r} is reserved (every batch has {', '.join(RESERVED_FIELD_NAMES)})"
    return None


def field_file(name: str) -> str:
    return f"{FIELD_DIR}/{name}.bin"


@dataclass(frozen=True)
class SkipListEntry(FileEntry):
    """The skip list file (1.1): `count` lines, one per skipped source."""

    count: int = 0


@dataclass(frozen=True)
class Part:
    """(1.3) Records [first, first + count) and the `compile` options that made them: an appended
    or merged dataset's records come from several compiles (formats.md, "Versions")."""

    first: int
    count: int
    compile: dict[str, Any]


@dataclass(frozen=True)
class Segment:
    """(1.5) The index of records [first, first + count): its own files, each sealed by the manifest (size and
    SHA-256), so an append writes a segment for its new records and keeps every earlier one by name. Its
    source offsets start at 0 (the segment's own sources file); `fields` follow the manifest's field order;
    `class_counts` holds how many of its records carry each label (-1 first), so counting needs no labels.
    A dataset before 1.5 has one segment: its whole-dataset files (`Manifest.index_segments`)."""

    first: int
    count: int
    index: dict[str, FileEntry]
    fields: tuple[FileEntry, ...] = ()
    checksums: FileEntry | None = None
    warnings: FileEntry | None = None
    class_counts: FileEntry | None = None  # None only in the one segment of a version before 1.5

    @property
    def files(self) -> list[FileEntry]:
        return [*self.index.values(), *self.fields, *filter(None, [self.checksums, self.warnings, self.class_counts])]

    def to_dict(self) -> dict[str, Any]:
        doc = {"first": self.first, "count": self.count, "index": {k: asdict(v) for k, v in self.index.items()},
               "fields": [_file_dict(f) for f in self.fields], "checksums": _file_dict(self.checksums),
               "class_counts": _file_dict(self.class_counts)}
        if self.warnings is not None:
            doc["warnings"] = _file_dict(self.warnings)
        return doc


def _file_dict(entry: FileEntry) -> dict[str, Any]:
    return {"file": entry.file, "bytes": entry.bytes, "sha256": entry.sha256}


@dataclass(frozen=True)
class Manifest:
    """Everything `manifest.json` says (see formats.md, "manifest.json")."""

    height: int
    width: int
    count: int
    records_per_shard: int
    classes: tuple[str, ...]
    shards: Sequence[ShardEntry]  # a tuple, or (1.4, as parsed) a ShardList made from the shard tables
    index: dict[str, FileEntry]
    skipped: tuple[dict[str, str], ...] = ()  # all of them, or with `skipped_list` the first SKIPPED_IN_MANIFEST
    compile: dict[str, Any] = field(default_factory=dict)
    fields: tuple[FieldEntry, ...] = ()
    version: str = FORMAT_VERSION
    skipped_list: SkipListEntry | None = None
    warnings: FileEntry | None = None  # 1.2: present only when some record had decoder warnings
    dataset_version: int = 1  # 1.3: which version of the dataset this manifest describes
    parts: tuple[Part, ...] = ()  # 1.3: how each run of records was made; () = one part, `compile`
    checksums: FileEntry | None = None  # 1.3: CRC-32 per record (optional: older datasets have none)
    shard_tables: tuple[ShardTable, ...] = ()  # 1.4: where the shards' SHA-256s are (`with_shard_table`)
    # 1.5: the index in segments (`with_segment`); then `index` is {}, `checksums` and `warnings` None and the
    # fields' file entries empty: every per-record file is a segment's (`index_segments`)
    segments: tuple[Segment, ...] = ()

    @property
    def index_segments(self) -> tuple[Segment, ...]:
        """The index by runs of records: 1.5's segments, or before it one segment of the whole-dataset files."""
        return self.segments or (Segment(0, self.count, dict(self.index), tuple(
            FileEntry(f.file, f.bytes, f.sha256) for f in self.fields), self.checksums, self.warnings),)

    @property
    def has_checksums(self) -> bool:
        """Whether every record has its CRC-32 stored (1.3 on; optional before 1.5)."""
        return all(s.checksums is not None for s in self.index_segments)

    @property
    def record_parts(self) -> tuple[Part, ...]:
        """Each run of records with the compile options that made it (one part unless appended or merged)."""
        return self.parts or (Part(0, self.count, self.compile),)

    @property
    def skipped_count(self) -> int:
        return self.skipped_list.count if self.skipped_list else len(self.skipped)

    @property
    def record_shape(self) -> tuple[int, int, int]:
        return (self.height, self.width, CHANNELS)

    @property
    def record_bytes(self) -> int:
        return self.height * self.width * CHANNELS

    @property
    def labeled(self) -> bool:
        return bool(self.classes)

    @property
    def files(self) -> list[FileEntry]:
        """Every file the manifest names, with its size and SHA-256."""
        tables = list({t.file: FileEntry(t.file, t.bytes, t.sha256) for t in self.shard_tables}.values())
        if self.segments:
            return [*self.shards, *tables, *(f for s in self.segments for f in s.files),
                    *filter(None, [self.skipped_list])]
        return [*self.shards, *tables, *self.index.values(), *self.fields,
                *filter(None, [self.skipped_list, self.warnings, self.checksums])]

    @property
    def fingerprint(self) -> str:
        """Which dataset this is: the manifest names every file's SHA-256, so equal manifests mean equal data."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def to_json(self) -> str:
        # Before 1.4, and while the shards' digests are in no table yet (`with_shard_table` puts them in one),
        # the shards are listed inline, as 1.3 does: what a writer that writes no table file still produces.
        # Likewise (1.5) the index is in segments only once `with_segment` made them; before, it is 1.4's.
        tabled = bool(self.shard_tables) and minor_version(self.version) >= 4
        segmented = tabled and bool(self.segments) and minor_version(self.version) >= 5
        version = self.version if segmented or minor_version(self.version) < 4 else "1.4" if tabled else "1.3"
        doc = {
            "format": FORMAT_NAME,
            "version": version,
            "record": {"shape": list(self.record_shape), "dtype": "uint8", "layout": "HWC",
                       "color": "RGB", "bytes": self.record_bytes},
            "count": self.count,
            "records_per_shard": self.records_per_shard,
            "classes": list(self.classes),
            **({"shard_tables": [asdict(t) for t in self.shard_tables]} if tabled else
               {"shards": [asdict(s) for s in self.shards]}),
            **({"segments": [s.to_dict() for s in self.segments]} if segmented else
               {"index": {k: asdict(v) for k, v in self.index.items()}}),
            "skipped": [dict(s) for s in self.skipped],
            "compile": self.compile,
        }
        if version != "1.0":
            doc["fields"] = [_spec_dict(f) if segmented else f.to_dict() for f in self.fields]
        if self.skipped_list is not None:
            doc["skipped_list"] = asdict(self.skipped_list)
        if self.warnings is not None and not segmented:
            doc["warnings"] = asdict(self.warnings)
        if self.checksums is not None and not segmented:
            doc["checksums"] = asdict(self.checksums)
        if self.dataset_version != 1:
            doc["dataset_version"] = self.dataset_version
        if self.parts:
            doc["parts"] = [asdict(p) for p in self.parts]
        if minor_version(version) >= 2:
            doc[SEAL_KEY] = _SEAL_PLACEHOLDER
            return sealed(json.dumps(doc, indent=1, ensure_ascii=True) + "\n")
        return json.dumps(doc, indent=1, ensure_ascii=True) + "\n"


def _spec_dict(f: FieldEntry) -> dict[str, Any]:
    """(1.5) A field as the manifest lists it: what it is; its files are the segments'."""
    doc = f.to_dict()
    for key in _FILE_KEYS:
        del doc[key]
    return doc


def minor_version(version: str) -> int:
    """The MINOR part of a 'MAJOR.MINOR' version this module has checked or written."""
    return int(version.split(".")[1])


def sealed(text: str) -> str:
    """A manifest's text (ASCII, its 'manifest_sha256' still 64 '0's) with its checksum filled in:
    the SHA-256 of the text as it stands, so that putting the zeros back gives it again."""
    digest = hashlib.sha256(text.encode("ascii")).hexdigest()
    key = json.dumps(SEAL_KEY)  # only the key can be followed by ': "' (quotes inside strings are escaped)
    return text.replace(f'{key}: "{_SEAL_PLACEHOLDER}"', f'{key}: "{digest}"', 1)


def seal_problem(text: bytes, manifest: Manifest, root: Any, name: str = MANIFEST_FILE) -> str | None:
    """Why a manifest's bytes (of the file `name`: manifest.json or a version's) do not match their own
    checksum (1.2 on; None when they do, or for an older version, which has none): an edit by hand, or damage
    the sizes and digests it lists miss."""
    if minor_version(manifest.version) < 2:
        return None
    seal = json.loads(text)[SEAL_KEY].encode("ascii")  # parse_manifest checked it: 64 lowercase hex digits
    if text.count(seal) != 1:
        return f"{_at(root, name)}: its checksum {SEAL_KEY!r} appears {text.count(seal)} times in it"
    if hashlib.sha256(text.replace(seal, _SEAL_PLACEHOLDER.encode())).hexdigest() != seal.decode():
        return (f"{_at(root, name)}: its content does not match its own checksum ({SEAL_KEY!r}): "
                "it was changed after it was written")
    return None


# ----------------------------------------------------------------------------- layout helpers

def shard_file(shard: int) -> str:
    """The relative path the writer gives shard number `shard`."""
    return f"{SHARD_DIR}/{shard:05d}.bin"


def version_file(version: int) -> str:
    """(1.3) The relative path of version `version`'s manifest."""
    return f"{VERSIONS_DIR}/{version:0{VERSION_DIGITS}d}.json"


def version_of(name: str) -> int | None:
    """(1.3) The version number a file name of `versions/` gives (`00000002.json` -> 2), or None
    when the name is not one dsc gives a version's manifest (a temporary, a user's file)."""
    stem = name.removesuffix(".json")
    if len(stem) != VERSION_DIGITS or not stem.isdigit() or not stem.isascii() or name == stem:
        return None
    return int(stem) if int(stem) >= 1 else None


def append_folder(tag: str) -> str:
    """(1.3) The folder an append writes its files in: `appends/<tag>`, `tag` APPEND_TAG_HEX hex digits."""
    return f"{APPENDS_DIR}/{tag}"


def build_folder(tag: str) -> str:
    """(1.3) The folder a compile into object storage writes its files in: `builds/<tag>`, `tag` as an append's."""
    return f"{BUILDS_DIR}/{tag}"


def _is_append_tag(tag: str) -> bool:
    return len(tag) == APPEND_TAG_HEX and all(c in "0123456789abcdef" for c in tag)


def shard_count(count: int, records_per_shard: int) -> int:
    return -(-count // records_per_shard)


def shard_records(count: int, records_per_shard: int) -> list[int]:
    """Records in each shard: `records_per_shard` each, the last one the remainder."""
    full, rest = divmod(count, records_per_shard)
    return [records_per_shard] * full + ([rest] if rest else [])


def shard_segments(start: int, stop: int, records_per_shard: int) -> Iterator[tuple[int, int, int]]:
    """Split records [start, stop) into (shard, first, last) pieces, one per shard touched."""
    while start < stop:
        shard, first = divmod(start, records_per_shard)
        n = min(stop - start, records_per_shard - first)
        yield shard, first, first + n
        start += n


def locate(record, records_per_shard: int):
    """(shard, position in shard) of a record, or of each record of an index array."""
    return divmod(record, records_per_shard)


def record_offset(record: int, records_per_shard: int, record_bytes: int) -> tuple[int, int]:
    """(shard, byte offset in the shard file) of a record: records are back to back, no header."""
    shard, pos = locate(record, records_per_shard)
    return shard, pos * record_bytes


def open_shard(path: Path, records: int, record_shape: tuple[int, int, int], mode: str = "r") -> np.memmap:
    """Map one shard as a uint8 array [records, H, W, 3]."""
    return np.memmap(path, dtype=RECORD_DTYPE, mode=mode, shape=(records, *record_shape))


# ----------------------------------------------------------------------------- payloads (what a writer writes)

def file_entry(name: str, payload: bytes) -> FileEntry:
    """The manifest entry of a file with these bytes."""
    return FileEntry(name, len(payload), hashlib.sha256(payload).hexdigest())


def encode_sources(sources: list[str]) -> tuple[np.ndarray, bytes]:
    """Source paths → (offsets [n + 1], concatenated bytes), keeping undecodable names exact."""
    blobs = [os.fsencode(s) for s in sources]
    offsets = np.zeros(len(blobs) + 1, dtype=OFFSET_DTYPE)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return offsets, b"".join(blobs)


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_whole_source(source: str) -> bool:
    """Whether a source path names its image on its own, not under `compile.source_root`: a URL
    (`s3://bucket/key`) or an absolute path, as an append or merge writes the sources of a part whose root
    and the dataset's are not both local folders (no relative path leads from the one to the other)."""
    return source.startswith("/") or _URL.match(source) is not None


def source_location(root: str, source: str) -> str:
    """Where a record's source is: `source` (as `sources.bin` holds it) under `root`, the dataset's
    `compile.source_root` (a folder, or an `s3://` URL: joined without folding its '//'), unless it is whole."""
    if is_whole_source(source):
        return source
    if "://" in root:
        return f"{root.rstrip('/')}/{source}"
    return os.path.join(root, source)


def index_payloads(labels: np.ndarray, sizes: np.ndarray, sources: list[str]) -> dict[str, tuple[str, bytes]]:
    """The index files' (file name, bytes), keyed as the manifest's "index"."""
    return encoded_index_payloads(labels, sizes, *encode_sources(sources))


def joined_sources(pieces: Iterable[tuple[np.ndarray, bytes]]) -> tuple[np.ndarray, bytes]:
    """(offsets, bytes) of several runs of records' source paths, one after the other, each given as
    its own (offsets [n + 1] from 0, bytes): what an append or a merge writes without decoding a name."""
    offsets, blobs, end = [np.zeros(1, OFFSET_DTYPE)], [], 0
    for piece_offsets, blob in pieces:
        offsets.append(np.asarray(piece_offsets[1:], OFFSET_DTYPE) + np.uint64(end))
        blobs.append(bytes(blob))
        end += len(blob)
    return np.concatenate(offsets), b"".join(blobs)


def encoded_index_payloads(labels: np.ndarray, sizes: np.ndarray, offsets: np.ndarray,
                           blob: bytes) -> dict[str, tuple[str, bytes]]:
    """`index_payloads` of source paths already encoded (`encode_sources`, `joined_sources`)."""
    payloads = {"labels": np.ascontiguousarray(labels, LABEL_DTYPE).tobytes(),
                "sizes": np.ascontiguousarray(sizes, SIZE_DTYPE).tobytes(),
                "source_offsets": np.ascontiguousarray(offsets, OFFSET_DTYPE).tobytes(), "sources": blob}
    return {key: (INDEX_FILES[key], payload) for key, payload in payloads.items()}


def field_payload(spec: FieldEntry, values: np.ndarray) -> tuple[str, bytes]:
    """A field's (file name, bytes): its values `[count, *shape]` in its kind's dtype."""
    problem = field_name_problem(spec.name)
    if problem:
        raise ValueError(problem)
    return field_file(spec.name), np.ascontiguousarray(values, spec.dtype).tobytes()


def record_crc(data) -> int:
    """A record's checksum (1.3, "Record checksums"): zlib's CRC-32 of its bytes (a C-contiguous buffer)."""
    return _crc32(data)


def record_checksums(data, record_bytes: int) -> list[int]:
    """CRC-32 (`record_crc`) of each whole record in `data` (bytes of records back to back)."""
    view = memoryview(data).cast("B")
    return [record_crc(view[at:at + record_bytes]) for at in range(0, len(view) - record_bytes + 1, record_bytes)]


def with_shard_table(manifest: Manifest, name: str, base: Manifest | None = None,
                     kept: int = 0) -> tuple[Manifest, bytes]:
    """(1.4) `manifest` with its shards' SHA-256s in shard tables instead of inline, and the bytes of the
    new table file `name` (to write before the manifest). Shards [0, kept) keep the rows `base` (the
    version an append grows) has for them in its tables; the others get rows of the new file, in order."""
    kept = kept if base is not None and base.shard_tables else 0
    tables = [replace(t, count=min(t.count, kept - t.first)) for t in (base.shard_tables if kept else ())
              if t.first < kept]
    rows = manifest.shards[kept:]
    payload = b"".join(bytes.fromhex(s.sha256) for s in rows)
    entry = file_entry(name, payload)
    for k, shard in enumerate(rows, kept):
        folder, _, base_name = shard.file.rpartition("/")
        if base_name != shard_file(k).rsplit("/", 1)[1]:
            raise ValueError(f"shard {k} is written as {shard.file!r}, not by the name dsc gives it")
        if tables and tables[-1].folder == folder and tables[-1].file == name:
            tables[-1] = replace(tables[-1], count=tables[-1].count + 1)
        else:
            tables.append(ShardTable(name, entry.bytes, entry.sha256, k, 1, k - kept, folder))
    return replace(manifest, shard_tables=tuple(tables)), payload


def count_labels(labels: np.ndarray, classes: int) -> np.ndarray:
    """(1.5) How many of `labels` are -1, then each label 0 .. classes - 1 ([classes + 1]), SCAN_ITEMS at a time."""
    counts = np.zeros(classes + 1, np.int64)
    for start in range(0, len(labels), SCAN_ITEMS):
        counts += np.bincount(np.asarray(labels[start:start + SCAN_ITEMS], np.int64) + 1, minlength=classes + 1)
    return counts


def class_counts_payload(counts: np.ndarray) -> tuple[str, bytes]:
    """(1.5) A segment's class counts file's (file name, bytes), from `count_labels` of its records' labels."""
    return CLASS_COUNTS_FILE, np.ascontiguousarray(counts, COUNT_DTYPE).tobytes()


def with_segment(manifest: Manifest, class_counts: FileEntry | None, kept: Sequence[Segment] = ()) -> Manifest:
    """(1.5) `manifest` with its index in segments: `kept` (a 1.5 version's, records 0 .. c - 1, listed by
    their names unchanged), then one new segment of the files `manifest` names as its index, fields, checksums
    and decoder warnings, which hold records c .. count - 1 only; `class_counts` is that segment's counts file."""
    first = sum(s.count for s in kept)
    if kept and (kept[0].first != 0 or any(a.first + a.count != b.first for a, b in zip(kept, kept[1:]))
                 or any(s.checksums is None or s.class_counts is None for s in kept)):
        raise ValueError("kept segments must follow each other from record 0, each with its checksums and counts")
    if manifest.checksums is None or class_counts is None:
        raise ValueError("a segment has its records' checksums and class counts")
    new = Segment(first, manifest.count - first, dict(manifest.index),
                  tuple(FileEntry(f.file, f.bytes, f.sha256) for f in manifest.fields),
                  manifest.checksums, manifest.warnings, class_counts)
    fields = tuple(replace(f, file="", bytes=0, sha256="") for f in manifest.fields)
    return replace(manifest, version=FORMAT_VERSION, segments=(*kept, new), index={}, fields=fields,
                   checksums=None, warnings=None)


def checksums_payload(crcs: np.ndarray) -> tuple[str, bytes]:
    """The checksums file's (file name, bytes) (1.3): each record's CRC-32, in record order."""
    return CHECKSUMS_FILE, np.ascontiguousarray(crcs, CHECKSUM_DTYPE).tobytes()


def warnings_payload(counts: np.ndarray) -> tuple[str, bytes]:
    """The warnings file's (file name, bytes) (1.2): each record's count of decoder warnings."""
    return WARNINGS_FILE, np.ascontiguousarray(np.minimum(counts, np.iinfo(WARNING_DTYPE).max),
                                               WARNING_DTYPE).tobytes()


# ----------------------------------------------------------------------------- skip list (1.1)

def skip_list_payload(skipped: list[dict[str, str]]) -> bytes:
    """The skip list file's bytes: one JSON object a line, in the order given."""
    return "".join(json.dumps({"source": s["source"], "reason": s["reason"]}, ensure_ascii=True) + "\n"
                   for s in skipped).encode("ascii")


def parse_skip_list(text: bytes, entry: SkipListEntry, root: Any) -> list[dict[str, str]]:
    """The skip list file's lines, checked against its manifest entry (`text`: up to entry.bytes + 1 bytes)."""
    path = _at(root, entry.file)
    if len(text) != entry.bytes:
        raise DatasetError(f"{path}: file is {len(text)} bytes, the manifest says {entry.bytes}; "
                           "the dataset is damaged")
    lines = text.splitlines()
    if len(lines) != entry.count:
        raise DatasetError(f"{path}: {len(lines)} lines, the manifest says {entry.count} skipped sources")
    skipped = []
    for number, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}: line {number} is not valid JSON ({e})") from e
        if not _is_skip(item, extra_ok=False):
            raise DatasetError(f"{path}: line {number} must be a {{\"source\": str, \"reason\": str}} object")
        skipped.append(item)
    return skipped


def _is_skip(item: Any, extra_ok: bool) -> bool:
    return (isinstance(item, dict) and (set(item) >= {"source", "reason"} if extra_ok else
                                        set(item) == {"source", "reason"})
            and isinstance(item["source"], str) and isinstance(item["reason"], str))


# ----------------------------------------------------------------------------- validation
# Validation reads nothing itself: the store that holds the dataset (`dsc.storage`) hands in the
# manifest's bytes, each named file's size (`SizeOf`) and an index file's values (`ValuesOf`).

ReadFile = Callable[[str, int], bytes]  # (file name, limit) -> at most `limit` bytes of the stored file
SizeOf = Callable[[str, str], int]  # (file name, what names it) -> the stored file's size in bytes
ValuesOf = Callable[[str, np.dtype, int], Iterable[np.ndarray]]  # the first n values, piece by piece (each
# piece valid until the next is asked for: the store may read them all into one buffer)


_MANIFEST_KEYS_1_0 = {"format", "version", "record", "count", "records_per_shard", "classes",
                      "shards", "index", "skipped", "compile"}
_MANIFEST_KEYS = {0: _MANIFEST_KEYS_1_0, 1: _MANIFEST_KEYS_1_0 | {"fields"},  # required, by MINOR version
                  2: _MANIFEST_KEYS_1_0 | {"fields", SEAL_KEY}}
_MANIFEST_KEYS[3] = _MANIFEST_KEYS[2]
_MANIFEST_KEYS[4] = _MANIFEST_KEYS[3] - {"shards"} | {"shard_tables"}  # 1.4: the shards' digests in table files
_OPTIONAL_KEYS = {0: frozenset(), 1: frozenset({"skipped_list"}),  # optional, by MINOR version
                  2: frozenset({"skipped_list", "warnings"}),
                  3: frozenset({"skipped_list", "warnings", "dataset_version", "parts", "checksums"})}
_OPTIONAL_KEYS[4] = _OPTIONAL_KEYS[3]
_MANIFEST_KEYS[5] = _MANIFEST_KEYS[4] - {"index"} | {"segments"}  # 1.5: the index in segments
_OPTIONAL_KEYS[5] = _OPTIONAL_KEYS[4] - {"warnings", "checksums"}  # a segment's, from 1.5 on
_SEGMENT_KEYS = {"first", "count", "index", "fields", "checksums", "class_counts"}  # and optional "warnings"
_FIELD_SPEC_KEYS = {"name", "kind", "dtype", "shape", "classes"}  # 1.5: a field's files are the segments'
_TABLE_KEYS = {"file", "bytes", "sha256", "first", "count", "row", "folder"}
_PART_KEYS = {"first", "count", "compile"}
_RECORD_KEYS = {"shape", "dtype", "layout", "color", "bytes"}
_FILE_KEYS = {"file", "bytes", "sha256"}
_FIELD_KEYS = _FILE_KEYS | {"name", "kind", "dtype", "shape", "classes"}


def _at(root: Any, name: str) -> str:
    """How messages name file `name` of the dataset at `root` (a path; later a URL)."""
    return f"{str(root).rstrip('/')}/{name}"


_parsing: contextvars.ContextVar[str] = contextvars.ContextVar("the manifest file parsed", default=MANIFEST_FILE)


def _fail(root: Any, what: str) -> DatasetError:
    """A refusal of the manifest being parsed (`parse_manifest`'s `name`: manifest.json or a version's)."""
    return DatasetError(f"{_at(root, _parsing.get())}: {what}")


def _expect(root: Path, doc: dict, key: str, kind: type | tuple[type, ...], where: str = "") -> Any:
    value = doc[key]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _fail(root, f"{where}{key!r} must be {names}, found {type(value).__name__} {quoted(value, 60)}")
    return value


def _expect_int(root: Path, doc: dict, key: str, low: int, high: int, where: str = "") -> int:
    value = _expect(root, doc, key, int, where)
    if not low <= value <= high:
        raise _fail(root, f"{where}{key!r} = {value} is outside [{low}, {high}]")
    return value


def _expect_keys(root: Path, doc: Any, required: set[str], where: str, extra_ok: bool,
                 optional: frozenset[str] = frozenset()) -> None:
    if not isinstance(doc, dict):
        raise _fail(root, f"{where or 'the manifest'} must be a JSON object, found {type(doc).__name__}")
    missing = required - doc.keys()
    if missing:
        raise _fail(root, f"{where}missing key(s) {sorted(missing)}")
    unknown = doc.keys() - required - optional
    if unknown and not extra_ok:
        raise _fail(root, f"{where}unknown key(s) {sorted(unknown)} for version {doc.get('version', FORMAT_VERSION)}")


def _expect_hex_digest(root: Path, doc: dict, key: str, where: str) -> str:
    value = _expect(root, doc, key, str, where)
    if not _is_hex_digest(value):
        raise _fail(root, f"{where}{key!r} must be 64 lowercase hex digits")
    return value


def _is_hex_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_version(root: Path, doc: dict) -> int:
    """Return the MINOR version (one newer than ours may add keys; they are then allowed)."""
    if doc.get("format") != FORMAT_NAME:
        raise _fail(root, f"'format' must be {FORMAT_NAME!r}, found {quoted(doc.get('format'), 60)}")
    version = doc.get("version")
    parts = version.split(".") if isinstance(version, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise _fail(root, f"'version' must be 'MAJOR.MINOR', found {quoted(version, 60)}")
    major, minor = (int(p) for p in parts)
    ours_major, ours_minor = (int(p) for p in FORMAT_VERSION.split("."))
    if major != ours_major:
        raise UnsupportedVersionError(
            f"{root}: dataset format version {version} is not supported by this dsc, which reads "
            f"{ours_major}.x; recompile the dataset or use a dsc that reads version {major}.x")
    return minor


def file_name_problem(name: Any) -> str | None:
    """Why `name` cannot name a file of a dataset (a plain relative '/'-separated path inside it), or None."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name \
            or not name.isprintable():
        return f"has an invalid file name {quoted(name, 80)}"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return f"file name {quoted(name, 80)} must be a plain relative path without '.' or '..'"
    return None


def names_this_format(text: bytes) -> bool:
    """Whether manifest bytes name this format (a cheap check, not validation: an image folder
    may hold a manifest.json of its own)."""
    try:
        return json.loads(text).get("format") == FORMAT_NAME
    except (ValueError, AttributeError, RecursionError):
        return False


def is_dataset_file_name(name: str) -> bool:
    """Whether dsc gives a dataset's file this '/'-path: the manifest, an index file, the skip list,
    the decoder warnings, the record checksums, a shard or a field (what a build of dsc may hold, before its
    manifest lists it)."""
    if name in (MANIFEST_FILE, SKIP_LIST_FILE, WARNINGS_FILE, CHECKSUMS_FILE, SHARD_TABLE_FILE, CLASS_COUNTS_FILE,
                *INDEX_FILES.values()):
        return True
    folder, _, base = name.partition("/")
    if folder == VERSIONS_DIR:
        return version_of(base) is not None
    if folder in (APPENDS_DIR, BUILDS_DIR):  # an append's, a bucket compile's: <folder>/<tag>/<a build's, no manifest>
        tag, _, rest = base.partition("/")
        return _is_append_tag(tag) and rest != MANIFEST_FILE and is_dataset_file_name(rest)
    stem = base.removesuffix(".bin")
    if folder == SHARD_DIR:
        return stem.isdigit() and shard_file(int(stem)) == name
    return folder == FIELD_DIR and field_name_problem(stem) is None and field_file(stem) == name


def is_dataset_folder_name(path: str) -> bool:
    """Whether dsc gives a dataset's folder this '/'-path: `shards`, `fields`, (1.3) `versions`, `appends`,
    an append's `appends/<tag>` (a bucket compile's `builds/<tag>`) and the `shards` and `fields` inside it."""
    parts = path.split("/")
    if parts[0] in (APPENDS_DIR, BUILDS_DIR) and len(parts) > 1:
        return _is_append_tag(parts[1]) and len(parts) <= 3 and (len(parts) == 2 or parts[2] in (SHARD_DIR, FIELD_DIR))
    return path in (SHARD_DIR, FIELD_DIR, VERSIONS_DIR, APPENDS_DIR, BUILDS_DIR)


def listed_files(text: bytes) -> set[str]:
    """The file names that manifest bytes of this format list, unchecked: what a writer may delete
    with a dataset it replaced even when part of it is gone (not validation; see `parse_manifest`)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return set()
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        return set()

    return {e["file"] for e in _declared_entries(doc)
            if isinstance(e, dict) and file_name_problem(e.get("file")) is None} \
        | set(_declared_shards(doc))


def declared_shard_tables(text: bytes) -> dict[str, FileEntry]:
    """(1.4) Each shard table that manifest bytes name, with its declared size and SHA-256, unchecked: what lets
    a cache keep one copy a node of it (checked against them) while `parse_manifest` asks for its rows."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    tables = _items(doc.get("shard_tables")) if isinstance(doc, dict) else []
    return {t["file"]: FileEntry(t["file"], t["bytes"], t["sha256"]) for t in tables
            if isinstance(t, dict) and file_name_problem(t.get("file")) is None and isinstance(t.get("bytes"), int)
            and not isinstance(t.get("bytes"), bool) and _is_hex_digest(t.get("sha256"))}


def _declared_entries(doc: dict) -> list:
    """Every file entry of manifest JSON (its shards' aside), unchecked: (1.5) the segments' among them."""
    entries = [*_items(doc.get("shards")), *_items(doc.get("shard_tables")), *_items(doc.get("index")),
               *_items(doc.get("fields")), doc.get("skipped_list"), doc.get("warnings"), doc.get("checksums")]
    for seg in _items(doc.get("segments")):
        if isinstance(seg, dict):
            entries += [*_items(seg.get("index")), *_items(seg.get("fields")), seg.get("checksums"),
                        seg.get("warnings"), seg.get("class_counts")]
    return entries


def _items(value: Any) -> list:
    return list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []


def _declared_shards(doc: dict) -> dict[str, int]:
    """(1.4) Each shard file the shard tables of manifest JSON name, with the size its record count gives,
    unchecked (see `listed_files`)."""
    try:
        count, per_shard, record_bytes = doc["count"], doc["records_per_shard"], doc["record"]["bytes"]
        sizes = {}
        for t in _items(doc.get("shard_tables")):
            table = ShardTable(t["file"], 0, "", int(t["first"]), int(t["count"]), 0, t["folder"])
            for k in range(table.first, min(table.first + table.count, shard_count(int(count), int(per_shard)))):
                sizes[table.file_of(k)] = min(int(per_shard), int(count) - k * int(per_shard)) * int(record_bytes)
        return {name: size for name, size in sizes.items() if file_name_problem(name) is None}
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
        return {}


def declared_version(text: bytes) -> int:
    """The dataset version manifest bytes declare (`dataset_version`), unchecked; 1 where absent or unreadable
    (a manifest made before versions is version 1)."""
    try:
        value = json.loads(text).get("dataset_version", 1)
    except (ValueError, AttributeError, RecursionError):
        return 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


@functools.lru_cache(maxsize=4)  # asked once per file of a dataset: parse its manifest once
def declared_sizes(text: bytes) -> dict[str, int]:
    """Each listed file's size as manifest bytes declare it, unchecked: what lets a cache answer a
    size without asking the bucket, before `parse_manifest` has validated anything (a wrong answer
    only makes validation fail; it never lets a wrong file through)."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {**_declared_shards(doc), **{
        e["file"]: e["bytes"] for e in _declared_entries(doc)
        if isinstance(e, dict) and file_name_problem(e.get("file")) is None
        and isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool)}}


class _Stored(NamedTuple):
    root: Any  # names the dataset in messages
    size_of: SizeOf
    seen: dict[str, str]  # file name -> the entry that listed it: each file of a dataset has one entry
    is_shard: Callable[[str], bool] = lambda name: False  # (1.4) whether a shard table names this file


def _file_entry(stored: _Stored, doc: Any, where: str, expected_bytes: int | None, extra_ok: bool,
                entry_keys: set[str] = _FILE_KEYS) -> dict:
    root = stored.root
    _expect_keys(root, doc, entry_keys, f"{where}: ", extra_ok)
    problem = file_name_problem(doc["file"])
    if problem:
        raise _fail(root, f"{where} {problem}")
    actual = stored.size_of(doc["file"], where)
    size = _expect_int(root, doc, "bytes", 0, 1 << 50, f"{where}: ")
    _expect_hex_digest(root, doc, "sha256", f"{where}: ")
    if expected_bytes is not None and size != expected_bytes:
        raise _fail(root, f"{where}: declares {size} bytes, but its record count needs {expected_bytes}")
    if actual != size:
        raise DatasetError(f"{_at(root, doc['file'])}: file is {actual} bytes, the manifest says {size} "
                           f"({'truncated' if actual < size else 'extended'}); the dataset is damaged")
    if stored.is_shard(doc["file"]):
        raise _fail(root, f"{where}: file {doc['file']!r} is also a shard file of the shard tables")
    if doc["file"] in stored.seen:
        raise _fail(root, f"{where}: file {doc['file']!r} is listed twice: also used elsewhere, by "
                          f"{stored.seen[doc['file']]}")
    stored.seen[doc["file"]] = where
    return doc


def _read_manifest(text: bytes, root: Any) -> dict:
    if len(text) > MAX_MANIFEST_BYTES:
        raise _fail(root, f"more than the {MAX_MANIFEST_BYTES} bytes a manifest may have")
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, or a 5000-digit number
        raise _fail(root, f"not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise _fail(root, f"must be a JSON object, found {type(doc).__name__}")
    try:  # "\ud800" is valid JSON but not text: refuse it here rather than fail later when printed
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise _fail(root, f"holds a lone surrogate escape ({e.object[e.start:e.end]!r}), not valid Unicode") from e
    return doc


def parse_manifest(text: bytes, root: Any, size_of: SizeOf, read: ReadFile | None = None,
                   name: str = MANIFEST_FILE) -> Manifest:
    """Validate manifest.json's bytes (at most MAX_MANIFEST_BYTES + 1 of them, read by the store)
    and the size of every file it names (`size_of`); `root` names the dataset in messages, `name` the
    manifest's file (a version's: `versions/N.json`). A 1.4 manifest's shard tables are read (`read`)
    and checked against their SHA-256 before any row is used."""
    parsing = _parsing.set(name)
    try:
        return _parse_manifest(text, root, size_of, read)
    finally:
        _parsing.reset(parsing)


def _parse_manifest(text: bytes, root: Any, size_of: SizeOf, read: ReadFile | None) -> Manifest:
    doc, stored = _read_manifest(text, root), _Stored(root, size_of, {})
    minor = _check_version(root, doc)
    newer = minor > max(_MANIFEST_KEYS)
    known = min(minor, max(_MANIFEST_KEYS))
    _expect_keys(root, doc, _MANIFEST_KEYS[known], "", newer, _OPTIONAL_KEYS[known])

    record = doc["record"]
    _expect_keys(root, record, _RECORD_KEYS, "record: ", newer)
    shape = _expect(root, record, "shape", list, "record: ")
    if len(shape) != 3 or any(isinstance(s, bool) or not isinstance(s, int) for s in shape) \
            or shape[2] != CHANNELS or not all(1 <= s <= MAX_SIDE for s in shape[:2]):
        raise _fail(root, f"record: 'shape' must be [H, W, {CHANNELS}] with 1 <= H, W <= {MAX_SIDE}, "
                          f"found {quoted(shape, 60)}")
    for key, want in (("dtype", "uint8"), ("layout", "HWC"), ("color", "RGB")):
        if record[key] != want:
            raise _fail(root, f"record: {key!r} must be {want!r}, found {quoted(record[key], 60)}")
    height, width = shape[0], shape[1]
    record_bytes = height * width * CHANNELS
    if isinstance(record["bytes"], bool) or not isinstance(record["bytes"], int) or record["bytes"] != record_bytes:
        raise _fail(root, f"record: 'bytes' = {quoted(record['bytes'], 30)} but shape {shape} needs {record_bytes}")

    count = _expect_int(root, doc, "count", 1, MAX_RECORDS)
    per_shard = _expect_int(root, doc, "records_per_shard", 1, MAX_RECORDS)
    classes = _expect(root, doc, "classes", list)
    if not all(isinstance(c, str) and c for c in classes) or len(set(classes)) != len(classes):
        raise _fail(root, "'classes' must be a list of distinct, non-empty strings")

    if minor >= 4:
        shards, stored = _parse_shard_tables(stored, doc, count, per_shard, record_bytes, newer, read)
    else:
        shards = _parse_shards(stored, doc, count, per_shard, record_bytes, newer)

    segmented = minor >= 5
    fields = _parse_fields(stored, doc.get("fields", []), count, newer, with_files=not segmented)
    index = {} if segmented else _parse_index(stored, doc["index"], count, "index", newer)
    segments = _parse_segments(stored, doc, count, len(classes), fields, newer) if segmented else ()

    if minor >= 2:
        _expect_hex_digest(root, doc, SEAL_KEY, "")
    skipped = _expect(root, doc, "skipped", list)
    if not all(_is_skip(s, newer) for s in skipped):
        raise _fail(root, "'skipped' must be a list of {\"source\": str, \"reason\": str} objects")
    return Manifest(height=height, width=width, count=count, records_per_shard=per_shard,
                    classes=tuple(classes), shards=shards, index=index,
                    skipped=tuple({"source": s["source"], "reason": s["reason"]} for s in skipped),
                    compile=_expect(root, doc, "compile", dict), fields=fields,
                    version=doc["version"], skipped_list=_skip_list_entry(stored, doc, newer),
                    warnings=_warnings_entry(stored, doc, count, newer),
                    dataset_version=_expect_int(root, doc, "dataset_version", 1, MAX_DATASET_VERSION)
                    if "dataset_version" in doc else 1,
                    parts=_parse_parts(root, doc.get("parts", []), count, newer),
                    checksums=_checksums_entry(stored, doc, count, newer),
                    shard_tables=shards.tables if isinstance(shards, ShardList) else (), segments=segments)


def _parse_index(stored: _Stored, index_doc: Any, count: int, where: str, newer: bool) -> dict[str, FileEntry]:
    """The four index files of `count` records (the whole dataset's before 1.5, a segment's from 1.5 on)."""
    _expect_keys(stored.root, index_doc, set(INDEX_FILES), f"{where}: ", newer)
    index_bytes = {"labels": count * LABEL_DTYPE.itemsize, "sizes": count * 2 * SIZE_DTYPE.itemsize,
                   "source_offsets": (count + 1) * OFFSET_DTYPE.itemsize, "sources": None}
    index = {}
    for key in INDEX_FILES:
        entry = _file_entry(stored, index_doc[key], f"{where}.{key}", index_bytes[key], newer)
        index[key] = FileEntry(entry["file"], entry["bytes"], entry["sha256"])
    return index


def _parse_segments(stored: _Stored, doc: dict, count: int, classes: int, fields: tuple[FieldEntry, ...],
                    newer: bool) -> tuple[Segment, ...]:
    """1.5: the index segments, in record order, covering every record exactly once; each segment's files
    sized by its own record count (their values are `check_index`'s, their SHA-256s verification's)."""
    root = stored.root
    segments_doc = _expect(root, doc, "segments", list)
    if not segments_doc or len(segments_doc) > count:
        raise _fail(root, f"'segments' has {len(segments_doc)} segment(s) for {count} record(s)")
    segments, first = [], 0
    for i, seg in enumerate(segments_doc):
        where = f"segments[{i}]"
        _expect_keys(root, seg, _SEGMENT_KEYS, f"{where}: ", newer, frozenset({"warnings"}))
        if _expect_int(root, seg, "first", 0, MAX_RECORDS, f"{where}: ") != first:
            raise _fail(root, f"{where}: 'first' = {seg['first']}, expected {first} (segments follow each other)")
        n = _expect_int(root, seg, "count", 1, count - first, f"{where}: ")
        index = _parse_index(stored, seg["index"], n, f"{where}.index", newer)
        files = _expect(root, seg, "fields", list, f"{where}: ")
        if len(files) != len(fields):
            raise _fail(root, f"{where}: 'fields' lists {len(files)} file(s), the dataset has {len(fields)} field(s)")
        field_files = tuple(_entry(stored, e, f"{where}.fields[{k}] ({f.name})",
                                   n * f.dtype.itemsize * (f.shape[0] if f.shape else 1), newer)
                            for k, (e, f) in enumerate(zip(files, fields)))
        checksums = _entry(stored, seg["checksums"], f"{where}.checksums", n * CHECKSUM_DTYPE.itemsize, newer)
        warnings = _entry(stored, seg["warnings"], f"{where}.warnings", n * WARNING_DTYPE.itemsize, newer) \
            if "warnings" in seg else None
        counts = _entry(stored, seg["class_counts"], f"{where}.class_counts", None, newer)
        if counts.bytes % COUNT_DTYPE.itemsize or not 1 <= counts.bytes // COUNT_DTYPE.itemsize <= classes + 1:
            raise _fail(root, f"{where}.class_counts: {counts.bytes} bytes is not {COUNT_DTYPE.itemsize} bytes "
                              f"for each of 1 .. {classes + 1} labels (-1 and the dataset's {classes} classes)")
        segments.append(Segment(first, n, index, field_files, checksums, warnings, counts))
        first += n
    if first != count:
        raise _fail(root, f"'segments' cover {first} record(s), the dataset has {count}")
    return tuple(segments)


def _entry(stored: _Stored, doc: Any, where: str, expected_bytes: int | None, newer: bool) -> FileEntry:
    entry = _file_entry(stored, doc, where, expected_bytes, newer)
    return FileEntry(entry["file"], entry["bytes"], entry["sha256"])


def _parse_shards(stored: _Stored, doc: dict, count: int, per_shard: int, record_bytes: int,
                  newer: bool) -> tuple[ShardEntry, ...]:
    """1.0-1.3: every shard listed in the manifest, with its size, SHA-256 and record count."""
    root = stored.root
    shards_doc = _expect(root, doc, "shards", list)
    if len(shards_doc) != shard_count(count, per_shard):  # compared before any per-shard list is built
        raise _fail(root, f"'shards' lists {len(shards_doc)} shard(s), but {count} records at "
                          f"{per_shard} per shard need {shard_count(count, per_shard)}")
    shards = []
    for i, (entry, records) in enumerate(zip(shards_doc, shard_records(count, per_shard))):
        where = f"shards[{i}]"
        _file_entry(stored, entry, where, records * record_bytes, newer, _FILE_KEYS | {"records"})
        if _expect_int(root, entry, "records", 1, MAX_RECORDS, f"{where}: ") != records:
            raise _fail(root, f"{where}: 'records' = {entry['records']}, expected {records}")
        shards.append(ShardEntry(entry["file"], entry["bytes"], entry["sha256"], records))
    return tuple(shards)


def _parse_shard_tables(stored: _Stored, doc: dict, count: int, per_shard: int, record_bytes: int, newer: bool,
                        read: ReadFile | None) -> tuple[ShardList, _Stored]:
    """1.4: the shard tables, in shard order, covering every shard exactly; each table file's size and
    SHA-256 (the manifest's seal covers them) checked before its rows are trusted; every shard file's size.
    Returns the shards and a `_Stored` that refuses another entry naming a shard file."""
    root, total = stored.root, shard_count(count, per_shard)
    tables_doc = _expect(root, doc, "shard_tables", list)
    if not tables_doc or len(tables_doc) > total:
        raise _fail(root, f"'shard_tables' has {len(tables_doc)} table(s) for {total} shard(s)")
    tables, files, first = [], {}, 0
    for i, t in enumerate(tables_doc):
        where = f"shard_tables[{i}]"
        _expect_keys(root, t, _TABLE_KEYS, f"{where}: ", newer)
        if _expect_int(root, t, "first", 0, MAX_RECORDS, f"{where}: ") != first:
            raise _fail(root, f"{where}: 'first' = {t['first']}, expected {first} (tables follow each other)")
        n = _expect_int(root, t, "count", 1, total - first, f"{where}: ")
        row = _expect_int(root, t, "row", 0, MAX_RECORDS, f"{where}: ")
        folder = _expect(root, t, "folder", str, f"{where}: ")
        problem = file_name_problem(folder)
        if problem:
            raise _fail(root, f"{where}: 'folder' {problem}")
        problem = file_name_problem(t["file"])
        if problem:
            raise _fail(root, f"{where} {problem}")
        if t["file"] in files:  # one file backing several tables: the same entry each time
            if (t["bytes"], t["sha256"]) != (files[t["file"]].bytes, files[t["file"]].sha256):
                raise _fail(root, f"{where}: file {t['file']!r} is listed with another size or SHA-256 before")
        else:
            _file_entry(stored, t, where, None, newer, _TABLE_KEYS)
            files[t["file"]] = FileEntry(t["file"], t["bytes"], t["sha256"])
        if t["bytes"] % DIGEST_BYTES or (row + n) * DIGEST_BYTES > t["bytes"]:
            raise _fail(root, f"{where}: rows {row} .. {row + n - 1} of {DIGEST_BYTES} bytes do not fit its "
                              f"{t['bytes']} bytes")
        tables.append(ShardTable(t["file"], t["bytes"], t["sha256"], first, n, row, folder))
        first += n
    if first != total:
        raise _fail(root, f"'shard_tables' cover {first} shard(s), but {count} records at {per_shard} per shard "
                          f"need {total}")
    for name, entry in files.items():  # read whole below: at most one row beyond those used (a replaced shard's)
        used = max(t.row + t.count for t in tables if t.file == name) * DIGEST_BYTES
        if entry.bytes > used + DIGEST_BYTES:
            raise _fail(root, f"shard table {name!r} has {entry.bytes} bytes, but its entries use {used} (at most "
                              f"{DIGEST_BYTES} more may be unused)")
    if read is None:
        raise ValueError("a 1.4 manifest is parsed with a reader of its shard tables")
    rows = {}
    for name, entry in files.items():
        data = read(name, entry.bytes + 1)
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise DatasetError(f"{_at(root, name)}: the shard table does not match its size and SHA-256 in "
                               f"{_parsing.get()}; the dataset is damaged")
        rows[name] = data
    shards = ShardList(count, per_shard, record_bytes, tuple(tables),
                       b"".join(rows[t.file][t.row * DIGEST_BYTES:(t.row + t.count) * DIGEST_BYTES] for t in tables))
    for k in range(total):
        name, size = tables[bisect.bisect_right(shards._firsts, k) - 1].file_of(k), \
            min(per_shard, count - k * per_shard) * record_bytes
        actual = stored.size_of(name, f"shard {k}")
        if actual != size:
            raise DatasetError(f"{_at(root, name)}: file is {actual} bytes, the manifest says {size} "
                               f"({'truncated' if actual < size else 'extended'}); the dataset is damaged")
    folders = {t.folder for t in tables}

    def is_shard(name: str) -> bool:
        folder, _, base = name.rpartition("/")
        stem = base.removesuffix(".bin")
        if not stem.isdigit() or not stem.isascii() or folder not in folders:
            return False
        k = int(stem)
        return any(t.first <= k < t.first + t.count and t.file_of(k) == name for t in tables if t.folder == folder)
    for name in files:
        if is_shard(name):
            raise _fail(root, f"shard table {name!r} is also a shard file of the shard tables")
    return shards, stored._replace(is_shard=is_shard)


def _checksums_entry(stored: _Stored, doc: dict, count: int, newer: bool) -> FileEntry | None:
    """The 1.3 `checksums` entry (uint32 CRC-32 per record), checked like any file entry; None when absent."""
    if "checksums" not in doc or minor_version(doc["version"]) < 3:
        return None
    entry = _file_entry(stored, doc["checksums"], "checksums", count * CHECKSUM_DTYPE.itemsize, newer)
    return FileEntry(entry["file"], entry["bytes"], entry["sha256"])


def _parse_parts(root: Any, parts_doc: Any, count: int, newer: bool) -> tuple[Part, ...]:
    """The 1.3 "parts": runs of records, in order, that together cover [0, count) exactly."""
    if not isinstance(parts_doc, list):
        raise _fail(root, f"'parts' must be list, found {type(parts_doc).__name__}")
    parts, first = [], 0
    for i, entry in enumerate(parts_doc):
        where = f"parts[{i}]: "
        _expect_keys(root, entry, _PART_KEYS, where, newer)
        if _expect_int(root, entry, "first", 0, 1 << 40, where) != first:
            raise _fail(root, f"{where}'first' = {entry['first']}, expected {first} (parts follow each other)")
        first += _expect_int(root, entry, "count", 1, 1 << 40, where)
        parts.append(Part(entry["first"], entry["count"], _expect(root, entry, "compile", dict, where)))
    if parts and first != count:
        raise _fail(root, f"'parts' cover {first} records, the dataset has {count}")
    return tuple(parts)


def _warnings_entry(stored: _Stored, doc: dict, count: int, newer: bool) -> FileEntry | None:
    """The 1.2 `warnings` entry (uint16 per record), checked like any file entry; None when absent."""
    if "warnings" not in doc:
        return None
    entry = _file_entry(stored, doc["warnings"], "warnings", count * WARNING_DTYPE.itemsize, newer)
    return FileEntry(entry["file"], entry["bytes"], entry["sha256"])


def _skip_list_entry(stored: _Stored, doc: dict, newer: bool) -> SkipListEntry | None:
    """The 1.1 `skipped_list` entry, checked like any file entry; None when absent."""
    if "skipped_list" not in doc:
        return None
    entry = _file_entry(stored, doc["skipped_list"], "skipped_list", None, newer, _FILE_KEYS | {"count"})
    count = _expect_int(stored.root, entry, "count", 0, MAX_RECORDS, "skipped_list: ")
    if len(doc["skipped"]) != min(count, SKIPPED_IN_MANIFEST):  # 'skipped' repeats the list's first lines
        raise _fail(stored.root, f"skipped_list: 'count' = {count}, but 'skipped' lists {len(doc['skipped'])} "
                                 f"(it must repeat the first min(count, {SKIPPED_IN_MANIFEST}))")
    return SkipListEntry(entry["file"], entry["bytes"], entry["sha256"], count)


def _parse_fields(stored: _Stored, fields_doc: Any, count: int, newer: bool,
                  with_files: bool = True) -> tuple[FieldEntry, ...]:
    """Validate the 1.1 "fields" list: names, kinds, dtypes, shapes and vocabularies, each file's size
    (1.5: `with_files` False, the files are the segments')."""
    root = stored.root
    if not isinstance(fields_doc, list):
        raise _fail(root, f"'fields' must be list, found {type(fields_doc).__name__}")
    fields, names = [], set()
    for i, entry in enumerate(fields_doc):
        where = f"fields[{i}]"
        _expect_keys(root, entry, _FIELD_KEYS if with_files else _FIELD_SPEC_KEYS, f"{where}: ", newer)
        name = entry["name"]
        problem = field_name_problem(name)
        if problem:
            raise _fail(root, f"{where}: {problem}")
        if name in names:
            raise _fail(root, f"{where}: field {name!r} is listed twice")
        names.add(name)
        kind = entry["kind"]
        if not isinstance(kind, str) or kind not in FIELD_DTYPES:
            raise _fail(root, f"{where}: 'kind' must be one of {', '.join(FIELD_DTYPES)}, found {quoted(kind, 40)}")
        if entry["dtype"] != FIELD_DTYPES[kind].str:
            raise _fail(root, f"{where}: 'dtype' of a {kind} field must be {FIELD_DTYPES[kind].str!r}, "
                              f"found {quoted(entry['dtype'], 40)}")
        shape = _expect(root, entry, "shape", list, f"{where}: ")
        if len(shape) > 1 or any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_FIELD_VALUES
                                 for d in shape):
            raise _fail(root, f"{where}: 'shape' must be [] or [k] with 1 <= k <= {MAX_FIELD_VALUES}, "
                              f"found {quoted(shape, 60)}")
        classes = _expect(root, entry, "classes", list, f"{where}: ")
        if not all(isinstance(c, str) and c for c in classes) or len(set(classes)) != len(classes) \
                or len(classes) > MAX_FIELD_VALUES:
            raise _fail(root, f"{where}: 'classes' must be a list of at most {MAX_FIELD_VALUES} distinct, non-empty "
                              "strings")
        if kind == "class" and (shape != [] or not classes):
            raise _fail(root, f"{where}: a class field has shape [] and at least one class")
        if kind == "multilabel" and shape != [len(classes)]:
            raise _fail(root, f"{where}: a multilabel field has shape [len(classes)] = [{len(classes)}], "
                              f"found {shape}")
        if kind in ("float", "int") and classes:
            raise _fail(root, f"{where}: a {kind} field has no classes")
        if not with_files:
            fields.append(FieldEntry("", 0, "", name, kind, tuple(shape), tuple(classes)))
            continue
        per_record = FIELD_DTYPES[kind].itemsize * (shape[0] if shape else 1)
        _file_entry(stored, entry, where, count * per_record, newer, _FIELD_KEYS)
        fields.append(FieldEntry(entry["file"], entry["bytes"], entry["sha256"], name, kind, tuple(shape),
                                 tuple(classes)))
    return tuple(fields)


def check_index(manifest: Manifest, root: Any, values_of: ValuesOf, trusted: int = 0) -> None:
    """Labels in range (a class index, or -1: no label — in a labeled dataset from 1.2 on), source
    offsets rising from 0 to the size of sources.bin, original sizes of at least 1 pixel a side, field
    values their kind allows: checked piece by piece as `values_of` hands them in, segment by segment (1.5;
    their class counts: `check_class_counts`), so the cost follows the bytes really stored,
    not what a manifest claims (a 1 KB manifest may claim 2^40 records over sparse files). The first
    `trusted` segments are skipped: a writer's new version keeps them from one already checked."""
    for key in checked_values(manifest):
        check_values(manifest, key, root, values_of, trusted)


def checked_values(manifest: Manifest) -> list[str]:
    """What `check_values` checks, by key: the index's labels, source offsets and sizes, then each field's
    values (`field_key`)."""
    return ["labels", "source_offsets", "sizes", *(field_key(f.name) for f in manifest.fields)]


def field_key(name: str) -> str:
    """The key of field `name`'s values (a field may be named "labels"; no index key holds a '/')."""
    return f"fields/{name}"


def segment_file(manifest: Manifest, segment: Segment, key: str) -> str:
    """The file of one of `checked_values` (or "sources") in `segment`."""
    if key in segment.index:
        return segment.index[key].file
    return segment.fields[[field_key(f.name) for f in manifest.fields].index(key)].file


def check_values(manifest: Manifest, key: str, root: Any, values_of: ValuesOf, trusted: int = 0) -> None:
    """`check_index` for one of `checked_values`, in every segment but the first `trusted`: what a reader that
    checks each file only when it is first used whole runs (a batch checks just the values it takes:
    `taken_values_problem`)."""
    for segment in manifest.index_segments[trusted:]:
        file, n = segment_file(manifest, segment, key), segment.count
        if key == "labels":
            low, high = label_range(manifest)
            found_low, found_high = high, low
            for values in values_of(file, LABEL_DTYPE, n):
                found_low, found_high = min(found_low, int(values.min())), max(found_high, int(values.max()))
            if found_low < low or found_high > high:
                found = f", found [{found_low}, {found_high}]"
                raise DatasetError(f"{_at(root, file)}: {_label_rule(manifest, found)}")
        elif key == "source_offsets":
            previous, rising = None, True
            for values in values_of(file, OFFSET_DTYPE, n + 1):
                joined = values[0] == 0 if previous is None else values[0] >= previous
                rising = rising and bool(joined) and bool(np.all(values[1:] >= values[:-1]))
                previous = int(values[-1])
            sources = segment.index["sources"]
            if not rising or previous != sources.bytes:
                raise DatasetError(f"{_at(root, file)}: offsets must rise from 0 to the size of {sources.file} "
                                   f"({sources.bytes})")
        elif key == "sizes":
            _check_sizes(file, n, root, values_of)
        else:
            _check_field(replace(_field(manifest, key), file=file), n, root, values_of)


def label_range(manifest: Manifest) -> tuple[int, int]:
    """The labels a record may have: [0, K-1], with -1 (no label) too from 1.2 on; [-1, -1] unlabeled."""
    k = len(manifest.classes)
    unlabeled_ok = not k or minor_version(manifest.version) >= 2
    return UNLABELED if unlabeled_ok else 0, k - 1 if k else UNLABELED


def _label_rule(manifest: Manifest, found: str = "") -> str:
    k, (low, high) = len(manifest.classes), label_range(manifest)
    return (f"labels must lie in [{0 if k else low}, {high}] for {k} classes{found}"
            + (f"; {UNLABELED} (no label) is allowed too" if k and low == UNLABELED else ""))


def _field(manifest: Manifest, key: str) -> FieldEntry:
    return next(f for f in manifest.fields if field_key(f.name) == key)


def taken_values_problem(manifest: Manifest, key: str, values: np.ndarray, records: np.ndarray) -> str | None:
    """What is wrong with the values of records `records` that a reader took from file `key` (labels, sizes
    or a field's file: `checked_values`, but for the offsets, whose reader checks the two it uses), said with
    the first wrong record and the rule; None when they are fine. A few comparisons per batch: what lets a
    reader check each value it uses instead of every value of a 10^8-record index at open."""
    if not len(values):
        return None
    if key == "labels":
        low, high = label_range(manifest)
        if low <= values.min() and values.max() <= high:  # the usual case: two reductions, no mask
            return None
        wrong, rule = (values < low) | (values > high), _label_rule(manifest)
    elif key == "sizes":
        if values.min() >= 1:
            return None
        wrong, rule = (values < 1).reshape(len(values), -1).any(axis=1), SIZE_RULE
    else:
        entry = _field(manifest, key)
        if entry.kind == "int":
            return None
        flat = values.reshape(len(values), -1)
        wrong = {"class": lambda: (flat < 0) | (flat >= len(entry.classes)), "multilabel": lambda: flat > 1,
                 "float": lambda: ~np.isfinite(flat)}[entry.kind]().any(axis=1)
        if not wrong.any():
            return None
        rule = f"values of field {entry.name!r} {_field_rule(entry)}"
    row = int(np.flatnonzero(wrong)[0])
    return (f"record {int(records[row])} has {np.asarray(values[row]).tolist()}, but {rule}; the dataset is damaged "
            "(dsc verify checks every file)")


SIZE_RULE = "every original (height, width) must be at least 1 pixel a side"


def _field_rule(entry: FieldEntry) -> str:
    """What a field's kind allows, in words."""
    return {"class": f"must lie in [0, {len(entry.classes) - 1}]", "multilabel": "must be 0 or 1",
            "float": "must be finite"}[entry.kind]


def check_class_counts(manifest: Manifest, root: Any, values_of: ValuesOf) -> None:
    """(1.5) Each segment's stored class counts are its labels' (classes after its K_s count none): a second
    pass over the labels, made by verification (`dsc verify`), not at every open; labels checked in range first
    (`check_index`)."""
    for segment in manifest.segments:
        counts = np.zeros(len(manifest.classes) + 1, np.int64)
        for values in values_of(segment.index["labels"].file, LABEL_DTYPE, segment.count):
            counts += np.bincount(values + 1, minlength=len(counts))
        _check_class_counts(segment, counts, root, values_of)


def _check_class_counts(segment: Segment, counts: np.ndarray, root: Any, values_of: ValuesOf) -> None:
    entry = segment.class_counts
    stored = np.zeros_like(counts)
    at = 0
    for values in values_of(entry.file, COUNT_DTYPE, entry.bytes // COUNT_DTYPE.itemsize):
        stored[at:at + len(values)] = values
        at += len(values)
    if not np.array_equal(stored, counts):
        wrong = int(np.flatnonzero(stored != counts)[0]) - 1
        raise DatasetError(f"{_at(root, entry.file)}: the class counts say {int(stored[wrong + 1])} record(s) of label "
                           f"{wrong}, the segment's labels ({segment.index['labels'].file}) hold "
                           f"{int(counts[wrong + 1])}; the dataset is damaged")


def class_counts(manifest: Manifest, read: ReadFile, root: Any) -> np.ndarray | None:
    """(1.5) Records per label over the dataset, -1 first ([K + 1]), from the segments' stored counts, each
    file checked against its size and SHA-256 and its sum against its segment's records; None when a segment
    stores none (older versions: count the labels)."""
    total = np.zeros(len(manifest.classes) + 1, np.int64)
    for segment in manifest.index_segments:
        entry = segment.class_counts
        if entry is None:
            return None
        data = read(entry.file, entry.bytes + 1)
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise DatasetError(f"{_at(root, entry.file)}: the class counts do not match their size and SHA-256 in "
                               "the manifest; the dataset is damaged")
        counts = np.frombuffer(data, COUNT_DTYPE)
        if counts.min() < 0 or int(counts.sum()) != segment.count:
            raise DatasetError(f"{_at(root, entry.file)}: the class counts sum to {int(counts.sum())}, not to the "
                               f"segment's {segment.count} records; the dataset is damaged")
        total[:len(counts)] += counts
    return total


def _check_sizes(file: str, count: int, root: Any, values_of: ValuesOf) -> None:
    """Every original (height, width) at least 1: a 0 is no image a record could come from, and a
    transform that crops by the original size (`original_sizes=True`) would divide by it or crop
    nothing. Scanned in pieces like the labels; a hole of a sparse file reads as 0, so it is refused."""
    low = high = None
    for values in values_of(file, SIZE_DTYPE, count * 2):
        low = int(values.min()) if low is None else min(low, int(values.min()))
        high = int(values.max()) if high is None else max(high, int(values.max()))
    if low is not None and low < 1:
        raise DatasetError(f"{_at(root, file)}: {SIZE_RULE}, found sides in [{low}, {high}]")


def _check_field(entry: FieldEntry, count: int, root: Any, values_of: ValuesOf) -> None:
    """Values a field's kind allows (class indices in [0, K-1], multi-hot 0 or 1, finite floats),
    scanned in pieces like the index."""
    if entry.kind == "int" or not count:
        return
    low = high = None
    for values in values_of(entry.file, entry.dtype, count * (entry.shape[0] if entry.shape else 1)):
        low = values.min() if low is None else np.minimum(low, values.min())  # NaN propagates
        high = values.max() if high is None else np.maximum(high, values.max())
        if entry.kind == "float" and not (np.isfinite(low) and np.isfinite(high)):
            break
    wrong = {"class": low < 0 or high >= len(entry.classes), "multilabel": high > 1,
             "float": not (np.isfinite(low) and np.isfinite(high))}[entry.kind]
    if wrong:
        raise DatasetError(f"{_at(root, entry.file)}: values of field {entry.name!r} {_field_rule(entry)}, "
                           f"found [{low}, {high}]")


