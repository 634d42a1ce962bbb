"""MemmapDataset: contents, copies of records, pickling, DataLoader drop-in, tensordict, damaged folders."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

import dsc
from dsc import format as fmt
from dsc import storage
from dsc.compiler import output
from dsc.errors import DatasetError, UnsupportedVersionError
from dsc.reader import GatheredBatch, MemmapDataset

from conftest import listed_shards_doc

SIZE = (16, 20)


def make_images(root: Path, classes: int = 3, per_class: int = 7, seed: int = 0) -> Path:
    """Tiny real JPEG/PNG files of random sizes in class folders."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(40, 90, size=2))
            img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
            img.save(root / f"c{c}" / f"{i}.{'png' if i % 3 == 0 else 'jpg'}")
    return root


def compile_tiny(root: Path, records_per_shard: int | None = 5) -> Path:
    src = make_images(root / "src")
    out = root / "ds"
    dsc.compile_folder(src, out, size=SIZE, records_per_shard=records_per_shard, workers=1, seed=0)
    return out


def make_synthetic(root: Path, count: int, shape: tuple[int, int, int], per_shard: int) -> Path:
    """A dataset written with dsc.format directly (fast at any size): record i is filled with i % 251."""
    record_bytes = int(np.prod(shape))
    for path, records, first in zip(output.allocate_shards(root, count, per_shard, record_bytes),
                                    fmt.shard_records(count, per_shard), range(0, count, per_shard)):
        shard = fmt.open_shard(path, records, shape, mode="r+")
        shard[:] = (np.arange(first, first + records) % 251).astype(np.uint8)[:, None, None, None]
        shard.flush()
        del shard
    labels = np.arange(count) % 2
    index = output.write_index(root, labels, np.tile([shape[0], shape[1]], (count, 1)),
                            [f"c{k}/{i}.jpg" for i, k in enumerate(labels)])
    shards = output.shard_entries(root, count, per_shard, record_bytes)
    output.write_manifest(root, fmt.Manifest(height=shape[0], width=shape[1], count=count, records_per_shard=per_shard,
                                          classes=("c0", "c1"), shards=shards, index=index,
                                          compile={"source_root": "/nowhere"}))
    return root


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """21 records in shards of 5 (the last one holds 1)."""
    return compile_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def ds(tiny: Path) -> MemmapDataset:
    return MemmapDataset(tiny)


def raw_records(path: Path) -> np.ndarray:
    """All records read with plain numpy from the files, independently of the reader."""
    opened = storage.open_dataset(path)
    return np.concatenate([np.asarray(s) for s in opened.shards])


def test_basic_properties(ds: MemmapDataset, tiny: Path) -> None:
    assert len(ds) == 21
    assert len(ds.opened.shards) == 5 and len(ds.opened.shards[-1]) == 1
    assert ds.classes == ["c0", "c1", "c2"]
    assert ds.class_to_idx == {"c0": 0, "c1": 1, "c2": 2}
    assert ds.labels.dtype == np.int64 and len(ds.labels) == 21
    assert np.bincount(ds.labels).tolist() == [7, 7, 7]
    for i in range(len(ds)):  # each record's source is a real file of its class folder
        src = ds.source(i)
        assert src.is_file() and src.parent.name == ds.classes[ds.labels[i]]
    assert sorted(str(ds.source(i)) for i in range(21)) == sorted(
        str(p) for p in (tiny.parent / "src").rglob("*") if p.is_file())


def test_getitem_is_a_copy_of_its_record(ds: MemmapDataset, tiny: Path) -> None:
    raw = raw_records(tiny)
    for i in [0, 4, 5, 19, 20, -1, -21]:
        image, label = ds[i]
        assert image.shape == (3, *SIZE) and image.dtype == torch.uint8
        assert np.array_equal(image.permute(1, 2, 0).numpy(), raw[i])
        assert label == ds.labels[i]
    a, b = ds[7].image, ds[7].image
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)  # two copies: the shard map is read-only
    for bad in [21, -22, 1000]:
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]


@pytest.mark.parametrize(("bad", "got"), [([0, 1], "list"), (1.5, "float"), ("5", "str"), (True, "bool"),
                                          (np.bool_(True), "bool"), (slice(0, 3), "slice"),
                                          (torch.tensor([3]), r"Tensor of dtype torch.int64, shape \(1,\)"),
                                          (torch.tensor(True), "Tensor of dtype torch.bool")])
