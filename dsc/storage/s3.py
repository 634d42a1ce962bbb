"""A dataset in an S3-compatible bucket (`s3://bucket/prefix`), read through a node-local cache.

`S3Dataset` is `LocalFolder`'s sibling behind `dsc.storage.store.DatasetStore`: the manifest
comes from the bucket (it is the dataset's identity), and every index file is downloaded once per
node into `<cache>/<SHA-256 of the manifest>/`, under a file lock, to a temporary name created
exclusively, checked against the manifest's size and SHA-256, then renamed into place; `open`
hands out descriptors of those copies, so the reader maps them as it does a folder's. (1.4) A shard
table, read at every parse of the manifest, is kept once per node at `<cache>/shard-tables/<its SHA-256>`.

The records (the shards) are not cached whole: `record_cache` hands the reader a
`dsc.storage.cache.RecordCache`, which fetches byte ranges of the shards as the epoch's order asks
for them, within `cache_bytes` (the manifest and index files, fetched whole here, count in it).

The client is obstore's `S3Store`, imported only here and made lazily, once per process. obstore's
runtime does not survive `fork` (a request in a child forked after the parent used it hangs, with
the parent's client or a new one), so a forked child (a `DataLoader` worker started by fork) sends
its requests to a helper process of its own (`dsc.storage.fetch_helper`); `head` and `get_range`
pick the way.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import logging
import os
import re
import secrets
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError, StorageError
from dsc.storage import aws_config, fetch_helper, manifest_copies
from dsc.storage.ledger import node_default
from dsc.storage.local import TEMP_SUFFIX, create_exclusive, locked, sha256_fd

EXTRA = "pip install 'dsc-images[s3]' (from a checkout: pip install '.[s3]')"
ATTEMPTS = 4  # tries of one request before giving up (timeouts, 5xx, refused or reset connections)
BACKOFF_S = 0.25  # the pause before try k + 1 is BACKOFF_S * 2**(k - 1)
CONNECT_TIMEOUT = "5s"
REQUEST_TIMEOUT_S = 120.0  # one ranged GET of PIECE_BYTES, start to end; $DSC_S3_TIMEOUT overrides it
TIMEOUT_ENV = "DSC_S3_TIMEOUT"
PIECE_BYTES = 32 << 20  # a download is a run of ranged GETs of this size, each retried on its own
FETCHES = 2  # downloads of a file whose bytes do not match the manifest, before it is an error
DEFAULT_SHARE = 0.5  # cache_bytes by default: this share of the cache's free space at open, plus what it holds
LOCK_SUFFIX = ".lock"
LATEST = "latest"  # the stamp of the note on the copy of the manifest last read as a URL's latest version
SEAL_SUFFIX = ".checked"  # beside a copy cached whole: what it was when its SHA-256 was last found right
SEAL_MAX = 256
TABLES_DIR = "shard-tables"  # (1.4) <cache>/shard-tables/<SHA-256>: the node's copy of each shard table it read

OPEN_REQUESTS = 8  # an open's small requests (HEADs, index files) in flight at a time: each is a round trip
# (~20-50 ms to a real endpoint), so an open asks them together, not one by one
HELPER_WAIT_S = 30.0  # how much longer than a request's own limit a forked child waits for its helper's answer


logger = logging.getLogger("dsc")
_clients: dict[tuple, Any] = {}  # (process id, bucket, endpoint settings) -> obstore S3Store
_runtime_pid: int | None = None  # the process that first called obstore (its runtime lives there)
_opened_keys: dict[tuple[str, str], str] = {}  # (url, cache) -> cache key of the manifest read last
_opened_versions: dict[tuple[str, str], dict[str, str]] = {}  # (url, cache) -> {versions/N.json: its cache key}


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket/prefix`; the prefix without surrounding slashes."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise DatasetError(f"{url}: not an s3://bucket/prefix URL")
    prefix = parts.path.strip("/")
    if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
        raise DatasetError(f"{url}: the prefix must be a plain path without empty, '.' or '..' parts")
    return parts.netloc, prefix


def default_cache_dir() -> Path:
    """$DSC_CACHE_DIR, else the user cache folder ($XDG_CACHE_HOME or ~/.cache) / dsc."""
    if os.environ.get("DSC_CACHE_DIR"):
        return Path(os.environ["DSC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsc"


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the file system of `path`."""
    return shutil.disk_usage(path).free


def _is_loopback(host: str | None) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False


