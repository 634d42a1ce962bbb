"""A dataset in an S3-compatible bucket (`s3://bucket/prefix`), read through a node-local cache.

`S3Dataset` is `LocalFolder`'s sibling behind `dsc.storage.store.DatasetStore`: the manifest
comes from the bucket (it is the dataset's identity), and every index file is downloaded once per
node into `<cache>/<SHA-256 of the manifest>/`, under a file lock, to a temporary name created
exclusively, checked against the manifest's size and SHA-256, then renamed into place; `open`
hands out descriptors of those copies, so the reader maps them as it does a folder's.

The records (the shards) are not cached whole: `record_cache` hands the reader a
`dsc.storage.cache.RecordCache`, which fetches byte ranges of the shards as the epoch's order asks
for them, within `cache_bytes` (the manifest and index files, fetched whole here, count in it).

The client is obstore's `S3Store`, imported only here and made lazily, once per process. obstore's
runtime does not survive `fork` (a call in a child forked after the parent used it hangs), so a
forked child never calls it: it reads the copies its parent cached (a `DataLoader` worker forked
after the dataset was opened has everything it needs), and says so clearly when one is missing.
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import os
import re
import secrets
import shutil
import stat
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from dsc import format as fmt
from dsc.errors import DatasetError, StorageError
from dsc.storage import aws_config
from dsc.storage.local import TEMP_SUFFIX, create_exclusive, open_lock

EXTRA = "pip install 'dsc-images[s3]'"
ATTEMPTS = 4  # tries of one request before giving up (timeouts, 5xx, refused or reset connections)
BACKOFF_S = 0.25  # the pause before try k + 1 is BACKOFF_S * 2**(k - 1)
CONNECT_TIMEOUT = "5s"
REQUEST_TIMEOUT_S = 120.0  # one ranged GET of PIECE_BYTES, start to end; $DSC_S3_TIMEOUT overrides it
TIMEOUT_ENV = "DSC_S3_TIMEOUT"
PIECE_BYTES = 32 << 20  # a download is a run of ranged GETs of this size, each retried on its own
FETCHES = 2  # downloads of a file whose bytes do not match the manifest, before it is an error
DEFAULT_SHARE = 0.5  # cache_bytes by default: this share of the cache's free space at open, plus what it holds
LOCK_SUFFIX = ".lock"

_clients: dict[tuple, Any] = {}  # (process id, bucket, endpoint settings) -> obstore S3Store
_runtime_pid: int | None = None  # the process that first called obstore (its runtime lives there)
_opened_keys: dict[tuple[str, str], str] = {}  # (url, cache) -> cache key of the manifest read last


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
        parts = urlsplit(endpoint)
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
    """Whether this process was forked from one that had started obstore's runtime (unusable here)."""
    return _runtime_pid is not None and _runtime_pid != os.getpid()


