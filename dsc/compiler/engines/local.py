"""The local engine: chunks decoded by worker processes of this machine (or in this process).

Workers are processes (decoding is CPU-bound and partly holds the GIL), forked when the engine
is entered, before discovery: each imports the decoders and torch (`write`) while the driver,
which never imports torch, is still listing the sources. A chunk travels with its `WriteJob`;
each worker keeps one `SlotWriter` per job. At most IN_FLIGHT_PER_WORKER chunks per worker are
queued at a time, so a compile of millions of sources keeps a bounded queue. A worker that dies
(the OOM killer, a crash in a decoder) fails the compile at once instead of hanging it, and any
failure stops every worker. With one worker, chunks are decoded in this process (no pool).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from itertools import islice

from dsc.compiler.jobs import Chunk, OnResults, SlotResult, WriteJob
from dsc.errors import CompileError

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# fork starts a worker in milliseconds; spawn re-imports Python's start-up in each. The workers use
# no threads of the parent: they are forked before discovery starts its walk threads.
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the parent's to handle (see _init_worker)
IN_FLIGHT_PER_WORKER = 4  # queued chunks per worker: none idles between chunks, the queue stays small


class LocalEngine:
    """`workers` processes here, started on entry (`with LocalEngine(n) as engine:`); one worker
    decodes in this process."""

    def __init__(self, workers: int, address: str | None = None) -> None:
        if address is not None:
            raise CompileError("an address is only for --engine ray")
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._before: set = set()

    def __enter__(self) -> LocalEngine:
        if self.workers > 1:
            self._before = set(multiprocessing.active_children())
            self._pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context(START_METHOD),
                                             _init_worker, (os.getpid(),))
            # A Ctrl-C between a fork and the worker's own SIG_IGN would end that worker with a traceback:
            # the workers are forked with SIGINT and SIGTERM blocked (the parent gets them after the forks).
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            try:
                self._pool.submit(os.getpid)  # forks every worker now: their imports overlap discovery
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self._stop(finished=kind is None)

    def _stop(self, finished: bool) -> None:
        """Shut the pool down: wait for idle workers to exit, or, after a failure, kill them at once."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        pool.shutdown(wait=finished, cancel_futures=not finished)
        for process in set(multiprocessing.active_children()) - self._before:
            process.kill()  # SIGKILL: the workers ignore SIGINT and SIGTERM
            process.join(timeout=10)

    def fill(self, job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
        if self._pool is None:
            _fill_here(job, chunks, on_results)
            return
        chunks = iter(chunks)
        try:
            pending: set[Future] = {self._pool.submit(_work, job, c)
                                    for c in islice(chunks, self.workers * IN_FLIGHT_PER_WORKER)}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                pending |= {self._pool.submit(_work, job, c) for c in islice(chunks, len(done))}
                for future in done:
                    on_results(future.result())
        except BrokenProcessPool as e:
            self._stop(finished=False)
            raise CompileError("a worker process died (killed by a signal, or out of memory?); the output was "
                               "not written, and the same command with --resume continues the work") from e
        except BaseException:  # --strict, Ctrl-C: no worker may go on writing into the build
            self._stop(finished=False)
            raise


def _fill_here(job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
    """One worker: decode in this process, each chunk with a writer of its own (`write.write_chunk`)."""
    from dsc.compiler import write  # the decoding side: imported only where records are written

    for chunk in chunks:
        on_results(write.write_chunk(job, chunk))


_WRITERS: dict = {}  # in each worker: its SlotWriter for the job at hand


def _writer(job: WriteJob):
    """This worker's `SlotWriter` for `job` (made on its first chunk)."""
    if job not in _WRITERS:
        from dsc.compiler.write import SlotWriter  # imported by _init_worker already: no cost here

        _WRITERS.clear()
        _WRITERS[job] = SlotWriter(job)
    return _WRITERS[job]


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when the compile process dies (kill -9 included),
    so no orphan goes on writing into a partial build that a resumed compile now owns."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _init_worker(parent: int) -> None:
    _die_with_parent(parent)
    # Ctrl-C and SIGTERM sent to the whole process group are the parent's to handle: it cleans up
    # and then kills us. A worker that died of them first would read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    import dsc.compiler.write  # noqa: F401  (the decoders and torch, while the driver discovers)


def _work(job: WriteJob, chunk: Chunk) -> list[SlotResult]:
    return _writer(job).write(chunk)
