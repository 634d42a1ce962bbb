"""Compile into object storage (`dsc compile SRC s3://bucket/prefix`), with no shared file system anywhere.

The driver handles only small metadata: the plan, each slot's outcome, the index. The engine's workers
(local processes or Ray tasks) decode their chunks and write each as one chunk object; once every slot
is done, workers assemble each shard from those objects, skipped sources closed up on the way, by
server-side copies of their byte ranges (`bucket_chunks`: each record is uploaded once); the driver
writes the index files and commits the manifest (`bucket_publish`). Every object's bytes are those of
the file a compile into a folder writes for the same SRC and options (only the manifest differs: it
names them under `builds/<tag>/`).

A killed compile is continued by the same command with `--resume`: the build's work folder is listed,
and every chunk object (by its trailer) and assembled shard (by its marker, which names the object's
ETag and its records' CRC-32s) is reused; the rest is done again. A chunk whose worker was stopped before
it wrote the object (a stalled worker) is decoded again in another round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from dsc import format as fmt
from dsc.compiler import bucket_chunks as chunks
from dsc.compiler import bucket_publish as bp
from dsc.compiler.decoding import Plan, StrictFailure, decode_all, make_chunks
from dsc.compiler.discover import printable
from dsc.compiler.finish import NothingDecoded, Unpublishable
from dsc.compiler.jobs import Engine, SlotResult
from dsc.errors import CompileError, DatasetError, Interrupted, StorageError
from dsc.storage.bucket import Bucket
from dsc.storage.compose import PART_MIN

ROUNDS = 3  # decoding rounds for slots whose chunk object was never written (a stalled worker's)
CHUNK_BYTES = 64 << 20  # a chunk's records at most: a worker holds them in memory until its chunk object's PUT
# and PART_MIN at least (where each worker still gets a chunk): a chunk whole is one part the server copies
logger = logging.getLogger("dsc")


class _NoJournal:
    """The chunk objects are a bucket build's journal: nothing to append on the driver's side."""

    def append(self, results: list[SlotResult]) -> None:
        pass


def build_and_publish(url: str, plan: Plan, runner: Engine, force: bool, resume: bool, strict: bool,
                      on_skip: Callable[[str, str], None], progress: Callable[[int], None] | None
                      ) -> tuple[fmt.Manifest, int, list[tuple[str, str]]]:
    """Stage → build → commit into `url`; (the committed manifest, slots a resume reused, the skips)."""
    dataset = Bucket(url)
    state = bp.survey(dataset)
    finished = _finished_build(dataset, state, plan) if resume else None
    bp.tidy(dataset, state)
    if finished is not None:
        return finished, len(plan.sources), _skips(dataset, finished)
    bp.check_target(dataset, state, force, resume)
    tag = _stage(dataset, state, plan, force, resume)
    if tag is None:
        tag = bp.new_build(dataset, plan.record, plan.digest, plan.listing)
        resumed = False
    else:
        resumed = True
        bp.renew(dataset, tag)
    kept = f"{dataset.at(fmt.build_folder(tag))}/"
    try:
        manifest, reused, skipped = _build(dataset, tag, plan, runner, resumed, strict, on_skip, progress)
    except (StrictFailure, NothingDecoded, Unpublishable):  # a verdict on the data: nothing worth resuming
        bp.delete_build(dataset, dataset.list(fmt.build_folder(tag)))
        raise
    except StorageError as e:
        raise CompileError(f"{e}; the work so far is kept in {kept}: fix the cause and run the same command with "
                           "--resume to continue") from e
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted; nothing was committed to {dataset.root}, which holds what it held before; "
                          f"the work so far is kept in {kept}: add --resume to continue") from None
    try:
        made = bp.commit(dataset, manifest, force)
    except StorageError as e:
        raise CompileError(f"{e}; the finished build is kept in {kept}: fix the cause and run the same command with "
                           "--resume to commit it") from e
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted while committing {dataset.root}: it holds what it held before or the new "
                          "dataset, never a mix: add --resume to finish") from None
    listed = {f.file for f in made.files}
    try:
        bp.delete_build(dataset, dataset.list(fmt.build_folder(tag)), keep=listed)  # its work objects
    except KeyboardInterrupt:
        raise Interrupted(f"interrupted after {dataset.root} committed the new dataset (version "
                          f"{made.dataset_version}); the clean-up of its work objects in {kept} was cut short: the "
                          "next compile, append or prune deletes them") from None
    return made, reused, skipped


def _finished_build(dataset: Bucket, state: bp.PrefixState, plan: Plan) -> fmt.Manifest | None:
    """The latest version, when a compile of this plan committed it and was killed before its clean-up."""
    text = state.versions.get(state.latest) if state.versions else None
    tags = {bp._tag_of(name) for name in fmt.listed_files(text)} if text else set()
    for tag in tags & set(state.builds):
        if tag and (bp.read_plan(dataset, tag) or {}).get("digest") == plan.digest:
            return fmt.parse_manifest(text, dataset.root, lambda name, where: _size(state, name),
                                      lambda name, limit: dataset.get(name)[0][:limit])
    return None


def _skips(dataset: Bucket, manifest: fmt.Manifest) -> list[tuple[str, str]]:
    """The committed dataset's skip list, whole."""
    entry = manifest.skipped_list
    skipped = fmt.parse_skip_list(dataset.get(entry.file)[0], entry, dataset.root) if entry else manifest.skipped
    return [(s["source"], s["reason"]) for s in skipped]


