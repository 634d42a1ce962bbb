"""Versions (format 1.3): `dsc append`, `dsc merge`, `dsc prune`, and readers of a growing dataset.

Real compiles of real JPEGs and PNGs (conftest.make_folder), real processes for the races and kills."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_publish_states import tmpfs
from typer.testing import CliRunner

from dsc import format as fmt
from dsc import storage
from dsc.cli import app
from dsc.compiler import versions
from dsc.compiler.append import append
from dsc.compiler.merge import merge
from dsc.compiler.pipeline import compile_folder
from dsc.errors import CompileError, DatasetError
from dsc.reader.dataset import MemmapDataset

from conftest import make_folder, pattern, rewrite_manifest, save, whole_index_doc

SIZE = 16


def split_folder(master: Path, parts: dict[str, Path], pick) -> None:
    """Copy each image of `master` (class folders) into the part `pick(class, name)` names."""
    for image in sorted(master.rglob("*.*")):
        dest = parts[pick(image.parent.name, image.name)] / image.parent.name / image.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(image, dest)


def by_source(ds: MemmapDataset) -> dict[str, tuple[np.ndarray, str]]:
    """Each record's pixels and class name, keyed by its source's last two path components (class/file)."""
    out = {}
    for i in range(len(ds)):
        key = "/".join(ds.opened.source(i).split("/")[-2:])
        label = int(ds.labels[i])
        out[key] = (np.array(ds.opened.shards[i // ds.manifest.records_per_shard][i % ds.manifest.records_per_shard]),
                    ds.classes[label] if label >= 0 else None)
    return out


@pytest.fixture
def grown(tmp_path: Path):
    """A master folder split in two: `a` compiled (5 records a shard: a partial last shard), `b` to append."""
    master = make_folder(tmp_path / "master", classes=3, per_class=7)
    a, b = tmp_path / "a", tmp_path / "b"
    split_folder(master, {"a": a, "b": b}, lambda cls, name: "a" if int(name[4]) < 4 else "b")
    compile_folder(a, tmp_path / "ds", size=SIZE, records_per_shard=5, workers=1)
    return tmp_path, master, a, b


def test_append_then_read_equals_a_compile_of_the_union(grown) -> None:
    tmp, master, a, b = grown
    before = MemmapDataset(tmp / "ds")
    old = [before[i].image.numpy().copy() for i in range(len(before))]
    summary = append(tmp / "ds", b, workers=1)
    compile_folder(master, tmp / "union", size=SIZE, workers=1)
    after, union = MemmapDataset(tmp / "ds"), MemmapDataset(tmp / "union")
    assert (summary.version, after.version, len(after)) == (2, 2, len(union)) == (2, 2, 21)
    got, want = by_source(after), by_source(union)
    assert sorted(got) == sorted(want)
    for key, (pixels, label) in want.items():
        assert got[key][1] == label, key
        assert np.array_equal(got[key][0], pixels), key
    # order: version 1's records first, unchanged; then SRC's in the order a compile of SRC alone stores them
    assert all(np.array_equal(after[i].image.numpy().copy(), old[i]) for i in range(len(old)))
    compile_folder(b, tmp / "b_only", size=SIZE, records_per_shard=5, workers=1)
    alone = MemmapDataset(tmp / "b_only")
    assert [after.opened.source(len(old) + i) for i in range(len(alone))] == \
        [f"../b/{alone.opened.source(i)}" for i in range(len(alone))]
    assert storage.validate(tmp / "ds").dataset_version == 2
    storage.verify_checksums(tmp / "ds", after.manifest)


def test_a_reader_of_version_n_keeps_serving_it_while_an_append_lands(grown) -> None:
    tmp, _, _, b = grown
    ds = MemmapDataset(tmp / "ds")
    expected = {i: ds[i].image.numpy().copy() for i in range(len(ds))}
    loader = ds.loader(4, order="sequential", seed=0)
    it = iter(loader)
    seen = [next(it)]
    append(tmp / "ds", b, workers=1)  # lands while the pass is half-way
    seen += list(it)
    served = {int(i): img for batch in seen for i, img in zip(batch["index"], batch["image"].numpy())}
    assert sorted(served) == sorted(expected)
    assert all(np.array_equal(served[i], expected[i]) for i in expected)
    copy = pickle.loads(pickle.dumps(ds))  # a DataLoader worker's copy opens the same version again
    assert (copy.version, len(copy)) == (1, 12)
    assert all(np.array_equal(copy[i].image.numpy().copy(), expected[i]) for i in expected)
    assert len(MemmapDataset(tmp / "ds")) == 21  # a new open sees the new version


def test_loader_state_names_the_version_and_refuses_a_newer_one(grown) -> None:
    tmp, _, _, b = grown
    loader = MemmapDataset(tmp / "ds").loader(4, seed=3)
    next(iter(loader))
    state = loader.state_dict()
    assert state["dataset_version"] == 1
    append(tmp / "ds", b, workers=1)
    with pytest.raises(ValueError, match=r"saved reading version 1 .* reads version 2.*version=1"):
        MemmapDataset(tmp / "ds").loader(4, seed=3).load_state_dict(state)
    again = MemmapDataset(tmp / "ds", version=1).loader(4, seed=3)
    again.load_state_dict(state)  # the message's way to continue
    assert len(list(again)) == 2  # 12 records, 4 served: 8 left


def _append_process(ds: Path, src: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsc", "append", str(ds), str(src), "-j", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_racing_appends_in_two_processes_both_land_never_lost(tmp_path: Path) -> None:
    master = make_folder(tmp_path / "master", classes=2, per_class=9)
    parts = {k: tmp_path / k for k in ("a", "b", "c")}
    split_folder(master, parts, lambda cls, name: "abc"[int(name[4]) % 3])
    compile_folder(parts["a"], tmp_path / "ds", size=SIZE, records_per_shard=4, workers=1)
    procs = [_append_process(tmp_path / "ds", parts[k]) for k in ("b", "c")]
    results = [p.communicate(timeout=120) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], [err for _, err in results]  # the second waits for the first's commit, then goes on top
    ds = MemmapDataset(tmp_path / "ds")
    assert ds.version == 3 and storage.dataset_versions(tmp_path / "ds") == [1, 2, 3]
    keys = set(by_source(ds))
    assert len(keys) == len(ds) == 18  # each append whole, once
    assert {len(MemmapDataset(tmp_path / "ds", version=2))} == {12}
    storage.verify_checksums(tmp_path / "ds", ds.manifest)


def test_a_commit_never_replaces_a_version_someone_else_made(grown) -> None:
    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    v2 = storage.parse_manifest(tmp / "ds")
    text = (tmp / "ds" / fmt.version_file(2)).read_bytes()
    with pytest.raises(versions.VersionTaken, match="version 2 was committed by another writer"):
        versions.commit(tmp / "ds", replace(v2, classes=(*v2.classes[:-1], "renamed")))
    assert (tmp / "ds" / fmt.version_file(2)).read_bytes() == text


def _landing_while_compiling(monkeypatch, then) -> None:
    """Make an append's compile of SRC (`grow.compile_new`, run before it takes the dataset's lock) end with
    `then()`: another writer's commit landing while the append compiled."""
    from dsc.compiler import grow

    def compile_then_land(*args, **kwargs):
        made = grow.compile_new(*args, **kwargs)
        then()
        return made
    monkeypatch.setattr("dsc.compiler.append.compile_new", compile_then_land)


