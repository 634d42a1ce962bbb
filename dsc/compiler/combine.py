"""Combine: the records of several datasets of one record shape as one, without decoding anything.

What `dsc append` (a dataset and the records compiled from new sources) and `dsc merge` (several
datasets) share: one class vocabulary matched by name (`Vocabulary`: the first dataset's indices
never change, later names go at the end), fields matched by name and kind, each dataset's labels
and field values remapped onto them, source paths re-expressed from the first dataset's source
folder, and the shards laid out again so that record i is in shard i // R (`write_shards`): a shard
that is a whole input file is reused (reflink, hard link or copy, `local.reuse_file`), any other is
copied in the kernel, records a run at a time; a shard in a bucket is read by bounded ranged GETs. Also
what `dsc merge` does into a folder and into a bucket alike (`joined_inputs`, `merged_manifest`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.compiler import output
from dsc.errors import CompileError
from dsc.storage import local


@dataclass
class Vocabulary:
    """Class names in index order, grown by name: a name already there keeps its index."""

    names: list[str]
    allow_new: bool
    what: str  # what the classes are of, for messages ("the label", "field 'tags'")

    def remap(self, theirs: Sequence[str], whose: str) -> np.ndarray:
        """Each of `theirs` (another dataset's classes, in its index order) as an index here, adding
        the names not here yet at the end, or refusing them unless new classes are allowed."""
        position = {name: k for k, name in enumerate(self.names)}
        new = [name for name in theirs if name not in position]
        if new and not self.allow_new:
            shown = ", ".join(repr(n) for n in new[:5]) + (f" and {len(new) - 5} more" if len(new) > 5 else "")
            raise CompileError(f"{whose} has classes of {self.what} that the dataset lacks: {shown}; existing classes "
                               "keep their indices, and new ones are added at the end only when asked for "
                               "(--new-classes)")
        for name in new:
            position[name] = len(self.names)
            self.names.append(name)
        return np.array([position[name] for name in theirs], dtype=np.int64)


def _relabel(values: np.ndarray, remap: np.ndarray) -> np.ndarray:
    """Class indices through `remap`; -1 (no label) stays -1."""
    values = np.asarray(values, dtype=np.int64)
    return np.where(values >= 0, remap[np.maximum(values, 0)] if len(remap) else values, values)


def check_shapes(datasets: Sequence[storage.OpenedDataset], whose: Sequence[str]) -> None:
    """Every dataset's records have the first one's shape, and all are labeled or none (`whose[k]` names
    dataset k: an append's compiled SRC is a scratch folder the user never named)."""
    first, first_name = datasets[0], whose[0]
    for d, name in zip(datasets[1:], whose[1:]):
        if d.manifest.record_shape != first.manifest.record_shape:
            raise CompileError(f"{name} holds records of shape {list(d.manifest.record_shape)}, {first_name} of "
                               f"{list(first.manifest.record_shape)}: records of one shape only can be joined "
                               "without decoding (compile the sources again at one --size)")
        if d.manifest.labeled != first.manifest.labeled:
            (labeled, labeled_name), other = ((d, name), first_name) if d.manifest.labeled else ((first, first_name),
                                                                                                  name)
            raise CompileError(f"{labeled_name} is labeled ({len(labeled.manifest.classes)} classes) and {other} "
                               "is not: their labels cannot agree")


def _field_vocabularies(datasets: Sequence[storage.OpenedDataset], allow_new: bool, whose: Sequence[str]):
    """The fields of the first dataset, checked against every other one's by name and kind (`whose[k]` names
    dataset k); the class and multilabel fields' vocabularies, grown as `Vocabulary` says."""
    first = datasets[0].manifest.fields
    ours = {f.name: f for f in first}
    for d, name_of_d in zip(datasets[1:], whose[1:]):
        theirs = {f.name: f for f in d.manifest.fields}
        if set(theirs) != set(ours):
            raise CompileError(f"{name_of_d} has fields {sorted(theirs) or 'none'}, {whose[0]} has "
                               f"{sorted(ours) or 'none'}: fields must match by name")
        for name, f in theirs.items():
            mine = ours[name]
            if f.kind != mine.kind or (f.kind in ("float", "int") and f.shape != mine.shape):
                raise CompileError(f"field {name!r} is {f.kind} {list(f.shape)} in {name_of_d} but {mine.kind} "
                                   f"{list(mine.shape)} in {whose[0]}: fields must match by name and kind")
    return {f.name: Vocabulary(list(f.classes), allow_new, f"field {f.name!r}") for f in first if f.classes}


@dataclass
class Joined:
    """The index of the joined records, ready to write."""

    classes: list[str]
    labels: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray
    sources: bytes
    fields: list[tuple[fmt.FieldEntry, np.ndarray]]
    warnings: np.ndarray | None
    skipped: list[dict[str, str]]
    parts: tuple[fmt.Part, ...]
    checksums: np.ndarray  # each record's CRC-32 (format 1.3), joined like the index


def _rebased(d: storage.OpenedDataset, root: str | None) -> tuple[np.ndarray, bytes]:
    """A dataset's source paths (offsets, bytes), re-expressed relative to `root` when it was compiled
    from another folder: one source folder names every record of the joined dataset."""
    mine = d.manifest.compile.get("source_root")
    offsets, blob = np.asarray(d.source_offsets), np.asarray(d.sources).tobytes()
    if root is None or mine == root or not isinstance(mine, str):
        return offsets, blob
    return fmt.encode_sources([rebase(d.source(i), mine, root) for i in range(d.manifest.count)])


def rebase(source: str, root: str, new_root: str) -> str:
    """`source` (relative to `root`, or whole) relative to `new_root`, '/'-separated (it may climb with '..'),
    where both are folders; else whole (`fmt.is_whole_source`): a folder's absolute path, an object's URL."""
    location = fmt.source_location(root, source)
    if storage.is_url(location) or storage.is_url(new_root):
        return location if storage.is_url(location) else os.path.abspath(location)
    return os.path.relpath(location, new_root).replace(os.sep, "/")


def join_index(datasets: Sequence[storage.OpenedDataset], allow_new: bool, whose: Sequence[str],
               records_from: int = 0) -> Joined:
    """The index of `datasets`' records one after the other: the first one's vocabularies grown by the
    others' (`whose[k]` names dataset k in a refusal), labels and class fields remapped onto them. The
    per-record values are those of datasets[records_from:] only (an append that keeps the earlier records'
    index segments, format 1.5, reads nothing of theirs); classes, skips and parts are every dataset's."""
    check_shapes(datasets, whose)
    vocabulary = Vocabulary(list(datasets[0].manifest.classes), allow_new, "the label")
    fields = _field_vocabularies(datasets, allow_new, whose)
    root = datasets[0].manifest.compile.get("source_root")
    root = root if isinstance(root, str) else None
    labels, sizes, sources, values, warned, skipped, parts, first, crcs = [], [], [], {}, [], [], [], 0, []
    for position, (d, name) in enumerate(zip(datasets, whose)):
        m = d.manifest
        remap = vocabulary.remap(m.classes, name)
        remaps = {f.name: fields[f.name].remap(f.classes, name) if f.name in fields else None for f in m.fields}
        if position >= records_from:
            labels.append(_relabel(d.labels, remap))
            sizes.append(np.asarray(d.sizes))
            sources.append(_rebased(d, root))
            for f in m.fields:
                values.setdefault(f.name, []).append((f, np.asarray(d.fields[f.name]), remaps[f.name]))
            warned.append(storage.read_warnings(d.root, m))
            crcs.append(storage.record_checksums(d))
        mine = m.compile.get("source_root")
        skipped += [{"source": rebase(s["source"], mine, root) if root and isinstance(mine, str) and mine != root
                     else s["source"], "reason": s["reason"]} for s in storage.read_skipped(d.root, m)]
        parts += [fmt.Part(first + p.first, p.count, p.compile) for p in m.record_parts]
        first += m.count
    offsets, blob = fmt.joined_sources(sources)
    warnings = np.concatenate(warned)
    return Joined(vocabulary.names, np.concatenate(labels), np.concatenate(sizes), offsets, blob,
                  [_joined_field(pieces, fields.get(name)) for name, pieces in values.items()],
                  warnings if warnings.any() else None, sorted(skipped, key=lambda s: s["source"]), tuple(parts),
                  np.concatenate(crcs))


def _joined_field(pieces, vocabulary: Vocabulary | None) -> tuple[fmt.FieldEntry, np.ndarray]:
    """One field's values over every dataset, class indices and multi-hot positions remapped."""
    first = pieces[0][0]
    classes = tuple(vocabulary.names) if vocabulary else first.classes
    joined = []
    for f, values, remap in pieces:
        if f.kind == "class":
            values = _relabel(values, remap)
        elif f.kind == "multilabel":
            wide = np.zeros((len(values), len(classes)), dtype=f.dtype)
            wide[:, remap] = values
            values = wide
        joined.append(values)
    shape = (len(classes),) if first.kind == "multilabel" else first.shape
    spec = fmt.FieldEntry("", 0, "", first.name, first.kind, shape, classes)
    return spec, np.concatenate(joined)


@dataclass(frozen=True)
class Run:
    """Records [first, first + count) of the shard file at `path`, which holds `records` records; a shard in
    object storage has no local path but `fetch(start, stop)`, its bytes [start, stop) from the bucket."""

    path: Path | None
    first: int
    count: int
    records: int
    sha256: str
    fetch: Callable[[int, int], bytes] | None = None
    url: str = ""  # the shard object's s3://bucket/key, for a shard in a bucket
    crcs: np.ndarray | None = None  # a shard in a bucket: its records' CRC-32s, each fetched record checked


FETCH_BYTES = 32 << 20  # a shard in object storage is copied by ranged GETs of at most this much


def runs_of(d: storage.OpenedDataset, first_record: int = 0) -> list[Run]:
    """A dataset's records from `first_record` on, as runs of its shard files (fetched from the bucket when the
    dataset is in object storage)."""
    m = d.manifest
    if storage.is_url(d.root):
        from dsc.storage.bucket import Bucket  # the s3 client, imported only for a dataset in a bucket

        bucket, crcs = Bucket(str(d.root)), storage.record_checksums(d) if m.has_checksums else None
        per_shard = m.records_per_shard
        return [Run(None, lo, hi - lo, m.shards[shard].records, m.shards[shard].sha256,
                    partial(bucket.get_range, m.shards[shard].file), bucket.at(m.shards[shard].file),
                    None if crcs is None else crcs[shard * per_shard:shard * per_shard + m.shards[shard].records])
                for shard, lo, hi in fmt.shard_segments(first_record, m.count, per_shard)]
    paths = d.shard_paths()
    return [Run(paths[shard], lo, hi - lo, m.shards[shard].records, m.shards[shard].sha256)
            for shard, lo, hi in fmt.shard_segments(first_record, m.count, m.records_per_shard)]


Piece = tuple[Run, int, int]  # (a run, its first record within its shard file, how many records)


def layout(runs: Sequence[Run], records_per_shard: int) -> list[list[Piece]]:
    """`runs` one after the other laid out as shards of R records (the last the rest): each shard's pieces."""
    total = sum(r.count for r in runs)
    pieces: list[list[Piece]] = [[] for _ in fmt.shard_records(total, records_per_shard)]
    position = 0
    for run in runs:
        for shard, lo, hi in fmt.shard_segments(position, position + run.count, records_per_shard):
            pieces[shard].append((run, run.first + shard * records_per_shard + lo - position, hi - lo))
        position += run.count
    return pieces


def whole_file(pieces: Sequence[Piece]) -> Run | None:
    """The run whose whole shard file these pieces are (a shard reused as it is), or None."""
    (run, start, n) = pieces[0]
    return run if len(pieces) == 1 and start == 0 and n == run.records else None


def write_shards(root: Path, folder: str, first_shard: int, runs: Sequence[Run], records_per_shard: int,
                 record_bytes: int) -> tuple[list[fmt.ShardEntry], list[str]]:
    """Lay `runs` out as shards `first_shard`, `first_shard + 1`, ... (R records each, the last the rest) in
    `root`/`folder`; return their entries (file names relative to `root`) and how each was made."""
    (root / folder).mkdir(mode=0o755, parents=True, exist_ok=True)
    entries, how, checked = [], [], set()
    for k, shard_pieces in enumerate(layout(runs, records_per_shard)):
        name = f"{folder}/{os.path.basename(fmt.shard_file(first_shard + k))}"
        records = sum(n for _, _, n in shard_pieces)
        whole = whole_file(shard_pieces)
        for run, _, _ in shard_pieces:
            check_shard_file(run, checked)
        if whole is not None and whole.path is not None:
            how.append(local.reuse_file(whole.path, root / name))
            entries.append(fmt.ShardEntry(name, records * record_bytes, whole.sha256, records))
            continue
        fd = local.create_exclusive(root / name)
        try:
            at = 0
            for run, start, n in shard_pieces:
                _copy_piece(run, start, n, record_bytes, fd, at)
                at += n * record_bytes
            os.fsync(fd)
        finally:
            os.close(fd)
        digest = local.sha256_file(root / name)
        if whole is not None and digest != whole.sha256:
            raise CompileError(f"{whole.url}: downloaded, its SHA-256 is {digest}, its manifest says {whole.sha256}; "
                               "the object in the bucket is damaged")
        how.append("copy" if whole is None else "download")
        entries.append(fmt.ShardEntry(name, records * record_bytes, digest, records))
    return entries, how


def check_shard_file(run: Run, checked: set[Path]) -> None:
    """A local run's shard file read once and checked against its manifest's SHA-256 before any of it is reused
    or copied (a link or a copy in the kernel reads nothing, and would carry damaged bytes into a dataset
    whose manifest vouches for them); a run in a bucket has each record checked as it is fetched instead."""
    if run.path is None or run.path in checked:
        return
    digest = local.sha256_file(run.path)
    if digest != run.sha256:
        raise CompileError(f"{run.path}: its SHA-256 is {digest}, its manifest says {run.sha256}: the shard file "
                           "is damaged, so nothing was written from it (dsc verify names every damaged file)")
    checked.add(run.path)


def _copy_piece(run: Run, first: int, count: int, record_bytes: int, fd: int, at: int) -> None:
    """Records [first, first + count) of a run's shard file into the open file `fd` at byte `at`: in the kernel
    from a local file; from a bucket by bounded ranged GETs (never the whole shard in memory), each record
    checked against its CRC-32 where the dataset has them."""
    if run.fetch is None:
        with open(run.path, "rb") as source:
            local.copy_range(source.fileno(), fd, count * record_bytes, first * record_bytes, at)
        return
    step = max(1, FETCH_BYTES // record_bytes)
    for k in range(first, first + count, step):
        n = min(step, first + count - k)
        data = run.fetch(k * record_bytes, (k + n) * record_bytes)
        if len(data) != n * record_bytes:
            raise CompileError(f"{run.url}: the bucket gave {len(data)} bytes where {n * record_bytes} were asked for "
                               f"at byte {k * record_bytes}; the object is shorter than its manifest says")
        if run.crcs is not None:
            wrong = np.flatnonzero(np.array(fmt.record_checksums(data, record_bytes)) != run.crcs[k:k + n])
            if wrong.size:
                raise CompileError(f"{run.url}: record {k + int(wrong[0])} of this shard does not match its CRC-32; "
                                   "the object in the bucket is damaged, so nothing was written from it")
        os.pwrite(fd, data, at + (k - first) * record_bytes)


def write_index(root: Path, folder: str, joined: Joined) -> tuple[dict[str, fmt.FileEntry],
                                                                  tuple[fmt.FieldEntry, ...],
                                                                  fmt.FileEntry | None, fmt.SkipListEntry]:
    """Write the joined index, fields, decoder warnings and skip list into `root`/`folder` (names relative
    to `root`)."""
    where = root / folder if folder else root
    where.mkdir(mode=0o755, parents=True, exist_ok=True)
    index = output.write_index_payloads(where, fmt.encoded_index_payloads(joined.labels, joined.sizes,
                                                                          joined.offsets, joined.sources))
    fields = output.write_fields(where, joined.fields)
    warnings = output.write_warnings(where, joined.warnings) if joined.warnings is not None else None
    skip_list = output.write_skip_list(where, joined.skipped)

    def moved(entry):
        return replace(entry, file=f"{folder}/{entry.file}") if folder else entry
    return ({k: moved(e) for k, e in index.items()}, tuple(moved(f) for f in fields),
            moved(warnings) if warnings else None, moved(skip_list))


def write_checksums(root: Path, folder: str, joined: Joined) -> fmt.FileEntry:
    """Write the joined records' CRC-32s (format 1.3) into `root`/`folder` (its name relative to `root`)."""
    written = output.write_checksums(root / folder if folder else root, joined.checksums)
    return replace(written, file=f"{folder}/{written.file}") if folder else written


@dataclass
class MergeSummary:
    """What a merge did; also printed by `dsc merge`."""

    out: Path | str
    count: int
    classes: list[str]
    shard_files: list[str]  # how each was made: reflink, link, copy, download, server-side copy, upload
    seconds: float


def joined_inputs(inputs: list[str | os.PathLike]) -> tuple[list[storage.OpenedDataset], Joined, list[Run]]:
    """The datasets to merge, opened; their joined index; their records as runs of their shard files."""
    datasets = [storage.open_dataset(p) for p in inputs]
    joined = join_index(datasets, True, [os.fspath(p) for p in inputs])
    return datasets, joined, [run for d in datasets for run in runs_of(d)]


def merged_manifest(stage: Path, first: fmt.Manifest, joined: Joined, shards: list[fmt.ShardEntry],
                    folder: str = "") -> fmt.Manifest:
    """Write the joined index, (1.4) the shard table and (1.5) the class counts of its one index segment into
    `stage`/`folder` (a merge into a bucket writes under `builds/<tag>`); the merged dataset's manifest (records
    shaped as `first`'s)."""
    index, fields, warnings, skip_list = write_index(stage, folder, joined)
    checksums = write_checksums(stage, folder, joined)
    manifest = fmt.Manifest(height=first.height, width=first.width, count=len(joined.labels),
                            records_per_shard=first.records_per_shard, classes=tuple(joined.classes),
                            shards=tuple(shards), index=index, skipped=tuple(joined.skipped[:fmt.SKIPPED_IN_MANIFEST]),
                            compile=first.compile, fields=fields, skipped_list=skip_list, warnings=warnings,
                            parts=joined.parts, checksums=checksums)
    return output.write_segment(stage, folder, output.write_shard_table(stage, folder, manifest))
