"""The node's ledger of one dataset's record cache: one `cache_bytes` for every process of a node that shares
the cache folder, and one plan of what they read next.

Processes of a node (DDP ranks, their DataLoader workers) share a dataset's cache folder, so they share its
limit: what the folder holds counts once, whoever fetched it. Two things are not on disk for them to see:

- the bytes a process has **reserved** for fetches under way (room made before a GET, so the limit holds
  while bytes arrive; and while records it let go are being punched, their bytes beyond those fetches'):
  each process keeps its sum in its row of `node/rows.bin`;
- **when each process reads each unit next**: ranks read disjoint shares of an epoch, so a process that
  evicted by its own plan alone would let go first the units other ranks read next, and the ranks would
  fetch each other's units out in turn. Each process that follows a plan publishes it in
  `node/plan.<row>.bin` (one int32 per unit: the batch of its plan that reads it next), and the batch it
  is making in its row; a unit's distance for the node is the least, over the processes, of how many of
  their batches from now it is read (`distances`). Evictions go by that (Belady's rule over the node), and
  a process that prefetches lets go of nothing another one reads within the same horizon.

A row is claimed by a process the first time it needs one (a child forked from a process that held one
claims its own) and freed when its cache is closed. The process holds the row's lock (`node/row.<r>.lock`,
flock) for as long as it has the row: the kernel lets it go when the process ends, killed included, so a row
whose lock is free counts for nothing, whichever pid namespace its process ran in (containers of one machine
may share the folder: pids could not tell one container's processes from another's, nor a pid reused). The
next process that makes room frees such a row and removes its plan (`reap`), and when it had bytes reserved,
the cache frees what it may have left on disk uncounted: records half written, or let go and not punched yet
(`RecordSlots.reclaim`). Reading and writing the table to make room and reserve happen under
`node/rows.lock`, so two processes never both take the last free bytes. What the folder holds is read from
the cache's own files (the records' state words, the shard files), not from the table. (Earlier versions kept a
table of pids in `node/table.bin` and plans in `next.<row>.bin`: a process of this one refuses to share the
folder with a live process of those, whose fetches it would not count, and removes their files once none is.)

The default `cache_bytes` is the node's too (`node_default`, `node/default_bytes`). Distances are
comparable across processes that make batches at the same pace (the ranks of a job); the limit holds
whatever the processes are.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from dsc.errors import DatasetError
from dsc.storage.local import (
    cache_writes,
    hold_lock,
    let_go_lock,
    lock_is_held,
    locked,
    map_shared,
    open_regular,
    read_no_follow,
    remove_named,
    reserve,
)

NODE_DIR = "node"
TABLE_FILE = "rows.bin"
LOCK_FILE = "rows.lock"
_OLD_TABLE, _OLD_LOCK = "table.bin", "table.lock"  # earlier versions': pids told live rows (`_refuse_older_dsc`)
_OLD_PLAN = re.compile(r"next\.(\d+)\.bin")
DEFAULT_FILE = "default_bytes"  # the node's default cache_bytes while processes share the folder (`node_default`)
ROWS = 256  # processes sharing one dataset's cache at a time
# a row: int64 each; "claims": how many times the row was claimed (a process's plan, mapped by another, is kept
# mapped while it is the same claim's)
_COLUMNS = ("pid", "claims", "reserved", "now", "need")
_PID, _CLAIMS, _RESERVED, _NOW, _NEED = range(len(_COLUMNS))
TABLE_BYTES = ROWS * len(_COLUMNS) * 8
NEXT_DTYPE = np.dtype(np.int32)  # a plan's batch number (native order: node-local)
NEVER = np.iinfo(NEXT_DTYPE).max  # read again by no batch of the plan
_PLAN_NAME = re.compile(r"plan\.(\d+)\.bin")
# the other processes' plans are read again once this many times as long as reading them took has passed: reading
# them is O(processes x units), 100 ms for 8 plans of 1.28M records here, and ranks move a few batches meanwhile
# (an eviction on a slightly older view refetches a unit at worst); small datasets' are read again every time
REFRESH_AFTER = 10


def _started(pid: int) -> int | None:
    """(An earlier version's rows) The start time of process `pid` (clock ticks after boot); -1: none, or a
    zombie; None: it cannot be told."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return -1 if fields[0] in (b"Z", b"X") else int(fields[19])
    except FileNotFoundError:
        return -1
    except (OSError, ValueError, IndexError):
        return None


def retire_plans(folder_fd: int) -> int:
    """Delete the plans published in a dataset's cache folder (open as `folder_fd`) that no process uses
    (`cache.retire_version`)."""
    return remove_named(folder_fd, NODE_DIR, lambda name: bool(_PLAN_NAME.fullmatch(name)))


def node_default(folder: Path, compute: Callable[[], int]) -> int:
    """The default `cache_bytes` of the cache folder `folder`, the same for every process of the node: the one
    written there while another process of the node uses the folder (it has a row), else `compute()`, written
    for the others. (Each computed at its own open, a process opening later, once the folder has filled, would
    add to the limit half of what is left free, and the next one half again.)"""
    value = compute()  # (first: what the folder holds before the table is made)
    ledger = NodeLedger(folder, 0)
    path = ledger.folder / DEFAULT_FILE
    with ledger.locked():
        if len(ledger._live()):
            with contextlib.suppress(OSError, ValueError):
                fd = ledger._open(path)
                with os.fdopen(fd, "rb") as f:
                    stored = int(f.read(32).decode("ascii"))
                if stored > 0:
                    return stored
        temp = path.with_name(f".{DEFAULT_FILE}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)  # ours: a process of this pid left it
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(str(value).encode("ascii"))
        os.replace(temp, path)
        return value


class NodeLedger:
    """The ledger of the cache folder `folder` of a dataset of `units` units (module docstring)."""

    def __init__(self, folder: Path, units: int) -> None:
        self.folder, self.units = folder / NODE_DIR, units
        self.folder.mkdir(exist_ok=True)
        self.plan_bytes = units * NEXT_DTYPE.itemsize  # a process's published plan
        self._table = self._map_table()
        self._row: int | None = None
        self._row_pid = 0
        self._row_lock = -1  # the descriptor holding this process's row's lock (`local.hold_lock`)
        self._left_behind = False  # a row claimed from a process gone had bytes reserved (`reap` says so)
        self._plan: np.ndarray | None = None  # this process's published plan (its row's file, mapped)
        self._theirs: dict[int, tuple[tuple, np.ndarray]] = {}  # row -> ((claims, inode), its plan mapped)
        self._counting = threading.Lock()  # this process's threads add to and take from its reservations
        self._nearest: np.ndarray | None = None  # the others' distances to every unit (`distances`), valid until
        self._nearest_until = 0.0

    # --------------------------------------------------------------------- files

    def _map_table(self) -> np.ndarray:
        """The table, shared by the node (a new one: no rows claimed)."""
        path = self.folder / TABLE_FILE
        return np.frombuffer(map_shared(path, TABLE_BYTES, lambda what: self._foreign(path, what)),
                             dtype=np.int64).reshape(ROWS, len(_COLUMNS))

    def _open(self, path: Path, create: bool = False) -> int:
        return open_regular(path, lambda what: self._foreign(path, what), create)

    def _foreign(self, path: Path, what: str) -> DatasetError:
        return DatasetError(f"{path}: {what}; the cache holds something dsc did not put there, and leaves it alone: "
                            "move it away")

    def _plan_path(self, row: int) -> Path:
        return self.folder / f"plan.{row}.bin"

    def _lock_path(self, row: int) -> Path:
        return self.folder / f"row.{row}.lock"

    def overhead(self) -> int:
        """The bytes the ledger's files take: the table, the plans published (one per process following one) and
        the node's default budget (`node_default`)."""
        plans = extra = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.folder) as entries:
            for entry in entries:
                if _PLAN_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    plans += 1
                elif entry.name == DEFAULT_FILE:
                    extra = entry.stat(follow_symlinks=False).st_size
        return TABLE_BYTES + plans * self.plan_bytes + extra

    # --------------------------------------------------------------------- rows

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The table's lock: making room and reserving it are one step for the node."""
        with locked(self.folder / LOCK_FILE):
            yield

    def _live(self) -> np.ndarray:
        """The rows whose process is alive (it holds the row's lock)."""
        return np.array([r for r, alive in self._rows() if alive], dtype=np.int64)

    def _rows(self) -> list[tuple[int, bool]]:
        """(row, alive) of every row claimed."""
        return [(r, self._held(r)) for r in np.flatnonzero(self._table[:, _PID]).tolist()]

    def _held(self, row: int) -> bool:
        """Whether a live process holds row `row`'s lock."""
        if row == self._row and self._row_pid == os.getpid():
            return True
        path = self._lock_path(row)
        return lock_is_held(path, lambda what: self._foreign(path, what))

    def reap(self) -> bool:
        """Free the rows of processes gone (under `locked`), their plans removed; whether one of them had bytes
        reserved: it may have left records half written, or let go and not punched, which nothing counts now
        (the cache then frees them: `RecordSlots.reclaim`)."""
        left, self._left_behind = self._left_behind, False
        for row, alive in self._rows():
            if not alive:
                left |= bool(self._table[row, _RESERVED])
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._plan_path(row))
                self._table[row, _PID] = self._table[row, _RESERVED] = self._table[row, _NEED] = 0
        return left

    def mine(self) -> int:
        """This process's row, claimed now if it has none (under `locked`): a free row, or one whose process is
        gone (its plan file removed)."""
        if self._row is not None and self._row_pid == os.getpid():
            return self._row
        self._refuse_older_dsc()
        for row in range(ROWS):
            try:
                fd = hold_lock(self._lock_path(row))
            except OSError as e:
                raise self._foreign(self._lock_path(row), f"cannot be locked ({e.strerror or e})") from e
            if fd is not None:  # else another live process's row
                break
        else:
            raise DatasetError(f"{self.folder.parent}: {ROWS} processes of this node share this dataset's cache "
                               "already; no more can join it (give the others' DataLoaders fewer workers, or this "
                               "process another cache_dir)")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._plan_path(row))  # a process gone left it (ours: created by `follow`, in our folder)
        if self._table[row, _PID] and self._table[row, _RESERVED]:  # gone with bytes reserved, not reaped yet
            self._left_behind = True
        self._table[row] = (os.getpid(), self._table[row, _CLAIMS] + 1, 0, -1, 0)
        self._row, self._row_pid, self._plan, self._row_lock = row, os.getpid(), None, fd
        return row

    def _refuse_older_dsc(self) -> None:
        """Refuse to share the folder with a live process of an earlier version (module docstring), which counts
        live rows by pid in `table.bin`, a table this one neither reads nor writes; once none is alive, its files
        go (under its lock)."""
        old = self.folder / _OLD_TABLE
        try:
            values = np.frombuffer(read_no_follow(old, TABLE_BYTES), dtype=np.int64)
        except OSError:  # none (or not a file: left alone)
            return
        rows = values[:len(values) // len(_COLUMNS) * len(_COLUMNS)].reshape(-1, len(_COLUMNS))
        for pid, started in rows[rows[:, 0] > 0][:, :2].tolist():
            if _started(pid) in (started, None):
                raise DatasetError(f"{self.folder.parent}: process {pid}, of an earlier dsc, uses this cache folder "
                                   "and counts what it holds in another way (its fetches would not count in this "
                                   "process's cache_bytes): let it finish, or give this process another cache_dir")
        with locked(self.folder / _OLD_LOCK):
            for name in [_OLD_TABLE] + [n for n in os.listdir(self.folder) if _OLD_PLAN.fullmatch(n)]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.folder / name)

    def leave(self) -> None:
        """Remove this process's plan and free its row (its cache is closed or collected). Without the table's
        lock: a finalizer may run this on any thread, in the middle of anything (a lock held included); the
        plan goes first, while no other process may claim the row and make one of its own there."""
        row, self._row, self._plan = self._row, None, None
        if row is None or self._row_pid != os.getpid():
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._plan_path(row))
        self._table[row, _PID] = 0
        fd, self._row_lock = self._row_lock, -1
        if fd >= 0:
            let_go_lock(fd)

    def after_fork(self) -> None:
        """In a child just forked: the parent's row and plan are the parent's (the child claims its own)."""
        self._row, self._plan, self._theirs, self._nearest = None, None, {}, None  # (read again when asked)
        self._counting = threading.Lock()
        self._row_lock = -1  # the parent's hold: the child's copy was closed at the fork (`local.hold_lock`)

    # --------------------------------------------------------------------- reserved bytes and needs

    def reserve(self, nbytes: int) -> None:
        """Count `nbytes` more in this process's reservations (under `locked`, after making room for them)."""
        row = self.mine()
        with self._counting:
            self._table[row, _RESERVED] += nbytes

    def release(self, nbytes: int) -> None:
        """Count `nbytes` less (their fetch ended: what it placed is counted on disk now)."""
        row = self._row
        if row is not None and self._row_pid == os.getpid():
            with self._counting:
                self._table[row, _RESERVED] -= nbytes

    def reserved(self) -> int:
        """The bytes the node's live processes have reserved."""
        live = self._live()
        return int(self._table[live, _RESERVED].sum()) if len(live) else 0

    def reserved_by_others(self) -> int:
        live = self._live()
        live = live[live != self._row] if self._row is not None else live
        return int(self._table[live, _RESERVED].sum()) if len(live) else 0

    def set_need(self, nbytes: int) -> tuple[int, int]:
        """Say what this process needs to make its batches (its part of the node's minimum); the needs of the
        node's live processes, this one's included, and how many of them need any (under `locked`)."""
        self._table[self.mine(), _NEED] = nbytes
        needs = self._table[self._live(), _NEED]
        return int(needs.sum()), int((needs > 0).sum())

    def processes(self) -> int:
        return len(self._live())

    # --------------------------------------------------------------------- plans

    def has_plan(self) -> bool:
        return self._plan is not None and self._row_pid == os.getpid()

    def make_plan(self) -> None:
        """Make this process's plan file (under `locked`, once its room is made: `overhead` counts it)."""
        path = self._plan_path(self.mine())
        fd = self._open(path, create=True)
        try:
            with cache_writes(path):
                reserve(fd, self.plan_bytes)  # its blocks now: a full disk is ENOSPC here, not SIGBUS in a write
            self._plan = np.frombuffer(mmap.mmap(fd, self.plan_bytes), dtype=NEXT_DTYPE) \
                if self.plan_bytes else np.zeros(0, NEXT_DTYPE)
        finally:
            os.close(fd)
        self._plan[:] = NEVER

    def publish(self, next_use: np.ndarray, units: np.ndarray | None = None) -> None:
        """Publish when this process's plan reads each unit next (`units`: only those changed), as batch numbers
        from the plan's start; NEVER and anything past int32 read as never. Nothing without a plan file."""
        if not self.has_plan():
            return
        values = np.minimum(next_use if units is None else next_use[units], NEVER).astype(NEXT_DTYPE)
        if units is None:
            self._plan[:] = values
        else:
            self._plan[units] = values

    def at_batch(self, batch: int) -> None:
        """This process is making batch `batch` of its plan now."""
        if self._row is not None and self._row_pid == os.getpid():
            self._table[self._row, _NOW] = batch

    def distances(self, units: np.ndarray) -> np.ndarray:
        """How many batches from now another live process with a plan reads each of `units` next: the least over
        them (int64; `never` where none does), as of a moment ago (`refresh`)."""
        if self._nearest is None:
            self.refresh()
        return self._nearest[units]

    def refresh(self) -> None:
        """Read the others' plans again if REFRESH_AFTER times as long as reading them took has passed; called
        outside `locked` (100 ms for 8 plans of 1.28M records: the node's other processes would wait on it)."""
        began = time.monotonic()
        if self._nearest is None or began >= self._nearest_until:
            self._nearest = self._others_nearest()
            self._nearest_until = began + REFRESH_AFTER * (time.monotonic() - began)

    def _others_nearest(self) -> np.ndarray:
        """`distances` of every unit, from the others' plans read now (whole arrays: faster than gathers)."""
        never = np.iinfo(np.int64).max
        best = np.full(self.units, never, dtype=np.int64)
        live = set(self._live().tolist())
        self._theirs = {row: held for row, held in self._theirs.items() if row in live}
        for row in sorted(live):
            if row == self._row or self._table[row, _NOW] < 0:
                continue
            plan = self._their_plan(row)
            if plan is None:
                continue
            ahead = plan.astype(np.int64)
            ahead -= self._table[row, _NOW]
            np.maximum(ahead, 0, out=ahead)
            ahead[plan == NEVER] = never
            np.minimum(best, ahead, out=best)
        return best

    def _their_plan(self, row: int) -> np.ndarray | None:
        """Another process's plan, mapped (again when its file was made anew: another inode)."""
        path = self._plan_path(row)
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        key = (int(self._table[row, _CLAIMS]), st.st_ino)
        held = self._theirs.get(row)
        if held is not None and held[0] == key:
            return held[1]
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.plan_bytes or not self.plan_bytes:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            plan = np.frombuffer(mmap.mmap(fd, self.plan_bytes, prot=mmap.PROT_READ), dtype=NEXT_DTYPE)
        finally:
            os.close(fd)
        self._theirs[row] = (key, plan)
        return plan