def test_an_append_refuses_a_dataset_replaced_meanwhile_by_records_made_another_way(grown, monkeypatch) -> None:
    """A `compile --force` with other options landing while an append compiles SRC the old way: the append adds
    nothing (records of two fits in one dataset would be silently wrong) and names what changed."""
    tmp, _, a, b = grown
    _landing_while_compiling(monkeypatch, lambda: compile_folder(a, tmp / "ds", size=SIZE, fit="pad",
                                                                 records_per_shard=5, workers=1, force=True))
    with pytest.raises(CompileError, match=r"its version 1 makes records otherwise .*\(fit center-crop → pad\).*"
                                           r"nothing was added: run the command again"):
        append(tmp / "ds", b, workers=1)  # (a folder's --force puts a new dataset, version 1, in its place)
    assert storage.dataset_versions(tmp / "ds") == [1]
    monkeypatch.undo()
    summary = append(tmp / "ds", b, workers=1)  # run again: made the new way
    assert summary.version == 2 and {p.compile["fit"] for p in MemmapDataset(tmp / "ds").manifest.record_parts} \
        == {"pad"}


def test_an_appends_new_classes_are_those_it_added_to_the_version_it_built_on(grown, monkeypatch) -> None:
    """Another append that added a class lands first; this one, which adds none, says it added none."""
    tmp, _, _, b = grown
    make_folder(tmp / "c", classes=1, per_class=1, seed=5)
    (tmp / "c" / "class_0").rename(tmp / "c" / "zebra")
    _landing_while_compiling(monkeypatch, lambda: monkeypatch.undo() or append(tmp / "ds", tmp / "c", workers=1,
                                                                                 new_classes=True))
    summary = append(tmp / "ds", b, workers=1)
    assert summary.version == 3 and MemmapDataset(tmp / "ds").classes[-1] == "zebra"
    assert summary.new_classes == []


def test_new_classes_are_refused_unless_asked_for_and_then_go_at_the_end(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=3, per_class=2, seed=5)
    (tmp_path / "b" / "class_2").rename(tmp_path / "b" / "zebra")
    (tmp_path / "b" / "class_0").rename(tmp_path / "b" / "ant")
    compile_folder(tmp_path / "a", tmp_path / "ds", size=SIZE, workers=1)
    with pytest.raises(CompileError, match=r"lacks: 'ant', 'zebra'.*--new-classes"):
        append(tmp_path / "ds", tmp_path / "b", workers=1)
    assert storage.dataset_versions(tmp_path / "ds") == [1]
    summary = append(tmp_path / "ds", tmp_path / "b", workers=1, new_classes=True)
    ds = MemmapDataset(tmp_path / "ds")
    assert ds.classes == ["class_0", "class_1", "ant", "zebra"] and summary.new_classes == ["ant", "zebra"]
    for i in range(len(ds)):
        assert ds.opened.source(i).split("/")[-2] == ds.classes[int(ds.labels[i])]


def test_appended_and_merged_datasets_carry_every_records_checksum(grown) -> None:
    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    record_checksums_match(MemmapDataset(tmp / "ds"))
    merge([tmp / "ds", tmp / "ds"], tmp / "merged")
    record_checksums_match(MemmapDataset(tmp / "merged"))


def test_merge_joins_differing_class_sets_by_name(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=4, seed=7)
    (tmp_path / "b" / "class_0").rename(tmp_path / "b" / "eel")  # b: class_1 (shared, index 0 there), eel
    compile_folder(tmp_path / "a", tmp_path / "A", size=SIZE, records_per_shard=3, workers=1)
    compile_folder(tmp_path / "b", tmp_path / "B", size=SIZE, records_per_shard=3, workers=1)
    assert MemmapDataset(tmp_path / "B").classes == ["class_1", "eel"]
    result = CliRunner().invoke(app, ["merge", str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "M")])
    assert result.exit_code == 0, result.output
    m, a, b = (MemmapDataset(tmp_path / k) for k in "MAB")
    assert m.classes == ["class_0", "class_1", "eel"] and len(m) == 14
    for i in range(len(m)):
        assert m.opened.source(i).split("/")[-2] == m.classes[int(m.labels[i])]
    for i in range(len(a)):
        assert np.array_equal(m[i].image.numpy().copy(), a[i].image.numpy().copy())
    for i in range(len(b)):
        assert np.array_equal(m[6 + i].image.numpy().copy(), b[i].image.numpy().copy())
    assert m.opened.source(6) == f"../b/{b.opened.source(0)}"
    # A's 6 records fill its 2 shards and B's start on a shard boundary: every shard is a whole input file,
    # reused by a reflink or (on this file system) a hard link, never copied
    assert "5 shard(s) (5 reused" in result.stdout
    # one record more in A: B's records no longer start on a boundary, and are copied into place
    make_folder(tmp_path / "a7", classes=1, per_class=7)
    compile_folder(tmp_path / "a7", tmp_path / "A7", size=SIZE, records_per_shard=3, workers=1)
    shifted = merge([tmp_path / "A7", tmp_path / "B"], tmp_path / "M2")
    assert shifted.shard_files[:2] != ["copy", "copy"] and set(shifted.shard_files[2:]) == {"copy"}
    m2, a7 = MemmapDataset(tmp_path / "M2"), MemmapDataset(tmp_path / "A7")
    for i in range(len(b)):
        assert np.array_equal(m2[7 + i].image.numpy(), b[i].image.numpy())
    assert m2.classes == ["class_0", "class_1", "eel"] and len(a7) == 7
    storage.verify_checksums(tmp_path / "M", m.manifest)


