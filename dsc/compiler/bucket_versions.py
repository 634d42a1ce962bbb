"""Versions of a dataset in a bucket (format 1.3, formats.md "Versions", "In object storage"): commit a new
one, refresh `manifest.json`, prune old ones (`dsc.compiler.versions` does the same in a dataset folder).

No lock can be held on a bucket, so the commit is the create-only PUT of `versions/NNNNNNNN.json`
(`If-None-Match: *`): of two writers that built version N + 1, exactly one creates it; the other learns so
(`VersionTaken`) and adds nothing. `manifest.json`, the copy of the latest version for readers that do not
list, is then replaced only by compare-and-swap (`If-Match` on the ETag read just before), never by an
older version than it holds.

An object no version lists may be an upload of an append that has not committed yet (it has no lock to
show): prune deletes such an object only once it is `bucket_publish.ABANDONED_AFTER_S` old; an object only
pruned versions list is deleted at once. A build (`builds/<tag>/`, a compile's or a merge's) that no version
lists is partial: prune deletes it whole, its work objects included, once every object of it is that old
(its writer is gone), else leaves it whole for its writer or its --resume. A prefix where a killed merge or
compile left partial builds but no dataset is pruned of its abandoned builds only.
"""

from __future__ import annotations

import time

from dsc import format as fmt
from dsc.compiler import bucket_publish as bp
from dsc.compiler.grow import Pruned, VersionTaken
from dsc.errors import CompileError, DatasetError
from dsc.storage import parse_manifest
from dsc.storage.bucket import Bucket


def versions(bucket: Bucket) -> list[int]:
    """The committed versions, oldest first (one LIST of versions/); [] when there are none."""
    found = (fmt.version_of(o.name.removeprefix(f"{fmt.VERSIONS_DIR}/")) for o in bucket.list(fmt.VERSIONS_DIR))
    return sorted(v for v in found if v is not None)


def commit(bucket: Bucket, manifest: fmt.Manifest, first: bytes) -> None:
    """Make `manifest` (version N, whose objects are all uploaded) the latest version: create
    `versions/NNNNNNNN.json`, never replacing one; VersionTaken when another writer made it. `first` is the
    bytes of `manifest.json` the writer read version 1 from, saved as `versions/00000001.json` when N is 2."""
    if manifest.dataset_version == 2 and not bucket.create(fmt.version_file(1), first):
        raise VersionTaken(f"{bucket.root}: its version 1 was saved by another writer with other bytes than the "
                           f"{fmt.MANIFEST_FILE} this one read (was it replaced meanwhile?); nothing was added")
    if not bucket.create(fmt.version_file(manifest.dataset_version), manifest.to_json().encode("ascii")):
        raise VersionTaken(f"{bucket.root}: version {manifest.dataset_version} was committed by another writer "
                           "meanwhile; nothing was added")
    refresh_copy(bucket)


def refresh_copy(bucket: Bucket) -> None:
    """`manifest.json` := the latest version's manifest (`bucket_publish.refresh_manifest`)."""
    found = versions(bucket)
    if found:
        bp.refresh_manifest(bucket, bucket.get(fmt.version_file(found[-1]))[0], found[-1])


def manifests(bucket: Bucket, found: list[int]) -> dict[str, bytes]:
    """Every version's manifest and `manifest.json`, by name; DatasetError when one cannot be read (what
    deletes the objects no version lists must know them all)."""
    texts = {}
    for name in [fmt.MANIFEST_FILE, *(fmt.version_file(v) for v in found)]:
        text, _ = bucket.get(name)
        if not fmt.names_this_format(text):
            raise DatasetError(f"{bucket.at(name)}: not a readable dsc manifest; which objects the dataset's versions "
                               "use cannot be told, so none is deleted (move the damaged manifest away)")
        texts[name] = text
    return texts


def _committed_since(bucket: Bucket, found: list[int]) -> set[str]:
    """The objects that versions committed since `found` was listed name. Asked after prune's LIST of the
    objects: a compile's build committed before that LIST is in a version this finds (its plan, which keeps
    prune off a build, goes only after its commit), one committed after it still had its plan there."""
    return set().union(*(fmt.listed_files(bucket.get(fmt.version_file(v))[0])
                         for v in versions(bucket) if v not in found))


def prune(url: str, keep: int) -> Pruned:
    """Keep the `keep` newest versions of the dataset at `url`; delete the other versions' manifests, then
    the objects with names dsc gives that no kept version lists (module docstring), never another object."""
    if keep < 1:
        raise CompileError(f"--keep must be at least 1 (the latest version), got {keep}")
    bucket = Bucket(url)
    try:
        parse_manifest(url)  # a dataset, whole: refuse anything else before deleting anything
    except DatasetError:
        state = bp.survey(bucket)
        if state.latest or state.foreign or not state.builds:
            raise
        gone = bp.clear_abandoned(bucket, bp.partial_builds(state))  # a killed merge's or compile's, no dataset yet
        return Pruned([], [], [o.name for o in gone], sum(o.size for o in gone), _abort_abandoned_uploads(bucket))
    refresh_copy(bucket)
    found = versions(bucket)
    texts = manifests(bucket, found)
    kept, dropped = found[-keep:], found[:-keep]
    listed = {fmt.MANIFEST_FILE, *fmt.listed_files(texts[fmt.MANIFEST_FILE])}
    for v in kept:
        listed |= fmt.listed_files(texts[fmt.version_file(v)])
    obsolete = set().union(*(fmt.listed_files(texts[fmt.version_file(v)]) for v in dropped)) - listed
    for v in dropped:  # manifests first: nobody opens a pruned version half-deleted
        bucket.delete(fmt.version_file(v))
    removed, freed, now = [], 0, time.time()
    objects = bucket.list()
    listed |= _committed_since(bucket, found)
    building = bp.unfinished(objects)
    # a build some version lists, kept or dropped, is committed: a dropped one's files go at once (obsolete)
    committed = {bp._tag_of(name) for name in listed | obsolete} | {None}  # None: a name outside builds/
    partial: dict[str, list] = {}
    for obj in objects:
        if (tag := bp._tag_of(obj.name)) not in committed:
            partial.setdefault(tag, []).append(obj)
    for obj in objects:
        name = obj.name
        if name in listed or not fmt.is_dataset_file_name(name) or name.startswith(f"{fmt.VERSIONS_DIR}/") \
                or bp._tag_of(name) in partial:
            continue
        if name not in obsolete and (obj.modified is None or now - obj.modified < bp.ABANDONED_AFTER_S
                                     or bp._tag_of(name) in building):
            continue  # listed by no version: maybe an append's upload not committed yet
        bucket.delete(name)
        removed.append(name)
        freed += obj.size
    gone = bp.clear_abandoned(bucket, partial)
    return Pruned(kept or [1], dropped, removed + [o.name for o in gone], freed + sum(o.size for o in gone),
                  _abort_abandoned_uploads(bucket))


def _abort_abandoned_uploads(bucket: Bucket) -> list[str]:
    """The multipart uploads a killed writer left unfinished under the dataset (objects dsc names only), once
    they are as old as an abandoned build: no listing of objects shows them, so nothing else finds them."""
    from dsc.storage import compose

    return compose.abort_abandoned(bucket.bucket, bucket.prefix, bp.ABANDONED_AFTER_S, fmt.is_dataset_file_name,
                                   bucket.root)
