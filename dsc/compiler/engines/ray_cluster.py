"""The Ray engine: the same chunks as the local engine, each one Ray task on the cluster.

Each task decodes one chunk and writes its records straight into the shard files of the
partial build, which must therefore be on storage every node sees (as must SRC). Only
(slot, size, CRC or reason) comes back to the driver, slot by slot as each is written (the task
is a streaming generator), and the driver keeps the journal and finishes the dataset exactly as
with the local engine: the bytes are identical. At most IN_FLIGHT_PER_CPU tasks per cluster CPU
are submitted at a time, so the driver holds a bounded number of task references whatever the
number of sources, and the progress moves chunk by chunk. A task whose worker dies is retried by
Ray (`RETRIES` times); a task that reports no slot for the stall limit is cancelled and what it
left given to another (`ray_tasks`). Writing a slot twice writes the same bytes, so a retry is
harmless and redoes one chunk at most.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Iterable, Iterator

from dsc.compiler.engines.ray_tasks import Started, TaskBook
from dsc.compiler.engines.supervisor import DEFAULT_STALL_S
from dsc.compiler.jobs import Chunk, OnResults, WriteJob
from dsc.errors import CompileError

RETRIES = 3  # a task whose worker process dies is run again this many times
ADDRESS_TIMEOUT_S = 5.0
PROBE_S = 2.0  # while no task finishes, the cluster's head is checked this often: Ray itself waits 60 s, then exits
LOST = ("lost the Ray cluster at {address} (its head stopped?); the work so far is kept beside OUT: run the same "
        "dsc compile command with --resume to continue")
IN_FLIGHT_PER_CPU = 2  # one running, one queued behind it: no CPU waits for the driver
logger = logging.getLogger("dsc")  # a stalled task is reported here (see dsc.compiler.pipeline)


class RayEngine:
    """Tasks on the Ray cluster at `address`, or on a local one of `workers` CPUs."""

    forks_here = False  # its workers are Ray's processes, started by Ray

    def __init__(self, workers: int, address: str | None = None, stall_seconds: float | None = None) -> None:
        check_address(address)  # before any partial build exists
        self.workers, self.address = workers, address
        self.stall_s = DEFAULT_STALL_S if stall_seconds is None else stall_seconds
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
        limit = max(1, int(ray.cluster_resources().get("CPU", 1))) * IN_FLIGHT_PER_CPU
        book = TaskBook(iter(chunks), submit=lambda chunk: remote.remote(job, chunk),
                        cancel=lambda task: ray.cancel(task, force=True),  # kills its worker, stopped or not
                        note=lambda line: logger.warning("%s", line), stall_s=self.stall_s)
        head = ray.get_runtime_context().gcs_address
        tick = min(PROBE_S, self.stall_s / 4)  # a stall is seen, and said half-way, within a quarter of the limit
        try:
            while book.top_up(limit):
                ready, _ = ray.wait(list(book.running), num_returns=1, timeout=tick)
                if not ready:
                    _check_head(head)
                for task in ready:
                    try:
                        book.item(task, _result(ray, next(task)))
                    except StopIteration:  # the task is done
                        finished = book.ended(task)
                        if finished is not None:
                            on_results(finished)
                for finished in book.look_for_stalls():
                    on_results(finished)
        finally:
            book.cancel_all()


def write_chunk(job: WriteJob, chunk: Chunk) -> Iterator:
    """One task (`ray::write_chunk`): fill one chunk's slots on a Ray worker, saying first where it
    runs and then each slot as it is done (its sign of progress); the driver never imports the decoders.
    The writer runs in a thread of the task, which yields what it reports; the task ends once the writer
    has returned (a bucket build's chunk object written), so a chunk counts as done only then."""
    yield Started.here()
    from dsc.compiler import write  # imported as the worker started (`import_decoders`): no cost here

    writer = write.writer_for(job)
    reported: queue.SimpleQueue = queue.SimpleQueue()
    failed: list[BaseException] = []

    def fill() -> None:
        try:
            writer.write(chunk, on_result=reported.put)
        except BaseException as e:  # raised in the task below, as a Ray task error
            failed.append(e)
        finally:
            reported.put(None)

    thread = threading.Thread(target=fill, name="dsc-write-chunk", daemon=True)
    thread.start()
    try:
        while (result := reported.get()) is not None:
            yield result
        thread.join()
        if failed:
            raise failed[0]
    finally:
        if not thread.is_alive():
            writer.close()


def import_decoders() -> None:
    """Each of this job's Ray workers imports the decoders and torch as it starts, while the driver
    discovers, so a task's stall limit times decoding, not imports. A broken install is left for the
    task to report."""
    try:
        import dsc.compiler.write  # noqa: F401
    except ImportError:
        pass


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
                 log_to_driver=False, logging_level=logging.WARNING,
                 runtime_env={"worker_process_setup_hook": import_decoders})
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise CompileError(f"cannot reach the Ray cluster at {address or 'a new local instance'}: {e}") from e
    return ray, True