def test_info_on_a_merged_dataset_says_where_each_part_came_from_and_how_it_was_made(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=4, seed=7)
    compile_folder(tmp_path / "a", tmp_path / "A", size=SIZE, workers=1)
    compile_folder(tmp_path / "b", tmp_path / "B", size=SIZE, fit="pad", workers=1)
    merge([tmp_path / "A", tmp_path / "B"], tmp_path / "M")
    lines = CliRunner().invoke(app, ["info", str(tmp_path / "M")]).stdout.splitlines()
    assert lines[1] == (f"records from 0-5: {tmp_path / 'a'} (6 sources found), fit=center-crop; 6-13: "
                        f"{tmp_path / 'b'} (8 sources found), fit=pad")  # not the first input's, as if the whole
    compiled = next(line for line in lines if line.startswith("every part compiled with: "))
    assert f"size=[{SIZE}, {SIZE}]" in compiled and "fit=" not in compiled and "sources_found" not in compiled
    assert next(line for line in lines if line.startswith("from: ")).startswith("from: the parts above; ")
    single = CliRunner().invoke(app, ["info", str(tmp_path / "A")]).stdout.splitlines()
    assert not any(line.startswith("records from") for line in single)
    assert "sources_found=6" in single[2] and single[3].startswith(f"from: {tmp_path / 'a'}; ")


def test_merge_refuses_other_record_shapes_and_fields(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=2)
    compile_folder(tmp_path / "a", tmp_path / "A", size=SIZE, workers=1)
    compile_folder(tmp_path / "a", tmp_path / "B", size=SIZE + 1, workers=1)
    with pytest.raises(CompileError, match=r"records of shape \[17, 17, 3\].*\[16, 16, 3\]"):
        merge([tmp_path / "A", tmp_path / "B"], tmp_path / "M")
    table = tmp_path / "t.csv"
    table.write_text("path,label,score\n" + "".join(f"class_{c}/img_{i}.jpg,class_{c},{i}.5\n"
                                                    for c in range(2) for i in range(2)))
    compile_folder(tmp_path / "a", tmp_path / "C", size=SIZE, labels=table, workers=1)
    with pytest.raises(CompileError, match=r"fields must match by name"):
        merge([tmp_path / "A", tmp_path / "C"], tmp_path / "M")
    assert not (tmp_path / "M").exists()
    result = CliRunner().invoke(app, ["append", str(tmp_path / "A"), str(tmp_path / "a"), "--labels", str(table),
                                      "--again"])
    assert result.exit_code == 1 and f"{tmp_path / 'a'} has fields ['score'], {tmp_path / 'A'} has none" \
        in result.output, result.output  # (was: the append's scratch folder named for its SRC)


def test_prune_keeps_what_kept_versions_need(grown) -> None:
    tmp, master, a, b = grown
    c = tmp / "c"
    split_folder(b, {"c": c}, lambda cls, name: "c")
    for image in c.rglob("*.*"):
        image.rename(image.with_name("c" + image.name))
    append(tmp / "ds", b, workers=1)
    append(tmp / "ds", c, workers=1)
    (tmp / "ds" / "notes.txt").write_text("mine")
    v1_only = {"shards/00002.bin"}  # version 1's partial last shard (1.5: its index is kept, segment 0)
    result = CliRunner().invoke(app, ["prune", str(tmp / "ds"), "--keep", "2"])
    assert result.exit_code == 0, result.output
    assert "removed 1 version" in result.output
    assert storage.dataset_versions(tmp / "ds") == [2, 3]
    assert not any((tmp / "ds" / name).exists() for name in v1_only)
    assert (tmp / "ds" / "notes.txt").read_text() == "mine" and (tmp / "ds" / "shards/00000.bin").exists()
    segments = [s.index["labels"].file for s in storage.parse_manifest(tmp / "ds").segments]
    assert len(segments) == 3 and segments[0] == fmt.LABELS_FILE and (tmp / "ds" / fmt.LABELS_FILE).exists()
    for v in (2, 3):
        ds = MemmapDataset(tmp / "ds", version=v)
        storage.verify_checksums(tmp / "ds", ds.manifest)
    with pytest.raises(DatasetError, match="has no version 1 .*versions 2 to 3"):
        MemmapDataset(tmp / "ds", version=1)
    tables = {t.file for t in storage.parse_manifest(tmp / "ds").shard_tables}
    assert len(tables) == 3  # (1.4) version 1's (its first two shards), version 2's, version 3's
    versions.prune(tmp / "ds", 1)  # every table still backs shards of version 3: kept
    assert all((tmp / "ds" / name).exists() for name in tables)
    storage.verify_checksums(tmp / "ds", MemmapDataset(tmp / "ds").manifest)


