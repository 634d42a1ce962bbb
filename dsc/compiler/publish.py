"""Publish: build beside OUT, then rename it into place, so OUT is only ever absent, the old
dataset or the new one — and nothing that is not a dsc dataset is ever replaced.

The states of a build and their transitions are the spec's ("Partial builds" in formats.md):
building (`plan.json` in `.OUT.dsc-partial`), compacting (`kept.bin`), finishing (the
`.OUT.dsc-publish` record beside OUT: the plan's and the manifest's SHA-256, so a resume acts
only on its own plan's build), and published with the old dataset waiting for deletion (it is
renamed to a unique `.OUT.dsc-old-*` first, never left where a build is looked for). Every state
file is written atomically and every rename is followed by an fsync of the folder. A compile
holds `.OUT.dsc-lock` (`flock`) from its first look at OUT to the end of its publish: one compile
per OUT at a time; the holder removes the file before releasing it (`unlock`). Without --force
the build is renamed with RENAME_NOREPLACE; with it, exchanged with RENAME_EXCHANGE (readers see
the old dataset or the new one) and exchanged back if what came out is not a dsc dataset.

`LocalTarget` is the compiler's publish seam over all this: `stage` (make or find the build),
`commit` (make it the dataset), `discard`. A bucket prefix will be its sibling.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

from dsc import format as fmt
from dsc.compiler import journal
from dsc.errors import CompileError
from dsc.storage import is_dataset, local, parse_manifest
from dsc.storage.local import RENAME_EXCHANGE, RENAME_NOREPLACE, fsync_dir, renameat2

LOCK_WAIT_S = 5.0


def staging_path(out: Path) -> Path:
    """The sibling folder a compile builds in; its name says what it is."""
    return out.parent / f".{out.name}.dsc-partial"


def replaceable(path: Path) -> bool:
    """What --force may replace: a dsc dataset or an empty folder, never a link or anything else."""
    if path.is_symlink() or not path.is_dir():
        return False
    return is_dataset(path) or not any(path.iterdir())


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.dsc-lock"


def retired_prefix(out: Path) -> str:
    """Replaced datasets wait for deletion under this prefix and a random suffix: never mistaken for a build."""
    return f".{out.name}.dsc-old-"


def record_path(out: Path) -> Path:
    """Where a finished build's publish is recorded until it is done (outside the build, which becomes OUT)."""
    return out.parent / f".{out.name}.dsc-publish"


def record_publish(out: Path, plan: str, manifest: str) -> None:
    """State "finishing": the build's manifest is written; `plan` and `manifest` are their SHA-256s."""
    local.write_durably(record_path(out), json.dumps({"plan": plan, "manifest": manifest}).encode())


