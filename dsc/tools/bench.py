"""Read throughput of one dataset on this machine (`dsc bench`), beside this machine's own limits.

The headline is a ratio: the loader against a plain contiguous copy out of the same maps into
one preallocated buffer on the same threads. Cold figures (page cache evicted with
`posix_fadvise(DONTNEED)`, checked with `mincore`) are measured only where the OS lets them be.
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsc import format as fmt
from dsc import storage
from dsc.errors import DscError
from dsc.reader import MemmapDataset
from dsc.reader.gather import default_threads, split
from dsc.reader.producer import LoaderStats
from dsc.reader.settings import resolve_device

ORDERS = ("sequential", "block", "random")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
COLD_RESIDENT_MAX = 0.05  # a "cold" run needs at least 95% of the dataset out of the page cache
BATCHES_HELD = 8  # batch-sized buffers alive at once at most: the copy limit's, the loader's ring and prefetch


@dataclass(frozen=True)
class Rate:
    """One measured row: `samples` records of `record_bytes` read in `seconds`."""

    name: str
    samples: int
    seconds: float
    record_bytes: int
    stats: LoaderStats | None = None  # the loader's own account of the run, for loader rows

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        return self.samples_per_s * self.record_bytes / 1e9


@dataclass
class BenchReport:
    """Every row of a `dsc bench` run, and what they mean in words."""

    dataset_bytes: int
    memory_bytes: int
    limit: Rate
    warm: list[Rate]
    cold: list[Rate] = field(default_factory=list)
    device: list[Rate] = field(default_factory=list)  # the loader with a device
    h2d: Rate | None = None  # pinned host → device copies: the device rows' limit
    notes: list[str] = field(default_factory=list)

    def rows(self) -> list[tuple[Rate, float]]:
        """Every row with its ratio to its own limit: host rows to the copy limit, device rows to the h2d one."""
        def ratio(rate: Rate, limit: Rate | None) -> float:
            return rate.samples_per_s / limit.samples_per_s if limit and limit.samples_per_s else 0.0

        host = [(r, ratio(r, self.limit)) for r in [self.limit, *self.warm, *self.cold]]
        return host + [(r, ratio(r, self.h2d)) for r in [*([self.h2d] if self.h2d else []), *self.device]]


def _timed(epoch: Callable[[], Iterable[int]], budget_s: float, warm: bool = True,
           finish: Callable[[], None] = lambda: None) -> tuple[int, float]:
    """Samples and seconds read by `epoch()` (yielding batch sizes) within `budget_s`, at least one batch.

    warm: a first (partial) epoch is left out, as a training run pays the first touch of the
    maps' pages once, then epochs repeat until the budget is spent. Cold: one epoch at most,
    since a second would find the data in the page cache. `finish()` runs before the clock
    stops (a device sync: the last copies must have landed).
    """
    if warm:
        _timed(epoch, budget_s, warm=False, finish=finish)
    start, samples = time.perf_counter(), 0
    while True:
        for n in epoch():
            samples += n
            if time.perf_counter() - start > budget_s:
                break
        if not warm or time.perf_counter() - start > budget_s:
            finish()
            return samples, time.perf_counter() - start


def _copy_range(buf: np.ndarray, d: storage.OpenedDataset, start: int, stop: int) -> None:
    at = 0
    for shard, lo, hi in fmt.shard_segments(start, stop, d.manifest.records_per_shard):
        np.copyto(buf[at:at + hi - lo], d.shards[shard][lo:hi])
        at += hi - lo


def copy_limit(d: storage.OpenedDataset, batch_size: int, threads: int, budget_s: float) -> Rate:
    """Plain contiguous copies of consecutive batches into one preallocated buffer, split over threads."""
    m = d.manifest
    buf = np.empty((batch_size, *m.record_shape), np.uint8)

    def batches():
        with ThreadPoolExecutor(threads) as pool:
            for a in range(0, m.count, batch_size):
                n = min(batch_size, m.count - a)
                list(pool.map(lambda r, a=a: _copy_range(buf[r[0]:r[1]], d, a + r[0], a + r[1]), split(n, threads)))
                yield n

    samples, seconds = _timed(batches, budget_s)
    return Rate(f"limit: contiguous copy, {threads} thread(s)", samples, seconds, m.record_bytes)


def loader_rate(path: Path, order: str, batch_size: int, threads: int, budget_s: float,
                device: str | None = None, label: str = "", warm: bool = True) -> Rate:
    """Epochs of a fresh `MemmapDataset(path).loader` in `order` for `budget_s` (see `_timed`)."""
    ds = MemmapDataset(path)
    loader = ds.loader(batch_size, order=order, num_threads=threads, device=device)
    on_cuda = loader.device is not None and loader.device.type == "cuda"

    def batches():
        for batch in loader:
            yield len(batch["index"])

    samples, seconds = _timed(batches, budget_s, warm,
                              finish=(lambda: torch.cuda.synchronize(loader.device)) if on_cuda else lambda: None)
    stats = loader.stats()
    loader.close()
    return Rate(f"{label}dsc loader, {order}" + (f", to {loader.device}" if on_cuda else ""), samples, seconds,
                ds.manifest.record_bytes, stats)


def resident_fraction(paths: list[Path]) -> float | None:
    """The share of these files' pages in the page cache (Linux `mincore`), or None if unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        view = np.memmap(path, np.uint8, "r")
        pages = -(-size // PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec) != 0:
            return None
        resident += int(np.count_nonzero(np.frombuffer(vec, np.uint8) & 1))
        total += pages
        del view
    return resident / total if total else 1.0


def evict(paths: list[Path]) -> float | None:
    """Ask the OS to drop these files from the page cache; return what is still resident."""
    gc.collect()  # our own maps of the files keep their pages
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_fraction(paths)


def warm_up(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def h2d_limit(batch_size: int, record_shape: tuple[int, int, int], device: str, budget_s: float) -> Rate:
    """Pinned host → device copies of one batch-sized buffer: the ceiling of the device path."""
    device = torch.device(device)
    host = torch.empty((batch_size, *record_shape), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)

    def batches():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        yield batch_size

    samples, seconds = _timed(batches, budget_s)
    return Rate(f"limit: pinned host → {device} copy", samples, seconds, int(np.prod(record_shape)))


def diagnose(r: BenchReport) -> list[str]:
    """What bounds reading this dataset here, in words."""
    notes, best = [], max(r.warm, key=lambda x: x.samples_per_s)
    gb = r.dataset_bytes / 1e9
    if r.memory_bytes and r.dataset_bytes > 0.8 * r.memory_bytes:
        notes.append(f"page cache too small: the dataset ({gb:.1f} GB) does not fit in this machine's memory "
                     f"({r.memory_bytes / 1e9:.1f} GB), so every epoch reads from disk; expect the cold figures, "
                     "and prefer order='block' (contiguous reads).")
    cold_block = next((c for c in r.cold if "block" in c.name), None)
    if cold_block and cold_block.samples_per_s < 0.5 * best.samples_per_s:
        notes.append(f"disk: from a cold page cache the loader reads {cold_block.gb_per_s:.2f} GB/s against "
                     f"{best.gb_per_s:.2f} GB/s warm; the first epoch is disk-bound, later ones (if the dataset "
                     "fits in memory) run from the page cache.")
    share = best.samples_per_s / r.limit.samples_per_s if r.limit.samples_per_s else 0.0
    if share > 1.1:
        notes.append(f"above the copy limit: the fastest order ({best.name.split(', ')[-1]}) runs at {share:.0%} of "
                     f"the plain copy limit, which can only be a cache effect: with a small dataset ({gb:.2f} GB) "
                     "part of what is copied is still in the CPU caches from the last epoch or batch. On a dataset "
                     "much larger than the caches expect at most the copy limit.")
    elif share >= 0.7:
        notes.append(f"copy bandwidth: warm, the fastest order ({best.name.split(', ')[-1]}) runs at {share:.0%} of "
                     "this machine's plain copy limit; memory bandwidth bounds it, not per-batch overhead.")
    else:
        notes.append(f"loader overhead: warm, the fastest order reaches only {share:.0%} of the copy limit; "
                     "other load on the machine, or too few copy threads (num_threads=...)?")
    for row in r.device:
        if row.samples_per_s >= 0.8 * best.samples_per_s:
            continue
        h2d = r.h2d.samples_per_s if r.h2d else 0.0
        bound = ("the host→device copy bounds it" if h2d and row.samples_per_s >= 0.8 * h2d
                 else "below both the host-side loader and the host→device copy limit: the upload path itself")
        notes.append(f"host→device: {row.name} reaches {row.gb_per_s:.2f} GB/s, below the host-side loader "
                     f"({best.gb_per_s:.2f} GB/s); {bound}.")
    return notes


def batch_problem(batch_size: int, record_shape: tuple[int, int, int], memory: int) -> str | None:
    """Why batches of `batch_size` records cannot be measured in `memory` bytes; None when they can."""
    held = batch_size * int(np.prod(record_shape)) * BATCHES_HELD
    if not memory or held <= memory:
        return None
    h, w, c = record_shape
    return (f"batches of {batch_size:,} records of {h}x{w}x{c} need about {held / 1e9:,.1f} GB "
            f"({BATCHES_HELD} of them in memory at once), more than this machine's {memory / 1e9:.1f} GB")


def run(path: str | os.PathLike, batch_size: int = 256, threads: int | None = None, budget_s: float = 5.0,
        cold: bool = True, device: str | None = None,
        log: Callable[[str], None] = lambda line: None) -> BenchReport:
    """Measure the copy limit and every order, cold (where possible) and warm; `log` tells progress."""
    path, threads = Path(path), threads or default_threads()
    d = storage.open_dataset(path)
    shards, shape = d.shard_paths(), d.manifest.record_shape
    if (problem := batch_problem(batch_size, shape, memory_bytes())) is not None:
        raise DscError(problem)
    report = BenchReport(sum(s.bytes for s in d.manifest.shards), memory_bytes(), Rate("", 0, 0.0, 1), [])
    del d
    if cold:
        for order in ORDERS:
            left = evict(shards)
            if left is None or left > COLD_RESIDENT_MAX:
                report.notes.append("cold: not measured; the OS kept "
                                    f"{'an unknown share' if left is None else f'{left:.0%}'} of the dataset "
                                    "in the page cache (another process has it mapped?)")
                break
            log(f"cold {order}")
            report.cold.append(loader_rate(path, order, batch_size, threads, budget_s, label="cold: ", warm=False))
    log("warming the page cache")
    warm_up(shards)
    report.limit = copy_limit(storage.open_dataset(path), batch_size, threads, budget_s)
    for order in ORDERS:
        log(f"warm {order}")
        report.warm.append(loader_rate(path, order, batch_size, threads, budget_s))
    if resolve_device(device) is not None:  # a CUDA device; "cpu" is the host path measured above
        report.h2d = h2d_limit(batch_size, shape, device, budget_s)
        report.device.append(loader_rate(path, "block", batch_size, threads, budget_s, device=device))
    report.notes += diagnose(report)
    return report

