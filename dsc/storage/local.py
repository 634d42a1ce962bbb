"""Local files: the operating system's side of a dataset folder, with no knowledge of the format.

- `LocalFolder`: a folder held open by a descriptor, its files opened relative to it and never
  through a symbolic link (the reader's store for a path; see `dsc.storage.store`).
- Bounded reads: `scan_values` reads a file's typed values a piece at a time and skips the
  holes of sparse files, `pread_exact` reads an exact byte range.
- Durable writes: `write_durably` (temporary file, fsync, rename, fsync of the folder),
  `fsync_dir`, `reserve` (Linux `fallocate`, never glibc's emulation) and `renameat2`.
- Names in a folder others may write (OUT's parent): `create_exclusive` (a new file under an
  unguessable name, never through a link), `open_lock`, `read_no_follow`, and `foreign_entries` /
  `remove_claimed`, which walk and delete a tree by directory descriptors, never following a link.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np

from dsc.errors import DatasetError, quoted

HASH_CHUNK = 8 << 20
AT_FDCWD = -100  # linux/fcntl.h: a path relative to the working directory
RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2


class LocalFolder:
    """A dataset folder held open by a descriptor. Every file is opened relative to it, never
    through a symbolic link: a dataset swapped for another while it is opened (`dsc compile
    --force`) cannot mix their files, and no name can reach outside the folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError as e:
            raise DatasetError(f"{root}: does not exist (expected a compiled dsc dataset)") from e
        except NotADirectoryError as e:
            raise DatasetError(f"{root}: not a directory (expected a compiled dsc dataset)") from e
        except OSError as e:  # a name too long, a folder that may not be read, a loop of links
            raise DatasetError(f"{root}: cannot be opened: {e.strerror or e} (expected a compiled dsc dataset)") from e

    def close(self) -> None:
        os.close(self.fd)

    def duplicate(self) -> LocalFolder:
        """The same folder, held by a descriptor of its own (for what opens files after this one is closed)."""
        copy = object.__new__(LocalFolder)
        copy.root, copy.fd = self.root, os.dup(self.fd)
        return copy

    def local_folder(self) -> Path:
        """The folder itself: its files are local already."""
        return self.root

    def replaced(self) -> bool:
        """Whether the path now names another folder than the one held open (a recompile swapped it)."""
        held = os.fstat(self.fd)
        try:
            now = os.stat(self.root)
        except OSError:
            return True
        return (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)

    def open(self, name: str, where: str) -> int:
        """A read-only descriptor of the regular file `name` (relative, '/'-separated) in the folder;
        `where` says what named it, for messages."""
        parts = name.split("/")
        if name.startswith("/") or "\0" in name or any(part in ("", ".", "..") for part in parts):
            raise DatasetError(f"{self.root}: refusing to open {quoted(name, 80)} ({where}): not a plain relative path")
        dirs = []  # (the path is joined only for a message: joining it for every shard took a third of an open)
        try:
            for part in parts[:-1]:
                dirs.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=(dirs or [self.fd])[-1]))
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=(dirs or [self.fd])[-1])
        except FileNotFoundError as e:
            raise DatasetError(f"{self.root / name}: missing ({where} in the manifest)") from e
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):  # every mapped shard holds a descriptor
                raise DatasetError(f"{self.root / name}: too many open files; raise the limit (ulimit -n) above the "
                                   "number of shards") from e
            raise DatasetError(f"{self.root / name}: {where} must be a regular file inside the dataset folder, "
                               f"not a symbolic link or special file ({e.strerror})") from e
        finally:
            for d in dirs:
                os.close(d)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise DatasetError(f"{self.root / name}: {where} must be a regular file inside the dataset folder")
        return fd

    def list(self, folder: str) -> list[str]:
        """The names in the sub-folder `folder` (one plain name), never through a link; [] when it is missing."""
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise DatasetError(f"{self.root}/{folder}: must be a folder inside the dataset ({e.strerror})") from e
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def listed_sizes(self, folder: str) -> dict[str, int]:
        """The size of every regular file in the sub-folder `folder` ('' for the folder itself, '/'-separated),
        keyed by its name from the dataset's folder, from one listing, never through a link: 10^5 shards'
        sizes without 10^5 opens. A name not here is asked for with `size`, which says what is wrong."""
        dirs = []
        try:
            for part in folder.split("/") if folder else []:
                dirs.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=(dirs or [self.fd])[-1]))
            with os.scandir((dirs or [self.fd])[-1]) as entries:  # it reads a duplicate, and closes that
                stats = {e.name: e.stat(follow_symlinks=False) for e in entries}
        except OSError:
            return {}
        finally:
            for d in dirs:
                os.close(d)
        prefix = f"{folder}/" if folder else ""
        return {prefix + name: st.st_size for name, st in stats.items() if stat.S_ISREG(st.st_mode)}

    def size(self, name: str, where: str) -> int:
        fd = self.open(name, where)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def read(self, name: str, limit: int) -> bytes:
        """At most `limit` bytes of `name` (a caller that gets `limit` bytes knows the file is larger)."""
        with os.fdopen(self.open(name, name), "rb") as f:
            return f.read(limit)


