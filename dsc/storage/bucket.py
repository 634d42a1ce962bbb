"""Object writes under `s3://bucket/prefix`: what a compile, an append or a prune does to a bucket.

`Bucket` is a handful of verbs on the objects under one prefix, named relative to it (`shards/00000.bin`):
`put` (plain), `create` (`If-None-Match: *`: the one commit point of a version), `replace` (`If-Match`
an ETag read before: a compare-and-swap of `manifest.json`), `get` (whole, with its ETag), `get_range`,
`head`, `list` (a prefix), `delete`, `upload` (a streaming multipart upload of a large object) and
`copy` (server-side, a whole object). Requests go through `dsc.storage.s3`: its client (one per process,
never across fork), its retry loop and its error wording.

A conditional PUT whose answer was lost and is retried meets its own write: 412 Precondition Failed.
`create` and `replace` then read the object back, and a write is the caller's when the object holds
exactly the bytes it wrote (a writer of the same bytes made the same commit).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dsc.errors import DatasetError, StorageError
from dsc.storage import s3

UPLOAD_PART_BYTES = 16 << 20  # a streaming upload's parts (S3 wants 5 MiB at least, but the last)
UPLOAD_CONCURRENCY = 4  # parts of one upload in flight at a time
_UNLISTABLE = re.compile(r'Path "(.*?)"')  # how the S3 client names a listed key it cannot take as a path


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its name relative to the bucket prefix, its size and its ETag (quotes kept); from a LIST,
    when it was last written (seconds since the epoch)."""

    name: str
    size: int
    etag: str
    modified: float | None = None


