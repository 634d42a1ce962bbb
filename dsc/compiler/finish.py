"""Finish: turn a build whose slots are all filled into a dataset that can be published.

Close up the slots of skipped sources (compaction), trim the shards to their final size,
make them durable, hash them, write the index, the skip list and the manifest (last), and
check the result as a reader will before it is published. Every step touches the shards one
or two at a time (`ShardFiles`), so a build of any number of shards finishes under a small
`ulimit -n`.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.compiler import journal, output
from dsc.compiler.discover import printable
from dsc.compiler.jobs import WriteJob
from dsc.compiler.shard_io import ShardFiles
from dsc.errors import CompileError, DatasetError
from dsc.storage.local import fsync_dir, fsync_files

logger = logging.getLogger("dsc")  # what a compile finds is reported here (see dsc.compiler)


class NothingDecoded(CompileError):
    """No source could be decoded: the build is discarded."""


class Unpublishable(CompileError):
    """The finished build is something the reader would refuse: it is discarded, never published."""


def compact(stage: Path, ok: np.ndarray, job: WriteJob) -> int:
    """Close up the slots of skipped sources, keeping the order of the rest; return the kept count."""
    kept = int(ok.sum())
    if kept == len(ok):
        return kept
    record_bytes = job.record_bytes
    # Runs of consecutive kept slots: each moves down by the number of skipped slots before it.
    edges = np.flatnonzero(np.diff(np.concatenate(([0], ok.astype(np.int8), [0]))))
    dst = 0
    with ShardFiles(stage, job.records_per_shard, record_bytes) as shards:
        for start, stop in zip(edges[::2].tolist(), edges[1::2].tolist()):
            if start != dst:
                shards.move(start, dst, stop - start)
            dst += stop - start
    return kept


def finish(stage: Path, job: WriteJob, ok: np.ndarray, sizes: np.ndarray, labels: np.ndarray,
           sources: list[str], classes: list[str], skipped: list[tuple[str, str]], options: dict,
           threads: int, fields: list[tuple[fmt.FieldEntry, np.ndarray]] = (),
           warned: np.ndarray | None = None) -> fmt.Manifest:
    """Close up skipped slots, make the shards durable, write index, fields and decoder warnings (per slot,
    like `labels`), each record's CRC-32, skip list and manifest (last), and check the build as `open_dataset` will."""
    journal.write_kept(stage, ok)  # state "compacting": a resume finds moved records through it
    kept = compact(stage, ok, job)
    if kept == 0:
        raise NothingDecoded(f"none of the {len(sources)} images in {job.src_root} could be decoded; nothing written")
    per_shard = job.records_per_shard
    record_bytes = job.record_bytes
    output.trim_shards(stage, kept, per_shard, record_bytes)
    fsync_files([stage / fmt.shard_file(i) for i in range(fmt.shard_count(kept, per_shard))])
    fsync_dir(stage / fmt.SHARD_DIR)  # the shards' names (trim may have removed some); the rest: write_durably
    with ThreadPoolExecutor(threads) as pool:  # `threads` files open at a time
        shards, crcs = output.hash_shards(stage, kept, per_shard, record_bytes, map_fn=pool.map)
    index = output.write_index(stage, labels[ok], sizes[ok], [s for s, k in zip(sources, ok) if k])
    written_fields = output.write_fields(stage, [(spec, values[ok]) for spec, values in fields])
    warnings = output.write_warnings(stage, warned[ok]) if warned is not None and warned[ok].any() else None
    skip_list = [{"source": printable(s), "reason": r} for s, r in skipped]
    manifest = fmt.Manifest(height=job.target.height, width=job.target.width, count=kept,
                            records_per_shard=per_shard, classes=tuple(classes), shards=shards, index=index,
                            compile=options, skipped=tuple(skip_list[:fmt.SKIPPED_IN_MANIFEST]),
                            skipped_list=output.write_skip_list(stage, skip_list), fields=written_fields,
                            warnings=warnings, checksums=output.write_checksums(stage, crcs))
    manifest = output.write_manifest(stage, manifest)
    try:  # never publish what the reader would refuse
        storage.validate(stage)
    except DatasetError as e:
        raise Unpublishable(f"the finished build would not open as a dataset, so it was not published: {e}") from e
    return manifest
