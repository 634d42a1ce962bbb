"""Merge: join datasets of one record shape into a new dataset, without decoding (`dsc merge A B ... OUT`).

Records are A's, then B's, and so on; classes are matched by name into one vocabulary (A's indices
first, each later dataset's new names at the end) and labels remapped; fields must match by name
and kind, their vocabularies joined the same way (`combine`). A shard that is a whole input file in
the output's layout is reused (reflink, hard link where the storage allows), any other copied. OUT is
built beside and published like a compile (`publish.LocalTarget`): whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import combine, output, publish
from dsc.compiler.finish import Unpublishable
from dsc.errors import CompileError, DatasetError
from dsc.storage import local


@dataclass
class MergeSummary:
    """What a merge did; also printed by `dsc merge`."""

    out: Path
    count: int
    classes: list[str]
    shard_files: list[str]  # how each shard file was made: "reflink", "link" or "copy"
    seconds: float


def merge(inputs: list[str | os.PathLike], out: str | os.PathLike, force: bool = False) -> MergeSummary:
    """Join the datasets `inputs` (their latest versions) into a new dataset at `out`."""
    started = time.perf_counter()
    if len(inputs) < 2:
        raise CompileError("give at least two datasets to merge")
    if any(storage.is_url(p) for p in [*inputs, out]):
        raise CompileError("dsc merge joins dataset folders; datasets in object storage come later")
    out = Path(out).absolute()
    for p in inputs:
        given = Path(p).absolute()
        if given == out:
            raise CompileError(f"the output {out} is one of the datasets to merge; give OUT another name")
        if given in out.parents or out in given.parents:
            raise CompileError(f"the output {out} and the dataset {given} would lie one inside the other; give OUT "
                               "a folder of its own")
    datasets = [storage.open_dataset(p) for p in inputs]
    joined = combine.join_index(datasets, True, [str(p) for p in inputs])
    per_shard = datasets[0].manifest.records_per_shard
    digest = hashlib.sha256(" ".join(d.manifest.fingerprint for d in datasets).encode()).hexdigest()
    with publish.LocalTarget(out) as target:
        target.stage(force, resume=False)
        stage = target.stage_dir
        try:
            runs = [run for d in datasets for run in combine.runs_of(d)]
            first = datasets[0].manifest
            shards, how = combine.write_shards(stage, fmt.SHARD_DIR, 0, runs, per_shard, first.record_bytes)
            local.fsync_dir(stage / fmt.SHARD_DIR)
            index, fields, warnings, skip_list = combine.write_index(stage, "", joined)
            checksums = combine.write_checksums(stage, "", joined)
            manifest = fmt.Manifest(height=first.height, width=first.width, count=len(joined.labels),
                                    records_per_shard=per_shard, classes=tuple(joined.classes), shards=tuple(shards),
                                    index=index, skipped=tuple(joined.skipped[:fmt.SKIPPED_IN_MANIFEST]),
                                    compile=first.compile, fields=fields, skipped_list=skip_list, warnings=warnings,
                                    parts=joined.parts, checksums=checksums)
            manifest = output.write_manifest(stage, manifest)
            try:
                storage.validate(stage)
            except DatasetError as e:
                raise Unpublishable(f"the merged dataset would not open, so it was not published: {e}") from e
        except BaseException:
            target.discard()
            raise
        target.commit(digest, force)
    return MergeSummary(out, manifest.count, joined.classes, how, time.perf_counter() - started)
