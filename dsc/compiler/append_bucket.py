"""Append to a dataset in a bucket (`dsc append s3://bucket/prefix SRC`): `append` does it in a folder.

SRC is compiled on this machine, in a private temporary folder, the way the dataset's records were made;
nothing of the dataset is downloaded but its manifest, its index, its shard tables (format 1.4) and, when
partial, its last shard (whose records go into a new shard with the first new ones). Version N + 1's new
files are written locally under `appends/<random tag>/` exactly as a local append writes them (its shard
table of its new shards included), then uploaded under the same names (a new tag: no object already there
is ever written), and the version is committed by a create-only PUT (`bucket_versions.commit`). Where
another writer committed N + 1 first, this append deletes its own uploads and builds the next version
again on the new latest one, up to `append.COMMIT_ATTEMPTS` times: two racing appends both land, one after
the other; neither is lost.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import bucket_versions, grow
from dsc.compiler.grow import AppendSummary, VersionTaken
from dsc.errors import CompileError, DatasetError, StorageError
from dsc.storage.bucket import UPLOAD_PART_BYTES, Bucket

SMALL_OBJECT_BYTES = UPLOAD_PART_BYTES  # uploaded by one create-only PUT; larger ones by a multipart upload


def append_to_bucket(url: str, src: str | os.PathLike, new_classes: bool, compiling: dict,
                     started: float, again: bool = False) -> AppendSummary:
    """`append.append` for a dataset at an s3:// URL; `compiling` holds compile_folder's options for SRC."""
    base = storage.parse_manifest(url)
    scratch = Path(tempfile.mkdtemp(prefix="dsc-append-"))
    try:
        new = grow.compile_new(base, url, src, scratch / "new", **compiling)
        bucket = Bucket(url)
        for attempt in range(1, grow.COMMIT_ATTEMPTS + 1):
            try:
                version, how, joined, built_on = _commit_on_latest(bucket, new, new_classes, src,
                                                                   scratch / f"try{attempt}", again)
                break
            except VersionTaken as e:
                if attempt == grow.COMMIT_ATTEMPTS:
                    raise grow.lost_every_race(url, e) from e
            except OSError as e:  # a full disk here: nothing is committed
                raise CompileError(f"writing the next version of {url} in {scratch} failed ({e}); it is still at "
                                   "its previous version") from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return grow.summary(bucket.root, built_on, new, version, joined, how, started)


def _commit_on_latest(bucket: Bucket, new: storage.OpenedDataset, new_classes: bool, src, stage: Path,
                      again: bool) -> tuple:
    """Join the compiled records after the latest version's, write version N + 1's new files in `stage`,
    upload them and commit; VersionTaken (its uploads deleted again) when another writer committed N + 1."""
    base = storage.open_dataset(bucket.root)
    if not again:
        grow.refuse_a_repeat(bucket.root, base, new)
    joined, kept_segments = grow.join_for_append(base, new, new_classes, [bucket.root, str(src)])
    folder = fmt.append_folder(secrets.token_hex(fmt.APPEND_TAG_HEX // 2))
    stage.mkdir()
    try:
        manifest, how = grow.next_version(stage, folder, base, new, joined, kept_segments)
    except StorageError:  # the bucket did not answer: said as it is
        raise
    except DatasetError as e:  # its partial last shard gone: a writer replaced version N, a prune removed it
        found = bucket_versions.versions(bucket)
        if found and found[-1] > base.manifest.dataset_version:
            raise VersionTaken(f"{bucket.root}: reading version {base.manifest.dataset_version} failed ({e}), and "
                               f"version {found[-1]} was committed meanwhile") from e
        raise
    kept = {e.file: e.bytes for e in base.manifest.files}
    for table in {t.file for t in base.manifest.shard_tables}:  # (1.4) rows it keeps: read where it validates
        (stage / table).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(base.local_root / table, stage / table)  # fetched into the cache whole, as the index
    storage.check_manifest_text(stage, manifest.to_json().encode("ascii"), kept,  # never commit what readers refuse
                                len(kept_segments))
    names = sorted(p.relative_to(stage).as_posix() for p in (stage / folder).rglob("*") if p.is_file())
    try:
        for name in names:
            upload_file(bucket, name, stage / name)
        bucket_versions.commit(bucket, manifest, (base.local_root / fmt.MANIFEST_FILE).read_bytes())
    except VersionTaken:
        for name in names:  # listed by no version: nobody reads them
            bucket.delete(name)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest, how, joined, base.manifest


def upload_file(bucket: Bucket, name: str, path: Path) -> None:
    """Upload a new file under its name, where nothing is (a fresh tag's, an empty prefix's): a small one by a
    create-only PUT, a large one by a multipart upload (whole or not at all)."""
    if path.stat().st_size <= SMALL_OBJECT_BYTES:
        if not bucket.create(name, path.read_bytes()):
            raise CompileError(f"{bucket.at(name)}: another writer's object is already there; nothing was committed: "
                               "run the command again")
        return

    def pieces():
        with open(path, "rb") as f:
            while piece := f.read(UPLOAD_PART_BYTES):
                yield piece
    bucket.upload(name, pieces)
