"""Publish: build beside OUT, then swap it into place, so OUT is only ever absent or complete.

The build lives in `.OUT.dsc-partial` next to OUT and survives an interrupted compile so that
`--resume` can continue it. A compile holds `.OUT.dsc-lock` (`flock`, a file never deleted)
from its first look at OUT to the end of its publish: one compile per OUT at a time. Publishing exchanges
the finished folder with the previous dataset in one atomic `renameat2(RENAME_EXCHANGE)` where
the system has it: readers see the old dataset or the new one, never no dataset.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import time
from pathlib import Path

from dsc import format as fmt
from dsc.errors import CompileError

LOCK_WAIT_S = 5.0
RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100


def staging_path(out: Path) -> Path:
    """The sibling folder a compile builds in; its name says what it is."""
    return out.parent / f".{out.name}.dsc-partial"


def is_dataset(path: Path) -> bool:
    """Whether `path` looks like a dsc dataset (so --force may replace it)."""
    try:
        with open(path / fmt.MANIFEST_FILE, "rb") as f:
            return json.loads(f.read(fmt.MAX_MANIFEST_BYTES)).get("format") == fmt.FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.dsc-lock"


def _check_out(out: Path, force: bool) -> None:
    if out.is_symlink():
        raise CompileError(f"output {out} is a symbolic link; give the folder it points to instead")
    if out.exists():
        if not force:
            raise CompileError(f"output {out} already exists; pass --force to replace it")
        if not out.is_dir() or not (is_dataset(out) or not any(out.iterdir())):
            raise CompileError(f"output {out} exists and is not a dsc dataset; refusing to replace it, "
                               "even with --force")
    if not out.parent.is_dir():
        raise CompileError(f"the folder {out.parent} that should hold {out.name} does not exist")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CompileError(f"cannot write in {out.parent} (permission denied)")


def lock(out: Path, wait_s: float = LOCK_WAIT_S) -> int:
    """Hold OUT's lock for this compile (the caller closes the descriptor when done).

    Waits a few seconds first: the workers of a compile killed a moment ago may still be exiting.
    """
    if not out.parent.is_dir():
        raise CompileError(f"the folder {out.parent} that should hold {out.name} does not exist")
    try:
        fd = os.open(lock_path(out), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CompileError(f"cannot write in {out.parent}: {e.strerror or e}") from e
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as e:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise CompileError(f"another dsc compile is writing {out} right now; wait for it to finish") from e
            time.sleep(0.05)


def prepare(out: Path, force: bool, resume: bool, lock_fd: int) -> tuple[Path, bool]:
    """Under OUT's lock: check OUT, then give (staging folder, whether it holds work to resume)."""
    _check_out(out, force)
    stage = staging_path(out)
    if stage.is_symlink() or stage.exists():
        if resume and stage.is_dir() and not stage.is_symlink():
            return stage, True
        if not force:
            raise CompileError(f"an interrupted compile left a partial build at {stage}: run the same command "
                               "with --resume to continue it, or pass --force to discard it")
        stage.unlink() if stage.is_symlink() or not stage.is_dir() else shutil.rmtree(stage)
    try:
        stage.mkdir()
    except OSError as e:
        raise CompileError(f"cannot create {stage}: {e.strerror or e}") from e
    return stage, False


def discard(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(a))


def publish(stage: Path, out: Path) -> None:
    """Move the finished build to OUT, replacing a previous dataset there (--force)."""
    if out.exists() and _exchange(stage, out):
        shutil.rmtree(stage, ignore_errors=True)  # now the previous dataset; open maps keep it readable
    else:
        old = None
        if out.exists():  # no atomic exchange here: a moment without OUT, never a mixed OUT
            old = out.parent / f".{out.name}.dsc-old-{os.getpid()}"
            os.rename(out, old)
        try:
            os.rename(stage, out)
        except BaseException:  # never leave OUT empty: put the previous dataset back
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
