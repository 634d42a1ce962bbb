"""Decoding a plan: which source fills which slot (`Plan`), the chunks that fill slots, and the loop
that fills them through an engine and collects each slot's outcome (`decode_all`). Shared by the
compile into a folder (`pipeline`) and into a bucket (`bucket_build`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.compiler import journal
from dsc.compiler import sources as archives
from dsc.compiler.discover import Discovery
from dsc.compiler.jobs import Engine, SlotResult, WriteJob, chunk_size, split
from dsc.errors import CompileError

logger = logging.getLogger("dsc")  # what a compile finds is reported here (see dsc.compiler.pipeline)


@dataclass(frozen=True)
class Plan:
    """What a build makes, fixed before any work: slot i holds `sources[i]`; `record` is what a resume
    must find unchanged (`digest` is its SHA-256), `listing` names the sources with their stamps."""

    job: WriteJob  # where and how slots are filled (its stage is set when the build folder is known)
    found: Discovery
    order: np.ndarray  # slot i holds found.sources[order[i]]
    sources: list[str]
    listing: list[str]
    record: dict
    digest: str
    options: dict  # the manifest's "compile" section

    def fields(self) -> list[tuple[fmt.FieldEntry, np.ndarray]]:
        return [(spec, values[self.order]) for spec, values in self.found.fields]


class StrictFailure(CompileError):
    """A --strict compile met a source it could not decode: the build is discarded."""


def decode_all(job: WriteJob, plan: Plan, engine: Engine, strict: bool, done: dict[int, SlotResult],
                log: journal.Journal, on_skip: Callable[[str, str], None],
                progress: Callable[[int], None] | None):
    """Fill every slot not `done` already; return (ok mask, upright sizes, skipped (source, reason) list,
    decoder warnings per slot)."""
    sources = plan.sources
    ok = np.zeros(len(sources), dtype=bool)
    sizes = np.zeros((len(sources), 2), dtype=np.int64)
    warned = np.zeros(len(sources), dtype=np.int64)
    failed: list[tuple[str, str]] = []

    def collect(results: list[SlotResult]) -> None:
        for result in results:
            if result.ok:
                if result.warnings and strict:
                    raise StrictFailure(f"{Path(job.src_root) / sources[result.slot]}: {result.warning} "
                                        "(--strict refuses a source the decoder warned about: nothing written)")
                if result.warning:
                    logger.warning("%s: %s", sources[result.slot], result.warning)
                warned[result.slot] = result.warnings
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
    chunks = make_chunks(job, plan, [slot for slot in range(len(sources)) if slot not in done], engine.workers)
    engine.fill(job, chunks, lambda results: (log.append(results), collect(results)))
    return ok, sizes, failed, warned


def make_chunks(job: WriteJob, plan: Plan, slots: list[int], workers: int):
    """The chunks that fill `slots`: runs of consecutive ones, or for archives the format's units, each
    read in stored order; at most `job.max_chunk` sources each, and `job.min_chunk` at least unless that
    would leave a worker without a chunk."""
    size = max(chunk_size(len(slots), workers), min(job.min_chunk, -(-len(slots) // max(1, workers))))
    if job.max_chunk is not None:
        size = min(size, job.max_chunk)
    if isinstance(plan.found, archives.ArchiveDiscovery):
        return archives.chunks(plan.found, plan.order, slots, size)
    return split([(slot, plan.sources[slot]) for slot in slots], size)
