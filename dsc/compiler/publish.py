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

What --force may replace (`replace_problem`): a folder that opens as a valid dataset and holds
nothing its manifest does not list, or an empty folder; checked before the swap, so nothing of a
user's is ever moved, and again on what the swap took out. What dsc deletes (a replaced dataset,
a build it discards) it deletes only when that holds nothing dsc did not make (`_made_by_dsc`),
checked just before, and then only what dsc made; anything else is left where it is, and said.
OUT's parent may be writable by others: every name dsc makes there is created without following
a link or truncating anything (`local.write_durably`, `local.open_lock`); formats.md, "Threats".

`LocalTarget` is the compiler's publish seam over all this: `stage` (make or find the build),
`commit` (make it the dataset), `discard`. A bucket prefix will be its sibling.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path

from dsc import format as fmt
from dsc.compiler import journal
from dsc.errors import CompileError, DatasetError, NotReplaceableError
from dsc.storage import files_of_versions, local, parse_manifest, validate
from dsc.storage.local import RENAME_EXCHANGE, RENAME_NOREPLACE, fsync_dir, renameat2

LOCK_WAIT_S = 5.0
SHOWN = 3  # entries a message names
MAX_RECORD_BYTES = 1 << 16  # a publish record is two hex digests in JSON

logger = logging.getLogger("dsc")


def staging_path(out: Path) -> Path:
    """The sibling folder a compile builds in; its name says what it is."""
    return out.parent / f".{out.name}.dsc-partial"


def replace_problem(path: Path) -> str | None:
    """Why --force may not replace `path` ("is ..."), or None: only a folder that opens as a valid
    dsc dataset (the reader's validation) and holds nothing its manifest does not list, or an empty
    folder, is replaced — a manifest.json saying "dsc" beside a user's files proves nothing."""
    if path.is_symlink() or not path.is_dir():
        return "is a symbolic link" if path.is_symlink() else "is a file"
    try:
        entries = sorted(p.name for p in path.iterdir())
        if not entries:
            return None
        validate(path)
        foreign = local.foreign_entries(path, _listed_only(path))
    except DatasetError as e:
        mine = [name for name in entries if name != fmt.MANIFEST_FILE]
        return (f"is a folder that is not a dsc dataset; it{f' holds {_some(mine)} and' if mine else ''} "
                f"does not open as one: {e}")
    except OSError as e:
        return f"is a folder that cannot be read whole ({e.strerror or e})"
    if foreign:
        return f"is a dsc dataset that also holds what its manifest does not list: {_some(foreign)}"
    return None


def _some(names: list[str]) -> str:
    """Up to SHOWN names, and how many more."""
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _folders_of(names: set[str]) -> set[str]:
    """Every folder on the way to the '/'-paths `names`."""
    return {"/".join(name.split("/")[:k]) for name in names for k in range(1, name.count("/") + 1)}


def _listed_only(root: Path) -> local.Claims:
    """A dataset's own entries: its manifests (format 1.3: every version's), the files they list and the
    folders holding them, and what an append killed before its commit left in `appends/` (dsc's names)."""
    files = files_of_versions(root)
    folders = _folders_of(files)

    def claims(path: str, is_dir: bool) -> bool:
        if path.startswith(f"{fmt.APPENDS_DIR}/") or path == fmt.APPENDS_DIR:
            return fmt.is_dataset_folder_name(path) if is_dir else fmt.is_dataset_file_name(path)
        return path in (folders if is_dir else files)
    return claims


def _made_by_dsc(root: Path) -> local.Claims:
    """What dsc may delete of a build or of a dataset it replaced, even one part deleted: the files
    its manifest lists (while it has one), the names dsc gives a build's files, resume files and
    temporaries, and the folders holding them. Anything else is someone's, and stays."""
    try:
        listed = files_of_versions(root)
    except (OSError, DatasetError):
        listed = set()
    folders = _folders_of(listed)

    def claims(path: str, is_dir: bool) -> bool:
        if is_dir:
            return path in folders or fmt.is_dataset_folder_name(path)
        folder, _, name = path.rpartition("/")
        return (path in listed or fmt.is_dataset_file_name(path) or path in journal.STATE_FILES
                or ((not folder or folder in folders) and local.is_temporary(name)))
    return claims


