"""Concurrent use (issue 5): many readers at once, and recompiles under open readers.

Two source folders X and Y of the same size are compiled once each into reference copies
(`Version`: every record, label and source). A dataset read anywhere must then be exactly one
of them, whole: threads sharing one `MemmapDataset`, threads with their own, DataLoader worker
processes, readers that opened OUT before `compile_folder(..., force=True)` replaced it, and
readers opening OUT while a second process recompiles it again and again. Every join and wait
has a timeout, so a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import pickle
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dsc
from dsc.testing import make_image_folder

SIZE, PER_SHARD, PER_CLASS = 8, 3, 5  # 10 records in shards of 3, 3, 3, 1
JOIN_S = 60.0  # far above what any of these takes; only a deadlock reaches it


@dataclass(frozen=True)
class Version:
    """Everything a compiled dataset serves, copied out of the maps."""

    name: str
    path: Path  # its reference copy
    classes: tuple[str, ...]
    records: np.ndarray  # [N, H, W, 3]
    labels: np.ndarray
    sources: tuple[str, ...]


def read_whole(ds: dsc.MemmapDataset) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, tuple[str, ...]]:
    records = np.stack([ds[i].image.permute(1, 2, 0).numpy() for i in range(len(ds))])
    labels = np.array([ds[i].label for i in range(len(ds))])
    return tuple(ds.classes), records, labels, tuple(ds.opened.source(i) for i in range(len(ds)))


def identify(ds: dsc.MemmapDataset, versions: dict[str, Version]) -> str:
    """The version `ds` serves, after checking that every record, label and source is that version's."""
    classes, records, labels, sources = read_whole(ds)
    matches = [v for v in versions.values() if v.classes == classes]
    assert len(matches) == 1, f"classes {classes} belong to no version"
    v = matches[0]
    assert sources == v.sources, f"sources are not all {v.name}'s: a mixture"
    assert np.array_equal(labels, v.labels), f"labels are not all {v.name}'s: a mixture"
    same = [np.array_equal(a, b) for a, b in zip(records, v.records)]
    assert all(same), f"records {[i for i, s in enumerate(same) if not s]} are not {v.name}'s: a mixture"
    return v.name


def check_batch(batch_images: torch.Tensor, batch_labels: torch.Tensor, indices, v: Version) -> None:
    """A served batch [B, 3, H, W] holds exactly version v's records at `indices`."""
    indices = list(indices)
    assert torch.equal(batch_images.permute(0, 2, 3, 1).contiguous(), torch.from_numpy(v.records[indices])), \
        f"batch {indices} differs from {v.name}'s records"
    assert batch_labels.tolist() == v.labels[indices].tolist()


