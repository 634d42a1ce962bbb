"""The pipeline: discover → order → decode/resize into shards → finish (compact, index) → publish.

`compile_folder` reads as the pipeline: check the options, find the sources (`discover`, `labels`
for a label table, `sources` for archives), fix the plan (which source fills which slot, what a
resume must find unchanged), then under OUT's lock stage the build (`publish.LocalTarget`), fill its slots
(`write`, run by an engine from `engines`, recorded by `journal`), `finish` it and commit it. An
`s3://` OUT is built in the bucket instead (`bucket_build`), by the same plan and engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.arguments import check_bool, check_int
from dsc.compiler import classes as classes_module
from dsc.compiler import journal, output, publish
from dsc.compiler import labels as labels_module
from dsc.compiler import sources as archives
from dsc.compiler.decode import DEFAULT_MAX_PIXELS, decoder_name
from dsc.compiler.decoding import Plan, StrictFailure, decode_all
from dsc.compiler.discover import Discovery, discover, printable
from dsc.compiler.engines import check_workers, make_engine
from dsc.compiler.engines.supervisor import MAX_STALL_S
from dsc.compiler.finish import NothingDecoded, Unpublishable, finish
from dsc.compiler.jobs import Engine, WriteJob
from dsc.compiler.sources import bucket_folder
from dsc.compiler.target import INTERPOLATION, PAD_VALUE, Target, parse_size, resize_backend
from dsc.errors import CompileError
from dsc.storage.object_file import is_url
from dsc.version import __version__

__all__ = ["CompileSummary", "compile_folder"]
SHARD_TARGET_BYTES = 1 << 30  # ~1 GiB shards: few files, yet units small enough to copy or verify


# What a compile finds in the data (skips, odd files, splits that disagree) is reported on this
# logger, at WARNING: not Python warnings, which are about the caller's code. Unconfigured, Python
# prints them on stderr; the CLI shows them between its progress bar's lines.
logger = logging.getLogger("dsc")


@dataclass
class CompileSummary:
    """What a compile did; also printed by `dsc compile`."""

    out: Path | str  # a folder, or an s3:// URL
    kept: int
    skipped: list[tuple[str, str]]
    classes: list[str]
    empty_classes: list[str]
    shards: int
    bytes_on_disk: int
    seconds: float
    decoder: str
    record_shape: tuple[int, int, int] = field(default=(0, 0, 0))
    fields: tuple[fmt.FieldEntry, ...] = ()
    ignored: int = 0  # images under SRC that the label table does not list
    reused: int = 0  # sources a resume found done already (decoded or skipped by the interrupted compile)
    built: int = 0  # sources the build decoded or tried (discovery's skips never reach it)

    @property
    def labeled(self) -> bool:
        return bool(self.classes)

    @property
    def images_per_second(self) -> float:
        """Sources decoded (or found bad) per second by this call; what a resume reused is not counted."""
        return (self.built - self.reused) / self.seconds if self.seconds > 0 else 0.0


def _log_skip(source: str, reason: str) -> None:
    logger.warning("skipped %s: %s", source, reason)


def source_order(n: int, seed: int, shuffle: bool) -> np.ndarray:
    """Slot i holds source order[i]: a seeded permutation, so any block of records mixes classes."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng(seed).permutation(n)


def _check_paths(src: Path, out: Path) -> None:
    """OUT and SRC must not contain each other: a compile must never read or replace its sources."""
    try:
        src.exists()
    except OSError as e:  # a name too long: no file or pattern could have it
        raise CompileError(f"source {src}: {e.strerror or e}") from None
    s, o = src.resolve(), out.resolve()
    if o == s:
        raise CompileError(f"the source folder and the output are the same folder, {src}; give OUT another name")
    if s in o.parents:
        raise CompileError(f"output {out} must not be inside the source folder {src}")
    if o in s.parents:
        raise CompileError(f"the source folder {src} must not be inside the output {out}")


