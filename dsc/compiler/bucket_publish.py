"""Publish into object storage: what a bucket prefix holds, and the commit of a compile's build there.

A compile into `s3://bucket/prefix` writes every file of the new dataset under `builds/<tag>/` (16 random
hex digits: a new name, so nothing an opened version lists is ever overwritten) and its work objects
under `builds/<tag>/work/` (`plan.json` first, then chunk objects and shard markers). The commit is one
small object written last, create-only: `versions/NNNNNNNN.json` with `If-None-Match: *`, then
`manifest.json` refreshed with `If-Match` (formats.md, "Versions", "In object storage"). A reader opens
`manifest.json` (or lists `versions/`), so it sees the previous dataset or the new one, whole — never a
build in progress. `--force` commits the new dataset as the next version; the replaced version's objects
stay for its readers until `dsc prune`.

A build no version lists is partial: the next compile names it, `--resume` continues the one of its own
plan. No lock can show that a partial build's writer is gone (a compile or a merge still running, before
its commit, holds none): a partial build any of whose objects is younger than ABANDONED_AFTER_S is left
alone by every other command and named; an older one is abandoned, and `--force`, the next merge or `dsc
prune` deletes it. What a committed build left in `work/` (a kill between the commit and the clean-up) is
deleted by the next compile, which also refreshes a `manifest.json` that lags.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from dsc import format as fmt
from dsc.compiler.bucket_chunks import is_chunk_or_marker
from dsc.compiler.publish import already_exists
from dsc.errors import CompileError, DatasetError, NotReplaceableError, StorageError
from dsc.storage.bucket import Bucket, ObjectInfo

WORK_DIR = "work"
PLAN_FILE = "plan.json"  # in the work folder: the plan's record and digest; written first, deleted last
RESUMED_FILE = "resumed.json"  # in the work folder: written by each --resume of the build (`renew`)
LISTING_FILE = "sources.jsonl"
SHOWN = 3
DELETE_THREADS = 8  # DELETEs in flight when a build's objects go
REFRESH_ATTEMPTS = 8  # compare-and-swaps of manifest.json lost to other writers before leaving it to the next one
REFRESH_PAUSE_S = 0.05  # the most a writer waits after its first lost swap (twice that after the second, ...)
ABANDONED_AFTER_S = fmt.ABANDONED_AFTER_S  # an object no version lists is left this long to a writer uploading it

logger = logging.getLogger("dsc")


def _tag_of(name: str) -> str | None:
    """The build tag of an object a build writes under `builds/<tag>/` (a dataset file or one of its work
    objects, by the names dsc gives them), else None: another object there is not dsc's, and nothing that
    deletes builds deletes it."""
    parts = name.split("/")
    if len(parts) > 2 and parts[0] == fmt.BUILDS_DIR and fmt.is_dataset_folder_name("/".join(parts[:2])) \
            and (_is_work_name(parts[2:]) or fmt.is_dataset_file_name(name)):
        return parts[1]
    return None


def _is_work_name(parts: list[str]) -> bool:
    if parts[0] != WORK_DIR:
        return False
    rest = "/".join(parts[1:])
    return rest in (PLAN_FILE, RESUMED_FILE, LISTING_FILE) or is_chunk_or_marker(rest)


@dataclass
class PrefixState:
    """What a prefix holds: its versions' manifests (number -> bytes), `manifest.json` (bytes and ETag),
    the builds (tag -> their objects) and which of them some version lists."""

    versions: dict[int, bytes] = field(default_factory=dict)
    manifest: tuple[bytes, str] | None = None
    builds: dict[str, list[ObjectInfo]] = field(default_factory=dict)
    committed: set[str] = field(default_factory=set)
    foreign: list[str] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)  # every object listed: its size

    @property
    def latest(self) -> int:
        """The latest committed version's number; 0 when the prefix holds no dataset."""
        if self.versions:
            return max(self.versions)
        return fmt.declared_version(self.manifest[0]) if self.manifest else 0

    @property
    def partial(self) -> list[str]:
        return sorted(tag for tag in self.builds if tag not in self.committed)