def test_getitem_takes_exactly_one_integer(ds: MemmapDataset, bad, got: str) -> None:
    with pytest.raises(TypeError, match=rf"^record index must be an integer, got {got}.*; for many records use "
                                        r"ds.__getitems__\(indices\) or ds.loader\(...\)$"):
        ds[bad]


def test_getitem_takes_numpy_and_torch_integers(ds: MemmapDataset) -> None:
    for i in [np.int64(7), np.uint8(7), torch.tensor(7), np.array(7), -14]:
        assert torch.equal(ds[i].image, ds[7].image) and ds.source(i) == ds.source(7)


@pytest.mark.parametrize("bad", [-22, 21])
def test_out_of_range_names_the_index_given_and_the_valid_range(ds: MemmapDataset, bad: int) -> None:
    message = rf"^record index {bad} is out of range for a dataset of 21 records \(valid: -21\.\.20\)$"
    with pytest.raises(IndexError, match=message):
        ds[bad]
    with pytest.raises(IndexError, match=message):
        ds.__getitems__([0, bad, -1])
    with pytest.raises(IndexError, match=message):
        ds.source(bad)


@pytest.mark.parametrize(("bad", "got"), [([1.5, 2.0], "floats"), ([True, False], "bools"), (["5"], "strings"),
                                          ([[0, 1], [2, 3]], "2-D input"), (5, "0-D input"),
                                          (torch.tensor([0.0, 1.0]), "floats")])
@pytest.mark.parametrize("transform", [None, lambda image: image])
def test_getitems_refuses_indices_that_are_not_integers(tiny: Path, bad, got: str, transform) -> None:
    ds = MemmapDataset(tiny, transform=transform)  # with a transform, records are taken one by one
    with pytest.raises(TypeError, match=rf"^record indices must be a 1-D sequence of integers \(a list of ints, "
                                        rf"as DataLoader passes\), got {got}$"):
        ds.__getitems__(bad)


INTERLEAVED = [0, 5, 10, 15, 20, 1, 6, 11, 16, 2, 7, 12, 17, 3, 8, 13, 18, 4, 9, 14, 19]  # shard changes every record


@pytest.mark.parametrize("indices", [[0, 1, 2, 3], [3, 4, 5, 6, 7, 20], [20, 0, 13, 7, 7, 2, 19, 5],
                                     list(range(21))[::-1], [9], [], [-1, 0], INTERLEAVED, INTERLEAVED[::-1]])
def test_getitems_equals_getitem(ds: MemmapDataset, indices: list[int]) -> None:
    batch = ds.__getitems__(indices)
    assert isinstance(batch, GatheredBatch) and len(batch) == len(indices)
    assert batch.images.shape == (len(indices), 3, *SIZE)
    for k, i in enumerate(indices):
        assert torch.equal(batch.images[k], ds[i].image)
        assert batch.labels[k].item() == ds[i].label == batch[k].label


def test_pickle_by_path_reopens_lazily(ds: MemmapDataset) -> None:
    blob = pickle.dumps(ds)
    assert len(blob) < 500  # the path, not the data
    copy = pickle.loads(blob)
    assert copy._data is None
    assert torch.equal(copy[11].image, ds[11].image) and len(copy) == len(ds)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_drop_in(ds: MemmapDataset, workers: int) -> None:
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    loader = DataLoader(ds, batch_size=4, sampler=order, num_workers=workers)
    seen = []
    for images, labels in loader:
        assert images.shape[1:] == (3, *SIZE) and images.dtype == torch.uint8 and labels.dtype == torch.int64
        seen.append((images, labels))
    images = torch.cat([im for im, _ in seen])
    labels = torch.cat([lb for _, lb in seen])
    assert len(labels) == 21
    expected = torch.stack([ds[i].image for i in order])
    assert torch.equal(images, expected)
    assert labels.tolist() == [ds[i].label for i in order]


def test_default_collate_stacks_loose_samples(ds: MemmapDataset) -> None:
    subset = torch.utils.data.ConcatDataset([ds])  # no __getitems__: samples come one by one
    images, labels = next(iter(DataLoader(subset, batch_size=5)))
    assert torch.equal(images, torch.stack([ds[i].image for i in range(5)]))
    assert labels.tolist() == [ds[i].label for i in range(5)]


