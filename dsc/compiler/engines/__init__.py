"""Engines: where the decoding runs. Each is a small class with `fill(job, chunks, on_results)`
(see `jobs.Engine`), made from this table by `make_engine`; the compiler never asks which one
it has, and the two never import each other. Their outputs are byte-identical."""

from __future__ import annotations

import os

from dsc.arguments import check_int
from dsc.compiler.engines.local import LocalEngine
from dsc.compiler.engines.ray_cluster import RayEngine
from dsc.compiler.jobs import Engine
from dsc.errors import CompileError

ENGINES = {"local": LocalEngine, "ray": RayEngine}
MAX_WORKERS = 1024  # worker processes (or Ray tasks in flight) a compile asks for; more is a typo, or a fork bomb


def make_engine(name: str, workers: int, address: str | None, stall_seconds: float | None = None) -> Engine:
    """The engine called `name`; it checks its own options (a Ray address is reached before any build exists)."""
    if name not in ENGINES:
        raise CompileError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    return ENGINES[name](workers, address, stall_seconds)


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, e.g. under a batch scheduler), not all cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_workers(workers: int | None) -> int:
    if workers is None:
        return available_cores()
    return check_int("workers", workers, 1, MAX_WORKERS, error=CompileError)