def _client_options() -> tuple[dict[str, Any], dict[str, Any]]:
    """(S3 config, client options) from the standard AWS environment and the profile's config and credentials
    files (`aws_config`): keys, region, the endpoint (plain http only to a loopback address); timeouts."""
    config: dict[str, Any] = aws_config.settings()
    options: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT, "timeout": f"{_request_timeout() * 1000:.0f}ms"}
    endpoint = config.get("endpoint")
    if endpoint:
        try:
            parts = urlsplit(endpoint)
            parts.port  # noqa: B018 (raises for a port that is not a number from 0 to 65535)
        except ValueError as e:
            raise StorageError(f"endpoint {endpoint}: not a URL the S3 client can use ({e})") from e
        if not parts.hostname:
            raise StorageError(f"endpoint {endpoint}: no host name in it (expected e.g. https://s3.example.net)")
        if parts.scheme == "http":
            if not _is_loopback(parts.hostname):
                raise StorageError(f"endpoint {endpoint}: plain http is allowed only to a loopback "
                                   "address (127.0.0.1, ::1, localhost); use https")
            options["allow_http"] = True
        elif parts.scheme != "https":
            raise StorageError(f"endpoint {endpoint}: expected an http(s):// URL")
    return config, options


def _request_timeout() -> float:
    """Seconds one request may take, start to end: $DSC_S3_TIMEOUT (a positive number), else 120."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return REQUEST_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0.001 <= seconds < 1e6:
        raise StorageError(f"{TIMEOUT_ENV}={text}: expected seconds per request, a positive number")
    return seconds




def _forked() -> bool:
    """Whether this process was forked from one that made an obstore client (`client`), whose runtime it may
    have started (unusable here): its requests then go through a helper process (`fetch_helper`). Importing
    obstore starts nothing: a process forked from one that only imported it (the compile's spawned worker
    host) makes its own client and requests."""
    return _runtime_pid is not None and _runtime_pid != os.getpid()


def _settings() -> dict[str, Any]:
    """obstore S3Store's keyword arguments for this process's environment (besides the bucket)."""
    config, options = _client_options()
    return {"config": config, "client_options": options,
            "retry_config": {"max_retries": 0}}  # dsc retries itself, counting and naming each try


def client(bucket: str) -> Any:
    """This process's obstore client for `bucket`, made on first use (never shared across processes)."""
    global _runtime_pid
    settings = _settings()
    pid = os.getpid()
    key = (pid, bucket, repr(sorted(settings["config"].items())),
           repr(sorted(settings["client_options"].items())))  # the environment may change
    found = _clients.get(key)
    if found is not None:
        return found
    try:
        from obstore.store import S3Store
    except ImportError as e:
        raise StorageError(f"an s3:// URL needs obstore, which is not installed: {EXTRA}") from e
    made = S3Store(bucket, **settings)
    _clients[key] = made
    if _runtime_pid is None:
        _runtime_pid = pid
    return made


def head(bucket: str, key: str) -> dict[str, Any]:
    """The object's metadata (obstore's `head`), asked by this process or, forked, by its helper."""
    if _forked():
        _obstore()  # installed, or the same message as unforked
        return fetch_helper.call(("head", bucket, _settings(), key), _request_timeout() + HELPER_WAIT_S)
    return _obstore().head(client(bucket), key)


def get_range(bucket: str, key: str, start: int, end: int) -> bytes | memoryview:
    """Bytes [start, end) of the object, fetched by this process (the client's own buffer, not copied) or,
    forked, by its helper."""
    if _forked():
        _obstore()  # installed, or the same message as unforked
        return fetch_helper.call(("get_range", bucket, _settings(), key, start, end),
                                 _request_timeout() + HELPER_WAIT_S)
    return memoryview(_obstore().get_range(client(bucket), key, start=start, end=end))


class EndpointUnreachable(StorageError):
    """A request that failed every try in a way a retry could have fixed (no answer, 5xx): `reason` says how."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def retried(what: str, where: str, request) -> Any:
    """`request()`, tried up to ATTEMPTS times with growing pauses while it fails in a way a retry can fix;
    a failure names `where`, the tries and the last error, on one line. FileNotFoundError (no such object)
    and dsc's own errors (the client not installed, a bad endpoint) pass through: no retry helps them."""
    began, last = time.monotonic(), None
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return request()
        except (FileNotFoundError, DatasetError):  # StorageError is one too
            raise
        except Exception as e:  # obstore's errors: connection, timeout, HTTP status
            if _permanent(e):
                raise StorageError(f"{where}: {what} refused: {_describe(e)}") from e
            last = e
        if attempt < ATTEMPTS:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
    raise EndpointUnreachable(f"{where}: {what} failed {ATTEMPTS} times in {time.monotonic() - began:.1f} s; "
                              f"last: {_describe(last)}", _describe(last)) from last


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


_STATUS = re.compile(r"status code: (\d{3})")  # how obstore's message gives an HTTP status
_STATUS_LINE = re.compile(r"status code: (\d{3}[^:\n]*)")  # "503 Service Unavailable"
_S3_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")  # the S3 error XML's code, e.g. SlowDown


def _describe(e: BaseException) -> str:
    """One line on what went wrong with a request: the HTTP status and the S3 error code, a timeout
    with its limit, a connection cut mid-answer; else the first line of obstore's message."""
    text = str(e)
    status = _STATUS_LINE.search(text)
    if status is not None:
        code = _S3_CODE.search(text)
        return f"HTTP {status.group(1).strip()}" + (f" ({code.group(1)})" if code else "")
    if "kind: Timeout" in text or "TimedOut" in text:
        return (f"no complete answer within {_request_timeout():g} s (the limit per request; "
                f"${TIMEOUT_ENV} sets it)")
    if "ConnectionRefused" in text or "Connection refused" in text:
        return "connection refused (nothing listens at the endpoint)"
    if "body error" in text:
        return "the connection was cut in the middle of the answer"
    return _first_line(e)


