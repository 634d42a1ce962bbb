"""The compiler: discover → order → decode/resize into shards → finish (compact, index) → publish.

`compile_folder` is the whole pipeline in one short function; each stage is its own module:
`discover`, `write` (decode + resize into slots, run by an engine from `engines`), `journal`
(what a partial build holds, for --resume), `finish` and `publish`. `jobs` holds the types
they share.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsc import __version__
from dsc import format as fmt
from dsc.compiler import classes as classes_module
from dsc.compiler import journal, publish
from dsc.compiler import labels as labels_module
from dsc.compiler.decode import DEFAULT_MAX_PIXELS, decoder_name
from dsc.compiler.discover import discover, printable
from dsc.compiler.engines import check_workers, make_engine
from dsc.compiler.finish import NothingDecoded, Unpublishable, check_shard_count, finish
from dsc.compiler.jobs import Engine, SlotResult, WriteJob, chunk_size, split
from dsc.compiler.resize import INTERPOLATION, PAD_VALUE, Target, parse_size, resize_backend
from dsc.errors import CompileError

__all__ = ["CompileSummary", "compile_folder"]
SHARD_TARGET_BYTES = 1 << 30  # ~1 GiB shards: few files, yet units small enough to copy or verify


# What a compile finds in the data (skips, odd files, splits that disagree) is reported on this
# logger, at WARNING: not Python warnings, which are about the caller's code. Unconfigured, Python
# prints them on stderr; the CLI shows them between its progress bar's lines.
logger = logging.getLogger("dsc")


@dataclass
class CompileSummary:
    """What a compile did; also printed by `dsc compile`."""

    out: Path
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


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CompileError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_paths(src: Path, out: Path) -> None:
    """OUT and SRC must not contain each other: a compile must never read or replace its sources."""
    s, o = src.resolve(), out.resolve()
    if o == s:
        raise CompileError(f"the source folder and the output are the same folder, {src}; give OUT another name")
    if s in o.parents:
        raise CompileError(f"output {out} must not be inside the source folder {src}")
    if o in s.parents:
        raise CompileError(f"the source folder {src} must not be inside the output {out}")


class StrictFailure(CompileError):
    """A --strict compile met a source it could not decode: the build is discarded."""


def _decode_all(job: WriteJob, sources: list[str], engine: Engine, strict: bool, done: dict[int, SlotResult],
                log: journal.Journal, on_skip: Callable[[str, str], None],
                progress: Callable[[int], None] | None):
    """Fill every slot not `done` already; return (ok mask, upright sizes, skipped (source, reason) list)."""
    ok = np.zeros(len(sources), dtype=bool)
    sizes = np.zeros((len(sources), 2), dtype=np.int64)
    failed: list[tuple[str, str]] = []

    def collect(results: list[SlotResult]) -> None:
        for result in results:
            if result.ok:
                if result.warning:
                    logger.warning("%s: %s", sources[result.slot], result.warning)
                ok[result.slot] = True
                sizes[result.slot] = (result.height, result.width)
            elif strict:
                raise StrictFailure(f"{Path(job.src_root) / sources[result.slot]}: {result.reason} "
                                    "(--strict: nothing written)")
            else:
                failed.append((sources[result.slot], result.reason))
                on_skip(sources[result.slot], result.reason)
        if progress:
            progress(len(results))

    collect(list(done.values()))
    tasks = [(slot, source) for slot, source in enumerate(sources) if slot not in done]
    chunks = split(tasks, chunk_size(len(tasks), engine.workers))
    engine.fill(job, chunks, lambda results: (log.append(results), collect(results)))
    return ok, sizes, failed


def _fields_digest(fields: list[tuple[fmt.FieldEntry, np.ndarray]]) -> str:
    """Fingerprint of the fields' kinds, vocabularies and values: a resume must write the same ones."""
    digest = hashlib.sha256()
    for spec, values in fields:
        digest.update(json.dumps([spec.name, spec.kind, list(spec.shape), list(spec.classes)]).encode())
        digest.update(np.ascontiguousarray(values, spec.dtype).tobytes())
    return digest.hexdigest()


