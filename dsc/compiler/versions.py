"""Versions of a dataset folder (format 1.3): commit a new one, and prune old ones.

A version is committed by creating its manifest, `versions/NNNNNNNN.json`, under a name nothing
has yet (`local.create_noreplace`: renameat2(RENAME_NOREPLACE), or a hard link): of two writers
that both built version N + 1, exactly one creates it, and the other learns so and adds nothing.
Nothing a version lists is ever rewritten, so readers of older versions are never disturbed.
`manifest.json` is then refreshed to a copy of the latest version, for readers that do not know
versions. The first commit on a dataset without `versions/` (any 1.0 - 1.2 dataset, or a fresh
compile) first saves its `manifest.json` as `versions/00000001.json`, create-only too.

Writers of new versions and `prune` hold the dataset's lock (`publish.lock`, the one a compile
holds) while they write in it, so a local append waits for another instead of racing it; the
create-only commit is what keeps a writer that does not take the lock (another machine on a shared
file system, an object store) from ever overwriting a version.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import publish
from dsc.compiler.grow import Pruned, VersionTaken
from dsc.errors import CompileError
from dsc.storage import local

WRITER_WAIT_S = 600.0  # how long an append or a prune waits for the dataset's lock (another append's commit)
ABANDONED_AFTER_S = fmt.ABANDONED_AFTER_S  # where locks cannot tell whether an append folder's writer lives
FOLDER_ATTEMPTS = 3


@contextmanager
def writing(root: Path, wait_s: float = WRITER_WAIT_S) -> Iterator[tuple[list[str], int]]:
    """Hold the dataset's lock (the one a compile holds) while writing in it: abandoned work of a writer
    killed meanwhile is cleared first (what `clear_abandoned` deleted is yielded). The lock is the dataset
    folder's own, whatever name it is given (a link to it, `latest -> ds`, takes `ds`'s): two names must
    never let two writers in at once."""
    real = root.resolve()
    fd = publish.lock(real, wait_s)
    try:
        yield clear_abandoned(root)
    finally:
        publish.unlock(real, fd)


def listed_by_versions(root: Path) -> set[str]:
    """Every file some version's manifest (or `manifest.json`) lists, with those manifests themselves;
    DatasetError when one cannot be read (what deletes the rest must know them all)."""
    return storage.files_of_versions(root, strict=True)


def _versions(root: Path) -> list[int]:
    folder = local.LocalFolder(root)
    try:
        return storage.store.versions(folder)
    finally:
        folder.close()


def clear_abandoned(root: Path) -> tuple[list[str], int]:
    """Delete what writers killed before their commit left in the dataset: files under `appends/` that no
    version lists (only names dsc gives them), in append folders no live writer marks in use (`new_folder`),
    and temporaries in `versions/`; (what was deleted, its bytes). Where the file system has no locks, an
    append folder whose files are all ABANDONED_AFTER_S old is taken as abandoned. One folder is claimed at a
    time, and only one holding something no version lists (a dataset may have thousands of append folders)."""
    appends, removed, freed = root / fmt.APPENDS_DIR, [], 0
    if appends.is_dir() and not appends.is_symlink():
        listed = listed_by_versions(root)
        for entry in sorted(os.scandir(appends), key=lambda e: e.name):
            folder = f"{fmt.APPENDS_DIR}/{entry.name}"
            if not entry.is_dir(follow_symlinks=False) or not fmt.is_dataset_folder_name(folder) \
                    or not _holds_unlisted(root, folder, listed):
                continue
            fd = _claim_if_abandoned(root / folder)
            if fd is None:
                continue
            try:
                listed = listed_by_versions(root)  # read once claimed: a writer commits before it lets go
                gone, size = _remove_unlisted(root, folder, listed)
            finally:
                local.let_go_lock(fd)
            removed, freed = removed + gone, freed + size
        with suppress(OSError):
            os.rmdir(appends)  # emptied (a writer that finds it gone makes it again: `new_folder`)
    if (root / fmt.VERSIONS_DIR).is_dir():
        publish.remove_temporaries(root / fmt.VERSIONS_DIR)
    return removed, freed


def _holds_unlisted(root: Path, folder: str, listed: set[str]) -> bool:
    """Whether the append folder holds a file no version lists, or none at all."""
    files = [os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
             for d, _, names in os.walk(root / folder) for n in names]
    return not files or any(f not in listed for f in files)


def _remove_unlisted(root: Path, folder: str, listed: set[str]) -> tuple[list[str], int]:
    """Delete the files of an append folder that no version lists (names dsc gives only), then the folder if
    that emptied it; (what was deleted, its bytes)."""
    removed, freed = [], 0

    def claims(path: str, is_dir: bool) -> bool:  # `path` is relative to the folder
        nonlocal freed
        name = f"{folder}/{path}"
        if is_dir:
            return fmt.is_dataset_folder_name(name)
        if not fmt.is_dataset_file_name(name) or name in listed:
            return False
        freed += os.lstat(root / name).st_size
        removed.append(name)
        return True
    local.remove_claimed(root / folder, claims, "")
    return removed, freed


LOCKLESS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # what flock says where it has no locks


def _claim_if_abandoned(folder: Path) -> int | None:
    """`local.claim_folder`, or where locks cannot tell, a descriptor of the folder once every file in it is
    ABANDONED_AFTER_S old; None while a writer may still be at work in it."""
    try:
        return local.claim_folder(folder)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno not in LOCKLESS:
            raise
    newest = max((os.lstat(os.path.join(d, n)).st_mtime for d, _, names in os.walk(folder) for n in [".", *names]),
                 default=0.0)
    if time.time() - newest < ABANDONED_AFTER_S:
        return None
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextmanager
def new_folder(root: Path) -> Iterator[str]:
    """A new append folder `appends/<random tag>` (its name relative to `root`), marked in use for the block
    (`local.hold_folder`), so that no other writer's `clear_abandoned` deletes what is written there before
    the commit lists it: one that bypasses the dataset's lock included, on this machine (a network file
    system may not show a `flock` to another machine)."""
    (root / fmt.APPENDS_DIR).mkdir(mode=0o755, exist_ok=True)
    for _ in range(FOLDER_ATTEMPTS):
        folder = fmt.append_folder(secrets.token_hex(fmt.APPEND_TAG_HEX // 2))
        try:
            (root / folder).mkdir(mode=0o755)
        except FileNotFoundError:  # appends/, emptied, removed by a clear_abandoned meanwhile
            (root / fmt.APPENDS_DIR).mkdir(mode=0o755, exist_ok=True)
            continue
        fd = local.hold_folder(root / folder)
        if fd is None:
            continue  # a clear_abandoned took it for a killed writer's in the instant before the mark
        try:
            if _same_file(fd, root / folder):  # (else deleted by one before the mark: the name leads nowhere)
                yield folder
                return
        finally:
            local.let_go_lock(fd)
    raise CompileError(f"{root / fmt.APPENDS_DIR}: {FOLDER_ATTEMPTS} new folders were deleted as soon as they were "
                       "made; another process clears that folder as fast as this one writes")


def _same_file(fd: int, path: Path) -> bool:
    try:
        st, held = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def discard(root: Path, folder: str) -> None:
    """Delete an append folder this writer made and no version lists (its commit lost a race)."""
    _remove_unlisted(root, folder, listed_by_versions(root))


def commit(root: Path, manifest: fmt.Manifest) -> None:
    """Make `manifest` (version N, whose files are written and durable) the dataset's latest version:
    create `versions/NNNNNNNN.json`, never replacing one; VersionTaken when another writer made it."""
    (root / fmt.VERSIONS_DIR).mkdir(mode=0o755, exist_ok=True)
    first = root / fmt.version_file(1)
    if manifest.dataset_version == 2 and not first.exists():  # the upgrade: version 1 keeps its manifest
        _create(first, local.read_no_follow(root / fmt.MANIFEST_FILE, fmt.MAX_MANIFEST_BYTES + 1))
    if not _create(root / fmt.version_file(manifest.dataset_version), manifest.to_json().encode("ascii")):
        raise VersionTaken(f"{root}: version {manifest.dataset_version} was committed by another writer meanwhile; "
                           "nothing was added: run the command again to add to the new version")
    refresh_copy(root)


def _create(path: Path, payload: bytes) -> bool:
    """Create `path` with `payload` only if nothing has that name (written, fsynced, then linked in)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{local.TEMP_SUFFIX}")
    fd = local.create_exclusive(temp)
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    return local.create_noreplace(temp, path)