def _size(state: bp.PrefixState, name: str) -> int:
    for objects in state.builds.values():
        for info in objects:
            if info.name == name:
                return info.size
    raise DatasetError(f"{name}: missing")


def _stage(dataset: Bucket, state: bp.PrefixState, plan: Plan, force: bool, resume: bool) -> str | None:
    """The partial build to continue (its tag), or None for a new one; partial builds of others are named
    (refused) or, with --force, left beside the new one: deleted only when abandoned (`bp.clear_abandoned`)."""
    partial = state.partial
    if resume:
        plans = {tag: bp.read_plan(dataset, tag) for tag in partial}
        mine = [tag for tag, p in plans.items() if p and p.get("digest") == plan.digest]
        if mine:
            return mine[0]
        planned = frozenset(tag for tag in partial if plans[tag] is not None)  # the others: nothing to resume
        partial = [tag for tag in partial if plans[tag] is not None]
        bp.clear_abandoned(dataset, bp.partial_builds(state, but=planned))
        if partial:
            saved = plans[partial[0]]
            differ = sorted(k for k in {*saved["record"], *plan.record} if saved["record"].get(k) != plan.record.get(k))
            raise CompileError(f"cannot resume {dataset.at(fmt.build_folder(partial[0]))}/: made with other "
                               f"settings or sources ({', '.join(differ)}); run it with its own settings "
                               "and --resume, or pass --force to start over")
        logger.warning("nothing to resume at %s: compiling from scratch", dataset.at(fmt.BUILDS_DIR))
        return None
    if partial and not force:
        where = dataset.at(fmt.build_folder(partial[0]))
        raise CompileError(f"an interrupted compile left a partial build at {where}/: "
                           "run the command that started it again with --resume to continue it (with the same "
                           "options: with others --resume is refused), or pass --force to compile anew (the partial "
                           "build is then deleted if nothing wrote to it for a day, else left for a later compile or "
                           "`dsc prune` to delete once nothing has)")
    bp.clear_abandoned(dataset, bp.partial_builds(state))  # a younger one may be another live compile's: left
    return None


