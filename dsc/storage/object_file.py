"""One object in an S3-compatible bucket read as a seekable, read-only file: ranged GETs, never the whole.

`ObjectFile` is what an archive source (`dsc.compiler.sources`) reads a tar shard, a zip or a
Parquet file through when SRC is an `s3://` URL: `tarfile`, `zipfile` and pyarrow take it as they
take an open file, and `pread` reads a member at its offset. Its size comes from one HEAD; reads
go through one read-ahead window of at most READ_AHEAD_BYTES (a tar walked header by header, or
members read in stored order, cost one GET per window, not one per member); a read larger than
the window is one GET of exactly its bytes. Memory stays bounded whatever the object's size.

Requests are those of `dsc.storage.s3` (its client, made per process, and its rule of which
failures a retry can fix), tried ATTEMPTS times; that module (and obstore) is imported only once
an s3:// source is read. A missing object reads as FileNotFoundError (the archive is gone: its
samples are skipped, as for a local file); any other failure is a StorageError naming the
object, the tries and the last error. A process forked after this one used the client cannot use
it (obstore's runtime does not survive fork): it says so instead of hanging.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import Any

from dsc.errors import StorageError

READ_AHEAD_BYTES = 8 << 20  # one GET fetches this much ahead of a read: tar headers and members in order
EXACT_READS = 0  # read_ahead for a reader that asks for whole ranges itself (pyarrow): one GET a read
SCHEME = "s3://"


def is_url(text: str) -> bool:
    """Whether a source names an object in a bucket (`s3://...`; a URL's scheme, `S3://` too, is not case
    sensitive) rather than a local path."""
    return text[:len(SCHEME)].lower() == SCHEME


def _s3():
    from dsc.storage import s3  # obstore's module: never imported for local sources

    return s3


def split(url: str) -> tuple[str, str]:
    """(bucket, key) of the object `s3://bucket/key`, the key as it is: a key may hold '#' or '?', which a URL
    parser would cut off as a fragment or a query. One the S3 client cannot take as a path is refused."""
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket or any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"{url}: not an s3://bucket/key URL of an object (a key without empty, '.' or '..' "
                           "parts)")
    return bucket, key


def split_prefix(url: str) -> tuple[str, str]:
    """(bucket, prefix) of a folder's URL `s3://bucket/prefix`, as a dataset's is read (`s3.parse_url`)."""
    return _s3().parse_url(url)


def client_used_here() -> bool:
    """Whether this process runs obstore's runtime (it read a bucket): a child it forks from now on
    could not, so it must start fresh ones (spawn) for work that reads a bucket."""
    s3 = sys.modules.get("dsc.storage.s3")
    return s3 is not None and s3._runtime_pid == os.getpid()


def _request(what: str, url: str, request) -> Any:
    """`request()`, retried as dsc.storage.s3 retries; FileNotFoundError for a missing object."""
    s3 = _s3()
    if s3._forked():
        raise StorageError(f"{url}: this process cannot reach the bucket: it was forked from one that already "
                           "used the S3 client (obstore), whose runtime does not survive fork; compile s3:// "
                           "sources from a fresh process")
    try:
        return s3.retried(what, url, request)
    except FileNotFoundError as e:
        raise FileNotFoundError(errno.ENOENT, "no such object in the bucket", url) from e


def head(url: str) -> tuple[int, str]:
    """(size, a stamp that changes when the object does: its size and ETag) of one object."""
    bucket, key = split(url)
    s3 = _s3()
    meta = _request("HEAD", url, lambda: s3._obstore().head(s3.client(bucket), key))
    return int(meta["size"]), f"{meta['size']}:{meta.get('e_tag') or meta.get('last_modified')}"


def list_prefix(url: str) -> list[tuple[str, int, str]]:
    """(URL, size, stamp) of every object whose key starts with the URL's key, sorted by key."""
    bucket, _, key = url[len(SCHEME):].partition("/")  # the key as given: a partial name narrows it too
    if not bucket:
        raise StorageError(f"{url}: not an s3://bucket/prefix URL")
    folder = key.rpartition("/")[0]  # obstore lists whole path segments: a partial name is filtered here
    s3 = _s3()

    def listed() -> list[dict]:
        pages = s3._obstore().list(s3.client(bucket), prefix=folder or None)
        return [meta for page in pages for meta in page if meta["path"].startswith(key)]

    found = _request("LIST", url, listed)
    return sorted((f"{SCHEME}{bucket}/{m['path']}", int(m["size"]), f"{m['size']}:{m.get('e_tag')}") for m in found)


