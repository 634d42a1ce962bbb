"""Write: decode + resize every source straight into its record slot of the shard memory maps.

Record slot `i` belongs to source `order[i]`, fixed before any work starts, so the bytes
do not depend on how many workers there are or which finishes first. Workers are
processes (decoding is CPU-bound and partly holds the GIL); each writes its records straight
into the shard files at their offsets, so no pixel ever crosses a pipe: only (slot, size or
reason) comes back.
Slots of skipped sources are closed up afterwards by `compact`.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing
import os
import signal
import warnings
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from dsc import format as fmt
from dsc.compiler.decode import IncompleteJpegWarning, decode, probe
from dsc.compiler.resize import Target, needed_size, resize_into
from dsc.errors import CompileError, ImageError

CHUNK = 16  # sources per task: small enough to keep every worker busy to the end
# Errors that belong to a source file itself, so it is skipped. Any other OSError (too many open
# files, an I/O error) stops the compile instead, to be resumed: never a good image lost.
SOURCE_ERRNOS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP,
                           errno.ENAMETOOLONG, errno.ENXIO, errno.ENODEV})
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# fork starts a worker in milliseconds; spawn re-imports torch in each (~1.3 s here). The
# workers use no threads of the parent (torch is set to one thread before any work).
START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class WriteJob:
    """All a worker needs to fill slots; small and picklable."""

    src_root: str
    stage: str
    count: int
    records_per_shard: int
    target: Target
    max_pixels: int
    decode_mode: str = "faithful"  # format.DECODE_MODES


@dataclass(frozen=True)
class SlotResult:
    slot: int
    height: int = 0  # original, upright
    width: int = 0
    reason: str = ""  # why the source was skipped; empty when it was written
    warning: str = ""  # what was odd about a source that was written anyway (e.g. a missing EOI)
    crc: int = 0  # CRC-32 of the record's bytes, so a resume can check what it reuses

    @property
    def ok(self) -> bool:
        return not self.reason


def compile_image(path: str, target: Target, out: np.ndarray, max_pixels: int,
                  decode_mode: str = "faithful") -> tuple[int, int]:
    """Decode one file into `out`; return its upright (height, width) or raise ImageError."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_file_bytes(max_pixels):
                raise ImageError(f"file is {size} bytes, more than any image within --max-pixels "
                                 f"({max_pixels}) can need; not read")
            data = f.read()
    except OSError as e:
        if e.errno not in SOURCE_ERRNOS:  # EMFILE, EIO, ENOMEM...: the machine's trouble, not the file's
            raise
        raise ImageError(f"cannot read file: {e.strerror or e}") from e
    try:
        p = probe(data, max_pixels)
        height, width = p.oriented_size
        resize_into(decode(data, p, *needed_size(height, width, target), decode_mode), target, out, (height, width))
    except ImageError:
        raise
    except MemoryError as e:
        raise ImageError("out of memory while decoding") from e
    except Exception as e:  # one odd file must not end a compile of millions; report it instead
        raise ImageError(f"cannot decode ({type(e).__name__}: {e})") from e
    return height, width


def max_file_bytes(max_pixels: int) -> int:
    """The largest file worth reading: uncompressed 16-bit RGBA (8 bytes a pixel) plus 16 MiB of metadata."""
    return max_pixels * 8 + (16 << 20)


