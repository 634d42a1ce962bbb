"""The units of decoding work, shared by the writer, both engines and the journal (a leaf: it
imports no other compiler module).

A compile is one `WriteJob` (where and how to write) and a list of `Chunk`s: runs of
consecutive (slot, source) pairs. An `Engine` fills chunks wherever it runs them and hands
back one `SlotResult` per slot; which engine ran a chunk never changes a byte of the output,
because every slot's place in the shards is fixed by the job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

from dsc.compiler.target import Target
from dsc.format import CHANNELS

Chunk = list[tuple[int, str]]  # consecutive (slot, source path relative to SRC) pairs
MIN_CHUNK = 16  # sources per chunk at least: amortises a task's start (a Ray task costs ~1 ms)
MAX_CHUNK = 256  # and at most: a retried or last task redoes little, and progress moves often
CHUNKS_PER_WORKER = 32  # enough chunks that no worker idles at the end while another finishes a big one


@dataclass(frozen=True)
class WriteJob:
    """All a worker needs to fill slots; small and picklable."""

    src_root: str
    stage: str
    count: int
    records_per_shard: int
    target: Target
    max_pixels: int
    decode_mode: str = "faithful"  # format.DECODE_MODES
    alpha: str = "black"  # format.ALPHA
    max_chunk: int | None = None  # sources per chunk at most (a bucket build's worker holds a chunk in memory)
    min_chunk: int = 1  # and at least, where each worker still gets a chunk (a bucket build's: S3's smallest part)

    @property
    def record_bytes(self) -> int:
        return self.target.height * self.target.width * CHANNELS


@dataclass(frozen=True)
class SlotResult:
    slot: int
    height: int = 0  # original, upright
    width: int = 0
    reason: str = ""  # why the source was skipped; empty when it was written
    warning: str = ""  # what was odd about a source that was written anyway (e.g. a missing EOI)
    warnings: int = 0  # how many decoder warnings that was: stored per record (format 1.2), refused by --strict
    crc: int = 0  # CRC-32 of the record's bytes, so a resume can check what it reuses

    @property
    def ok(self) -> bool:
        return not self.reason


OnResults = Callable[[list[SlotResult]], None]


class Engine(Protocol):
    """Where chunks are decoded: `dsc.compiler.engines.ENGINES` names each kind. An engine is a
    context: its workers start on entry, before discovery (their imports overlap it), and stop on exit."""

    workers: int  # how many chunks it decodes at once (the chunk size is picked for it)
    forks_here: bool  # whether entering it forks worker processes from this one (nothing here may use the S3
    # client before: its runtime does not survive a fork)

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc) -> None: ...

    def ready(self) -> None:
        """Raise CompileError now, before any build exists, if its workers cannot decode."""

    def fill(self, job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
        """Fill every slot of `chunks`, calling `on_results` in the caller's thread once per chunk. It may be
        called again (a bucket build fills its chunks, then assembles its shards: `write.writer_for(job)`).

        `on_results` may raise (e.g. for --strict) to stop the remaining work at once."""


def chunk_size(tasks: int, workers: int) -> int:
    """Sources per chunk: about CHUNKS_PER_WORKER chunks per worker, within [MIN_CHUNK, MAX_CHUNK]."""
    return max(MIN_CHUNK, min(MAX_CHUNK, tasks // max(1, workers * CHUNKS_PER_WORKER)))


def split(tasks: list[tuple[int, str]], size: int) -> Iterator[Chunk]:
    """Consecutive runs of `size` tasks (the last one shorter)."""
    return (tasks[i:i + size] for i in range(0, len(tasks), size))


def chunk_tasks(chunk) -> list[tuple[int, Any]]:
    """A chunk's (slot, source) pairs: a folder's chunk is that list; an archive's unit holds it in `tasks`."""
    return getattr(chunk, "tasks", chunk)


def with_tasks(chunk, tasks: list[tuple[int, Any]]):
    """The same kind of chunk, holding only `tasks` (what a stalled worker left, for another)."""
    return replace(chunk, tasks=tasks) if hasattr(chunk, "tasks") else tasks


def source_name(source: Any) -> str:
    """A source in words: an archive member's name, or a path."""
    return str(getattr(source, "name", source))
