"""The record cache's files for a dataset with per-record checksums (format 1.3+): one sparse file per shard,
shared by the processes of a node, read through memory maps.

Why not a file per record (what this replaced): creating, writing and renaming a file per record cost the
client 0.5-0.8 s of CPU per 300 MB epoch (plain GETs: 0.1 s), and reading one back was open + fstat + pread +
close (~17 µs a record, twice a memory-map gather). Here a shard's records live in `slots/SSSSS.bin`, a file of
the shard's size created once (`ftruncate`, so sparse), each record at its own offset in the shard: a run
is fetched in GETs of `PIECE_BYTES`, each written with one `pwrite` once its records' CRC-32s are checked;
a batch is gathered straight out of a memory map of these files (kept mapped for the life of the process) by
the local reader's own gather (`dsc.reader.gather`, the same layout as a shard). Evicting a record punches its
bytes out of the file (`fallocate(PUNCH_HOLE)`), which gives the disk blocks back at once; a file system that
cannot punch holes is refused at open, naming the folder.

Which records are there: `slots/state.bin`, one uint32 word per record, memory-mapped by every process of
the node. Its low bit says the record's bytes are in place and were checked; the rest counts the times it
was let go (a generation). Writers and evictors of a record hold the `flock` of its chunk (`GET_BYTES` of
the shard, `slots/.SSSSS.C.lock`): a writer checks the word, fetches, writes, then sets the bit; an
evictor bumps the word (bit cleared, generation + 1), then punches. Readers take no lock (a seqlock): they
read the words of a batch, copy the records whose bit is set, and read the words again; a record whose word
changed meanwhile may have been punched while it was copied (zeros), and is read again, its bytes never
served. (An evictor's store comes before its punch, and the punch unmaps the range from every process that
maps it, which interrupts a reader's CPU: a reader that copied zeros then sees the new word.)

A process checks a record's CRC-32 the first time it reads it under a given word (one it wrote itself it
checked before writing): a record damaged in place is then fetched again; still wrong, an error names the
object and the record. A writer killed mid-write leaves the bit clear: nothing counts as present, and the
next open punches the blocks of records that are not present (`reclaim`). There are no temporary files.

The budget counts the disk a record can pin: the most file-system blocks its bytes can touch at their
offsets (`record_cost`; 224x224x3 records: 38 blocks of 4 KiB for 36.75 of bytes), so what the slot files
take on disk (`st_blocks`) stays within it whichever neighbours are held. Letting a record go punches its
bytes, widened to the whole blocks it shares with neighbours of its chunk that are not held either.
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.reader.gather import fill_parallel
from dsc.storage.local import (
    TEMP_SUFFIX,
    cache_writes,
    locked,
    map_shared,
    open_regular,
    remove_named,
)
from dsc.storage.units import FETCHES, GET_BYTES, fetch_range

SLOT_DIR = "slots"
STATE_FILE = "state.bin"
_SLOT_NAME = re.compile(r"\d{5,}\.bin")  # a shard's slot file (`RecordSlots.path`)
STATE_DTYPE = np.dtype(np.uint32)  # a record's word (native order: node-local): bit 0 present, bits 1.. let go
RETRIES = 8  # copies of a record that changed while it was copied, before it is read as gone
# a run is fetched in GETs of this much: each piece is checked and written while the next ones are in flight on
# the other fetch threads (16 MiB GETs, a lock chunk whole, took 1.5x as long on loopback: fewer, longer answers
# leave the server and the client waiting on each other; benchmarks/s3_read_bench.py)
PIECE_BYTES = 4 << 20
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link, never wait on a FIFO


def state_bytes(count: int) -> int:
    """The size of the state file of a dataset of `count` records (counted in the budget)."""
    return count * STATE_DTYPE.itemsize


def block_size(folder: Path) -> int:
    """The block size of the file system of `folder` (what a punch frees at a time)."""
    return max(os.statvfs(folder).f_bsize, 512)


def record_cost(record_bytes: int, block: int) -> int:
    """The most disk a record of `record_bytes` at its offset in a shard can pin: the blocks its bytes touch
    at the worst offset a record has (offsets are multiples of `record_bytes`)."""
    worst = block - math.gcd(record_bytes, block)  # the largest offset of a record within its first block
    return -(-(record_bytes + worst) // block) * block


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


_fallocate_call = _fallocate()
Placed = Callable[[int, Callable[[], None]], None]  # `fetch_run`'s placed(nbytes, mark)


def punch(fd: int, offset: int, length: int) -> None:
    """Free bytes [offset, offset + length) of a file (they read as zeros), keeping its size."""
    if length <= 0:
        return
    if _fallocate_call is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available on this system")
    if _fallocate_call(fd, _PUNCH, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class RecordSlots:
    """The slot files of one dataset's cache folder (module docstring): the same verbs as
    `dsc.storage.units.UnitFiles` (whose units are whole shards), a unit being one record."""

    kind = "record"
    per_unit = 1
    request_bytes = PIECE_BYTES  # the most bytes one ranged GET of these files asks for

    def __init__(self, manifest: fmt.Manifest, folder: Path, get: Callable[[str, int, int], bytes],
                 at: Callable[[str], str], crcs: np.ndarray, fetched: Callable[[int], None]) -> None:
        self.manifest, self.crcs = manifest, crcs
        self._get, self._at, self._fetched = get, at, fetched
        self.root_name = at("").rstrip("/")
        self.record_bytes, self.per_shard = manifest.record_bytes, manifest.records_per_shard
        self.count = manifest.count
        self.folder = folder / SLOT_DIR
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block = _check_punch(self.folder, self.root_name)
        self.cost = record_cost(self.record_bytes, self.block)
        self.state = self._map_state()
        self._checked = np.zeros(self.count, dtype=STATE_DTYPE)  # the word under which this process checked each
        self._fds: dict[int, int] = {}  # shard -> read-write descriptor of its slot file
        weakref.finalize(self, _close_all, self._fds)  # (a map keeps a descriptor of its own)
        self._maps: list[np.ndarray | None] = [None] * len(manifest.shards)  # shard -> [records, H, W, 3] view

    # --------------------------------------------------------------------- sizes and names

    def of(self, records: np.ndarray) -> np.ndarray:
        return np.asarray(records, dtype=np.int64)

    def size(self, unit: int) -> int:
        """What the budget counts for a record (`record_cost`)."""
        return self.cost

    def sizes(self, units: np.ndarray) -> np.ndarray:
        return np.full(len(units), self.cost, dtype=np.int64)

    def largest(self) -> int:
        return self.cost

    def path(self, unit: int) -> Path:
        """The slot file that holds record `unit`."""
        return self.folder / f"{unit // self.per_shard:05d}.bin"

    def runs(self, units: np.ndarray) -> list[tuple[int, int, int]]:
        """(shard, first record, end record) of each ranged GET of sorted `units`: consecutive records of one
        shard, cut at each lock chunk (`GET_BYTES`)."""
        chunk = self._chunk_records()
        shard, pos = fmt.locate(units, self.per_shard)
        cut = np.flatnonzero((np.diff(units) != 1) | (shard[1:] != shard[:-1])
                             | (pos[1:] // chunk != pos[:-1] // chunk)) + 1
        edges = [0, *cut.tolist(), len(units)]
        return [(int(shard[a]), int(units[a]), int(units[b - 1]) + 1) for a, b in zip(edges[:-1], edges[1:])]

    def _chunk_records(self) -> int:
        return max(1, GET_BYTES // self.record_bytes)

    # --------------------------------------------------------------------- the state

    def _map_state(self) -> np.ndarray:
        """The records' words, shared by the node (a new state: nothing present)."""
        path = self.folder / STATE_FILE
        return np.frombuffer(map_shared(path, state_bytes(self.count), lambda what: self._foreign(path, what)),
                             dtype=STATE_DTYPE)

    def _open(self, path: Path, create: bool = False) -> int:
        return open_regular(path, lambda what: self._foreign(path, what), create)

    def _foreign(self, path: Path, what: str = "not a regular file") -> DatasetError:
        return DatasetError(f"{path}: {what}; the cache of {self.root_name} holds something dsc did not "
                            "put there, and leaves it alone: move it away")

    def present(self, unit: int) -> bool:
        return bool(self.state[unit] & 1)

    def present_mask(self) -> np.ndarray:
        """Which records the node's folder holds now (whoever placed them)."""
        return (self.state & 1).astype(bool)

    def present_of(self, units: np.ndarray) -> np.ndarray:
        """Which of `units` the folder holds now (a batch's: what a warm read asks, without the whole mask)."""
        return (self.state[units] & 1).astype(bool)

    whole = present

    def scan(self) -> tuple[np.ndarray, int]:
        """The records present (an earlier run's, another process's) and their bytes; first, the blocks of
        records not present that a writer or evictor killed midway left allocated are punched (`reclaim`)."""
        self.reclaim()
        found = np.flatnonzero(self.state & 1)
        return found, len(found) * self.cost

    def reclaim(self) -> None:
        """Punch the allocated bytes of records not present in every slot file (each chunk under its lock)."""
        for shard in range(len(self.manifest.shards)):
            if not os.path.lexists(self.path(shard * self.per_shard)):
                continue
            fd = self._fd(shard)
            stale = self._allocated(fd, shard)
            stale = stale[(self.state[stale] & 1) == 0]
            if len(stale):
                self._let_go(shard, stale, bump=False)

    def _allocated(self, fd: int, shard: int) -> np.ndarray:
        """The records of `shard` that have allocated bytes in its slot file (`SEEK_DATA` / `SEEK_HOLE`)."""
        size, first, rb = self.manifest.shards[shard].bytes, shard * self.per_shard, self.record_bytes
        found, at = [], 0
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data past `at`
                    break
                raise
            end = min(size, os.lseek(fd, start, os.SEEK_HOLE))
            found.append(np.arange(start // rb, -(-end // rb), dtype=np.int64))
            at = end
        records = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
        return first + records[records < self.manifest.shards[shard].records]

    # --------------------------------------------------------------------- slot files

    def _fd(self, shard: int) -> int:
        """This process's read-write descriptor of the shard's slot file, which is made (sparse) if missing."""
        fd = self._fds.get(shard)
        if fd is not None:
            return fd
        path, size = self.path(shard * self.per_shard), self.manifest.shards[shard].bytes
        try:
            fd = os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fd, size)
            first = shard * self.per_shard  # what the state says of a file that went (emptied by hand) is not so
            words = self.state[first:first + self.manifest.shards[shard].records]
            words[:] = (words | 1) + 1
        except FileExistsError:
            fd = self._open(path)
            if os.fstat(fd).st_size == 0:  # another process made it and is about to set its size
                os.ftruncate(fd, size)
        if os.fstat(fd).st_size != size:
            os.close(fd)
            raise DatasetError(f"{path}: not the size of {self._at(self.manifest.shards[shard].file)} "
                               f"({size} bytes); the cache holds something dsc did not put there, and leaves it "
                               "alone: move it away")
        self._fds[shard] = fd
        return fd

    def _map(self, shard: int) -> np.ndarray:
        view = self._maps[shard]
        if view is None:
            entry = self.manifest.shards[shard]
            data = mmap.mmap(self._fd(shard), entry.bytes, prot=mmap.PROT_READ)
            view = np.frombuffer(data, dtype=fmt.RECORD_DTYPE).reshape(entry.records, *self.manifest.record_shape)
            self._maps[shard] = view
        return view

    def _lock_path(self, shard: int, pos: int) -> Path:
        return self.folder / f".{shard:05d}.{pos // self._chunk_records()}.lock"

    # --------------------------------------------------------------------- letting go

    def remove_all(self, units: np.ndarray) -> None:
        """Let records go: their words bumped, then their bytes punched, a chunk at a time under its lock."""
        units = np.sort(np.asarray(units, dtype=np.int64))
        shard = units // self.per_shard
        for s in np.unique(shard).tolist():
            self._let_go(s, units[shard == s], bump=True)

    def remove(self, unit: int) -> None:
        self.remove_all(np.array([unit]))

    def let_go_now(self, units: np.ndarray) -> None:
        """Let present records go at once, without their chunks' locks (a fetch may hold one while its GET runs):
        their words bumped, so that no process counts them as held or serves them from then on; their bytes are
        punched later (`punch_absent`). A writer places only records not present, so none is writing these;
        one that places one again meanwhile keeps it (`punch_absent` leaves what is present)."""
        units = np.asarray(units, dtype=np.int64)
        self.state[units] = (self.state[units] | 1) + 1

    def punch_absent(self, units: np.ndarray) -> None:
        """Punch the bytes of those of `units` that are not present, a chunk at a time under its lock."""
        units = np.sort(np.asarray(units, dtype=np.int64))
        shard = units // self.per_shard
        for s in np.unique(shard).tolist():
            self._let_go(s, units[shard == s], bump=False)

    def _let_go(self, shard: int, records: np.ndarray, bump: bool) -> None:
        fd, first = self._fd(shard), shard * self.per_shard
        chunk = (records - first) // self._chunk_records()
        for c in np.unique(chunk).tolist():
            mine = records[chunk == c]
            with locked(self._lock_path(shard, int(mine[0] - first))):
                if bump:
                    self.state[mine] = (self.state[mine] | 1) + 1  # readers see the change before the punch
                else:
                    mine = mine[(self.state[mine] & 1) == 0]  # a writer may have placed one meanwhile
                for a, b in self._holes(shard, mine, int(c)):
                    punch(fd, a, b - a)

    def _holes(self, shard: int, records: np.ndarray, chunk: int) -> list[tuple[int, int]]:
        """The byte ranges of the slot file to punch for `records` (not present, of one chunk): each record's
        bytes, widened to the whole blocks it shares with neighbours of its own chunk that are not present
        either (a neighbour in another chunk may be written at this moment, under that chunk's lock)."""
        rb, blk, first = self.record_bytes, self.block, shard * self.per_shard
        n = self.manifest.shards[shard].records
        lo_pos, hi_pos = chunk * self._chunk_records(), min(n, (chunk + 1) * self._chunk_records())
        absent = (self.state[first + lo_pos:first + hi_pos] & 1) == 0

        def clear(a: int, b: int) -> bool:  # records [a, b) of the shard (none past its end): in this chunk, absent
            b = min(b, n)
            return lo_pos <= a and b <= hi_pos and bool(absent[a - lo_pos:b - lo_pos].all())

        ranges = []
        for pos in (records - first).tolist():
            start, end = pos * rb, (pos + 1) * rb
            down = start // blk * blk
            if down < start and clear(down // rb, pos):
                start = down
            up = -(-end // blk) * blk  # past the file's end too: a block the file ends in is freed whole
            if up > end and clear(pos + 1, -(-up // rb)):
                end = up
            if ranges and ranges[-1][1] >= start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    # --------------------------------------------------------------------- fetching and checking

    def fetch_run(self, shard: int, first: int, last: int, placed: Placed | None = None) -> None:
        """Fetch records [first, last) of one shard under the lock of their chunk, skipping those another
        process placed meanwhile: one ranged GET, each record checked, written in place, then marked.
        `placed(nbytes, mark)`: marks records written (`mark()`), the budget's bytes of them said with it (and
        of those found placed, with nothing to mark)."""
        with locked(self._lock_path(shard, first - shard * self.per_shard)):
            wanted = np.flatnonzero((self.state[first:last] & 1) == 0) + first
            if placed is not None and len(wanted) < last - first:
                placed((last - first - len(wanted)) * self.cost, _nothing)
            if len(wanted):
                self._fetch_records(shard, int(wanted[0]), int(wanted[-1]) + 1,
                                    wanted if len(wanted) < int(wanted[-1]) + 1 - int(wanted[0]) else None, placed)

    def _fetch_records(self, shard: int, first: int, last: int, only: np.ndarray | None,
                       placed: Placed | None = None) -> None:
        """Records [first, last) of `shard` (`only`: of those, the ones to place) in ranged GETs of
        `PIECE_BYTES`, each piece checked, written and marked before the next is asked for (`_fetch_piece`)."""
        step = max(1, PIECE_BYTES // self.record_bytes)
        wanted = np.arange(first, last) if only is None else np.asarray(only, dtype=np.int64)
        for start in range(first, last, step):
            units = wanted[(wanted >= start) & (wanted < start + step)]
            if len(units):
                lo, hi = int(units[0]), int(units[-1]) + 1
                self._fetch_piece(shard, lo, hi, units if len(units) < hi - lo else None, placed)

    def _fetch_piece(self, shard: int, first: int, last: int, only: np.ndarray | None,
                     placed: Placed | None = None) -> None:
        """One ranged GET of records [first, last) of `shard` (`only`: of those, the ones to place); each
        checked against its CRC-32 (fetched again once when wrong), written, then marked present."""
        name, rb, fd = self.manifest.shards[shard].file, self.record_bytes, self._fd(shard)
        offset = (first - shard * self.per_shard) * rb
        data = self._ranged(name, offset, offset + (last - first) * rb)
        units = np.arange(first, last) if only is None else only
        wrong = [int(u) for u in units.tolist()
                 if fmt.record_crc(data[(u - first) * rb:(u - first + 1) * rb]) != int(self.crcs[u])]
        if only is None and not wrong:
            self._write(fd, data, offset, first)  # the whole run in one write
        else:
            for u in units.tolist():
                piece = data[(u - first) * rb:(u - first + 1) * rb] if u not in wrong else self._refetch(u)
                self._write(fd, piece, offset + (u - first) * rb, u)

        def mark() -> None:
            self.state[units] |= 1
            self._checked[units] = self.state[units]
        if placed is None:
            mark()
        else:
            placed(len(units) * self.cost, mark)

    def _write(self, fd: int, data, offset: int, unit: int) -> None:
        """`data` into a slot file at `offset`; a full or read-only disk said in one line (the records written
        are not marked yet: nothing counts as there)."""
        with cache_writes(self.path(unit), self.root_name):
            _write(fd, data, offset)

    def _refetch(self, unit: int) -> memoryview:
        """Record `unit` fetched again on its own; still not matching its CRC-32: an error naming it."""
        shard, pos = fmt.locate(unit, self.per_shard)
        name, rb = self.manifest.shards[shard].file, self.record_bytes
        piece = self._ranged(name, pos * rb, (pos + 1) * rb)
        found = fmt.record_crc(piece)
        if found != int(self.crcs[unit]):
            raise DatasetError(f"{self._at(name)}: record {unit} (bytes {pos * rb}-{(pos + 1) * rb - 1} of the object) "
                               f"has CRC-32 {found:08x}, but {fmt.CHECKSUMS_FILE} says {int(self.crcs[unit]):08x}; "
                               f"fetched {FETCHES} times, wrong each time: the object in the bucket is damaged")
        return piece

    def _ranged(self, name: str, start: int, stop: int) -> memoryview:
        return fetch_range(self._get, self._at, self._fetched, name, start, stop)

    # --------------------------------------------------------------------- reading

    def gather(self, dst: np.ndarray, idx: np.ndarray, pool: Executor | None, threads: int) -> list[int]:
        """Records `idx` into `dst[:len(idx)]` out of the maps, checked; the rows not served (their record
        not present, changed while it was copied, or damaged), for `read` one by one."""
        words = self.state[idx]
        if not np.all(words & 1):
            return list(range(len(idx)))
        shards = np.unique(idx // self.per_shard).tolist()
        maps: list[np.ndarray | None] = [None] * len(self._maps)
        for s in shards:
            maps[s] = self._map(s)
        fill_parallel(dst, maps, idx, self.per_shard, pool, threads)
        bad = (self.state[idx] != words)
        unchecked = np.flatnonzero(~bad & (self._checked[idx] != words))
        for row in unchecked.tolist():
            if fmt.record_crc(dst[row]) != int(self.crcs[idx[row]]):
                bad[row] = True
        good = unchecked[~bad[unchecked]]
        self._checked[idx[good]] = words[good]
        return np.flatnonzero(bad).tolist()

    def read(self, row: np.ndarray, record: int) -> str | None:
        """Record `record` into `row`, checked: None, or what was wrong ("gone": not present, or let go each
        time it was copied; a checksum)."""
        shard, pos = fmt.locate(record, self.per_shard)
        view = self._map(shard)
        for _ in range(RETRIES):
            word = int(self.state[record])
            if not word & 1:
                return "gone"
            row[...] = view[pos]
            if int(self.state[record]) == word:
                break
        else:
            return "gone"
        if self._checked[record] != word:
            found, want = fmt.record_crc(row), int(self.crcs[record])
            if found != want:
                return f"CRC-32 {found:08x}, {fmt.CHECKSUMS_FILE} says {want:08x}"
            self._checked[record] = word
        return None



def retire(folder_fd: int) -> int:
    """Delete the slot files of a dataset's cache folder (open as `folder_fd`) that no process uses
    (`cache.retire_version`), the state first: whatever a stop midway leaves, no record counts as there. The
    disk blocks freed."""
    return remove_named(folder_fd, SLOT_DIR, lambda name: name == STATE_FILE or bool(_SLOT_NAME.fullmatch(name)),
                        first=STATE_FILE)


def _nothing() -> None:
    pass


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


def _write(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while len(view):
        wrote = os.pwrite(fd, view, offset)
        view, offset = view[wrote:], offset + wrote


def _check_punch(folder: Path, name: str) -> int:
    """The file system's block size, once it has shown it can punch holes (a probe file of dsc's, removed)."""
    probe = folder / f".punch-probe.{secrets.token_hex(8)}{TEMP_SUFFIX}"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        block = block_size(folder)
        _write(fd, b"\1" * (2 * block), 0)
        try:
            punch(fd, 0, block)
        except OSError as e:
            raise DatasetError(f"{folder}: the file system of the cache of {name} cannot punch holes in a file "
                               f"(fallocate PUNCH_HOLE: {e.strerror}); a dataset with per-record checksums is "
                               "cached there: put cache_dir on ext4, xfs, btrfs or tmpfs") from e
        return block
    finally:
        os.close(fd)
        os.unlink(probe)


__all__: Sequence[str] = ["RecordSlots", "punch", "state_bytes", "record_cost", "block_size", "SLOT_DIR", "STATE_FILE"]
