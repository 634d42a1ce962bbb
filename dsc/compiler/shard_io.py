"""Record-level reads and writes on the shard files of a partial build, a few files at a time.

Finishing steps and resume touch every shard, and a build may have tens of thousands of them
(`--records-per-shard 10`): mapping them all at once needs one descriptor each and fails
under `ulimit -n 1024`. `ShardFiles` keeps at most MAX_OPEN shards open (the two a move reads
from and writes to), closing the least recently used one when it needs another.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

from dsc import format as fmt

MAX_OPEN = 2  # the source and the destination shard of a move
PIECE_BYTES = 8 << 20  # a move copies this much at a time


class ShardFiles:
    """The shard files under `stage`, addressed by record position (`fmt.record_offset`)."""

    def __init__(self, stage: Path, records_per_shard: int, record_bytes: int) -> None:
        self.stage, self.per_shard, self.record_bytes = stage, records_per_shard, record_bytes
        self._open: OrderedDict[int, int] = OrderedDict()
        self._written: set[int] = set()

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, shard: int) -> int:
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if len(self._open) >= MAX_OPEN:
            os.close(self._open.popitem(last=False)[1])
        self._open[shard] = os.open(self.stage / fmt.shard_file(shard), os.O_RDWR)
        return self._open[shard]

    def read(self, position: int, n: int = 1) -> bytes:
        """Records [position, position + n), which must lie in one shard."""
        shard, offset = fmt.record_offset(position, self.per_shard, self.record_bytes)
        want, data = n * self.record_bytes, b""
        while len(data) < want:
            piece = os.pread(self._fd(shard), want - len(data), offset + len(data))
            if not piece:
                raise OSError(f"{self.stage / fmt.shard_file(shard)}: ends before record {position + n - 1}")
            data += piece
        return data

    def write(self, position: int, data: bytes) -> None:
        shard, offset = fmt.record_offset(position, self.per_shard, self.record_bytes)
        self._written.add(shard)
        view = memoryview(data)
        while view:
            written = os.pwrite(self._fd(shard), view, offset)
            view, offset = view[written:], offset + written

    def crc(self, position: int) -> int:
        """CRC-32 of one record, as the journal records it."""
        return fmt.record_crc(self.read(position))

    def move(self, src: int, dst: int, n: int) -> None:
        """Copy records [src, src + n) to [dst, dst + n) across shard boundaries, front to back:
        right whenever dst <= src or the two ranges do not overlap."""
        piece = max(1, PIECE_BYTES // self.record_bytes)
        done = 0
        while done < n:
            (_, so), (_, do) = fmt.locate(src + done, self.per_shard), fmt.locate(dst + done, self.per_shard)
            k = min(n - done, piece, self.per_shard - so, self.per_shard - do)
            self.write(dst + done, self.read(src + done, k))
            done += k

    def sync(self) -> None:
        """Make every write so far durable (before a state file that relies on them changes)."""
        for shard in sorted(self._written):
            os.fsync(self._fd(shard))
        self._written.clear()

    def close(self) -> None:
        while self._open:
            os.close(self._open.popitem()[1])
