"""The Ray engine: the same slots as the local engine, filled by Ray tasks, one per shard.

Each task decodes the sources of one shard's slots and writes their records straight into
that shard file of the partial build, which must therefore be on storage every node sees
(as must SRC). Only (slot, size, CRC or reason) comes back to the driver, which keeps the
journal and finishes the dataset exactly as the local engine does: the bytes are identical.
A task whose worker dies is retried by Ray (`RETRIES` times); writing a slot twice writes the
same bytes, so a retry is harmless.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from itertools import groupby

from dsc.compiler.write import SlotResult, SlotWriter, WriteJob
from dsc.errors import CompileError

RETRIES = 3  # a task whose worker process dies is run again this many times
ADDRESS_TIMEOUT_S = 5.0


def write_shard(job: WriteJob, tasks: list[tuple[int, str]]) -> list[SlotResult]:
    """One Ray task: fill these slots (all of one shard)."""
    writer = SlotWriter(job)
    try:
        return writer.write(tasks)
    finally:
        writer.close()


def check_address(address: str | None, timeout_s: float = ADDRESS_TIMEOUT_S) -> None:
    """Fail fast on a `host:port` nobody listens on: Ray itself would retry for minutes, deaf to Ctrl-C."""
    if not address or ":" not in address or address.startswith("ray://") or address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise CompileError(f"cannot reach the Ray cluster at {address}: {e}") from e


def _connect(address: str | None, workers: int):
    """Join the cluster at `address`, or start a local one of `workers` CPUs; return (ray, started)."""
    try:
        import ray
    except ImportError as e:
        raise CompileError("--engine ray needs Ray: pip install 'dsc[ray]'") from e
    if ray.is_initialized():
        return ray, False
    try:
        ray.init(address=address, num_cpus=None if address else workers, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CompileError(f"cannot reach the Ray cluster at {address or 'a new local instance'}: {e}") from e
    return ray, True


def fill_with_ray(job: WriteJob, tasks: list[tuple[int, str]], workers: int, address: str | None,
                  on_results: Callable[[list[SlotResult]], None]) -> None:
    """`fill_slots` on a Ray cluster: one task per shard, results handed over as tasks finish."""
    ray, started = _connect(address, workers)
    remote = ray.remote(num_cpus=1, max_retries=RETRIES)(write_shard)
    by_shard = [list(group) for _, group in groupby(tasks, key=lambda t: t[0] // job.records_per_shard)]
    pending = [remote.remote(job, group) for group in by_shard]
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                on_results(ray.get(done[0]))
            except ray.exceptions.RayTaskError as e:  # the task's own code raised: not retried
                cause = getattr(e, "cause", None) or e
                raise CompileError(f"a Ray task failed: {type(cause).__name__}: {cause} (are SRC and OUT's folder "
                                   "on storage every node sees?)") from e
            except ray.exceptions.RayError as e:  # the worker died and every retry too
                raise CompileError(f"a Ray task's worker died {RETRIES + 1} times ({type(e).__name__}); the output "
                                   "was not written, and the same command with --resume continues the work") from e
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started:
            ray.shutdown()
