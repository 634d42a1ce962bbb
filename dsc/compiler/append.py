"""Append: grow a dataset folder by the images of SRC, as a new version (format 1.3), decoding only SRC.

SRC is compiled first, aside (a private scratch folder beside the dataset), with the dataset's own
options: size, fit, decode mode, alpha, pixel limit, seed, shuffle, shard size. Then, under the
dataset's lock and on its latest version (another append may have landed meanwhile), its records
are joined after the dataset's (`combine`): the dataset's full shards stay as they are, its last
shard, when partial, is copied with the first new records into a new file (record i stays in shard
i // R), and the index is written again for the joined records, into `appends/<random>/`. The new
version's manifest is committed create-only (`versions.commit`). A kill at any moment leaves the
dataset at its previous version, whole; what the killed append wrote is cleared by the next writer.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsc import format as fmt
from dsc import storage
from dsc.compiler import combine, versions
from dsc.compiler.pipeline import compile_folder
from dsc.errors import CompileError
from dsc.storage import local

SCRATCH_LOCK = "owner.lock"  # held by the append that made a scratch folder, for as long as it lives


@dataclass
class AppendSummary:
    """What an append did; also printed by `dsc append`."""

    dataset: Path
    version: int
    added: int
    count: int
    skipped: int
    new_classes: list[str]
    shard_files: list[str]  # how each new shard file was made: "copy", "link", "reflink"
    seconds: float


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
        self._fd = os.open(self.path / SCRATCH_LOCK, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)


def compile_options(manifest: fmt.Manifest, root: Path) -> dict:
    """`compile_folder`'s options that make records the way the dataset's were made (its first part)."""
    c = manifest.compile
    alpha = {text: name for name, text in fmt.ALPHA.items()}.get(c.get("alpha", fmt.ALPHA["black"]))
    missing = [k for k in ("size", "fit", "seed", "shuffle", "max_pixels") if k not in c] + \
        ([] if alpha else ["alpha"])
    if missing:
        raise CompileError(f"{root}: its manifest does not record how its records were made ({', '.join(missing)} "
                           "missing from 'compile'), so new records could not be made the same way")
    return {"size": tuple(c["size"]), "fit": c["fit"], "seed": c["seed"], "shuffle": c["shuffle"],
            "max_pixels": c["max_pixels"], "alpha": alpha,
            "fast_decode": c.get("decode", fmt.DECODE_MODE_UNRECORDED) == "fast",
            "records_per_shard": manifest.records_per_shard}


def append(dataset: str | os.PathLike, src: str | os.PathLike, *, labels: str | os.PathLike | None = None,
           columns: dict[str, str] | None = None, new_classes: bool = False, workers: int | None = None,
           strict: bool = False, on_total: Callable[[int], None] | None = None,
           progress: Callable[[int], None] | None = None,
           on_skip: Callable[[str, str], None] | None = None) -> AppendSummary:
    """Add the images of `src` (or the rows of the label table `labels`) to the dataset folder `dataset` as
    its next version; see `dsc append --help`. Raises CompileError; the dataset is then unchanged."""
    started = time.perf_counter()
    root = Path(dataset).absolute()
    if storage.is_url(dataset):
        raise CompileError(f"{dataset}: dsc append grows dataset folders; datasets in object storage come later")
    base = storage.parse_manifest(root)
    options = compile_options(base, root)
    kinds = {f.name: f.kind for f in base.fields}
    if labels is not None and not base.labeled:
        kinds.setdefault("label", "none")
    scratch = _Scratch(root)
    try:
        table_kinds = ({**kinds, **(columns or {})} or None) if labels is not None else columns
        compile_folder(src, scratch.path / "new", **options, workers=workers, strict=strict, labels=labels,
                       columns=table_kinds,
                       on_total=on_total, progress=progress, on_skip=on_skip)
        new = storage.open_dataset(scratch.path / "new")
        with versions.writing(root):
            try:
                version, how, joined = _commit_on_latest(root, new, new_classes, src)
            except OSError as e:  # a full disk, a permission: nothing is committed
                raise CompileError(f"writing the next version of {root} failed ({e}); it is still at its previous "
                                   "version, and what was written is cleared by the next append or prune") from e
    finally:
        scratch.close()
    before = set(base.classes)
    return AppendSummary(root, version.dataset_version, new.manifest.count, version.count,
                         new.manifest.skipped_count, [c for c in joined.classes if c not in before], how,
                         time.perf_counter() - started)


def _commit_on_latest(root: Path, new: storage.OpenedDataset, new_classes: bool, src) -> tuple:
    """Under the lock: join the compiled records after the latest version's, write them, commit."""
    base = storage.open_dataset(root)
    m = base.manifest
    joined = combine.join_index([base, new], new_classes, [str(root), str(src)])
    folder = fmt.append_folder(secrets.token_hex(fmt.APPEND_TAG_HEX // 2))
    full = m.count // m.records_per_shard  # shards kept as they are; a partial last one is copied
    runs = combine.runs_of(base, full * m.records_per_shard) + combine.runs_of(new)
    shards, how = combine.write_shards(root, f"{folder}/{fmt.SHARD_DIR}", full, runs, m.records_per_shard,
                                       m.record_bytes)
    index, fields, warnings, skip_list = combine.write_index(root, folder, joined)
    checksums = combine.write_checksums(root, folder, joined)
    local.fsync_dir(root / folder / fmt.SHARD_DIR)
    local.fsync_dir(root / folder)
    local.fsync_dir(root / fmt.APPENDS_DIR)
    local.fsync_dir(root)
    manifest = fmt.Manifest(height=m.height, width=m.width, count=len(joined.labels),
                            records_per_shard=m.records_per_shard, classes=tuple(joined.classes),
                            shards=(*m.shards[:full], *shards), index=index,
                            skipped=tuple(joined.skipped[:fmt.SKIPPED_IN_MANIFEST]), compile=m.compile,
                            fields=fields, skipped_list=skip_list, warnings=warnings,
                            dataset_version=m.dataset_version + 1, parts=joined.parts, checksums=checksums)
    table = f"{folder}/{fmt.SHARD_TABLE_FILE}"  # the new shards' digests; the kept ones stay in m's tables
    manifest, payload = fmt.with_shard_table(manifest, table, base=m, kept=full)
    local.write_durably(root / table, payload)
    storage.check_manifest_text(root, manifest.to_json().encode("ascii"))  # never commit what readers refuse
    versions.commit(root, manifest)
    return manifest, how, joined
