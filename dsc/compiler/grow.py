"""What the writers of a dataset's versions share, whether it is a folder (`append`, `versions`) or in a
bucket (`append_bucket`, `bucket_versions`): the records of SRC made the dataset's way, the files version
N + 1 adds, and what an append or a prune reports.
"""

from __future__ import annotations

import os
import posixpath
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.compiler import combine, output
from dsc.compiler.pipeline import compile_folder
from dsc.errors import CompileError

COMMIT_ATTEMPTS = 5  # versions built, each on the latest one, before an append that keeps losing races gives up


class VersionTaken(CompileError):
    """Another writer committed the version this one built: nothing was added."""


@dataclass
class AppendSummary:
    """What an append did; also printed by `dsc append`."""

    dataset: Path | str
    version: int
    added: int
    count: int
    skipped: int
    new_classes: list[str]
    shard_files: list[str]  # how each new shard file was made: "copy", "link", "reflink"
    seconds: float


@dataclass
class Pruned:
    """What `prune` did."""

    kept: list[int]
    removed_versions: list[int]
    removed_files: list[str]
    bytes_freed: int
    aborted_uploads: list[str] = field(default_factory=list)  # (a bucket) killed writers' unfinished uploads


def compile_options(manifest: fmt.Manifest, root: Path | str) -> dict:
    """`compile_folder`'s options that make records the way the dataset's were made (its first part)."""
    c = manifest.compile
    alpha = {text: name for name, text in fmt.ALPHA.items()}.get(c.get("alpha", fmt.ALPHA["black"]))
    missing = [k for k in ("size", "fit", "seed", "shuffle", "max_pixels") if k not in c] + \
        ([] if alpha else ["alpha"])
    if missing:
        raise CompileError(f"{root}: its manifest does not record how its records were made ({', '.join(missing)} "
                           "missing from 'compile'), so new records could not be made the same way")
    return {"size": tuple(c["size"]), "fit": c["fit"], "seed": c["seed"], "shuffle": c["shuffle"],
            "max_pixels": c["max_pixels"], "alpha": alpha,
            "fast_decode": c.get("decode", fmt.DECODE_MODE_UNRECORDED) == "fast",
            "records_per_shard": manifest.records_per_shard}


def compile_new(base: fmt.Manifest, where: Path | str, src: str | os.PathLike, out: Path, *,
                labels: str | os.PathLike | None, columns: dict[str, str] | None, **options) -> storage.OpenedDataset:
    """Compile `src` into the new folder `out` the way the records of the dataset at `where` (whose latest
    manifest is `base`) were made, its fields' kinds by default; the compiled dataset."""
    kinds = {f.name: f.kind for f in base.fields}
    if labels is not None and not base.labeled:
        kinds.setdefault("label", "none")
    table_kinds = ({**kinds, **(columns or {})} or None) if labels is not None else columns
    compile_folder(src, out, **compile_options(base, where), labels=labels, columns=table_kinds, **options)
    return storage.open_dataset(out)


def summary(dataset: Path | str, built_on: fmt.Manifest, new: storage.OpenedDataset, version: fmt.Manifest,
            joined: combine.Joined, how: list[str], started: float) -> AppendSummary:
    """What an append did; its new classes are those `version` has and `built_on` (the version it was built on,
    perhaps not the one first read: another writer's landed meanwhile) had not."""
    before = set(built_on.classes)
    return AppendSummary(dataset, version.dataset_version, new.manifest.count, version.count,
                         new.manifest.skipped_count, [c for c in joined.classes if c not in before], how,
                         time.perf_counter() - started)


def lost_every_race(dataset: Path | str, e: Exception) -> CompileError:
    return CompileError(f"{dataset}: {COMMIT_ATTEMPTS} times another writer committed the version this append built "
                        f"({e}); nothing was added: run the command again")


def refuse_a_repeat(dataset: Path | str, base: storage.OpenedDataset, new: storage.OpenedDataset) -> None:
    """Refuse to add `new`'s records when version N's last part (its compile's, or its last append's) holds
    the same ones: the same SRC, the same sources in the same order, of the same original sizes. That is what
    running an append again does when a kill or a lost connection hid that its commit had landed, and it
    would serve every one of those images twice an epoch. Cheap: the last part's records only, and their
    CRC-32s where version N has them (a drop folder reused for new images of the same names and sizes is new)."""
    b, n = base.manifest, new.manifest
    last = b.record_parts[-1]
    if not n.count or last.count != n.count or \
            last.compile.get("source_root") != n.compile.get("source_root"):
        return
    mine = np.arange(last.first, last.first + last.count)
    theirs = np.arange(n.count)
    if [_source_at(b, base.source(int(i))) for i in mine] != [_source_at(n, new.source(int(i))) for i in theirs] or \
            not np.array_equal(base.take("sizes", mine), new.take("sizes", theirs)):
        return
    same_decoder = last.compile.get("jpeg_decoder") == n.compile.get("jpeg_decoder")  # (else pixels may differ)
    if b.has_checksums and same_decoder and \
            not np.array_equal(storage.record_checksums(base)[mine], storage.record_checksums(new)):
        return  # the same names and sizes, other pixels: a folder reused for new images
    pixels = ", decoded to the same pixels" if b.has_checksums and same_decoder else ""
    raise CompileError(f"{dataset}: its version {b.dataset_version} already ends with these {n.count:,} images "
                       f"of {n.compile.get('source_root')} (records {last.first:,} to {b.count - 1:,}: the same "
                       f"sources, of the same sizes{pixels}), "
                       "added by an earlier run; nothing was added. To add them a second time, pass --again")


