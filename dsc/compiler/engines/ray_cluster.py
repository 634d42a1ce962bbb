"""The Ray engine: the same chunks as the local engine, each one Ray task on the cluster.

Each task decodes one chunk and writes its records straight into the shard files of the
partial build, which must therefore be on storage every node sees (as must SRC). Only
(slot, size, CRC or reason) comes back to the driver, which keeps the journal and finishes
the dataset exactly as with the local engine: the bytes are identical. At most
IN_FLIGHT_PER_CPU tasks per cluster CPU are submitted at a time, so the driver holds a
bounded number of task references whatever the number of sources, and the progress moves
chunk by chunk. A task whose worker dies is retried by Ray (`RETRIES` times); writing a slot
twice writes the same bytes, so a retry is harmless and redoes one chunk only.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable
from itertools import islice

from dsc.compiler.jobs import Chunk, OnResults, WriteJob
from dsc.errors import CompileError

RETRIES = 3  # a task whose worker process dies is run again this many times
ADDRESS_TIMEOUT_S = 5.0
PROBE_S = 2.0  # while no task finishes, the cluster's head is checked this often: Ray itself waits 60 s, then exits
LOST = ("lost the Ray cluster at {address} (its head stopped?); the work so far is kept beside OUT: run the same "
        "dsc compile command with --resume to continue")
IN_FLIGHT_PER_CPU = 2  # one running, one queued behind it: no CPU waits for the driver


class RayEngine:
    """Tasks on the Ray cluster at `address`, or on a local one of `workers` CPUs."""

    def __init__(self, workers: int, address: str | None = None, stall_seconds: float | None = None) -> None:
        if stall_seconds is not None:
            raise CompileError("a stall limit is for the local engine; Ray tasks have none yet")
        check_address(address)  # before any partial build exists
        self.workers, self.address = workers, address
        self._ray, self._started = None, False

    def __enter__(self) -> RayEngine:
        """Join (or start) the cluster now, while the driver discovers the sources."""
        self._ray, self._started = _connect(self.address, self.workers)
        return self

    def __exit__(self, *exc) -> None:
        if self._started:
            self._ray.shutdown()
        self._ray, self._started = None, False

    def ready(self) -> None:
        """The cluster's workers import the decoders in each task; a failure there is reported per task."""

    def fill(self, job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
        ray = self._ray
        remote = ray.remote(num_cpus=1, max_retries=RETRIES)(write_chunk)
        chunks = iter(chunks)
        limit = max(1, int(ray.cluster_resources().get("CPU", 1))) * IN_FLIGHT_PER_CPU
        pending = [remote.remote(job, chunk) for chunk in islice(chunks, limit)]
        head = ray.get_runtime_context().gcs_address
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=PROBE_S)
                if not done:
                    _check_head(head)
                    continue
                pending += [remote.remote(job, chunk) for chunk in islice(chunks, 1)]
                on_results(_result(ray, done[0]))
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)


def write_chunk(job: WriteJob, chunk: Chunk) -> list:
    """One task (`ray::write_chunk`): fill one chunk's slots, on a Ray worker; the driver never
    imports the decoders."""
    from dsc.compiler import write

    return write.write_chunk(job, chunk)


def _result(ray, ref):
    """A finished task's results, or a CompileError that says what went wrong where."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # the task's own code raised: not retried
        cause = getattr(e, "cause", None) or e
        raise CompileError(f"a Ray task failed: {type(cause).__name__}: {cause} (are SRC and OUT's folder "
                           "on storage every node sees?)") from e
    except ray.exceptions.RayError as e:  # the worker died and every retry too
        raise CompileError(f"a Ray task's worker died {RETRIES + 1} times ({type(e).__name__}); the output "
                           "was not written, and the same command with --resume continues the work") from e


def _check_head(head: str) -> None:
    """CompileError at once when nobody listens at the head's address any more."""
    try:
        check_address(head, PROBE_S)
    except CompileError:
        raise CompileError(LOST.format(address=head)) from None


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
