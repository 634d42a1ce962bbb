"""The Ray driver's book of tasks in flight: which chunk each task fills, which of its slots it has
reported, and which task has gone silent.

A task (`ray_cluster.write_chunk`, a streaming generator) first says which worker process runs it,
then yields each slot's result as soon as the slot is written. A task that yields nothing for the
stall limit once it has started (a decoder that never returns on a pathological file, a read
blocked on a dead network mount, a worker stopped by SIGSTOP) is cancelled, which kills its worker,
and the slots it had not reported go back to the front of the queue, as a task of their own. The
slot it was on is counted: a source that STALLS_TO_SKIP tasks stalled on is recorded as skipped, as
with the local engine's workers (`supervisor`). Half-way to the limit, the driver is told which task
waits on which source.

A task that has not said it started may be waiting for a CPU behind others, or for a new worker
process to start, so it is timed only while no task at all makes progress, and given at least
START_S: a worker stopped before its first word, or a cluster whose
workers never start, is cancelled too and its chunk handed out again, blaming no source; a chunk
whose tasks fail to start STARTS_TO_FAIL times ends the compile with a message, the work kept.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from dsc.compiler.engines.supervisor import STALLS_TO_SKIP, stall_reason
from dsc.compiler.jobs import Chunk, SlotResult, chunk_tasks, source_name, with_tasks
from dsc.errors import CompileError

STARTS_TO_FAIL = 4  # a chunk handed out this many times without a task starting on it ends the compile
START_S = 120.0  # a task not started is given at least this long: a new worker process starts, registers (Ray
# kills one that has not in 60 s) and imports the decoders (~10 s under load here) before it can say a word
NEVER_STARTED = ("no Ray task started on {source} in {stall_s:g} s, {tries} times in a row (is the cluster busy, or "
                 "are its workers unable to start?); the work so far is kept beside OUT: run the same dsc compile "
                 "command with --resume to continue")


@dataclass(frozen=True)
class Started:
    """A task's first item: the worker process that runs it, so that a stall can name it."""

    pid: int
    node: str

    @classmethod
    def here(cls) -> Started:
        return cls(os.getpid(), socket.gethostname())

    def __str__(self) -> str:
        return f"Ray task in worker {self.pid} on {self.node}"


@dataclass
class _Task:
    chunk_id: int
    chunk: Chunk  # the slots it was given
    last: float  # when it was submitted or last made progress (monotonic)
    worker: Started | None = None  # None until it starts running
    told: bool = False  # the driver heard that it is slow on its current slot


@dataclass
class _Chunk:
    slots: Chunk  # the chunk as the driver made it
    results: dict[int, SlotResult] = field(default_factory=dict)
    tasks: int = 0  # its tasks in flight or queued
    unstarted: int = 0  # its tasks in a row cancelled before they started