def _remove_build(folder: Path) -> list[str]:
    """Delete a build or a replaced dataset when it holds only what dsc made, and then only that;
    return what was left (nothing, or the entries dsc did not make, with nothing deleted). A link at
    its name is removed, never followed: that loses nothing."""
    if folder.is_symlink():
        folder.unlink()
        return []
    if not folder.is_dir():
        return [f"{folder.name} itself, a file"]
    try:
        claims = _made_by_dsc(folder)
        return local.foreign_entries(folder, claims) or local.remove_claimed(folder, claims, fmt.MANIFEST_FILE)
    except FileNotFoundError:
        return []
    except OSError as e:
        return [f"what could not be read ({e.strerror or e})"]


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
        record = json.loads(local.read_no_follow(record_path(out), MAX_RECORD_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn, a link, not a file: written atomically, so only a foreign hand does this; proves nothing
    return record if isinstance(record, dict) else {}


def clear_publish(out: Path) -> None:
    record_path(out).unlink(missing_ok=True)
    fsync_dir(out.parent)


def manifest_digest(root: Path) -> str | None:
    try:
        return hashlib.sha256((root / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    except OSError:
        return None


def already_exists(out: str, resume_found_nothing: bool, more: str = "") -> CompileError:
    """The refusal of an OUT that holds a dataset, without --force (a folder, or a prefix in a bucket); after a
    --resume that found no partial build, what may have happened."""
    why = (" (--resume found no partial build of it to continue: an earlier run may have finished before it was "
           f"stopped; dsc info {out} shows what is there)") if resume_found_nothing else ""
    return CompileError(f"output {out} already exists; pass --force to replace it{more}{why}")


def check_out(out: Path, force: bool, resume_found_nothing: bool = False) -> None:
    """Refuse an OUT that is a link, holds what dsc never replaces, or holds a dataset without --force."""
    if out.is_symlink():
        raise CompileError(f"output {out} is a symbolic link; give the folder it points to instead")
    if out.exists():
        problem = replace_problem(out)
        if problem:  # say so first: --force would not help
            raise NotReplaceableError(_refusal(out, problem))
        if not force:
            raise already_exists(str(out), resume_found_nothing)
    if not out.parent.is_dir():
        raise CompileError(f"the folder {out.parent} that should hold {out.name} does not exist")
    if out.is_dir() and os.path.ismount(out):
        raise CompileError(f"output {out} is a mount point; a dataset is published by renaming a folder onto "
                           "it, which a mount point refuses: give a folder inside it instead")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise CompileError(f"cannot write in {out.parent} (permission denied)")


def _refusal(out: Path, problem: str) -> str:
    """Why OUT is not replaced and what to do, in one line."""
    what, _, why = problem.partition("; ")
    if "also holds" in what:
        return (f"output {out} {what}; dsc replaces only a dsc dataset or an empty folder (even with --force) "
                f"and never deletes what is not its own: move those out of {out}, or give another OUT")
    return (f"output {out} {what}; dsc replaces only a dsc dataset or an empty folder (even with --force): "
            f"give another OUT, or move it away first{f' ({why})' if why else ''}")


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
            fd = local.open_lock(lock_path(out))
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                what = "a symbolic link, which dsc never makes nor follows" if e.errno == errno.ELOOP else "a folder"
                raise CompileError(f"the lock file {lock_path(out)} is {what}: remove it and run again") from e
            raise CompileError(f"cannot write in {out.parent} (creating the lock file {lock_path(out).name} failed: "
                               f"{e.strerror or e})") from e
        problem = _lock_problem(fd)
        if problem:
            os.close(fd)
            raise CompileError(f"the lock file {lock_path(out)} {problem}, so no compile of yours made it: remove "
                               "it and run again")
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


def _lock_problem(fd: int) -> str | None:
    """Why the opened lock file is not one this user's dsc made: it must be a regular file of this user
    (a compile of another user's holds its own lock, and is refused here rather than run alongside)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"belongs to another user (uid {st.st_uid})"
    return None


def unlock(out: Path, fd: int) -> None:
    """Remove the lock file, then release it: a compile waiting on the removed file finds that
    the name no longer leads to it and locks a new one, so two never hold OUT at once."""
    try:
        if _names(fd, lock_path(out)):
            lock_path(out).unlink()
    finally:
        os.close(fd)


def _names(fd: int, path: Path) -> bool:
    """Whether `path` (not followed, if a link) is the file open as `fd`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def prepare(out: Path, force: bool, resume: bool, lock_fd: int, command: str = "compile") -> tuple[Path, bool]:
    """Under OUT's lock: check OUT, then give (staging folder, whether it holds work to resume). `command`: the
    one writing OUT, as its refusals name it ("merge" has no --resume: they say so)."""
    stage = staging_path(out)
    for grave in out.parent.glob(f"{glob.escape(retired_prefix(out))}*"):  # a kill stopped its deletion
        delete_retired(grave)
    remove_temporaries(out.parent, f".{record_path(out).name}.")
    if pending_publish(out) is not None:
        if resume:
            return stage, True
        if not force:
            raise CompileError(f"an interrupted {'compile' if command == 'compile' else 'compile or merge'} left a "
                               f"finished build of {out} waiting to be published: " + _continue_hint(command,
                                                                                                    "publish it"))
        clear_publish(out)
    check_out(out, force, resume and not (stage.is_symlink() or stage.exists()))
    if stage.is_symlink() or stage.exists():
        if resume and stage.is_dir() and not stage.is_symlink():
            _check_resumable(stage)
            for folder in (stage, stage / fmt.FIELD_DIR):
                remove_temporaries(folder)
            return stage, True
        if not force:
            raise CompileError(f"an interrupted {'compile' if command == 'compile' else 'compile or merge'} left a "
                               f"partial build at {stage}: " + _continue_hint(command, "continue it"))
        discard(stage, refuse=True)
    make_stage(stage)
    return stage, False


def _continue_hint(command: str, what: str) -> str:
    if command == "compile":
        return (f"run the command that started it again with --resume to {what} (with the same options: with others "
                "--resume is refused), or pass --force to discard it")
    return f"dsc {command} cannot continue it: pass --force to discard it"


def make_stage(stage: Path) -> None:
    """Create the build folder, writable by this user alone: nobody else can plant a link in it that
    the build's writes would follow (it becomes OUT: readable by all, as before)."""
    try:
        stage.mkdir(mode=0o755)
        fsync_dir(stage.parent)
    except OSError as e:
        raise CompileError(f"cannot create {stage}: {e.strerror or e}") from e


def remove_temporaries(folder: Path, prefix: str = ".") -> None:
    """The temporary files of `local.write_durably` that a kill left in `folder` (with this prefix):
    their names are random, so no later write replaces them, and none may be published."""
    for path in folder.glob(f"{glob.escape(prefix)}*{local.TEMP_SUFFIX}"):
        if local.is_temporary(path.name) and not path.is_dir():  # a link is removed, never followed
            path.unlink(missing_ok=True)


def _check_resumable(stage: Path) -> None:
    """A build is written into only when nobody else could have planted a link in it."""
    st = os.lstat(stage)
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_IWOTH:
        raise CompileError(f"cannot resume {stage}: it is not a folder that only you can write (owner uid "
                           f"{st.st_uid}, mode {stat.filemode(st.st_mode)}), so it may hold links that writing "
                           "would follow; move it away and compile again")


def discard(stage: Path, refuse: bool = False) -> None:
    """Delete a build: a link at its name is removed (never followed), a folder only if it holds nothing
    dsc did not make, and then only what dsc made. What stays is refused (`refuse`) or warned about."""
    left = _remove_build(stage) if stage.exists() or stage.is_symlink() else []
    if not left:
        return
    message = (f"the partial build at {stage} holds what dsc did not make ({_some(left)}), so it was left "
               "there: move those out of it (or it away), then run again")
    if refuse:
        raise NotReplaceableError(message)
    logger.warning("%s", message)


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
    delete_retired(grave)


def delete_retired(grave: Path) -> None:
    """Delete a replaced dataset, or what a kill left of its deletion, re-checked now: if it holds
    anything dsc did not make (written into it since it was checked), it is left, and said where."""
    left = _remove_build(grave)
    if left:
        logger.warning("%s", f"a dataset replaced by --force waits at {grave}: it holds what dsc did not make "
                             f"({_some(left)}), so it was not deleted; move out what is yours, then delete it")


def _changed(stage: Path, out: Path, problem: str) -> NotReplaceableError:
    what = problem.split("; ")[0]
    return NotReplaceableError(f"{out} appeared or changed while the dataset was compiled: it {what}; "
                               f"it was left untouched, even with --force, and the finished build waits at {stage}: "
                               f"move {out} away (or what is not the dataset's out of it) and run with --resume")


def publish(stage: Path, out: Path, force: bool) -> None:
    """Move the finished build to OUT. Without `force` nothing at OUT is ever replaced; with it, only
    a dsc dataset holding nothing else (or an empty folder) is — checked before the swap, so nothing
    of a user's is moved, and again on what the swap took out, which is put back if it changed."""
    if not (force and (out.exists() or out.is_symlink())):
        _rename_noreplace(stage, out)
        fsync_dir(out.parent)
        return
    problem = replace_problem(out)
    if problem:
        raise _changed(stage, out, problem)
    if renameat2(stage, out, RENAME_EXCHANGE):
        problem = replace_problem(stage)
        if problem:
            renameat2(stage, out, RENAME_EXCHANGE)  # it changed since the check: put it back
            raise _changed(stage, out, problem)
        fsync_dir(out.parent)
        retire(stage, out)  # the previous dataset; open maps keep it readable
    else:  # no atomic exchange here: a moment without OUT, never a mixed OUT
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

    def stage(self, force: bool, resume: bool, command: str = "compile") -> bool:
        """Make the build folder, or find the one to resume (True); `command` writes OUT (see `prepare`)."""
        return prepare(self.out, force, resume, self._lock_fd, command)[1]

    def restart(self) -> None:
        """Empty the build folder: what it holds was made from no plan."""
        discard(self.stage_dir, refuse=True)
        make_stage(self.stage_dir)

    def pending(self, plan_digest: str, force: bool) -> fmt.Manifest | None:
        """Publish a build of this plan that finished before an interruption; None when there is none."""
        return finish_publish(self.stage_dir, self.out, plan_digest, force)

    def commit(self, plan_digest: str, force: bool) -> fmt.Manifest:
        """Make the finished build the dataset at OUT: readers see the old dataset or the new one, whole."""
        record_publish(self.out, plan_digest, manifest_digest(self.stage_dir))
        return finish_publish(self.stage_dir, self.out, plan_digest, force)

    def discard(self) -> None:
        discard(self.stage_dir)