def _source(src: str | os.PathLike) -> Path | str:
    """SRC (or OUT) as an absolute path, or as given when it is an `s3://` URL (archives, a dataset in a bucket)."""
    text = os.fspath(src)
    return text if is_url(text) else Path(src).absolute()


def _fields_digest(fields: list[tuple[fmt.FieldEntry, np.ndarray]]) -> str:
    """Fingerprint of the fields' kinds, vocabularies and values: a resume must write the same ones."""
    digest = hashlib.sha256()
    for spec, values in fields:
        digest.update(json.dumps([spec.name, spec.kind, list(spec.shape), list(spec.classes)]).encode())
        digest.update(np.ascontiguousarray(values, spec.dtype).tobytes())
    return digest.hexdigest()


def _options(job: WriteJob, seed: int, shuffle: bool, src: Path | str, found: int,
             label_table: str | os.PathLike | None) -> dict:
    """How the pixels were made, recorded in the manifest (formats.md, "compile")."""
    listed = {} if label_table is None else {"label_table": printable(str(Path(label_table).absolute()))}
    target = job.target
    return {"dsc_version": __version__, "size": [target.height, target.width], "fit": target.fit,
            "interpolation": INTERPOLATION, "pad_value": PAD_VALUE, "alpha": fmt.ALPHA[job.alpha],
            "exif_orientation": "applied", "jpeg_decoder": decoder_name(),
            "decode": job.decode_mode, "dct_scaling": fmt.DCT_SCALING[job.decode_mode],
            "shuffle": shuffle, "seed": seed, "max_pixels": job.max_pixels, "source_root": printable(str(src)),
            "source_order": "as listed in the label table" if listed else
                            "by label, then depth-first with folder entries sorted by name",
            "sources_found": found, **listed}


