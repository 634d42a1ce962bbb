"""Publish: build beside OUT, then rename into place, so OUT is only ever absent or complete."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dsc import format as fmt
from dsc.errors import CompileError


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


def prepare(out: Path, force: bool) -> Path:
    """Check OUT and its parent, create a fresh staging folder and return it."""
    if out.exists() or out.is_symlink():
        if not force:
            raise CompileError(f"output {out} already exists; pass --force to replace it")
        if not out.is_dir() or not (is_dataset(out) or not any(out.iterdir())):
            raise CompileError(f"output {out} exists and is not a dsc dataset; refusing to replace it, "
                               "even with --force")
    parent = out.parent
    if not parent.is_dir():
        raise CompileError(f"the folder {parent} that should hold {out.name} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CompileError(f"cannot write in {parent} (permission denied)")
    stage = staging_path(out)
    if stage.exists():
        if not force:
            raise CompileError(f"an interrupted compile left a partial build at {stage}; delete it, "
                               "or pass --force to discard it")
        shutil.rmtree(stage)
    try:
        stage.mkdir()
    except OSError as e:
        raise CompileError(f"cannot create {stage}: {e.strerror or e}") from e
    return stage


def discard(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def publish(stage: Path, out: Path) -> None:
    """Move the finished build to OUT, replacing a previous dataset there (--force)."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.dsc-old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(stage, out)
    except BaseException:  # never leave OUT empty: put the previous dataset back
        if old is not None:
            os.rename(old, out)
        raise
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
