"""The interpreter's thread switch interval while a loader's producer thread runs.

A training loop that launches kernels as fast as it can (a small model on a fast GPU) holds the GIL
nearly all the time. CPython hands the GIL to a waiting thread only once that thread has waited a
whole switch interval (`sys.getswitchinterval`, 5 ms by default), and the producer gives the GIL up
many times per batch (each copy, each wait, each CUDA call): every time it wants it back it waits up
to 5 ms, so its batches stop being made while the step runs, and the loop waits for them instead
(benchmarks/busy_loop_bench.py: a loop busy 5 ms a step waited 1.8 ms a step at 5 ms, 0.6 ms at 1 ms;
on an H200, resnet18 at 160 px read 0.33x the synthetic feed's samples/s). torch's pin-memory
thread meets the same wall (pytorch#77139).

While any producer runs, the interval is lowered to `SWITCH_S` unless it is lower already, and what
was found is put back when the last producer stops, unless someone else changed it meanwhile. It is
process-wide, as the GIL is. ``DSC_SWITCH_INTERVAL=off`` leaves it alone; a number of seconds sets
the interval to use instead.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "DSC_SWITCH_INTERVAL"
SWITCH_S = 0.001  # a switch costs a few microseconds: at most a few per cent of a millisecond
_TOLERANCE_S = 1e-7  # the interpreter keeps the interval in whole microseconds


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders = 0
        self.found: float | None = None  # the interval before the first holder, when it was changed
        self.set: float | None = None  # the interval set then


_state = _State()


def target() -> float | None:
    """The interval producers run under (None: leave it alone), from `DSC_SWITCH_INTERVAL`; a bad value is refused."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return SWITCH_S
    if raw.lower() == "off":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 1e-6 <= value <= 1.0:
        raise ValueError(f"{ENV}={raw!r}: give 'off' (leave the interpreter's switch interval alone) or an "
                         f"interval in seconds between 1e-6 and 1, e.g. {SWITCH_S}")
    return value


@contextmanager
def lowered() -> Iterator[None]:
    """Run the block with the switch interval at `target()` at most; the last block to end restores it."""
    state = _state
    with state.lock:
        state.holders += 1
        if state.holders == 1:
            want, now = target(), sys.getswitchinterval()
            if want is not None and want < now - _TOLERANCE_S:
                state.found, state.set = now, want
                sys.setswitchinterval(want)
    try:
        yield
    finally:
        with state.lock:
            state.holders -= 1
            if state.holders == 0 and state.set is not None:
                if abs(sys.getswitchinterval() - state.set) < _TOLERANCE_S:  # else: someone chose another one
                    sys.setswitchinterval(state.found)
                state.found = state.set = None


def _after_fork_in_child() -> None:
    """A forked child has no producer thread: the interval its parent's producers lowered goes back."""
    global _state
    old, _state = _state, _State()
    if old.set is not None and abs(sys.getswitchinterval() - old.set) < _TOLERANCE_S:
        sys.setswitchinterval(old.found)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
