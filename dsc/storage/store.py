"""The reader's seam: a dataset is opened through a `DatasetStore`, whatever holds its files.

A store answers three questions — the manifest's bytes, the stored size of a file, and a local,
validated, mappable descriptor of a file — and `open_dataset` does the rest the same way for
every store: `format.parse_manifest` and `format.check_index` validate, then the files are
memory-mapped. `LocalFolder` (`dsc.storage.local`) is the store of a path; `S3Dataset`
(`dsc.storage.s3`, for `s3://bucket/prefix`) is a sibling that fetches into a node-local cache
and hands out descriptors of the cached index files; it has two verbs more, `record_cache` (its
records come through a bounded cache, `OpenedDataset.records`, instead of maps) and `pieces` (a
file's bytes as the bucket holds them, for verification). `STORES` picks one by the location's URL scheme,
importing an object store's module (and its client) only for a URL of its scheme.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from dsc import format as fmt
from dsc.errors import ChecksumError, DatasetError, StorageError
from dsc.storage.columns import Column
from dsc.storage.local import LocalFolder, cache_writes, first_hole, map_file, scan_values
from dsc.storage.shard_maps import ShardMaps

REOPEN_ATTEMPTS = 5  # opens of a folder that recompiles keep swapping, before giving up
VERIFY_PIECE_BYTES = 8 << 20  # verification reads a file this much (whole records) at a time
REOPEN_PAUSE_S = 0.01  # the pause before the next attempt grows by this much each time


class DatasetStore(Protocol):
    """Where a dataset's files are. Every name comes from a manifest that `format` has checked."""

    root: Any  # names the dataset in messages (a Path for a folder)

    def read(self, name: str, limit: int) -> bytes:
        """At most `limit` bytes of file `name`; DatasetError when it is missing or not a plain file."""

    def size(self, name: str, where: str) -> int:
        """The stored size of `name` without fetching it (`where` names what asked, for messages)."""

    def open(self, name: str, where: str) -> int:
        """A read-only descriptor of a local regular file holding `name`'s bytes, fit to map."""

    def replaced(self) -> bool:
        """Whether the location now holds another dataset than the one this store opened."""

    def local_folder(self) -> Path:
        """The local folder holding the files `open` hands out (a folder itself; an object store's cache)."""

    def close(self) -> None: ...

    # Optional (format 1.3 versions): `list(folder) -> list[str]`, the names in a sub-folder. A store
    # without it reads `manifest.json` only, the copy of the latest version (see `versions`).
    # Optional: `duplicate() -> store`, the same store held open apart, which maps shards on first use
    # (`ShardMaps`) after this one is closed; a store without it has every shard mapped at open.


Location = str | os.PathLike  # a folder path, or a URL whose scheme STORES names
STORES = {"s3": "dsc.storage.s3"}  # URL scheme -> module with `open_store(url, cache_dir)`, imported when used


def url_scheme(location: Location) -> str | None:
    """The scheme of a URL location (`s3` of `s3://bucket/prefix`); None for a path."""
    text = os.fspath(location)
    if isinstance(text, str) and "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme.isidentifier():
            return scheme.lower()
    return None


def is_url(location: Location) -> bool:
    """Whether `location` names a dataset in object storage rather than a folder."""
    return url_scheme(location) is not None


def store_for(location: Location, cache_dir: str | os.PathLike | None = None,
              cache_bytes: int | None = None) -> DatasetStore:
    """The store of a dataset location: a folder path, or a URL of a scheme in `STORES` (whose
    files are cached under `cache_dir`, at most `cache_bytes` of them; neither has a meaning for a folder)."""
    scheme = url_scheme(location)
    if scheme is None:
        if cache_dir is not None or cache_bytes is not None:
            raise ValueError(f"cache_dir and cache_bytes are for datasets in object storage (s3://...); {location} "
                             "is a folder")
        return LocalFolder(Path(location))
    if scheme not in STORES:
        raise DatasetError(f"{location}: dsc reads datasets from folders and from "
                           f"{', '.join(s + '://' for s in STORES)} URLs, not {scheme}://")
    return importlib.import_module(STORES[scheme]).open_store(os.fspath(location), cache_dir, cache_bytes)