def survey(dataset: Bucket) -> PrefixState:
    """List the prefix once and read every manifest in it (they are small)."""
    state = PrefixState()
    listed: set[str] = set()
    objects = dataset.list()
    state.sizes = {info.name: info.size for info in objects}
    for info in objects:
        folder, _, base = info.name.partition("/")
        if folder == fmt.VERSIONS_DIR and fmt.version_of(base) is not None:
            state.versions[fmt.version_of(base)] = dataset.get(info.name)[0]
        elif info.name == fmt.MANIFEST_FILE:
            state.manifest = dataset.get(info.name)
    for text in [*state.versions.values(), *([state.manifest[0]] if state.manifest else [])]:
        listed |= fmt.listed_files(text)
    state.committed = {tag for tag in map(_tag_of, listed) if tag}
    for info in objects:
        tag = _tag_of(info.name)
        if tag is not None:
            state.builds.setdefault(tag, []).append(info)
        elif not (info.name in listed or info.name == fmt.MANIFEST_FILE or fmt.is_dataset_file_name(info.name)
                  and info.name.startswith((f"{fmt.VERSIONS_DIR}/", f"{fmt.APPENDS_DIR}/"))):  # a killed append's
            state.foreign.append(info.name)
    if state.manifest and not state.versions and not fmt.names_this_format(state.manifest[0]):
        state.foreign.append(fmt.MANIFEST_FILE)  # another tool's: never taken for version 1 of a dataset
    return state


def check_target(dataset: Bucket, state: PrefixState, force: bool, resume: bool = False) -> None:
    """Refuse a prefix holding what is not a dsc dataset's, and an existing dataset without --force."""
    if state.foreign:
        more = len(state.foreign) - SHOWN
        names = ", ".join(state.foreign[:SHOWN]) + (f" and {more} more" if more > 0 else "")
        raise NotReplaceableError(f"output {dataset.root} holds objects that are not a dsc dataset's ({names}); dsc "
                                  "writes only under a prefix that is empty or holds a dsc dataset (even with "
                                  "--force): give another prefix")
    if state.latest and not force:
        raise already_exists(dataset.root, resume and not state.partial, " (readers that opened it keep reading it)")


def abandoned(objects: list[ObjectInfo], now: float) -> bool:
    """Whether every one of `objects` (a build's, not committed) was written ABANDONED_AFTER_S ago or more: its
    writer is gone. A build with a younger object may still be written by a live process."""
    return all(i.modified is not None and now - i.modified >= ABANDONED_AFTER_S for i in objects)


def age_of(objects: list[ObjectInfo], now: float) -> str:
    """How long ago the newest of `objects` was written, for a message."""
    newest = max((i.modified for i in objects if i.modified is not None), default=now)
    minutes = max(0, round((now - newest) / 60))
    return f"{minutes} min" if minutes < 120 else f"{minutes // 60} h"


def partial_builds(state: PrefixState, but: frozenset[str] = frozenset()) -> dict[str, list[ObjectInfo]]:
    """The partial builds of `state` (tag -> objects) but those of `but`."""
    return {tag: state.builds[tag] for tag in state.partial if tag not in but}


