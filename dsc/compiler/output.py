"""Output: the files of a build, written into its staging folder (the format's payloads, made durable).

The shard files are sized up front (`allocate_shards`: workers then fill record slots in
place) and cut down after compaction (`trim_shards`); the index, fields, warnings, skip list and
manifest are built by `dsc.format` and written here, each atomically, the manifest last.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.storage import local


def allocate_shards(root: Path, count: int, records_per_shard: int, record_bytes: int) -> list[Path]:
    """Give every shard file its full size for `count` records, keeping bytes already written
    (a resumed build) and zero-filling the rest; return their paths."""
    (root / fmt.SHARD_DIR).mkdir(mode=0o755, parents=True, exist_ok=True)  # only we write in a build
    paths = []
    for shard, records in enumerate(fmt.shard_records(count, records_per_shard)):
        path = root / fmt.shard_file(shard)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            local.reserve(fd, records * record_bytes)
            if os.fstat(fd).st_size > records * record_bytes:
                os.ftruncate(fd, records * record_bytes)
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def trim_shards(root: Path, count: int, records_per_shard: int, record_bytes: int) -> None:
    """Cut the shard files down to `count` records after skipped sources were compacted away."""
    records = fmt.shard_records(count, records_per_shard)
    for path in sorted((root / fmt.SHARD_DIR).glob("*.bin")):
        if not (path.stem.isdigit() and path.relative_to(root).as_posix() == fmt.shard_file(int(path.stem))):
            continue  # not a shard (a stray notes.bin, a macOS ._00000.bin): not ours to touch
        shard = int(path.stem)
        if shard < len(records):
            os.truncate(path, records[shard] * record_bytes)
        else:
            path.unlink()


HASH_RECORDS_BYTES = 8 << 20  # a shard is hashed this much (rounded to whole records) at a time


def shard_digests(path: Path, record_bytes: int) -> tuple[str, list[int]]:
    """(SHA-256 of a shard file, CRC-32 of each of its records), from one read of it."""
    digest, crcs = hashlib.sha256(), []
    step = max(1, HASH_RECORDS_BYTES // record_bytes) * record_bytes
    with open(path, "rb") as f:
        while chunk := f.read(step):
            digest.update(chunk)
            crcs.extend(fmt.record_checksums(chunk, record_bytes))
    return digest.hexdigest(), crcs


def hash_shards(root: Path, count: int, records_per_shard: int, record_bytes: int,
                map_fn: Callable[..., Iterable[tuple[str, list[int]]]] = map
                ) -> tuple[tuple[fmt.ShardEntry, ...], np.ndarray]:
    """Manifest entries of the finished shards and every record's CRC-32 (format 1.3's checksums), one
    read of each shard; `map_fn` may be a thread pool's map."""
    records = fmt.shard_records(count, records_per_shard)
    names = [fmt.shard_file(i) for i in range(len(records))]
    digests = list(map_fn(lambda name: shard_digests(root / name, record_bytes), names))
    crcs = np.fromiter((c for _, shard in digests for c in shard), fmt.CHECKSUM_DTYPE, count)
    return tuple(fmt.ShardEntry(n, r * record_bytes, d, r) for n, r, (d, _) in zip(names, records, digests)), crcs


def shard_entries(root: Path, count: int, records_per_shard: int, record_bytes: int,
                  map_fn: Callable[..., Iterable[tuple[str, list[int]]]] = map) -> tuple[fmt.ShardEntry, ...]:
    """Manifest entries of the finished shards; `map_fn` may be a thread pool's map."""
    return hash_shards(root, count, records_per_shard, record_bytes, map_fn)[0]


def _write(root: Path, name: str, payload: bytes) -> fmt.FileEntry:
    (root / name).parent.mkdir(mode=0o755, exist_ok=True)
    local.write_durably(root / name, payload)
    return fmt.file_entry(name, payload)


def write_index(root: Path, labels: np.ndarray, sizes: np.ndarray, sources: list[str]) -> dict[str, fmt.FileEntry]:
    """Write the per-record index files and return their manifest entries."""
    return write_index_payloads(root, fmt.index_payloads(labels, sizes, sources))


