"""The producer thread of a loader and what it measures: batches gathered ahead into a sink and
handed over through a bounded queue (`Producer`), the copy pool and the live producer (`Threads`),
what a batch holds besides its images (`batch_fields`, `field_specs`), and the consumer's waits
(`LoaderStats`). Errors on the thread reach the consumer as `LoaderError`, naming the batch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsc.errors import LoaderError
from dsc.reader import order as orders
from dsc.reader import progress
from dsc.reader.gather import fill_parallel

POLL_S = 0.1  # how often blocked queue waits look at the stop event / the producer's health
JOIN_S = 30.0  # how long closing waits for a producer that is mid-copy


@dataclass(frozen=True)
class LoaderStats:
    """Whether training waited for data, since the loader was made or `stats(reset=True)`.

    `wait_s` is the time the consumer spent blocked for the next batch; `wall_s` runs from the
    first batch asked for to the last one handed out, so `wait_fraction` is the share of the
    training loop's time lost to data. The producer's time per batch is split into copying
    records out of the maps (`gather_s`) and the rest of making the batch (`upload_s`: on
    CUDA, waiting for a free ring slot and issuing the host→device copy).

    A dataset in object storage adds what its cache did (zeros for a folder): `fetched_bytes` and
    `requests` (ranged GETs), `cache_hits` and `cache_misses` (units a batch found local, or had to
    fetch, ahead or not), and `network_wait_s`, the time the producer waited for fetches (part of
    `gather_s`).
    """

    batches: int
    wait_s: float
    wall_s: float
    gather_s: float
    upload_s: float
    fetched_bytes: int = 0
    requests: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    network_wait_s: float = 0.0

    @property
    def wait_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def costs(self) -> str:
        """What making one batch cost the producer, on average."""
        per = 1e3 / max(self.batches, 1)
        return f"gather {self.gather_s * per:.2f} ms, upload {self.upload_s * per:.2f} ms"

    def __str__(self) -> str:
        network = (f"; fetched {self.fetched_bytes} bytes in {self.requests} requests, {self.cache_hits} hits, "
                   f"{self.cache_misses} misses, {self.network_wait_s:.2f} s waiting on the network"
                   if self.requests or self.cache_hits else "")
        return (f"{self.batches} batches, waited {self.wait_s:.2f} s of {self.wall_s:.2f} s "
                f"({self.wait_fraction:.1%}); per batch: {self.costs()}{network}")


@dataclass
class Meter:
    batches: int = 0
    wait_s: float = 0.0
    gather_s: float = 0.0
    upload_s: float = 0.0
    first: float | None = None
    last: float = 0.0
    network: Any = None  # a remote dataset's `cache.NetworkStats`, as it stood when this meter started

    def stats(self, network: Any = None) -> LoaderStats:
        """The figures since the meter started; `network`: the remote dataset's cache figures now."""
        wall = self.last - self.first if self.first is not None else 0.0
        net = {}
        if network is not None:
            start = self.network
            net = {"fetched_bytes": network.fetched_bytes - start.fetched_bytes,
                   "requests": network.requests - start.requests, "cache_hits": network.hits - start.hits,
                   "cache_misses": network.misses - start.misses, "network_wait_s": network.wait_s - start.wait_s}
        return LoaderStats(self.batches, self.wait_s, wall, self.gather_s, self.upload_s, **net)