def clear_abandoned(dataset: Bucket, builds: dict[str, list[ObjectInfo]]) -> list[ObjectInfo]:
    """Delete the partial builds among `builds` (tag -> objects) that are abandoned; warn about the others,
    which a live compile or merge may still be writing (never deleted here: `dsc prune` removes them once
    abandoned). The objects deleted."""
    now, deleted = time.time(), []
    for tag, objects in sorted(builds.items()):
        if abandoned(objects, now):  # listed again just before: a --resume begun since made it young (`renew`)
            objects, now = [i for i in dataset.list(fmt.build_folder(tag)) if _tag_of(i.name) == tag], time.time()
            if abandoned(objects, now):
                delete_build(dataset, objects)
                deleted += objects
                continue
        logger.warning("left the partial build %s/ in place: written %s ago, it may be another compile's or merge's "
                       "still running; dsc prune deletes it once it is %d h old", dataset.at(fmt.build_folder(tag)),
                       age_of(objects, now), ABANDONED_AFTER_S // 3600)
    return deleted


def build_bucket(dataset: Bucket, tag: str) -> Bucket:
    return Bucket(dataset.at(fmt.build_folder(tag)))


def work_bucket(dataset: Bucket, tag: str) -> Bucket:
    return Bucket(dataset.at(f"{fmt.build_folder(tag)}/{WORK_DIR}"))


def renew(dataset: Bucket, tag: str) -> None:
    """Write the build's RESUMED_FILE anew: a build all of whose objects are ABANDONED_AFTER_S old counts as
    abandoned, so a resume (perhaps the next day) makes it young again, and no prune or --force elsewhere
    deletes what it is about to reuse."""
    work_bucket(dataset, tag).put(RESUMED_FILE, json.dumps({"resumed_at": time.time()}).encode())


def read_plan(dataset: Bucket, tag: str) -> dict | None:
    """The plan a build was made from ({"record", "digest"}), or None when it has no whole one."""
    try:
        plan = json.loads(work_bucket(dataset, tag).get(PLAN_FILE)[0])
    except StorageError:
        raise  # the bucket did not answer: that says nothing about the build (never taken for one without a plan)
    except (ValueError, DatasetError):
        return None
    return plan if isinstance(plan, dict) and isinstance(plan.get("record"), dict) else None


def unfinished(objects: list[ObjectInfo]) -> set[str]:
    """The tags of the builds among `objects` that still hold their plan: partial ones (which the next compile
    names, and a --resume continues) and committed ones not yet cleaned up."""
    return {tag for tag in map(_tag_of, (i.name for i in objects if i.name.endswith(f"/{WORK_DIR}/{PLAN_FILE}")))
            if tag}


def new_build(dataset: Bucket, record: dict, digest: str, listing: list[str]) -> str:
    """Start a build: its listing, then its plan (whose presence marks it); its tag."""
    tag = secrets.token_hex(fmt.APPEND_TAG_HEX // 2)
    work = work_bucket(dataset, tag)
    work.put(LISTING_FILE, ("\n".join(listing) + "\n").encode())
    work.put(PLAN_FILE, json.dumps({"record": record, "digest": digest}, indent=1, sort_keys=True).encode())
    return tag


def delete_build(dataset: Bucket, objects: list[ObjectInfo], keep: set[str] = frozenset()) -> None:
    """Delete a build's objects (of `objects`, those with names a build gives: another tool's object in its
    folder stays) but `keep` (names relative to the prefix), its plan last: a deletion a kill cut short still
    looks like a build."""
    mine = [i.name for i in objects if _tag_of(i.name) is not None and i.name not in keep]
    plan = [name for name in mine if name.endswith(f"/{WORK_DIR}/{PLAN_FILE}")]
    with ThreadPoolExecutor(DELETE_THREADS) as pool:
        list(pool.map(dataset.delete, [name for name in mine if name not in plan]))
    for name in plan:
        dataset.delete(name)


def tidy(dataset: Bucket, state: PrefixState) -> None:
    """What a kill after a commit left: a `manifest.json` behind the latest version, then the committed builds'
    work objects (their plans last: until then a resume knows its build was committed)."""
    if state.versions:
        refresh_manifest(dataset, state.versions[state.latest], state.latest)
    for tag in sorted(state.committed & set(state.builds)):
        work = [i for i in state.builds[tag] if i.name.startswith(f"{fmt.build_folder(tag)}/{WORK_DIR}/")]
        if work:
            delete_build(dataset, work)


def refresh_manifest(dataset: Bucket, text: bytes, version: int) -> None:
    """Make `manifest.json` the copy of committed version `version` (`swap_manifest`, up to REFRESH_ATTEMPTS
    tries a short random pause apart). One left behind (its swaps all refused, the bucket not answering, another
    tool's file in its place) is said in a warning and left to the next writer: the version is committed either
    way and dsc's readers list versions/, so the writer still succeeded."""
    why = (f"{REFRESH_ATTEMPTS} compare-and-swaps of it were refused (other writers kept changing it, or the server "
           "refuses If-Match)")
    then = ("readers that do not list versions/ (dsc's do) read what it names until the next append, prune or "
            f"compile into {dataset.root} refreshes it")
    try:
        for attempt in range(REFRESH_ATTEMPTS):
            if swap_manifest(dataset, text, version):
                return
            if attempt + 1 < REFRESH_ATTEMPTS:
                time.sleep(random.uniform(0, REFRESH_PAUSE_S * (attempt + 1)))  # racing writers fall out of step
    except StorageError as e:
        why = str(e)
    except NotReplaceableError as e:
        why, then = str(e), f"move it away, and the next append, prune or compile into {dataset.root} writes dsc's copy"
    logger.warning("%s does not name committed version %d: %s; %s", dataset.at(fmt.MANIFEST_FILE), version, why, then)


def swap_manifest(dataset: Bucket, text: bytes, version: int) -> bool:
    """One try at making `manifest.json` the copy of version `version` (its bytes `text`): created if missing,
    else replaced only if it is still the copy read (If-Match) and of no later version (never regressing it).
    True when it holds that copy or a later version's; False when another writer changed it meanwhile;
    NotReplaceableError when it is not a dsc manifest (another tool's file, which dsc never writes over)."""
    if dataset.head(fmt.MANIFEST_FILE) is None:
        return dataset.create(fmt.MANIFEST_FILE, text)
    current, etag = dataset.get(fmt.MANIFEST_FILE)
    if not fmt.names_this_format(current):
        raise NotReplaceableError("it is not a dsc manifest (another tool's file?), and dsc never writes over one")
    if current == text or fmt.declared_version(current) > version:
        return True
    return dataset.replace(fmt.MANIFEST_FILE, text, etag)


def commit(dataset: Bucket, manifest: fmt.Manifest, force: bool) -> fmt.Manifest:
    """Commit `manifest` as the next version (version 1 of an empty prefix): create-only, then refresh
    `manifest.json`. Another writer's commit of the same number meanwhile fails this one, adding nothing; a
    latest version that is `manifest` itself (an earlier run's commit of the same build) is taken as it is."""
    state = survey(dataset)
    if fmt.MANIFEST_FILE in state.foreign:
        raise NotReplaceableError(f"{dataset.at(fmt.MANIFEST_FILE)}, another tool's (not a dsc manifest), appeared "
                                  "while the dataset was compiled; nothing was committed over it")
    gone = [e.file for e in manifest.files if state.sizes.get(e.file) != e.bytes]
    if gone:  # deleted meanwhile (a prune or another compile's --force took the build for an abandoned one)
        raise CompileError(f"{dataset.at(gone[0])}{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}: written "
                           "by this compile, now missing or of another size in the bucket; nothing was committed: "
                           "run the same command with --resume to write it again")
    if state.versions:  # this very manifest, committed by an earlier run of the build: a driver killed with its
        # create-only PUT in flight, which landed after this run (its --resume) had looked
        ours = replace(manifest, dataset_version=state.latest)
        if state.versions[state.latest] == ours.to_json().encode("ascii"):
            refresh_manifest(dataset, state.versions[state.latest], state.latest)
            return ours
    if state.latest and not force:
        raise CompileError(f"{dataset.root} appeared while the dataset was compiled; it was left untouched, and the "
                           "finished build waits: pass --force --resume to make it the next version")
    if state.manifest and not state.versions:  # a dataset made before versions: it keeps its version 1
        dataset.create(fmt.version_file(state.latest), state.manifest[0])
    number = state.latest + 1
    if number > fmt.MAX_DATASET_VERSION:
        raise CompileError(f"{dataset.root} has {state.latest} versions already; prune it or give another prefix")
    made = replace(manifest, dataset_version=number)
    text = made.to_json().encode("ascii")
    if not dataset.create(fmt.version_file(number), text):
        raise CompileError(f"another writer committed version {number} of {dataset.root} first; nothing of this "
                           "compile was published: run it again with --resume --force to commit it after that one")
    refresh_manifest(dataset, text, number)
    return made