def write_index_payloads(root: Path, payloads: dict[str, tuple[str, bytes]]) -> dict[str, fmt.FileEntry]:
    """Write index files made by `format` ({key: (file name, bytes)}) and return their manifest entries."""
    return {key: _write(root, name, payload) for key, (name, payload) in payloads.items()}


def write_fields(root: Path, fields: list[tuple[fmt.FieldEntry, np.ndarray]]) -> tuple[fmt.FieldEntry, ...]:
    """Write each field's values (`[count, *shape]`; the entry's file, size and hash are filled in here)
    and return their manifest entries, in the given order."""
    entries = []
    for spec, values in fields:
        written = _write(root, *fmt.field_payload(spec, values))
        entries.append(fmt.FieldEntry(written.file, written.bytes, written.sha256, spec.name, spec.kind,
                                      tuple(spec.shape), tuple(spec.classes)))
    return tuple(entries)


def write_warnings(root: Path, counts: np.ndarray) -> fmt.FileEntry:
    """Write the decoder warnings of each record (format 1.2; only when some record has one)."""
    return _write(root, *fmt.warnings_payload(counts))


def write_checksums(root: Path, crcs: np.ndarray) -> fmt.FileEntry:
    """Write every record's CRC-32 (format 1.3), so a reader can check a byte range it fetched on its own."""
    return _write(root, *fmt.checksums_payload(crcs))


def write_skip_list(root: Path, skipped: list[dict[str, str]]) -> fmt.SkipListEntry:
    """Write every skipped source to the skip list file (in the order given) and return its manifest
    entry: the manifest keeps only the first SKIPPED_IN_MANIFEST, so its size never grows with the skips."""
    written = _write(root, fmt.SKIP_LIST_FILE, fmt.skip_list_payload(skipped))
    return fmt.SkipListEntry(written.file, written.bytes, written.sha256, len(skipped))


def write_manifest(root: Path, manifest: fmt.Manifest) -> fmt.Manifest:
    """Write the shard table (format 1.4), then manifest.json last: until it exists, the folder is not a
    dataset. Returns the manifest written."""
    if not manifest.shard_tables:
        manifest = write_shard_table(root, "", manifest)
    if not manifest.segments:
        manifest = write_segment(root, "", manifest)
    local.write_durably(root / fmt.MANIFEST_FILE, manifest.to_json().encode("ascii"))
    return manifest


def write_segment(root: Path, folder: str, manifest: fmt.Manifest, kept: tuple[fmt.Segment, ...] = ()) -> fmt.Manifest:
    """(1.5) Write `folder`/class_counts.bin, the counts of the labels `manifest`'s index file holds (records
    after the `kept` segments'); `manifest` with its index in segments: `kept`, then that one. Before the manifest.
    A manifest without the records' checksums (a segment has them) keeps its index whole: it is written as 1.4."""
    if fmt.minor_version(manifest.version) < 5 or manifest.checksums is None:
        return manifest
    path = root / manifest.index["labels"].file
    labels = np.memmap(path, fmt.LABEL_DTYPE, "r") if path.stat().st_size else np.zeros(0, fmt.LABEL_DTYPE)
    name, payload = fmt.class_counts_payload(fmt.count_labels(labels, len(manifest.classes)))
    written = _write(root / folder if folder else root, name, payload)
    entry = fmt.FileEntry(f"{folder}/{name}" if folder else name, written.bytes, written.sha256)
    return fmt.with_segment(manifest, entry, kept)


def write_shard_table(root: Path, folder: str, manifest: fmt.Manifest, base: fmt.Manifest | None = None,
                      kept: int = 0) -> fmt.Manifest:
    """(1.4) Write `folder`/shard_table.bin, the SHA-256s of the shards from `kept` on (the first `kept` keep
    their rows in `base`'s tables: `fmt.with_shard_table`); `manifest` naming it. Before the manifest."""
    if fmt.minor_version(manifest.version) < 4:
        return manifest
    name = f"{folder}/{fmt.SHARD_TABLE_FILE}" if folder else fmt.SHARD_TABLE_FILE
    manifest, payload = fmt.with_shard_table(manifest, name, base=base, kept=kept)
    local.write_durably(root / name, payload)
    return manifest