@contextmanager
def _opened(location: Location, cache_dir: str | os.PathLike | None = None) -> Iterator[DatasetStore]:
    store = store_for(location, cache_dir)
    try:
        with _said(store):
            yield store
    finally:
        store.close()


def _said(store: DatasetStore) -> AbstractContextManager[None]:
    """Writes into a store's cache folder (an object store's), a read-only or full one said in one line."""
    cache = getattr(store, "cache", None)
    return nullcontext() if cache is None else cache_writes(cache, str(store.root))


_checking: weakref.WeakSet = weakref.WeakSet()  # the OpenedDatasets with files still to check whole (`_whole`)


def _after_fork() -> None:
    """A child forked (DataLoader's fork workers inherit the dataset) while a thread of the parent checked a whole
    file under a dataset's lock has no thread to release it: a fresh lock, and the check is done again if asked."""
    for opened in list(_checking):
        opened._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class OpenedDataset:
    """A validated dataset: its manifest, read-only memory maps of its index files, and its shards
    (`ShardMaps`: mapped at open, or on first use past a few thousand).

    `root` is where it is (a folder's Path, or a URL); `local` the folder whose files are mapped
    (the same folder, or an object store's cache of the dataset).

    Index values (labels, sizes, source offsets, fields) checked at open (`open_dataset(check_values=True)`)
    or when used: `take` checks the values of the records a batch takes, `source(i)` the two offsets it
    uses, and `labels`, `sizes`, `source_offsets` and `fields` check a whole file the first time it is
    asked for whole (then never again). Either way no value outside the format's rules reaches a caller:
    a wrong one is a DatasetError naming the file and the record."""

    def __init__(self, root: Path | str, manifest: fmt.Manifest, shards: Sequence[np.ndarray],
                 values: dict[str, np.ndarray], unchecked: dict[str, dict[str, int]], local: Path | None = None,
                 records: Any = None) -> None:
        """`values`: each index column's map by key (`fmt.checked_values`, and "sources"; several segments' files
        joined, format 1.5); `unchecked`: by key, a descriptor of each of its files (by name) whose values were
        not checked at open (closed when this is collected)."""
        self.root, self.manifest, self.shards, self.local, self.records = root, manifest, shards, local, records
        self._values, self._unchecked = values, dict(unchecked)
        self._lock = threading.Lock()
        if unchecked:  # the descriptors still held when this goes (`_whole` closes each one it is done with)
            weakref.finalize(self, _close_all, self._unchecked)
            _checking.add(self)

    @property
    def labels(self) -> np.ndarray:
        """Every record's label, int64 [count], checked."""
        return self._whole("labels")

    @property
    def sizes(self) -> np.ndarray:
        """Every record's source (height, width), [count, 2], checked."""
        return self._whole("sizes")

    @property
    def source_offsets(self) -> np.ndarray:
        return self._whole("source_offsets")

    @property
    def sources(self) -> np.ndarray:
        """sources.bin's bytes (its offsets say where each name is: `source(i)`)."""
        return self._values["sources"]

    @property
    def fields(self) -> dict[str, np.ndarray]:
        """The dataset's own fields (1.1), each [count, *shape], checked, by name in manifest order."""
        return {f.name: self._whole(fmt.field_key(f.name)) for f in self.manifest.fields}

    @staticmethod
    def field_key(name: str) -> str:
        """The key of field `name`'s values (for `take`)."""
        return fmt.field_key(name)

    def take(self, key: str, idx: np.ndarray) -> np.ndarray:
        """The values of records `idx` (checked indices) from index file `key` ("labels", "sizes" or a field's
        `field_key`), checked unless the whole file was: a few comparisons per batch."""
        values = np.take(self._values[key], idx, axis=0)
        if key in self._unchecked:
            problem = fmt.taken_values_problem(self.manifest, key, values, idx)
            if problem:
                raise DatasetError(f"{self._named(key)}: {problem}")
        return values

    def _named(self, key: str) -> str:
        files = [fmt.segment_file(self.manifest, s, key) for s in self.manifest.index_segments]
        return f"{str(self.root).rstrip('/')}/{files[0] if len(files) == 1 else key + ' (of the index segments)'}"

    def _whole(self, key: str) -> np.ndarray:
        if key in self._unchecked:
            with self._lock:  # one scan, whichever thread asks first
                fds = self._unchecked.get(key)
                if fds is not None:
                    def values_of(name: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
                        return scan_values(fds[name], dtype, count, fmt.SCAN_ITEMS)
                    fmt.check_values(self.manifest, key, self.root, values_of)
                    del self._unchecked[key]
                    _close_all(fds)
        return self._values[key]

    @property
    def local_root(self) -> Path:
        """The local folder of the mapped files (what code that maps them by path again uses)."""
        return self.local if self.local is not None else Path(self.root)

    @property
    def stored_bytes(self) -> int:
        """The dataset's size: the files its manifest lists and the manifest (what `dsc info` and `dsc verify` say)."""
        return sum(e.bytes for e in self.manifest.files) + (self.local_root / fmt.MANIFEST_FILE).stat().st_size

    def source(self, i: int) -> str:
        """Record `i`'s source path, relative to the compiled SRC folder."""
        offsets = self._values["source_offsets"]
        start, stop = int(offsets[i]), int(offsets[i + 1])
        if "source_offsets" in self._unchecked and not 0 <= start <= stop <= len(self.sources):
            raise DatasetError(f"{self._named('source_offsets')}: record {i}'s name would run from byte {start} to "
                               f"{stop} of {self._named('sources')} ({len(self.sources)} bytes); the "
                               "dataset is damaged (dsc verify checks every file)")
        return os.fsdecode(self.sources[start:stop].tobytes())

    def read_records(self, indices) -> np.ndarray:
        """A copy of records `indices` [n, H, W, 3], from the maps or, in object storage, through the cache."""
        idx = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(idx), *self.manifest.record_shape), dtype=fmt.RECORD_DTYPE)
        if self.records is not None:
            self.records.fill(out, idx)
        else:
            for row, i in enumerate(idx.tolist()):
                shard, pos = fmt.locate(i, self.manifest.records_per_shard)
                out[row] = self.shards[shard][pos]
        return out

    def shard_paths(self) -> list[Path]:
        return [self.local_root / s.file for s in self.manifest.shards]


