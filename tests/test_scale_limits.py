"""Limits that must hold at millions of files, checked small: many shards under a real `ulimit -n`,
a manifest whose size does not grow with the skips, a hostile sparse dataset that opens in bounded
memory, and discovery's own stamps of the sources."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
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
except dsc.CompileError as e:
    print(json.dumps({{"ok": False, "error": str(e)}}))
    sys.exit()
read = {{}}
if sys.argv[3] == "read":  # every record through the loader, under the same limit, by index
    import numpy as np
    ds = dsc.MemmapDataset(sys.argv[2])
    for batch in ds.loader(16, order="random", seed=0, num_threads=2):
        for i, image in zip(batch["index"].tolist(), batch["image"].permute(0, 2, 3, 1).numpy()):
            read[i] = image.tobytes().hex()
print(json.dumps({{"ok": True, "warnings": caught, "read": read}}))
"""


def compile_under_limit(src: Path, out: Path, resume: bool = False, read: bool = False) -> dict:
    run = subprocess.run([sys.executable, "-c", COMPILE_UNDER_LIMIT.format(limit=DESCRIPTORS), str(src), str(out),
                          "resume" if resume else "read" if read else "new"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_many_shards_compile_and_read_under_a_small_ulimit(many: Path, many_reference: dict, tmp_path: Path) -> None:
    """300 shards under `ulimit -n` 128: the compile finishes, and the reader, whose every shard map holds a
    descriptor, keeps at most 128 - 64 of them (`shard_maps.map_bound`) and reads every record right, so
    there is nothing to warn about."""
    out = tmp_path / "out"
    result = compile_under_limit(many, out, read=True)
    assert result["ok"], result
    assert file_bytes(out) == many_reference
    assert result["warnings"] == []
    shards = sorted((out / fmt.SHARD_DIR).iterdir())
    assert result["read"] == {str(i): p.read_bytes().hex() for i, p in enumerate(shards)}


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


def shard_maps_held(root: Path) -> int:
    """How many of this process's memory maps are files of `root`'s shards (/proc/self/maps)."""
    shards = f"{root.resolve()}/{fmt.SHARD_DIR}/"
    return sum(shards in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_more_shards_than_the_map_bound_are_mapped_on_first_use_and_read_right(many: Path, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """301 one-record shards under a bound of 16 maps (in use: 4096, against vm.max_map_count's 65,530): random
    batches, two copy threads, `ds[i]` and `__getitems__` give the records the shards hold, and the process never
    holds more shard maps than the bound and one per copy thread (the map a thread is copying out of, which the
    cache may have let go meanwhile: it is unmapped only once that copy is done)."""
    gc.collect()  # datasets earlier tests left in reference cycles hold maps of the process's bound till then
    from dsc import MemmapDataset
    from dsc.storage import shard_maps

    out = tmp_path / "out"
    compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)
    expected = np.stack([np.fromfile(p, np.uint8).reshape(4, 4, 3) for p in sorted((out / fmt.SHARD_DIR).iterdir())])
    bound, threads = 16, 2
    monkeypatch.setattr(shard_maps, "MAX_SHARD_MAPS", bound)
    ds = MemmapDataset(out)
    assert len(ds) == len(expected) == 300 and ds.opened.shards.lazy and shard_maps_held(out) == 0
    most = 0
    for epoch in range(2):
        loader = ds.loader(32, order="random", seed=epoch, num_threads=threads)
        for batch in loader:
            idx = batch["index"].numpy()
            assert np.array_equal(batch["image"].permute(0, 2, 3, 1).numpy(), expected[idx])
            most = max(most, shard_maps_held(out))
        loader.close()
    assert bound <= most <= bound + threads, most
    for i in (0, 299, 17, 0):
        assert np.array_equal(ds[i].image.permute(1, 2, 0).numpy(), expected[i])
    picked = [5, 250, 5, 123]
    assert np.array_equal(ds.__getitems__(picked).images.permute(0, 2, 3, 1).numpy(), expected[picked])
    assert shard_maps_held(out) <= bound


def test_a_shard_gone_before_its_first_use_is_an_error_naming_it(many: Path, tmp_path: Path, monkeypatch) -> None:
    """Mapped on first use, a shard deleted meanwhile (the folder removed under a reader) is said, never read
    as something else."""
    gc.collect()  # datasets earlier tests left in reference cycles hold maps of the process's bound till then
    from dsc import MemmapDataset
    from dsc.storage import shard_maps

    out = tmp_path / "out"
    compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)
    monkeypatch.setattr(shard_maps, "MAX_SHARD_MAPS", 8)
    ds = MemmapDataset(out)
    ds[0]
    (out / fmt.shard_file(7)).unlink()
    with pytest.raises(DatasetError, match=rf"{fmt.shard_file(7)}: missing .*mapped when first read.*Open it again"):
        ds[7]
    shutil.rmtree(out)
    ds[0]  # mapped already: still read


def test_two_datasets_share_the_process_bound_on_shard_maps(many: Path, tmp_path: Path) -> None:
    """A training and a validation set of 300 one-record shards each, read in turn by one process under
    `ulimit -n` 128: the bound on shard maps (each holds a descriptor) is the process's, so the second never
    runs out of descriptors mid-epoch (it did: 'too many open files' from batch 1, each dataset keeping
    128 - 64 maps), and every record read is the one its shard holds."""
    out = tmp_path / "out"
    compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)
    script = textwrap.dedent("""
        import resource, sys
        import numpy as np
        from pathlib import Path
        from dsc import MemmapDataset
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
        out = Path(sys.argv[1])
        expected = np.stack([np.fromfile(p, np.uint8).reshape(4, 4, 3) for p in sorted((out / "shards").iterdir())])
        train, val = MemmapDataset(out), MemmapDataset(out)
        for epoch in range(2):
            for ds in (train, val):
                for batch in ds.loader(32, order="random", seed=epoch, num_threads=2):
                    got = batch["image"].permute(0, 2, 3, 1).numpy()
                    assert np.array_equal(got, expected[batch["index"].numpy()])
        print("read", train.opened.shards.lazy, val.opened.shards.lazy)
    """)
    run = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["read", "True", "True"], run.stderr[-2000:]


def _read_shard_7(ds, expected, done) -> None:
    done.put(bool(np.array_equal(ds[7].image.permute(1, 2, 0).numpy(), expected)))


def test_a_process_forked_while_a_shard_was_being_mapped_reads_on(many: Path, tmp_path: Path, monkeypatch) -> None:
    """DataLoader's fork workers inherit the dataset: forked while another thread of the parent held the shard
    maps' lock (a loader's copy thread mapping a shard), a worker must not wait for ever on that lock, which
    no thread of its own will release."""
    from dsc import MemmapDataset
    from dsc.storage import shard_maps

    out = tmp_path / "out"
    compile_folder(many, out, size=4, records_per_shard=1, workers=1, on_skip=quiet)
    monkeypatch.setattr(shard_maps, "MAX_SHARD_MAPS", 8)
    ds = MemmapDataset(out)
    assert ds.opened.shards.lazy
    context = multiprocessing.get_context("fork")
    done, expected = context.Queue(), np.fromfile(out / fmt.shard_file(7), np.uint8).reshape(4, 4, 3)
    with shard_maps._LOCK:  # as a copy thread holds it for an instant
        child = context.Process(target=_read_shard_7, args=(ds, expected, done))
        child.start()
    try:
        assert done.get(timeout=30) is True
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
