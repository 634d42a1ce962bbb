"""The local engine's host process: it runs the worker processes, hands them chunks, and stops a
worker that makes no progress.

Each worker reports every slot as it finishes it. A worker that reports nothing for the stall
limit (a decoder that never returns on a pathological file, a read blocked on a dead network
mount, a process stopped by SIGSTOP) is killed and replaced, and the slots of its chunk that are
not done yet go back to the front of the queue, for another worker. The slot it was on when it
stalled is counted: a source that stalls STALLS_TO_SKIP times is recorded as skipped, so one
pathological file cannot stall a compile for ever. Half-way to the limit, the driver is told which
worker waits on which source.

A worker killed while writing a record leaves that slot half-written; the worker that redoes the
slot writes all of it, so the output does not depend on which worker ran what.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from dsc.compiler.jobs import Chunk, SlotResult, WriteJob, chunk_tasks, source_name, with_tasks

DEFAULT_STALL_S = 300.0  # a worker silent this long (no slot finished) is stopped and its chunk retried
MAX_STALL_S = 86400.0  # a day: a longer limit is no limit
STALLS_TO_SKIP = 2  # a source on which this many workers stalled is skipped
TICK_S = 0.5  # how often stalls are looked for when nothing else happens


def stall_reason(stall_s: float) -> str:
    """A skipped source's reason: its decode stalled STALLS_TO_SKIP times."""
    return f"decode did not finish in {stall_s:g} s ({STALLS_TO_SKIP} workers stalled on it)"


@dataclass
class _Worker:
    process: multiprocessing.Process
    conn: Connection
    task: tuple[int, Chunk] | None = None  # (chunk id, its slots not done when handed over)
    last: float = 0.0  # when it last made progress (monotonic)
    told: bool = False  # the driver heard that it is slow on its current slot


@dataclass
class _Chunk:
    slots: Chunk  # the chunk as the driver sent it: a folder's (slot, path) list, or an archive's unit
    results: dict[int, SlotResult] = field(default_factory=dict)


class Failed(Exception):
    """A worker died or raised: the message for the driver ("broken", or the exception in words)."""