def _source_at(manifest: fmt.Manifest, relative: str) -> str:
    """Where a record's source was: its path (relative to the dataset's first `source_root`, perhaps through
    `..` for an appended folder) made whole, a URL's without folding its `s3://`."""
    where = fmt.source_location(str(manifest.compile.get("source_root", "")), relative)
    scheme, sep, rest = where.rpartition("://")
    return f"{scheme}{sep}{posixpath.normpath(rest)}"


def check_made_alike(dataset: Path | str, base: fmt.Manifest, new: fmt.Manifest) -> None:
    """Refuse to join records of SRC made otherwise than version N's: SRC is compiled the way of the version
    an append read first, and a `compile --force` with other options may have replaced the dataset since."""
    theirs, ours = compile_options(base, dataset), compile_options(new, dataset)
    differ = [f"{k} {ours[k]} → {theirs[k]}" for k in theirs if ours.get(k) != theirs[k]]
    if differ:
        raise CompileError(f"{dataset}: its version {base.dataset_version} makes records otherwise than the version "
                           f"this append made its new ones for ({'; '.join(differ)}): it replaced the dataset while "
                           "the append ran; nothing was added: run the command again to add them made its way")


def join_for_append(base: storage.OpenedDataset, new: storage.OpenedDataset, new_classes: bool,
                    whose: list[str]) -> tuple[combine.Joined, tuple[fmt.Segment, ...]]:
    """(1.5) The index version N + 1 writes, and the segments of version N it keeps as they are: every one
    (the new index holds the new records only), unless version N is older than 1.5 (its whole-dataset files
    lack the class counts, perhaps the checksums, a segment has: the upgrade writes them once) or a multilabel
    field gains classes, whose earlier rows would need the new columns: then none, and the new index holds
    every record in one segment, as an append did before 1.5. Records made otherwise than N's are refused
    (`check_made_alike`)."""
    check_made_alike(whose[0], base.manifest, new.manifest)
    if base.manifest.segments:
        joined = combine.join_index([base, new], new_classes, whose, records_from=1)
        before = {f.name: f.classes for f in base.manifest.fields if f.kind == "multilabel"}
        if not any(f.kind == "multilabel" and f.classes != before[f.name] for f, _ in joined.fields):
            return joined, base.manifest.segments
    return combine.join_index([base, new], new_classes, whose), ()


def next_version(root: Path, folder: str, base: storage.OpenedDataset, new: storage.OpenedDataset,
                 joined: combine.Joined, kept: tuple[fmt.Segment, ...] = ()) -> tuple[fmt.Manifest, list[str]]:
    """Write the files version N + 1 adds (`base` being version N) into `root`/`folder`: its shards from
    version N's last full one on (a partial last shard is copied with the first new records), its index
    segment (1.5: the records after the `kept` segments of N, `join_for_append`; the skip list whole), (1.4)
    the shard table of those shards (the kept ones keep their rows in N's tables); return its manifest and
    how each new shard file was made."""
    m = base.manifest
    full = m.count // m.records_per_shard  # shards kept as they are; a partial last one is copied
    runs = combine.runs_of(base, full * m.records_per_shard) + combine.runs_of(new)
    shards, how = combine.write_shards(root, f"{folder}/{fmt.SHARD_DIR}", full, runs, m.records_per_shard,
                                       m.record_bytes)
    index, fields, warnings, skip_list = combine.write_index(root, folder, joined)
    checksums = combine.write_checksums(root, folder, joined)
    manifest = fmt.Manifest(height=m.height, width=m.width, count=sum(s.count for s in kept) + len(joined.labels),
                            records_per_shard=m.records_per_shard, classes=tuple(joined.classes),
                            shards=(*m.shards[:full], *shards), index=index,
                            skipped=tuple(joined.skipped[:fmt.SKIPPED_IN_MANIFEST]), compile=m.compile,
                            fields=fields, skipped_list=skip_list, warnings=warnings,
                            dataset_version=m.dataset_version + 1, parts=joined.parts, checksums=checksums)
    manifest = output.write_shard_table(root, folder, manifest, base=m, kept=full)
    return output.write_segment(root, folder, manifest, kept), how