def client(bucket: str) -> Any:
    """This process's obstore client for `bucket`, made on first use (never shared across processes)."""
    global _runtime_pid
    config, options = _client_options()
    pid = os.getpid()
    key = (pid, bucket, repr(sorted(config.items())), repr(sorted(options.items())))  # the environment may change
    found = _clients.get(key)
    if found is not None:
        return found
    try:
        from obstore.store import S3Store
    except ImportError as e:
        raise StorageError(f"reading s3:// datasets needs obstore, which is not installed: {EXTRA}") from e
    made = S3Store(bucket, config=config, client_options=options,
                   retry_config={"max_retries": 0})  # dsc retries itself, counting and naming each try
    _clients[key] = made
    if _runtime_pid is None:
        _runtime_pid = pid
    return made


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
    raise StorageError(f"{where}: {what} failed {ATTEMPTS} times in {time.monotonic() - began:.1f} s; "
                       f"last: {_describe(last)}") from last


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
    downloaded once, under a lock. The index files are only ever added; records are deleted only by
    the record cache, at its own names (`dsc.storage.units`); nothing at a dataset file's name that is
    not a regular file is replaced or followed."""

    def __init__(self, url: str, cache_dir: str | os.PathLike | None = None, cache_bytes: int | None = None) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.root = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        self.cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self._text: bytes | None = None  # the manifest's bytes, as read
        self._key: str | None = None  # their SHA-256: the cache sub-folder of this dataset
        self._manifest: fmt.Manifest | None = None
        self._sizes: dict[str, int] = {}  # HEAD answers, so validating twice asks once
        self.cache_bytes = cache_bytes  # None: DEFAULT_SHARE of the free space, fixed at the first open

    # --------------------------------------------------------------------- the store's verbs

    def close(self) -> None:
        """Nothing to release: the client lives as long as the process, the copies in the cache."""

    def replaced(self) -> bool:
        """Never: a dataset is its manifest's bytes, and every copy is checked against them."""
        return False

    def read(self, name: str, limit: int) -> bytes:
        """The manifest from the bucket (a forked child: its parent's cached copy); another file from
        the cache when it holds it, else from the bucket."""
        if name == fmt.MANIFEST_FILE:
            return self._read_manifest(limit)
        fd = self._cached(name, None)
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                return f.read(limit)
        return self._get(name, 0, min(limit, self.size(name, name)), "GET")

    def size(self, name: str, where: str) -> int:
        """The cached copy's size where it has the size the manifest declares, else the object's (HEAD);
        a shard's declared size as it is (its ranges are fetched later, each checked for length and content)."""
        declared = fmt.declared_sizes(self._text or b"").get(name)
        if declared is not None and name.startswith(f"{fmt.SHARD_DIR}/"):
            return declared
        fd = self._cached(name, declared) if declared is not None else None
        if fd is not None:
            os.close(fd)
            return declared
        if name not in self._sizes:
            if _forked():
                raise self._forked_error(name)
            meta = self._call("HEAD", name, lambda: _obstore().head(client(self.bucket), self._key_of(name)),
                              missing=f"missing ({where} in the manifest)")
            self._sizes[name] = int(meta["size"])
        return self._sizes[name]

    def open(self, name: str, where: str) -> int:
        """A read-only descriptor of the cached copy of `name` (an index file: the reader's records come
        through `record_cache`), downloaded first if missing or of the wrong size; a download whose size
        or SHA-256 is wrong is fetched again, then is an error."""
        entry = self._entry(name, where)
        fd = self._cached(name, entry.bytes)
        if fd is not None:
            return fd
        if _forked():
            raise self._forked_error(name)
        self._check_budget()
        self._fetch(entry)
        for other in self._whole_files():  # the index, whole, once per node: a forked child finds it all
            if other.file != name:
                self._fetch(other)
        fd = self._cached(name, entry.bytes)
        if fd is None:
            raise DatasetError(f"{self.local_path(name)}: the cached copy of {self._at(name)} vanished or changed "
                               "right after it was downloaded; is another program writing into the cache?")
        return fd

    def get_range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a dataset file, from the bucket (retried as every request is)."""
        return self._get(name, start, stop, "GET")

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

    def _read_manifest(self, limit: int) -> bytes:
        remembered = _opened_keys.get((self.root, str(self.cache)))
        if _forked():
            if remembered is None:
                raise self._forked_error(fmt.MANIFEST_FILE)
            with open(self.cache / remembered / fmt.MANIFEST_FILE, "rb") as f:  # written by this node
                text = f.read(limit)
            if hashlib.sha256(text).hexdigest() != remembered:
                raise DatasetError(f"{self.cache / remembered / fmt.MANIFEST_FILE}: the cached manifest of "
                                   f"{self.root} was changed; it is not the one its name says")
        else:
            text = self._get(fmt.MANIFEST_FILE, 0, min(limit, self.size(fmt.MANIFEST_FILE, "the manifest")), "GET")
        self._text, self._key, self._manifest = text, hashlib.sha256(text).hexdigest(), None
        _opened_keys[(self.root, str(self.cache))] = self._key
        return text

    def _parsed(self) -> fmt.Manifest:
        if self._manifest is None:
            if self._text is None:
                self._read_manifest(fmt.MAX_MANIFEST_BYTES + 1)
            self._manifest = fmt.parse_manifest(self._text, self.root, self.size, self.read)
            self._keep_manifest()
        return self._manifest

    def _entry(self, name: str, where: str) -> fmt.FileEntry:
        for entry in self._parsed().files:
            if entry.file == name:
                return entry
        raise DatasetError(f"{self._at(name)}: not a file of this dataset ({where})")

    def _keep_manifest(self) -> None:
        """A copy of the manifest beside the cached files: the folder becomes a dataset of its own,
        and a forked child (which cannot call the bucket) reads its parent's manifest from it."""
        folder = self.local_folder()
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / fmt.MANIFEST_FILE).exists():
            self._place(folder / fmt.MANIFEST_FILE, lambda f: f.write(self._text))

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

    def _whole_files(self) -> list[fmt.FileEntry]:
        """The files cached whole: every one but the shards (whose records `record_cache` fetches)."""
        shards = {e.file for e in self._manifest.shards}
        return [e for e in self._manifest.files if e.file not in shards]

    def base_bytes(self) -> int:
        """What the cache holds besides records: the manifest's copy and the files cached whole."""
        return len(self._text or b"") + sum(e.bytes for e in self._whole_files())

    def budget(self) -> int:
        """`cache_bytes`, or by default DEFAULT_SHARE of the cache's free space at the first open plus what
        this dataset's folder holds already."""
        if self.cache_bytes is None:
            folder = self.local_folder()
            held = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
            self.cache_bytes = int(free_bytes(folder) * DEFAULT_SHARE) + held
        return self.cache_bytes

    def _check_budget(self) -> None:
        """Before anything is fetched: `cache_bytes` must hold the manifest, the index and one unit of
        records (a record, or with no per-record checksums a shard); say the minimum where it does not."""
        unit = self._manifest.record_bytes if self._manifest.checksums is not None else \
            max(e.bytes for e in self._manifest.shards)
        need = self.base_bytes() + unit
        if self.budget() < need:
            raise DatasetError(f"{self.root}: cache_bytes={self.budget()} cannot hold this dataset's index and one "
                               f"{'record' if self._manifest.checksums is not None else 'shard'}: at least {need} "
                               "bytes are needed; give a larger cache_bytes (or free space in the cache folder "
                               f"{self.cache}, whose default share is {DEFAULT_SHARE:.0%} of its free space)")

    def record_cache(self, manifest: fmt.Manifest):
        """The records' bounded cache (`dsc.storage.cache.RecordCache`) for a validated `manifest`."""
        from dsc.storage.cache import RecordCache

        self._parsed()
        self._check_budget()
        crcs = None
        if manifest.checksums is not None:
            fd = self.open(manifest.checksums.file, "checksums")
            with os.fdopen(fd, "rb") as f:
                crcs = np.frombuffer(f.read(manifest.checksums.bytes + 1), fmt.CHECKSUM_DTYPE)
            if len(crcs) != manifest.count:
                raise DatasetError(f"{self.local_path(manifest.checksums.file)}: {len(crcs)} checksums for "
                                   f"{manifest.count} records; the cached copy is damaged")
        return RecordCache(manifest, self.local_folder(), self.budget(), self.base_bytes(),
                           self.get_range, self._at, crcs)

    def _fetch(self, entry: fmt.FileEntry) -> None:
        """Download `entry` into the cache once per node: under its lock, unless another process did."""
        path = self.local_path(entry.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open_lock(path.with_name(f".{path.name}{LOCK_SUFFIX}"))
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            fd = self._cached(entry.file, entry.bytes)
            if fd is not None:  # another process of the node fetched it while this one waited
                os.close(fd)
                return
            problems = []
            for _ in range(FETCHES):
                problem = self._place(path, lambda f: self._download(entry, f), entry)
                if problem is None:
                    return
                problems.append(problem)
            raise DatasetError(f"{self._at(entry.file)}: downloaded {FETCHES} times, wrong each time "
                               f"({'; '.join(problems)}); the object in the bucket is damaged")
        finally:
            os.close(lock)

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
        """Write the object's bytes into `f` by ranged GETs; return their SHA-256."""
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

    def _get(self, name: str, start: int, stop: int, what: str) -> bytes:
        if _forked():
            raise self._forked_error(name)
        if stop <= start:
            return b""
        key = self._key_of(name)
        return bytes(self._call(what, name, lambda: _obstore().get_range(client(self.bucket), key, start=start,
                                                                             end=stop), missing="missing"))

    def _call(self, what: str, name: str, request, missing: str) -> Any:
        """`retried(request)`, naming this dataset's object; a missing one is `missing`."""
        try:
            return retried(what, self._at(name), request)
        except FileNotFoundError as e:
            raise DatasetError(f"{self._at(name)}: {missing}") from e

    def _forked_error(self, name: str) -> StorageError:
        return StorageError(f"{self._at(name)}: not in the cache {self.cache}, and this process cannot reach the "
                            "bucket: it was forked from one that already used the S3 client (obstore), whose "
                            "runtime does not survive fork. Open the dataset before forking (its files are then "
                            "cached), or start workers with multiprocessing_context='spawn' or 'forkserver'")


def _obstore():
    try:
        import obstore
    except ImportError as e:
        raise StorageError(f"reading s3:// datasets needs obstore, which is not installed: {EXTRA}") from e
    return obstore


def open_store(url: str, cache_dir: str | os.PathLike | None = None, cache_bytes: int | None = None) -> S3Dataset:
    """The store of an s3:// URL (what `dsc.storage.store.store_for` calls for the scheme)."""
    return S3Dataset(url, cache_dir, cache_bytes)


__all__ = ["S3Dataset", "open_store", "default_cache_dir", "parse_url", "EXTRA"]