def test_append_upgrades_a_1_2_dataset_in_place_and_its_readers_see_no_change(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=2, seed=3)
    compile_folder(tmp_path / "a", tmp_path / "ds", size=SIZE, workers=1)
    doc = whole_index_doc(json.loads((tmp_path / "ds" / fmt.MANIFEST_FILE).read_text()))  # one index, as 1.2's
    shards = [dataclasses.asdict(s) for s in storage.parse_manifest(tmp_path / "ds").shards]  # listed, as 1.2 did
    rewrite_manifest(tmp_path / "ds", {**{k: v for k, v in doc.items() if k not in ("checksums", "shard_tables")},
                                       "version": "1.2", "shards": shards})
    (tmp_path / "ds" / fmt.CHECKSUMS_FILE).unlink()  # as 1.2 wrote it: no per-record checksums (1.3's)
    (tmp_path / "ds" / fmt.SHARD_TABLE_FILE).unlink()  # nor a shard table (1.4's)
    old_bytes = (tmp_path / "ds" / fmt.MANIFEST_FILE).read_bytes()
    reader = MemmapDataset(tmp_path / "ds")
    pixels = [reader[i].image.numpy().copy() for i in range(len(reader))]
    append(tmp_path / "ds", tmp_path / "b", workers=1)
    assert (tmp_path / "ds" / fmt.version_file(1)).read_bytes() == old_bytes
    for ds in (reader, MemmapDataset(tmp_path / "ds", version=1), pickle.loads(pickle.dumps(reader))):
        assert ds.manifest.version == "1.2" and len(ds) == 6
        assert all(np.array_equal(ds[i].image.numpy().copy(), pixels[i]) for i in range(6))
    new = MemmapDataset(tmp_path / "ds")
    assert (new.manifest.version, new.version, len(new)) == (fmt.FORMAT_VERSION, 2, 10)
    assert json.loads((tmp_path / "ds" / fmt.MANIFEST_FILE).read_text())["dataset_version"] == 2  # the copy
    record_checksums_match(new)  # the 1.2 part's computed from its records, the appended part's compiled


def record_checksums_match(ds: MemmapDataset) -> None:
    """The dataset has format 1.3's checksums.bin, and it holds every record's CRC-32; verify agrees."""
    import zlib

    crcs = storage.record_checksums(ds.opened)
    assert ds.manifest.has_checksums and len(crcs) == len(ds)
    assert crcs.tolist() == [zlib.crc32(ds[i].image.permute(1, 2, 0).contiguous().numpy().tobytes())
                             for i in range(len(ds))]
    storage.verify_checksums(ds.path, ds.manifest)


def test_kill_9_during_append_leaves_the_dataset_at_n_and_intact(tmp_path: Path) -> None:
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=30, seed=9, sides=(200, 400))
    compile_folder(tmp_path / "a", tmp_path / "ds", size=64, records_per_shard=4, workers=1)
    first = storage.parse_manifest(tmp_path / "ds")
    killed = 0
    for delay in (0.6, 1.2, 1.8, 2.4, 3.0):
        proc = _append_process(tmp_path / "ds", tmp_path / "b")
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed += 1
        proc.communicate(timeout=120)
        ds = MemmapDataset(tmp_path / "ds")
        storage.verify_checksums(tmp_path / "ds", ds.manifest)
        assert len(ds) in (first.count, first.count + 60 * (ds.version - 1))
        if ds.version > 1:
            break
    assert killed >= 1
    # the next append clears what kills left (b may have landed already: added once more, on purpose)
    summary = append(tmp_path / "ds", tmp_path / "b", workers=1, again=True)
    listed = versions.listed_by_versions(tmp_path / "ds")
    stray = [p for p in (tmp_path / "ds" / fmt.APPENDS_DIR).rglob("*")
             if p.is_file() and p.relative_to(tmp_path / "ds").as_posix() not in listed]
    assert stray == [] and summary.count == len(MemmapDataset(tmp_path / "ds"))
    assert not list(tmp_path.glob(".ds.dsc-append-*"))


def test_cli_append_info_verify_name_versions(grown) -> None:
    tmp, _, _, b = grown
    runner = CliRunner()
    result = runner.invoke(app, ["append", str(tmp / "ds"), str(b), "-j", "1"])
    assert result.exit_code == 0, result.output
    assert "version 2, 9 new records (21 in all)" in result.stdout
    info = runner.invoke(app, ["info", str(tmp / "ds")])
    assert "version 2 (kept: 1, 2)" in info.stdout and "12-20:" in info.stdout
    as_json = json.loads(runner.invoke(app, ["info", str(tmp / "ds"), "--json"]).stdout)
    assert (as_json["version"], as_json["versions"], as_json["records"]) == (2, [1, 2], 21)
    assert "ok: manifest of version 1," in runner.invoke(app, ["verify", str(tmp / "ds"), "--version", "1"]).stdout
    assert "ok: manifest of version 2," in runner.invoke(app, ["verify", str(tmp / "ds")]).stdout
    bad = runner.invoke(app, ["append", str(tmp / "ds"), str(tmp / "nowhere")])
    assert bad.exit_code == 1 and "Traceback" not in bad.output


def test_a_dataset_named_through_a_link_is_locked_as_the_dataset_itself(grown) -> None:
    """Was: `latest -> ds` took the lock `.latest.dsc-lock`, so a writer through the link and one through `ds`
    never queued, and the one's clean-up deleted the other's files just before its commit."""
    tmp = grown[0]
    os.symlink("ds", tmp / "latest")
    with versions.writing(tmp / "ds"):
        with pytest.raises(CompileError, match=f"writing {tmp / 'ds'} right now"):
            with versions.writing(tmp / "latest", wait_s=0.5):
                pass
    with versions.writing(tmp / "latest"):  # let go: taken
        pass


CLEAR = "import sys; from pathlib import Path; from dsc.compiler import versions; " \
        "print(len(versions.clear_abandoned(Path(sys.argv[1]))[0]))"


