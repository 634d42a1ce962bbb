"""A dataset's shard files as read-only arrays: mapped at open, or, past `MAX_SHARD_MAPS` shards, on first use.

A process may hold only `vm.max_map_count` memory maps (Linux's default: 65,530), and a dataset may have
more shards (400,000 one-record shards): mapping every shard at open made such a dataset impossible to
open. Up to `MAX_SHARD_MAPS` shards are mapped at open, as before, so the hot path is one tuple lookup and
a reader keeps reading a dataset recompiled (`--force`) under it (its maps hold the old files); beyond
that (or past what `ulimit -n` leaves room for: each map holds a descriptor), a shard is mapped when first
read, through a descriptor of the folder held open, and the maps read least recently leave the cache once
it holds that many (`map_bound`). The bound is the process's, not each dataset's: a training set and a
validation set (or DataLoader's datasets in one process) share it, so together they never run a process out
of descriptors mid-epoch; a dataset is mapped whole at open only if its shards fit beside the maps the
datasets already open hold. Such a dataset's shards not yet mapped when a recompile replaces it are
then missing: an error that says so, never another dataset's records.

A map is never unmapped under a reader: leaving the cache drops only the cache's reference, and the
operating system unmaps the file when the last array over it goes, so a gather copying out of a shard
(it holds the array for the whole call, on whichever thread) always finishes. What the cache bounds is the
maps it keeps; a caller that keeps a shard's array keeps that one map too.
"""

from __future__ import annotations

import errno
import itertools
import operator
import os
import resource
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.storage.local import map_file

MAX_SHARD_MAPS = 4096  # shard maps a process keeps (vm.max_map_count's default is 65,530; DataLoader workers
# and other datasets share it)
SPARE_DESCRIPTORS = 64  # descriptors left to the rest of a training process: each map holds one (Python's mmap
# keeps a duplicate of the file's), so under `ulimit -n` N the bound is N - 64


_HELD: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()  # (dataset's token, shard) -> map, of
# every dataset mapped on first use, least recently read first
_WHOLE = [0]  # shard maps held by the datasets mapped whole at open
_LOCK = threading.Lock()
_TOKENS = itertools.count()


def _after_fork() -> None:
    """A child forked (DataLoader's fork workers inherit the datasets) while a thread of the parent held the lock
    has no thread to release it: a fresh one."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _release(token: int, whole: int) -> None:
    """A ShardMaps collected: its maps leave the process's count (each is unmapped once no array holds it)."""
    with _LOCK:
        _WHOLE[0] -= whole
        for key in [key for key in _HELD if key[0] == token]:
            del _HELD[key]


def map_bound() -> int:
    """How many shard maps a process keeps: MAX_SHARD_MAPS, fewer under a small `ulimit -n` (at least 8)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_SHARD_MAPS if soft == resource.RLIM_INFINITY else max(8, min(MAX_SHARD_MAPS, soft - SPARE_DESCRIPTORS))


class ShardMaps(Sequence):
    """`shards[k]`: shard `k`'s records, uint8 [n_k, H, W, 3], read-only (module docstring)."""

    def __init__(self, root: object, manifest: fmt.Manifest, open_file: Callable[[str, str], int],
                 close: Callable[[], None] | None = None, limit: int | None = None) -> None:
        """`open_file(name, where)`: a read-only descriptor of a shard file (the folder's, held open until
        `close` is called: when this is collected, or at once when every shard is mapped at open)."""
        self._root, self._entries, self._shape, self._open = root, manifest.shards, manifest.record_shape, open_file
        self.limit = map_bound() if limit is None else limit
        self._all: tuple[np.ndarray, ...] | None = None
        self._token = next(_TOKENS)
        with _LOCK:
            whole = len(self._entries) <= self.limit - _WHOLE[0] - len(_HELD) or close is None
            _WHOLE[0] += len(self._entries) if whole else 0
        weakref.finalize(self, _release, self._token, len(self._entries) if whole else 0)
        if whole:
            try:
                self._all = tuple(self._map(k) for k in range(len(self._entries)))
            finally:
                if close is not None:
                    close()
        else:
            weakref.finalize(self, close)

    @property
    def lazy(self) -> bool:
        """Whether shards are mapped on first use (more of them than `limit` leaves room for beside the maps held)."""
        return self._all is None

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, k: int) -> np.ndarray:  # type: ignore[override]
        if self._all is not None:
            return self._all[k]
        k = operator.index(k)
        n = len(self._entries)
        if not -n <= k < n:
            raise IndexError(f"shard {k} of {n}")
        k %= n
        key = (self._token, k)
        with _LOCK:
            found = _HELD.get(key)
            if found is not None:
                _HELD.move_to_end(key)
                return found
        mapped = self._map(k)  # outside the lock: a few system calls, which other threads need not wait for
        with _LOCK:
            mapped = _HELD.setdefault(key, mapped)  # another thread may have mapped it meanwhile: keep one
            _HELD.move_to_end(key)
            while len(_HELD) > 1 and len(_HELD) + _WHOLE[0] > self.limit:  # the shard just read stays
                _HELD.popitem(last=False)  # unmapped once no gather holds it (module docstring)
        return mapped

    def _map(self, k: int) -> np.ndarray:
        entry = self._entries[k]
        try:
            fd = self._open(entry.file, "shard")
        except DatasetError as e:
            held = isinstance(e.__cause__, OSError) and e.__cause__.errno in (errno.EMFILE, errno.ENFILE)
            if self.lazy and not held:  # mapped after the open: say why it may fail
                raise DatasetError(f"{e}; this dataset's shards are mapped when first read, so a change to its "
                                   "folder since it was opened (replaced, deleted?) shows here: Open it again") from e
            raise
        if (size := os.fstat(fd).st_size) != entry.bytes:  # checked at open; mapped maybe hours later
            os.close(fd)
            raise DatasetError(f"{str(self._root).rstrip('/')}/{entry.file}: {size} bytes, the manifest says "
                               f"{entry.bytes}: the dataset changed after it was opened (open it again)")
        return map_file(fd, fmt.RECORD_DTYPE, (entry.records, *self._shape)).view(np.ndarray)