def _close_all(fds: dict[str, Any]) -> None:
    """Close every descriptor of `fds` (by name, or by key then name)."""
    for fd in list(fds.values()):
        _close_all(fd) if isinstance(fd, dict) else os.close(fd)
    fds.clear()


def versions(store: DatasetStore) -> list[int]:
    """(format 1.3) The dataset's committed versions, oldest first: the manifests in `versions/`;
    [] when it has none (version 1 is then `manifest.json`). A store that cannot list answers [] and
    reads `manifest.json`, the copy of the latest version (an object store lists `versions/`)."""
    listing = getattr(store, "list", None)
    return sorted(v for v in map(fmt.version_of, listing(fmt.VERSIONS_DIR) if listing else []) if v is not None)


def manifest_name(store: DatasetStore, version: int | None = None) -> str:
    """Which file holds version `version`'s manifest (None: the latest version's). A store that cannot
    list has only `manifest.json`, whichever version it holds (a reader compares fingerprints)."""
    if getattr(store, "list", None) is None:
        return fmt.MANIFEST_FILE
    found = versions(store)
    if version is None:
        return fmt.version_file(found[-1]) if found else fmt.MANIFEST_FILE
    if version in found:
        return fmt.version_file(version)
    if version == 1 and not found:
        return fmt.MANIFEST_FILE
    kept = f"versions {found[0]} to {found[-1]}" if found else "version 1 only"
    offline = getattr(store, "offline", lambda: None)()  # an object store whose endpoint did not answer
    if offline is not None:
        raise StorageError(f"{offline}; the cache {store.cache} holds no copy of this dataset's version {version}'s "
                           f"manifest fetched through {store.endpoint_named()}, to open it without the endpoint (it "
                           f"holds copies of {kept})")
    raise DatasetError(f"{store.root}: has no version {version} (it holds {kept}; `dsc prune` removes old versions)")


