"""Stall real worker processes of a running compile with SIGSTOP, as a decoder that never returns or a read
from a dead mount would (issue 27, point 3): the loop the stall tests of both engines share
(test_stalls, test_ray_stalls). Linux only: the process tree is read from /proc.

`run_stopping` runs the compile and, until it has stopped as many processes as asked, asks the test's
`pick` which to stop now, from what the compile shows: its process tree, and the lines it has written to
stderr so far (where the compile names a stalled worker by its pid). Every wait is bounded; whatever it
stopped is killed at the end, should the compile not have done so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO

POLL_S = 0.005  # how often `pick` is asked


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def chunk_task_workers(pid: int) -> list[int]:
    """The Ray workers below `pid` (the process whose ray.init started a local cluster: the raylet is its child,
    the workers the raylet's) running a dsc chunk task: never another test's, which may run beside this one."""
    found = []
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::write_chunk"):
                    found.append(p)
        except OSError:
            pass
    return found


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")
    except OSError:
        return True


def _collect(stream: IO[str], into: list[str]) -> None:
    for line in stream:  # ends when the compile closes it
        into.append(line)


def run_stopping(command: Sequence[str], to_stop: int, pick: Callable[[int, list[str]], list[int]],
                 timeout_s: float) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run `command`; SIGSTOP each process `pick(compile's pid, stderr lines so far)` names until `to_stop`
    are stopped, then wait for the compile to end; (the finished compile, the pids stopped in order)."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=_collect, args=(s, into), daemon=True)
               for s, into in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    stopped: list[int] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(stopped) < to_stop and proc.poll() is None and time.monotonic() < deadline:
            for pid in pick(proc.pid, list(err)):
                if pid not in stopped and len(stopped) < to_stop:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
            time.sleep(POLL_S)
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the compile did not end in {timeout_s:g} s (stopped {stopped}); its stderr:\n"
                                 + "".join(err)) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for r in readers:
            r.join(timeout=10)
        for pid in stopped:  # the compile kills them; should it not have, they must not outlive the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(list(command), proc.returncode, "".join(out), "".join(err)), stopped