class Bucket:
    """The objects under `s3://bucket/prefix` (`url`), each named relative to the prefix."""

    def __init__(self, url: str) -> None:
        self.bucket, self.prefix = s3.parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def at(self, name: str) -> str:
        """The object's URL, as messages name it."""
        return f"{self.root}/{name}"

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _request(self, what: str, name: str, request: Callable[[Any], Any]) -> Any:
        """`request(client)` retried as every request of dsc is; FileNotFoundError passes through."""
        if s3._forked():
            raise StorageError(f"{self.at(name)}: this process cannot reach the bucket: it was forked from one that "
                               "already used the S3 client (obstore), whose runtime does not survive fork")
        return s3.retried(what, self.at(name), lambda: request(s3.client(self.bucket)))

    # ------------------------------------------------------------------ writes

    def put(self, name: str, data: bytes | memoryview) -> str:
        """Write the object (replacing any); its ETag."""
        result = self._request("PUT", name, lambda c: s3._obstore().put(c, self.key(name), data,
                                                                       use_multipart=False))
        return result["e_tag"]

    def create(self, name: str, data: bytes) -> bool:
        """Write the object only if nothing has its name (`If-None-Match: *`). True when the object now
        holds `data` (written here, or the same bytes by another writer); False when it holds others."""
        return self._conditional(name, data, "create", "PUT if-none-match") or self._holds(name, data)

    def replace(self, name: str, data: bytes, etag: str) -> bool:
        """Write the object only if its ETag is still `etag` (`If-Match`). True when it now holds `data`;
        False when another writer changed or deleted it first.

        Ceph's radosgw (16.2, checked) compares `If-Match` with the ETag without its quotes, so it refuses
        the quoted ETag HTTP specifies, which S3 gives and takes: refused while the object still has that
        ETag, the PUT is sent again with the bare one. That one is still conditional on such a server (a
        change meanwhile refuses it); a server that refused the quoted form and then ignored the bare one
        would make it a plain PUT, none is known to."""
        if self._conditional(name, data, {"e_tag": etag}, "PUT if-match"):
            return True
        bare = etag.strip('"')
        if bare != etag and (held := self.head(name)) is not None and held.etag == etag \
                and self._conditional(name, data, {"e_tag": bare}, "PUT if-match"):
            return True
        return self._holds(name, data)

    def _conditional(self, name: str, data: bytes, mode: Any, what: str) -> bool:
        """The conditional PUT (`mode`: obstore's); whether the server took it."""
        ox = _exceptions()

        def put(c: Any) -> bool:
            try:
                s3._obstore().put(c, self.key(name), data, mode=mode, use_multipart=False)
                return True
            except (ox.AlreadyExistsError, ox.PreconditionError):
                return False
            except FileNotFoundError:  # If-Match on an object deleted meanwhile (some servers answer 404)
                return False
        return self._request(what, name, put)

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether the object holds `data` after a refused conditional PUT: a retry of our own write whose
        first answer was lost, or another writer's same bytes."""
        found = self.get(name) if self.head(name) is not None else None
        return found is not None and found[0] == data

    def upload(self, name: str, pieces: Callable[[], Iterable[bytes]]) -> str:
        """Write a large object from `pieces()` (called again for a retry; it may make requests of its own) as
        one multipart upload: it appears whole or not at all, an exception from `pieces` aborting it. Its ETag."""
        def request(c: Any) -> None:
            with s3._obstore().open_writer(c, self.key(name), buffer_size=UPLOAD_PART_BYTES,
                                           max_concurrency=UPLOAD_CONCURRENCY) as writer:
                for piece in pieces():
                    writer.write(piece)
        self._request("multipart PUT", name, request)
        written = self.head(name)
        if written is None:
            raise StorageError(f"{self.at(name)}: missing right after its upload completed")
        return written.etag

    def copy(self, source: str, name: str) -> None:
        """Copy object `source` to `name` inside the bucket (server-side: no bytes through this process)."""
        self._request("COPY", name, lambda c: s3._obstore().copy(c, self.key(source), self.key(name)))

    def delete(self, name: str) -> None:
        """Delete the object; one already gone is fine."""
        def delete(c: Any) -> None:
            try:
                s3._obstore().delete(c, self.key(name))
            except FileNotFoundError:
                pass
        self._request("DELETE", name, delete)

    # ------------------------------------------------------------------ reads

    def get(self, name: str) -> tuple[bytes, str]:
        """The whole object and its ETag; DatasetError when it is missing."""
        def get(c: Any) -> tuple[bytes, str]:
            answer = s3._obstore().get(c, self.key(name))
            return bytes(answer.bytes()), answer.meta["e_tag"]
        try:
            return self._request("GET", name, get)
        except FileNotFoundError as e:
            raise DatasetError(f"{self.at(name)}: missing") from e

    def get_range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the object (fewer if it is shorter); DatasetError when it is missing."""
        if stop <= start:
            return b""
        try:
            return bytes(self._request("GET", name, lambda c: s3._obstore().get_range(c, self.key(name), start=start,
                                                                                      end=stop)))
        except FileNotFoundError as e:
            raise DatasetError(f"{self.at(name)}: missing") from e

    def head(self, name: str) -> ObjectInfo | None:
        """The object's size and ETag; None when there is none."""
        try:
            meta = self._request("HEAD", name, lambda c: s3._obstore().head(c, self.key(name)))
        except FileNotFoundError:
            return None
        return ObjectInfo(name, int(meta["size"]), meta["e_tag"])

    def list(self, folder: str = "") -> list[ObjectInfo]:
        """Every object under `folder/` (all of them for ""), at any depth, sorted by name."""
        base = self.key(folder) if folder else self.prefix

        def listed(c: Any) -> list[dict]:
            return [meta for page in s3._obstore().list(c, prefix=base or None) for meta in page]
        cut = len(self.prefix) + 1 if self.prefix else 0
        try:
            answer = self._request("LIST", folder, listed)
        except StorageError as e:  # one key spoils the whole listing: say which, and what to do
            key = _UNLISTABLE.search(str(e))
            if key is None or "invalid path" not in str(e):
                raise
            raise StorageError(f"{self.root} holds an object whose key {key.group(1)!r} cannot be read as a path (an "
                               "empty, '.' or '..' part, or a control character), so the prefix cannot be listed "
                               "while it is there: rename or delete that object") from None
        found = [ObjectInfo(m["path"][cut:], int(m["size"]), m["e_tag"], m["last_modified"].timestamp())
                 for m in answer]
        return sorted(found, key=lambda info: info.name)


def _exceptions() -> Any:
    from obstore import exceptions

    return exceptions


__all__ = ["Bucket", "ObjectInfo"]