def test_another_writers_clean_up_leaves_an_append_folder_in_use_alone(grown, monkeypatch) -> None:
    """A writer that bypasses this machine's lock (another machine's) clears killed appends' files in the moment
    before this append's commit: it deletes the killed one's, never this one's (was: every file no version listed
    yet, and this append then committed a version whose files were gone)."""
    tmp, _, _, b = grown
    real, cleared = versions.commit, []
    killed = tmp / "ds" / fmt.APPENDS_DIR / "0123456789abcdef" / fmt.SHARD_DIR

    def cleared_first(root, manifest):
        killed.mkdir(parents=True)
        (killed / "00009.bin").write_bytes(b"x")  # a killed append's file: nobody holds its folder
        done = subprocess.run([sys.executable, "-c", CLEAR, str(root)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        cleared.append(int(done.stdout))
        real(root, manifest)
    monkeypatch.setattr(versions, "commit", cleared_first)
    append(tmp / "ds", b, workers=1)
    assert cleared == [1] and not killed.exists()
    ds = MemmapDataset(tmp / "ds")
    assert (ds.version, len(ds)) == (2, 21)
    storage.verify_checksums(tmp / "ds", ds.manifest)


PRUNE_WITH_FEW_FILES = """
import resource, sys
from dsc.compiler import versions
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(len(versions.prune(sys.argv[1], 5).removed_files))
"""


def test_a_clean_up_of_many_append_folders_holds_one_open_at_a_time(grown) -> None:
    """Was: every append folder claimed at once (a descriptor each): with more folders than the process may
    open files, append and prune failed with "Too many open files", and the dataset could not be pruned."""
    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    for k in range(300):  # what appends killed right after making their folders left
        (tmp / "ds" / fmt.append_folder(f"{k:016x}")).mkdir()
    done = subprocess.run([sys.executable, "-c", PRUNE_WITH_FEW_FILES, str(tmp / "ds")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    committed = {e.file.split("/")[1] for e in storage.parse_manifest(tmp / "ds").files
                 if e.file.startswith(f"{fmt.APPENDS_DIR}/")}
    assert {p.name for p in (tmp / "ds" / fmt.APPENDS_DIR).iterdir()} == committed and len(committed) == 1
    assert int(done.stdout) == 0  # (empty folders: no file to count)
    storage.verify_checksums(tmp / "ds", MemmapDataset(tmp / "ds").manifest)


def test_force_replaces_a_grown_dataset_but_not_a_users_file_in_it(grown) -> None:
    tmp, master, _, b = grown
    append(tmp / "ds", b, workers=1)
    (tmp / "ds" / fmt.APPENDS_DIR / "0123456789abcdef" / "shards").mkdir(parents=True)  # a killed append's
    (tmp / "ds" / fmt.APPENDS_DIR / "0123456789abcdef" / "shards" / "00009.bin").write_bytes(b"x")
    (tmp / "ds" / "versions" / "notes.txt").write_text("mine")
    with pytest.raises(CompileError, match="versions/notes.txt"):
        compile_folder(master, tmp / "ds", size=SIZE, force=True, workers=1)
    (tmp / "ds" / "versions" / "notes.txt").unlink()
    compile_folder(master, tmp / "ds", size=SIZE, force=True, workers=1)
    ds = MemmapDataset(tmp / "ds")
    assert (ds.version, len(ds)) == (1, 21) and not (tmp / "ds" / fmt.VERSIONS_DIR).exists()
    assert not list(tmp.glob(".ds.dsc-old-*"))  # the grown dataset, every version's files, deleted whole


def _table(path: Path, rows: list[tuple[str, str, str, str]]) -> Path:
    path.write_text("path,label,tags,score\n" + "".join(",".join(r) + "\n" for r in rows))
    return path


def test_append_by_label_table_keeps_field_indices_and_widens_new_tags(tmp_path: Path) -> None:
    make_folder(tmp_path / "src", classes=2, per_class=4)
    rows = [(f"class_{c}/img_{i}.{'png' if i == 3 else 'jpg'}", f"class_{c}", "red;big" if i % 2 else "red", f"{i}.5")
            for c in range(2) for i in range(4)]
    compile_folder(tmp_path / "src", tmp_path / "ds", size=SIZE, workers=1,
                   labels=_table(tmp_path / "old.csv", rows[:5]), columns={"tags": "multilabel"})
    new_rows = [(p, c, "red;spotted" if k else "big", s) for k, (p, c, _, s) in enumerate(rows[5:])]
    table = _table(tmp_path / "new.csv", new_rows)
    with pytest.raises(CompileError, match=r"classes of field 'tags' that the dataset lacks: 'spotted'"):
        append(tmp_path / "ds", tmp_path / "src", labels=table, workers=1)
    before = MemmapDataset(tmp_path / "ds")
    old_tags = np.array(before.fields["tags"])
    append(tmp_path / "ds", tmp_path / "src", labels=table, workers=1, new_classes=True)
    ds = MemmapDataset(tmp_path / "ds")
    assert ds.field_classes("tags") == before.field_classes("tags") + ["spotted"]
    tags = np.array(ds.fields["tags"])
    assert tags.shape == (8, 3) and np.array_equal(tags[:5, :2], old_tags) and not tags[:5, 2].any()
    names = ds.field_classes("tags")
    for i in range(5, 8):
        row = {r[0]: r for r in new_rows}[ds.opened.source(i).removeprefix("../src/")]
        assert {names[k] for k in np.flatnonzero(tags[i])} == set(row[2].split(";"))
        assert float(ds.fields["score"][i]) == float(row[3]) and ds.classes[int(ds.labels[i])] == row[1]
    assert len(ds.manifest.segments) == 1  # (1.5) earlier rows gained a column: the index written whole, once
    append(tmp_path / "ds", tmp_path / "src", labels=_table(tmp_path / "again.csv", rows[:2]), workers=1)
    again = MemmapDataset(tmp_path / "ds")  # no new tag: a segment of the 2 new records, fields read across both
    assert [s.count for s in again.manifest.segments] == [8, 2]
    assert np.array_equal(np.asarray(again.fields["tags"])[:8], tags)
    for i in (8, 9):  # the new records, in their compile's order
        row = {r[0]: r for r in rows[:2]}[again.opened.source(i).removeprefix("../src/")]
        assert {names[k] for k in np.flatnonzero(again.fields["tags"][i])} == set(row[2].split(";"))
        assert np.take(again.fields["score"], [i, 0]).tolist() == [float(row[3]), float(again.fields["score"][0])]
    shown = CliRunner().invoke(app, ["info", str(tmp_path / "ds"), "--json"])  # fields read across both segments
    assert shown.exit_code == 0, shown.output
    about = {f["name"]: f for f in json.loads(shown.output)["fields"]}
    scores = np.asarray(again.fields["score"])
    assert (about["score"]["min"], about["score"]["max"]) == (scores.min(), scores.max())
    assert about["tags"]["counts"] == np.asarray(again.fields["tags"]).sum(axis=0).tolist()
    assert CliRunner().invoke(app, ["info", str(tmp_path / "ds")]).exit_code == 0


def test_append_carries_its_skips_into_the_skip_list(grown) -> None:
    tmp, _, _, b = grown
    (b / "class_0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    summary = append(tmp / "ds", b, workers=1)
    ds = MemmapDataset(tmp / "ds")
    skipped = storage.read_skipped(tmp / "ds", ds.manifest)
    assert summary.skipped == 1 and [s["source"] for s in skipped] == ["../b/class_0/broken.jpg"]
    storage.check_skip_list(ds.opened)


KILLED_AT = """
import os, signal, sys
from dsc.compiler import append, versions
def die(*args):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[3] == "before-commit":
    versions.commit = die  # every new file is written, the version's manifest is not
else:
    versions.refresh_copy = die  # version N + 1 is committed, manifest.json still says N
append.append(sys.argv[1], sys.argv[2], workers=1)
"""


@pytest.mark.parametrize("moment", ["before-commit", "before-refresh"])
def test_a_kill_at_the_commit_leaves_one_whole_version_and_the_next_writer_tidies(grown, moment: str) -> None:
    tmp, _, _, b = grown
    before = (tmp / "ds" / fmt.MANIFEST_FILE).read_bytes()
    done = subprocess.run([sys.executable, "-c", KILLED_AT, str(tmp / "ds"), str(b), moment], timeout=120)
    assert done.returncode == -signal.SIGKILL
    ds = MemmapDataset(tmp / "ds")
    assert (ds.version, len(ds)) == ((1, 12) if moment == "before-commit" else (2, 21))
    storage.verify_checksums(tmp / "ds", ds.manifest)
    assert (tmp / "ds" / fmt.MANIFEST_FILE).read_bytes() == before  # not refreshed yet in either case
    written = [p for p in (tmp / "ds" / fmt.APPENDS_DIR).rglob("*.bin")]
    assert written  # the killed append's files are there, listed by a version or not
    files = [p for p in (tmp / "ds" / fmt.APPENDS_DIR).rglob("*") if p.is_file()]
    result = CliRunner().invoke(app, ["prune", str(tmp / "ds"), "--keep", "5"])  # the next writer
    assert result.exit_code == 0, result.output
    if moment == "before-commit":  # what it deleted is counted (was: "0 files (0 B)")
        assert f"removed 0 versions and {len(files)} files" in result.output, result.output
    else:
        assert "removed 0 versions and 0 files" in result.output, result.output
    listed = versions.listed_by_versions(tmp / "ds")
    assert all(p.relative_to(tmp / "ds").as_posix() in listed for p in (tmp / "ds" / fmt.APPENDS_DIR).rglob("*.bin"))
    assert json.loads((tmp / "ds" / fmt.MANIFEST_FILE).read_text()).get("dataset_version", 1) == ds.version
    assert len(list(tmp.glob(".ds.dsc-append-*"))) == 1  # the killed append's scratch folder, until the next append
    if moment == "before-commit":
        append(tmp / "ds", b, workers=1)
    else:  # the same command again, its commit having landed: refused, never b's images twice
        with pytest.raises(CompileError, match="already ends with these 9 images .* pass --again"):
            append(tmp / "ds", b, workers=1)
    assert not list(tmp.glob(".ds.dsc-append-*"))
    assert (MemmapDataset(tmp / "ds").version, len(MemmapDataset(tmp / "ds"))) == (2, 21)


def test_an_append_beside_which_nothing_can_be_written_is_one_line(tmp_path: Path) -> None:
    make_folder(tmp_path / "src", classes=2, per_class=2)
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        compile_folder(tmp_path / "src", mnt / "ds", size=SIZE, workers=1)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        result = CliRunner().invoke(app, ["append", str(mnt / "ds"), str(tmp_path / "src")])
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert f"cannot write beside {mnt / 'ds'}" in result.output and "Read-only file system" in result.output
        assert MemmapDataset(mnt / "ds").version == 1


def test_an_append_whose_scratch_lock_cannot_be_made_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """The scratch folder takes the file system's last inode, so its owner lock cannot be created: one line, and
    nothing left behind (before: an OSError out of the CLI, and the scratch folder left there)."""
    make_folder(tmp_path / "src", classes=2, per_class=2)
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        compile_folder(tmp_path / "src", mnt / "ds", size=SIZE, workers=1)
        st = os.statvfs(mnt)
        subprocess.run(["mount", "-o", f"remount,nr_inodes={st.f_files - st.f_ffree + 1}", str(mnt)], check=True)
        gc.collect()  # (descriptors of earlier tests' objects closed now, not while the append runs)
        before, descriptors = sorted(p.name for p in mnt.iterdir()), len(os.listdir("/proc/self/fd"))
        result = CliRunner().invoke(app, ["append", str(mnt / "ds"), str(tmp_path / "src")])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        assert "cannot lock" in result.output and "No space left on device" in result.output
        assert sorted(p.name for p in mnt.iterdir()) == before  # the scratch folder removed
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == descriptors  # (the append ran in this process)
        assert MemmapDataset(mnt / "ds").version == 1


def test_verify_decode_remakes_each_part_of_a_merge_as_its_own_compile_did(tmp_path: Path) -> None:
    from dsc.tools.recheck import check_against_sources

    make_folder(tmp_path / "a", classes=2, per_class=3, sides=(40, 120))
    make_folder(tmp_path / "b", classes=2, per_class=3, seed=4, sides=(40, 120))
    compile_folder(tmp_path / "a", tmp_path / "A", size=SIZE, workers=1)
    compile_folder(tmp_path / "b", tmp_path / "B", size=SIZE, fit="stretch", workers=1)
    merge([tmp_path / "A", tmp_path / "B"], tmp_path / "M")
    assert [p.compile["fit"] for p in MemmapDataset(tmp_path / "M").manifest.record_parts] == ["center-crop", "stretch"]
    check = check_against_sources(tmp_path / "M", 12)
    assert check.checked == 12 and check.missing == [] and check.worst_max_abs == 0, check


@pytest.mark.parametrize("args", [["prune", "s3://bucket/ds", "--keep", "1"], ["append", "s3://bucket/ds", "SRC"],
                                  ["merge", "A", "s3://bucket/b", "OUT"], ["merge", "A", "B", "s3://bucket/out"]])
def test_object_storage_urls_reach_the_bucket_not_mangled_into_paths(grown, args: list[str], monkeypatch) -> None:
    """Was: '/cwd/s3:/bucket/ds: does not exist' (the URL folded into a relative path); then a refusal by
    name; now the bucket is asked (here an endpoint where nothing listens), and named as given."""
    pytest.importorskip("obstore", reason="the s3 extra is not installed")
    from s3server import closed_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setattr("dsc.storage.s3.BACKOFF_S", 0.01)
    tmp = grown[0]
    args = [str(tmp / "ds") if a in ("A", "B") else str(tmp / "b") if a == "SRC" else
            str(tmp / "out") if a == "OUT" else a for a in args]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1 and "connection refused" in result.output, result.output
    assert "s3://bucket/" in result.output and "Traceback" not in result.output, result.output
    assert "s3:/bucket" not in result.output.replace("s3://bucket", ""), result.output
    assert not (tmp / "out").exists()


@pytest.mark.parametrize("damaged", ["ds", "other"])
def test_a_merge_refuses_a_damaged_shard_file_it_would_link_or_copy(grown, damaged: str) -> None:
    """Was: a shard reused by a link (ds's first, whole in M) or copied in the kernel (other's, off M's shard
    boundaries) carried its damaged bytes into M, and the merge said it wrote M."""
    tmp = grown[0]
    shutil.copytree(tmp / "ds", tmp / "other")
    shard = tmp / damaged / "shards/00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = CliRunner().invoke(app, ["merge", str(tmp / "ds"), str(tmp / "other"), str(tmp / "M")])
    assert result.exit_code == 1, result.output
    assert f"{shard}: its SHA-256 is" in result.output and "damaged" in result.output, result.output
    assert not (tmp / "M").exists()


def test_a_killed_merges_partial_build_is_named_with_what_merge_can_do(grown) -> None:
    """Was: "run the command that started it again with --resume", an option merge does not have."""
    tmp = grown[0]
    shutil.copytree(tmp / "ds", tmp / "other")
    (tmp / ".M.dsc-partial").mkdir()  # what a merge killed after it made its build folder leaves
    result = CliRunner().invoke(app, ["merge", str(tmp / "ds"), str(tmp / "other"), str(tmp / "M")])
    assert result.exit_code == 1 and "again with --resume" not in result.output, result.output
    assert "dsc merge cannot continue it" in result.output and "pass --force to discard it" in result.output
    forced = CliRunner().invoke(app, ["merge", str(tmp / "ds"), str(tmp / "other"), str(tmp / "M"), "--force"])
    assert forced.exit_code == 0, forced.output


def test_merge_refuses_an_output_inside_an_input(grown) -> None:
    """Was: a whole dataset written inside the input folder (which `--force` then refused to replace)."""
    tmp = grown[0]
    shutil.copytree(tmp / "ds", tmp / "other")
    result = CliRunner().invoke(app, ["merge", str(tmp / "ds"), str(tmp / "other"), str(tmp / "ds" / "sub")])
    assert result.exit_code == 1 and "would lie one inside the other" in result.output, result.output
    assert not (tmp / "ds" / "sub").exists()
    # spelled with '..' or through a link (was: accepted, M written into ds's fields/, which a prune of ds emptied)
    os.symlink(tmp / "ds", tmp / "link")
    for spelled in (tmp / "ds" / "shards" / "..", tmp / "link"):
        result = CliRunner().invoke(app, ["merge", str(spelled), str(tmp / "other"), str(tmp / "ds" / "fields")])
        assert result.exit_code == 1 and "would lie one inside the other" in result.output, result.output
        assert not (tmp / "ds" / "fields" / fmt.MANIFEST_FILE).exists()


def test_a_local_append_that_loses_its_version_to_a_writer_without_the_lock_builds_again(grown, monkeypatch) -> None:
    """Another machine on a shared file system takes no lock of this one: its commit of version N + 1 between
    this append's plan and its commit makes this one build N + 2 on it, never lose either."""
    from dsc.compiler import append as append_module

    tmp, _, _, b = grown
    c = tmp / "c"
    split_folder(b, {"c": c}, lambda cls, name: "c")
    for image in c.rglob("*.*"):
        image.rename(image.with_name("c" + image.name))
    compile_folder(c, tmp / "c_compiled", size=SIZE, records_per_shard=5, workers=1)
    real, calls = versions.commit, []

    def other_writer_first(root, manifest):
        calls.append(manifest.dataset_version)
        if len(calls) == 1:  # the other writer, bypassing the lock: its whole append, committed first
            monkeypatch.setattr(versions, "commit", real)
            append_module._commit_on_latest(root, storage.open_dataset(tmp / "c_compiled"), False, c, False)
            monkeypatch.setattr(versions, "commit", other_writer_first)
        return real(root, manifest)
    monkeypatch.setattr(versions, "commit", other_writer_first)
    summary = append(tmp / "ds", b, workers=1)
    assert calls == [2, 3] and summary.version == 3
    ds = MemmapDataset(tmp / "ds")
    assert [p.count for p in ds.manifest.record_parts] == [12, 9, 9] and len(set(by_source(ds))) == 30
    listed = versions.listed_by_versions(tmp / "ds")
    assert all(p.relative_to(tmp / "ds").as_posix() in listed for p in (tmp / "ds" / fmt.APPENDS_DIR).rglob("*.bin"))
    storage.verify_checksums(tmp / "ds", ds.manifest)
def test_the_manifest_does_not_grow_with_the_shards(tmp_path: Path) -> None:
    """Format 1.4: one shard a record or one shard in all, the manifest is as long but for a few digits; the
    shards' digests are in the shard table, 32 bytes each (1.3 listed ~150 bytes a shard in the manifest)."""
    make_folder(tmp_path / "src", classes=2, per_class=6)
    sizes = {}
    for per_shard in (1, 12):
        out = tmp_path / f"ds{per_shard}"
        compile_folder(tmp_path / "src", out, size=SIZE, workers=1, records_per_shard=per_shard)
        sizes[per_shard] = len((out / fmt.MANIFEST_FILE).read_bytes())
        assert (out / fmt.SHARD_TABLE_FILE).stat().st_size == 32 * (12 // per_shard)
        manifest = storage.parse_manifest(out)
        assert [s.file for s in manifest.shards] == [fmt.shard_file(k) for k in range(12 // per_shard)]
        assert [bytes.fromhex(s.sha256) for s in manifest.shards] == [
            hashlib.sha256((out / fmt.shard_file(k)).read_bytes()).digest() for k in range(12 // per_shard)]
    assert abs(sizes[1] - sizes[12]) < 10


def test_an_append_writes_the_digests_of_its_own_shards_only(grown) -> None:
    """The append's shard table holds the rows of the shards it wrote (the partial last one written again, and
    the new ones); the version it grows keeps its table file unchanged, and its row of the replaced shard."""
    tmp, _, _, b = grown
    root = tmp / "ds"
    before = storage.parse_manifest(root)
    table_bytes = (root / fmt.SHARD_TABLE_FILE).read_bytes()
    append(root, b, workers=1)
    after = storage.parse_manifest(root)
    full = before.count // before.records_per_shard
    assert (root / fmt.SHARD_TABLE_FILE).read_bytes() == table_bytes
    first, second = after.shard_tables
    assert (first.file, first.first, first.count, first.row) == (fmt.SHARD_TABLE_FILE, 0, full, 0)
    assert (second.first, second.count, second.row) == (full, len(after.shards) - full, 0)
    assert second.file.startswith(f"{fmt.APPENDS_DIR}/") and second.folder == second.file.rsplit("/", 1)[0] + "/shards"
    assert (root / second.file).stat().st_size == 32 * (len(after.shards) - full)
    assert list(after.shards[:full]) == list(before.shards[:full])
    storage.verify_checksums(root, after)
    storage.verify_checksums(root, storage.parse_manifest(root, version=1))  # its replaced shard's row still used


def test_an_append_run_again_after_its_commit_is_refused_not_added_twice(grown) -> None:
    """A kill or a lost connection can hide that an append's commit landed; the same command run again would
    serve each of those images twice an epoch: it is refused, naming the records, unless --again."""
    tmp, _, a, b = grown
    def contents() -> tuple:
        ds = MemmapDataset(tmp / "ds")
        return ds.version, ds.opened.read_records(range(len(ds))).tobytes(), ds.labels.tolist()
    append(tmp / "ds", b, workers=1)
    once = contents()
    with pytest.raises(CompileError, match=r"version 2 already ends with these 9 images of .*/b \(records 12 to "
                                           r"20: the same sources, of the same sizes, decoded to the same pixels\)"
                                           r".*nothing was added.*--again"):
        append(tmp / "ds", b, workers=1)
    assert contents() == once and once[0] == 2
    result = CliRunner().invoke(app, ["append", str(tmp / "ds"), str(b), "-j", "1"])
    assert result.exit_code == 1 and "pass --again" in result.stderr and "Traceback" not in result.output
    compile_folder(a, tmp / "fresh", size=SIZE, records_per_shard=5, workers=1)
    with pytest.raises(CompileError, match="version 1 already ends with these 12 images"):  # the compile's SRC too
        append(tmp / "fresh", a, workers=1)
    result = CliRunner().invoke(app, ["append", str(tmp / "ds"), str(b), "-j", "1", "--again"])
    assert result.exit_code == 0 and "version 3, 9 new records (30 in all)" in result.stdout, result.output


def test_a_drop_folder_reused_for_new_images_of_the_same_names_and_sizes_is_appended(grown) -> None:
    """Was: refused as a repeat of the last append (the same sources, of the same sizes), pixels never compared."""
    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    for k, image in enumerate(sorted(b.rglob("*.*"))):  # the next batch: new pictures under the same names
        with Image.open(image) as old:
            size, kind = old.size, old.format
        save(image, pattern(size[1], size[0], seed=500 + k), kind)
    summary = append(tmp / "ds", b, workers=1)
    assert (summary.version, summary.count) == (3, 30)
    ds = MemmapDataset(tmp / "ds")
    assert not np.array_equal(ds.opened.read_records(range(12, 21)), ds.opened.read_records(range(21, 30)))


def test_other_pixels_from_another_jpeg_decoder_do_not_make_a_repeat_new(grown, monkeypatch) -> None:
    """A re-run on a machine with another JPEG decoder may decode the same files to other pixels: there a pixel
    difference proves nothing, and the same names and sizes are still refused as a repeat."""
    from dsc.compiler import pipeline

    tmp, _, _, b = grown
    append(tmp / "ds", b, workers=1)
    for k, image in enumerate(sorted(b.rglob("*.*"))):
        with Image.open(image) as old:
            size, kind = old.size, old.format
        save(image, pattern(size[1], size[0], seed=700 + k), kind)
    monkeypatch.setattr(pipeline, "decoder_name", lambda: "another decoder")
    with pytest.raises(CompileError, match=r"already ends with these 9 images .* of the same sizes\), added by"):
        append(tmp / "ds", b, workers=1)
    assert MemmapDataset(tmp / "ds").version == 2


def test_an_appends_refusals_name_src_and_the_dataset_not_its_scratch_folder(grown) -> None:
    tmp, _, _, b = grown
    flat = tmp / "flat"
    flat.mkdir()
    for image in sorted(b.rglob("*.jpg"))[:2]:
        shutil.copy(image, flat / image.name)
    result = CliRunner().invoke(app, ["append", str(tmp / "ds"), str(flat), "-j", "1"])
    assert result.exit_code == 1 and f"and {flat} is not: their labels cannot agree" in result.output, result.output
    result = CliRunner().invoke(app, ["append", str(tmp / "ds"), str(tmp), "-j", "1"])
    assert result.exit_code == 1 and f"the dataset {tmp / 'ds'} is inside the source folder {tmp}" in result.output
    assert "dsc-append" not in result.output and MemmapDataset(tmp / "ds").version == 1