def _options(target: Target, seed: int, shuffle: bool, max_pixels: int, src: Path, found: int,
             decode_mode: str, label_table: str | os.PathLike | None) -> dict:
    """How the pixels were made, recorded in the manifest (formats.md, "compile")."""
    listed = {} if label_table is None else {"label_table": printable(str(Path(label_table).absolute()))}
    return {"dsc_version": __version__, "size": [target.height, target.width], "fit": target.fit,
            "interpolation": INTERPOLATION, "pad_value": PAD_VALUE, "alpha": "composited onto black",
            "exif_orientation": "applied", "jpeg_decoder": decoder_name(),
            "decode": decode_mode, "dct_scaling": fmt.DCT_SCALING[decode_mode],
            "shuffle": shuffle, "seed": seed, "max_pixels": max_pixels, "source_root": printable(str(src)),
            "source_order": "as listed in the label table" if listed else
                            "by label, then depth-first with folder entries sorted by name",
            "sources_found": found, **listed}


def compile_folder(src: str | os.PathLike, out: str | os.PathLike, *, size: int | str | tuple[int, int] = 224,
                   fit: str = "center-crop", seed: int = 0, shuffle: bool = True, workers: int | None = None,
                   strict: bool = False, force: bool = False, records_per_shard: int | None = None,
                   max_pixels: int = DEFAULT_MAX_PIXELS, resume: bool = False, engine: str = "local",
                   address: str | None = None, fast_decode: bool = False,
                   classes: str | os.PathLike | Sequence[str] | None = None, skip_unknown_classes: bool = False,
                   labels: str | os.PathLike | None = None, columns: dict[str, str] | None = None,
                   on_found: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None,
                   progress: Callable[[int], None] | None = None,
                   on_skip: Callable[[str, str], None] | None = None) -> CompileSummary:
    """Compile an image folder into a dsc dataset at `out`; see `dsc compile --help` for the options.

    `on_found(n)` is called as discovery finds n more images (a long walk's running count),
    `on_total(n)` once it is done, with the n sources to decode (for a progress bar's total),
    `progress(n)` as n more of them are done; `on_skip(source, reason)` for each
    skipped source (default: a line on the "dsc" logger). Raises CompileError; OUT is then untouched.
    An interrupted compile leaves its partial build beside OUT; `resume=True` continues it.
    `engine="ray"` runs the decoding as Ray tasks on the cluster at `address` (or a local one);
    the output is byte-identical to the local engine's. `fast_decode=True` lets JPEGs be scaled
    down in the DCT domain to just the needed size: faster, visibly less faithful.

    Labels: `classes` fixes the class vocabulary (names, a file of names, or another dataset's
    folder, e.g. the training split's) so that every split gives a class the same index.
    `labels` is a CSV or JSONL label table (see `dsc.compiler.labels`): only the images it lists
    are compiled, its `label` column is the label and its other columns become typed fields,
    their kinds inferred or given by `columns` ({name: "class" | "multilabel" | "float" | "int"}).
    """
    started = time.perf_counter()
    target = Target(*parse_size(size), fit=fit)
    workers = check_workers(workers)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise CompileError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(fast_decode, bool):
        raise CompileError(f"fast_decode must be True or False, got {fast_decode!r}")
    decode_mode = "fast" if fast_decode else "faithful"
    record_bytes = target.height * target.width * fmt.CHANNELS
    per_shard = _positive_int("records_per_shard", max(1, SHARD_TARGET_BYTES // record_bytes)
                              if records_per_shard is None else records_per_shard)
    max_pixels = _positive_int("max_pixels", max_pixels)
    src, out = Path(src).absolute(), Path(out).absolute()
    _check_paths(src, out)
    runner = make_engine(engine, workers, address)  # a Ray address is checked before any build exists
    vocabulary = None if classes is None else classes_module.load_classes(classes)
    if labels is not None:
        found = labels_module.discover_listed(src, labels, columns, vocabulary, skip_unknown_classes,
                                              classes_module.reference_fields(classes), on_found)
    elif columns:
        raise CompileError("column kinds are for a label table (--labels)")
    else:
        found = discover(src, vocabulary, skip_unknown_classes, on_found)
    if vocabulary is None and found.classes:
        for message in classes_module.sibling_class_mismatch(out, found.classes):
            logger.warning("%s", message)
    if strict and found.skipped:
        source, reason = found.skipped[0]
        raise StrictFailure(f"{src / source}: {reason} (--strict: nothing written)")
    on_skip = on_skip or _log_skip
    for source, reason in found.skipped:
        on_skip(source, reason)
    if on_total:
        on_total(len(found.sources))
    order = source_order(len(found.sources), seed, shuffle)
    sources = [found.sources[i] for i in order]
    listing = journal.source_listing(sources, found.labels[order], [found.stamps[i] for i in order], found.classes)
    check_shard_count(fmt.shard_count(len(sources), per_shard))
    plan = {"dsc_version": __version__, "decoder": decoder_name(), "resize": resize_backend(),
            "size": [target.height, target.width], "fit": target.fit, "decode": decode_mode, "seed": seed,
            "shuffle": shuffle, "max_pixels": max_pixels, "records_per_shard": per_shard, "count": len(sources),
            "sources": journal.listing_digest(listing), "fields": _fields_digest(found.fields)}
    plan_digest = hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()
    lock_fd, log, reused = publish.lock(out), None, 0
    try:
        stage, resumed = publish.prepare(out, force, resume, lock_fd)
        if resume and not resumed:
            logger.warning("nothing to resume at %s: compiling from scratch", stage)
        manifest = _finish_publish(stage, out, plan_digest, force) if resumed else None
        reused = len(sources) if manifest is not None else 0
        if manifest is None:
            if resumed and not journal.has_plan(stage):  # the plan never got written: nothing to reuse
                publish.discard(stage)
                stage.mkdir()
                resumed = False
            journal.check_plan(stage, plan, listing) if resumed else journal.write_plan(stage, plan, listing)
            fmt.allocate_shards(stage, len(sources), per_shard, record_bytes)
            job = WriteJob(str(src), str(stage), len(sources), per_shard, target, max_pixels, decode_mode)
            done = journal.reusable(stage, job) if resumed else {}
            reused = len(done)
            log = journal.Journal(stage)
            ok, sizes, failed = _decode_all(job, sources, runner, strict, done, log, on_skip, progress)
            log.close()
            options = _options(target, seed, shuffle, max_pixels, src, len(sources), decode_mode, labels)
            manifest = finish(stage, job, ok, sizes, found.labels[order], sources, found.classes,
                              sorted(found.skipped + failed), options, min(4, workers),
                              [(spec, values[order]) for spec, values in found.fields])
            publish.record_publish(out, plan_digest, publish.manifest_digest(stage))
            _finish_publish(stage, out, plan_digest, force)
    except (StrictFailure, NothingDecoded, Unpublishable):  # a verdict on the data: nothing worth resuming
        publish.discard(stage)
        raise
    except OSError as e:  # a full disk, too many open files: say so, keep the work for --resume
        raise CompileError(f"writing the dataset in {out.parent} failed: {e}; fix the cause and run the same "
                           "command with --resume to continue") from e
    finally:
        try:
            if log is not None:
                log.close()
        finally:
            publish.unlock(out, lock_fd)
    size_on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return CompileSummary(out, manifest.count, [(s["source"], s["reason"]) for s in fmt.read_skipped(out, manifest)],
                          list(manifest.classes), found.empty_classes, len(manifest.shards), size_on_disk,
                          time.perf_counter() - started, decoder_name(), manifest.record_shape, manifest.fields,
                          found.ignored, reused, len(sources))


def _finish_publish(stage: Path, out: Path, plan_digest: str, force: bool) -> fmt.Manifest | None:
    """State "finishing" (formats.md): publish the recorded build, or see that it already is.

    Acts only on a build this plan made: the record names the plan's and the manifest's SHA-256.
    None when no publish is pending (the build is still in progress)."""
    record = publish.pending_publish(out)
    if record is None:
        return None
    if record.get("plan") != plan_digest:
        raise CompileError(f"a finished build of {out} made with other settings or sources waits to be published "
                           f"at {stage}; run the original command with --resume, or pass --force to discard it")
    if publish.manifest_digest(out) == record["manifest"]:  # published; the stage holds the old dataset
        if stage.exists():
            publish.retire(stage, out)
    elif publish.manifest_digest(stage) == record["manifest"]:
        journal.remove(stage)
        publish.publish(stage, out, force)
    else:
        raise CompileError(f"the finished build at {stage} is damaged or gone; pass --force to start over")
    publish.clear_publish(out)
    return fmt.parse_manifest(out)
