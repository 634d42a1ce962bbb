"""Merge into a bucket (`dsc merge A B ... s3://bucket/prefix`): `merge` does it into a folder.

The joined index is written in a private temporary folder on this machine and uploaded. Each shard of OUT
that is a whole shard of an input is reused: copied server-side when the input is in OUT's bucket (no byte
up from this machine; the copy is read back once and checked against the input's SHA-256, as any input's
bytes are before the merge vouches for them), uploaded from its file (checked) when it is local; any other
shard is assembled in the
temporary folder (from files, or by bounded ranged GETs) and uploaded, then deleted there, one at a time.
Every object goes under a fresh `builds/<tag>/`, as a compile's (server-side copies and multipart uploads
are not create-only: a name of its own is what keeps two merges racing into one prefix from overwriting
each other's shards), and the merge commits as a compile does: version 1 by a create-only PUT of
`versions/00000001.json`, then `manifest.json` (`bucket_publish.commit`). Of two racing merges one commits;
the other deletes its build, as a merge that fails does. A killed merge leaves a partial build no version
lists: the next merge names it and merges beside it, deleting it once abandoned, as `dsc prune` does. OUT
must hold no dataset.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import bucket_publish as bp
from dsc.compiler import combine
from dsc.compiler.append_bucket import upload_file
from dsc.compiler.combine import MergeSummary, joined_inputs, merged_manifest
from dsc.errors import CompileError, DscError
from dsc.storage.bucket import Bucket
from dsc.storage.s3 import parse_url

logger = logging.getLogger("dsc")


def merge_into_bucket(inputs: list[str | os.PathLike], out: str, force: bool, started: float) -> MergeSummary:
    """`merge.merge` for an s3:// OUT."""
    bucket = Bucket(out)
    if force:
        raise CompileError(f"{bucket.root}: --force cannot replace a dataset in a bucket; delete it first, or merge "
                           "into a new prefix")
    for given in (Bucket(os.fspath(p)).root for p in inputs if storage.is_url(p)):
        if given == bucket.root:
            raise CompileError(f"the output {bucket.root} is one of the datasets to merge; give OUT another name")
        if given.startswith(f"{bucket.root}/") or bucket.root.startswith(f"{given}/"):
            raise CompileError(f"the output {bucket.root} and the dataset {given} would lie one inside the other; "
                               "give OUT a prefix of its own")
    state = bp.survey(bucket)
    if state.latest or state.foreign:
        raise CompileError(f"{bucket.root}: already holds {'a dataset' if state.latest else 'objects'}; a merge "
                           "writes a new dataset into a prefix holding none: give another prefix")
    bp.clear_abandoned(bucket, bp.partial_builds(state))  # a killed merge's or compile's; a younger one: named
    datasets, joined, runs = joined_inputs(inputs)
    first = datasets[0].manifest
    folder = fmt.build_folder(secrets.token_hex(fmt.APPEND_TAG_HEX // 2))
    stage = Path(tempfile.mkdtemp(prefix="dsc-merge-"))
    try:
        shards, how = _shards(bucket, stage, folder, runs, first)
        manifest = replace(merged_manifest(stage, first, joined, shards, folder), dataset_version=1)
        text = manifest.to_json().encode("ascii")
        storage.check_manifest_text(stage, text, {e.file: e.bytes for e in shards})  # never publish what readers refuse
        for path in sorted(p for p in stage.rglob("*") if p.is_file()):
            upload_file(bucket, path.relative_to(stage).as_posix(), path)
    except DscError:
        _delete_quietly(bucket, folder)  # no version lists it: nothing of a merge that stopped is kept
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _commit(bucket, folder, text)
    return MergeSummary(bucket.root, manifest.count, joined.classes, how, time.perf_counter() - started)


def _delete_quietly(bucket: Bucket, folder: str) -> None:
    """Delete a merge's build; where the bucket does not answer, it is left to the next merge or prune (as a
    killed merge's is)."""
    try:
        bp.delete_build(bucket, bucket.list(folder))
    except DscError as e:
        logger.warning("could not delete %s/ (%s): the next merge or prune into %s deletes it once abandoned",
                       bucket.at(folder), e, bucket.root)


def _commit(bucket: Bucket, folder: str, text: bytes) -> None:
    """Commit the merged dataset (its manifest's bytes) as version 1 of OUT, create-only, then `manifest.json`;
    when another writer committed a version 1 first, delete this merge's build (no version lists it) and say so."""
    if not bucket.create(fmt.version_file(1), text):
        bp.delete_build(bucket, bucket.list(folder))
        raise CompileError(f"{bucket.root}: another merge or compile committed a dataset there first; this merge's "
                           "objects were deleted and that dataset is untouched: merge into another prefix")
    bp.refresh_manifest(bucket, text, 1)


def _shards(bucket: Bucket, stage: Path, folder: str, runs: list[combine.Run],
            first: fmt.Manifest) -> tuple[list, list[str]]:
    """Write OUT's shards into the bucket under `folder`, each the cheapest way (module docstring); their
    entries, and how."""
    entries, how = [], []
    whole_bucket = Bucket(f"s3://{bucket.bucket}")  # names whole keys: a server-side copy between prefixes
    for k, pieces in enumerate(combine.layout(runs, first.records_per_shard)):
        name, whole = f"{folder}/{fmt.shard_file(k)}", combine.whole_file(pieces)
        source = _object_of(whole)
        if source is not None and source[0] == bucket.bucket:
            whole_bucket.copy(source[1], bucket.key(name))
            _check_copy(bucket, name, whole, whole.records * first.record_bytes)
            entries.append(fmt.ShardEntry(name, whole.records * first.record_bytes, whole.sha256, whole.records))
            how.append("server-side copy")
            continue
        part = [replace(r, first=start, count=n) for r, start, n in pieces]
        (entry,), _ = combine.write_shards(stage, f"{folder}/{fmt.SHARD_DIR}", k, part, first.records_per_shard,
                                           first.record_bytes)
        upload_file(bucket, name, stage / name)
        (stage / name).unlink()
        entries.append(entry)
        how.append("upload" if whole is not None else "copy")
    return entries, how


def _check_copy(bucket: Bucket, name: str, run: combine.Run, size: int) -> None:
    """A shard copied server-side (`size` bytes), read back by bounded ranged GETs and checked against its
    input's SHA-256: the copy carries the input object's bytes, whatever they are, and the new manifest vouches
    for them."""
    digest = hashlib.sha256()
    for start in range(0, size, combine.FETCH_BYTES):
        digest.update(bucket.get_range(name, start, min(size, start + combine.FETCH_BYTES)))
    if digest.hexdigest() != run.sha256:
        raise CompileError(f"{run.url}: its server-side copy has SHA-256 {digest.hexdigest()}, its manifest says "
                           f"{run.sha256}: the object (or the copy) is damaged, so the merge stopped and committed "
                           "nothing (dsc verify on the input says which)")


def _object_of(run: combine.Run | None) -> tuple[str, str] | None:
    """(bucket, key) of a run's shard object when it is in a bucket, else None."""
    return parse_url(run.url) if run is not None and run.url else None