def refresh_copy(root: Path) -> None:
    """`manifest.json` := the latest version's manifest, for readers that do not know versions (atomic)."""
    found = _versions(root)
    if found:
        latest = local.read_no_follow(root / fmt.version_file(found[-1]), fmt.MAX_MANIFEST_BYTES + 1)
        if hashlib.sha256(latest).digest() != _digest(root / fmt.MANIFEST_FILE):
            local.write_durably(root / fmt.MANIFEST_FILE, latest)


def _digest(path: Path) -> bytes | None:
    try:
        return hashlib.sha256(local.read_no_follow(path, fmt.MAX_MANIFEST_BYTES + 1)).digest()
    except OSError:
        return None


def prune(root: str | os.PathLike, keep: int) -> Pruned:
    """Keep the `keep` newest versions; delete the other versions' manifests, then every file of the
    dataset that no kept version lists (only names dsc gives, never anything else). An s3:// URL: see
    `bucket_versions.prune`."""
    if storage.is_url(root):
        from dsc.compiler import bucket_versions

        return bucket_versions.prune(os.fspath(root), keep)
    root = Path(root).absolute()
    if keep < 1:
        raise CompileError(f"--keep must be at least 1 (the latest version), got {keep}")
    storage.parse_manifest(root)  # a dataset, whole: refuse anything else before deleting anything
    with writing(root) as (removed, freed):
        found = _versions(root)
        refresh_copy(root)
        kept, dropped = found[-keep:], found[:-keep]
        if not found:
            return Pruned([1], [], removed, freed)
        for v in dropped:  # manifests first: nobody opens a pruned version half-deleted
            os.unlink(root / fmt.version_file(v))
        local.fsync_dir(root / fmt.VERSIONS_DIR)
        listed = listed_by_versions(root)
        for dirpath, folders, filenames in os.walk(root):  # never into a linked folder
            if Path(dirpath) == root:
                folders[:] = [f for f in folders if f not in (fmt.APPENDS_DIR, fmt.VERSIONS_DIR)]
            for name in filenames:
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if path.is_symlink() or rel in listed or not fmt.is_dataset_file_name(rel):
                    continue
                freed += path.stat().st_size
                path.unlink()
                removed.append(rel)
        cleared, cleared_bytes = clear_abandoned(root)  # appends/: the folders no writer is at work in
        removed, freed = removed + cleared, freed + cleared_bytes
        for folder in (fmt.SHARD_DIR, fmt.FIELD_DIR):
            if (root / folder).is_dir() and not any((root / folder).iterdir()):
                (root / folder).rmdir()
        local.fsync_dir(root)
        return Pruned(kept, dropped, removed, freed)