def list_folder(url: str) -> tuple[list[str], list[str]]:
    """(the URLs of the objects directly in the folder `url` names, the names of its sub-folders), sorted: one
    LIST with a delimiter, however many objects lie deeper."""
    bucket, _, key = url[len(SCHEME):].partition("/")
    if not bucket:
        raise StorageError(f"{url}: not an s3://bucket/prefix URL")
    s3 = _s3()
    found = _request("LIST", url, lambda: s3._obstore().list_with_delimiter(s3.client(bucket),
                                                                            prefix=key.strip("/") or None))
    cut = len(key.strip("/")) + 1 if key.strip("/") else 0
    return (sorted(f"{SCHEME}{bucket}/{m['path']}" for m in found["objects"]),
            sorted(p[cut:] for p in found["common_prefixes"]))


def get_listed(url: str, size: int, etag: str) -> bytes | None:
    """The whole object, if it is still the one a LIST saw (`size` bytes, ETag `etag`); None when it changed
    since (a GET with `If-Match`, read no further than `size` + 1 bytes whatever the server sends)."""
    bucket, key = split(url)
    s3 = _s3()

    def get() -> bytes | None:
        from obstore.exceptions import PreconditionError

        try:
            answer = s3._obstore().get(s3.client(bucket), key, options={"if_match": etag})
        except PreconditionError:
            return None
        data = bytearray()
        for piece in answer:  # streamed: a server that ignored If-Match cannot make this read more than size + 1
            data += piece
            if len(data) > size:
                return None
        return bytes(data) if len(data) == size else None

    return _request("GET", url, get)


class ObjectFile(io.RawIOBase):
    """A read-only, seekable file over one object's bytes (see the module's docstring)."""

    def __init__(self, url: str, read_ahead: int = READ_AHEAD_BYTES, until: int | None = None) -> None:
        """`until`: where the reads the caller means to make end (a chunk's last member), so the
        read-ahead stops there instead of fetching bytes nobody reads; reads beyond it still work."""
        super().__init__()
        self._until = until
        self.url = url
        self.bucket, self.key = split(url)
        self.size, self.stamp = head(url)
        self._read_ahead = read_ahead
        self._window, self._window_start = b"", 0
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, "negative seek position", self.url)
        self._position = base + offset
        return self._position

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.size - self._position
        data = self.pread(size, self._position)
        self._position += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def pread(self, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` (fewer at the end of the object, as `os.pread` gives)."""
        self._checkClosed()
        stop = min(self.size, offset + max(0, size))
        if stop <= offset:
            return b""
        window_stop = self._window_start + len(self._window)
        if self._window_start <= offset and stop <= window_stop:
            return self._window[offset - self._window_start:stop - self._window_start]
        if stop - offset >= self._read_ahead:
            return self._get(offset, stop)
        ahead = offset + self._read_ahead if self._until is None else min(offset + self._read_ahead,
                                                                              max(self._until, stop))
        self._window_start = offset
        self._window = self._get(offset, min(self.size, ahead))
        return self._window[:stop - offset]

    def _get(self, start: int, stop: int) -> bytes:
        s3 = _s3()
        data = bytes(_request(f"GET of bytes {start}-{stop - 1}", self.url,
                              lambda: s3._obstore().get_range(s3.client(self.bucket), self.key, start=start,
                                                              end=stop)))
        if len(data) != stop - start:  # the object was replaced by a shorter one since the HEAD
            raise OSError(errno.ENXIO, f"asked for bytes {start}-{stop - 1}, got {len(data)}", self.url)
        return data

    def close(self) -> None:
        self._window = b""
        super().close()