def map_file(fd: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Map an open file read-only (`PROT_READ`, `MAP_SHARED`) as an array (the descriptor is closed:
    the map keeps the file); numpy cannot map an empty file, so an empty shape gives an empty array."""
    with os.fdopen(fd, "rb") as f:
        if 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(f, dtype=dtype, mode="r", shape=shape)


def scan_values(fd: int, dtype: np.dtype, count: int, piece: int) -> Iterator[np.ndarray]:
    """The first `count` values of an open file in pieces of at most `piece` values; a hole of a
    sparse file comes as one zero (a run of zeros has the same minimum, maximum and order as one
    zero), so the cost follows the bytes really stored, not the file's size. The pieces are read
    into one buffer (a fresh one each piece cost page faults: a third of the scan at 10^8 records),
    so a piece is valid until the next one is asked for."""
    size, item = count * dtype.itemsize, dtype.itemsize
    buffer = np.empty(min(piece, count) * item, np.uint8)
    position = 0
    while position < size:
        found = _seek(fd, position, "SEEK_DATA", size)
        data = found // item * item  # >= position: positions stay on item boundaries
        if data > position or found == size:
            yield np.zeros(1, dtype)
        hole = -(-_seek(fd, found, "SEEK_HOLE", size) // item) * item
        for start in range(data, hole, piece * item):
            yield _pread_into(fd, buffer[:min(piece * item, hole - start)], start).view(dtype)
        position = hole


def _pread_into(fd: int, out: np.ndarray, offset: int) -> np.ndarray:
    """`out` filled with the bytes at `offset`; a file that ends before is an error (it changed while read)."""
    view, done = memoryview(out), 0
    while done < len(out):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise DatasetError(f"file ended early at byte {offset + done} (it changed while being read?)")
        done += n
    return out


def _seek(fd: int, position: int, whence: str, size: int) -> int:
    """lseek's SEEK_DATA / SEEK_HOLE from `position`, within [position, size]; a file system
    without them has no holes (its data runs from `position` to `size`)."""
    try:
        return min(size, os.lseek(fd, position, getattr(os, whence)))
    except AttributeError:
        return position if whence == "SEEK_DATA" else size
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data (or hole) after `position`: the rest is a hole
            return size
        return position if whence == "SEEK_DATA" else size


def first_hole(fd: int) -> int | None:
    """Where the open file's first hole (bytes never written: a sparse file) starts; None when it has none.
    dsc never writes one, so a hole is damage, found in one `lseek` before hours of hashing zeros."""
    size = os.fstat(fd).st_size
    hole = _seek(fd, 0, "SEEK_HOLE", size)
    return hole if hole < size else None


def pread_exact(fd: int, n: int, offset: int) -> bytes:
    """Exactly `n` bytes at `offset`; a file that ends before is an error (it changed while read)."""
    data = b""
    while len(data) < n:
        piece = os.pread(fd, n - len(data), offset + len(data))
        if not piece:
            raise DatasetError(f"file ended early at byte {offset + len(data)} (it changed while being read?)")
        data += piece
    return data


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    """SHA-256 of a file, read in chunks (hashlib releases the GIL, so threads help);
    `progress(n)` is told of every n bytes hashed."""
    return sha256_fd(os.open(path, os.O_RDONLY | os.O_CLOEXEC), progress)


def sha256_fd(fd: int, progress: Callable[[int], None] | None = None) -> str:
    """SHA-256 of an open file from its start, as `sha256_file`; the descriptor is closed."""
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


# ----------------------------------------------------------------------------- durable writes

TEMP_SUFFIX = ".tmp"


def create_exclusive(path: Path, mode: int = 0o644) -> int:
    """A write descriptor of a new file at `path`: O_EXCL and O_NOFOLLOW, so nothing already there
    (a file, or a link someone planted) is ever truncated, written or followed."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def is_temporary(name: str) -> bool:
    """Whether `name` is one `write_durably` gives its temporary files (a kill may leave one behind)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def write_durably(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` atomically and durably: a crash or a full disk leaves the old file
    or the new one whole, never an empty or torn one (a temporary file, fsynced, renamed over),
    and once this returns the new name survives a crash too (the folder is fsynced after the rename).

    The temporary file has an unguessable name and is created exclusively (`create_exclusive`): in
    a folder others can write, a link planted at a predictable name would be followed and its target
    overwritten. The rename replaces a link at `path` itself, never its target."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TEMP_SUFFIX}")
    fd = create_exclusive(temp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)  # ours: made by create_exclusive above
        raise
    fsync_dir(path.parent)


def open_lock(path: Path) -> int:
    """A descriptor to `flock` on the lock file `path`, made if missing: read-only, never through a
    link (ELOOP), never truncated, a FIFO never waited on; the caller checks what it opened."""
    return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)


_held_locks: set[int] = set()  # descriptors of the lock files `locked` holds in this process now
_held_guard = threading.Lock()  # held while one is opened or closed, and across a fork


@contextmanager
def locked(path: Path) -> Iterator[int]:
    """Hold an exclusive `flock` on the lock file `path` (`open_lock`) for the `with` block. A `flock` belongs
    to the open file, which a child forked meanwhile shares through its copy of the descriptor: that copy
    would keep the file locked after this process let it go, until the child exited, and the child itself
    would wait on it forever. So a forked child closes its copies first (`_after_fork`)."""
    with _held_guard:
        fd = open_lock(path)
        _held_locks.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        with _held_guard:
            _held_locks.discard(fd)
            os.close(fd)


def hold_lock(path: Path) -> int | None:
    """Take the exclusive `flock` of the lock file `path` (made if missing) without waiting, and keep it until
    `let_go_lock`: its descriptor, or None while another open file holds it. A process holds it for as long as
    it lives (the kernel lets it go at the end), so others can tell it is alive (`lock_is_held`); a forked child
    closes its copy, as of `locked`'s (else the lock would outlive this process in the child)."""
    with _held_guard:
        fd = open_lock(path)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file")
        return _take(fd, fcntl.LOCK_EX)


def _take(fd: int, operation: int, lockless: bool = False) -> int | None:
    """`fd`, its `flock(operation)` taken without waiting and recorded as held (a forked child closes its copy);
    None, `fd` closed, while another open file holds a conflicting one. Any other failure closes `fd` and is
    raised, unless `lockless` (the descriptor is then kept unlocked). Under `_held_guard`."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        if not lockless:
            os.close(fd)
            raise
    _held_locks.add(fd)
    return fd


def let_go_lock(fd: int) -> None:
    """Close a descriptor of `hold_lock`. Without `_held_guard` (a finalizer may run this in the middle of
    anything): a fork at that moment leaves the child a copy that keeps the file locked until it exits."""
    _held_locks.discard(fd)
    with suppress(OSError):
        os.close(fd)


def hold_folder(path: Path) -> int | None:
    """Mark the folder `path` in use for as long as this process keeps the descriptor returned (a shared
    `flock` on the folder itself, let go by `let_go_lock`), so that `claim_folder` elsewhere leaves it alone;
    None when a `claim_folder` holds it now or deleted it (use another folder). On a file system without
    locks, the descriptor unlocked (`claim_folder` cannot tell there either). A `flock` is seen by the
    processes of this machine (on a network file system, perhaps not by another machine's)."""
    with _held_guard:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:  # deleted by one that claimed it a moment ago
            return None
        return _take(fd, fcntl.LOCK_SH, lockless=True)


def claim_folder(path: Path) -> int | None:
    """An exclusive `flock` on the folder `path` when no process marks it in use (`hold_folder`): its
    descriptor, to `let_go_lock` once done with it; None while one does. OSError where locks cannot tell."""
    with _held_guard:
        return _take(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC), fcntl.LOCK_EX)


def lock_is_held(path: Path, foreign: Callable[[str], Exception]) -> bool:
    """Whether some open file holds the `flock` of the lock file `path` (no such file: not held); a link or
    anything but a regular file there is refused (`foreign(what)`), never followed."""
    with _held_guard:  # (no fork copies the descriptor meanwhile, nor the shared lock it may take for a moment)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise foreign("not a regular file") from e
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise foreign("not a regular file")
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held (EWOULDBLOCK), or it cannot be told: held
            return True
        finally:
            os.close(fd)
        return False


def _after_fork() -> None:
    for fd in _held_locks:
        os.close(fd)
    _held_locks.clear()
    _held_guard.release()


os.register_at_fork(before=_held_guard.acquire, after_in_parent=_held_guard.release, after_in_child=_after_fork)


def read_no_follow(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of the regular file `path`, never read through a link (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return f.read(limit)


def _open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _entries(fd: int, prefix: str) -> list[tuple[str, str, bool]]:
    """(name, '/'-path from the top, is a folder) of a folder's entries, links never taken for folders."""
    with os.scandir(fd) as it:
        return sorted((e.name, prefix + e.name, e.is_dir(follow_symlinks=False)) for e in it)


Claims = Callable[[str, bool], bool]  # (a '/'-path from the top, is a folder) -> whether it is dsc's


def foreign_entries(root: Path, claims: Claims) -> list[str]:
    """The entries under the folder `root` that `claims` does not claim ('/'-paths, folders ending in
    '/'), walked by descriptors without following a link or entering an unclaimed folder."""
    found: list[str] = []

    def walk(fd: int, prefix: str) -> None:
        for name, path, is_dir in _entries(fd, prefix):
            if not claims(path, is_dir):
                found.append(path + "/" if is_dir else path)
            elif is_dir:
                sub = _open_dir(name, fd)
                try:
                    walk(sub, path + "/")
                finally:
                    os.close(sub)

    top = _open_dir(root)
    try:
        walk(top, "")
    finally:
        os.close(top)
    return found


def remove_claimed(root: Path, claims: Claims, last: str) -> list[str]:
    """Delete what `claims` claims under the folder `root`, deepest first and the top's `last` after
    everything else (so a deletion cut short by a kill is still recognisable), then `root` if that
    emptied it. Never follows a link and never touches an unclaimed entry, even one that appeared
    after the caller looked; returns what is left (empty when `root` is gone)."""
    def clear(fd: int, prefix: str) -> None:
        for name, path, is_dir in sorted(_entries(fd, prefix), key=lambda e: e[0] == last and not prefix):
            if not claims(path, is_dir):
                continue
            try:
                if is_dir:
                    sub = _open_dir(name, fd)
                    try:
                        clear(sub, path + "/")
                    finally:
                        os.close(sub)
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except OSError:
                pass  # gone already, not empty (something unclaimed is inside), or not ours to delete

    try:
        top = _open_dir(root)
    except FileNotFoundError:
        return []
    try:
        clear(top, "")
    finally:
        os.close(top)
    try:
        os.rmdir(root)
    except FileNotFoundError:
        pass
    except OSError:
        return foreign_entries(root, lambda path, is_dir: False)  # what is left, as it is now
    return []


def fsync_dir(path: Path) -> None:
    """Make the names in a folder durable (a rename, a new or removed file is an entry of the folder)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths: list[Path]) -> None:
    """Make writes made through other descriptors (workers' `pwrite`s) durable, one file open at a time."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def reserve(fd: int, size: int) -> None:
    """Give a file its final size with its disk blocks allocated now: a full disk fails here,
    with ENOSPC, instead of as SIGBUS when a worker later writes through the map.

    Linux's own `fallocate`, not `posix_fallocate`: where the file system cannot allocate (NFSv3,
    many FUSE file systems) glibc's `posix_fallocate` emulates it by writing into every block, a
    whole shard's worth of I/O before any decoding. There the file is made sparse instead."""
    if _fallocate(fd, size):
        return
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)  # the file system cannot reserve: a sparse file, extended only


def _fallocate(fd: int, size: int) -> bool:
    """Reserve [0, size) with the fallocate system call (never emulated); False where unsupported."""
    if size == 0:
        return True
    call = _libc_fallocate()
    if call is None:
        return False
    if call(fd, 0, 0, size) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


@functools.cache
def _libc_fallocate():
    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate64
    except (OSError, AttributeError):
        return None  # not Linux/glibc: the sparse fallback
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int
    return call


def renameat2(a: Path, b: Path, flags: int) -> bool:
    """Linux renameat2 (RENAME_NOREPLACE, RENAME_EXCHANGE); False where the system or file system
    cannot do `flags`."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if call(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def create_noreplace(temp: Path, target: Path) -> bool:
    """Give the written, fsynced file `temp` the name `target` only if nothing has it, atomically:
    renameat2(RENAME_NOREPLACE), or where that is missing a hard link (which fails on an existing
    name too) and the temporary removed. False when `target` exists: someone else made it first."""
    try:
        if not renameat2(temp, target, RENAME_NOREPLACE):
            os.link(temp, target)
            temp.unlink()
    except FileExistsError:
        temp.unlink(missing_ok=True)
        return False
    fsync_dir(target.parent)
    return True


FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): share a whole file's blocks (btrfs, XFS, bcachefs)


def reuse_file(src: Path, dst: Path) -> str:
    """Make `dst` a new file with `src`'s bytes, the cheapest way the storage allows: a reflink (its
    blocks shared, copy-on-write), else a hard link (the same file: neither is ever written again),
    else a copy. Returns which ("reflink", "link" or "copy")."""
    with open(src, "rb") as source:
        fd = create_exclusive(dst)
        try:
            fcntl.ioctl(fd, FICLONE, source.fileno())
            return "reflink"
        except OSError:
            pass
        finally:
            os.close(fd)
        dst.unlink()
        try:
            os.link(src, dst)
            return "link"
        except OSError:
            pass
        fd = create_exclusive(dst)
        try:
            copy_range(source.fileno(), fd, os.fstat(source.fileno()).st_size, 0, 0)
        finally:
            os.close(fd)
        return "copy"


def copy_range(src_fd: int, dst_fd: int, n: int, src_offset: int, dst_offset: int) -> None:
    """Copy `n` bytes between open files, in the kernel where it can (copy_file_range: no trip through
    this process, and a reflink where the file system can share the blocks)."""
    done = 0
    while done < n:
        try:
            moved = os.copy_file_range(src_fd, dst_fd, min(n - done, 1 << 30), src_offset + done, dst_offset + done)
        except (AttributeError, OSError):
            moved = os.pwrite(dst_fd, pread_exact(src_fd, min(n - done, HASH_CHUNK), src_offset + done),
                              dst_offset + done)
        if moved == 0:
            raise DatasetError(f"file ended early at byte {src_offset + done} (it changed while being copied?)")
        done += moved


_OWN_FILE_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link, never wait on a FIFO


def open_regular(path: Path, foreign: Callable[[str], Exception], create: bool = False) -> int:
    """A read-write descriptor of the regular file at one of dsc's own names (made if `create`); a link or
    anything else there is refused (`foreign(what)`: the error naming it), never followed; FileNotFoundError."""
    try:
        fd = os.open(path, _OWN_FILE_FLAGS | (os.O_CREAT if create else 0), 0o644)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise foreign("not a regular file") from e  # a link (ELOOP) or worse at our name
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise foreign("not a regular file")
    return fd


def remove_named(folder_fd: int, sub: str, names: Callable[[str], bool], first: str | None = None) -> int:
    """Delete the regular files of the subfolder `sub` of the folder open as `folder_fd` whose names `names`
    accepts (`first` before the others), by descriptors: never following a link (a link at `sub` is left, and
    nothing through it is touched) nor touching anything else; the disk blocks they took."""
    try:
        fd = _open_dir(sub, folder_fd)
    except OSError:  # missing, not a folder, a link
        return 0
    freed = 0
    try:
        for name, _, is_dir in sorted(_entries(fd, ""), key=lambda entry: entry[0] != first):
            if is_dir or not names(name):
                continue
            with suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    os.unlink(name, dir_fd=fd)
                    freed += st.st_blocks * 512
    finally:
        os.close(fd)
    return freed


CACHE_WRITE_ERRORS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM)  # `cache_writes` says


@contextmanager
def cache_writes(where: Path | str, root: str | None = None) -> Iterator[None]:
    """Writes into a cache folder: one that cannot be written (read-only, full, not this user's) raised as a
    DatasetError of one line with what to do (`where` names the file or folder when the error does not, `root`
    the dataset whose cache it is); any other system error as it is."""
    try:
        yield
    except OSError as e:
        if e.errno not in CACHE_WRITE_ERRORS:
            raise
        at = e.filename if e.filename is not None else where
        whose = f"the cache of {root}" if root else "the cache"
        raise DatasetError(f"{at}: {whose} cannot be written there ({e.strerror or e}); give cache_dir (or "
                           "$DSC_CACHE_DIR) a folder this user can write, with free space") from e


def map_shared(path: Path, nbytes: int, foreign: Callable[[str], Exception]) -> mmap.mmap:
    """The file of `nbytes` at one of dsc's own names, mapped shared (made, zeros, if missing or empty: processes
    doing it at once make the same); one of another size is refused (`foreign(what)`)."""
    fd = open_regular(path, foreign, create=True)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            reserve(fd, nbytes)  # its blocks now: a full disk is ENOSPC here, not SIGBUS at a write into the map
        elif size != nbytes:
            raise foreign(f"{size} bytes where it has {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
