"""`Loader`: batches of a `MemmapDataset` as TensorDicts, gathered on a background thread.

One epoch = `order.epoch_share` (this rank's indices) cut into sorted batches; a producer
thread copies each batch out of the maps (`gather.fill_parallel`, split over a small thread
pool) into a host buffer, optionally uploads it (`device.DeviceFeeder`), and hands it over
through a bounded queue. Errors on that thread reach the consumer as `LoaderError`, naming
the batch. The plain single-threaded `reference.reference_batches` serves identical batches.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from dsc.errors import LoaderError
from dsc.reader import order as orders
from dsc.reader.gather import fill_parallel

POLL_S = 0.1  # how often blocked queue waits look at the stop event / the producer's health
JOIN_S = 30.0  # how long closing waits for a producer that is mid-copy
MAX_DEFAULT_THREADS = 4  # copies saturate memory bandwidth with a few threads


def default_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores))


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size) from the arguments, else from torch.distributed when initialised, else (0, 1)."""
    if rank is None and world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


class HostBuffers:
    """Host batch buffers [B, H, W, 3], recycled to avoid page-faulting fresh memory every batch.

    HOST BUFFER REUSE RULE: a buffer is refilled only when its refcount shows that nothing but
    this pool refers to it. Every tensor handed out is `torch.from_numpy(buffer)` or a view of
    one, and a torch storage made by from_numpy holds a reference to the array until the last
    tensor, view, storage or `.numpy()` over it dies. So a batch the user keeps (or any piece of
    it) pins its buffer, and is never overwritten; only batches already dropped are recycled.
    """

    def __init__(self, record_shape: tuple[int, int, int], keep: int) -> None:
        self._shape, self._keep = record_shape, keep
        self._pool: list[np.ndarray] = []
        self._lock = threading.Lock()
        probe = [np.empty(0)]
        self._unreferenced = sys.getrefcount(probe[0])  # the same expression as in take()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for k in range(len(self._pool)):
                if len(self._pool[k]) == n and sys.getrefcount(self._pool[k]) == self._unreferenced:
                    return self._pool[k]
            buf = np.empty((n, *self._shape), dtype=np.uint8)
            if len(self._pool) < self._keep:
                self._pool.append(buf)
            return buf


