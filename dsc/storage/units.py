"""The files of the record cache (`dsc.storage.cache`): what one unit is, where it lives, how it is fetched,
checked, placed and read back.

A unit is what can be checked on its own: a record where the dataset has per-record checksums (format
1.3, `checksums.bin`), else a whole shard (checked by its SHA-256). Each is one file of the dataset's
cache folder: `records/SSSSS/P.bin` for record P of shard S (the cache's own layout, not the format's),
or the shard file itself, `shards/SSSSS.bin`. A run of neighbouring units of one shard is fetched with
one ranged GET (`GET_BYTES` at most, never across a lock chunk), under a lock file per chunk of the
shard so that processes of one node fetch it once, each unit checked, written to a temporary name and
renamed into place. Something else than a regular file at a unit's name is refused and left alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.storage.local import TEMP_SUFFIX, create_exclusive, locked, sha256_fd

RECORD_DIR = "records"
GET_BYTES = 16 << 20  # a coalesced ranged GET covers at most this much (a lock chunk of a shard)
FETCHES = 2  # fetches of a unit whose bytes are wrong, before it is an error
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link, never wait on a FIFO
_UNIT_NAME = re.compile(r"(?:records/(\d{5,})/(\d+)\.bin|shards/(\d{5,})\.bin)")


class UnitFiles:
    """The unit files of one dataset's cache folder. `get(name, start, stop)` fetches bytes of a dataset
    file (with retries), `at(name)` names its object, `fetched(nbytes)` is told of every GET answered;
    `crcs`: the records' CRC-32s, or None for whole-shard units."""

    def __init__(self, manifest: fmt.Manifest, folder: Path, get: Callable[[str, int, int], bytes],
                 at: Callable[[str], str], crcs: np.ndarray | None, fetched: Callable[[int], None]) -> None:
        self.manifest, self.folder, self.crcs = manifest, folder, crcs
        self._get, self._at, self._fetched = get, at, fetched
        self.root_name = at("").rstrip("/")  # the dataset's URL, for messages
        self.record_bytes, self.per_shard = manifest.record_bytes, manifest.records_per_shard
        self.per_unit = 1 if crcs is not None else self.per_shard
        self.count = manifest.count if crcs is not None else len(manifest.shards)
        # the file (inode, mtime) each unit was last checked in: unchanged since, it is not checked again
        self._checked_ino = np.zeros(self.count, dtype=np.int64)
        self._checked_mtime = np.zeros(self.count, dtype=np.int64)
        self._root = os.fspath(folder)  # paths as strings: a Path per record read costs more than the read
        self._made: set[Path] = set()  # folders of unit files this process made (or found) already

    # --------------------------------------------------------------------- sizes and names

    @property
    def kind(self) -> str:
        return "record" if self.crcs is not None else "shard"

    def of(self, records: np.ndarray) -> np.ndarray:
        """The unit of each record."""
        return np.asarray(records, dtype=np.int64) // self.per_unit

    def size(self, unit: int) -> int:
        return self.record_bytes if self.crcs is not None else self.manifest.shards[unit].bytes

    def sizes(self, units: np.ndarray) -> np.ndarray:
        if self.crcs is not None:
            return np.full(len(units), self.record_bytes, dtype=np.int64)
        return np.array([self.manifest.shards[int(u)].bytes for u in units], dtype=np.int64)

    def largest(self) -> int:
        return self.record_bytes if self.crcs is not None else max(s.bytes for s in self.manifest.shards)

    def path(self, unit: int) -> Path:
        return Path(self._where(unit))

    def _where(self, unit: int) -> str:
        if self.crcs is None:
            return f"{self._root}/{fmt.shard_file(unit)}"
        shard, pos = divmod(unit, self.per_shard)
        return f"{self._root}/{RECORD_DIR}/{shard:05d}/{pos}.bin"

    def scan(self) -> dict[int, int]:
        """The units already in the folder (an earlier run's, another process's) and their sizes."""
        found = {}
        for path in [*(self.folder / RECORD_DIR).glob("*/*.bin"), *(self.folder / fmt.SHARD_DIR).glob("*.bin")]:
            unit = self._unit_at(path)
            if unit is None:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size == self.size(unit):
                found[unit] = st.st_size
        return found

    def _unit_at(self, path: Path) -> int | None:
        """The unit whose name `path` has in this dataset's layout, or None (not ours)."""
        match = _UNIT_NAME.fullmatch(path.relative_to(self.folder).as_posix())
        if match is None or (match.group(3) is None) != (self.crcs is not None):
            return None
        if self.crcs is None:
            shard = int(match.group(3))
            return shard if shard < self.count and self.path(shard) == path else None
        shard, pos = int(match.group(1)), int(match.group(2))
        if shard >= len(self.manifest.shards) or pos >= self.manifest.shards[shard].records:
            return None
        unit = shard * self.per_shard + pos
        return unit if self.path(unit) == path else None

    def runs(self, units: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, first unit, end unit) of each ranged GET of sorted `units`: consecutive units of one shard,
        cut at each lock chunk (`GET_BYTES`); a shard unit is one run of its own."""
        if self.crcs is None:
            return [(int(u), int(u), int(u) + 1) for u in units]
        chunk = max(1, GET_BYTES // self.record_bytes)
        shard, pos = fmt.locate(units, self.per_shard)
        cut = np.flatnonzero((np.diff(units) != 1) | (shard[1:] != shard[:-1])
                             | (pos[1:] // chunk != pos[:-1] // chunk)) + 1
        edges = [0, *cut.tolist(), len(units)]
        return [(int(shard[a]), int(units[a]), int(units[b - 1]) + 1) for a, b in zip(edges[:-1], edges[1:])]

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

    def fetch_run(self, shard: int, first: int, last: int) -> None:
        """Fetch units [first, last) of one shard, under the lock of their chunk, skipping those another
        process placed meanwhile; each checked, placed by rename."""
        lock_path = self._lock_path(shard, first)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with locked(lock_path):
            wanted = [u for u in range(first, last) if not self.present(u)]
            if wanted:
                self.fetch_again(shard, wanted[0], wanted[-1] + 1)

    def fetch_again(self, shard: int, first: int, last: int) -> None:
        """Units [first, last) of `shard` fetched and put in place (a rename over what is there)."""
        if self.crcs is None:
            self._fetch_shard(shard)
        else:
            self._fetch_records(shard, first, last)

    def _lock_path(self, shard: int, unit: int) -> Path:
        if self.crcs is None:
            return self.folder / fmt.SHARD_DIR / f".{shard:05d}.bin.lock"
        chunk = (unit - shard * self.per_shard) // max(1, GET_BYTES // self.record_bytes)
        return self.folder / RECORD_DIR / f"{shard:05d}" / f".{chunk}.lock"

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
            self._placed(unit, self._place(self.path(unit), piece))

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
        entry, problems = self.manifest.shards[shard], []
        for _ in range(FETCHES):
            data = self._ranged(entry.file, 0, entry.bytes)
            digest = hashlib.sha256(data).hexdigest()
            if digest == entry.sha256:
                self._placed(shard, self._place(self.path(shard), data))
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
            self._fetched(len(data))
            parts.append(data)
        return memoryview(parts[0] if len(parts) == 1 else b"".join(parts))

    def _place(self, path: Path, data) -> os.stat_result:
        """Write `data` to a new temporary name beside `path`, then rename it into place; the file's status."""
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
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
        """Record `record` from its unit's file into `row`, checked: None, or what was wrong ("gone", a
        checksum); something else than a regular file at the unit's name is refused. A unit is checked the
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
            if self.crcs is None and not checked:
                problem = self._check_shard(fd, unit)
                if problem is not None:
                    return problem
            got = os.preadv(fd, [view], (record - unit * self.per_unit) * self.record_bytes)
        finally:
            os.close(fd)
        if got != self.record_bytes:
            return f"{got} bytes where the record has {self.record_bytes}"
        if self.crcs is not None and not checked:
            found, want = zlib.crc32(view), int(self.crcs[record])
            if found != want:
                return f"CRC-32 {found:08x}, {fmt.CHECKSUMS_FILE} says {want:08x}"
        self._checked_ino[unit], self._checked_mtime[unit] = st.st_ino, st.st_mtime_ns
        return None

    def _check_shard(self, fd: int, unit: int) -> str | None:
        """A shard unit's SHA-256 (`read` remembers the file it checked)."""
        digest = sha256_fd(os.dup(fd))
        if digest != self.manifest.shards[unit].sha256:
            return f"SHA-256 {digest}, the manifest says {self.manifest.shards[unit].sha256}"
        return None