def pending_publish(out: Path) -> dict | None:
    """The recorded publish of a finished build, or None when none is pending."""
    try:
        record = json.loads(record_path(out).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn: written atomically, so only a foreign hand does this; proves nothing
    return record if isinstance(record, dict) else {}


def clear_publish(out: Path) -> None:
    record_path(out).unlink(missing_ok=True)
    fsync_dir(out.parent)


def manifest_digest(root: Path) -> str | None:
    try:
        return hashlib.sha256((root / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def _check_out(out: Path, force: bool) -> None:
    if out.is_symlink():
        raise CompileError(f"output {out} is a symbolic link; give the folder it points to instead")
    if out.exists():
        if not replaceable(out):  # say so first: --force would not help
            what = "a file" if not out.is_dir() else "a folder that is not a dsc dataset"
            raise CompileError(f"output {out} is {what}; dsc replaces only a dsc dataset or an empty folder "
                               "(even with --force): give another OUT, or move it away first")
        if not force:
            raise CompileError(f"output {out} already exists; pass --force to replace it")
    if not out.parent.is_dir():
        raise CompileError(f"the folder {out.parent} that should hold {out.name} does not exist")
    if out.is_dir() and os.path.ismount(out):
        raise CompileError(f"output {out} is a mount point; a dataset is published by renaming a folder onto "
                           "it, which a mount point refuses: give a folder inside it instead")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CompileError(f"cannot write in {out.parent} (permission denied)")


def lock(out: Path, wait_s: float = LOCK_WAIT_S) -> int:
    """Hold OUT's lock for this compile (the caller gives it back with `unlock`).

    Waits a few seconds first: the workers of a compile killed a moment ago may still be exiting.
    """
    if out.parent.exists() and not out.parent.is_dir():
        raise CompileError(f"{out.parent} is a file, not a folder, so it cannot hold {out.name}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # like mkdir -p: out/train needs no out/ first
    except OSError as e:
        raise CompileError(f"cannot create the folder {out.parent} to hold {out.name}: {e.strerror or e}") from e
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(lock_path(out), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CompileError(f"cannot write in {out.parent} (creating the lock file {lock_path(out).name} failed: "
                               f"{e.strerror or e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if time.monotonic() >= deadline:
                raise CompileError(f"another dsc compile is writing {out} right now; wait for it to finish") from e
            time.sleep(0.05)
            continue
        if _names(fd, lock_path(out)):
            return fd
        os.close(fd)  # the holder before us removed this file on its way out: lock the one there now


def unlock(out: Path, fd: int) -> None:
    """Remove the lock file, then release it: a compile waiting on the removed file finds that
    the name no longer leads to it and locks a new one, so two never hold OUT at once."""
    try:
        if _names(fd, lock_path(out)):
            lock_path(out).unlink()
    finally:
        os.close(fd)


def _names(fd: int, path: Path) -> bool:
    """Whether `path` is the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def prepare(out: Path, force: bool, resume: bool, lock_fd: int) -> tuple[Path, bool]:
    """Under OUT's lock: check OUT, then give (staging folder, whether it holds work to resume)."""
    stage = staging_path(out)
    for grave in out.parent.glob(f"{glob.escape(retired_prefix(out))}*"):  # a kill stopped its deletion
        shutil.rmtree(grave, ignore_errors=True)
    if pending_publish(out) is not None:
        if resume:
            return stage, True
        if not force:
            raise CompileError(f"an interrupted compile left a finished build of {out} waiting to be published: run "
                               "the same command with --resume to publish it, or pass --force to discard it")
        clear_publish(out)
    _check_out(out, force)
    if stage.is_symlink() or stage.exists():
        if resume and stage.is_dir() and not stage.is_symlink():
            return stage, True
        if not force:
            raise CompileError(f"an interrupted compile left a partial build at {stage}: run the command that "
                               "started it again with --resume to continue it (other options are refused), or pass "
                               "--force to discard it")
        stage.unlink() if stage.is_symlink() or not stage.is_dir() else shutil.rmtree(stage)
    try:
        stage.mkdir()
        fsync_dir(out.parent)
    except OSError as e:
        raise CompileError(f"cannot create {stage}: {e.strerror or e}") from e
    return stage, False


def discard(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)


def _rename_noreplace(stage: Path, out: Path) -> None:
    """Move `stage` to `out` only if nothing is at `out`, atomically where the system can."""
    try:
        if renameat2(stage, out, RENAME_NOREPLACE):
            return
    except FileExistsError:
        raise CompileError(f"{out} appeared while the dataset was compiled; it was left untouched, and the "
                           f"finished build waits at {stage}: move {out} away and run with --resume") from None
    if out.exists() or out.is_symlink():  # no renameat2 here: the narrowest check we can make
        raise CompileError(f"{out} appeared while the dataset was compiled; it was left untouched")
    os.rename(stage, out)


def retire(old: Path, out: Path) -> None:
    """Give a replaced dataset a name of its own before deleting it: nothing may mistake it for a build."""
    grave = out.parent / f"{retired_prefix(out)}{secrets.token_hex(6)}"
    os.rename(old, grave)
    fsync_dir(out.parent)
    shutil.rmtree(grave, ignore_errors=True)


def publish(stage: Path, out: Path, force: bool) -> None:
    """Move the finished build to OUT. Without `force` nothing at OUT is ever replaced; with it,
    only a dsc dataset (or an empty folder) is, and anything else swapped out is put back."""
    if not (force and (out.exists() or out.is_symlink())):
        _rename_noreplace(stage, out)
    elif renameat2(stage, out, RENAME_EXCHANGE):
        if not replaceable(stage):
            renameat2(stage, out, RENAME_EXCHANGE)  # not ours to replace: put it back
            raise CompileError(f"{out} is not a dsc dataset (it changed while compiling); it was left "
                               "untouched, even with --force")
        fsync_dir(out.parent)
        retire(stage, out)  # the previous dataset; open maps keep it readable
    else:  # no atomic exchange here: a moment without OUT, never a mixed OUT
        if not replaceable(out):
            raise CompileError(f"{out} is not a dsc dataset; refusing to replace it, even with --force")
        old = out.parent / f"{retired_prefix(out)}{secrets.token_hex(6)}"
        os.rename(out, old)
        try:
            _rename_noreplace(stage, out)
        except BaseException:  # never leave OUT empty: put the previous dataset back
            os.rename(old, out)
            raise
        retire(old, out)
    fsync_dir(out.parent)


def finish_publish(stage: Path, out: Path, plan_digest: str, force: bool) -> fmt.Manifest | None:
    """State "finishing" (formats.md): publish the recorded build, or see that it already is.

    Acts only on a build this plan made: the record names the plan's and the manifest's SHA-256.
    None when no publish is pending (the build is still in progress)."""
    record = pending_publish(out)
    if record is None:
        return None
    if record.get("plan") != plan_digest:
        raise CompileError(f"a finished build of {out} made with other settings or sources waits to be published "
                           f"at {stage}; run the original command with --resume, or pass --force to discard it")
    if manifest_digest(out) == record["manifest"]:  # published; the stage holds the old dataset
        if stage.exists():
            retire(stage, out)
    elif manifest_digest(stage) == record["manifest"]:
        journal.remove(stage)
        publish(stage, out, force)
    else:
        raise CompileError(f"the finished build at {stage} is damaged or gone; pass --force to start over")
    clear_publish(out)
    return parse_manifest(out)


class LocalTarget:
    """OUT as a folder of this machine: the compiler's publish seam.

    `with LocalTarget(out) as target:` holds OUT's lock; `target.stage(force, resume)` makes the
    build folder (`target.stage_dir`, which the build's files are written into) or finds one to
    resume, `target.commit(plan_digest, force)` makes the finished build the dataset at OUT, and
    `target.discard()` drops it. A resumed build that had already finished is published by
    `target.pending(plan_digest, force)`.
    """

    def __init__(self, out: Path) -> None:
        self.out, self.stage_dir = out, staging_path(out)
        self._lock_fd: int | None = None

    def __enter__(self) -> LocalTarget:
        self._lock_fd = lock(self.out)
        return self

    def __exit__(self, *exc) -> None:
        unlock(self.out, self._lock_fd)

    def stage(self, force: bool, resume: bool) -> bool:
        """Make the build folder, or find the one to resume (True)."""
        return prepare(self.out, force, resume, self._lock_fd)[1]

    def restart(self) -> None:
        """Empty the build folder: what it holds was made from no plan."""
        discard(self.stage_dir)
        self.stage_dir.mkdir()

    def pending(self, plan_digest: str, force: bool) -> fmt.Manifest | None:
        """Publish a build of this plan that finished before an interruption; None when there is none."""
        return finish_publish(self.stage_dir, self.out, plan_digest, force)

    def commit(self, plan_digest: str, force: bool) -> fmt.Manifest:
        """Make the finished build the dataset at OUT: readers see the old dataset or the new one, whole."""
        record_publish(self.out, plan_digest, manifest_digest(self.stage_dir))
        return finish_publish(self.stage_dir, self.out, plan_digest, force)

    def discard(self) -> None:
        discard(self.stage_dir)
