"""The local engine: chunks decoded by worker processes of this machine (or in this process).

Workers are processes (decoding is CPU-bound and partly holds the GIL), forked once, each with
its own `SlotWriter`. At most IN_FLIGHT_PER_WORKER chunks per worker are queued at a time, so
a compile of millions of sources keeps a bounded queue. A worker that dies (the OOM killer, a
crash in a decoder) fails the compile at once instead of hanging it, and any failure stops
every worker.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import chain, islice

from dsc.compiler.jobs import Chunk, OnResults, SlotResult, WriteJob
from dsc.compiler.write import SlotWriter, write_chunk
from dsc.errors import CompileError

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# fork starts a worker in milliseconds; spawn re-imports torch in each (~1.3 s here). The
# workers use no threads of the parent (torch is set to one thread before any work).
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
IN_FLIGHT_PER_WORKER = 4  # queued chunks per worker: none idles between chunks, the queue stays small


class LocalEngine:
    """`workers` processes here; one worker decodes in this process (no pool to start)."""

    def __init__(self, workers: int, address: str | None = None) -> None:
        if address is not None:
            raise CompileError("an address is only for --engine ray")
        self.workers = workers

    def fill(self, job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
        chunks = iter(chunks)
        first = list(islice(chunks, self.workers * IN_FLIGHT_PER_WORKER))
        workers = min(self.workers, len(first))  # no pool of 8 for 2 chunks
        if workers <= 1:
            for chunk in chain(first, chunks):
                on_results(write_chunk(job, chunk))
            return
        _fill_in_processes(job, chain(first, chunks), workers, on_results)


_WRITER: SlotWriter | None = None


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when the compile process dies (kill -9 included),
    so no orphan goes on writing into a partial build that a resumed compile now owns."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _init_worker(job: WriteJob, parent: int) -> None:
    global _WRITER
    _die_with_parent(parent)
    # Ctrl-C and SIGTERM sent to the whole process group are the parent's to handle: it cleans up
    # and then kills us. A worker that died of them first would read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _WRITER = SlotWriter(job)


def _work(chunk: Chunk) -> list[SlotResult]:
    if _WRITER is None:
        raise RuntimeError("worker used before _init_worker")
    return _WRITER.write(chunk)


def _fill_in_processes(job: WriteJob, chunks: Iterator[Chunk], workers: int, on_results: OnResults) -> None:
    before = set(multiprocessing.active_children())
    executor = ProcessPoolExecutor(workers, multiprocessing.get_context(START_METHOD), _init_worker,
                                   (job, os.getpid()))
    finished = False
    try:
        pending: set[Future] = {executor.submit(_work, c) for c in islice(chunks, workers * IN_FLIGHT_PER_WORKER)}
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            pending |= {executor.submit(_work, c) for c in islice(chunks, len(done))}
            for future in done:
                on_results(future.result())
        finished = True
    except BrokenProcessPool as e:
        raise CompileError("a worker process died (killed by a signal, or out of memory?); the output was "
                           "not written, and the same command with --resume continues the work") from e
    finally:
        executor.shutdown(wait=finished, cancel_futures=not finished)
        for process in set(multiprocessing.active_children()) - before:
            process.kill()  # SIGKILL: the workers ignore SIGINT and SIGTERM
            process.join(timeout=10)