def compile_into(src: Path, out: Path, force: bool = False) -> None:
    dsc.compile_folder(src, out, size=SIZE, records_per_shard=PER_SHARD, workers=1, force=force)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Source folders X and Y: the same number of images, different pixels, different class names."""
    root = tmp_path_factory.mktemp("concurrency")
    x = make_image_folder(root / "x", classes=2, per_class=PER_CLASS, seed=1)
    y = make_image_folder(root / "y", classes=2, per_class=PER_CLASS, seed=2)
    for folder in sorted(y.iterdir()):
        folder.rename(y / f"y_{folder.name}")
    return {"x": x, "y": y}


@pytest.fixture(scope="module")
def versions(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Version]:
    root = tmp_path_factory.mktemp("references")
    found = {}
    for name, src in folders.items():
        compile_into(src, root / name)
        found[name] = Version(name, root / name, *read_whole(dsc.MemmapDataset(root / name)))
    assert found["x"].classes != found["y"].classes and not np.array_equal(found["x"].records, found["y"].records)
    return found


@pytest.fixture(scope="module")
def reference_path(versions: dict[str, Version]) -> Path:
    return versions["x"].path


def run_threads(target, count: int) -> None:
    """Run target(k) on `count` threads at once; re-raise the first failure, never hang."""
    errors: list[BaseException] = []
    start = threading.Barrier(count, timeout=JOIN_S)

    def run(k: int) -> None:
        try:
            start.wait()
            target(k)
        except BaseException as e:  # handed to the test thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a reader thread is stuck (deadlock?)"
    if errors:
        raise errors[0]


# ----------------------------------------------------------------------------- many readers at once

@pytest.mark.parametrize("sharing", ["one instance", "one unpickled instance", "an instance each"])
def test_many_threads_read_one_dataset(reference_path: Path, versions: dict[str, Version], sharing: str) -> None:
    x = versions["x"]
    shared = dsc.MemmapDataset(reference_path)
    if sharing == "one unpickled instance":  # its maps are opened lazily, by whichever thread comes first
        shared = pickle.loads(pickle.dumps(shared))

    def read(k: int) -> None:
        ds = dsc.MemmapDataset(reference_path) if sharing == "an instance each" else shared
        rng = np.random.default_rng(k)
        for epoch in range(3):
            loader = ds.loader(batch_size=3, order=("block", "random", "sequential")[k % 3], seed=k, num_threads=2)
            loader.set_epoch(epoch)
            served = []
            for batch in loader:
                check_batch(batch["image"], batch["label"], batch["index"].tolist(), x)
                served += batch["index"].tolist()
            assert sorted(served) == list(range(len(ds)))
            for i in rng.integers(len(ds), size=20).tolist():
                image, label = ds[i]
                check_batch(image[None], torch.tensor([label]), [i], x)
            picks = rng.integers(len(ds), size=7)
            gathered = ds.__getitems__(picks.tolist())
            check_batch(gathered.images, gathered.labels, picks, x)

    run_threads(read, 6)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_worker_processes_read_one_dataset(reference_path: Path, versions: dict[str, Version],
                                                      context: str) -> None:
    ds = dsc.MemmapDataset(reference_path)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(3)).tolist() * 3
    loader = DataLoader(ds, batch_size=4, sampler=order, num_workers=2, multiprocessing_context=context,
                        timeout=JOIN_S)
    served = []
    for images, labels in loader:
        indices = order[len(served):len(served) + len(labels)]
        check_batch(images, labels, indices, versions["x"])
        served += indices
    assert served == order


# ----------------------------------------------------------------------------- recompiling under readers

def test_a_recompile_leaves_open_readers_on_the_old_data(folders: dict[str, Path], versions: dict[str, Version],
                                                         tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_into(folders["x"], out)
    reader = dsc.MemmapDataset(out)
    epoch = iter(reader.loader(batch_size=3, order="sequential", num_threads=2))
    first = next(epoch)  # reading has started...
    check_batch(first["image"], first["label"], first["index"].tolist(), versions["x"])
    views = [reader[i].image for i in range(len(reader))]  # ...and these views point into the maps
    order = list(range(len(reader)))
    workers = iter(DataLoader(reader, batch_size=1, sampler=order, num_workers=2, multiprocessing_context="fork",
                              timeout=JOIN_S))  # worker processes reading it too, 4 batches ahead at most
    check_batch(*next(workers), order[:1], versions["x"])

    compile_into(folders["y"], out, force=True)  # ...when OUT is replaced

    for batch in epoch:
        check_batch(batch["image"], batch["label"], batch["index"].tolist(), versions["x"])
    for k, (images, labels) in enumerate(workers, start=1):
        check_batch(images, labels, order[k:k + 1], versions["x"])
    assert identify(reader, versions) == "x"
    assert torch.equal(torch.stack(views).permute(0, 2, 3, 1), torch.from_numpy(versions["x"].records))
    assert [b["index"].tolist() for b in reader.loader(batch_size=10, order="sequential")] == [list(range(10))]
    assert identify(dsc.MemmapDataset(out), versions) == "y"  # a new reader sees the new dataset


def test_a_copy_of_an_old_reader_never_reads_the_new_dataset(folders: dict[str, Path], versions: dict[str, Version],
                                                             tmp_path: Path) -> None:
    """DataLoader workers under spawn (and any pickled copy) re-open by path: after a recompile
    they must not quietly serve the new dataset beside a parent that reads the old one."""
    out = tmp_path / "out"
    compile_into(folders["x"], out)
    reader = dsc.MemmapDataset(out)
    blob = pickle.dumps(reader)
    compile_into(folders["y"], out, force=True)
    for copy in (pickle.loads(blob), pickle.loads(pickle.dumps(reader))):
        with pytest.raises(dsc.DatasetError, match="replaced"):
            identify(copy, versions)
    with pytest.raises(dsc.DatasetError, match="replaced"):
        reader.as_tensordict()
    assert identify(reader, versions) == "x"


def test_a_copy_made_before_any_recompile_still_reads(reference_path: Path, versions: dict[str, Version]) -> None:
    copy = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(dsc.MemmapDataset(reference_path)))))
    assert identify(copy, versions) == "x"
    td = copy.as_tensordict()
    assert torch.equal(td["shards", "0", "image"], torch.from_numpy(versions["x"].records[:PER_SHARD]))


ROUNDS = 16
RECOMPILER = """
import sys
import dsc
x, y, out, rounds = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
print("ready", flush=True)
for k in range(rounds):
    dsc.compile_folder(y if k % 2 == 0 else x, out, size={size}, records_per_shard={per_shard}, workers=1, force=True)
    print(k, flush=True)
"""


def test_readers_opening_during_recompiles_see_one_whole_version(folders: dict[str, Path],
                                                                 versions: dict[str, Version],
                                                                 tmp_path: Path) -> None:
    """Readers open OUT in a loop while another process recompiles it from X and Y in turn:
    each open gives all of X's dataset or all of Y's, never a mixture, and never fails (an open
    that the swap interrupts starts again on the new folder)."""
    out = tmp_path / "out"
    compile_into(folders["x"], out)
    script = RECOMPILER.format(size=SIZE, per_shard=PER_SHARD)
    recompiler = subprocess.Popen([sys.executable, "-c", script, str(folders["x"]), str(folders["y"]), str(out),
                                   str(ROUNDS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: Counter[str] = Counter()
    lock = threading.Lock()
    deadline = time.monotonic() + JOIN_S

    def read(k: int) -> None:
        while recompiler.poll() is None and time.monotonic() < deadline:
            try:
                ds = dsc.MemmapDataset(out)
            except dsc.DatasetError as e:
                outcome = f"refused: {e}"
            else:
                outcome = identify(ds, versions)
                for batch in ds.loader(batch_size=4, order="random", seed=k, num_threads=1):
                    check_batch(batch["image"], batch["label"], batch["index"].tolist(), versions[outcome])
            with lock:
                seen[outcome] += 1

    try:
        ready, _, _ = select.select([recompiler.stdout], [], [], JOIN_S)  # past its imports: compiles follow
        assert ready and recompiler.stdout.readline() == "ready\n", recompiler.stderr.read()
        run_threads(read, 3)
        _, stderr = recompiler.communicate(timeout=JOIN_S)
    finally:
        if recompiler.poll() is None:
            recompiler.kill()
            recompiler.wait(JOIN_S)
    assert recompiler.returncode == 0, stderr
    assert set(seen) == {"x", "y"}, f"each open is all X or all Y: {dict(seen)}"
    assert identify(dsc.MemmapDataset(out), versions) == "x"  # an even number of rounds: Y first, X last