class Supervisor:
    """The host's loop: chunks from the driver (`conn`) to `workers` processes, results back."""

    def __init__(self, conn: Connection, context, job: WriteJob, workers: int, stall_s: float,
                 init_worker: Callable[[], None]) -> None:
        self.conn, self.context, self.job, self.stall_s = conn, context, job, stall_s
        self._init_worker = init_worker
        self.chunks: dict[int, _Chunk] = {}
        self.queue: deque[tuple[int, Chunk]] = deque()
        self.stalls: Counter[int] = Counter()
        self.workers = [self._start_worker() for _ in range(workers)]
        self._next = 0
        self.ended_by: tuple = ("end",)  # the driver's message that ended `run`: "end", or the next fill's "start"

    def run(self) -> None:
        """Serve the driver until it says "end" (return) or goes away (EOFError); Failed when a worker fails."""
        try:
            while True:
                ready = wait([self.conn, *(w.conn for w in self.workers)], timeout=TICK_S)
                if self.conn in ready and not self._from_driver():
                    return
                for worker in [w for w in self.workers if w.conn in ready]:
                    self._from_worker(worker)
                self._look_for_stalls()
                self._hand_out()
        finally:
            for worker in self.workers:
                worker.process.kill()
                worker.process.join()

    def _from_driver(self) -> bool:
        kind, *args = self.conn.recv()
        if kind != "chunk":  # "end", or "start" of the driver's next fill
            self.ended_by = (kind, *args)
            return False
        self.chunks[self._next] = _Chunk(args[0])
        self.queue.append((self._next, args[0]))
        self._next += 1
        return True

    def _from_worker(self, worker: _Worker) -> None:
        try:
            while worker.conn.poll():
                kind, value = worker.conn.recv()
                if kind == "error":
                    raise Failed(value)
                chunk_id = worker.task[0]
                if kind == "slot":
                    self.chunks[chunk_id].results[value.slot] = value
                    worker.last, worker.told = time.monotonic(), False
                else:  # "idle": its chunk is done
                    worker.task = None
                    self._finish(chunk_id)
        except (EOFError, OSError):  # it died: killed by a signal, out of memory
            raise Failed("broken") from None

    def _look_for_stalls(self) -> None:
        now = time.monotonic()
        for worker in [w for w in self.workers if w.task is not None]:
            chunk_id, _ = worker.task
            chunk = self.chunks[chunk_id]
            left = [task for task in chunk_tasks(worker.task[1]) if task[0] not in chunk.results]
            quiet = now - worker.last
            if quiet >= self.stall_s:
                self._replace(worker, chunk_id, chunk, left)
            elif quiet >= self.stall_s / 2 and not worker.told and left:
                self._tell(f"worker {worker.process.pid} has made no progress for {quiet:.0f} s on "
                           f"{source_name(left[0][1])}; it is stopped at {self.stall_s:g} s and its work given to "
                           "another")
                worker.told = True

    def _replace(self, worker: _Worker, chunk_id: int, chunk: _Chunk, left: list[tuple[int, Any]]) -> None:
        """Kill a stalled worker, start another, and queue what it left (less a source that stalled too often)."""
        worker.process.kill()
        worker.process.join()
        worker.conn.close()
        self.workers[self.workers.index(worker)] = self._start_worker()
        if not left:  # it stalled after its last slot: nothing to redo
            self._finish(chunk_id)
            return
        slot, source = left[0]
        self.stalls[slot] += 1
        if self.stalls[slot] >= STALLS_TO_SKIP:
            chunk.results[slot] = SlotResult(slot, reason=stall_reason(self.stall_s))
            left = left[1:]
        then = "the source is skipped" if slot in chunk.results else "another worker tries it again"
        self._tell(f"worker {worker.process.pid} made no progress for {self.stall_s:g} s on {source_name(source)}: "
                   f"stopped; {then}")
        if left:
            self.queue.appendleft((chunk_id, with_tasks(worker.task[1], left)))
        else:
            self._finish(chunk_id)

    def _finish(self, chunk_id: int) -> None:
        chunk = self.chunks[chunk_id]
        if len(chunk.results) == len(chunk_tasks(chunk.slots)) and not any(chunk_id == q[0] for q in self.queue):
            del self.chunks[chunk_id]
            self.conn.send(("done", [chunk.results[slot] for slot, _ in chunk_tasks(chunk.slots)]))

    def _hand_out(self) -> None:
        for worker in self.workers:
            if worker.task is None and self.queue:
                worker.task = self.queue.popleft()
                worker.last, worker.told = time.monotonic(), False
                # A stopped worker never reads: a chunk too big for the pipe would block this loop, so
                # it is sent from a thread of its own, which ends when the worker reads it or is killed.
                threading.Thread(target=_send, args=(worker.conn, ("chunk", worker.task[1])), daemon=True).start()

    def _tell(self, line: str) -> None:
        self.conn.send(("note", line))

    def _start_worker(self) -> _Worker:
        mine, theirs = self.context.Pipe()
        process = self.context.Process(target=_worker_main, args=(theirs, self.job, self._init_worker),
                                       name="dsc-worker", daemon=True)
        process.start()
        theirs.close()
        return _Worker(process, mine, last=time.monotonic())


def _send(conn: Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:  # the worker was killed first
        pass


def _worker_main(conn: Connection, job: WriteJob, init: Callable[[], None]) -> None:
    """A worker: fill each chunk it is sent, reporting every slot as it is done."""
    init()
    from dsc.compiler.write import writer_for  # imported by the host already: shared, no cost here

    writer = writer_for(job)
    try:
        while True:
            try:
                _, chunk = conn.recv()
            except EOFError:  # the host is done with us
                return
            try:
                writer.write(chunk, on_result=lambda result: conn.send(("slot", result)))
            except BaseException as e:  # a bug in dsc, not a bad image (those are SlotResults)
                conn.send(("error", "".join(traceback.format_exception_only(type(e), e)).strip()))
                return
            conn.send(("idle", None))
    finally:
        writer.close()
        os._exit(0)