def _permanent(e: BaseException) -> bool:
    """Errors a retry cannot fix: a missing object, refused credentials, a bad configuration, an HTTP
    status other than 5xx or 429 (a timeout, a reset or refused connection, a 503 SlowDown are retried)."""
    try:
        from obstore import exceptions as ox
    except ImportError:
        return False
    if isinstance(e, (FileNotFoundError, PermissionError, ox.PermissionDeniedError, ox.UnauthenticatedError,
                      ox.InvalidPathError, ox.UnknownConfigurationKeyError, ox.NotSupportedError)):
        return True
    status = _STATUS.search(str(e))
    return status is not None and not (status.group(1).startswith("5") or status.group(1) == "429")


class S3Dataset:
    """A compiled dataset under `s3://bucket/prefix`: its index cached whole under `cache_dir`, its records
    through a bounded cache there (`record_cache`), at most `cache_bytes` in all.

    The cache folder may be shared by every process of the node (ranks, workers): each file is
    downloaded once, under a lock. The index files are only ever added (a damaged one replaced by a new
    download); records are deleted only by the record cache, at its own names (`dsc.storage.slots`,
    `dsc.storage.units`), and of an older version of the URL no process reads (`cache.retire_version`);
    nothing at a dataset file's name that is not a regular file is replaced or followed."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None, cache_bytes: int | None = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._text: bytes | None = None  # the manifest's bytes, as read
        self._key: str | None = None  # their SHA-256: the cache sub-folder of this dataset
        self._manifest: fmt.Manifest | None = None
        self._sizes: dict[str, int] = {}  # HEAD answers, so validating twice asks once
        self._unreachable: EndpointUnreachable | None = None  # set once the endpoint failed every try at open
        self._latest: int | None = None  # the latest version the last LIST of versions/ found
        self.cache_bytes = cache_bytes  # None: DEFAULT_SHARE of the free space, fixed at the first open
        self._given_bytes = cache_bytes is not None

    # --------------------------------------------------------------------- the store's verbs

    def close(self) -> None:
        """Nothing to release: the client lives as long as the process, the copies in the cache."""

    def replaced(self) -> bool:
        """Never: a dataset is its manifest's bytes, and every copy is checked against them."""
        return False

    def read(self, name: str, limit: int) -> bytes:
        """The manifest from the bucket (a forked child: its parent's cached copy); another file from
        the cache when it holds it, else from the bucket."""
        if name == fmt.MANIFEST_FILE or _is_version_manifest(name):
            return self._read_manifest(limit, name)
        entry = next((e for e in self._whole_files() if e.file == name), None) if self._manifest else None
        fd = self._checked_copy(entry) if entry is not None else self._cached(name, None)
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                return f.read(limit)
        table = fmt.declared_shard_tables(self._text or b"").get(name)
        if table is not None:  # (1.4) read at every parse of the manifest: fetched once per node
            return self._table_copy(table)[:limit]
        return self._get(name, 0, min(limit, self.size(name, name)), "GET")

    def size(self, name: str, where: str) -> int:
        """The cached copy's size where it has the size the manifest declares, else the object's (HEAD);
        a shard's declared size as it is (its ranges are fetched later, each checked for length and content)."""
        declared = fmt.declared_sizes(self._text or b"").get(name)
        if declared is not None and (_is_shard(name) or self._has_copy(name, declared)):
            return declared
        if name not in self._sizes:
            meta = self._call("HEAD", name, lambda: head(self.bucket, self._key_of(name)),
                              missing=f"missing ({where} in the manifest)")
            self._sizes[name] = int(meta["size"])
        return self._sizes[name]

    def open(self, name: str, where: str) -> int:
        """A read-only descriptor of the cached copy of `name` (an index file: the reader's records come
        through `record_cache`), downloaded first if missing or of the wrong size; a download whose size
        or SHA-256 is wrong is fetched again, then is an error."""
        entry = self._entry(name, where)
        fd = self._checked_copy(entry)
        if fd is not None:
            return fd
        self._check_budget()
        others = [other for other in self._whole_files() if other.file != name]
        _together(self._fetch, [entry, *others])  # the index, whole, once per node: a forked child finds it all
        fd = self._checked_copy(entry)
        if fd is None:
            raise DatasetError(f"{self.local_path(name)}: the cached copy of {self._at(name)} vanished or changed "
                               "right after it was downloaded; is another program writing into the cache?")
        return fd

    def list(self, folder: str) -> list[str]:
        """(format 1.3) The names of the objects directly in `folder` (one LIST: strongly consistent on S3), what
        finds a dataset's versions; a forked child, which cannot call the bucket, names the versions its parent read."""
        if _forked():
            read = _opened_versions.get((self.root, str(self.cache)), {})
            return sorted(name.split("/")[-1] for name in read if name.rpartition("/")[0] == folder)
        if self._unreachable is None:
            try:
                answer = self._call("LIST", f"{folder}/", lambda: _obstore().list_with_delimiter(
                    client(self.bucket), self._key_of(folder)), missing="missing")
                names = sorted(entry["path"].split("/")[-1] for entry in answer["objects"])
                if folder == fmt.VERSIONS_DIR:
                    self._latest = max(filter(None, map(fmt.version_of, names)), default=None)
                return names
            except EndpointUnreachable as e:  # offline: the versions whose manifests the node holds copies of
                self._unreachable = e
        if folder != fmt.VERSIONS_DIR:
            return []
        latest = fmt.declared_version(self._offline_latest() or b"")
        held = [v for v in self._offline_copies() if v <= latest]
        return [] if held in ([], [1]) else [fmt.version_file(v).split("/")[-1] for v in sorted(held)]

    def get_range(self, name: str, start: int, stop: int) -> bytes | memoryview:
        """Bytes [start, stop) of a dataset file, from the bucket (retried as every request is), as the client's
        own buffer: not copied (the record cache checks, places and serves records straight out of it)."""
        return self._get(name, start, stop, "GET", copy=False)

    def pieces(self, name: str, size: int, step: int):
        """The object's bytes by ranged GETs of `step`, as the bucket holds them (nothing cached): what
        verification reads."""
        for start in range(0, size, step):
            stop = min(size, start + step)
            data = self._get(name, start, stop, "GET")
            if len(data) != stop - start:
                raise DatasetError(f"{self._at(name)}: asked for bytes {start}-{stop - 1}, got {len(data)} bytes; "
                                   "the object is shorter than the manifest says")
            yield data

    def local_folder(self) -> Path:
        """The folder that holds this dataset's cached copies (a dsc dataset folder once complete)."""
        if self._key is None:
            raise DatasetError(f"{self.root}: its manifest has not been read yet")
        return self.cache / self._key

    def local_path(self, name: str) -> Path:
        return self.local_folder() / name

    # --------------------------------------------------------------------- the manifest

    def _read_manifest(self, limit: int, name: str = fmt.MANIFEST_FILE) -> bytes:
        """The bytes of a manifest (`manifest.json`, or a version's `versions/N.json`), which from here on name
        the dataset this store reads; a forked child reads the copy its parent opened, from the node's cache."""
        versioned = name != fmt.MANIFEST_FILE
        remembered = (_opened_versions.get((self.root, str(self.cache)), {}).get(name) if versioned
                      else _opened_keys.get((self.root, str(self.cache))))
        if _forked() and remembered is not None:
            text = manifest_copies.read(self.cache, remembered, limit)
            if text is None:
                raise DatasetError(f"{self.cache / remembered / fmt.MANIFEST_FILE}: the cached manifest of "
                                   f"{self.root} was changed or removed; it is not the one its name says")
        elif versioned and self._unreachable is not None:
            text = self._offline_manifest(self._unreachable, limit, fmt.version_of(name.split("/")[-1]))
        elif versioned:
            text = self._get(name, 0, min(limit, self.size(name, "the manifest")), "GET")
            self._keep_noted(text, name)
            if fmt.version_of(name.split("/")[-1]) == self._latest:
                self._keep_noted(text, LATEST)
        else:
            text = self._current_manifest(limit)
            self._keep_noted(text, LATEST)
        self._text, self._key, self._manifest = text, hashlib.sha256(text).hexdigest(), None
        _opened_keys[(self.root, str(self.cache))] = self._key
        if versioned:
            _opened_versions.setdefault((self.root, str(self.cache)), {})[name] = self._key
        return text

    def _current_manifest(self, limit: int) -> bytes:
        """The bucket's manifest: asked with one HEAD per process, its bytes fetched once per node (a copy
        is used while the object has the ETag and size it was fetched with; the first process to miss
        fetches it under a lock). An endpoint that does not answer: the node's latest copy, with a warning."""
        if self._unreachable is not None:  # asked once per open, not once per question
            return self._offline_manifest(self._unreachable, limit)
        try:
            meta = self._call("HEAD", fmt.MANIFEST_FILE, lambda: head(self.bucket, self._key_of(fmt.MANIFEST_FILE)),
                              missing="missing (the manifest)")
        except EndpointUnreachable as e:
            self._unreachable = e
            return self._offline_manifest(e, limit)
        self._sizes[fmt.MANIFEST_FILE] = int(meta["size"])
        stamp = f"{meta.get('e_tag')} {meta['size']}" if meta.get("e_tag") else None  # an object without: no copy
        def node_copy() -> bytes | None:
            return manifest_copies.find(self.cache, self._origin(stamp), limit) if stamp else None

        text = node_copy()
        if text is not None:
            return text
        self.cache.mkdir(parents=True, exist_ok=True)
        with locked(self.cache / f"{self._origin(None)}{LOCK_SUFFIX}"):
            text = node_copy()  # another process of the node fetched it while this one waited
            if text is None:
                text = self._get(fmt.MANIFEST_FILE, 0, min(limit, int(meta["size"])), "GET")
                folder = self.cache / hashlib.sha256(text).hexdigest()
                self._keep_text(folder, text)
                if stamp:
                    self._place(folder / self._origin(stamp), lambda f: None)
        return text

    def _keep_noted(self, text: bytes, name: str) -> None:
        """Keep a version's manifest read from the bucket, noted as this URL's (`name` its stamp; LATEST: read as
        the latest version, the note made anew at each such read): what an open finds when the endpoint does not
        answer (`_offline_manifest`), as a copy of `manifest.json` is."""
        folder = self.cache / hashlib.sha256(text).hexdigest()
        self._keep_text(folder, text)
        if name == LATEST and manifest_copies.newest(self.cache, self._origin(LATEST)) == folder.name:
            return  # the node read it as the latest last time too: nothing to note (nothing written at an open)
        self._place(folder / self._origin(name), lambda f: None)

    def offline(self) -> EndpointUnreachable | None:
        """Why the endpoint did not answer at open (the store then reads the node's copies), or None."""
        return self._unreachable

    def _offline_copies(self) -> dict[int, bytes]:
        """The copies of this URL's manifests (`manifest.json`'s and versions') the node holds, by version."""
        return manifest_copies.by_version(self.cache, self._origin(manifest_copies.ANY), fmt.MAX_MANIFEST_BYTES + 1)

    def _offline_latest(self) -> bytes | None:
        """The copy of the manifest this node last read as the latest version of this URL (a version read by
        number is not; nor, of a prefix emptied and compiled anew, the old dataset's higher versions)."""
        return manifest_copies.find(self.cache, self._origin(LATEST), fmt.MAX_MANIFEST_BYTES + 1)

    def _offline_manifest(self, error: EndpointUnreachable, limit: int, version: int | None = None) -> bytes:
        """The copy of version `version` (None: the latest, `_offline_latest`) of the manifest this node fetched
        from this URL and endpoint, with a warning naming the version; none: `error`, saying so."""
        latest = self._offline_latest()
        if version is None or latest is not None and fmt.declared_version(latest) == version:
            text = latest
        else:
            text = self._offline_copies().get(version)
        if text is None:  # (a version asked for by number is one `list` named: the node holds it)
            raise StorageError(f"{error}; the cache {self.cache} holds no copy of this dataset's manifest fetched "
                               f"through {self.endpoint_named()}, to open it without the endpoint") from error
        number = fmt.declared_version(text)
        which = f"version {number}" + (", the latest it read," if text == latest else "")
        logger.warning("%s", f"{self.root}: the endpoint cannot be reached ({error.reason}); opened {which} from the "
                             f"copy cached in {self.cache}: only what the cache holds can be read")
        return text[:limit]

    def endpoint_named(self) -> str:
        """The endpoint the settings give, for a message (a node's copies are kept per endpoint)."""
        endpoint = str(_settings()["config"].get("endpoint") or "")
        return f"the endpoint {endpoint}" if endpoint else "AWS's own endpoint"

    def _origin(self, stamp: str | None) -> str:
        return manifest_copies.origin(str(_settings()["config"].get("endpoint", "")), self.root, stamp)

    def _parsed(self) -> fmt.Manifest:
        if self._manifest is None:
            if self._text is None:
                self._read_manifest(fmt.MAX_MANIFEST_BYTES + 1)
            self._ask_sizes()
            self._manifest = fmt.parse_manifest(self._text, self.root, self.size, self.read)
            self._keep_manifest()
        return self._manifest

    def _ask_sizes(self) -> None:
        """The HEADs validation will ask (the files the manifest lists but the shards, not cached at their declared
        size), asked together beforehand; one that fails is asked again by `size`, which names what went wrong."""
        if _forked() or self._unreachable is not None:
            return
        todo = [name for name, declared in fmt.declared_sizes(self._text or b"").items()
                if not _is_shard(name) and name not in self._sizes and not self._has_copy(name, declared)]

        def ask(name: str) -> None:
            try:
                self._sizes[name] = int(head(self.bucket, self._key_of(name))["size"])
            except Exception:  # left to `size`, whose retries and message are the reader's
                pass
        _together(ask, todo)

    def _entry(self, name: str, where: str) -> fmt.FileEntry:
        for entry in self._parsed().files:
            if entry.file == name:
                return entry
        raise DatasetError(f"{self._at(name)}: not a file of this dataset ({where})")

    def _keep_manifest(self) -> None:
        """A copy of the manifest beside the cached files: the folder becomes a dataset of its own, the
        node's other processes and a forked child (the version its parent opened) read it from there."""
        self._keep_text(self.local_folder(), self._text)

    def _keep_text(self, folder: Path, text: bytes) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / fmt.MANIFEST_FILE).exists():
            self._place(folder / fmt.MANIFEST_FILE, lambda f: f.write(text))

    # --------------------------------------------------------------------- the cache

    def _cached(self, name: str, size: int | None) -> int | None:
        """A descriptor of the cached copy of `name` if it is a regular file (of `size` bytes, if given)."""
        if self._key is None:
            remembered = _opened_keys.get((self.root, str(self.cache)))
            if remembered is None:
                return None
            path = self.cache / remembered / name
        else:
            path = self.local_path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DatasetError(f"{path}: not a regular file; the cache of {self._at(name)} holds something dsc "
                               f"did not put there, and leaves it alone: move it away ({e.strerror})") from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size):
            os.close(fd)
            if not stat.S_ISREG(st.st_mode):
                raise DatasetError(f"{path}: not a regular file; the cache of {self._at(name)} holds something "
                                   "dsc did not put there, and leaves it alone: move it away")
            return None
        return fd

    def _checked_copy(self, entry: fmt.FileEntry) -> int | None:
        """A descriptor of the cached copy of a file cached whole if it has `entry`'s size and SHA-256, else None
        (missing or damaged: to be fetched again). The SHA-256 is computed once per copy: then a seal beside it
        (`_seal`) records the copy's inode, size and change times, which any write into it changes, so a copy
        changed since it was checked is checked again."""
        fd = self._cached(entry.file, entry.bytes)
        if fd is None:
            return None
        path = self.local_path(entry.file)
        stamp = f"{_file_stamp(os.fstat(fd))} {entry.sha256}\n"
        if _read_seal(path) == stamp:
            return fd
        try:
            found = sha256_fd(os.dup(fd))  # (the copy shares the offset: back to the start after)
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        if found != entry.sha256:
            os.close(fd)
            return None
        _write_seal(path, stamp)
        return fd

    def _has_copy(self, name: str, size: int) -> bool:
        """Whether the cache holds a copy of `name` of `size` bytes (then nobody need ask the bucket its size)."""
        fd = self._cached(name, size)
        if fd is None:
            return False
        os.close(fd)
        return True

    def _whole_files(self) -> list[fmt.FileEntry]:
        """The files cached whole: every one but the shards (whose records `record_cache` fetches)."""
        shards = {e.file for e in self._manifest.shards}
        return [e for e in self._manifest.files if e.file not in shards]

    def base_bytes(self) -> int:
        """What the cache holds besides records: the manifest's copy, the files cached whole with their seals
        (`_checked_copy`) and (records cached one by one) the state of the records (`dsc.storage.slots`)."""
        from dsc.storage.slots import state_bytes

        state = state_bytes(self._manifest.count) if self._manifest.has_checksums else 0
        whole = self._whole_files()
        return len(self._text or b"") + sum(e.bytes for e in whole) + SEAL_MAX * len(whole) + state

    def budget(self) -> int:
        """`cache_bytes`, or by default DEFAULT_SHARE of the cache's free space at the first open plus what this
        dataset's folder holds already: the node's, whose processes count what they hold together (`cache`),
        computed by the first of them to open it (`ledger.node_default`)."""
        if self.cache_bytes is None:
            folder = self.local_folder()

            def compute() -> int:
                return int(free_bytes(folder) * DEFAULT_SHARE) + _held_bytes(folder)
            self.cache_bytes = node_default(folder, compute)
        return self.cache_bytes

    def _check_budget(self) -> None:
        """Before anything is fetched: `cache_bytes` must hold the manifest, the index, the node's table of the
        processes sharing the folder (`ledger`) and one unit of records (a record, or with no per-record
        checksums a shard); say the minimum where it does not."""
        from dsc.storage.ledger import TABLE_BYTES
        from dsc.storage.slots import block_size, record_cost

        unit = record_cost(self._manifest.record_bytes, block_size(self.local_folder())) \
            if self._manifest.has_checksums else max(e.bytes for e in self._manifest.shards)
        need = self.base_bytes() + TABLE_BYTES + unit
        if self.budget() < need:
            raise DatasetError(f"{self.root}: cache_bytes={self.budget()} cannot hold this dataset's index, the node's "
                               f"table and one {'record' if self._manifest.has_checksums else 'shard'}: at least "
                               f"{need} bytes are needed; give a larger cache_bytes (or free space in the cache folder "
                               f"{self.cache}, whose default share is {DEFAULT_SHARE:.0%} of its free space)")

    def _warn_past_the_disk(self) -> None:
        """A `cache_bytes` given that the cache folder's file system cannot hold, for a dataset that could fill it:
        said at open, since the limit is an upper bound, not room on the disk (a full disk fails a fetch later,
        naming it)."""
        if not self._given_bytes:
            return
        folder = self.local_folder()
        free = free_bytes(folder)
        wanted = min(self.budget(), self.base_bytes() + sum(e.bytes for e in self._manifest.shards))
        room = free + _held_bytes(folder) if wanted > free else free  # (others change what it holds meanwhile)
        if wanted > room:
            logger.warning("%s", f"{self.root}: cache_bytes={self.budget()} is more than the cache folder {folder} "
                                 f"can hold ({room} bytes: what it holds and the free space of its disk), and the "
                                 f"dataset's {wanted} bytes would fill it; the disk fills before the limit is "
                                 f"reached and a fetch then fails: give cache_bytes <= {room}, or a larger disk")

    def record_cache(self, manifest: fmt.Manifest):
        """The records' bounded cache (`dsc.storage.cache.RecordCache`) for a validated `manifest`."""
        from dsc.storage.cache import RecordCache

        self._parsed()
        self._check_budget()
        self._warn_past_the_disk()
        crcs = None
        if manifest.has_checksums:  # (1.5) every segment's, joined
            pieces = []
            for segment in manifest.index_segments:
                with os.fdopen(self.open(segment.checksums.file, "checksums"), "rb") as f:
                    pieces.append(np.frombuffer(f.read(segment.checksums.bytes + 1), fmt.CHECKSUM_DTYPE))
                if len(pieces[-1]) != segment.count:
                    raise DatasetError(f"{self.local_path(segment.checksums.file)}: {len(pieces[-1])} checksums for "
                                       f"{segment.count} records; the cached copy is damaged")
            crcs = np.concatenate(pieces)
        made = RecordCache(manifest, self.local_folder(), self.budget(), self.base_bytes(), self.get_range, self._at,
                           crcs)
        self._retire_other_versions()
        return made

    def _retire_other_versions(self) -> None:
        """Let go of the records of this URL's older versions cached on this node that no process reads (each
        version has a folder of its own: without this an append would leave its predecessor's records on disk
        beside the new version's, past `cache_bytes`). A newer version's are kept: reading version 1 by number
        does not empty the cache of the latest."""
        from dsc.storage.cache import retire_version

        ours, mine = self.local_folder(), fmt.declared_version(self._text or b"")
        for note in self.cache.glob(f"*/{self._origin(manifest_copies.ANY)}"):
            folder = note.parent
            if folder == ours or folder.is_symlink():
                continue
            text = manifest_copies.read(self.cache, folder.name, fmt.MAX_MANIFEST_BYTES + 1)
            if text is not None and fmt.declared_version(text) < mine:
                retire_version(folder)

    def _fetch(self, entry: fmt.FileEntry) -> None:
        """Download `entry` into the cache once per node: under its lock, unless another process did."""
        path = self.local_path(entry.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(f".{path.name}{LOCK_SUFFIX}")):
            fd = self._checked_copy(entry)
            if fd is not None:  # another process of the node fetched it while this one waited
                os.close(fd)
                return
            _remove_dead_temporaries(path)
            problems = []
            for _ in range(FETCHES):
                problem = self._place(path, lambda f: self._download(entry, f), entry)
                if problem is None:
                    return
                problems.append(problem)
            raise DatasetError(f"{self._at(entry.file)}: downloaded {FETCHES} times, wrong each time "
                               f"({'; '.join(problems)}); the object in the bucket is damaged")

    def _table_copy(self, entry: fmt.FileEntry) -> bytes:
        """(1.4) A shard table's bytes from the node's copy of it, named by the SHA-256 the manifest seals (so
        checked at each read, trusted across datasets and versions), fetched first under its lock if missing.
        Like the manifest's copy it is kept outside the dataset's folder and before the budget is checked (the
        manifest cannot be parsed without it); `base_bytes` counts it with the index."""
        path = self.cache / TABLES_DIR / entry.sha256
        data = _verified(path, entry)
        if data is not None:
            return data
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path.with_name(f".{path.name}{LOCK_SUFFIX}")):
            if _verified(path, entry) is None:  # else another process of the node fetched it while this one waited
                _remove_dead_temporaries(path)
                problem = self._place(path, lambda f: self._download(entry, f), entry)
                if problem is not None:  # the parse names the damage, as it does for any table read
                    return self._get(entry.file, 0, entry.bytes + 1, "GET")
        data = _verified(path, entry)
        if data is None:
            raise DatasetError(f"{path}: the cached copy of {self._at(entry.file)} vanished or changed right after "
                               "it was downloaded; is another program writing into the cache?")
        return data

    def _place(self, path: Path, write, entry: fmt.FileEntry | None = None) -> str | None:
        """Write a file through `write(f)` to a new temporary name beside `path`, check it against
        `entry` (size, SHA-256), then rename it into place; return what was wrong (nothing placed)."""
        temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
        fd = create_exclusive(temp)
        try:
            with os.fdopen(fd, "wb") as f:
                digest = write(f)
                f.flush()
                os.fsync(f.fileno())
            if entry is not None:
                size = temp.stat().st_size
                if size != entry.bytes:
                    return f"{size} bytes, the manifest says {entry.bytes}"
                if digest != entry.sha256:
                    return f"SHA-256 {digest}, the manifest says {entry.sha256}"
            os.replace(temp, path)
            return None
        finally:
            try:
                os.unlink(temp)  # ours (created exclusively above); gone already once renamed
            except FileNotFoundError:
                pass

    def _download(self, entry: fmt.FileEntry, f) -> str:
        """Write the object's bytes into `f` by ranged GETs (a shard table: from the node's copy, `_table_copy`);
        return their SHA-256."""
        copy = _verified(self.cache / TABLES_DIR / entry.sha256, entry)
        if copy is not None:
            f.write(copy)
            return entry.sha256
        digest = hashlib.sha256()
        for start in range(0, entry.bytes, PIECE_BYTES):
            stop = min(entry.bytes, start + PIECE_BYTES)
            data = self._get(entry.file, start, stop, "GET")
            if len(data) != stop - start:
                raise DatasetError(f"{self._at(entry.file)}: asked for bytes {start}-{stop - 1}, got {len(data)} "
                                   "bytes; the object is shorter than the manifest says")
            digest.update(data)
            f.write(data)
        return digest.hexdigest()

    # --------------------------------------------------------------------- requests

    def _key_of(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _at(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _get(self, name: str, start: int, stop: int, what: str, copy: bool = True) -> bytes | memoryview:
        if stop <= start:
            return b""
        key = self._key_of(name)
        data = self._call(what, name, lambda: get_range(self.bucket, key, start, stop), missing="missing")
        return bytes(data) if copy else memoryview(data)

    def _call(self, what: str, name: str, request, missing: str) -> Any:
        """`retried(request)`, naming this dataset's object; a missing one is `missing`."""
        try:
            return retried(what, self._at(name), request)
        except FileNotFoundError as e:
            raise DatasetError(f"{self._at(name)}: {missing}") from e



def _together(call, items: list) -> None:
    """`call(item)` for each item, OPEN_REQUESTS at a time (requests that each wait a round trip); the first
    failure, in the items' order, is raised once all have ended."""
    if len(items) <= 1:
        for item in items:
            call(item)
        return
    with ThreadPoolExecutor(min(OPEN_REQUESTS, len(items)), "dsc-open") as pool:
        futures = [pool.submit(call, item) for item in items]
    for future in futures:
        future.result()


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporaries of `path` that `_place` made (`.NAME.<16 hex>.tmp`, regular files) and a process
    killed while it downloaded left. Called under `path`'s lock, which every download of it holds while it
    writes its temporary: none of them is being written now."""
    made = re.compile(rf"\.{re.escape(path.name)}\.[0-9a-f]{{16}}{re.escape(TEMP_SUFFIX)}")
    try:
        names = [name for name in os.listdir(path.parent) if made.fullmatch(name)]
    except FileNotFoundError:
        return
    for name in names:
        left = path.parent / name
        try:
            if stat.S_ISREG(os.lstat(left).st_mode):  # never a link or anything else planted at such a name
                os.unlink(left)
        except FileNotFoundError:
            pass


def _held_bytes(folder: Path) -> int:
    """The bytes of the regular files under `folder`, or the disk their blocks take where that is less; files that
    go while it is walked are not counted."""
    held = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(FileNotFoundError):
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                held += min(st.st_size, st.st_blocks * 512)  # a sparse file of the record cache: its blocks
    return held


def _file_stamp(st: os.stat_result) -> str:
    """What changes whenever a file's bytes do: its inode, size and modification and change times (a write
    sets both; ctime cannot be set back by hand)."""
    return f"{st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _seal_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{SEAL_SUFFIX}")


def _read_seal(path: Path) -> str | None:
    try:
        fd = os.open(_seal_path(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(SEAL_MAX).decode("ascii", "replace")


def _write_seal(path: Path, stamp: str) -> None:
    """Record that the copy at `path`, as `stamp` describes it, was checked (best effort: without the seal, the
    copy is only checked again at the next open)."""
    try:
        fd = os.open(_seal_path(path), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "wb") as f:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # (never a FIFO or a device someone put there)
            f.truncate(0)
            f.write(stamp.encode("ascii"))


def _verified(path: Path, entry: fmt.FileEntry) -> bytes | None:
    """The bytes of the regular file `path` if they have `entry`'s size and SHA-256; else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(entry.bytes + 1)
    return data if len(data) == entry.bytes and hashlib.sha256(data).hexdigest() == entry.sha256 else None


def _is_version_manifest(name: str) -> bool:
    folder, _, base = name.rpartition("/")
    return folder == fmt.VERSIONS_DIR and fmt.version_of(base) is not None


def _is_shard(name: str) -> bool:
    """Whether `name` is a shard's name (`shards/NNNNN.bin`, or an append's `appends/<tag>/shards/NNNNN.bin`)."""
    return fmt.is_dataset_file_name(name) and name.split("/")[-2:-1] == [fmt.SHARD_DIR]


def _obstore():
    try:
        import obstore
    except ImportError as e:
        raise StorageError(f"an s3:// URL needs obstore, which is not installed: {EXTRA}") from e
    return obstore


def open_store(url: str, cache_dir: str | os.PathLike | None = None, cache_bytes: int | None = None) -> S3Dataset:
    """The store of an s3:// URL (what `dsc.storage.store.store_for` calls for the scheme)."""
    return S3Dataset(url, cache_dir, cache_bytes)


__all__ = ["S3Dataset", "open_store", "default_cache_dir", "parse_url", "EXTRA"]
