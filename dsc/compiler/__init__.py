"""The compiler: discover → order → decode/resize into shards → compact → index → publish.

`compile_folder` is the whole pipeline in one short function; each stage is its own module.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dsc import __version__
from dsc import format as fmt
from dsc.compiler import publish
from dsc.compiler.decode import DEFAULT_MAX_PIXELS, decoder_name
from dsc.compiler.discover import discover
from dsc.compiler.resize import INTERPOLATION, PAD_VALUE, Target, parse_size
from dsc.compiler.write import SlotResult, WriteJob, check_workers, compact, fill_slots, fsync_files
from dsc.errors import CompileError

SHARD_TARGET_BYTES = 1 << 30  # ~1 GiB shards: few files, yet units small enough to copy or verify


class SkippedImageWarning(UserWarning):
    """A source image was skipped; the dataset records it under "skipped"."""


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

    @property
    def labeled(self) -> bool:
        return bool(self.classes)

    @property
    def images_per_second(self) -> float:
        return (self.kept + len(self.skipped)) / self.seconds if self.seconds > 0 else 0.0


def _warn_skip(source: str, reason: str) -> None:
    warnings.warn(f"skipped {source}: {reason}", SkippedImageWarning, stacklevel=3)


def source_order(n: int, seed: int, shuffle: bool) -> np.ndarray:
    """Slot i holds source order[i]: a seeded permutation, so any block of records mixes classes."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng(seed).permutation(n)


def _manifest(target: Target, kept: int, per_shard: int, classes: list[str], shards, index,
              skipped: list[tuple[str, str]], options: dict) -> fmt.Manifest:
    return fmt.Manifest(height=target.height, width=target.width, count=kept,
                        records_per_shard=per_shard, classes=tuple(classes), shards=shards,
                        index=index, skipped=tuple({"source": s, "reason": r} for s, r in skipped),
                        compile=options)


def compile_folder(src: str | os.PathLike, out: str | os.PathLike, *, size: int | str | tuple[int, int] = 224,
                   fit: str = "center-crop", seed: int = 0, shuffle: bool = True, workers: int | None = None,
                   strict: bool = False, force: bool = False, records_per_shard: int | None = None,
                   max_pixels: int = DEFAULT_MAX_PIXELS, progress: Callable[[int], None] | None = None,
                   on_skip: Callable[[str, str], None] | None = None) -> CompileSummary:
    """Compile an image folder into a dsc dataset at `out`; see `dsc compile --help` for the options.

    `progress(n)` is called as n more sources are done; `on_skip(source, reason)` for each
    skipped source (default: a SkippedImageWarning). Raises CompileError; OUT is then untouched.
    """
    started = time.perf_counter()
    target = Target(*parse_size(size), fit=fit)
    workers = check_workers(workers)
    if records_per_shard is not None and (not isinstance(records_per_shard, int) or records_per_shard < 1):
        raise CompileError(f"records_per_shard must be a positive integer, got {records_per_shard!r}")
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise CompileError(f"max_pixels must be a positive integer, got {max_pixels!r}")
    src, out = Path(src).absolute(), Path(out).absolute()
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise CompileError(f"output {out} must not be inside the source folder {src}")
    found = discover(src)
    on_skip = on_skip or _warn_skip
    for source, reason in found.skipped:
        on_skip(source, reason)
    record_bytes = target.height * target.width * fmt.CHANNELS
    per_shard = records_per_shard or max(1, SHARD_TARGET_BYTES // record_bytes)
    order = source_order(len(found.sources), seed, shuffle)
    sources = [found.sources[i] for i in order]
    stage = publish.prepare(out, force)
    try:
        fmt.allocate_shards(stage, len(sources), per_shard, record_bytes)
        job = WriteJob(str(src), str(stage), len(sources), per_shard, target, max_pixels)
        sizes = np.zeros((len(sources), 2), dtype=np.int64)
        ok = np.zeros(len(sources), dtype=bool)
        failed: list[tuple[str, str]] = []

        def collect(result: SlotResult) -> None:
            if result.ok:
                ok[result.slot] = True
                sizes[result.slot] = (result.height, result.width)
            elif strict:
                raise CompileError(f"{src / sources[result.slot]}: {result.reason} (--strict: nothing written)")
            else:
                failed.append((sources[result.slot], result.reason))
                on_skip(sources[result.slot], result.reason)
            if progress:
                progress(1)

        fill_slots(job, sources, workers, collect)
        kept = compact(stage, ok, job)
        if kept == 0:
            raise CompileError(f"none of the {len(sources)} images in {src} could be decoded; nothing written")
        fmt.trim_shards(stage, kept, per_shard, record_bytes)
        shard_paths = [stage / fmt.shard_file(i) for i in range(fmt.shard_count(kept, per_shard))]
        fsync_files(shard_paths)
        with ThreadPoolExecutor(min(4, workers)) as pool:
            shards = fmt.shard_entries(stage, kept, per_shard, record_bytes, map_fn=pool.map)
        index = fmt.write_index(stage, found.labels[order][ok], sizes[ok], [s for s, k in zip(sources, ok) if k])
        skipped = sorted(found.skipped + failed)
        options = {"dsc_version": __version__, "size": [target.height, target.width], "fit": target.fit,
                   "interpolation": INTERPOLATION, "pad_value": PAD_VALUE, "alpha": "composited onto black",
                   "exif_orientation": "applied", "jpeg_decoder": decoder_name(),
                   "dct_scaling": "1/2, 1/4 or 1/8 when the source is at least that many times the target",
                   "shuffle": shuffle, "seed": seed, "max_pixels": max_pixels, "source_root": str(src),
                   "source_order": "by label, then depth-first with folder entries sorted by name",
                   "sources_found": len(found.sources)}
        fmt.write_manifest(stage, _manifest(target, kept, per_shard, found.classes, shards, index, skipped, options))
        publish.publish(stage, out)
    except OSError as e:  # a full disk, a vanished folder: say so, leave OUT as it was
        publish.discard(stage)
        raise CompileError(f"writing the dataset in {stage} failed: {e}") from e
    except BaseException:
        publish.discard(stage)
        raise
    size_on_disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return CompileSummary(out, kept, skipped, found.classes, found.empty_classes, len(shards),
                          size_on_disk, time.perf_counter() - started, decoder_name(), target_shape(target))


def target_shape(target: Target) -> tuple[int, int, int]:
    return (target.height, target.width, fmt.CHANNELS)
