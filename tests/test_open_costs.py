"""`dsc info` reads no more than it shows (issue 27, point 7): its text lists the first skipped sources,
which the manifest holds, so the skip list file — whose size grows with the skips — is not read;
`--json`, which lists every skip, reads it."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import dsc
from dsc import MemmapDataset, storage
from dsc import format as fmt
from dsc.cli import SHOW_SKIPPED, app
from dsc.errors import DatasetError, LoaderError

from conftest import make_folder, rewrite_manifest, whole_index_doc
from test_scale_limits import sparse_dataset

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
BAD = 30


def test_info_text_does_not_read_the_skip_list_file(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=1, per_class=2)
    for i in range(BAD):
        (src / "class_0" / f"bad_{i:02d}.jpg").write_bytes(b"oops")
    dsc.compile_folder(src, tmp_path / "ds", size=8, workers=1)
    skip_list = tmp_path / "ds" / fmt.SKIP_LIST_FILE
    skip_list.write_bytes(b"\x00" * skip_list.stat().st_size)  # same size, unreadable as a skip list
    text = runner.invoke(app, ["info", str(tmp_path / "ds")])
    assert text.exit_code == 0, text.stderr
    assert f"{BAD} skipped:" in text.stdout
    assert "  class_0/bad_00.jpg: not a recognised image file" in text.stdout
    assert f"  ... and {BAD - SHOW_SKIPPED} more (dsc info --json lists them all)" in text.stdout
    every = runner.invoke(app, ["info", str(tmp_path / "ds"), "--json"])
    assert every.exit_code == 1 and fmt.SKIP_LIST_FILE in every.stderr  # the one that reads the file says so


# Index values are checked as they are used, not all at open (issue 27 point 7): a reader opens a 10^8-record
# dataset without reading 2.4 GB of index, and a wrong value still never reaches a batch.

DAMAGED = 5  # the record whose value is made wrong: in the second batch of 4


@pytest.fixture(scope="module")
def with_fields(tmp_path_factory) -> Path:
    """8 records of 2 classes with a float and a class field."""
    tmp = tmp_path_factory.mktemp("fields")
    src = make_folder(tmp / "src", classes=2, per_class=4)
    paths = sorted(str(p.relative_to(src)) for p in src.rglob("*.*"))
    table = tmp / "t.csv"
    table.write_text("path,label,score,species\n" + "".join(
        f"{p},{p.split('/')[0]},{k / 2},{['owl', 'emu'][k % 2]}\n" for k, p in enumerate(paths)))
    dsc.compile_folder(src, tmp / "ds", size=8, workers=1, labels=table, columns={"score": "float"})
    return tmp / "ds"


def set_value(root: Path, file: str, dtype: str, at: int, value) -> None:
    values = np.fromfile(root / file, dtype=dtype)
    values[at] = value
    values.tofile(root / file)


WRONG = {  # file, dtype, which value, the wrong value, the rule it breaks
    "label": (fmt.LABELS_FILE, "<i8", DAMAGED, 7, r"labels must lie in \[0, 1\] for 2 classes"),
    "size": (fmt.SIZES_FILE, "<u4", 2 * DAMAGED + 1, 0, r"every original \(height, width\) must be at least 1"),
    "float field": ("fields/score.bin", "<f4", DAMAGED, np.nan, "values of field 'score' must be finite"),
    "class field": ("fields/species.bin", "<i8", DAMAGED, 9, r"values of field 'species' must lie in \[0, 1\]"),
}


@pytest.mark.parametrize("case", sorted(WRONG))
def test_a_wrong_index_value_fails_the_batch_that_uses_it_naming_the_record(with_fields: Path, tmp_path: Path,
                                                                             case: str) -> None:
    file, dtype, at, value, rule = WRONG[case]
    root = tmp_path / "ds"
    shutil.copytree(with_fields, root)
    set_value(root, file, dtype, at, value)
    ds = MemmapDataset(root)  # opens: nothing is read of the index yet
    loader = ds.loader(4, order="sequential")
    batches = iter(loader)
    first = next(batches)
    assert first["index"].tolist() == [0, 1, 2, 3]  # a batch without the record is served
    with pytest.raises(LoaderError, match=rf"{file}: record {DAMAGED} has .*, but {rule}"):
        next(batches)
    loader.close()
    whole = {"label": lambda: ds.labels, "size": lambda: ds.opened.sizes,
             "float field": lambda: ds.fields, "class field": lambda: ds.fields}[case]
    with pytest.raises(DatasetError, match=file):  # asked for whole, the whole file is checked
        whole()
    with pytest.raises(DatasetError, match=file):  # and what checks every value at open still refuses it
        storage.open_dataset(root)
    if case == "label":  # the torch paths that take a label check it too
        assert ds[DAMAGED - 1].label in (0, 1)
        with pytest.raises(DatasetError, match=rf"record {DAMAGED} has \[?7\]?, but {rule}"):
            ds[DAMAGED]
        with pytest.raises(DatasetError, match=rf"record {DAMAGED} has"):
            ds.__getitems__([0, DAMAGED])


def test_a_wrong_source_offset_fails_the_source_that_uses_it(with_fields: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(with_fields, root)
    set_value(root, fmt.SOURCE_OFFSETS_FILE, "<u8", DAMAGED + 1, 1 << 40)
    ds = MemmapDataset(root)
    assert ds.source(0).name.endswith((".jpg", ".png"))
    with pytest.raises(DatasetError, match=rf"record {DAMAGED}'s name would run from byte \d+ to {1 << 40}"):
        ds.source(DAMAGED)
    with pytest.raises(DatasetError, match="offsets must rise"):
        _ = ds.opened.source_offsets


def test_a_reader_opens_a_hostile_sparse_index_and_refuses_its_first_batch(tmp_path: Path) -> None:
    """The all-zero sparse dataset that `storage.open_dataset` refuses after scanning 1 GiB of holes
    (test_scale_limits) opens as a reader without a scan; its first batch meets a size of 0."""
    root = sparse_dataset(tmp_path / "ds", 1 << 27, ("a",))
    ds = MemmapDataset(root)
    with pytest.raises(LoaderError, match=rf"{fmt.SIZES_FILE}: record 0 has \[0, 0\], but every original"):
        next(iter(ds.loader(2, order="sequential")))


def test_info_reads_no_label_of_a_large_dataset_unless_asked(with_fields: Path, tmp_path: Path, monkeypatch) -> None:
    """Past COUNTED_UNASKED records `dsc info` counts nothing per record (0.8 GB of labels at 10^8) and says how
    to: shown here on a dataset whose labels would fail the count."""
    from dsc.tools import inspect_dataset

    root = tmp_path / "ds"
    shutil.copytree(with_fields, root)
    set_value(root, fmt.LABELS_FILE, "<i8", DAMAGED, 7)
    monkeypatch.setattr(inspect_dataset, "COUNTED_UNASKED", 7)  # the dataset has 8 records
    text = runner.invoke(app, ["info", str(root)])  # format 1.5: its stored class counts, no label read
    assert text.exit_code == 0 and "2 classes: class_0 (4), class_1 (4)\n" in text.stdout, text.stderr
    rewrite_manifest(root, whole_index_doc(json.loads((root / fmt.MANIFEST_FILE).read_text())))  # as 1.4 wrote it
    (root / fmt.CLASS_COUNTS_FILE).unlink()
    text = runner.invoke(app, ["info", str(root)])
    assert text.exit_code == 0, text.stderr
    assert "2 classes: class_0, class_1\n" in text.stdout  # the names only: no count was read
    assert "field score: float, float32 scalar\n" in text.stdout
    assert ("not counted: records per class, field values (dsc info --counts reads every one of the 8 records' "
            "values)") in text.stdout
    for asked in (["--counts"], ["--json"]):  # reading the labels meets the wrong one, and says so
        counted = runner.invoke(app, ["info", str(root), *asked])
        assert counted.exit_code == 1 and f"{fmt.LABELS_FILE}: labels must lie in [0, 1]" in counted.stderr
    monkeypatch.setattr(inspect_dataset, "COUNTED_UNASKED", 8)  # up to the limit, counted unasked
    shutil.copy(with_fields / fmt.LABELS_FILE, root / fmt.LABELS_FILE)
    text = runner.invoke(app, ["info", str(root)])
    assert text.exit_code == 0 and "2 classes: class_0 (4), class_1 (4)\n" in text.stdout
    assert "not counted" not in text.stdout


def _labels_sum(ds: MemmapDataset, done) -> None:
    done.put(int(np.asarray(ds.opened.labels).sum()))


def test_a_process_forked_while_a_whole_file_was_being_checked_checks_it_again(with_fields: Path) -> None:
    """DataLoader's fork workers inherit the dataset: forked while another thread of the parent held the lock of
    a whole-file check (`ds.labels` asked in a thread), a worker asking for the labels must not wait for ever on
    a lock no thread of its own will release."""
    ds = MemmapDataset(with_fields)
    want = int(np.fromfile(with_fields / fmt.segment_file(ds.manifest, ds.manifest.index_segments[0], "labels"),
                           np.int64).sum())
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    with ds.opened._lock:  # as a thread checking the labels holds it
        child = context.Process(target=_labels_sum, args=(ds, done))
        child.start()
    try:
        assert done.get(timeout=30) == want
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()


def _open_descriptors() -> set[int]:
    return {int(fd) for fd in os.listdir("/proc/self/fd")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_opening_reading_and_compiling_many_times_leaves_no_descriptor_open(tmp_path: Path) -> None:
    """A training job that opens its validation set every epoch, or a service that compiles again and again,
    must not run out of descriptors. Each open left two (its folder and shards/, listed through a duplicate
    that scandir duplicated again), until after ~500 opens a `ulimit -n` of 1024 was reached (and select()
    refused descriptors past 1023)."""
    src = make_folder(tmp_path / "src", classes=2, per_class=3)
    dsc.compile_folder(src, tmp_path / "ds", size=8, workers=1, records_per_shard=2)
    gc.collect()
    before = _open_descriptors()
    for k in range(20):
        ds = MemmapDataset(tmp_path / "ds")
        assert sum(len(b["index"]) for b in ds.loader(4, order="random", seed=k)) == len(ds)
        del ds
    for k in range(3):
        dsc.compile_folder(src, tmp_path / f"again{k}", size=8, workers=1)
    gc.collect()
    assert _open_descriptors() - before == set()
