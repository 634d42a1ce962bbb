"""A bounded node-local cache of a remote dataset's records that follows the order they will be read in.

The unit of the cache is what can be checked on its own: a record where the dataset has per-record
checksums (format 1.3, `checksums.bin`), else a whole shard (checked by its SHA-256). A unit is one
file of the dataset's cache folder (`records/SSSSS/P.bin` for record P of shard S, or the shard file
itself, `shards/SSSSS.bin`), downloaded once per node: under a lock file, into a temporary name,
checked, renamed into place; ranks and workers of one node share them.

The loader tells the cache the sequence of batches this process reads next (`follow`: its share of
the epoch and the batch size); `fill` then makes one batch's units local and copies its records out.
Ahead of the batch being made it fetches the next `depth` batches' missing units, in order, with
runs of neighbouring records in one shard coalesced into one ranged GET (up to `GET_BYTES`) on a
bounded pool of threads. Room is made by evicting the unit needed furthest in the future (Belady's
rule; a unit this pass never reads again goes first), never one needed before the unit being
fetched: prefetching stops there instead. The bytes the folder holds (the manifest and index files,
the units, what is being fetched) never exceed `budget`. It deletes only units: files at the names
above, regular files it counted as units; anything else in the folder is never touched.

Every record is checked before it is served: a record unit against its CRC-32 each time it is read,
a shard unit against its SHA-256 once per process. A unit that fails is fetched again; a fetch still
wrong is an error naming the object and the record, never a wrong batch.

The count of bytes held is this process's: processes that share a folder share its units, but each
counts only what it has seen, so the folder of a node whose L processes share it stays under L times
the budget (README, "Datasets in object storage").
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.storage.local import open_lock

RECORD_DIR = "records"  # record units: records/SSSSS/P.bin (the cache's own layout, not the format's)
GET_BYTES = 16 << 20  # a coalesced ranged GET covers at most this much (and never crosses a lock chunk)
FETCH_THREADS = 8  # ranged GETs in flight at a time, per process
DEPTH = 2  # batches fetched ahead of the one being made
# ...when the cache has free room for them (they never evict anything)
FETCHES = 2  # fetches of a unit whose bytes are wrong, before it is an error
AHEAD_RECORDS = 4096  # neighbours read within this many records (two of block order's windows) join a GET...
NEVER = np.iinfo(np.int64).max  # the next use of a unit the followed sequence does not read again
_UNIT_NAME = re.compile(r"(?:records/(\d{5,})/(\d+)\.bin|shards/(\d{5,})\.bin)")


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
    """When each unit is read next, from the units of a followed sequence cut into batches."""

    def __init__(self, units: np.ndarray, batch_size: int, n_units: int) -> None:
        self.batch_size = batch_size
        self._units = units
        self.count = -(-len(units) // batch_size)
        self._nb = max(self.count, 1)
        batches = np.arange(len(units), dtype=np.int64) // batch_size
        self._keys = np.unique(units.astype(np.int64) * self._nb + batches)  # by unit, then batch
        unit_of = self._keys // self._nb
        first = np.r_[True, unit_of[1:] != unit_of[:-1]] if len(unit_of) else np.zeros(0, bool)
        self.first_use = np.full(n_units, NEVER, dtype=np.int64)
        self.first_use[unit_of[first]] = self._keys[first] % self._nb

    def batch(self, b: int) -> np.ndarray:
        """The distinct units batch `b` reads."""
        return np.unique(self._units[b * self.batch_size:(b + 1) * self.batch_size])

    def after(self, units: np.ndarray, b: int) -> np.ndarray:
        """The next batch after `b` that reads each of `units` (all read by batch `b`), or NEVER."""
        at = np.searchsorted(self._keys, units * self._nb + b) + 1
        ok = at < len(self._keys)
        nxt = self._keys[np.minimum(at, len(self._keys) - 1)]
        return np.where(ok & (nxt // self._nb == units), nxt % self._nb, NEVER)


class RecordCache:
    """The records of a remote dataset, read through a bounded folder (module docstring).

    `get(name, start, stop)` fetches bytes [start, stop) of a dataset file (with retries); `at(name)`
    names its object in messages; `crcs` are the records' CRC-32s (None: whole-shard units)."""

    def __init__(self, manifest: fmt.Manifest, folder: Path, budget: int, base_bytes: int,
                 get: Callable[[str, int, int], bytes], at: Callable[[str], str], crcs: np.ndarray | None,
                 threads: int = FETCH_THREADS) -> None:
        self.manifest, self.folder, self.budget, self._get, self._at = manifest, folder, budget, get, at
        self.crcs = crcs
        self.root_name = at("").rstrip("/")  # the dataset's URL, for messages
        self.record_bytes, self.per_shard = manifest.record_bytes, manifest.records_per_shard
        self.per_unit = 1 if crcs is not None else self.per_shard
        self.n_units = manifest.count if crcs is not None else len(manifest.shards)
        self._threads = threads
        self._lock = threading.RLock()  # a fetch that ends at once runs its callback inside `_request`
        self._held = np.zeros(self.n_units, dtype=bool)  # counted in `used`: a file, or a fetch under way
        self._checked = np.zeros(self.n_units, dtype=bool)  # shard units whose SHA-256 this process checked
        self._pending: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._plan: Plan | None = None
        self._start = 0  # the batch number of the plan's first batch
        self._depth = DEPTH
        self._fresh = np.zeros(self.n_units, dtype=bool)  # fetched, and not read by a batch since: a miss
        self._next = np.full(self.n_units, NEVER, dtype=np.int64)
        self.base_bytes = base_bytes
        self.used = base_bytes + self._scan()
        self.stats = NetworkStats()

    # --------------------------------------------------------------------- sizes and names

    def unit_of(self, records: np.ndarray) -> np.ndarray:
        return np.asarray(records, dtype=np.int64) // self.per_unit

    def unit_bytes(self, unit: int) -> int:
        return self.record_bytes if self.crcs is not None else self.manifest.shards[unit].bytes

    def largest_unit(self) -> int:
        return self.record_bytes if self.crcs is not None else max(s.bytes for s in self.manifest.shards)

    def unit_path(self, unit: int) -> Path:
        if self.crcs is None:
            return self.folder / fmt.shard_file(unit)
        shard, pos = fmt.locate(unit, self.per_shard)
        return self.folder / RECORD_DIR / f"{shard:05d}" / f"{pos}.bin"

    def minimum(self, batch_size: int, depth: int) -> int:
        """The least budget that holds the index and `depth + 1` batches of `batch_size` records."""
        units = min(self.n_units, (depth + 1) * min(batch_size, self.n_units))
        return self.base_bytes + units * self.largest_unit()

    def check_room(self, batch_size: int, depth: int = DEPTH) -> None:
        """Refuse, naming the minimum, a budget too small for batches of `batch_size` fetched `depth` ahead."""
        need = self.minimum(batch_size, depth)
        if self.budget < need:
            units = min(self.n_units, (depth + 1) * min(batch_size, self.n_units))
            unit = "records" if self.crcs is not None else "shards (this dataset has no per-record checksums)"
            raise DatasetError(f"{self.root_name}: cache_bytes={self.budget} is too small for batches of {batch_size} "
                               f"fetched {depth} batches ahead: at least {need} bytes are needed (the index, "
                               f"{self.base_bytes} bytes, and the {units} {unit} of {depth + 1} batches, up to "
                               f"{self.largest_unit()} bytes each); give cache_bytes >= {need}")

    def _scan(self) -> int:
        """Count the units already in the folder (an earlier run's, another process's): held, deletable."""
        total = 0
        for path in [*(self.folder / RECORD_DIR).glob("*/*.bin"), *(self.folder / fmt.SHARD_DIR).glob("*.bin")]:
            unit = self._unit_at(path)
            if unit is None:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == self.unit_bytes(unit):
                self._held[unit] = True
                total += st.st_size
        return total

    def _unit_at(self, path: Path) -> int | None:
        """The unit whose name `path` has in this dataset's layout, or None (not ours)."""
        match = _UNIT_NAME.fullmatch(path.relative_to(self.folder).as_posix())
        if match is None or (match.group(3) is None) != (self.crcs is not None):
            return None
        if self.crcs is None:
            shard = int(match.group(3))
            return shard if shard < self.n_units and self.unit_path(shard) == path else None
        shard, pos = int(match.group(1)), int(match.group(2))
        if shard >= len(self.manifest.shards) or pos >= self.manifest.shards[shard].records:
            return None
        unit = shard * self.per_shard + pos
        return unit if self.unit_path(unit) == path else None

    # --------------------------------------------------------------------- the reader's seam

    def follow(self, share: np.ndarray, batch_size: int, start: int = 0, depth: int = DEPTH) -> None:
        """From now on this process reads batches `share[b * batch_size:(b + 1) * batch_size]` for b >= `start`,
        in that order (`fill(..., batch=b)`); fetch `depth` batches ahead of the one being read."""
        plan = Plan(self.unit_of(share[start * batch_size:]), batch_size, self.n_units)
        with self._lock:
            self._plan, self._start, self._depth = plan, start, depth
            self._next = plan.first_use.copy()  # batch numbers from `start`, like every plan-relative one

    def fill(self, dst: np.ndarray, idx: np.ndarray, batch: int | None = None) -> None:
        """Copy records `idx` into `dst[:len(idx)]`, fetching what is not local; `batch`: which batch of the
        followed sequence this is (its next ones are fetched ahead, and what it read is let go after)."""
        plan = self._plan if batch is not None else None
        at = batch - self._start if plan is not None else 0
        units = np.unique(self.unit_of(idx))
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
        if self._pool is not None and self._pool_pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None

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
        need = int(sum(self.unit_bytes(int(u)) for u in missing)) if self.crcs is None else \
            len(missing) * self.record_bytes
        if not self._make_room(need, horizon, pinned if pinned is not None else units):
            if horizon is not None:
                return False
            raise DatasetError(f"{self.root_name}: the cache cannot hold the {len(units)} unit(s) one batch needs "
                               f"within cache_bytes={self.budget} ({self.used} held); give a larger cache_bytes")
        if reach is not None and self.crcs is not None:
            more = self._with_neighbours(missing, reach)
            if self.used + need + len(more) * self.record_bytes <= self.budget:
                missing = np.union1d(missing, more)
                need += len(more) * self.record_bytes
        self._held[missing] = True
        self._fresh[missing] = True
        self.used += need
        for shard, first, last in self._runs(missing):
            future = self._executor().submit(self._fetch_run, shard, first, last)
            for u in range(first, last):
                self._pending[u] = future
            future.add_done_callback(lambda f, span=(first, last): self._fetched(f, span))
        return True

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
                    if self._held[u] and not self._whole(u):
                        self._held[u] = False
                        self.used -= self.unit_bytes(u)

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
        sizes = np.array([self.unit_bytes(int(u)) for u in order], dtype=np.int64) if self.crcs is None else \
            np.full(len(order), self.record_bytes, dtype=np.int64)
        enough = np.searchsorted(np.cumsum(sizes), over)
        if enough >= len(order):
            return False
        for unit in order[:enough + 1].tolist():
            self._evict(unit)
        return True

    def _evict(self, unit: int) -> None:
        """Delete a unit's file (one of ours, at a unit's name: `_scan` or a fetch counted it)."""
        path = self.unit_path(unit)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass  # another process of the node let it go already
        self._held[unit] = False
        self._checked[unit] = False
        self.used -= self.unit_bytes(unit)

    def _runs(self, units: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, first unit, end unit) of each ranged GET: consecutive units of one shard, cut where a
        GET would pass `GET_BYTES` (record units; a shard unit is one run of its own)."""
        if self.crcs is None:
            return [(int(u), int(u), int(u) + 1) for u in units]
        chunk = max(1, GET_BYTES // self.record_bytes)
        shard, pos = fmt.locate(units, self.per_shard)
        cut = np.flatnonzero((np.diff(units) != 1) | (shard[1:] != shard[:-1])
                             | (pos[1:] // chunk != pos[:-1] // chunk)) + 1
        edges = [0, *cut.tolist(), len(units)]
        return [(int(shard[a]), int(units[a]), int(units[b - 1]) + 1) for a, b in zip(edges[:-1], edges[1:])]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_pid != os.getpid():  # a forked child makes its own
            self._pool, self._pool_pid = ThreadPoolExecutor(self._threads, "dsc-fetch"), os.getpid()
        return self._pool

    # --------------------------------------------------------------------- fetching and checking

    def _fetch_run(self, shard: int, first: int, last: int) -> None:
        """Fetch units [first, last) of one shard, under the lock of their chunk, skipping those another
        process placed meanwhile; each checked, placed by rename."""
        lock_path = self._lock_path(shard, first)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = open_lock(lock_path)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            wanted = [u for u in range(first, last) if not self._present(u)]
            if not wanted:
                return
            if self.crcs is None:
                self._fetch_shard(shard)
            else:
                self._fetch_records(shard, wanted[0], wanted[-1] + 1)
        finally:
            os.close(lock)

    def _lock_path(self, shard: int, unit: int) -> Path:
        if self.crcs is None:
            return self.folder / fmt.SHARD_DIR / f".{shard:05d}.bin.lock"
        chunk = (unit - shard * self.per_shard) // max(1, GET_BYTES // self.record_bytes)
        return self.folder / RECORD_DIR / f"{shard:05d}" / f".{chunk}.lock"

    def _present(self, unit: int) -> bool:
        """Whether the unit's file is there whole; something else than a regular file at its name is refused."""
        path = self.unit_path(unit)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise self._foreign(path)
        return st.st_size == self.unit_bytes(unit)

    def _whole(self, unit: int) -> bool:
        """`_present`, where something else than a regular file at the unit's name counts as absent."""
        try:
            return self._present(unit)
        except DatasetError:
            return False

    def _foreign(self, path: Path) -> DatasetError:
        return DatasetError(f"{path}: not a regular file; the cache of {self.root_name} holds something dsc did not "
                            "put there, and leaves it alone: move it away")

    def _fetch_records(self, shard: int, first: int, last: int) -> None:
        """One ranged GET of records [first, last) (all of shard `shard`), each checked against its CRC-32
        (fetched again once when wrong), then each placed as its own file."""
        name, rb = self.manifest.shards[shard].file, self.record_bytes
        start = (first - shard * self.per_shard) * rb
        data = self._ranged(name, start, start + (last - first) * rb)
        for unit in range(first, last):
            piece = data[(unit - first) * rb:(unit - first + 1) * rb]
            if zlib.crc32(piece) != int(self.crcs[unit]):
                piece = self._refetch(unit)
            self._place(self.unit_path(unit), piece)

    def _refetch(self, unit: int) -> memoryview:
        """Record `unit` fetched again on its own; still not matching its CRC-32: an error naming it."""
        shard, pos = fmt.locate(unit, self.per_shard)
        name, rb = self.manifest.shards[shard].file, self.record_bytes
        piece = self._ranged(name, pos * rb, (pos + 1) * rb)
        found = zlib.crc32(piece)
        if found != int(self.crcs[unit]):
            raise DatasetError(f"{self._at(name)}: record {unit} (bytes {pos * rb}-{(pos + 1) * rb - 1} of the object) "
                               f"has CRC-32 {found:08x}, but {fmt.CHECKSUMS_FILE} says {int(self.crcs[unit]):08x}; "
                               f"fetched {FETCHES} times, wrong each time: the object in the bucket is damaged")
        return piece

    def _fetch_shard(self, shard: int) -> None:
        """A whole shard, in ranged GETs of `GET_BYTES`, checked against its SHA-256 (fetched again once)."""
        import hashlib

        entry, problems = self.manifest.shards[shard], []
        for _ in range(FETCHES):
            data = self._ranged(entry.file, 0, entry.bytes)
            digest = hashlib.sha256(data).hexdigest()
            if digest == entry.sha256:
                self._place(self.unit_path(shard), data)
                return
            problems.append(f"SHA-256 {digest}, the manifest says {entry.sha256}")
        raise DatasetError(f"{self._at(entry.file)}: fetched {FETCHES} times, wrong each time ({'; '.join(problems)}); "
                           "the object in the bucket is damaged")

    def _ranged(self, name: str, start: int, stop: int) -> memoryview:
        """Bytes [start, stop) of a dataset file, in GETs of at most `GET_BYTES`, all of them or an error."""
        parts = []
        for at in range(start, stop, GET_BYTES):
            end = min(stop, at + GET_BYTES)
            data = self._get(name, at, end)
            if len(data) != end - at:
                raise DatasetError(f"{self._at(name)}: asked for bytes {at}-{end - 1}, got {len(data)} bytes; the "
                                   "object is shorter than the manifest says")
            with self._lock:
                self.stats.requests += 1
                self.stats.fetched_bytes += len(data)
            parts.append(data)
        return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))

    def _place(self, path: Path, data) -> None:
        """Write `data` to a new temporary name beside `path`, then rename it into place."""
        import secrets

        from dsc.storage.local import TEMP_SUFFIX, create_exclusive

        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        fd = create_exclusive(temp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(temp, path)
        finally:
            try:
                os.unlink(temp)  # ours (created exclusively above); gone already once renamed
            except FileNotFoundError:
                pass

    # --------------------------------------------------------------------- reading

    def _copy(self, dst: np.ndarray, idx: np.ndarray) -> None:
        """Each record of `idx` into its row of `dst`, checked (module docstring)."""
        for row, record in enumerate(idx.tolist()):
            self._read(dst[row], record)

    def _read(self, row: np.ndarray, record: int) -> None:
        """Record `record` into `row`; a unit gone (another process let it go) or wrong is fetched again
        once, and a copy still wrong is an error naming it."""
        unit = record // self.per_unit
        problem = self._read_once(row, record, unit)
        if problem is None:
            return
        if problem == "gone":
            with self._lock:
                if unit not in self._pending and self._held[unit]:
                    self._held[unit] = False
                    self.used -= self.unit_bytes(unit)
                self._request(np.array([unit]), pinned=np.array([unit]))
                future = self._pending.get(unit)
            if future is not None:
                future.result()
        else:
            self._fetch_forced(unit)
        problem = self._read_once(row, record, unit)
        if problem is not None:
            name = self.manifest.shards[record // self.per_shard].file
            raise DatasetError(f"{self._at(name)}: record {record}: its cached copy {self.unit_path(unit)} is still "
                               f"wrong after it was fetched again ({problem})")

    def _fetch_forced(self, unit: int) -> None:
        """A unit whose cached copy is wrong, fetched again and put in its place (a rename over it)."""
        if self.crcs is None:
            self._fetch_shard(unit)
        else:
            shard, _ = fmt.locate(unit, self.per_shard)
            self._fetch_records(shard, unit, unit + 1)

    def _read_once(self, row: np.ndarray, record: int, unit: int) -> str | None:
        """Record `record` from its unit's file into `row`; what was wrong ("gone", or a checksum), or None."""
        path = self.unit_path(unit)
        offset = (record - unit * self.per_unit) * self.record_bytes
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return "gone"
        except OSError as e:  # a link (ELOOP) or worse at a unit's name
            raise self._foreign(path) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._foreign(path)
        try:
            if self.crcs is None and not self._checked[unit]:
                problem = self._check_shard(fd, unit)
                if problem is not None:
                    return problem
            got = os.preadv(fd, [memoryview(row).cast("B")], offset)
        finally:
            os.close(fd)
        if got != self.record_bytes:
            return f"{got} bytes where the record has {self.record_bytes}"
        if self.crcs is not None:
            found = zlib.crc32(memoryview(row).cast("B"))
            if found != int(self.crcs[record]):
                return f"CRC-32 {found:08x}, {fmt.CHECKSUMS_FILE} says {int(self.crcs[record]):08x}"
        return None

    def _check_shard(self, fd: int, unit: int) -> str | None:
        from dsc.storage.local import sha256_fd

        digest = sha256_fd(os.dup(fd))
        if digest != self.manifest.shards[unit].sha256:
            return f"SHA-256 {digest}, the manifest says {self.manifest.shards[unit].sha256}"
        self._checked[unit] = True
        return None