def _mapped_file(address: int) -> Path | None:
    """The file this process has mapped at `address`, from /proc/self/maps (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return Path(fields[5]) if len(fields) == 6 and fields[5].startswith("/") else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_as_tensordict_indexes_records_across_shards_zero_copy(ds: MemmapDataset, tiny: Path) -> None:
    from tensordict import MemoryMappedTensor

    td = ds.as_tensordict()
    raw = raw_records(tiny)
    assert td.batch_size == () and list(td["shards"].keys()) == ["0", "1", "2", "3", "4"]
    assert isinstance(td["label"], MemoryMappedTensor) and td["label"].tolist() == ds.labels.tolist()
    assert _mapped_file(td["label"].data_ptr()) == (tiny / fmt.LABELS_FILE).resolve()
    for i in range(len(ds)):  # every record, found the documented way, is record i (the last shard holds 1)
        s, j = fmt.locate(i, ds.manifest.records_per_shard)
        record = td["shards", str(s)][j]
        assert torch.equal(record["image"], torch.from_numpy(raw[i]))
        assert torch.equal(record["image"].permute(2, 0, 1), ds[i].image)
        assert record["label"].item() == ds.labels[i]
    for s, path in enumerate(ds.opened.shard_paths()):
        image = td["shards", str(s), "image"]
        assert isinstance(image, MemoryMappedTensor) and image.shape == (len(ds.opened.shards[s]), *SIZE, 3)
        assert _mapped_file(image.data_ptr()) == path.resolve()  # the shard file's pages: nothing copied
        assert _mapped_file(image[-1].data_ptr()) == path.resolve()
    with pytest.raises(RuntimeError, match="batch_dims==0"):  # no silent wrong record by position
        td[10]
    with pytest.raises(KeyError, match="image"):
        td["image"]


def test_as_tensordict_single_shard_has_the_same_layout(tmp_path: Path) -> None:
    from tensordict import MemoryMappedTensor

    path = make_synthetic(tmp_path / "one", 12, (4, 6, 3), per_shard=100)
    td = MemmapDataset(path).as_tensordict()
    assert td.batch_size == () and list(td["shards"].keys()) == ["0"]
    shard = td["shards", "0"]
    assert shard.batch_size == (12,) and isinstance(shard["image"], MemoryMappedTensor)
    assert shard["image"][:, 0, 0, 0].tolist() == list(range(12))
    assert shard["label"].tolist() == td["label"].tolist() == [i % 2 for i in range(12)]


def _rss_kb() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields


def _worker_rss(batch):
    """collate_fn run in the worker: the batch's checksum and the worker's RSS after gathering it."""
    images, labels = batch.images, batch.labels
    return images[:, 0, 0, 0].to(torch.int64), labels, torch.tensor([_rss_kb()["RssAnon"]])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_no_copies_of_the_data(tmp_path: Path) -> None:
    """~96 MB of records read through workers and the loader; anonymous memory stays small."""
    path = make_synthetic(tmp_path / "big", 2000, (128, 128, 3), per_shard=700)
    ds = MemmapDataset(path)
    rss = []
    for first, labels, anon in DataLoader(ds, batch_size=32, num_workers=2, collate_fn=_worker_rss):
        assert first.tolist() == [i % 251 for i in range(len(rss) * 32, len(rss) * 32 + len(labels))]
        rss.append(anon.item())
    worker_growth_mb = (max(rss[-4:]) - min(rss[:4])) / 1024
    assert worker_growth_mb < 24, f"a worker's anonymous memory grew by {worker_growth_mb:.0f} MB"
    data_mb = sum(s.nbytes for s in ds.opened.shards) / 2**20
    before = _rss_kb()  # this process has not touched the shard maps yet (the workers did, in theirs)
    for batch in ds.loader(32, order="random", num_threads=2):
        del batch
    after = _rss_kb()
    anon_mb, file_mb = ((after[k] - before[k]) / 1024 for k in ("RssAnon", "RssFile"))
    assert file_mb > 0.8 * data_mb, f"only {file_mb:.0f} of {data_mb:.0f} MB read through the map"
    assert anon_mb < 24, f"anonymous memory grew by {anon_mb:.0f} MB while reading {data_mb:.0f} MB"


# ----------------------------------------------------------------------------- damaged datasets

def _manifest(path: Path) -> dict:
    return json.loads((path / fmt.MANIFEST_FILE).read_text())


def _rewrite(path: Path, edit) -> None:
    doc = _manifest(path)
    edit(doc)
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(doc))


def _rewrite_listed(path: Path, edit) -> None:
    """`_rewrite` of the manifest as 1.3 wrote it, every shard listed (1.4 lists none: formats.md "Shard tables")."""
    doc = listed_shards_doc(path)
    edit(doc)
    (path / fmt.MANIFEST_FILE).write_text(json.dumps(doc))


def _resize(path: Path, delta: int) -> None:
    os.truncate(path, path.stat().st_size + delta)


def _symlink_out(ds: Path) -> None:
    outside = ds.parent / "outside.bin"
    shutil.copy(ds / "shards/00001.bin", outside)
    (ds / "shards/00001.bin").unlink()
    (ds / "shards/00001.bin").symlink_to(outside)


DAMAGE = {
    "truncated shard": (lambda p: _resize(p / "shards/00002.bin", -1), DatasetError, r"00002\.bin.*truncated"),
    "extended shard": (lambda p: _resize(p / "shards/00000.bin", 1), DatasetError, r"00000\.bin.*extended"),
    "truncated last shard": (lambda p: _resize(p / "shards/00004.bin", -1), DatasetError, "truncated"),
    "missing shard": (lambda p: (p / "shards/00003.bin").unlink(), DatasetError, r"00003\.bin: missing"),
    "unknown major version": (lambda p: _rewrite(p, lambda d: d.update(version="2.0")),
                              UnsupportedVersionError, r"version 2\.0 is not supported"),
    "dotdot path": (lambda p: _rewrite_listed(p, lambda d: d["shards"][1].update(file="../x")), DatasetError,
                    r"'\.\./x' must be a plain relative path"),
    "absolute path": (lambda p: _rewrite_listed(p, lambda d: d["shards"][1].update(file="/etc/passwd")), DatasetError,
                      "invalid file name"),
    "duplicated shard": (lambda p: _rewrite_listed(p, lambda d: d["shards"][1].update(file=d["shards"][0]["file"])),
                         DatasetError, "listed twice"),
    "count lies": (lambda p: _rewrite(p, lambda d: d.update(count=40)), DatasetError,
                   r"cover 5 shard\(s\), but 40 records"),
    "shard bytes lie": (lambda p: _rewrite_listed(p, lambda d: d["shards"][0].update(bytes=1)), DatasetError,
                        "declares 1 bytes"),
    "shard records lie": (lambda p: _rewrite_listed(p, lambda d: d["shards"][0].update(records=4)), DatasetError,
                          r"'records' = 4, expected 5"),
    "record shape lies": (lambda p: _rewrite(p, lambda d: d["record"].update(shape=[16, 21, 3])), DatasetError,
                          "'bytes' = 960"),
    "unknown key": (lambda p: _rewrite(p, lambda d: d.update(extra=1)), DatasetError, r"unknown key\(s\) \['extra'\]"),
    "not json": (lambda p: (p / fmt.MANIFEST_FILE).write_text("{"), DatasetError, "not valid JSON"),
    "no manifest": (lambda p: (p / fmt.MANIFEST_FILE).unlink(), DatasetError, "no manifest.json"),
    "symlink out of the folder": (_symlink_out, DatasetError, "inside the dataset folder"),
    "truncated labels": (lambda p: _resize(p / fmt.LABELS_FILE, -8), DatasetError, r"labels\.bin.*truncated"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_dataset_fails_at_construction(tiny: Path, tmp_path: Path, case: str) -> None:
    damaged = tmp_path / "ds"
    shutil.copytree(tiny, damaged)
    damage, error, match = DAMAGE[case]
    damage(damaged)
    with pytest.raises(error, match=match):
        MemmapDataset(damaged)


def test_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="nothing: does not exist"):
        MemmapDataset(tmp_path / "nothing")
    (tmp_path / "file").write_text("")
    with pytest.raises(DatasetError, match="file: not a directory"):
        MemmapDataset(tmp_path / "file")


def test_spawned_workers_find_the_dataset_after_the_parent_changed_directory(tmp_path: Path, monkeypatch) -> None:
    dsc.compile_folder(make_images(tmp_path / "src"), tmp_path / "out", size=8, workers=1)
    monkeypatch.chdir(tmp_path)
    ds = MemmapDataset("out")  # a relative path...
    monkeypatch.chdir(tmp_path / "src")  # ...and then the training script moves on
    loader = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context="spawn")
    images = torch.cat([image for image, _ in loader])
    assert torch.equal(images, torch.stack([ds[i][0] for i in range(len(ds))]))