class TaskBook:
    """Tasks in flight, keyed by the handle `submit` returned for each; `cancel` kills one, `note` says a line."""

    def __init__(self, chunks: Iterator[Chunk], submit: Callable[[Chunk], Any], cancel: Callable[[Any], None],
                 note: Callable[[str], None], stall_s: float) -> None:
        self._fresh, self._submit, self._cancel, self._note = chunks, submit, cancel, note
        self.stall_s = stall_s
        self.running: dict[Any, _Task] = {}
        self._chunks: dict[int, _Chunk] = {}
        self._retries: deque[tuple[int, Chunk]] = deque()  # what stalled tasks left, handed out first
        self._stalls: Counter[int] = Counter()
        self._next = 0
        self._moved = time.monotonic()  # when any task last made progress, or a stalled one freed its CPU

    def top_up(self, limit: int) -> bool:
        """Submit tasks until `limit` are in flight (retries first); False once all work is done."""
        while len(self.running) < limit:
            if self._retries:
                chunk_id, chunk = self._retries.popleft()
            else:
                chunk = next(self._fresh, None)
                if chunk is None:
                    break
                chunk_id, self._next = self._next, self._next + 1
                self._chunks[chunk_id] = _Chunk(chunk, tasks=1)
            self.running[self._submit(chunk)] = _Task(chunk_id, chunk, last=time.monotonic())
        return bool(self.running)

    def item(self, handle: Any, item: Started | SlotResult) -> None:
        """A task's next item: where it started, or one slot done."""
        task = self.running[handle]
        if isinstance(item, Started):
            task.worker = item
            self._chunks[task.chunk_id].unstarted = 0
        else:
            self._chunks[task.chunk_id].results[item.slot] = item
        task.last = self._moved = time.monotonic()
        task.told = False

    def ended(self, handle: Any) -> list[SlotResult] | None:
        """A task returned: its chunk's results in slot order once the whole chunk is done, else None."""
        return self._task_over(self.running.pop(handle).chunk_id)

    def look_for_stalls(self) -> list[list[SlotResult]]:
        """Cancel each task silent for the stall limit and queue what it left; the chunks that this finishes."""
        finished = []
        for handle, task in [(h, t) for h, t in self.running.items() if t.worker is not None]:
            left = self._left(task)
            quiet = time.monotonic() - task.last
            if quiet >= self.stall_s:
                done = self._replace(handle, task, left)
                if done is not None:
                    finished.append(done)
            elif quiet >= self.stall_s / 2 and not task.told and left:
                self._note(f"{task.worker} has made no progress for {quiet:.0f} s on {source_name(left[0][1])}; "
                           f"it is cancelled at {self.stall_s:g} s and its work given to another")
                task.told = True
        for handle, task in [(h, t) for h, t in self.running.items() if t.worker is None]:
            if time.monotonic() - max(task.last, self._moved) >= max(self.stall_s, START_S):
                self._hand_out_again(handle, task)
        return finished

    def cancel_all(self) -> None:
        for handle in self.running:
            self._cancel(handle)
        self.running.clear()

    def _left(self, task: _Task) -> list[tuple[int, Any]]:
        results = self._chunks[task.chunk_id].results
        return [pair for pair in chunk_tasks(task.chunk) if pair[0] not in results]

    def _replace(self, handle: Any, task: _Task, left: list[tuple[int, Any]]) -> list[SlotResult] | None:
        """Cancel a stalled task and queue what it left, less a source that stalled too often."""
        self._cancel(handle)
        del self.running[handle]
        self._moved = time.monotonic()  # its CPU is free: a task waiting for one gets the whole limit again
        chunk = self._chunks[task.chunk_id]
        if left:
            slot, source = left[0]
            self._stalls[slot] += 1
            skipped = self._stalls[slot] >= STALLS_TO_SKIP
            if skipped:
                chunk.results[slot] = SlotResult(slot, reason=stall_reason(self.stall_s))
                left = left[1:]
            then = "the source is skipped" if skipped else "another task tries it again"
            self._note(f"{task.worker} made no progress for {self.stall_s:g} s on {source_name(source)}: "
                       f"cancelled; {then}")
        elif task.chunk:  # it stalled after its last slot, before it ended (a bucket build's chunk object):
            left = chunk_tasks(task.chunk)  # its whole part again, blaming none (a slot rewritten is the same)
            self._note(f"{task.worker} made no progress for {self.stall_s:g} s after its last source: cancelled; "
                       "another task does its part again")
        if left:
            self._retries.append((task.chunk_id, with_tasks(task.chunk, left)))
            chunk.tasks += 1
        return self._task_over(task.chunk_id)

    def _hand_out_again(self, handle: Any, task: _Task) -> None:
        """Cancel a task that never started, and queue its slots again, blaming none of them."""
        self._cancel(handle)
        del self.running[handle]
        chunk = self._chunks[task.chunk_id]
        chunk.unstarted += 1
        first = source_name(chunk_tasks(task.chunk)[0][1])
        if chunk.unstarted >= STARTS_TO_FAIL:
            raise CompileError(NEVER_STARTED.format(source=first, stall_s=max(self.stall_s, START_S),
                                                    tries=chunk.unstarted))
        self._note(f"the Ray task for {first} and on did not start in {max(self.stall_s, START_S):g} s: cancelled "
                   "and submitted again")
        self._retries.append((task.chunk_id, task.chunk))

    def _task_over(self, chunk_id: int) -> list[SlotResult] | None:
        chunk = self._chunks[chunk_id]
        chunk.tasks -= 1
        if chunk.tasks:
            return None
        missing = len(chunk_tasks(chunk.slots)) - len(chunk.results)
        if missing:  # every task reports each of its slots: this is a bug, not a bad image
            raise CompileError(f"a Ray task ended without reporting {missing} of its slots")
        del self._chunks[chunk_id]
        return [chunk.results[slot] for slot, _ in chunk_tasks(chunk.slots)]
