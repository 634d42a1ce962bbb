"""Limits that must hold at millions of files, checked small: many shards under a real `ulimit -n`,
a manifest whose size does not grow with the skips, a hostile sparse dataset that opens in bounded
memory, and discovery's own stamps of the sources."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsc import CompileError, compile_folder, storage
from dsc import format as fmt
from dsc.cli import app
from dsc.compiler import output
from dsc.compiler.discover import discover
from dsc.compiler.publish import staging_path
from dsc.errors import DatasetError
from dsc.storage import local

from conftest import pattern, save

DESCRIPTORS = 128  # the ulimit -n of the constrained compiles; the builds below have more shards


def quiet(source: str, reason: str) -> None:
    pass


def file_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    """300 tiny images and one junk file: with one record per shard, 300 shards, and compaction
    moves records through all of them."""
    root = tmp_path_factory.mktemp("many") / "src"
    for i in range(300):
        save(root / f"c{i % 3}" / f"{i:03d}.png", pattern(6, 5, seed=i % 7), "PNG")
    (root / "c0" / "000junk.jpg").write_bytes(b"not an image")
    return root


@pytest.fixture(scope="module")
def many_reference(many: Path) -> dict[str, bytes]:
    out = many.parent / "reference"
    compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)
    return file_bytes(out)


COMPILE_UNDER_LIMIT = """
import json, logging, resource, sys
import dsc
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
caught = []
handler = logging.Handler()
handler.emit = lambda record: caught.append(record.getMessage())
logging.getLogger("dsc").addHandler(handler)
try:
    dsc.compile_folder(sys.argv[1], sys.argv[2], size=4, records_per_shard=1, workers=1,
                       resume=sys.argv[3] == "resume", on_skip=lambda s, r: None)
    print(json.dumps({{"ok": True, "warnings": caught}}))
except dsc.CompileError as e:
    print(json.dumps({{"ok": False, "error": str(e)}}))
