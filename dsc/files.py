"""Reading a file a user names (a source image, a label table) without trusting what it is.

A FIFO is opened without waiting for a writer (O_NONBLOCK) and refused, as is a device (a link
to /dev/zero would be read for ever); only the bytes `fstat` gave are read, and a file that grows
while read (or claims a size it does not hold, as /proc files do) or shrinks is refused rather
than read without end or cut short.
"""

from __future__ import annotations

import os
import stat


class RefusedFile(Exception):
    """Not read: not a regular file, or it changed while read; the message says which."""


class TooLarge(RefusedFile):
    """Not read: larger than the caller's limit (`size` bytes)."""

    def __init__(self, size: int) -> None:
        super().__init__(f"file is {size} bytes")
        self.size = size


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file `path` (links followed), at most `limit` of them; RefusedFile
    (TooLarge) otherwise; OSError as `open` raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefusedFile(f"not a regular file ({_kind(st.st_mode)}); not read")
        if st.st_size > limit:
            raise TooLarge(st.st_size)
        data, got = bytearray(st.st_size), 0
        while got < st.st_size:
            n = os.readv(fd, [memoryview(data)[got:]])
            if n == 0:
                raise RefusedFile(f"file shrank while read (stat said {st.st_size} bytes, it ended at {got})")
            got += n
        if os.read(fd, 1):
            raise RefusedFile(f"file grew while read (stat said {st.st_size} bytes); not read")
        return bytes(data)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    kinds = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a folder"}
    return next((name for test, name in kinds.items() if test(mode)), "not a plain file")
