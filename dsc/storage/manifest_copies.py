"""The node's copies of manifests fetched from object storage, and where each came from.

A copy is `<cache>/<SHA-256 of the manifest>/manifest.json` (the folder of the dataset's cached files).
Beside it, an empty file `.origin-<hash of endpoint and URL>-<hash of ETag and size>` says that the object
at that URL had that ETag and size when the copy was fetched; its mtime says when. So the processes of a
node fetch a manifest once (`find` with the object's stamp, from a HEAD), and a node whose endpoint does
not answer opens the copy it fetched last (`find` with `ANY`). Empty, the notes take nothing from
`cache_bytes`. A copy is checked against its folder's name before it is used. A version's manifest read by
number (`versions/N.json`) is noted the same way, so offline the node opens the latest version it holds a copy
of, or any other of them asked for by number (`by_version`), whichever it fetched last.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from dsc import format as fmt

ORIGIN_PREFIX = ".origin-"
ANY = "*"  # a stamp that matches every copy of the URL


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def origin(endpoint: str, url: str, stamp: str | None) -> str:
    """The name of the note that a folder holds `url`'s manifest (at `endpoint`) as the object was when it had
    `stamp` (its ETag and size); `ANY`: a glob of every such note; None: the URL's part alone (a lock's name)."""
    name = f"{ORIGIN_PREFIX}{_short(f'{endpoint} {url}')}"
    return name if stamp is None else f"{name}-{stamp if stamp == ANY else _short(stamp)}"


def find(cache: Path, note: str, limit: int) -> bytes | None:
    """The newest copy of the manifest in a folder of `cache` holding the note `note` (a name or a glob), at most
    `limit` bytes of it; None when there is none (or none is what its folder's name says)."""
    found = []
    for path in cache.glob(f"*/{note}"):
        try:
            found.append((path.lstat().st_mtime_ns, path.parent.name))
        except FileNotFoundError:
            continue
    for _, key in sorted(found, reverse=True):
        text = read(cache, key, limit)
        if text is not None:
            return text
    return None


def by_version(cache: Path, note: str, limit: int) -> dict[int, bytes]:
    """The copies in folders of `cache` holding the note `note` (a glob: every copy of one URL), by the version
    each manifest says it is (`dataset_version`, 1 when absent); of two copies of one version, the newer."""
    found = []
    for path in cache.glob(f"*/{note}"):
        try:
            found.append((path.lstat().st_mtime_ns, path.parent.name))
        except FileNotFoundError:
            continue
    copies: dict[int, bytes] = {}
    for _, key in sorted(found):
        text = read(cache, key, limit)
        if text is not None:
            copies[_version_of(text)] = text
    return copies


def _version_of(text: bytes) -> int:
    try:
        version = json.loads(text).get("dataset_version", 1)
    except (ValueError, AttributeError):
        return 1
    return version if isinstance(version, int) and not isinstance(version, bool) and version >= 1 else 1


def read(cache: Path, key: str, limit: int) -> bytes | None:
    """The manifest cached in folder `key` if its SHA-256 is `key` (the folder's name); else None."""
    try:
        fd = os.open(cache / key / fmt.MANIFEST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(limit)
    return text if hashlib.sha256(text).hexdigest() == key else None
