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
deleted); anything else in the folder is never touched. Each version of a dataset has a folder of its own:
every process holds a shared lock on the one it reads (`_hold`), and the record files of an older version
of the same URL that no process holds are deleted when a newer one is read (`retire_version`).

The budget is the node's: the processes that share the folder count what it holds (whoever fetched it)
and what each has reserved for fetches under way, and evict by when any of them reads a unit next
(`dsc.storage.ledger`: a table of the processes' reservations and their published plans). A batch that
finds no room while other processes' fetches hold it waits for them to end.

Every record is checked before it is served: a record against its CRC-32 the first time this process
reads it under its state word (`RecordSlots.gather`), a shard against its SHA-256 the first time this
process reads its file and whenever the file changed since (`UnitFiles.read`). A unit that fails is
fetched again; a fetch still wrong is an error naming the object and the record, never a wrong batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.reader.gather import default_threads
from dsc.storage import slots, units
from dsc.storage.ledger import TABLE_BYTES, NodeLedger, retire_plans
from dsc.storage.local import claim_folder, hold_folder, let_go_lock
from dsc.storage.slots import RecordSlots
from dsc.storage.units import UnitFiles

FETCH_THREADS = 8  # ranged GETs in flight at a time, per process
READ_THREADS = default_threads()  # records of a batch read out of the cache (and checked) by this many threads
READ_SPLIT = 32  # a batch of fewer records is read on the caller's thread alone
DEPTH = 2  # batches fetched ahead of the one being made
AHEAD_RECORDS = 4096  # neighbours read within this many records (two of block order's windows) join a GET
NEVER = np.iinfo(np.int64).max  # the next use of a unit the followed sequence does not read again
ROOM_WAIT_S = 600.0  # how long a batch waits for other processes' fetches to end and leave it room
ROOM_POLL_S = 0.01  # how often it looks again, when none of its own fetches is under way
GONE_TRIES = 4  # fetches of a record let go by other processes each time before it was read, before an error


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


logger = logging.getLogger("dsc")
HOLD_WAIT_S = 30.0  # the longest a process waits for another's `retire_version` of its folder to end


def _hold(folder: Path) -> int:
    """A shared lock on the dataset's cache folder (`local.hold_folder`), taken once no `retire_version` holds
    it: the folder's records are this process's to read."""
    deadline = time.monotonic() + HOLD_WAIT_S
    while (fd := hold_folder(folder)) is None:
        if time.monotonic() > deadline:
            raise DatasetError(f"{folder}: another process kept this cache folder locked for {HOLD_WAIT_S:.0f} s "
                               "(it is deleting the records of a version no process reads); try again")
        time.sleep(0.05)
    return fd


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _let_go(pid: int, fd: int) -> None:
    """The hold of `_hold`, let go by the process that took it (a forked child closed its copy at the fork, and
    the number may name another file of the child's by now)."""
    if os.getpid() == pid:
        let_go_lock(fd)


def retire_version(folder: Path) -> int:
    """Delete the records (and published plans) a dataset's cache folder holds, if no process uses it now (an
    older version of a dataset, whose newer version has a folder of its own); its manifest, index and anything
    else stay. Best effort, by descriptors of the folder claimed (a link inside is never followed): the disk
    blocks freed; 0 when the folder is in use, locks cannot tell, or a file cannot be deleted (said in the log)."""
    try:
        fd = claim_folder(folder)
    except OSError:
        return 0
    if fd is None:
        return 0
    try:
        return slots.retire(fd) + units.retire(fd) + retire_plans(fd)
    except OSError as e:  # another user's files, an immutable one: they stay, and this version's open goes on
        logger.debug("could not delete the records of %s: %s", folder, e)
        return 0
    finally:
        let_go_lock(fd)


def _folder_kept(method: Callable) -> Callable:
    """`method` of a RecordCache, whose FileNotFoundError for a file of the cache's folder (one its own evictions
    delete is handled where it is read), or with the folder gone or made anew, is one line: the folder, or files of
    it, deleted from outside (by hand, another job's clean-up)."""
    @functools.wraps(method)
    def kept(self: RecordCache, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except FileNotFoundError as e:
            inside = isinstance(e.filename, str) and e.filename.startswith(f"{self.folder}{os.sep}")
            try:
                same = _identity(os.stat(self.folder)) == self._identity
            except FileNotFoundError:
                same = False
            if same and not inside:
                raise
            gone = f" ({e.filename} is gone)" if e.filename else ""
            raise DatasetError(f"{self.folder}: this cache folder of {self.files.root_name}, or files of it, were "
                               f"deleted while this process read through it{gone}; what it holds can no longer be "
                               "shared or counted: open the dataset again, which starts the folder anew") from e
    return kept


class RecordCache:
    """The records of a remote dataset, read through a bounded folder (module docstring).

    `get(name, start, stop)` fetches bytes [start, stop) of a dataset file (with retries); `at(name)`
    names its object in messages; `crcs` are the records' CRC-32s (None: whole-shard units)."""

    def __init__(self, manifest: fmt.Manifest, folder: Path, budget: int, base_bytes: int,
                 get: Callable[[str, int, int], bytes], at: Callable[[str], str], crcs: np.ndarray | None,
                 threads: int = FETCH_THREADS) -> None:
        self.stats = NetworkStats()
        self.folder = folder
        in_use = _hold(folder)  # for this object's life: no `retire_version` elsewhere deletes its records
        self._identity = _identity(os.fstat(in_use))  # the folder opened: one removed and made anew is another
        weakref.finalize(self, _let_go, os.getpid(), in_use)
        self._lock = threading.RLock()  # a fetch that ends at once runs its callback inside `_request`
        self.files = UnitFiles(manifest, folder, get, at, self._count_fetch) if crcs is None else \
            RecordSlots(manifest, folder, get, at, crcs, self._count_fetch)
        self.budget, self.base_bytes, self._threads = budget, base_bytes, threads
        n = self.files.count
        self.ledger = NodeLedger(folder, n)
        weakref.finalize(self, self.ledger.leave)
        self._fetching = np.zeros(n, dtype=bool)  # fetches of this process under way (`_pending`'s units)
        self._fresh = np.zeros(n, dtype=bool)  # fetched, and not read by a batch since: a miss
        self._next = np.full(n, NEVER, dtype=np.int64)  # the batch of the plan that reads each next
        self._now = 0  # the batch of the plan being made
        self._full = False  # the last room asked for had to be made (the others' plans are read before the next)
        self._others_reserved = 0  # what the node's other processes had reserved when a request was last refused
        self._pending: dict[int, Future] = {}
        self._victims: Future | None = None  # records let go whose bytes are being punched (`_evict`)
        self._pool: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._plan: Plan | None = None
        self._start = 0  # the batch number of the plan's first batch
        self._depth = DEPTH
        _caches.add(self)
        self.files.scan()  # (records: the blocks a writer killed midway left are freed first)

    @property
    @_folder_kept
    def used(self) -> int:
        """The bytes the node's folder holds and its processes have reserved, counted in the budget."""
        with self._lock, self.ledger.locked():
            return self._node_used(self.files.present_mask())

    def _node_used(self, present: np.ndarray) -> int:
        """The units held and the node's reservations (`NodeLedger.reserved`), besides the index and the node's
        table and plans."""
        held = np.flatnonzero(present)
        return (self.base_bytes + self.ledger.overhead() + int(self.files.sizes(held).sum())
                + self.ledger.reserved())

    def _count_fetch(self, nbytes: int) -> None:
        with self._lock:
            self.stats.requests += 1
            self.stats.fetched_bytes += nbytes

    def _units_of_batches(self, batch_size: int, depth: int) -> int:
        return min(self.files.count, (depth + 1) * min(batch_size, self.files.count))

    @_folder_kept
    def check_room(self, batch_size: int, depth: int = DEPTH) -> None:
        """Refuse, naming the minimum, a budget too small for batches of `batch_size` fetched `depth` ahead here
        and for what the node's other processes that share the folder said they need (`NodeLedger.set_need`)."""
        units = self._units_of_batches(batch_size, depth)
        mine = units * self.files.largest()
        with self.ledger.locked():
            needs, planners = self.ledger.set_need(mine)
            theirs = needs - mine
            # the table and a plan for each process that makes batches (published when it starts following one)
            tables = max(self.ledger.overhead(), TABLE_BYTES + planners * self.ledger.plan_bytes)
            need = self.base_bytes + tables + mine + theirs
            if self.budget >= need:
                return
            self.ledger.set_need(0)
        kind = "records" if self.files.crcs is not None else "shards (this dataset has no per-record checksums)"
        others = (f", and {theirs} bytes for the batches of the node's other processes that share this cache (each "
                  "of them needs cache_bytes at least this too)") if theirs else ""
        raise DatasetError(f"{self.files.root_name}: cache_bytes={self.budget} is too small for batches of "
                           f"{batch_size} fetched {depth} batches ahead: at least {need} bytes are needed (the "
                           f"index, {self.base_bytes} bytes, the node's table and plans, {tables} bytes, the {units} "
                           f"{kind} of {depth + 1} batches, up to {self.files.largest()} bytes each{others}); give "
                           f"cache_bytes >= {need}")

    # --------------------------------------------------------------------- the reader's seam

    @_folder_kept
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
            self._plan, self._start, self._depth, self._now = plan, start, depth, 0
            self._next = plan.first_use.copy()  # batch numbers from `start`, like every plan-relative one
            if not self.ledger.has_plan():
                self._make_plan()
            self.ledger.publish(self._next)  # for the node's other processes' evictions

    def _make_plan(self) -> None:
        """This process's plan file, in room made for it (it counts in the budget, `NodeLedger.overhead`)."""
        with self.ledger.locked():
            if self._make_room(self.ledger.plan_bytes, None, np.zeros(0, np.int64), self.files.present_mask()) \
                    is None:
                raise DatasetError(f"{self.files.root_name}: the cache cannot hold this process's plan "
                                   f"({self.ledger.plan_bytes} bytes) within cache_bytes={self.budget}: the node's "
                                   "fetches under way hold the rest; give a larger cache_bytes")
            self.ledger.make_plan()

    @_folder_kept
    def fill(self, dst: np.ndarray, idx: np.ndarray, batch: int | None = None) -> None:
        """Copy records `idx` into `dst[:len(idx)]`, fetching what is not local; `batch`: which batch of the
        followed sequence this is (its next ones are fetched ahead, and what it read is let go after)."""
        plan = self._plan if batch is not None else None
        at = batch - self._start if plan is not None else self._now
        units = np.unique(self.files.of(idx))
        began = time.perf_counter()
        if plan is not None:
            self.ledger.at_batch(at)
        with self._room(units, at, reach=at + self._ahead(plan) if plan is not None else None):
            if plan is not None:
                self._prefetch(plan, at)
            waits = [self._pending[u] for u in units.tolist() if u in self._pending]
            fresh = self._fresh[units]
            self.stats.misses += int(fresh.sum())
            self.stats.hits += len(units) - int(fresh.sum())
            self._fresh[units] = False
        for future in waits:
            future.result()
        self.stats.wait_s += time.perf_counter() - began
        self._copy(dst, np.asarray(idx, dtype=np.int64))
        if plan is not None:
            with self._lock:
                self._next[units] = plan.after(units, at)
                self.ledger.publish(self._next, units)

    @contextlib.contextmanager
    def _room(self, units: np.ndarray, now: int, reach: int | None = None) -> Iterator[None]:
        """Hold `_lock` with the fetches of `units` started (the batch being made at `now`); while the node's
        folder has no room for them, wait for fetches under way (this process's or others') to end, up to
        ROOM_WAIT_S, then an error."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            with self._lock:
                self._now = now
                if self._request(units, pinned=units, reach=reach):
                    yield
                    return
                mine = list(self._pending.values()) + [self._victims] * (self._victims is not None)  # punches too
                others = self._others_reserved  # when it was refused: read since, a fetch may have ended meanwhile
            if (not mine and not others) or time.monotonic() > deadline:
                raise DatasetError(f"{self.files.root_name}: the cache cannot hold the {len(units)} unit(s) one "
                                   f"batch needs within cache_bytes={self.budget} ({self.used} held or reserved by "
                                   f"the node's {self.ledger.processes()} process(es) sharing it); give a larger "
                                   "cache_bytes")
            if mine:
                wait(mine, timeout=ROOM_POLL_S * 10, return_when=FIRST_COMPLETED)
            else:
                time.sleep(ROOM_POLL_S)

    def close(self) -> None:
        if self._pool_pid == os.getpid():
            for pool in filter(None, (self._pool, self._readers)):
                pool.shutdown(wait=True)
        self._pool = self._readers = None
        self.ledger.leave()

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
        """Start fetching `units` the folder does not hold (with their neighbours read by batch `reach`, where
        there is free room: `_with_neighbours`); False when room for them cannot be made (nothing started).
        Evictable: units held, not being fetched here, not in `pinned`, and (with a `horizon`) read by no process
        of the node by then. Room made and reserved is one step for the node (`NodeLedger.locked`)."""
        missing = units[~(self.files.present_of(units) | self._fetching[units])]
        if len(missing) == 0:
            return True
        if self._full:
            self.ledger.refresh()  # the others' plans, read before the node's lock is taken (`_make_room`)
        with self.ledger.locked():
            if self.ledger.reap():  # a process gone left bytes nothing counts: freed
                self._executor().submit(self.files.reclaim)
            present = self.files.present_mask()  # now: under the lock, no process places or lets units go
            missing = missing[~present[missing]]  # looked at again: what another placed since is held, not needed
            if len(missing) == 0:
                return True
            need = int(self.files.sizes(missing).sum())
            used = self._make_room(need, horizon, pinned if pinned is not None else units, present)
            if used is None:
                self._others_reserved = self.ledger.reserved_by_others()  # (`_room`: worth waiting for?)
                return False
            if reach is not None and self.files.crcs is not None:
                more = self._with_neighbours(missing, reach, present)
                extra = int(self.files.sizes(more).sum())
                if used + need + extra <= self.budget:
                    missing, need = np.union1d(missing, more), need + extra
            self.ledger.reserve(need)
        self._fetching[missing] = True
        self._fresh[missing] = True
        room, self._victims = self._victims, None
        for shard, first, last in self.files.runs(missing):
            reserved = [int(self.files.sizes(np.arange(first, last)).sum()) if self.files.crcs is not None else
                        self.files.size(shard)]  # what is left of this run's reservation (`_placed`)
            future = self._executor().submit(self._fetch_run, room, shard, first, last, reserved)
            for u in range(first, last):
                self._pending[u] = future
            future.add_done_callback(lambda f, span=(first, last), left=reserved: self._fetched(f, span, left))
        return True

    def _fetch_run(self, room: Future | None, shard: int, first: int, last: int, reserved: list[int]) -> None:
        """A fetch, once the records let go to make room for it are punched (`_evict`); what it places counts as
        held from then on, not as reserved (`reserved`: what is left of the run's reservation)."""
        def placed(nbytes: int, mark: Callable[[], None]) -> None:
            with self.ledger.locked():  # held and no longer reserved at once, for every process's count
                mark()
                self.ledger.release(nbytes)
            reserved[0] -= nbytes

        if room is not None:
            room.result()
        self.files.fetch_run(shard, first, last, placed)

    def _with_neighbours(self, missing: np.ndarray, reach: int, present: np.ndarray) -> np.ndarray:
        """The records not held that the followed sequence reads by batch `reach` and that extend a run of
        `missing` (block order reads a window in a random order: its neighbours come a few batches later)."""
        soon = np.flatnonzero(~present & ~self._fetching & (self._next <= reach))
        if len(soon) == 0:
            return soon
        union = np.union1d(missing, soon)
        starts = np.r_[0, np.flatnonzero(np.diff(union) != 1) + 1]
        run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(union)]))
        wanted = np.zeros(len(starts), dtype=bool)
        wanted[run[np.isin(union, missing)]] = True
        return np.setdiff1d(union[wanted[run]], missing)

    def _fetched(self, future: Future, span: tuple[int, int], reserved: list[int]) -> None:
        """A fetch ended: the rest of its reservation goes (an error: what it did not place)."""
        with self._lock:
            for u in range(*span):
                if self._pending.get(u) is future:
                    del self._pending[u]
            self._fetching[span[0]:span[1]] = False
            self.ledger.release(reserved[0])
            reserved[0] = 0

    def _make_room(self, need: int, horizon: int | None, pinned: np.ndarray, present: np.ndarray) -> int | None:
        """Evict units, furthest next use by any process of the node first, until `need` more bytes fit; the
        bytes then counted, or None (nothing evicted) if that would take a unit being fetched, a pinned one or
        (with `horizon`) one some process reads by then."""
        used = self._node_used(present)
        over = used + need - self.budget
        self._full = over > 0
        if over <= 0:
            return used
        candidates = present & ~self._fetching
        candidates[pinned] = False
        candidates = np.flatnonzero(candidates)
        ahead = self._distances(candidates)
        if horizon is not None:
            candidates, ahead = candidates[ahead > horizon - self._now], ahead[ahead > horizon - self._now]
        order = candidates[np.argsort(-ahead, kind="stable")]
        sizes = self.files.sizes(order)
        enough = np.searchsorted(np.cumsum(sizes), over)
        if enough >= len(order):
            return None
        freed = int(sizes[:enough + 1].sum())
        beyond = max(0, freed - need)
        self._evict(order[:enough + 1], beyond)
        return used - freed + beyond

    def _distances(self, units: np.ndarray) -> np.ndarray:
        """How many batches from now the node reads each of `units` next: this process by its plan, the others
        by theirs (`NodeLedger.distances`); NEVER where none does."""
        own = self._next[units]
        own = np.where(own == NEVER, NEVER, np.maximum(own - self._now, 0))
        return np.minimum(own, self.ledger.distances(units))

    def _evict(self, units: np.ndarray, beyond: int) -> None:
        """Let units go (under the node's lock): a shard's file deleted now; records' words changed now (no
        process counts them as held, or reads them, from then on) and their bytes punched on a fetch thread
        (under their chunks' locks, which a fetch holds while its GET runs: never waited for under `_lock`),
        before the fetches that need the room write anything (`_fetch_run`). Until then the bytes are still on
        disk: the room made for those fetches counts them, and `beyond`, the bytes let go past that room, is
        reserved until they are punched."""
        if isinstance(self.files, RecordSlots):
            self.files.let_go_now(units)
            self.ledger.reserve(beyond)
            earlier = self._victims

            def punch() -> None:
                if earlier is not None:
                    earlier.result()
                try:
                    self.files.punch_absent(units)
                finally:
                    self.ledger.release(beyond)

            self._victims = self._executor().submit(punch)
        else:
            self.files.remove_all(units)

    def _let_go_damaged(self, record: int, unit: int, like: np.ndarray) -> None:
        """A held unit found damaged let go as an eviction lets one go (its bytes counted until they are punched,
        and punched before its next fetch writes), so that fetching it again needs room like any miss; unless it
        reads right now (another process put it right meanwhile)."""
        units, scratch = np.array([unit]), np.empty_like(like)
        with self._lock, self.ledger.locked():
            if self.files.present_of(units)[0] and not self._fetching[unit] and self.files.read(scratch, record):
                self._evict(units, int(self.files.sizes(units).sum()))

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
        self._pending = {}
        self._fetching[:] = False
        self._victims = None
        self.ledger.after_fork()

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
        """Record `record` into `row`. A unit gone (another process let it go) is fetched again, up to GONE_TRIES
        times (each time let go before it was read); a damaged copy is let go (`_let_go_damaged`) and fetched
        again once, as any miss is; a copy still wrong is an error naming it."""
        problem = self.files.read(row, record)
        if problem is None:
            return
        unit, damaged = int(self.files.of(record)), False
        for _ in range(GONE_TRIES):
            if problem != "gone":
                if damaged:
                    break
                damaged = True
                self._let_go_damaged(record, unit, row)
            with self._room(np.array([unit]), self._now):
                future = self._pending.get(unit)
            if future is not None:
                future.result()
            problem = self.files.read(row, record)
            if problem is None:
                return
        name = self.files.manifest.shards[record // self.files.per_shard].file
        raise DatasetError(f"{self.files.root_name}/{name}: record {record}: its cached copy "
                           f"{self.files.path(unit)} is still wrong after it was fetched again ({problem})")
