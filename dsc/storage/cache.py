"""A bounded node-local cache of a remote dataset's records that follows the order they will be read in.

Its units, and how each is fetched once per node, checked and read back, are `dsc.storage.slots` (a
record, format 1.3+, checked by its CRC-32: a sparse file per shard and a shared state word per record)
or `dsc.storage.units` (a whole shard, older formats, by its SHA-256). This module decides what to fetch
and what to let go.

The loader tells the cache the sequence of batches this process reads next (`follow`: its share of
the epoch, then of the next epoch, whose order is known, and the batch size); `fill` then makes one
batch's units local and copies its records out.
Ahead of the batch being made it fetches the next `depth` batches' missing units, in order, with
runs of neighbouring records in one shard coalesced, each run fetched by ranged GETs of `files.request_bytes`
on a bounded pool of threads
(neighbours read a little later join it where there is free room: block order reads a window in a
random order). Room is made by evicting the unit needed furthest in the future (Belady's rule; a unit
the followed sequence never reads again goes first), never one needed before the unit being fetched: prefetching
stops there instead. The bytes the folder holds (the manifest and index files, the units, what is
being fetched) never exceed `budget` (a record counts as the blocks it can pin, `slots.record_cost`). It
lets go only of units (`remove_all`: a record's bytes punched out of its slot file, a shard's file
deleted); anything else in the folder is never touched.

Every record is checked before it is served: a record against its CRC-32 the first time this process
reads it under its state word (`RecordSlots.gather`), a shard against its SHA-256 the first time this
process reads its file and whenever the file changed since (`UnitFiles.read`). A unit that fails is
fetched again; a fetch still wrong is an error naming the object and the record, never a wrong batch.

The count of bytes held is this process's: processes that share a folder share its units, but each
counts only what it has seen, so the folder of a node whose L processes share it stays under L times
the budget (README, "Datasets in object storage").
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.reader.gather import default_threads
from dsc.storage.slots import RecordSlots
from dsc.storage.units import UnitFiles

FETCH_THREADS = 8  # ranged GETs in flight at a time, per process
READ_THREADS = default_threads()  # records of a batch read out of the cache (and checked) by this many threads
READ_SPLIT = 32  # a batch of fewer records is read on the caller's thread alone
DEPTH = 2  # batches fetched ahead of the one being made
AHEAD_RECORDS = 4096  # neighbours read within this many records (two of block order's windows) join a GET
NEVER = np.iinfo(np.int64).max  # the next use of a unit the followed sequence does not read again


@dataclass
class NetworkStats:
    """What the cache did for this process: bytes and requests fetched, units found local or not, and
    how long the reader waited for fetches."""

    fetched_bytes: int = 0
    requests: int = 0
    hits: int = 0
    misses: int = 0
    wait_s: float = 0.0


class Plan:
    """When each unit is read next, from the units of a followed sequence cut into batches: one or more
    passes (this one, then the next epoch's), each cut into batches of its own, numbered on from the last."""

    def __init__(self, passes: list[np.ndarray], batch_size: int, n_units: int) -> None:
        self.batch_size = batch_size
        self._units = np.concatenate(passes) if passes else np.zeros(0, np.int64)
        counts = [-(-len(units) // batch_size) for units in passes]
        self.count = sum(counts)
        self._nb = max(self.count, 1)
        batches = np.concatenate([first + np.arange(len(units), dtype=np.int64) // batch_size
                                  for first, units in zip(np.cumsum([0, *counts[:-1]]), passes)] or
                                 [np.zeros(0, np.int64)])
        self._edges = np.searchsorted(batches, np.arange(self.count + 1))  # where each batch starts in `_units`
        self._keys = np.unique(self._units.astype(np.int64) * self._nb + batches)  # by unit, then batch
        unit_of = self._keys // self._nb
        first = np.r_[True, unit_of[1:] != unit_of[:-1]] if len(unit_of) else np.zeros(0, bool)
        self.first_use = np.full(n_units, NEVER, dtype=np.int64)
        self.first_use[unit_of[first]] = self._keys[first] % self._nb

    def batch(self, b: int) -> np.ndarray:
        """The distinct units batch `b` reads."""
        return np.unique(self._units[self._edges[b]:self._edges[b + 1]])

    def after(self, units: np.ndarray, b: int) -> np.ndarray:
        """The next batch after `b` that reads each of `units` (all read by batch `b`), or NEVER."""
        at = np.searchsorted(self._keys, units * self._nb + b) + 1
        ok = at < len(self._keys)
        nxt = self._keys[np.minimum(at, len(self._keys) - 1)]
        return np.where(ok & (nxt // self._nb == units), nxt % self._nb, NEVER)


_caches: weakref.WeakSet = weakref.WeakSet()  # every RecordCache of this process, for `_after_fork`


def _after_fork() -> None:
    for cache in list(_caches):
        cache._forget_parents_fetches()


os.register_at_fork(after_in_child=_after_fork)


class RecordCache:
    """The records of a remote dataset, read through a bounded folder (module docstring).

    `get(name, start, stop)` fetches bytes [start, stop) of a dataset file (with retries); `at(name)`
    names its object in messages; `crcs` are the records' CRC-32s (None: whole-shard units)."""

    def __init__(self, manifest: fmt.Manifest, folder: Path, budget: int, base_bytes: int,
                 get: Callable[[str, int, int], bytes], at: Callable[[str], str], crcs: np.ndarray | None,
                 threads: int = FETCH_THREADS) -> None:
        self.stats = NetworkStats()
        self._lock = threading.RLock()  # a fetch that ends at once runs its callback inside `_request`
        self.files = UnitFiles(manifest, folder, get, at, self._count_fetch) if crcs is None else \
            RecordSlots(manifest, folder, get, at, crcs, self._count_fetch)
        self.budget, self.base_bytes, self._threads = budget, base_bytes, threads
        n = self.files.count
        self._held = np.zeros(n, dtype=bool)  # counted in `used`: a file, or a fetch under way
        self._fresh = np.zeros(n, dtype=bool)  # fetched, and not read by a batch since: a miss
        self._next = np.full(n, NEVER, dtype=np.int64)  # the batch of the plan that reads each next
        self._pending: dict[int, Future] = {}
        self._victims: Future | None = None  # records let go whose bytes are being punched (`_evict`)
        self._pool: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._plan: Plan | None = None
        self._start = 0  # the batch number of the plan's first batch
        self._depth = DEPTH
        _caches.add(self)
        found, found_bytes = self.files.scan()  # an earlier run's or another process's: held, and deletable
        self._held[found] = True
        self.used = base_bytes + found_bytes

    def _count_fetch(self, nbytes: int) -> None:
        with self._lock:
            self.stats.requests += 1
            self.stats.fetched_bytes += nbytes

    def minimum(self, batch_size: int, depth: int) -> int:
        """The least budget that holds the index and the units of `depth + 1` batches of `batch_size` records."""
        return self.base_bytes + self._units_of_batches(batch_size, depth) * self.files.largest()

    def _units_of_batches(self, batch_size: int, depth: int) -> int:
        return min(self.files.count, (depth + 1) * min(batch_size, self.files.count))

    def check_room(self, batch_size: int, depth: int = DEPTH) -> None:
        """Refuse, naming the minimum, a budget too small for batches of `batch_size` fetched `depth` ahead."""
        need = self.minimum(batch_size, depth)
        if self.budget < need:
            kind = "records" if self.files.crcs is not None else "shards (this dataset has no per-record checksums)"
            raise DatasetError(f"{self.files.root_name}: cache_bytes={self.budget} is too small for batches of "
                               f"{batch_size} fetched {depth} batches ahead: at least {need} bytes are needed (the "
                               f"index, {self.base_bytes} bytes, and the {self._units_of_batches(batch_size, depth)} "
                               f"{kind} of {depth + 1} batches, up to {self.files.largest()} bytes each); give "
                               f"cache_bytes >= {need}")

    # --------------------------------------------------------------------- the reader's seam

    def follow(self, share: np.ndarray, batch_size: int, start: int = 0, depth: int = DEPTH,
               then: np.ndarray | None = None) -> None:
        """From now on this process reads batches `share[b * batch_size:(b + 1) * batch_size]` for b >= `start`,
        in that order (`fill(..., batch=b)`); fetch `depth` batches ahead of the one being read. `then`: the
        share of the pass that comes next (the next epoch's: its order is known), read in batches after this
        one's last: its first batches are fetched while this pass ends, and evictions see when it reads each
        unit (until the next pass is followed itself)."""
        passes = [self.files.of(share[start * batch_size:])]
        if then is not None:
            passes.append(self.files.of(then[:len(then)]))  # sliced: an `order.LazyShare` is computed then
        plan = Plan(passes, batch_size, self.files.count)
        with self._lock:
            self._plan, self._start, self._depth = plan, start, depth
            self._next = plan.first_use.copy()  # batch numbers from `start`, like every plan-relative one

    def fill(self, dst: np.ndarray, idx: np.ndarray, batch: int | None = None) -> None:
        """Copy records `idx` into `dst[:len(idx)]`, fetching what is not local; `batch`: which batch of the
        followed sequence this is (its next ones are fetched ahead, and what it read is let go after)."""
        plan = self._plan if batch is not None else None
        at = batch - self._start if plan is not None else 0
        units = np.unique(self.files.of(idx))
        with self._lock:
            self._request(units, pinned=units, reach=at + self._ahead(plan) if plan is not None else None)
            if plan is not None:
                self._prefetch(plan, at)
            waits = [self._pending[u] for u in units.tolist() if u in self._pending]
            fresh = self._fresh[units]
            self.stats.misses += int(fresh.sum())
            self.stats.hits += len(units) - int(fresh.sum())
            self._fresh[units] = False
        began = time.perf_counter()
        for future in waits:
            future.result()
        self.stats.wait_s += time.perf_counter() - began
        self._copy(dst, np.asarray(idx, dtype=np.int64))
        if plan is not None:
            with self._lock:
                self._next[units] = plan.after(units, at)

    def close(self) -> None:
        if self._pool_pid == os.getpid():
            for pool in filter(None, (self._pool, self._readers)):
                pool.shutdown(wait=True)
        self._pool = self._readers = None

    # --------------------------------------------------------------------- what to fetch, what to evict

    def _prefetch(self, plan: Plan, batch: int) -> None:
        """Fetch the missing units of the `depth` batches after `batch`, in order, while room can be made
        without evicting a unit needed before them."""
        for b in range(batch + 1, min(plan.count, batch + 1 + self._depth)):
            if not self._request(plan.batch(b), horizon=b, reach=b + self._ahead(plan)):
                return

    def _ahead(self, plan: Plan) -> int:
        """How many batches ahead a neighbour may be read and still join a GET (`AHEAD_RECORDS`)."""
        return max(1, AHEAD_RECORDS // plan.batch_size)

    def _request(self, units: np.ndarray, horizon: int | None = None, pinned: np.ndarray | None = None,
                 reach: int | None = None) -> bool:
        """Start fetching `units` not held yet (with their neighbours read by batch `reach`, where there is free
        room: `_with_neighbours`); False when room for them cannot be made (nothing started). Evictable: units
        not being fetched, not in `pinned`, and (with a `horizon`) not needed by then."""
        missing = units[~self._held[units]]
        if len(missing) == 0:
            return True
        need = int(self.files.sizes(missing).sum())
        if not self._make_room(need, horizon, pinned if pinned is not None else units):
            if horizon is not None:
                return False
            raise DatasetError(f"{self.files.root_name}: the cache cannot hold the {len(units)} unit(s) one batch "
                               f"needs within cache_bytes={self.budget} ({self.used} held); give a larger cache_bytes")
        if reach is not None and self.files.crcs is not None:
            more = self._with_neighbours(missing, reach)
            extra = int(self.files.sizes(more).sum())
            if self.used + need + extra <= self.budget:
                missing, need = np.union1d(missing, more), need + extra
        self._held[missing] = True
        self._fresh[missing] = True
        self.used += need
        room, self._victims = self._victims, None
        for shard, first, last in self.files.runs(missing):
            future = self._executor().submit(self._fetch_run, room, shard, first, last)
            for u in range(first, last):
                self._pending[u] = future
            future.add_done_callback(lambda f, span=(first, last): self._fetched(f, span))
        return True

    def _fetch_run(self, room: Future | None, shard: int, first: int, last: int) -> None:
        """A fetch, once the records let go to make room for it are punched (`_evict`)."""
        if room is not None:
            room.result()
        self.files.fetch_run(shard, first, last)

    def _with_neighbours(self, missing: np.ndarray, reach: int) -> np.ndarray:
        """The records not held that the followed sequence reads by batch `reach` and that extend a run of
        `missing` (block order reads a window in a random order: its neighbours come a few batches later)."""
        soon = np.flatnonzero(~self._held & (self._next <= reach))
        if len(soon) == 0:
            return soon
        union = np.union1d(missing, soon)
        starts = np.r_[0, np.flatnonzero(np.diff(union) != 1) + 1]
        run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(union)]))
        wanted = np.zeros(len(starts), dtype=bool)
        wanted[run[np.isin(union, missing)]] = True
        return np.setdiff1d(union[wanted[run]], missing)

    def _fetched(self, future: Future, span: tuple[int, int]) -> None:
        with self._lock:
            for u in range(*span):
                if self._pending.get(u) is future:
                    del self._pending[u]
            if future.exception() is not None:  # what was not placed before the error is not held any more
                for u in range(*span):
                    if self._held[u] and not self.files.whole(u):
                        self._held[u] = False
                        self.used -= self.files.size(u)

    def _make_room(self, need: int, horizon: int | None, pinned: np.ndarray) -> bool:
        """Evict units, furthest next use first, until `need` more bytes fit; False (nothing evicted) if
        that would take a unit being fetched, a pinned one or (with `horizon`) one needed by then."""
        over = self.used + need - self.budget
        if over <= 0:
            return True
        candidates = np.flatnonzero(self._held)
        keep = np.zeros(len(candidates), dtype=bool)
        if self._pending:
            keep |= np.isin(candidates, np.fromiter(self._pending, np.int64, len(self._pending)))
        keep |= np.isin(candidates, pinned)
        if horizon is not None:
            keep |= self._next[candidates] <= horizon
        candidates = candidates[~keep]
        order = candidates[np.argsort(-self._next[candidates], kind="stable")]
        enough = np.searchsorted(np.cumsum(self.files.sizes(order)), over)
        if enough >= len(order):
            return False
        self._evict(order[:enough + 1])
        return True

    def _evict(self, units: np.ndarray) -> None:
        """Let units go (ours, counted by `scan` or a fetch): a shard's file deleted now; records' bytes punched
        on a fetch thread (under their chunks' locks, which a fetch holds while its GET runs: never waited for
        under `_lock`), before the fetches that need the room write anything (`_fetch_run`)."""
        if isinstance(self.files, RecordSlots):
            earlier = self._victims

            def punch() -> None:
                if earlier is not None:
                    earlier.result()
                self.files.remove_all(units)

            self._victims = self._executor().submit(punch)
        else:
            self.files.remove_all(units)
        self._held[units] = False
        self.used -= int(self.files.sizes(units).sum())

    def _executor(self) -> ThreadPoolExecutor:
        self._own_pools()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, "dsc-fetch")
        return self._pool

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            self._own_pools()
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_THREADS - 1, "dsc-read")
            return self._readers

    def _forget_parents_fetches(self) -> None:
        """In a child just forked: the parent's fetches in flight never end here (their threads are not here),
        and one of them may have held the lock; so a new lock, and what they fetch is not held but fetched again
        when needed (or found in place, `UnitFiles.fetch_run`)."""
        self._lock = threading.RLock()
        for unit in self._pending:
            if self._held[unit]:
                self._held[unit] = False
                self.used -= self.files.size(unit)
        self._pending = {}
        self._victims = None

    def _own_pools(self) -> None:
        """A forked child makes pools of its own (its parent's threads are not in it)."""
        if self._pool_pid != os.getpid():
            self._pool = self._readers = None
            self._pool_pid = os.getpid()

    # --------------------------------------------------------------------- reading

    def _copy(self, dst: np.ndarray, idx: np.ndarray) -> None:
        """Each record of `idx` into its row of `dst`, checked (module docstring), on READ_THREADS threads
        (the copies, reads and checksums release the GIL): records out of their memory maps in one gather
        (`RecordSlots.gather`), those it could not serve one by one; shards' records one by one."""
        if isinstance(self.files, RecordSlots):
            threads = READ_THREADS if len(idx) >= READ_SPLIT else 1
            for row in self.files.gather(dst, idx, self._reader_pool() if threads > 1 else None, threads):
                self._read(dst[row], int(idx[row]))
            return

        def part(a: int, b: int) -> None:
            for row, record in enumerate(idx[a:b].tolist(), a):
                self._read(dst[row], record)

        parts = READ_THREADS if len(idx) >= READ_SPLIT else 1
        edges = [len(idx) * k // parts for k in range(parts + 1)]
        futures = [self._reader_pool().submit(part, a, b) for a, b in zip(edges[1:-1], edges[2:])] if parts > 1 else []
        try:
            part(edges[0], edges[1])
        finally:
            for future in futures:
                future.result()

    def _read(self, row: np.ndarray, record: int) -> None:
        """Record `record` into `row`; a unit gone (another process let it go) or wrong is fetched again
        once, and a copy still wrong is an error naming it."""
        problem = self.files.read(row, record)
        if problem is None:
            return
        unit = int(self.files.of(record))
        if problem == "gone":
            with self._lock:
                if unit not in self._pending and self._held[unit]:
                    self._held[unit] = False
                    self.used -= self.files.size(unit)
                self._request(np.array([unit]), pinned=np.array([unit]))
                future = self._pending.get(unit)
            if future is not None:
                future.result()
        else:
            self.files.fetch_again(record // self.files.per_shard, unit, unit + 1)
        problem = self.files.read(row, record)
        if problem is not None:
            name = self.files.manifest.shards[record // self.files.per_shard].file
            raise DatasetError(f"{self.files.root_name}/{name}: record {record}: its cached copy "
                               f"{self.files.path(unit)} is still wrong after it was fetched again ({problem})")
