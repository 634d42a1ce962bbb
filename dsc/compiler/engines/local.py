"""The local engine: chunks decoded by worker processes of this machine (or in this process).

The compile process (the driver) never imports the decoders or torch when it has workers. On
entry the engine forks one host process, before discovery starts its threads; the host imports
the decoders and torch while the driver lists the sources. Once the chunks are known, the host
forks min(workers, chunks) workers, which share those imports (copy-on-write pages: one import,
not one per worker), and relays chunks to them and results back (`supervisor`: a worker that
makes no progress for the stall limit is replaced and its work retried). Each worker writes its
records into the shard files itself: only (slot, size or reason, CRC) travels back.

At most IN_FLIGHT_PER_WORKER chunks per worker are queued at a time, so a compile of millions
of sources keeps a bounded queue. Every process dies with its parent (the kernel's parent-death
signal: driver → host → workers), so a killed compile leaves no orphan writing into a partial
build that a resumed compile now owns. A worker that dies fails the compile at once instead of
hanging it, and any failure stops every worker. With one worker the driver decodes itself (no
processes to start, and no stall limit: nothing could stop a stalled driver but the user).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
from collections.abc import Iterable
from itertools import islice

from dsc.compiler.engines.supervisor import DEFAULT_STALL_S, Failed, Supervisor
from dsc.compiler.jobs import Chunk, OnResults, WriteJob
from dsc.errors import CompileError
from dsc.storage.object_file import client_used_here

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# fork starts a process in milliseconds and shares the host's imports with the workers; spawn
# would import everything again in each.
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}  # the driver's to handle: it cleans up, then kills the rest
IN_FLIGHT_PER_WORKER = 4  # queued chunks per worker: none idles between chunks, the queue stays small
logger = logging.getLogger("dsc")  # what a compile finds is reported here (see dsc.compiler.pipeline)
WORKER_DIED = ("a worker process died (killed by a signal, or out of memory?); the output was not written, and "
               "the same command with --resume continues the work")


def _host_start_method() -> str:
    """How the host starts: forked, unless this process already used the S3 client (an earlier
    compile from s3:// archives), whose runtime a forked child cannot use; the host is then
    spawned, and forks the workers from itself, where the client was never used."""
    return "spawn" if START_METHOD == "fork" and client_used_here() else START_METHOD


class LocalEngine:
    """`workers` processes here, their host started on entry (`with LocalEngine(n) as engine:`);
    one worker decodes in this process."""

    def __init__(self, workers: int, address: str | None = None, stall_seconds: float | None = None) -> None:
        if address is not None:
            raise CompileError("an address is only for --engine ray")
        self.workers = workers
        self.stall_s = DEFAULT_STALL_S if stall_seconds is None else stall_seconds
        self._host: multiprocessing.Process | None = None
        self._conn = None
        self._ready = False

    @property
    def forks_here(self) -> bool:
        """Whether entering starts the workers' host from this process (forked, where the platform allows); with
        one worker, or in a daemon process, the chunks are decoded here."""
        return self.workers > 1 and not multiprocessing.current_process().daemon

    def __enter__(self) -> LocalEngine:
        if self.workers > 1 and not self.forks_here:
            logger.warning("this process is a daemon (a multiprocessing.Pool task?), which may not start worker "
                           "processes: decoding here, in one process")
        elif self.forks_here:
            context = multiprocessing.get_context(_host_start_method())
            self._conn, child = context.Pipe()
            self._host = context.Process(target=_host_main, args=(child,), name="dsc-host",
                                         daemon=False)  # not a daemon: it starts the workers
            # A Ctrl-C between the fork and the host's own SIG_IGN would end it with a traceback: it is
            # forked with SIGINT and SIGTERM blocked; this process gets them once the fork is done, raised
            # by pthread_sigmask itself, and then stops the host it has just started.
            try:
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
                try:
                    self._host.start()
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            except BaseException:
                self._stop()
                raise
            finally:
                child.close()
        return self

    def __exit__(self, kind, error, traceback_) -> None:
        if kind is None and self._host is not None:
            self._conn.send(("end",))  # the host shuts its pool down and exits
            self._host.join(timeout=30)
        self._stop()

    def _stop(self) -> None:
        """Kill the host at once; its workers die with it (their parent-death signal)."""
        host, self._host = self._host, None
        if host is not None and host.pid is not None:  # (None: its start failed, and raised)
            if host.is_alive():
                host.kill()  # SIGKILL: the host ignores SIGINT and SIGTERM
            host.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def ready(self) -> None:
        """Raise CompileError now, before any build exists, if the decoders cannot be imported where they run."""
        if self._ready:
            return
        if self._host is None:
            try:
                import dsc.compiler.write  # noqa: F401  (this process decodes: a broken install fails here)
            except ImportError as e:
                raise CompileError(f"cannot decode: {type(e).__name__}: {e}") from e
        else:
            kind, why = self._receive()
            if kind != "ready":
                raise CompileError(f"the worker processes cannot decode: {why}")
        self._ready = True

    def _receive(self) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):  # the host died (killed, out of memory)
            raise CompileError(WORKER_DIED) from None

    def fill(self, job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
        chunks = list(chunks)
        self.ready()
        if self._host is None:
            _fill_here(job, chunks, on_results)
            return
        try:
            self._conn.send(("start", job, max(1, min(self.workers, len(chunks))), self.stall_s))  # no 8 for 2 chunks
            queue, pending = iter(chunks), 0
            for chunk in islice(queue, self.workers * IN_FLIGHT_PER_WORKER):
                self._conn.send(("chunk", chunk))
                pending += 1
            while pending:
                kind, value = self._receive()
                if kind == "error":
                    raise CompileError(WORKER_DIED if value == "broken" else f"a worker failed: {value}")
                if kind == "note":  # a worker stalled: said while the compile waits
                    logger.warning("%s", value)
                    continue
                pending -= 1
                for chunk in islice(queue, 1):
                    self._conn.send(("chunk", chunk))
                    pending += 1
                on_results(value)
        except BaseException:  # --strict, Ctrl-C, a dead worker: no worker may go on writing into the build
            self._stop()
            raise


def _fill_here(job: WriteJob, chunks: Iterable[Chunk], on_results: OnResults) -> None:
    """Decode in this process, each chunk with a writer of its own (`write.write_chunk`)."""
    from dsc.compiler import write  # the decoding side: imported only where records are written

    for chunk in chunks:
        on_results(write.write_chunk(job, chunk))


def _die_with_parent() -> None:
    """Linux: have the kernel kill this process when its parent dies (kill -9 included), so no
    orphan goes on writing into a partial build that a resumed compile now owns."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _ignore_stop_signals() -> None:
    """Ctrl-C and SIGTERM sent to the whole process group are the driver's to handle: it cleans up
    and then kills us. A process that died of them first would read as a crash."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _host_main(conn) -> None:
    """The host: import the decoders, say so, then run the workers for the driver's chunks until it says "end"."""
    _die_with_parent()
    _ignore_stop_signals()
    try:
        import dsc.compiler.write  # noqa: F401  (the decoders and torch, while the driver discovers)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        message = conn.recv()
        while message[0] == "start":  # else "end": no (more) chunks come
            job, workers, stall_s = message[1:]
            supervisor = Supervisor(conn, multiprocessing.get_context(START_METHOD), job, workers, stall_s,
                                    _init_worker)
            supervisor.run()
            message = supervisor.ended_by  # a bucket build fills twice: its chunks, then its shards
    except EOFError:  # the driver went away: stop at once
        os._exit(1)
    except Failed as e:
        conn.send(("error", str(e)))


def _init_worker() -> None:
    _die_with_parent()
    _ignore_stop_signals()