def compile_folder(src: str | os.PathLike, out: str | os.PathLike, *, size: int | str | tuple[int, int] = 224,
                   fit: str = "center-crop", seed: int = 0, shuffle: bool = True, workers: int | None = None,
                   strict: bool = False, force: bool = False, records_per_shard: int | None = None,
                   max_pixels: int = DEFAULT_MAX_PIXELS, resume: bool = False, engine: str = "local",
                   address: str | None = None, stall_seconds: float | None = None, fast_decode: bool = False,
                   alpha: str = "black",
                   classes: str | os.PathLike | Sequence[str] | None = None, skip_unknown_classes: bool = False,
                   labels: str | os.PathLike | None = None, columns: dict[str, str] | None = None,
                   label_key: str | None = None, image_column: str | None = None,
                   on_found: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None,
                   progress: Callable[[int], None] | None = None,
                   on_skip: Callable[[str, str], None] | None = None) -> CompileSummary:
    """Compile an image folder into a dsc dataset at `out` (a folder, or `s3://bucket/prefix`: built and
    committed in the bucket, nothing local; see `bucket_build`); see `dsc compile --help` for the options.

    `on_found(n)` is called as discovery finds n more images (a long walk's running count),
    `on_total(n)` once it is done, with the n sources to decode (for a progress bar's total),
    `progress(n)` as n more of them are done; `on_skip(source, reason)` for each
    skipped source (default: a line on the "dsc" logger). Raises CompileError; OUT is then untouched.
    An interrupted compile leaves its partial build beside OUT; `resume=True` continues it.
    `engine="ray"` runs the decoding as Ray tasks on the cluster at `address` (or a local one);
    the output is byte-identical to the local engine's. `stall_seconds` (default 300): a worker
    (local engine, several workers) or Ray task that finishes no source for that long is stopped and
    its work retried by another; a source two workers stalled on is skipped. `fast_decode=True` lets JPEGs be scaled
    down in the DCT domain to just the needed size: faster, visibly less faithful. `alpha`: what
    becomes of transparent pixels: "black" (composited onto black), "white" or "drop" (the stored RGB).

    Labels: `classes` fixes the class vocabulary (names, a file of names, or another dataset's
    folder, e.g. the training split's) so that every split gives a class the same index.
    `labels` is a CSV or JSONL label table (see `dsc.compiler.labels`): only the images it lists
    are compiled, its `label` column is the label and its other columns become typed fields,
    their kinds inferred or given by `columns` ({name: "class" | "multilabel" | "float" | "int"}).

    Archives: `src` may name WebDataset tar shards (a file, a folder of them, a glob, a brace pattern),
    Parquet files (a file or a folder) or a zip archive (`dsc.compiler.sources`); each record's source is
    then `ARCHIVE#MEMBER`. `label_key` says where a label is: a tar member suffix (`cls`, `txt`,
    `json:FIELD`) or a Parquet column; `image_column` which Parquet column holds the images.
    """
    started = time.perf_counter()
    target = Target(*parse_size(size), fit=fit)
    workers = check_workers(workers)
    seed = check_int("seed", seed, 0, error=CompileError)
    fast_decode = check_bool("fast_decode", fast_decode, CompileError)
    if alpha not in fmt.ALPHA:
        raise CompileError(f"unknown alpha {alpha!r}; choose one of {', '.join(fmt.ALPHA)}")
    record_bytes = target.height * target.width * fmt.CHANNELS
    per_shard = check_int("records_per_shard", max(1, SHARD_TARGET_BYTES // record_bytes)
                          if records_per_shard is None else records_per_shard, 1, fmt.MAX_RECORDS,
                          error=CompileError)
    max_pixels = check_int("max_pixels", max_pixels, 1, error=CompileError)
    src, out = _source(src), _source(out)
    if isinstance(src, Path) and isinstance(out, Path):
        _check_paths(src, out)
    elif isinstance(src, str) and isinstance(out, str):
        bucket_folder.check_apart(src, out)
    on_skip = on_skip or _log_skip
    if stall_seconds is not None and (isinstance(stall_seconds, bool) or not isinstance(stall_seconds, (int, float))
                                      or not 1 <= stall_seconds <= MAX_STALL_S):
        raise CompileError(f"stall_seconds must be a number of seconds from 1 to {MAX_STALL_S:g}, "
                           f"got {stall_seconds!r}")
    runner = make_engine(engine, workers, address, stall_seconds)
    # OUT refused at once, not after discovery and the workers' start-up (a second or two); checked again where it
    # counts. A bucket's check uses the S3 client, whose runtime does not survive a fork: where the engine forks its
    # workers from this process, only once it has (forked after it, they would be spawned, importing numpy, torch
    # and the decoders anew)
    refuse_first = not resume and (isinstance(out, Path) or not runner.forks_here)
    if refuse_first:
        _refuse_out(out, force)
    with runner:  # the engine's workers start now: their imports overlap discovery
        if not resume and not refuse_first:
            _refuse_out(out, force)
        found = _discover(src, out, classes, skip_unknown_classes, labels, columns, (label_key, image_column),
                          on_found)
        _report(found, strict, on_skip, on_total)
        recipe = WriteJob(str(found.root), "", 0, per_shard, target, max_pixels, "fast" if fast_decode else "faithful",
                          alpha)
        plan = _plan(recipe, found, seed, shuffle, labels)
        runner.ready()  # a broken decoder install fails here, before any build exists
        if isinstance(out, str):  # s3://bucket/prefix: built and committed there (`bucket_build`)
            from dsc.compiler import bucket_build

            manifest, reused, skipped = bucket_build.build_and_publish(out, plan, runner, force, resume, strict,
                                                                       on_skip, progress)
        else:
            with publish.LocalTarget(out) as dest:
                manifest, reused = _build_and_publish(dest, plan, runner, force, resume, strict, on_skip, progress)
    if isinstance(out, str):
        size_on_disk = sum(f.bytes for f in manifest.files) + len(manifest.to_json())
    else:
        size_on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        skipped = [(s["source"], s["reason"]) for s in storage.read_skipped(out, manifest)]
    return CompileSummary(out, manifest.count, skipped,
                          list(manifest.classes), found.empty_classes, len(manifest.shards), size_on_disk,
                          time.perf_counter() - started, decoder_name(), manifest.record_shape, manifest.fields,
                          found.ignored, reused, len(plan.sources))


def _refuse_out(out: Path | str, force: bool) -> None:
    """What the build's own check of OUT (under its lock, or before its bucket build) would refuse without
    --resume: a link or another tool's files (even with --force), a dataset without --force."""
    if isinstance(out, Path):
        # (a missing OUT's folders are made later, mkdir -p; a finished build waiting to be published is said there)
        try:
            there = (out.is_symlink() or out.exists()) and publish.pending_publish(out) is None
        except OSError:  # a name too long, a folder that cannot be searched: said by the build's own check
            return
        if there:
            publish.check_out(out, force)
        return
    from dsc.compiler import bucket_publish
    from dsc.storage.bucket import Bucket

    dataset = Bucket(out)
    state = bucket_publish.survey(dataset)
    bucket_publish.tidy(dataset, state)  # what a kill after a commit left, as every compile into it does
    bucket_publish.check_target(dataset, state, force)


def _discover(src: Path | str, out: Path | str, classes, skip_unknown_classes: bool, labels, columns,
              archive_options: tuple[str | None, str | None], on_found: Callable[[int], None] | None) -> Discovery:
    """The sources to compile with their labels and fields: a label table's rows, the archives' samples
    (`archive_options`: their label key and image column), or the folder's images."""
    fields_only = labels is not None or bool(columns)  # an unlabeled dataset still gives its fields' vocabularies
    vocabulary = None if classes is None else classes_module.load_classes(classes, fields_only=fields_only)
    reference = classes_module.reference_fields(classes)
    if archives.archive_sources(src) is not None:
        if labels is not None:
            raise CompileError("a label table (--labels) is for an image folder, not for archives (--column takes "
                               "an archive's own columns or members as fields)")
        found = archives.discover(src, vocabulary, skip_unknown_classes, *archive_options, on_found=on_found,
                                  columns=columns, reference=reference)
    elif any(archive_options):
        raise CompileError("--label-key and --image-column are for archive sources (tar, Parquet)")
    elif labels is not None:
        listed = bucket_folder.discover_listed if isinstance(src, str) else labels_module.discover_listed
        found = listed(src, labels, columns, vocabulary, skip_unknown_classes, reference, on_found)
    elif columns:
        raise CompileError("--column is for a label table (--labels) or archive sources (tar, Parquet)")
    else:  # an image folder, on a file system or of objects in a bucket
        found = (bucket_folder.discover if isinstance(src, str) else discover)(src, vocabulary, skip_unknown_classes,
                                                                              on_found)
    free = [(spec.name, spec.kind, spec.classes) for spec, _ in found.fields  # vocabularies no reference fixed
            if spec.classes and reference.get(spec.name, ("",))[0] != spec.kind]
    siblings = classes_module.sibling_class_mismatch(out, found.classes if vocabulary is None else None, free) \
        if isinstance(out, Path) else []  # splits beside a dataset in a bucket are not looked for
    for message in siblings:
        logger.warning("%s", message)
    return found


def _report(found: Discovery, strict: bool, on_skip: Callable[[str, str], None],
            on_total: Callable[[int], None] | None) -> None:
    """What discovery skipped (a --strict compile stops at the first), and the count left to decode."""
    if strict and found.skipped:
        source, reason = found.skipped[0]
        raise StrictFailure(f"{found.root}/{source}: {reason} (--strict: nothing written)")
    for source, reason in found.skipped:
        on_skip(source, reason)
    if on_total:
        on_total(len(found.sources))


def _plan(recipe: WriteJob, found: Discovery, seed: int, shuffle: bool, label_table: str | os.PathLike | None) -> Plan:
    """The plan of a build: `recipe` (how each slot is filled) with the count of sources found."""
    order = source_order(len(found.sources), seed, shuffle)
    sources = [found.sources[i] for i in order]
    listing = journal.source_listing(sources, found.labels[order], [found.stamps[i] for i in order], found.classes)
    job, target = replace(recipe, count=len(sources)), recipe.target
    record = {"dsc_version": __version__, "decoder": decoder_name(), "resize": resize_backend(),
              "size": [target.height, target.width], "fit": target.fit, "decode": job.decode_mode, "seed": seed,
              "shuffle": shuffle, "max_pixels": job.max_pixels, "records_per_shard": job.records_per_shard,
              "count": job.count, "sources": journal.listing_digest(listing), "fields": _fields_digest(found.fields),
              **journal.without_defaults({"alpha": job.alpha})}
    if isinstance(found, archives.ArchiveDiscovery) and any(found.options):  # Parquet: the image column read
        record["image_column"] = ", ".join(sorted({options[0] for options in found.options if options}))
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    options = _options(job, seed, shuffle, _source(job.src_root), job.count, label_table)
    if isinstance(found, archives.ArchiveDiscovery):
        options["source_order"] = f"{found.kind} archives: {archives.ORDER}"
    return Plan(job, found, order, sources, listing, record, digest, options)


def _build_and_publish(dest: publish.LocalTarget, plan: Plan, runner: Engine, force: bool, resume: bool,
                       strict: bool, on_skip: Callable[[str, str], None],
                       progress: Callable[[int], None] | None) -> tuple[fmt.Manifest, int]:
    """Under OUT's lock: stage → build → commit; return the published manifest and how many sources
    a resume reused. A verdict on the data discards the build; a system error keeps it for --resume."""
    try:
        resumed = dest.stage(force, resume)
        if resume and not resumed:
            logger.warning("nothing to resume at %s: compiling from scratch", dest.stage_dir)
        manifest = dest.pending(plan.digest, force) if resumed else None
        if manifest is not None:  # the interrupted compile had finished its build
            return manifest, len(plan.sources)
        if resumed and not journal.has_plan(dest.stage_dir):  # the plan never got written: nothing to reuse
            dest.restart()
            resumed = False
        reused = _build(dest.stage_dir, plan, runner, resumed, strict, on_skip, progress)
        return dest.commit(plan.digest, force), reused
    except (StrictFailure, NothingDecoded, Unpublishable):  # a verdict on the data: nothing worth resuming
        dest.discard()
        raise
    except OSError as e:  # a full disk, too many open files: say so, keep the work for --resume
        raise CompileError(f"writing the dataset in {dest.out.parent} failed: {e}; fix the cause and run the same "
                           "command with --resume to continue") from e


def _build(stage: Path, plan: Plan, runner: Engine, resumed: bool, strict: bool,
           on_skip: Callable[[str, str], None], progress: Callable[[int], None] | None) -> int:
    """Fill every slot (reusing what a resumed build holds), then finish the build (its manifest written
    last); return the number of slots reused."""
    if resumed:
        journal.check_plan(stage, plan.record, plan.listing)
    else:
        journal.write_plan(stage, plan.record, plan.listing)
    job = replace(plan.job, stage=str(stage))
    output.allocate_shards(stage, job.count, job.records_per_shard, job.record_bytes)
    done = journal.reusable(stage, job) if resumed else {}
    log = journal.Journal(stage)
    try:
        ok, sizes, failed, warned = decode_all(job, plan, runner, strict, done, log, on_skip, progress)
    finally:
        log.close()
    finish(stage, job, ok, sizes, plan.found.labels[plan.order], plan.sources, plan.found.classes,
           sorted(plan.found.skipped + failed), plan.options, min(4, runner.workers), plan.fields(), warned)
    return len(done)