class Producer:
    """Makes `make(pass, b)` for each job on a background thread, at most `prefetch` ahead of the consumer.

    A semaphore, released when the consumer takes a batch, bounds the batches made but not yet
    taken, so the producer never holds a finished batch while waiting: fewer host buffers in
    flight (and a smaller, cache-warmer set of them).
    """

    def __init__(self, make: Callable[[progress.Pass, int, np.ndarray], tuple[Any, float]],
                 jobs: Iterator[tuple[progress.Pass, int, np.ndarray]], prefetch: int,
                 prepare_thread: Callable[[], None]) -> None:
        self._make, self._jobs, self._prepare = make, jobs, prepare_thread
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # bounded by _ahead
        self._ahead = threading.Semaphore(prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsc-loader", daemon=True)
        self._thread.start()

    def _acquire(self) -> bool:
        while not self._stop.is_set():
            if self._ahead.acquire(timeout=POLL_S):
                return not self._stop.is_set()
        return False

    def _run(self) -> None:
        job = None
        try:
            self._prepare()
            for job in self._jobs:
                if not self._acquire():
                    return
                start = time.perf_counter()
                value, gather_s = self._make(*job)
                self._queue.put((job[:2], value, None, gather_s, time.perf_counter() - start - gather_s))
        except BaseException as e:  # handed to the consumer, which re-raises it with the batch named
            self._queue.put((job and job[:2], None, e, 0.0, 0.0))

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise LoaderError("the loader thread stopped without handing over a batch") from None

    def take(self, expected: tuple[progress.Pass, int], describe: str, meter: Meter) -> Any:
        """The next batch, which must be `expected` (a pass and batch number); the wait goes to `meter`."""
        now = time.perf_counter()
        meter.first = now if meter.first is None else meter.first
        job, value, error, gather_s, upload_s = self._get()
        self._ahead.release()
        if error is not None:
            raise LoaderError(f"{describe} failed: {_described(error)}") from error
        if job != expected:
            raise LoaderError(f"{describe}: the loader thread made {job} instead (a bug in dsc)")
        meter.last = time.perf_counter()
        meter.wait_s += meter.last - now
        meter.batches, meter.gather_s, meter.upload_s = meter.batches + 1, meter.gather_s + gather_s, \
            meter.upload_s + upload_s
        return value

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def close(self) -> None:
        self._stop.set()
        self._ahead.release()  # wakes a producer waiting for room, which then sees the stop
        if threading.current_thread() is not self._thread:  # a loader collected on this thread closes it too
            self._thread.join(timeout=JOIN_S)


class Threads:
    """The loader's producer (with the pass it makes next, once it has finished one) and copy pool,
    stopped when the loader is closed or collected."""

    def __init__(self, num_threads: int) -> None:
        self.pool = ThreadPoolExecutor(num_threads - 1, "dsc-copy") if num_threads > 1 else None
        self.producer: Producer | None = None
        self.next_pass: progress.Pass | None = None

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.producer, self.next_pass = None, None

    def close(self) -> None:
        self.stop_producer()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


def batch_fields(opened, idx: np.ndarray) -> dict[str, np.ndarray]:
    """The small per-record values of a batch besides its images (the sinks' `fields`): label,
    index and size as int64, then the dataset's own fields (format 1.1) in their dtypes; each checked as it
    is taken (`storage.OpenedDataset.take`)."""
    return {"label": opened.take("labels", idx), "index": idx,
            "size": opened.take("sizes", idx).astype(np.int64),  # each source's (height, width)
            **{f.name: opened.take(opened.field_key(f.name), idx) for f in opened.manifest.fields}}


def field_specs(opened) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """Dtype and per-record shape of each of `batch_fields`, for sinks that size buffers up front."""
    int64 = np.dtype(np.int64)
    return {"label": (int64, ()), "index": (int64, ()), "size": (int64, (2,)),
            **{f.name: (f.dtype, f.shape) for f in opened.manifest.fields}}


def batch_maker(sink, opened, pool: ThreadPoolExecutor | None, num_threads: int, batch_size: int,
                order: str, seed: int, prefetch: int, following: Callable[[progress.Pass], np.ndarray] | None = None,
                ) -> Callable[[progress.Pass, int, np.ndarray], tuple[Any, float]]:
    """make(pass, b, share): batch b of the pass into the sink, and the seconds its gather took (a dataset in
    object storage: its cache follows the pass, `prefetch` batches ahead, and on into the next epoch's pass,
    which the producer makes next, whose share `following(pass)` gives)."""
    per_shard, records = opened.manifest.records_per_shard, opened.records
    followed = [None]  # the share the remote records' cache follows (`cache.RecordCache.follow`)

    def make(p: progress.Pass, b: int, share: np.ndarray) -> tuple[Any, float]:
        idx = orders.batch_indices(share, b, batch_size, order, seed, p.epoch, per_shard)
        took = [0.0]
        if records is not None and followed[0] is not share:  # a new pass: tell the cache what comes, in order
            records.follow(share, batch_size, b, prefetch, then=following(p) if following is not None else None)
            followed[0] = share

        def gather(host: np.ndarray) -> None:
            start = time.perf_counter()
            if records is not None:
                records.fill(host, idx, b)
            else:
                fill_parallel(host, opened.shards, idx, per_shard, pool, num_threads)
            took[0] = time.perf_counter() - start

        return sink.fill(batch_fields(opened, idx), gather), took[0]
    return make


def _described(error: BaseException) -> str:
    """An error as its type and message (`OSError: [Errno 2] No such file or directory: '/path'`: the repr
    of an OSError leaves its file out); its repr when the message is empty or takes several lines."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text and "\n" not in text else repr(error)
