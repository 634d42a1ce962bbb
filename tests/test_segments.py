"""Format 1.5: the index in segments. An append writes only a segment of its new records (its cost follows them,
not the dataset), every earlier version still reads exactly, readers see one index, and the stored class counts
are what `info` prints and what a reader checks against the labels.

Real compiles of real JPEGs and PNGs (conftest.make_folder), real maps, the real CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsc import format as fmt
from dsc import storage
from dsc.cli import app
from dsc.compiler.append import append
from dsc.compiler.merge import merge
from dsc.compiler.pipeline import compile_folder
from dsc.errors import ChecksumError, DatasetError
from dsc.reader.dataset import MemmapDataset
from dsc.storage.columns import Column

from conftest import make_folder, rewrite_manifest, whole_index_doc

SIZE = 16


def snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file of a folder: (inode, size, SHA-256): a file rewritten or replaced changes one of them."""
    return {p.relative_to(root).as_posix(): (p.stat().st_ino, p.stat().st_size,
                                             hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def contents(ds: MemmapDataset) -> list[tuple[int, str, list[int], str]]:
    """Each record's label, source, original size and pixels' SHA-256, read through the dataset's joined index."""
    o = ds.opened
    return [(int(o.labels[i]), o.source(i), o.sizes[i].tolist(), hashlib.sha256(o.read_records([i]).tobytes())
             .hexdigest()) for i in range(len(ds))]


@pytest.fixture
def grown(tmp_path: Path) -> Path:
    """12 records, 4 a shard (no partial last shard to copy), compiled; `b` (2 records) and `c` (1 of a new class)
    to append."""
    make_folder(tmp_path / "a", classes=2, per_class=6)
    make_folder(tmp_path / "b", classes=2, per_class=1, seed=3, sides=(40, 60))
    make_folder(tmp_path / "c", classes=1, per_class=1, seed=5)
    (tmp_path / "c" / "class_0").rename(tmp_path / "c" / "zebra")  # a class the dataset lacks
    compile_folder(tmp_path / "a", tmp_path / "ds", size=SIZE, records_per_shard=4, workers=1)
    return tmp_path


def test_an_append_writes_only_a_segment_of_its_new_records_and_touches_no_file(grown: Path) -> None:
    ds = grown / "ds"
    before = snapshot(ds)
    append(ds, grown / "b", workers=1)
    after = snapshot(ds)
    changed = [name for name in before if after.get(name) != before[name]]
    assert changed == [fmt.MANIFEST_FILE]  # refreshed to the new version's copy; nothing else rewritten
    added = sorted(set(after) - set(before))
    (tag,) = {name.split("/")[1] for name in added if name.startswith(fmt.APPENDS_DIR)}
    folder = fmt.append_folder(tag)
    assert added == sorted([fmt.version_file(1), fmt.version_file(2), f"{folder}/{fmt.SHARD_TABLE_FILE}",
                            f"{folder}/shards/00003.bin", f"{folder}/{fmt.CLASS_COUNTS_FILE}",
                            f"{folder}/{fmt.CHECKSUMS_FILE}", f"{folder}/{fmt.SKIP_LIST_FILE}",
                            *(f"{folder}/{name}" for name in fmt.INDEX_FILES.values())])
    # the new index files hold the 2 new records only: what an append writes follows them, not the dataset
    assert after[f"{folder}/{fmt.LABELS_FILE}"][1] == 2 * 8 and after[f"{folder}/{fmt.SIZES_FILE}"][1] == 2 * 8
    assert after[f"{folder}/{fmt.CHECKSUMS_FILE}"][1] == 2 * 4
    manifest = storage.parse_manifest(ds)
    first, new = manifest.segments
    assert (first.first, first.count, new.first, new.count) == (0, 12, 12, 2)
    assert first.index["labels"].file == fmt.LABELS_FILE and new.index["labels"].file == f"{folder}/{fmt.LABELS_FILE}"
    version1 = storage.parse_manifest(ds, version=1)
    assert version1.segments == (first,)  # version 2 lists version 1's segment as it was


def test_every_version_reads_exactly_after_appends_and_readers_see_one_index(grown: Path) -> None:
    ds = grown / "ds"
    v1 = contents(MemmapDataset(ds))
    append(ds, grown / "b", workers=1)
    v2 = contents(MemmapDataset(ds))
    append(ds, grown / "c", workers=1, new_classes=True)
    assert contents(MemmapDataset(ds, version=1)) == v1 and contents(MemmapDataset(ds, version=2)) == v2
    latest = MemmapDataset(ds)
    assert len(latest.manifest.segments) == 3 and contents(latest)[:14] == v2 and len(latest) == 15
    o = latest.opened
    labels = np.asarray(o.labels)
    assert labels.tolist() == [r[0] for r in contents(latest)] and labels[14] == 2  # the new class, at the end
    idx = np.array([14, 0, 13, 12, 5, 14])  # a gather across segments, as a batch makes
    assert np.take(o.labels, idx).tolist() == labels[idx].tolist()
    assert np.take(o.sizes, idx, axis=0).tolist() == [contents(latest)[i][2] for i in idx]
    assert o.labels[11:14].tolist() == labels[11:14].tolist() and (o.labels == 2).sum() == 1
    offsets = np.asarray(o.source_offsets)
    assert offsets[0] == 0 and np.all(np.diff(offsets.astype(np.int64)) > 0)
    assert offsets[-1] == len(np.asarray(o.sources))
    batch = next(iter(latest.loader(batch_size=15, order="sequential")))
    assert batch["label"].tolist() == labels.tolist()
    assert batch["size"].tolist() == [r[2] for r in contents(latest)]
    storage.verify_checksums(ds, latest.manifest)


def test_a_batch_reads_only_its_records_of_the_segments_never_the_joined_column(grown: Path, monkeypatch) -> None:
    """np.take, a slice, an item and the loader's gather read the maps they touch: a Column is never joined whole
    (that would cost a copy of the index per batch)."""
    ds = grown / "ds"
    append(ds, grown / "b", workers=1)
    latest = MemmapDataset(ds)
    labels = np.asarray(latest.opened.labels)
    sizes = np.asarray(latest.opened.sizes)

    def joined(self, dtype=None, copy=None):
        raise AssertionError("the whole column was joined")
    monkeypatch.setattr(Column, "__array__", joined)
    idx = np.array([13, 2, 12])
    assert np.take(latest.opened.labels, idx).tolist() == labels[idx].tolist()
    assert np.take(latest.opened.sizes, idx, axis=0).tolist() == sizes[idx].tolist()
    assert latest.opened.labels[12].tolist() == labels[12]
    assert latest.opened.sizes[10:14].tolist() == sizes[10:14].tolist()
    assert latest.opened.source(13) == MemmapDataset(ds).opened.source(13)
    batch = next(iter(latest.loader(batch_size=14, order="sequential")))
    assert batch["label"].tolist() == labels.tolist() and batch["size"].tolist() == sizes.tolist()


def test_stored_class_counts_are_what_info_prints_and_sum_every_segment(grown: Path) -> None:
    ds = grown / "ds"
    append(ds, grown / "b", workers=1)
    append(ds, grown / "c", workers=1, new_classes=True)  # its segment counts 3 classes, the earlier ones 2
    manifest = storage.parse_manifest(ds)
    assert [s.class_counts.bytes // 8 for s in manifest.segments] == [3, 3, 4]
    labels = np.asarray(MemmapDataset(ds).opened.labels)
    stored = storage.class_counts(ds, manifest)
    assert stored.tolist() == np.bincount(labels + 1, minlength=4).tolist() == [0, 7, 7, 1]
    result = CliRunner().invoke(app, ["info", str(ds), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["classes"] == dict(zip(manifest.classes, [7, 7, 1]))


def test_class_counts_that_disagree_with_the_labels_are_named_by_verify(grown: Path) -> None:
    ds = grown / "ds"
    path = ds / fmt.CLASS_COUNTS_FILE
    payload = np.array([0, 7, 5], fmt.COUNT_DTYPE).tobytes()  # the sum still 12: only the labels can tell
    path.write_bytes(payload)
    doc = json.loads((ds / fmt.MANIFEST_FILE).read_text())
    doc["segments"][0]["class_counts"]["sha256"] = hashlib.sha256(payload).hexdigest()
    rewrite_manifest(ds, doc)
    opened = storage.open_dataset(ds)  # an open does not count the labels again: verification does
    with pytest.raises(ChecksumError, match=r"class_counts.bin: the class counts say 7 record\(s\) of label 0, the "
                                            r"segment's labels \(labels.bin\) hold 6"):
        storage.verify_checksums(ds, opened.manifest)
    result = CliRunner().invoke(app, ["verify", str(ds)])
    assert result.exit_code == 1 and "the class counts say 7" in result.output


def test_damaged_class_counts_are_named_by_verify_and_never_summed(grown: Path) -> None:
    ds = grown / "ds"
    manifest = storage.parse_manifest(ds)
    path = ds / fmt.CLASS_COUNTS_FILE
    data = bytearray(path.read_bytes())
    data[0] ^= 1  # -1 claims 1 record more: a reader's check against the labels would catch it too
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="class counts do not match their size and SHA-256"):
        storage.class_counts(ds, manifest)
    with pytest.raises(ChecksumError, match="class_counts.bin: SHA-256 is"):
        storage.verify_checksums(ds, manifest)
    labels = np.asarray(MemmapDataset(ds).opened.labels)
    for json_or_text in (["--json"], []):  # info shows what opens: the labels counted instead, the damage named
        result = CliRunner().invoke(app, ["info", str(ds), *json_or_text])
        assert result.exit_code == 0, result.output
        assert "class counts do not match their size and SHA-256" in result.output
    summary = json.loads(CliRunner().invoke(app, ["info", str(ds), "--json"]).output)
    assert list(summary["classes"].values()) == np.bincount(labels, minlength=len(manifest.classes)).tolist()


def test_a_damaged_segment_of_an_append_is_named_by_verify(grown: Path) -> None:
    ds = grown / "ds"
    append(ds, grown / "b", workers=1)
    manifest = storage.parse_manifest(ds)
    sources = ds / manifest.segments[1].index["sources"].file
    data = bytearray(sources.read_bytes())
    data[0] ^= 0x20
    sources.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"{manifest.segments[1].index['sources'].file}: SHA-256 is"):
        storage.verify_checksums(ds, manifest)


def test_merge_of_appended_datasets_writes_one_segment_and_reads_the_same(grown: Path) -> None:
    ds = grown / "ds"
    append(ds, grown / "b", workers=1)
    make_folder(grown / "other", classes=3, per_class=1, seed=11)
    compile_folder(grown / "other", grown / "ds2", size=SIZE, records_per_shard=4, workers=1)
    merge([ds, grown / "ds2"], grown / "merged")
    merged = MemmapDataset(grown / "merged")
    assert len(merged.manifest.segments) == 1 and len(merged) == 17
    mine = contents(MemmapDataset(ds))
    assert [(r[1], r[2], r[3]) for r in contents(merged)[:14]] == [(r[1], r[2], r[3]) for r in mine]
    storage.verify_checksums(grown / "merged", merged.manifest)


def test_a_1_4_dataset_is_upgraded_once_then_appends_keep_its_segment(grown: Path) -> None:
    ds = grown / "ds"
    doc = whole_index_doc(json.loads((ds / fmt.MANIFEST_FILE).read_text()))  # as dsc 0.5.0 wrote it
    rewrite_manifest(ds, doc)
    (ds / fmt.CLASS_COUNTS_FILE).unlink()
    v1 = contents(MemmapDataset(ds))
    assert storage.parse_manifest(ds).version == "1.4"
    append(ds, grown / "b", workers=1)  # the upgrade: one segment of every record, with its class counts
    upgraded = storage.parse_manifest(ds)
    assert upgraded.version == fmt.FORMAT_VERSION and [s.count for s in upgraded.segments] == [14]
    assert storage.parse_manifest(ds, version=1).version == "1.4" and contents(MemmapDataset(ds, version=1)) == v1
    append(ds, grown / "c", workers=1, new_classes=True)  # then only new segments
    latest = storage.parse_manifest(ds)
    assert latest.segments[0] == upgraded.segments[0] and [s.count for s in latest.segments] == [14, 1]
    assert storage.class_counts(ds, latest).tolist() == [0, 7, 7, 1]


def test_a_reader_of_1_4_refuses_a_1_5_dataset_naming_the_missing_index(grown: Path, monkeypatch) -> None:
    """What dsc 0.5.0 (format 1.4) says: it knows 1.4's keys, and a 1.5 manifest has no `index` (checked by
    hand against 0.5.0: `dsc info` exits 1 with "manifest.json: missing key(s) ['index']")."""
    monkeypatch.setattr(fmt, "FORMAT_VERSION", "1.4")
    monkeypatch.delitem(fmt._MANIFEST_KEYS, 5)
    monkeypatch.delitem(fmt._OPTIONAL_KEYS, 5)
    with pytest.raises(DatasetError, match=r"manifest.json: missing key\(s\) \['index'\]"):
        storage.open_dataset(grown / "ds")


def test_an_append_checks_only_its_own_segment(grown: Path, monkeypatch) -> None:
    """Version N's segments were checked when N was committed: N + 1's check before its commit reads only the new
    segment's values (the index files of the records it adds)."""
    ds = grown / "ds"
    read, checking = [], []
    real_values, real_check = storage.store._values_of, storage.check_manifest_text

    def spying(store):
        values = real_values(store)

        def spy(name, dtype, count):
            if checking:
                read.append((name, count))
            return values(name, dtype, count)
        return spy

    def check(*args, **kwargs):
        checking.append(True)
        try:
            return real_check(*args, **kwargs)
        finally:
            checking.clear()
    monkeypatch.setattr(storage.store, "_values_of", spying)
    monkeypatch.setattr(storage, "check_manifest_text", check)
    append(ds, grown / "b", workers=1)
    labels = [count for name, count in read if name.endswith(f"/{fmt.LABELS_FILE}")]
    assert labels == [2], read  # the 2 new records' labels only, not the 12 version 1 holds
    assert all(name.startswith(f"{fmt.APPENDS_DIR}/") for name, _ in read), read
