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

import hashlib
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import publish
from dsc.compiler.grow import Pruned, VersionTaken
from dsc.errors import CompileError
from dsc.storage import local

WRITER_WAIT_S = 600.0  # how long an append or a prune waits for the dataset's lock (another append's commit)


@contextmanager
def writing(root: Path, wait_s: float = WRITER_WAIT_S) -> Iterator[None]:
    """Hold the dataset's lock (the one a compile holds) while writing in it: abandoned work of a writer
    killed meanwhile is cleared first (only a holder of the lock writes there)."""
    fd = publish.lock(root, wait_s)
    try:
        clear_abandoned(root)
        yield
    finally:
        publish.unlock(root, fd)


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


def clear_abandoned(root: Path) -> None:
    """Delete what writers killed before their commit left in the dataset: files under `appends/` that no
    version lists (only names dsc gives them), and temporaries in `versions/`."""
    listed = listed_by_versions(root)

    def claims(path: str, is_dir: bool) -> bool:  # `path` is relative to appends/
        name = f"{fmt.APPENDS_DIR}/{path}"
        return fmt.is_dataset_folder_name(name) if is_dir else fmt.is_dataset_file_name(name) and name not in listed
    appends = root / fmt.APPENDS_DIR
    if appends.is_dir() and not appends.is_symlink():
        local.remove_claimed(appends, claims, "")
    if (root / fmt.VERSIONS_DIR).is_dir():
        publish.remove_temporaries(root / fmt.VERSIONS_DIR)


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
    with writing(root):
        found = _versions(root)
        refresh_copy(root)
        kept, dropped = found[-keep:], found[:-keep]
        if not found:
            return Pruned([1], [], [], 0)
        for v in dropped:  # manifests first: nobody opens a pruned version half-deleted
            os.unlink(root / fmt.version_file(v))
        local.fsync_dir(root / fmt.VERSIONS_DIR)
        listed = listed_by_versions(root)
        removed, freed = [], 0
        for dirpath, _, filenames in os.walk(root):  # never into a linked folder
            for name in filenames:
                path = Path(dirpath) / name
                rel = path.relative_to(root).as_posix()
                if path.is_symlink() or rel in listed or not fmt.is_dataset_file_name(rel) \
                        or rel.startswith(f"{fmt.VERSIONS_DIR}/"):
                    continue
                freed += path.stat().st_size
                path.unlink()
                removed.append(rel)
        clear_abandoned(root)
        for folder in (fmt.SHARD_DIR, fmt.FIELD_DIR):
            if (root / folder).is_dir() and not any((root / folder).iterdir()):
                (root / folder).rmdir()
        local.fsync_dir(root)
        return Pruned(kept, dropped, removed, freed)

