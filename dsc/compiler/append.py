"""Append: grow a dataset folder by the images of SRC, as a new version (format 1.3), decoding only SRC.

SRC is compiled first, aside (a private scratch folder beside the dataset), with the dataset's own
options: size, fit, decode mode, alpha, pixel limit, seed, shuffle, shard size. Then, under the
dataset's lock and on its latest version (another append may have landed meanwhile), its records
are joined after the dataset's (`combine`): the dataset's full shards stay as they are, its last
shard, when partial, is copied with the first new records into a new file (record i stays in shard
i // R), and the index is written again for the joined records, into `appends/<random>/`. The new
version's manifest is committed create-only (`versions.commit`); where a writer that takes no lock of
this machine committed that version first, the append builds the next one again on it (`grow`). A kill
at any moment leaves the dataset at its previous version, whole; what the killed append wrote is cleared
by the next writer. A dataset in a bucket is appended to by `append_bucket`.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import versions
from dsc.compiler.grow import (
    COMMIT_ATTEMPTS,
    AppendSummary,
    compile_new,
    join_for_append,
    lost_every_race,
    next_version,
    refuse_a_repeat,
    summary,
)
from dsc.errors import CompileError
from dsc.storage import local

SCRATCH_LOCK = "owner.lock"  # held by the append that made a scratch folder, for as long as it lives


def scratch_prefix(root: Path) -> str:
    return f".{root.name}.dsc-append-"


def _clear_dead_scratch(root: Path) -> None:
    """Remove scratch folders of appends that were killed: one whose owner lock nobody holds any more,
    made by this user alone (mode 0700), never followed through a link."""
    for folder in root.parent.glob(f"{scratch_prefix(root).replace('[', '[[]')}*"):
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
                continue
            fd = os.open(folder / SCRATCH_LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live append's
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)


class _Scratch:
    """A private folder beside the dataset where SRC is compiled; removed when the append ends."""

    def __init__(self, root: Path) -> None:
        _clear_dead_scratch(root)
        self.path = root.parent / f"{scratch_prefix(root)}{secrets.token_hex(8)}"
        try:
            self.path.mkdir(mode=0o700)
        except OSError as e:
            raise CompileError(f"cannot write beside {root} (an append compiles its new images in {self.path} "
                               f"first): {e.strerror or e}") from e
        os.chmod(self.path, 0o700)  # whatever the umask: only we write here
        lock, self._fd = self.path / SCRATCH_LOCK, -1
        try:
            self._fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError as e:  # (a file system without locks): nothing left behind, and said in one line
            self.close()
            raise CompileError(f"cannot lock {lock} (an append holds it while it compiles there, so that no "
                               f"other append removes the folder as a killed one's): {e.strerror or e}") from e

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def append(dataset: str | os.PathLike, src: str | os.PathLike, *, labels: str | os.PathLike | None = None,
           columns: dict[str, str] | None = None, new_classes: bool = False, workers: int | None = None,
           strict: bool = False, on_total: Callable[[int], None] | None = None,
           progress: Callable[[int], None] | None = None,
           on_skip: Callable[[str, str], None] | None = None, again: bool = False) -> AppendSummary:
    """Add the images of `src` (or the rows of the label table `labels`) to the dataset `dataset` (a folder, or
    an s3:// URL: `append_bucket`) as its next version; see `dsc append --help`. Raises CompileError; the
    dataset is then unchanged, also when its last append added the same images of `src` (a re-run after a
    kill that hid the commit), unless `again`."""
    started = time.perf_counter()
    compiling = {"labels": labels, "columns": columns, "workers": workers, "strict": strict, "on_total": on_total,
                 "progress": progress, "on_skip": on_skip}
    if storage.is_url(dataset):
        from dsc.compiler.append_bucket import append_to_bucket

        return append_to_bucket(os.fspath(dataset), src, new_classes, compiling, started, again)
    root = Path(dataset).absolute()
    base = storage.parse_manifest(root)
    if not storage.is_url(src) and Path(src).resolve() in root.resolve().parents:
        raise CompileError(f"the dataset {root} is inside the source folder {src}, whose images an append compiles "
                           "beside the dataset first: give SRC a folder that does not hold it")
    scratch = _Scratch(root)
    try:
        new = compile_new(base, root, src, scratch.path / "new", **compiling)
        with versions.writing(root):
            try:
                version, how, joined, built_on = _commit_on_latest(root, new, new_classes, src, again)
            except OSError as e:  # a full disk, a permission: nothing is committed
                raise CompileError(f"writing the next version of {root} failed ({e}); it is still at its previous "
                                   "version, and what was written is cleared by the next append or prune") from e
    finally:
        scratch.close()
    return summary(root, built_on, new, version, joined, how, started)


def _commit_on_latest(root: Path, new: storage.OpenedDataset, new_classes: bool, src, again: bool) -> tuple:
    """Under the lock: join the compiled records after the latest version's, write them, commit; where a
    writer that bypasses the lock committed that version first, start again on the new latest one."""
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        base = storage.open_dataset(root)
        if not again:
            refuse_a_repeat(root, base, new)
        joined, kept = join_for_append(base, new, new_classes, [str(root), str(src)])
        with versions.new_folder(root) as folder:  # marked in use until the commit lists it
            manifest, how = next_version(root, folder, base, new, joined, kept)
            local.fsync_dir(root / folder / fmt.SHARD_DIR)
            local.fsync_dir(root / folder)
            local.fsync_dir(root / fmt.APPENDS_DIR)
            local.fsync_dir(root)
            storage.check_manifest_text(root, manifest.to_json().encode("ascii"),  # never commit what readers refuse
                                        kept_segments=len(kept))
            try:
                versions.commit(root, manifest)
                return manifest, how, joined, base.manifest
            except versions.VersionTaken as e:
                if attempt == COMMIT_ATTEMPTS:
                    versions.discard(root, folder)
                    raise lost_every_race(root, e) from e
                versions.discard(root, folder)  # this attempt's files: no version lists them
    raise AssertionError("unreachable")  # the loop returns or raises