class SlotWriter:
    """Fills slots of one staging folder; one per worker process.

    Each record is resized into one reused buffer and written to its slot with one `pwrite`:
    measured here, writing through a map of a freshly allocated shard costs 0.3-0.5 ms of page
    faults per 150 KB record, `pwrite` 0.07 ms.
    """

    def __init__(self, job: WriteJob):
        import torch

        torch.set_num_threads(1)  # parallelism comes from the workers, not from inside a resize
        self.job = job
        self.buffer = np.empty((job.target.height, job.target.width, fmt.CHANNELS), np.uint8)
        self.files: dict[int, int] = {}
        # probe() refuses images over --max-pixels from the header; Pillow's own, lower limit
        # would otherwise overrule a larger --max-pixels. Restored by close().
        self._pillow_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None

    def _store(self, slot: int) -> None:
        shard, offset = fmt.record_offset(slot, self.job.records_per_shard, self.buffer.nbytes)
        if shard not in self.files:
            self.files[shard] = os.open(Path(self.job.stage) / fmt.shard_file(shard), os.O_WRONLY)
        data = memoryview(self.buffer).cast("B")
        while data:
            written = os.pwrite(self.files[shard], data, offset)
            data, offset = data[written:], offset + written

    def write(self, tasks: list[tuple[int, str]]) -> list[SlotResult]:
        """Fill these slots (consecutive ones: one or two shards), closing the shard files after."""
        results = []
        try:
            for slot, source in tasks:
                try:
                    path = os.path.join(self.job.src_root, source)
                    with warnings.catch_warnings(record=True) as caught:  # they travel back in the result
                        warnings.simplefilter("always", IncompleteJpegWarning)
                        h, w = compile_image(path, self.job.target, self.buffer, self.job.max_pixels,
                                             self.job.decode_mode)
                    self._store(slot)
                    note = "; ".join(str(c.message) for c in caught if c.category is IncompleteJpegWarning)
                    results.append(SlotResult(slot, h, w, crc=zlib.crc32(self.buffer), warning=note))
                except ImageError as e:
                    results.append(SlotResult(slot, reason=str(e)))
        finally:
            self._close_files()
        return results

    def _close_files(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()

    def close(self) -> None:
        self._close_files()
        Image.MAX_IMAGE_PIXELS = self._pillow_limit


_WRITER: SlotWriter | None = None


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when the compile process dies (kill -9 included),
    so no orphan goes on writing into a partial build that a resumed compile now owns."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)


def _init_worker(job: WriteJob, parent: int) -> None:
    global _WRITER
    _die_with_parent(parent)
    # Ctrl-C and SIGTERM sent to the whole process group are the parent's to handle: it cleans up
    # and then kills us. A worker that died of them first would read as a crash.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _WRITER = SlotWriter(job)


def _work(tasks: list[tuple[int, str]]) -> list[SlotResult]:
    assert _WRITER is not None, "worker used before _init_worker"
    return _WRITER.write(tasks)


def fill_slots(job: WriteJob, tasks: list[tuple[int, str]], workers: int,
               on_results: Callable[[list[SlotResult]], None], engine: str = "local",
               address: str | None = None) -> None:
    """Fill each (slot, source) of `tasks`, calling `on_results` in the caller's thread per chunk.

    `on_results` may raise (e.g. for --strict) to stop the remaining work at once. The "ray"
    engine runs the same work as Ray tasks (see ray_engine); "local" uses processes here.
    """
    if engine == "ray":
        from dsc.compiler.ray_engine import fill_with_ray

        return fill_with_ray(job, tasks, workers, address, on_results)
    chunks: Iterator[list[tuple[int, str]]] = (tasks[i:i + CHUNK] for i in range(0, len(tasks), CHUNK))
    workers = min(workers, -(-len(tasks) // CHUNK))
    if workers <= 1:
        writer = SlotWriter(job)
        try:
            for chunk in chunks:
                on_results(writer.write(chunk))
        finally:
            writer.close()
        return
    _fill_in_processes(job, chunks, workers, on_results)


def _fill_in_processes(job: WriteJob, chunks: Iterator[list[tuple[int, str]]], workers: int,
                       on_results: Callable[[list[SlotResult]], None]) -> None:
    """`fill_slots` on worker processes; a worker that dies (OOM killer, a crash in a decoder)
    fails the compile at once instead of hanging it, and any failure stops every worker."""
    before = set(multiprocessing.active_children())
    executor = ProcessPoolExecutor(workers, multiprocessing.get_context(START_METHOD), _init_worker,
                                   (job, os.getpid()))
    finished = False
    try:
        for future in as_completed([executor.submit(_work, chunk) for chunk in chunks]):
            on_results(future.result())
        finished = True
    except BrokenProcessPool as e:
        raise CompileError("a worker process died (killed by a signal, or out of memory?); the output was "
                           "not written, and the same command with --resume continues the work") from e
    finally:
        executor.shutdown(wait=finished, cancel_futures=not finished)
        for process in set(multiprocessing.active_children()) - before:
            process.kill()  # SIGKILL: the workers ignore SIGINT and SIGTERM
            process.join(timeout=10)


def compact(stage: Path, ok: np.ndarray, job: WriteJob) -> int:
    """Close up the slots of skipped sources, keeping the order of the rest; return the kept count."""
    kept = int(ok.sum())
    if kept == len(ok):
        return kept
    shape = (job.target.height, job.target.width, fmt.CHANNELS)
    records = fmt.shard_records(job.count, job.records_per_shard)
    shards = [fmt.open_shard(stage / fmt.shard_file(i), n, shape, "r+") for i, n in enumerate(records)]
    # Runs of consecutive kept slots: each moves down by the number of skipped slots before it.
    edges = np.flatnonzero(np.diff(np.concatenate(([0], ok.astype(np.int8), [0]))))
    dst = 0
    for start, stop in zip(edges[::2], edges[1::2]):
        if start != dst:
            fmt.move_records(shards, int(start), dst, int(stop - start), job.records_per_shard)
        dst += int(stop - start)
    for shard in shards:
        shard.flush()
    return kept


def fsync_files(paths: list[Path]) -> None:
    """Make the workers' writes through their maps durable before the dataset is published."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def available_cores() -> int:
    """Cores this process may run on (CPU affinity, e.g. under a batch scheduler), not all cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_workers(workers: int | None) -> int:
    if workers is None:
        return available_cores()
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise CompileError(f"workers must be a positive integer, got {workers!r}")
    return workers
