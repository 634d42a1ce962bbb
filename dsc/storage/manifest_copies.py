"""The node's copies of manifests fetched from object storage, and where each came from.

A copy is `<cache>/<SHA-256 of the manifest>/manifest.json` (the folder of the dataset's cached files).
Beside it, an empty file `.origin-<hash of endpoint and URL>-<hash of ETag and size>` says that the object
at that URL had that ETag and size when the copy was fetched; its mtime says when. So the processes of a
node fetch a manifest once (`find` with the object's stamp, from a HEAD). Empty, the notes take nothing from
`cache_bytes`. A copy is checked against its folder's name before it is used. A version's manifest read by
number (`versions/N.json`) is noted the same way, and the copy last read as the URL's latest version carries
one more note (stamp "latest", made anew at each such read): offline, the node opens that copy as the latest,
and any other version it holds by number (`by_version`).
"""

from __future__ import annotations

import hashlib
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


def _noted(cache: Path, note: str) -> list[str]:
    """The folders of `cache` holding the note `note` (a name or a glob), the newest note first."""
    found = []
    for path in cache.glob(f"*/{note}"):
        try:
            found.append((path.lstat().st_mtime_ns, path.parent.name))
        except FileNotFoundError:
            continue
    return [key for _, key in sorted(found, reverse=True)]


def newest(cache: Path, note: str) -> str | None:
    """The folder of `cache` (its name) whose note `note` is the newest; None when none has it."""
    return next(iter(_noted(cache, note)), None)


def find(cache: Path, note: str, limit: int) -> bytes | None:
    """The newest copy of the manifest in a folder of `cache` holding the note `note` (a name or a glob), at most
    `limit` bytes of it; None when there is none (or none is what its folder's name says)."""
    for key in _noted(cache, note):
        text = read(cache, key, limit)
        if text is not None:
            return text
    return None


def by_version(cache: Path, note: str, limit: int) -> dict[int, bytes]:
    """The copies in folders of `cache` holding the note `note` (a glob: every copy of one URL), by the version
    each manifest says it is (`dataset_version`, 1 when absent); of two copies of one version, the newer."""
    copies: dict[int, bytes] = {}
    for key in reversed(_noted(cache, note)):
        text = read(cache, key, limit)
        if text is not None:
            copies[fmt.declared_version(text)] = text
    return copies


def read(cache: Path, key: str, limit: int) -> bytes | None:
    """The manifest cached in folder `key` if its SHA-256 is `key` (the folder's name); else None."""
    try:
        fd = os.open(cache / key / fmt.MANIFEST_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(limit)
    return text if hashlib.sha256(text).hexdigest() == key else None