def read_manifest(store: DatasetStore, version: int | None = None) -> fmt.Manifest:
    """The store's manifest of `version` (None: the latest), validated with the size of every file it names."""
    name = manifest_name(store, version)
    try:
        text = store.read(name, fmt.MAX_MANIFEST_BYTES + 1)
    except StorageError:
        raise
    except DatasetError as e:
        raise DatasetError(f"{store.root}: no {name}; not a dsc dataset, or its compile never "
                           "finished") from e
    manifest = fmt.parse_manifest(text, store.root, _sizes(store), store.read, name)
    if name != fmt.MANIFEST_FILE and manifest.dataset_version != fmt.version_of(name.split("/")[-1]):
        raise DatasetError(f"{store.root}/{name}: says it is version {manifest.dataset_version}; the dataset is "
                           "damaged")
    if version is not None and manifest.dataset_version != version:  # a store that cannot list: manifest.json
        raise DatasetError(f"{store.root}: version {version} asked for, but this store reads only its latest "
                           f"version ({manifest.dataset_version}, its {fmt.MANIFEST_FILE}): it cannot list "
                           f"{fmt.VERSIONS_DIR}/; copy the dataset to a folder")
    return manifest


def _sizes(store: DatasetStore) -> fmt.SizeOf:
    """`store.size`, answered from one listing of each folder where the store lists sizes (`listed_sizes`):
    checking 400k shards' sizes one open at a time took seconds. A name the listing lacks (missing, a link,
    not a plain file) is asked for with `store.size`, which says what is wrong."""
    listing = getattr(store, "listed_sizes", None)
    if listing is None:
        return store.size
    folders: dict[str, dict[str, int]] = {}

    def size(name: str, where: str) -> int:
        folder = name.rpartition("/")[0]
        if folder not in folders:
            folders[folder] = listing(folder)
        found = folders[folder].get(name)
        return found if found is not None else store.size(name, where)
    return size


