"""Merge: join datasets of one record shape into a new dataset, without decoding (`dsc merge A B ... OUT`).

Records are A's, then B's, and so on; classes are matched by name into one vocabulary (A's indices
first, each later dataset's new names at the end) and labels remapped; fields must match by name
and kind, their vocabularies joined the same way (`combine`). A shard that is a whole input file in
the output's layout is reused (reflink, hard link where the storage allows), any other copied; every input
shard file is read once first and checked against its SHA-256 (a link carries damaged bytes as they are). OUT is
built beside and published like a compile (`publish.LocalTarget`): whole or not at all. Any dataset may be
in a bucket (s3://): its shards are then read by bounded ranged GETs; an OUT in a bucket is `merge_bucket`'s.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import output, publish
from dsc.compiler.combine import MergeSummary, joined_inputs, merged_manifest, write_shards
from dsc.compiler.finish import Unpublishable
from dsc.errors import CompileError, DatasetError
from dsc.storage import local


def merge(inputs: list[str | os.PathLike], out: str | os.PathLike, force: bool = False) -> MergeSummary:
    """Join the datasets `inputs` (their latest versions; folders or s3:// URLs) into a new dataset at `out` (a
    folder, or an s3:// URL: `merge_bucket`)."""
    started = time.perf_counter()
    if len(inputs) < 2:
        raise CompileError("give at least two datasets to merge")
    if storage.is_url(out):
        from dsc.compiler.merge_bucket import merge_into_bucket

        return merge_into_bucket(inputs, os.fspath(out), force, started)
    out = Path(out).absolute()
    real_out = out.resolve()  # `..` and links resolved: `A/shards/..` is A
    for p in inputs:
        given = None if storage.is_url(p) else Path(p).resolve()
        if given == real_out:
            raise CompileError(f"the output {out} is one of the datasets to merge; give OUT another name")
        if given is not None and (given in real_out.parents or real_out in given.parents):
            raise CompileError(f"the output {out} and the dataset {p} would lie one inside the other; give OUT "
                               "a folder of its own")
    datasets, joined, runs = joined_inputs(inputs)
    digest = hashlib.sha256(" ".join(d.manifest.fingerprint for d in datasets).encode()).hexdigest()
    first = datasets[0].manifest
    with publish.LocalTarget(out) as target:
        target.stage(force, resume=False, command="merge")
        stage = target.stage_dir
        try:
            shards, how = write_shards(stage, fmt.SHARD_DIR, 0, runs, first.records_per_shard, first.record_bytes)
            local.fsync_dir(stage / fmt.SHARD_DIR)
            manifest = output.write_manifest(stage, merged_manifest(stage, first, joined, shards))
            try:
                storage.validate(stage)
            except DatasetError as e:
                raise Unpublishable(f"the merged dataset would not open, so it was not published: {e}") from e
        except BaseException:
            target.discard()
            raise
        target.commit(digest, force)
    return MergeSummary(out, manifest.count, joined.classes, how, time.perf_counter() - started)