def _build(dataset: Bucket, tag: str, plan: Plan, runner: Engine, resumed: bool, strict: bool,
           on_skip: Callable[[str, str], None], progress: Callable[[int], None] | None
           ) -> tuple[fmt.Manifest, int, list[tuple[str, str]]]:
    work, build = bp.work_bucket(dataset, tag), bp.build_bucket(dataset, tag)
    rb = plan.job.record_bytes
    job = replace(plan.job, stage=work.root, max_chunk=max(1, CHUNK_BYTES // rb), min_chunk=-(-PART_MIN // rb))
    count, record_bytes = job.count, job.record_bytes
    placed = {s: p for s, p in chunks.read_chunks(work, record_bytes).items() if s < count} if resumed else {}
    done = {slot: where.result for slot, where in placed.items()}
    ok, _, failed, _ = decode_all(job, plan, runner, strict, done, _NoJournal(), on_skip, progress)
    placed = chunks.read_chunks(work, record_bytes)
    for _ in range(ROUNDS):
        missing = [slot for slot in range(count) if ok[slot] and slot not in placed]
        if not missing:
            break
        runner.fill(job, make_chunks(job, plan, missing, runner.workers), lambda results: None)
        placed = chunks.read_chunks(work, record_bytes)
    else:
        raise CompileError(f"{len(missing)} decoded records never reached {work.root}; run the same command with "
                           "--resume to continue")
    reasons = {source: reason for source, reason in failed}  # a stalled source's skip is in no chunk object
    results = [placed[s].result if s in placed else SlotResult(s, reason=reasons[plan.sources[s]])
               for s in range(count)]
    kept = [r.slot for r in results if r.ok]
    if not kept:
        raise NothingDecoded(f"none of the {count} images in {job.src_root} could be decoded; nothing written")
    shards = _assemble(build, work, chunks.recipes(placed, kept, job.records_per_shard), runner, record_bytes)
    skipped = sorted(plan.found.skipped + [(plan.sources[r.slot], r.reason) for r in results if not r.ok])
    manifest = _write_index(build, dataset, tag, plan, results, shards, skipped)
    return manifest, len(done), skipped


def _assemble(build: Bucket, work: Bucket, wanted: list[chunks.ShardRecipe], runner: Engine,
              record_bytes: int) -> list[fmt.ShardEntry]:
    """Every shard's object, assembled by the workers (those a resume finds whole are kept); their entries."""
    held = chunks.read_markers(work, build, wanted)
    todo = [r for r in wanted if r.shard not in held]
    problems: list[str] = []

    def check(results: list[SlotResult]) -> None:
        problems.extend(f"shard {r.slot}: {r.reason}" for r in results if not r.ok)
    if todo:
        runner.fill(chunks.AssembleJob(build.root, work.root, record_bytes), [[(r.shard, r)] for r in todo], check)
    if problems:
        raise CompileError(f"{problems[0]}; run the same command with --resume to continue")
    held = chunks.read_markers(work, build, wanted)
    if len(held) != len(wanted):
        raise CompileError(f"{len(wanted) - len(held)} assembled shard(s) are missing from {build.root}; run the same "
                           "command with --resume to continue")
    return [fmt.ShardEntry(fmt.shard_file(r.shard), held[r.shard]["bytes"], held[r.shard]["sha256"], len(r.crcs))
            for r in wanted]


def _write_index(build: Bucket, dataset: Bucket, tag: str, plan: Plan, results: list[SlotResult],
                 shards: list[fmt.ShardEntry], skipped: list[tuple[str, str]]) -> fmt.Manifest:
    """Upload the index, fields, decoder warnings, checksums, skip list and (1.4) shard table; the manifest
    naming them all under `builds/<tag>/`, checked as a reader will check it (not yet committed)."""
    ok = np.array([r.ok for r in results])
    kept = [r for r in results if r.ok]
    sizes = np.array([(r.height, r.width) for r in kept], dtype=np.int64).reshape(-1, 2)
    warned = np.array([r.warnings for r in kept], dtype=np.int64)
    crcs = np.array([r.crc for r in kept], dtype=fmt.CHECKSUM_DTYPE)
    payloads: dict[str, bytes] = {}

    def put(name: str, payload: bytes) -> fmt.FileEntry:
        payloads[name] = payload
        build.put(name, payload)
        return fmt.file_entry(f"{fmt.build_folder(tag)}/{name}", payload)
    index = {key: put(name, payload) for key, (name, payload) in
             fmt.index_payloads(plan.found.labels[plan.order][ok], sizes, [s for s, k in zip(plan.sources, ok) if k])
             .items()}
    fields = []
    for spec, values in plan.fields():
        entry = put(*fmt.field_payload(spec, values[ok]))
        fields.append(fmt.FieldEntry(entry.file, entry.bytes, entry.sha256, spec.name, spec.kind, tuple(spec.shape),
                                     tuple(spec.classes)))
    skip_list = [{"source": printable(s), "reason": r} for s, r in skipped]
    listed = put(fmt.SKIP_LIST_FILE, fmt.skip_list_payload(skip_list))
    job = plan.job
    manifest = fmt.Manifest(
        height=job.target.height, width=job.target.width, count=len(kept), records_per_shard=job.records_per_shard,
        classes=tuple(plan.found.classes), index=index, compile=plan.options,
        shards=tuple(replace(s, file=f"{fmt.build_folder(tag)}/{s.file}") for s in shards),
        skipped=tuple(skip_list[:fmt.SKIPPED_IN_MANIFEST]),
        skipped_list=fmt.SkipListEntry(listed.file, listed.bytes, listed.sha256, len(skip_list)),
        fields=tuple(fields), warnings=put(*fmt.warnings_payload(warned)) if warned.any() else None,
        checksums=put(*fmt.checksums_payload(crcs)))
    manifest, table = fmt.with_shard_table(manifest, f"{fmt.build_folder(tag)}/{fmt.SHARD_TABLE_FILE}")
    manifest = fmt.with_segment(manifest, put(*fmt.class_counts_payload(  # (1.5) the index as one segment
        fmt.count_labels(plan.found.labels[plan.order][ok], len(plan.found.classes)))))
    put(fmt.SHARD_TABLE_FILE, table)  # (1.4) the shards' SHA-256s, uploaded before the manifest is committed
    _check(manifest, dataset, tag, payloads)
    return manifest


def _check(manifest: fmt.Manifest, dataset: Bucket, tag: str, payloads: dict[str, bytes]) -> None:
    """Never commit what the reader would refuse: the manifest and the index values, from what was uploaded."""
    base = f"{fmt.build_folder(tag)}/"
    sizes = {e.file: e.bytes for e in manifest.shards} | {base + n: len(p) for n, p in payloads.items()}

    def values(name: str, dtype: np.dtype, count: int):
        yield np.frombuffer(payloads[name.removeprefix(base)], dtype)[:count]
    try:
        parsed = fmt.parse_manifest(manifest.to_json().encode("ascii"), dataset.root,
                                    lambda name, where: sizes[name] if name in sizes else -1,
                                    lambda name, limit: payloads.get(name.removeprefix(base), b"")[:limit])
        fmt.check_index(parsed, dataset.root, values)
    except DatasetError as e:
        raise Unpublishable(f"the finished build would not open as a dataset, so it was not published: {e}") from e