"""


def compile_under_limit(src: Path, out: Path, resume: bool = False) -> dict:
    run = subprocess.run([sys.executable, "-c", COMPILE_UNDER_LIMIT.format(limit=DESCRIPTORS), str(src), str(out),
                          "resume" if resume else "new"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_many_shards_compile_under_a_small_ulimit_and_warn_about_reading(many: Path, many_reference: dict,
                                                                          tmp_path: Path) -> None:
    result = compile_under_limit(many, tmp_path / "out")
    assert result["ok"], result
    assert file_bytes(tmp_path / "out") == many_reference
    assert [w for w in result["warnings"] if "ulimit" in w] == [
        f"reading this dataset will need about 365 open files (a descriptor for each of up to 301 shard files, plus 64 "
        f"to spare for the rest of a training process), more than the {DESCRIPTORS} this process may have (ulimit -n). "
        "Raise the limit where you read it, or compile with a larger --records-per-shard"]


def test_a_resume_after_compaction_finishes_under_a_small_ulimit(many: Path, many_reference: dict,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "out"

    def killed_after_compaction() -> None:  # the records have moved down; a resume must move them back
        output.shard_digests = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)  # where shards are hashed
        compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)

    child = multiprocessing.get_context("fork").Process(target=killed_after_compaction)
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL and (staging_path(out) / "kept.bin").exists()
    result = compile_under_limit(many, out, resume=True)
    assert result["ok"], result
    assert file_bytes(out) == many_reference


def junk_folder(root: Path, junk: int) -> Path:
    save(root / "a" / "one.png", pattern(8, 8), "PNG")
    for i in range(junk):
        (root / "a" / f"junk_{i:05d}_{'x' * 40}.jpg").write_bytes(b"not an image at all")
    return root


def test_the_manifest_does_not_grow_with_the_skips(tmp_path: Path) -> None:
    sizes = {}
    for junk in (150, 3000):
        summary = compile_folder(junk_folder(tmp_path / f"src{junk}", junk), tmp_path / f"out{junk}", size=4,
                                 workers=1, on_skip=quiet)
        assert summary.kept == 1 and len(summary.skipped) == junk
        sizes[junk] = (tmp_path / f"out{junk}" / fmt.MANIFEST_FILE).stat().st_size
    assert abs(sizes[3000] - sizes[150]) < 64, sizes  # the same manifest but for a few digits
    out = tmp_path / "out3000"
    manifest = storage.open_dataset(out).manifest
    listed = storage.read_skipped(out, manifest)
    assert manifest.skipped_count == 3000 and len(listed) == 3000 and listed == sorted(listed, key=str)
    assert listed[0] == {"source": f"a/junk_00000_{'x' * 40}.jpg",
                         "reason": "not a recognised image file (no known format's signature)"}
    assert list(manifest.skipped) == listed[:fmt.SKIPPED_IN_MANIFEST]
    info = CliRunner().invoke(app, ["info", str(out), "--json"])
    assert info.exit_code == 0 and len(json.loads(info.stdout)["skipped"]) == 3000


def test_a_build_the_reader_would_refuse_is_never_published(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "src"
    for c in range(200):  # every class name is in the manifest: it can outgrow the reader's limit
        save(src / f"class_with_a_long_name_{c:03d}" / "x.png", pattern(8, 8, seed=c), "PNG")
    out = tmp_path / "out"
    compile_folder(junk_folder(tmp_path / "good", 0), out, size=4, workers=1)
    before = file_bytes(out)
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", 6000)  # a 200-class manifest is ~8 KB, one class's ~3 KB
    with pytest.raises(CompileError, match="would not open as a dataset.*more than the 6000 bytes"):
        compile_folder(src, out, size=4, workers=1, force=True)
    assert file_bytes(out) == before and not staging_path(out).exists()


def sparse_dataset(root: Path, count: int, classes: tuple[str, ...]) -> Path:
    """A 1x1-record dataset whose manifest claims `count` records over sparse files (a few KB on disk)."""
    (root / fmt.SHARD_DIR).mkdir(parents=True)
    sizes = {fmt.shard_file(0): count * 3, fmt.LABELS_FILE: count * 8, fmt.SIZES_FILE: count * 8,
             fmt.SOURCE_OFFSETS_FILE: (count + 1) * 8, fmt.SOURCES_FILE: 0}
    for name, size in sizes.items():
        with open(root / name, "wb") as f:
            f.truncate(size)
    entry = {key: fmt.FileEntry(name, sizes[name], "0" * 64) for key, name in fmt.INDEX_FILES.items()}
    manifest = fmt.Manifest(height=1, width=1, count=count, records_per_shard=count, classes=classes,
                            shards=(fmt.ShardEntry(fmt.shard_file(0), count * 3, "0" * 64, count),), index=entry)
    output.write_manifest(root, manifest)
    return root


PEAK_MEMORY = """
import resource, sys
from dsc import storage
from dsc.errors import DatasetError
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    storage.open_dataset(sys.argv[1])
    print("opened", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
except DatasetError as e:
    print("refused", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, e)
"""


def test_a_hostile_sparse_dataset_is_checked_in_bounded_memory(tmp_path: Path) -> None:
    """Every index file is scanned to its end through 1 GiB of holes each: labels and offsets (all
    zeros) pass, then the sizes (zeros too: no image has a 0 side) are refused, all in bounded memory.
    (Before sizes.bin was range-checked this all-zero dataset opened; it was never a valid one.)"""
    count = 1 << 27  # 1 GiB per index file, nothing stored; the format allows 2^40
    root = sparse_dataset(tmp_path / "ds", count, ("a",))
    run = subprocess.run([sys.executable, "-c", PEAK_MEMORY, str(root)], capture_output=True, text=True, timeout=300)
    outcome, grown_kib, *reason = run.stdout.split() + ["", ""]
    assert outcome == "refused", run.stdout + run.stderr
    assert f"{fmt.SIZES_FILE}: every original (height, width) must be at least 1" in " ".join(reason), run.stdout
    assert int(grown_kib) < 64 << 10, f"checking took {int(grown_kib) >> 10} MiB more memory"


def test_values_after_a_hole_are_still_checked(tmp_path: Path) -> None:
    count = 1 << 22
    bad_label = sparse_dataset(tmp_path / "label", count, ("a",))
    with open(bad_label / fmt.LABELS_FILE, "r+b") as f:
        f.seek((count - 1) * 8)
        f.write((7).to_bytes(8, "little"))  # data after 32 MiB of hole
    with pytest.raises(DatasetError, match=r"labels must lie in \[0, 0\] for 1 classes, found \[0, 7\]"):
        storage.open_dataset(bad_label)
    falling = sparse_dataset(tmp_path / "offsets", count, ("a",))
    with open(falling / fmt.SOURCE_OFFSETS_FILE, "r+b") as f:
        f.seek((count // 2) * 8)
        f.write((5).to_bytes(8, "little"))  # 0 ... 0 5 0 ... 0: falls after the 5
    with pytest.raises(DatasetError, match="offsets must rise from 0"):
        storage.open_dataset(falling)
    unlabeled = sparse_dataset(tmp_path / "unlabeled", count, ())  # a hole reads as label 0, not -1
    with pytest.raises(DatasetError, match=r"labels must lie in \[-1, -1\]"):
        storage.open_dataset(unlabeled)


def test_discovery_stamps_every_source_as_the_file_system_does(tmp_path: Path) -> None:
    for i in range(5):
        save(tmp_path / "src" / f"c{i % 2}" / f"{i}.png", pattern(8, 8 + i), "PNG")
    found = discover(tmp_path / "src")
    stats = [os.stat(tmp_path / "src" / s) for s in found.sources]
    assert found.stamps == [f"{st.st_size}:{st.st_mtime_ns}" for st in stats]
    assert len(set(found.stamps)) == 5  # the sizes differ, so a stamp is no constant


def test_the_index_scan_finds_what_numpy_finds_in_sparse_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    count = 3 << 20
    root = sparse_dataset(tmp_path / "ds", count, tuple("abcdefgh"))
    labels = np.zeros(count, "<i8")
    with open(root / fmt.LABELS_FILE, "r+b") as f:  # islands of data between holes, at odd places
        for start in rng.integers(0, count - 5000, 6).tolist():
            values = rng.integers(-2, 11, 5000)
            labels[start:start + 5000] = values
            f.seek(start * 8)
            f.write(values.astype("<i8").tobytes())
    with pytest.raises(DatasetError, match=rf"found \[{labels.min()}, {labels.max()}\]"):
        storage.open_dataset(root)


def test_reserving_a_shard_writes_nothing_where_the_file_system_cannot_allocate(tmp_path: Path) -> None:
    """ext3 (no extents) has no fallocate, like NFSv3: glibc's posix_fallocate then writes every block."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop file system needs root")
    image, mount = tmp_path / "ext3.img", tmp_path / "ext3"
    with open(image, "wb") as f:
        f.truncate(96 << 20)
    mount.mkdir()
    made = subprocess.run(["mkfs.ext3", "-q", "-F", str(image)], capture_output=True, text=True)
    if made.returncode or subprocess.run(["mount", "-o", "loop", str(image), str(mount)]).returncode:
        pytest.skip(f"cannot make or mount an ext3 loop file system here {made.stderr.strip()}")
    try:
        fd = os.open(mount / "shard.bin", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            local.reserve(fd, 64 << 20)
            st = os.fstat(fd)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
    assert st.st_size == 64 << 20 and st.st_blocks * 512 < 1 << 20, f"{st.st_blocks * 512} bytes written"


def test_more_shards_than_a_process_may_map_compile_with_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    """Format 1.4: the manifest does not grow with the shards, so their number is no reason to refuse a compile
    (1.3 refused what would pass 64 MiB of manifest); a reader maps every shard, so more of them than
    vm.max_map_count allows is said up front, with the way out."""
    from dsc.compiler import finish

    limit = tmp_path / "max_map_count"
    limit.write_text("70\n")
    monkeypatch.setattr(finish, "MAX_MAP_COUNT", limit)
    src = tmp_path / "src"
    for i in range(8):
        save(src / f"{i}.png", pattern(8, 8, seed=i), "PNG")
    with caplog.at_level("WARNING", logger="dsc"):
        compile_folder(src, tmp_path / "out", size=4, records_per_shard=1, workers=1)
    assert [r.getMessage() for r in caplog.records if "max_map_count" in r.getMessage()] == [
        "reading this dataset maps each of its 8 shard files, more memory maps than a process may hold here "
        "(vm.max_map_count = 70): raise it where you read it, or compile with a larger --records-per-shard"]
    finish.check_shard_count(1 << 20)  # a million shards: no longer refused for the manifest's size