class _Producer:
    """Runs `make(b)` for each batch number on a background thread, at most `prefetch` batches ahead.

    A semaphore, released when the consumer takes a batch, bounds the batches made but not yet
    taken, so the producer never holds a finished batch while waiting: fewer host buffers in
    flight (and a smaller, cache-warmer set of them).
    """

    _END = object()

    def __init__(self, make: Callable[[int], Any], batches: Iterable[int], prefetch: int,
                 describe: Callable[[int], str]) -> None:
        self._make, self._batches, self._describe = make, batches, describe
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # bounded by _ahead
        self._ahead = threading.Semaphore(prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dsc-loader", daemon=True)
        self._thread.start()

    def _acquire(self) -> bool:
        while not self._stop.is_set():
            if self._ahead.acquire(timeout=POLL_S):
                return True
        return False

    def _run(self) -> None:
        b = -1
        try:
            for b in self._batches:
                if not self._acquire():
                    return
                self._queue.put((b, self._make(b), None))
        except BaseException as e:  # handed to the consumer, which re-raises it with the batch named
            self._queue.put((b, None, e))
            return
        self._queue.put(self._END)

    def _get(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise LoaderError("the loader thread stopped without handing over a batch") from None

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        while (item := self._get()) is not self._END:
            self._ahead.release()
            b, value, error = item
            if error is not None:
                raise LoaderError(f"{self._describe(b)} failed: {error!r}") from error
            yield b, value

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=JOIN_S)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class Loader:
    """Iterate to get one epoch of TensorDicts {image uint8 [B,3,H,W] channels_last, label, index}.

    The epoch advances by itself after a complete pass; `set_epoch(e)` picks one (as with
    DistributedSampler). `state_dict()` after k batches + `load_state_dict()` on a new loader
    makes its next iteration start with batch k + 1 of the same epoch, exactly, also when the
    training loop calls `set_epoch` with that epoch first.
    Batches stay valid as long as you keep them (see `HostBuffers` and `device.DeviceFeeder`).
    `locality="shard"` (with order="block") gives each rank its own rotating subset of the shard
    files every epoch instead of a slice of one global order (`order.shard_share`).
    """

    def __init__(self, dataset, batch_size: int, *, order: str = "block", seed: int = 0, drop_last: bool = False,
                 device: str | torch.device | None = None, prefetch: int = 2, num_threads: int | None = None,
                 rank: int | None = None, world_size: int | None = None, locality: str | None = None) -> None:
        if order not in orders.ORDERS:
            raise ValueError(f"order must be one of {orders.ORDERS}, got {order!r}")
        orders.check_locality(order, locality)
        self.dataset, self.order, self.drop_last, self.locality = dataset, order, bool(drop_last), locality
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.prefetch = _check_int("prefetch", prefetch, 1)
        self.num_threads = default_threads() if num_threads is None else _check_int("num_threads", num_threads, 1)
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.device = torch.device(device) if device is not None else None
        self.epoch, self._served, self._start = 0, 0, 0
        self._buffers = HostBuffers(dataset.record_shape, keep=self.prefetch + 2)  # ahead, held, being let go
        self._feeder = None

    def __len__(self) -> int:
        share = orders.share_length(len(self.dataset), self.world_size, self.batch_size, self.drop_last,
                                    **self._locality())
        return orders.batch_count(share, self.batch_size)

    def _locality(self) -> dict[str, Any]:
        if self.locality is None:
            return {}
        return {"locality": self.locality, "records_per_shard": self.dataset.manifest.records_per_shard}

    def _share(self, epoch: int) -> np.ndarray:
        return orders.epoch_share(len(self.dataset), self.order, self.seed, epoch, self.rank,
                                  self.world_size, self.batch_size, self.drop_last, **self._locality())

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration serve `epoch` from its start, or from where `load_state_dict`
        left it when `epoch` is the epoch being resumed (so a loop that calls set_epoch at the
        top of every epoch resumes mid-epoch, not from its start)."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self.epoch or not self._start:
            self.epoch, self._served, self._start = epoch, 0, 0

    def _config(self) -> dict[str, Any]:
        return {"order": self.order, "seed": self.seed, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "rank": self.rank, "world_size": self.world_size, "count": len(self.dataset),
                "locality": self.locality}

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: epoch and batches already yielded in it, plus the settings that fix the order."""
        epoch, served = self.epoch, self._served
        if served >= len(self):  # every batch was taken: what comes next is the next epoch's first
            epoch, served = epoch + 1, 0
        return {"epoch": epoch, "batch": served, **self._config()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        wrong = {k: (state.get(k), v) for k, v in self._config().items() if state.get(k) != v}
        if wrong:
            raise ValueError(f"state_dict was saved with other settings (saved, ours): {wrong}")
        epoch, start = _check_int("epoch", state["epoch"], 0), _check_int("batch", state["batch"], 0)
        if start >= len(self):
            epoch, start = epoch + 1, 0
        self.epoch, self._served, self._start = epoch, start, start  # state_dict() reports it until we run

    def __iter__(self) -> Iterator[TensorDict]:
        start, self._start = self._start, 0
        return self._run(self.epoch, self._share(self.epoch), start)

    def _make_batch(self, share: np.ndarray, pool: ThreadPoolExecutor | None) -> Callable[[int], TensorDict]:
        d = self.dataset.opened
        per_shard = d.manifest.records_per_shard

        def make(b: int) -> TensorDict:
            idx = orders.batch_indices(share, b, self.batch_size)
            if self._feeder is not None:
                slot, host = self._feeder.host_slot(len(idx))
                fill_parallel(host, d.shards, idx, per_shard, pool, self.num_threads)
                return self._feeder.upload(slot, np.take(d.labels, idx), idx, np.take(d.sizes, idx, axis=0))
            host = self._buffers.take(len(idx))
            fill_parallel(host, d.shards, idx, per_shard, pool, self.num_threads)
            return TensorDict(image=torch.from_numpy(host).permute(0, 3, 1, 2),
                              label=torch.from_numpy(np.take(d.labels, idx)), index=torch.from_numpy(idx),
                              size=torch.from_numpy(np.take(d.sizes, idx, axis=0).astype(np.int64)),
                              batch_size=[len(idx)])
        return make

    def _run(self, epoch: int, share: np.ndarray, start: int) -> Iterator[TensorDict]:
        self._served = start
        if self.device is not None and self.device.type == "cuda" and self._feeder is None:
            from dsc.reader.device import DeviceFeeder

            self._feeder = DeviceFeeder(self.device, self.prefetch + 2, self.batch_size, self.dataset.record_shape)
        pool = ThreadPoolExecutor(self.num_threads - 1, "dsc-copy") if self.num_threads > 1 else None
        count = orders.batch_count(len(share), self.batch_size)
        producer = _Producer(self._make_batch(share, pool), range(start, count), self.prefetch,
                             lambda b: f"batch {b} of epoch {epoch} (rank {self.rank}/{self.world_size})")
        try:
            for b, batch in producer:
                if self._feeder is not None:
                    batch = self._feeder.hand_over(batch)
                elif self.device is not None and self.device.type != "cpu":
                    batch = batch.to(self.device)
                self._served = b + 1
                yield batch
        finally:
            producer.close()
            if pool is not None:
                pool.shutdown(wait=True)
        self.epoch, self._served = epoch + 1, 0
