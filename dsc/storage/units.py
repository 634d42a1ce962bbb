"""The files of the record cache (`dsc.storage.cache`) for a dataset without per-record checksums (format
1.0-1.2): what one unit is, where it lives, how it is fetched, checked, placed and read back.

A unit is what can be checked on its own: here a whole shard (checked by its SHA-256; a dataset with
per-record checksums caches records, `dsc.storage.slots`). Each is one file of the dataset's cache folder,
the shard file itself, `shards/SSSSS.bin`, fetched in ranged GETs of `GET_BYTES` under a lock file per
shard so that processes of one node fetch it once, checked, written to a temporary name and renamed into
place; a temporary that a writer killed midway left is removed by the next writer of that shard (it holds
the lock, so no writer of that shard is alive). Something else than a regular file at a unit's name is
refused and left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.storage.local import (
    TEMP_SUFFIX,
    cache_writes,
    create_exclusive,
    locked,
    remove_named,
    sha256_fd,
)

GET_BYTES = 16 << 20  # a shard is fetched in ranged GETs of at most this much
FETCHES = 2  # fetches of a unit whose bytes are wrong, before it is an error
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link, never wait on a FIFO
_UNIT_NAME = re.compile(r"shards/(\d{5,})\.bin")
_TEMP_NAME = re.compile(rf"\.(\d{{5,}})\.bin\.[0-9a-f]{{16}}{re.escape(TEMP_SUFFIX)}")  # `_place`'s temporaries


def retire(folder_fd: int) -> int:
    """Delete the shards a dataset's cache folder (open as `folder_fd`) holds whole, and temporaries of them,
    when no process uses it (`cache.retire_version`); the disk blocks freed."""
    return remove_named(folder_fd, fmt.SHARD_DIR, lambda name: bool(
        _UNIT_NAME.fullmatch(f"{fmt.SHARD_DIR}/{name}") or _TEMP_NAME.fullmatch(name)))


def fetch_range(get: Callable[[str, int, int], bytes], at: Callable[[str], str], fetched: Callable[[int], None],
                name: str, start: int, stop: int) -> memoryview:
    """Bytes [start, stop) of a dataset file, in GETs of at most `GET_BYTES`, all of them or an error naming it."""
    parts = []
    for begin in range(start, stop, GET_BYTES):
        end = min(stop, begin + GET_BYTES)
        data = get(name, begin, end)
        if len(data) != end - begin:
            raise DatasetError(f"{at(name)}: asked for bytes {begin}-{end - 1}, got {len(data)} bytes; the "
                               "object is shorter than the manifest says")
        fetched(len(data))
        parts.append(data)
    return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))


class UnitFiles:
    """The unit files (whole shards) of one dataset's cache folder. `get(name, start, stop)` fetches bytes of
    a dataset file (with retries), `at(name)` names its object, `fetched(nbytes)` is told of every GET answered."""

    kind = "shard"
    request_bytes = GET_BYTES  # the most bytes one ranged GET of these files asks for
    crcs = None

    def __init__(self, manifest: fmt.Manifest, folder: Path, get: Callable[[str, int, int], bytes],
                 at: Callable[[str], str], fetched: Callable[[int], None]) -> None:
        self.manifest, self.folder = manifest, folder
        self._get, self._at, self._fetched = get, at, fetched
        self.root_name = at("").rstrip("/")  # the dataset's URL, for messages
        self.record_bytes, self.per_shard = manifest.record_bytes, manifest.records_per_shard
        self.per_unit = self.per_shard
        self.count = len(manifest.shards)
        # the file (inode, mtime) each unit was last checked in: unchanged since, it is not checked again
        self._checked_ino = np.zeros(self.count, dtype=np.int64)
        self._checked_mtime = np.zeros(self.count, dtype=np.int64)
        self._root = os.fspath(folder)  # paths as strings: a Path per record read costs more than the read

    # --------------------------------------------------------------------- sizes and names

    def of(self, records: np.ndarray) -> np.ndarray:
        """The unit of each record."""
        return np.asarray(records, dtype=np.int64) // self.per_unit

    def size(self, unit: int) -> int:
        return self.manifest.shards[unit].bytes

    def sizes(self, units: np.ndarray) -> np.ndarray:
        return np.array([self.manifest.shards[int(u)].bytes for u in units], dtype=np.int64)

    def largest(self) -> int:
        return max(s.bytes for s in self.manifest.shards)

    def path(self, unit: int) -> Path:
        return Path(self._where(unit))

    def _where(self, unit: int) -> str:
        return f"{self._root}/{fmt.shard_file(unit)}"

    def scan(self) -> tuple[np.ndarray, int]:
        """The units already in the folder (an earlier run's, another process's) and their bytes."""
        found = {}
        for path in (self.folder / fmt.SHARD_DIR).glob("*.bin"):
            unit = self._unit_at(path)
            if unit is None:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == self.size(unit):
                found[unit] = st.st_size
        return np.array(sorted(found), dtype=np.int64), sum(found.values())

    def present_mask(self) -> np.ndarray:
        """Which shards the node's folder holds now, whole (whoever placed them)."""
        mask = np.zeros(self.count, dtype=bool)
        mask[self.scan()[0]] = True
        return mask

    def present_of(self, units: np.ndarray) -> np.ndarray:
        """Which of `units` the folder holds now, whole."""
        return np.array([self.whole(int(u)) for u in units], dtype=bool)

    def _unit_at(self, path: Path) -> int | None:
        """The unit whose name `path` has in this dataset's layout, or None (not ours)."""
        match = _UNIT_NAME.fullmatch(path.relative_to(self.folder).as_posix())
        if match is None:
            return None
        shard = int(match.group(1))
        return shard if shard < self.count and self.path(shard) == path else None

    def runs(self, units: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, first unit, end unit) of each fetch of sorted `units`: a shard unit is one run of its own."""
        return [(int(u), int(u), int(u) + 1) for u in units]

    # --------------------------------------------------------------------- on disk

    def present(self, unit: int) -> bool:
        """Whether the unit's file is there whole; something else than a regular file at its name is refused."""
        path = self.path(unit)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            raise self._foreign(path)
        return st.st_size == self.size(unit)

    def whole(self, unit: int) -> bool:
        """`present`, where something else than a regular file at the unit's name counts as absent."""
        try:
            return self.present(unit)
        except DatasetError:
            return False

    def remove_all(self, units: np.ndarray) -> None:
        for unit in np.asarray(units).tolist():
            self.remove(unit)

    def remove(self, unit: int) -> None:
        """Delete a unit's file: a regular file at a unit's name (a link there is left alone)."""
        path = self.path(unit)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass  # another process of the node let it go already
        self._checked_ino[unit] = 0

    def _foreign(self, path: Path) -> DatasetError:
        return DatasetError(f"{path}: not a regular file; the cache of {self.root_name} holds something dsc did not "
                            "put there, and leaves it alone: move it away")

    # --------------------------------------------------------------------- fetching and checking

    def fetch_run(self, shard: int, first: int, last: int,
                  placed: Callable[[int, Callable[[], None]], None] | None = None) -> None:
        """Fetch shard `shard` under its lock, unless another process placed it meanwhile; checked, placed by
        rename (temporaries a killed writer of this shard left are removed first). `placed(nbytes, mark)`: told
        of its bytes once it is in place (nothing left to mark)."""
        lock_path = self.folder / fmt.SHARD_DIR / f".{shard:05d}.bin.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(lock_path):
            self._remove_stale_temporaries(shard)
            if not self.present(shard):
                self._fetch_whole(shard)
            if placed is not None:
                placed(self.size(shard), lambda: None)

    def reclaim(self) -> None:
        """Remove the temporaries writers that are gone left (each shard's under its lock: none of its writers is
        alive then); a process of the node found dead had reserved bytes (`NodeLedger.reap`)."""
        found = {int(m.group(1)) for m in map(_TEMP_NAME.fullmatch, os.listdir(self.folder / fmt.SHARD_DIR)
                                                if (self.folder / fmt.SHARD_DIR).is_dir() else []) if m}
        for shard in sorted(s for s in found if s < self.count):
            with locked(self.folder / fmt.SHARD_DIR / f".{shard:05d}.bin.lock"):
                self._remove_stale_temporaries(shard)

    def _remove_stale_temporaries(self, shard: int) -> None:
        """The temporaries of this shard's unit (`_place`'s names): their writer held this lock and is gone."""
        pattern = re.compile(rf"\.{shard:05d}\.bin\.[0-9a-f]{{16}}{re.escape(TEMP_SUFFIX)}")
        for temp in (self.folder / fmt.SHARD_DIR).glob(f".{shard:05d}.bin.*{TEMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                if pattern.fullmatch(temp.name) and stat.S_ISREG(os.lstat(temp).st_mode):
                    os.unlink(temp)

    def _fetch_whole(self, shard: int) -> None:
        """A whole shard, in ranged GETs of `GET_BYTES`, checked against its SHA-256 (fetched again once), put
        in place (a rename over what is there)."""
        entry, problems = self.manifest.shards[shard], []
        for _ in range(FETCHES):
            data = self._ranged(entry.file, 0, entry.bytes)
            digest = hashlib.sha256(data).hexdigest()
            if digest == entry.sha256:
                with cache_writes(self.path(shard), self.root_name):
                    placed = self._place(self.path(shard), data)
                self._placed(shard, placed)
                return
            problems.append(f"SHA-256 {digest}, the manifest says {entry.sha256}")
        raise DatasetError(f"{self._at(entry.file)}: fetched {FETCHES} times, wrong each time ({'; '.join(problems)}); "
                           "the object in the bucket is damaged")

    def _ranged(self, name: str, start: int, stop: int) -> memoryview:
        return fetch_range(self._get, self._at, self._fetched, name, start, stop)

    def _place(self, path: Path, data) -> os.stat_result:
        """Write `data` to a new temporary name beside `path`, then rename it into place; the file's status."""
        temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        try:
            fd = create_exclusive(temp)
        except FileNotFoundError:  # its folder went (the cache folder emptied by hand): made again
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = create_exclusive(temp)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                st = os.fstat(f.fileno())
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)  # ours (created exclusively above), not renamed into place
            raise
        return st

    def _placed(self, unit: int, st: os.stat_result) -> None:
        """A unit this process checked before placing it needs no check when it reads the same file back."""
        self._checked_ino[unit], self._checked_mtime[unit] = st.st_ino, st.st_mtime_ns

    # --------------------------------------------------------------------- reading

    def read(self, row: np.ndarray, record: int) -> str | None:
        """Record `record` from its shard's file into `row`, checked: None, or what was wrong ("gone", a
        checksum); something else than a regular file at the shard's name is refused. A shard is checked the
        first time this process reads its file, and again whenever the file changed since (another inode: a
        copy renamed over it; another mtime: written in place); a copy this process placed was checked before it
        was placed, and is not checked again while its file is the same (`_placed`)."""
        unit = record // self.per_unit
        path = self._where(unit)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            return "gone"
        except OSError as e:  # a link (ELOOP) or worse at a unit's name
            raise self._foreign(Path(path)) from e
        view = memoryview(row).cast("B")
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._foreign(Path(path))
            checked = self._checked_ino[unit] == st.st_ino and self._checked_mtime[unit] == st.st_mtime_ns
            if not checked:
                problem = self._check_shard(fd, unit)
                if problem is not None:
                    return problem
            got = os.preadv(fd, [view], (record - unit * self.per_unit) * self.record_bytes)
        finally:
            os.close(fd)
        if got != self.record_bytes:
            return f"{got} bytes where the record has {self.record_bytes}"
        self._checked_ino[unit], self._checked_mtime[unit] = st.st_ino, st.st_mtime_ns
        return None

    def _check_shard(self, fd: int, unit: int) -> str | None:
        """A shard unit's SHA-256 (`read` remembers the file it checked)."""
        digest = sha256_fd(os.dup(fd))
        if digest != self.manifest.shards[unit].sha256:
            return f"SHA-256 {digest}, the manifest says {self.manifest.shards[unit].sha256}"
        return None