def _values_of(store: DatasetStore) -> Callable[[str, np.dtype, int], Iterator[np.ndarray]]:
    """`format.ValuesOf` over a store: an index file's values, scanned piece by piece."""
    def values(name: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
        fd = store.open(name, name)
        try:
            yield from scan_values(fd, dtype, count, fmt.SCAN_ITEMS)
        finally:
            os.close(fd)
    return values


def _read_values(store: DatasetStore) -> Callable[[str, np.dtype, int], Iterator[np.ndarray]]:
    """`format.ValuesOf` of a store read whole (an object store's, which verification reads without a cache)."""
    def values(name: str, dtype: np.dtype, count: int) -> Iterator[np.ndarray]:
        yield np.frombuffer(store.read(name, count * dtype.itemsize + 1), dtype)[:count]
    return values


def _validated(store: DatasetStore, version: int | None = None) -> fmt.Manifest:
    manifest = read_manifest(store, version)
    fmt.check_index(manifest, store.root, _values_of(store))
    return manifest


def open_dataset(root: Location, cache_dir: str | os.PathLike | None = None,
                 version: int | None = None, cache_bytes: int | None = None,
                 check_values: bool = True) -> OpenedDataset:
    """Validate a dataset, then map its files (no data is read yet): its latest version, or `version`.

    `check_values=False` leaves the index's values (linear in the records: 2.4 GB at 10^8) to be checked
    when used (`OpenedDataset`): what a reader and `dsc info` open with, in milliseconds at any size.

    Every file is mapped read-only and shared (`PROT_READ`, `MAP_SHARED`): such maps count against
    no commit limit, so a shard larger than RAM + swap maps even under strict overcommit. Reading through one
    folder descriptor never mixes two datasets; if a recompile swaps a new folder in meanwhile,
    the old one's files vanish under it, and the folder now at `root` is opened instead.
    A URL's index files are fetched into `cache_dir` first (see `store_for`), and its records are
    read through a bounded cache of at most `cache_bytes` (`OpenedDataset.records`), not mapped.
    Versions (format 1.3) are never rewritten: an append committed meanwhile leaves the version opened
    whole; a `dsc prune` that removed the latest version's predecessor meanwhile makes the open start again.
    """
    for attempt in range(1, REOPEN_ATTEMPTS + 1):
        store, latest = store_for(root, cache_dir, cache_bytes), None
        try:
            with _said(store):
                latest = manifest_name(store) if version is None else None
                return _map_dataset(store, version, check_values)
        except DatasetError:
            moved = latest is not None and manifest_name(store) != latest
            if attempt == REOPEN_ATTEMPTS or not (store.replaced() or moved):  # not swapped: a real error
                raise
        finally:
            store.close()
        time.sleep(REOPEN_PAUSE_S * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises


def validate(root: str | os.PathLike, version: int | None = None) -> fmt.Manifest:
    """Everything `open_dataset` checks, without mapping anything: what a writer runs before it publishes."""
    with _opened(root) as store:
        return _validated(store, version)


def parse_manifest(root: Location, cache_dir: str | os.PathLike | None = None,
                   version: int | None = None) -> fmt.Manifest:
    """The dataset's manifest (latest version, or `version`), validated with its files' sizes (not their
    values: see `validate`)."""
    with _opened(root, cache_dir) as store:
        return read_manifest(store, version)


def check_manifest_text(root: str | os.PathLike, text: bytes, kept: dict[str, int] | None = None,
                        kept_segments: int = 0) -> fmt.Manifest:
    """Everything `validate` checks, of manifest bytes not yet committed, over the files of the folder `root`:
    what a writer of a new version runs before it commits it. `kept`: the sizes of files it keeps from an
    earlier, validated version that are not in `root` (the shards of a dataset in a bucket; its shard tables,
    which are read, must be in `root`); `kept_segments`: (1.5) how many index segments it keeps from that
    version, whose values are not read again (an append costs what it adds)."""
    with _opened(root) as store:
        sizes = _sizes(store)

        def size(name: str, where: str) -> int:
            return kept[name] if kept and name in kept else sizes(name, where)
        manifest = fmt.parse_manifest(text, store.root, size, store.read)
        fmt.check_index(manifest, store.root, _values_of(store), kept_segments)
        return manifest


def files_of_versions(root: str | os.PathLike, strict: bool = False) -> set[str]:
    """(format 1.3) What a dataset folder's versions own: every version's manifest (and `manifest.json`)
    and every file one of them lists, unchecked. A manifest that cannot be read lists nothing, or with
    `strict` (for what deletes the files no version lists) raises DatasetError."""
    with _opened(root) as store:
        names = {fmt.MANIFEST_FILE, *(fmt.version_file(v) for v in versions(store))}
        owned = set(names)
        for name in sorted(names):
            try:
                text = store.read(name, fmt.MAX_MANIFEST_BYTES + 1)
                if strict and not fmt.names_this_format(text):
                    raise DatasetError(f"{store.root}/{name}: not a readable dsc manifest")
            except DatasetError as e:
                if strict:
                    raise DatasetError(f"{e}; which files the dataset's versions use cannot be told, so none is "
                                       "deleted (move the damaged manifest away, or recompile)") from e
                continue
            owned |= fmt.listed_files(text)
        return owned


def dataset_versions(root: Location) -> list[int]:
    """(format 1.3) The versions a dataset holds, oldest first ([1] for one never appended to)."""
    with _opened(root) as store:
        return versions(store) or [1]


def _map_dataset(store: DatasetStore, version: int | None = None, check_values: bool = True) -> OpenedDataset:
    manifest = read_manifest(store, version)
    if check_values:
        fmt.check_index(manifest, store.root, _values_of(store))
    held: dict[str, int] = {}  # a descriptor of each index file whose values are checked when used
    unchecked: dict[str, dict[str, int]] = {}

    def mapped(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        fd = store.open(name, name)
        if not check_values:
            held[name] = os.dup(fd)
        return map_file(fd, dtype, shape)

    try:
        labels, sizes, offsets, sources, fields = _map_index(manifest, mapped)
        values = {"labels": labels, "sizes": sizes, "source_offsets": offsets, "sources": sources,
                  **{fmt.field_key(name): column for name, column in fields.items()}}
        for key in [] if check_values else fmt.checked_values(manifest):
            files = {fmt.segment_file(manifest, segment, key) for segment in manifest.index_segments}
            unchecked[key] = {name: held.pop(name) for name in files}
        _close_all(held)  # the sources' (its offsets are checked where used)
        remote = getattr(store, "record_cache", None)  # an object store: records through its bounded cache
        records = remote(manifest) if remote is not None else None
        shards: Sequence[np.ndarray] = ()
        if records is None:
            kept = store.duplicate() if hasattr(store, "duplicate") else None  # for shards mapped when first read
            shards = ShardMaps(store.root, manifest, store.open, None, len(manifest.shards)) if kept is None else \
                ShardMaps(store.root, manifest, kept.open, kept.close)  # a store it cannot keep: every shard now
    except BaseException:
        _close_all(held)
        _close_all(unchecked)
        raise
    local = store.local_folder()
    return OpenedDataset(store.root, manifest, shards, values, unchecked, None if local == store.root else local,
                         records)


def _map_index(manifest: fmt.Manifest, mapped: Callable) -> tuple:
    """(labels, sizes, source offsets, sources, {field: values}) mapped: one segment's files as they are, several
    (format 1.5, appended) joined without a copy (`columns.Column`), their source offsets rebased."""
    segments = manifest.index_segments

    def column(pieces, bases=None):
        return pieces[0] if len(pieces) == 1 else Column(pieces, bases)
    labels = column([mapped(s.index["labels"].file, fmt.LABEL_DTYPE, (s.count,)) for s in segments])
    sizes = column([mapped(s.index["sizes"].file, fmt.SIZE_DTYPE, (s.count, 2)) for s in segments])
    blobs = [mapped(s.index["sources"].file, np.dtype(np.uint8), (s.index["sources"].bytes,)) for s in segments]
    bases = np.cumsum([0, *(s.index["sources"].bytes for s in segments)]).tolist()
    offsets = [mapped(s.index["source_offsets"].file, fmt.OFFSET_DTYPE, (s.count + 1,)) for s in segments]
    offsets = offsets[0] if len(segments) == 1 else \
        Column([o[:-1] for o in offsets] + [np.array([bases[-1]], fmt.OFFSET_DTYPE)], [*bases[:-1], 0])
    fields = {f.name: column([mapped(s.fields[k].file, f.dtype, (s.count, *f.shape)) for s in segments])
              for k, f in enumerate(manifest.fields)}
    return labels, sizes, offsets, column(blobs), fields


def _read_column(root: Location, manifest: fmt.Manifest, entry_of: Callable, dtype: np.dtype,
                 absent_zeros: bool = False) -> np.ndarray | None:
    """One small per-record file of every segment (checksums, decoder warnings), read whole and joined; a
    segment without it gives zeros (`absent_zeros`: no record of it had a warning), or the answer is None."""
    pieces = []
    with _opened(root) as store:
        for segment in manifest.index_segments:
            entry = entry_of(segment)
            if entry is None and not absent_zeros:
                return None
            if entry is None:
                pieces.append(np.zeros(segment.count, dtype))
                continue
            data = store.read(entry.file, entry.bytes + 1)
            if len(data) != segment.count * dtype.itemsize:
                raise DatasetError(f"{str(root).rstrip('/')}/{entry.file}: file is {len(data)} bytes, the manifest "
                                   f"says {entry.bytes}; the dataset is damaged")
            pieces.append(np.frombuffer(data, dtype))
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def class_counts(root: Location, manifest: fmt.Manifest) -> np.ndarray | None:
    """(format 1.5) Records per label, -1 first ([K + 1]), from the segments' stored counts, without reading a
    label; None for a version before 1.5 (count its labels)."""
    if not manifest.segments:
        return None
    with _opened(root) as store:
        return fmt.class_counts(manifest, store.read, store.root)


def read_skipped(root: Location, manifest: fmt.Manifest) -> list[dict[str, str]]:
    """Every skipped source of a dataset: the skip list file's lines (1.1), else the manifest's list."""
    entry = manifest.skipped_list
    if entry is None:
        return [dict(s) for s in manifest.skipped]
    with _opened(root) as store:
        return fmt.parse_skip_list(store.read(entry.file, entry.bytes + 1), entry, store.root)


def record_checksums(dataset: OpenedDataset) -> np.ndarray:
    """Each record's CRC-32: the dataset's checksums.bin (format 1.3), or computed from its mapped records
    where it has none (what a writer that joins datasets needs for the joined one)."""
    m = dataset.manifest
    stored = _read_column(dataset.root, m, lambda s: s.checksums, fmt.CHECKSUM_DTYPE)
    if stored is not None:
        return stored
    if dataset.records is not None:  # in object storage: its records a bounded piece at a time
        step = max(1, VERIFY_PIECE_BYTES // m.record_bytes)
        return np.array([c for first in range(0, m.count, step) for c in fmt.record_checksums(
            dataset.read_records(range(first, min(m.count, first + step))), m.record_bytes)], fmt.CHECKSUM_DTYPE)
    return np.fromiter((c for shard in dataset.shards for c in fmt.record_checksums(shard, m.record_bytes)),
                       fmt.CHECKSUM_DTYPE, m.count)


def read_warnings(root: Location, manifest: fmt.Manifest) -> np.ndarray:
    """Each record's count of decoder warnings (format 1.2); zeros for a dataset without the file."""
    return _read_column(root, manifest, lambda s: s.warnings, fmt.WARNING_DTYPE, absent_zeros=True)


def check_skip_list(dataset: OpenedDataset) -> None:
    """Refuse a skip list that names a source the index stores: a source is either a record or skipped."""
    problem = stored_and_skipped(dataset.sources, dataset.source_offsets,
                                 read_skipped(dataset.root, dataset.manifest))
    if problem:
        raise DatasetError(f"{dataset.root}: {problem}; the skip list contradicts the index")


COMPARE_BYTES = 8 << 20  # stored names compared at a time, as fixed-width strings (their index array is 8x)


def stored_and_skipped(sources: np.ndarray, offsets: np.ndarray, skipped: list[dict[str, str]]) -> str | None:
    """The first skipped source that is also a record's source, said in words; None when there is none.
    Each skipped name is compared only with the stored names of its length, those all at once a piece at a
    time: linear in the records and the skips (searching sources.bin once per skip was skips x bytes)."""
    wanted: dict[bytes, dict[str, str]] = {}
    for item in skipped:
        wanted.setdefault(os.fsencode(item["source"]), item)
    starts = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(starts)
    by_length = np.argsort(lengths, kind="stable")
    sorted_lengths = lengths[by_length]
    for length in sorted({len(name) for name in wanted} - {0}):
        records = by_length[np.searchsorted(sorted_lengths, length):np.searchsorted(sorted_lengths, length, "right")]
        names = np.array([name for name in wanted if len(name) == length], dtype=f"S{length}")
        step = max(1, COMPARE_BYTES // length)
        for first in range(0, len(records), step):
            piece = np.sort(records[first:first + step])
            stored = np.asarray(sources)[starts[piece, None] + np.arange(length)].view(f"S{length}").ravel()
            hits = np.flatnonzero(np.isin(stored, names))
            if hits.size:
                item = wanted[bytes(stored[hits[0]])]
                return (f"{item['source']!r} is listed as skipped ({item['reason']}) but is also stored as record "
                        f"{int(piece[hits[0]])}")
    return None


def is_dataset(path: str | os.PathLike) -> bool:
    """Whether `path` looks like a dsc dataset: its manifest names this format (a cheap check, not
    validation; an image folder may hold a manifest.json of its own)."""
    try:
        with open(Path(path) / fmt.MANIFEST_FILE, "rb") as f:
            return fmt.names_this_format(f.read(fmt.MAX_MANIFEST_BYTES))
    except OSError:
        return False


def verify_checksums(root: Location, manifest: fmt.Manifest, progress: Callable[[int], None] | None = None,
                     cache_dir: str | os.PathLike | None = None) -> None:
    """Recompute every file's SHA-256 and check the manifest's own (format 1.2 on) and, where it has them
    (1.3), every record's CRC-32; raise ChecksumError naming every damaged file and record. A URL's files
    are read from the bucket, a piece at a time, and nothing is cached."""
    with _opened(root, cache_dir) as store:
        name = manifest_name(store, manifest.dataset_version if versions(store) else None)
        sealed = fmt.seal_problem(store.read(name, fmt.MAX_MANIFEST_BYTES + 1), manifest, store.root, name)
        bad = [sealed] if sealed else []
        holes = [] if _is_remote(store) else _holes(store, manifest)  # objects have no holes; a shard with one
        bad.extend(holes)                                              # is not hashed at all
        crcs = None if holes else _stored_checksums(store, manifest)
        first = 0
        for entry in [] if holes else manifest.files:
            digest, problem = _check_file(store, entry, manifest.record_bytes, crcs, first, progress)
            if digest != entry.sha256:
                bad.append(f"{_named(store, entry.file)}: SHA-256 is {digest}, the manifest says {entry.sha256}; the "
                           "file is damaged")
            if problem:
                bad.append(problem)
            first += getattr(entry, "records", 0)
        if not holes:  # (1.5) the segments' class counts against their labels (an open does not count them)
            try:
                fmt.check_class_counts(manifest, store.root, _read_values(store) if _is_remote(store)
                                       else _values_of(store))
            except DatasetError as e:
                bad.append(str(e))
    if bad:
        error = ChecksumError("\n".join(bad))
        error.problems = bad
        raise error


def _stored_checksums(store: DatasetStore, manifest: fmt.Manifest) -> np.ndarray | None:
    """The records' CRC-32s (1.3), when every segment's file has the size and SHA-256 the manifest says; else None
    (its own damage is named by its SHA-256)."""
    pieces = []
    for segment in manifest.index_segments:
        entry = segment.checksums
        if entry is None:
            return None
        data = store.read(entry.file, entry.bytes + 1)
        if len(data) != entry.bytes or fmt.file_entry(entry.file, data).sha256 != entry.sha256:
            return None
        pieces.append(np.frombuffer(data, fmt.CHECKSUM_DTYPE))
    return np.concatenate(pieces)


def _check_file(store: DatasetStore, entry: fmt.FileEntry, record_bytes: int, crcs: np.ndarray | None, first: int,
                progress: Callable[[int], None] | None) -> tuple[str, str | None]:
    """(SHA-256 of a file, a line naming its first records whose CRC-32 is wrong, or None); a shard's records
    are checked against `crcs` from record `first` on."""
    digest, wrong, at = hashlib.sha256(), [], first
    check = crcs is not None and isinstance(entry, fmt.ShardEntry)
    for piece in _pieces(store, entry, record_bytes):
        digest.update(piece)
        if check:
            found = np.array(fmt.record_checksums(piece, record_bytes), dtype=np.int64)
            wrong.extend((at + np.flatnonzero(found != crcs[at:at + len(found)])).tolist())
            at += len(found)
        if progress:
            progress(len(piece))
    problem = None
    if wrong:
        problem = (f"{_named(store, entry.file)}: record(s) {', '.join(map(str, wrong[:5]))}"
                   f"{f' and {len(wrong) - 5} more' if len(wrong) > 5 else ''} do not match their CRC-32 in "
                   f"{fmt.CHECKSUMS_FILE}; the records are damaged")
    return digest.hexdigest(), problem


def _pieces(store: DatasetStore, entry: fmt.FileEntry, record_bytes: int) -> Iterator[bytes]:
    """A file's bytes, a bounded piece (whole records) at a time: from the store's own reader where it has one
    (an object store's ranged GETs), else from the descriptor it opens."""
    step = max(1, VERIFY_PIECE_BYTES // record_bytes) * record_bytes
    if _is_remote(store):
        yield from store.pieces(entry.file, entry.bytes, step)
        return
    with os.fdopen(store.open(entry.file, entry.file), "rb") as f:
        while piece := f.read(step):
            yield piece


def _is_remote(store: DatasetStore) -> bool:
    """Whether `store` reads its files from an object store (its own ranged reader), not from descriptors."""
    return getattr(store, "pieces", None) is not None


def _holes(store: DatasetStore, manifest: fmt.Manifest) -> list[str]:
    """Every file of the dataset with a hole, said in words: checked before any is hashed, for hashing a
    sparse file claiming terabytes would read zeros for hours."""
    problems = []
    for e in manifest.files:
        fd = store.open(e.file, e.file)
        try:
            hole = first_hole(fd)
        finally:
            os.close(fd)
        if hole is not None:
            problems.append(f"{_named(store, e.file)}: a hole (bytes never written) at byte {hole:,} of {e.bytes:,}; "
                            "dsc never writes sparse files, so the file is damaged (or was copied sparse, e.g. by "
                            "cp --sparse=always or rsync -S: copy it again without)")
    return problems


def _named(store: DatasetStore, name: str) -> str:
    """How verification names a file of `store`: its path, or the object an object store reads it from."""
    at = f"{str(store.root).rstrip('/')}/{name}"
    return at if getattr(store, "pieces", None) is not None else str(store.local_folder() / name)
