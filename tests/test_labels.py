"""Labels beyond folder names: class vocabularies shared across splits, label tables (CSV/JSONL) with
class, multilabel, float and int columns, and their fields end to end (format 1.1)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import dsc
from dsc import CompileError, MemmapDataset
from dsc import format as fmt
from dsc.cli import app
from dsc.compiler.labels import classes_without_records
from dsc.reader.device import pack_fields, packed_bytes, unpack_fields
from dsc.reader.producer import field_specs
from dsc.testing import assert_roundtrip, make_image_folder
from dsc.tools.sheet import caption_lines

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


def images(root: Path, classes: list[str], per_class: int = 3, seed: int = 0) -> Path:
    """An ImageFolder with the given class names (real JPEG and PNG files)."""
    make_image_folder(root / "tmp", classes=len(classes), per_class=per_class, size=(20, 24), seed=seed)
    for k, name in enumerate(classes):
        (root / "tmp" / f"class_{k}").rename(root / name)
    (root / "tmp").rmdir()
    return root


def folder_of(ds: MemmapDataset, i: int) -> str:
    return ds.opened.source(i).split("/")[0]


# ----------------------------------------------------------------------------- splits

def test_a_validation_split_lacking_a_class_keeps_the_training_indices(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    images(tmp_path / "train", ["bird", "cat", "dog"])
    images(tmp_path / "val", ["bird", "dog"], seed=1)
    dsc.compile_folder(tmp_path / "train", tmp_path / "out" / "train", size=8, workers=1)
    summary = dsc.compile_folder(tmp_path / "val", tmp_path / "out" / "val", size=8, workers=1,
                                 classes=tmp_path / "out" / "train")
    train, val = MemmapDataset(tmp_path / "out" / "train"), MemmapDataset(tmp_path / "out" / "val")
    assert val.classes == train.classes == ["bird", "cat", "dog"]
    assert all(val.classes[val[i].label] == folder_of(val, i) for i in range(len(val)))
    assert sorted(set(val.labels.tolist())) == [0, 2]  # dog keeps index 2
    assert summary.empty_classes == ["cat"]  # a vocabulary class without images keeps its index


def test_splits_compiled_apart_are_flagged_when_their_classes_differ(tmp_path: Path, caplog) -> None:
    (tmp_path / "out").mkdir()
    images(tmp_path / "train", ["bird", "cat", "dog"])
    images(tmp_path / "val", ["bird", "dog"], seed=1)
    images(tmp_path / "other", ["car", "truck"], seed=2)
    dsc.compile_folder(tmp_path / "train", tmp_path / "out" / "train", size=8, workers=1)
    with caplog.at_level(logging.WARNING, logger="dsc"):
        dsc.compile_folder(tmp_path / "val", tmp_path / "out" / "val", size=8, workers=1)
        assert len(caplog.records) == 1
        assert re.search(r"classes of val differ .*/out/train \(val lacks cat\): 'dog' is label 1 here and 2 in "
                         r".*/out/train; .*--classes-from .*train$", caplog.records[0].getMessage())
        dsc.compile_folder(tmp_path / "other", tmp_path / "out" / "other", size=8, workers=1)  # no shared class
        dsc.compile_folder(tmp_path / "val", tmp_path / "out" / "val2", size=8, workers=1,
                           classes=tmp_path / "out" / "train")  # fixed vocabulary: nothing to flag
        assert len(caplog.records) == 1


def test_a_split_is_flagged_only_when_a_shared_class_moves_and_told_a_fix_that_works(tmp_path: Path, caplog) -> None:
    """A val split lacking only the last class numbers the rest alike; one with a class train lacks
    cannot take --classes-from train (it would be refused), so it is told --classes with the union."""
    (tmp_path / "out").mkdir()
    images(tmp_path / "train", ["bird", "cat", "dog"])
    images(tmp_path / "val", ["bird", "cat"], seed=1)
    images(tmp_path / "more", ["bird", "dog", "emu"], seed=2)
    dsc.compile_folder(tmp_path / "train", tmp_path / "out" / "train", size=8, workers=1)
    with caplog.at_level(logging.WARNING, logger="dsc"):
        dsc.compile_folder(tmp_path / "val", tmp_path / "out" / "val", size=8, workers=1)
        assert caplog.records == []
        dsc.compile_folder(tmp_path / "more", tmp_path / "out" / "more", size=8, workers=1)
    message = caplog.records[-1].getMessage()
    assert re.search(r"\(more lacks cat; more adds emu\): 'dog' is label 1 here and 2 in .*/out/train; to keep "
                     r"train's indices, compile with --classes bird,cat,dog,emu$", message)
    assert "--classes-from" not in message


def test_a_class_folder_outside_the_vocabulary_is_refused_or_skipped(tmp_path: Path) -> None:
    images(tmp_path / "val", ["bird", "cat", "emu"])
    with pytest.raises(CompileError, match=r"'emu' .* not among the 2 given classes.*--skip-unknown-classes"):
        dsc.compile_folder(tmp_path / "val", tmp_path / "out", size=8, workers=1, classes=["bird", "cat"])
    assert not (tmp_path / "out").exists()
    summary = dsc.compile_folder(tmp_path / "val", tmp_path / "out", size=8, workers=1, classes=["cat", "bird"],
                                 skip_unknown_classes=True)
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == ["cat", "bird"] and summary.kept == 6
    assert all(ds.classes[ds[i].label] == folder_of(ds, i) for i in range(len(ds)))
    assert ("emu", "class folder not among the given classes") in summary.skipped
    assert_roundtrip(tmp_path / "val", tmp_path / "out")


def test_the_cli_takes_classes_from_a_list_a_file_or_a_dataset(tmp_path: Path) -> None:
    images(tmp_path / "src", ["bird", "cat"])
    (tmp_path / "classes.txt").write_text("cat\n\nbird\nemu\n")
    for args in (["--classes", "cat,bird,emu"], ["--classes", str(tmp_path / "classes.txt")]):
        out = tmp_path / f"out{len(args[1])}"
        result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(out), "--size", "8", "-j", "1", *args])
        assert result.exit_code == 0, result.output
        assert MemmapDataset(out).classes == ["cat", "bird", "emu"]
        assert "note: class 'emu' has no images (its label index is kept)\n" in result.stderr  # no folder emu
        assert "folder" not in result.stderr
    (tmp_path / "src" / "emu").mkdir()  # an empty class folder is called one
    result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(tmp_path / "empty"), "--size", "8", "-j", "1"])
    assert result.exit_code == 0, result.output
    assert "note: class folder 'emu' has no images (its label is kept)\n" in result.stderr
    result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(tmp_path / "again"), "--size", "8",
                                 "--classes-from", str(out)])
    assert result.exit_code == 0 and MemmapDataset(tmp_path / "again").classes == ["cat", "bird", "emu"]
    result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(tmp_path / "x"), "--classes", "cat",
                                 "--classes-from", str(out)])
    assert result.exit_code == 2 and "not both" in result.output
    result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(tmp_path / "x"), "--skip-unknown-classes"])
    assert result.exit_code == 2 and "only with --classes or --classes-from" in result.output
    result = runner.invoke(app, ["compile", str(tmp_path / "src"), str(tmp_path / "x"), "--classes-from",
                                 str(tmp_path)])
    assert result.exit_code == 2 and "is not a dsc dataset (no manifest.json)" in result.output


def test_a_classes_value_is_read_alike_by_the_cli_and_python(tmp_path: Path, monkeypatch) -> None:
    """Names or a file, by one rule: an empty value, or a missing file, is said, not taken as a class."""
    images(tmp_path / "src", ["bird", "cat"])
    monkeypatch.chdir(tmp_path)
    compile_ = ["compile", "src", "x", "--size", "8", "-j", "1"]
    result = runner.invoke(app, [*compile_, "--classes", ""])
    assert result.exit_code == 1 and result.stderr.endswith("error: the classes are empty (give names, a file of "
                                                            "names or a dataset)\n")
    result = runner.invoke(app, [*compile_, "--classes", "classes.txt"])
    assert result.exit_code == 1 and result.stderr.endswith("error: classes file classes.txt does not exist\n")
    result = runner.invoke(app, [*compile_, "--classes-from", "nothere"])
    assert result.exit_code == 2 and "Invalid value for --classes-from: nothere does not exist\n" in result.output
    dsc.compile_folder(tmp_path / "src", tmp_path / "out", size=8, workers=1, classes="cat,bird")
    assert MemmapDataset(tmp_path / "out").classes == ["cat", "bird"]
    with pytest.raises(CompileError, match=r"^classes file cat/bird does not exist$"):
        dsc.compile_folder(tmp_path / "src", tmp_path / "out2", size=8, workers=1, classes="cat/bird")
    with pytest.raises(CompileError, match=r"class folder\(s\) 'bird' .* not among the 2 given classes"):
        dsc.compile_folder(tmp_path / "src", tmp_path / "out3", size=8, workers=1, classes="cat,bird.txt")  # names


def test_a_table_class_without_images_is_not_called_a_folder(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "".join(f"{p},{['cat', 'dog'][k % 2]}\n" for k, p in enumerate(paths)))
    result = runner.invoke(app, ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1",
                                 "--labels", str(table), "--classes", "cat,dog,emu"])
    assert result.exit_code == 0, result.output
    assert "note: class 'emu' has no images (its label index is kept)\n" in result.stderr
    assert "folder" not in result.stderr


# ----------------------------------------------------------------------------- label tables

@pytest.fixture
def flat(tmp_path: Path) -> tuple[Path, list[str]]:
    """12 images in a flat-ish folder (label tables do not need class folders), and their paths."""
    src = make_image_folder(tmp_path / "src", classes=3, per_class=4, size=(20, 24), seed=3)
    return src, sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())


def rows_for(paths: list[str]) -> list[dict]:
    return [{"path": p, "label": ["cat", "dog", "emu"][k % 3], "tags": ["a", "b"][:k % 3],
             "target": [k / 4, -k], "count": k} for k, p in enumerate(paths)]


def write_csv(path: Path, rows: list[dict]) -> Path:
    lines = ["filename,label,tags,target,count"]
    lines += [f'{r["path"]},{r["label"]},"{";".join(r["tags"])}",{";".join(map(str, r["target"]))},{r["count"]}'
              for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_csv_table_gives_labels_and_typed_fields(flat, tmp_path: Path) -> None:
    src, paths = flat
    rows = rows_for(paths[:9])  # 3 images are not listed
    summary = dsc.compile_folder(src, tmp_path / "out", size=8, workers=1,
                                 labels=write_csv(tmp_path / "labels.csv", rows))
    assert summary.kept == 9 and summary.ignored == 3
    ds = MemmapDataset(tmp_path / "out")
    assert ds.manifest.version == fmt.FORMAT_VERSION and ds.classes == ["cat", "dog", "emu"]
    assert {f.name: (f.kind, f.shape) for f in ds.manifest.fields} == {
        "tags": ("multilabel", (2,)), "target": ("float", (2,)), "count": ("int", ())}
    assert ds.field_classes("tags") == ["a", "b"]
    by_path = {r["path"]: r for r in rows}
    for i in range(len(ds)):
        row = by_path[ds.opened.source(i)]
        assert ds.classes[ds.labels[i]] == row["label"]
        assert [ds.field_classes("tags")[k] for k in np.flatnonzero(ds.fields["tags"][i])] == row["tags"]
        assert ds.fields["target"][i].tolist() == row["target"] and ds.fields["target"].dtype == np.float32
        assert int(ds.fields["count"][i]) == row["count"]
    assert_roundtrip(src, tmp_path / "out")


def test_a_jsonl_table_gives_the_same_dataset_as_the_csv(flat, tmp_path: Path) -> None:
    src, paths = flat
    rows = rows_for(paths)
    dsc.compile_folder(src, tmp_path / "csv", size=8, workers=1, labels=write_csv(tmp_path / "t.csv", rows))
    dsc.compile_folder(src, tmp_path / "jsonl", size=8, workers=1, labels=write_jsonl(tmp_path / "t.jsonl", rows))
    for name in ("labels.bin", "fields/tags.bin", "fields/target.bin", "fields/count.bin", "shards/00000.bin"):
        assert (tmp_path / "csv" / name).read_bytes() == (tmp_path / "jsonl" / name).read_bytes(), name


def test_a_listed_image_that_is_missing_or_undecodable_is_skipped_and_recorded(flat, tmp_path: Path) -> None:
    src, paths = flat
    (src / "broken.jpg").write_bytes(b"not a jpeg")
    rows = rows_for([*paths[:4], "gone/missing.jpg", "broken.jpg"])
    summary = dsc.compile_folder(src, tmp_path / "out", size=8, workers=1,
                                 labels=write_csv(tmp_path / "labels.csv", rows))
    skipped = dict(summary.skipped)
    assert summary.kept == 4 and set(skipped) == {"gone/missing.jpg", "broken.jpg"}
    assert "listed in labels.csv but not found" in skipped["gone/missing.jpg"]
    ds = MemmapDataset(tmp_path / "out")
    by_path = {r["path"]: r for r in rows}
    assert all(int(ds.fields["count"][i]) == by_path[ds.opened.source(i)]["count"] for i in range(4))


def test_a_listed_broken_link_or_fifo_is_skipped_once_with_the_walks_reason(flat, tmp_path: Path) -> None:
    """The walk skips them, and the table's lookup found no file there either: one entry each, the
    walk's (which says what the file is), in the summary, the skip list and the on_skip calls."""
    src, paths = flat
    (src / "gone.jpg").symlink_to(src / "nowhere.jpg")
    os.mkfifo(src / "pipe.jpg")
    rows = rows_for([*paths[:4], "gone.jpg", "pipe.jpg", "missing.jpg"])
    told = []
    summary = dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, on_skip=lambda s, r: told.append(s),
                                 labels=write_csv(tmp_path / "labels.csv", rows))
    assert sorted(source for source, _ in summary.skipped) == ["gone.jpg", "missing.jpg", "pipe.jpg"]
    assert sorted(told) == ["gone.jpg", "missing.jpg", "pipe.jpg"]
    skipped = dict(summary.skipped)
    assert skipped["gone.jpg"] == "broken symbolic link (its target does not exist)"
    assert skipped["pipe.jpg"] == "not a regular file (a device, pipe or socket)"
    assert skipped["missing.jpg"] == "listed in labels.csv but not found"
    manifest = MemmapDataset(tmp_path / "out").manifest
    assert manifest.count == 4 and [s["source"] for s in manifest.skipped] == ["gone.jpg", "missing.jpg", "pipe.jpg"]


def test_empty_classes_are_found_in_one_pass() -> None:
    """Which vocabulary classes no record has: as the per-class definition says, and linear in the
    records (a scan per class took ~2.6 s at 2k classes x 1M records in discovery, and 0.1 ms a class
    at best: ~5 s for the 50k classes here; one pass takes milliseconds)."""
    rng = np.random.default_rng(0)
    for k, n in [(1, 0), (1, 3), (5, 3), (40, 200), (300, 1000)]:
        vocabulary = [f"c{i}" for i in range(k)]
        labels = rng.integers(-1, k, n)  # -1: no label, which is no class
        assert classes_without_records(labels, vocabulary) == \
            [c for i, c in enumerate(vocabulary) if not np.any(labels == i)]
    vocabulary = [f"c{i}" for i in range(50_000)]
    labels = rng.integers(0, 25_000, 1_000_000) * 2  # the odd classes have no record
    started = time.perf_counter()
    empty = classes_without_records(labels, vocabulary)
    elapsed = time.perf_counter() - started
    assert empty[:3] == ["c1", "c3", "c5"] and len(empty) == 25_000
    assert elapsed < 1.0, f"{elapsed:.1f} s for 50k classes x 1M records"


def test_column_kinds_are_inferred_or_given(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label,species,score\n" + "".join(
        f"{p},{k % 2},{['owl', 'emu'][k % 2]},{k}\n" for k, p in enumerate(paths)))
    dsc.compile_folder(src, tmp_path / "a", size=8, workers=1, labels=table)
    ds = MemmapDataset(tmp_path / "a")
    assert ds.classes == ["0", "1"]  # integers in the label column are classes, in numeric order
    assert {f.name: f.kind for f in ds.manifest.fields} == {"species": "class", "score": "int"}
    assert ds.field_classes("species") == ["emu", "owl"]
    dsc.compile_folder(src, tmp_path / "b", size=8, workers=1, labels=table, columns={"score": "float"})
    assert MemmapDataset(tmp_path / "b").fields["score"].dtype == np.float32


def test_integer_classes_are_their_own_indices(flat, tmp_path: Path) -> None:
    """Labels 1, 2 and 10 stay 1, 2 and 10 (a 1-based table, or a split missing a class, moves nothing);
    "01" is class 1."""
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "".join(f"{p},{['2', '10', '01'][k % 3]}\n" for k, p in enumerate(paths)))
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == [str(k) for k in range(11)]
    by_path = {p: [2, 10, 1][k % 3] for k, p in enumerate(paths)}
    assert all(ds.labels[i] == by_path[ds.opened.source(i)] for i in range(len(ds)))


@pytest.mark.parametrize("cells", [["1.5", "2.25", "NA", "10"], ["0", "1", "1x", "2"], ["3", "4", "nan", "5"]])
def test_a_number_column_with_one_bad_cell_stops_instead_of_becoming_classes(flat, tmp_path: Path, cells) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label,age\n" + "".join(f"{p},a,{cells[k % 4]}\n" for k, p in enumerate(paths)))
    with pytest.raises(CompileError, match=rf"t.csv, line 4, column 'age': '{cells[2]}' is not a number, but the "
                                           r"column's other values are; .* --column age:class"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, columns={"age": "class"})


def test_a_validation_table_takes_the_training_fields_vocabularies(flat, tmp_path: Path) -> None:
    """--classes-from also fixes the kind and vocabulary of same-named class and tag columns."""
    src, paths = flat
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"
    train.write_text("path,label,species,tags\n" + "".join(
        f"{p},a,{['cat', 'dog', 'fox'][k % 3]},{['indoor;red', 'outdoor', 'red'][k % 3]}\n"
        for k, p in enumerate(paths[:6])))
    val.write_text("path,label,species,tags\n" + "".join(
        f"{p},a,{['dog', 'fox'][k % 2]},{['red', 'outdoor'][k % 2]}\n" for k, p in enumerate(paths[6:])))
    dsc.compile_folder(src, tmp_path / "out" / "train", size=8, workers=1, labels=train)
    dsc.compile_folder(src, tmp_path / "out" / "val", size=8, workers=1, labels=val,
                       classes=tmp_path / "out" / "train")
    t, v = MemmapDataset(tmp_path / "out" / "train"), MemmapDataset(tmp_path / "out" / "val")
    assert v.field_classes("species") == t.field_classes("species") == ["cat", "dog", "fox"]
    assert v.field_classes("tags") == t.field_classes("tags") == ["indoor", "outdoor", "red"]
    assert {f.name: f.kind for f in v.manifest.fields} == {"species": "class", "tags": "multilabel"}  # no ';' in val
    val.write_text(val.read_text().replace(",dog,", ",emu,", 1))
    with pytest.raises(CompileError, match=r"val.csv, line 2, column 'species': class 'emu' is not among"):
        dsc.compile_folder(src, tmp_path / "out" / "val2", size=8, workers=1, labels=val,
                           classes=tmp_path / "out" / "train")


def test_a_table_label_uses_the_training_vocabulary(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "".join(f"{p},{['dog', 'cat'][k % 2]}\n" for k, p in enumerate(paths)))
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, classes=["ant", "cat", "dog"])
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == ["ant", "cat", "dog"] and sorted(set(ds.labels.tolist())) == [1, 2]
    table.write_text("path,label\n" + "".join(f"{p},{['dog', 'yak'][k % 2]}\n" for k, p in enumerate(paths)))
    with pytest.raises(CompileError, match=r"t.csv, line 3, column 'label': class 'yak' is not among"):
        dsc.compile_folder(src, tmp_path / "out2", size=8, workers=1, labels=table, classes=["cat", "dog"])
    summary = dsc.compile_folder(src, tmp_path / "out3", size=8, workers=1, labels=table, classes=["cat", "dog"],
                                 skip_unknown_classes=True)
    assert summary.kept == 6 and len(summary.skipped) == 6


@pytest.mark.parametrize(("content", "kinds", "match"), [
    ("path,label\nA,cat\nA,dog\n", None, r"line 3: image 'A' is listed twice \(first on line 2\)"),
    ("path,label\n../secret.jpg,cat\n", None, r"line 2: image path '../secret.jpg' leaves the source folder"),
    ("path,label\n/etc/x.jpg,cat\n", None, r"line 2: image path '/etc/x.jpg' leaves"),
    ("path,label\nA,cat,extra\n", None, r"line 2: 3 values, but the header has 2"),
    ("path,target\nA,1.5\nB,abc\n", {"target": "float"}, r"line 3, column 'target': 'abc' is not a finite number"),
    ("path,target\nA,1.5\nB,nan\n", {"target": "float"}, r"line 3, column 'target': 'nan' is not a finite"),
    ("path,target\nA,1e39\n", {"target": "float"}, r"line 2, column 'target': '1e39' is not a finite number in"),
    ("path,n\nA,1\nB,2.5\n", {"n": "int"}, r"line 3, column 'n': '2.5' is not an integer"),
    ("path,v\nA,1;2\nB,3\n", None, r"line 3, column 'v': 1 values, but line 2 has 2"),
    ("path,label\nA,\n", {"label": "class"}, r"bad.csv, line 2, column 'label': empty label$"),
    ("path,label\nA,cat\nB,\n", None, r"bad.csv, line 3, column 'label': empty label$"),
    ("path,label\nA,0.5\n", None, r"column 'label' holds float values"),
    ("path,index\nA,1\n", None, r"column 'index' is reserved"),
    ("path,a b\nA,1\n", None, r"'a b' is not a valid field name"),
    ("path,x,x\nA,1,2\n", None, r"column\(s\) 'x' appear twice"),
    ("path,label\n", None, r"no rows"),
    ("", None, r"empty"),
    ('path,label\n"A,cat\n', None, r"malformed CSV|values, but the header"),
    ("path,label\nA,cat\n", {"nope": "int"}, r"--column nope: .* has no column 'nope'"),
])
def test_a_malformed_csv_table_names_the_file_line_and_column(flat, tmp_path: Path, content, kinds, match) -> None:
    src, paths = flat
    table = tmp_path / "bad.csv"
    table.write_text(content.replace("A", paths[0]).replace("B", paths[1]) if content else "")
    with pytest.raises(CompileError, match=match.replace("'A'", f"'{paths[0]}'")) as error:
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, columns=kinds)
    assert "bad.csv" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_a_misspelt_label_column_is_warned_about(flat, tmp_path: Path, caplog) -> None:
    """`lable` or `Label` would quietly give an unlabeled dataset; a warning, for a field may be meant
    (a table without a label column is compiled only when said to be unlabeled: --column label:none)."""
    src, paths = flat
    for k, header in enumerate(["lable", "Label", "labels", "lbl"]):
        table = tmp_path / f"t{k}.csv"
        table.write_text(f"path,{header},weight\n" + "".join(f"{p},cat,1\n" for p in paths))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dsc"):
            summary = dsc.compile_folder(src, tmp_path / f"out{k}", size=8, workers=1, labels=table,
                                         columns={"label": "none"})
        assert not summary.labeled
        assert [r.getMessage() for r in caplog.records] == [
            f"{table} has no 'label' column, so the records are unlabeled and '{header}' becomes a field; if "
            f"'{header}' is the class label, rename it to 'label'"]
    caplog.clear()
    table.write_text("path,level,weight\n" + "".join(f"{p},cat,1\n" for p in paths))
    with caplog.at_level(logging.WARNING, logger="dsc"):
        dsc.compile_folder(src, tmp_path / "plain", size=8, workers=1, labels=table, columns={"label": "none"})
    assert caplog.records == []


def test_a_table_that_is_a_folder_or_a_json_document_is_named_as_such(flat, tmp_path: Path) -> None:
    src, paths = flat
    (tmp_path / "t.json").write_text(json.dumps([{"path": p, "label": "cat"} for p in paths]))
    compile_ = ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1", "--labels"]
    result = runner.invoke(app, [*compile_, str(tmp_path)])
    assert result.exit_code == 1 and result.stderr.endswith(
        f"error: {tmp_path} is a folder; --labels takes a CSV or JSONL file\n")
    result = runner.invoke(app, [*compile_, str(tmp_path / "t.json")])
    assert result.exit_code == 1 and result.stderr.endswith(
        f"error: {tmp_path / 't.json'}: only CSV (.csv, header row) and JSON Lines (.jsonl, one object per line) "
        "label tables are read, not a .json document\n")


@pytest.mark.parametrize(("table", "first", "hint"), [
    ("path;label\n{p};cat\n", "{p};cat", "the header 'path;label' is one column: is the table separated by ';'? "
                                         "A CSV table is read with ','"),
    ("path\tlabel\n{p}\tcat\n", "{p}\tcat", "the header 'path\\tlabel' is one column: is the table separated by "
                                           "tabs? A CSV table is read with ','"),
    ("path,label\n{w},cat\n", "{w}", "its paths hold '\\': write them with '/'"),
    ("path,label\nsrc/{p},cat\n", "src/{p}", "its paths start with src/, SRC's own name: give them relative to SRC"),
])
def test_when_no_listed_image_exists_the_message_says_where_it_looked_and_why(flat, tmp_path: Path, table, first,
                                                                               hint) -> None:
    """A ';'- or tab-separated file, Windows paths, paths that repeat SRC's name: the usual causes."""
    src, paths = flat
    spell = {"p": paths[0], "w": paths[0].replace("/", "\\")}
    (tmp_path / "t.csv").write_text(table.format(**spell))
    with pytest.raises(CompileError) as error:
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=tmp_path / "t.csv")
    assert str(error.value) == (f"none of the 1 images listed in {tmp_path / 't.csv'} exist under {src} (the first "
                                f"was looked up as {src / first.format(**spell)}); {hint}")


def test_an_absolute_path_inside_src_is_the_relative_one(flat, tmp_path: Path) -> None:
    """Accepted as the same source (so a duplicate in the other spelling is caught); outside SRC, refused."""
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "".join(f"{src / p},cat\n" for p in paths[:2]) + f"{paths[2]},dog\n")
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    ds = MemmapDataset(tmp_path / "out")
    assert sorted(ds.opened.source(i) for i in range(len(ds))) == paths[:3]
    table.write_text(f"path,label\n{src / paths[0]},cat\n{paths[0]},cat\n")
    with pytest.raises(CompileError, match=rf"t.csv, line 3: image '{paths[0]}' is listed twice \(first on line 2\)"):
        dsc.compile_folder(src, tmp_path / "out2", size=8, workers=1, labels=table)
    table.write_text(f"path,label\n{tmp_path / 'elsewhere' / paths[0]},cat\n")
    with pytest.raises(CompileError, match=r"t.csv, line 2: image path '/.*/elsewhere/.* leaves the source folder"):
        dsc.compile_folder(src, tmp_path / "out2", size=8, workers=1, labels=table)


def test_a_long_path_outside_src_is_shown_with_its_file_name_and_a_mark_where_it_is_cut(flat, tmp_path: Path) -> None:
    """Paths were cut at 80 characters with no mark (under a deep temporary folder the test above read
    '.../elsewhe leaves the source folder'): a cut path must say so, and keep its file name."""
    src, paths = flat
    deep = "/data/" + "/".join(f"level_{k:02d}" for k in range(40)) + "/photo_17.jpg"
    table = tmp_path / "t.csv"
    table.write_text(f"path,label\n{deep},cat\n")
    with pytest.raises(CompileError) as refused:
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    message = str(refused.value)
    assert re.search(r"image path '/data/level_00/\S*…\S*/photo_17\.jpg' leaves the source folder", message), message
    assert len(message) < len(deep) + 200


def test_the_path_and_label_columns_take_no_other_kind(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = write_csv(tmp_path / "t.csv", rows_for(paths))  # its path column is named 'filename'
    with pytest.raises(CompileError, match=r"^--column filename:int: 'filename' is the image path column of .*t.csv; "
                                           r"it takes no kind$"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, columns={"filename": "int"})
    with pytest.raises(CompileError, match=r"^--column label:float: 'label' is the class label column; its kind is "
                                           r"always class; name a numeric target otherwise \(e.g. 'target'\)$"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, columns={"label": "float"})


@pytest.mark.parametrize(("lines", "match"), [
    (['{"path": "A", "label": "cat"}', "{not json"], r"line 2: not valid JSON"),
    (['{"path": "A", "label": "cat"}', '{"path": "B"}'], r"line 2: keys differ from the first line's: 'label'"),
    (['["A", "cat"]'], r'line 1: each line must be a JSON object with a "path" key'),
    (['{"path": 5, "label": "cat"}'], r"line 1: the image path must be non-empty text"),
    (['{"path": "A", "tags": [1, "x"]}'], r"line 1, column 'tags': 'x' is not a number"),
    (['{"path": "A", "tags": ["x", 2]}'], r"line 1, column 'tags': 'x' is not a number"),
])
def test_a_malformed_jsonl_table_names_the_line(flat, tmp_path: Path, lines, match) -> None:
    src, paths = flat
    table = tmp_path / "bad.jsonl"
    table.write_text("\n".join(lines).replace('"A"', json.dumps(paths[0])).replace('"B"', json.dumps(paths[1])))
    with pytest.raises(CompileError, match=match):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)


def test_the_cli_compiles_a_table_and_info_lists_its_fields(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = write_csv(tmp_path / "labels.csv", rows_for(paths[:10]))
    out = tmp_path / "out"
    result = runner.invoke(app, ["compile", str(src), str(out), "--size", "8", "-j", "1", "--labels", str(table),
                                 "--column", "count:float"])
    assert result.exit_code == 0, result.output
    assert "note: 2 image(s) in" in result.stderr
    assert "field count: float, float32 scalar, values 0 to 9" in result.stderr
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0 and f"dsc format {fmt.FORMAT_VERSION}" in info.stdout
    assert "field tags: multilabel, uint8 [2], 2 classes: a (6), b (3)" in info.stdout
    assert "field target: float, float32 [2], values -9 to 2.25" in info.stdout
    as_json = json.loads(runner.invoke(app, ["info", str(out), "--json"]).stdout)
    assert [f["name"] for f in as_json["fields"]] == ["tags", "target", "count"]
    bad = runner.invoke(app, ["compile", str(src), str(tmp_path / "x"), "--labels", str(table), "--column", "count"])
    assert bad.exit_code == 2 and "expected NAME:KIND" in bad.output
    verify = runner.invoke(app, ["verify", str(out)])
    assert verify.exit_code == 0 and "3 field file(s)" in verify.stdout
    field_file = out / "fields" / "target.bin"
    field_file.write_bytes(b"\x00" * field_file.stat().st_size)
    verify = runner.invoke(app, ["verify", str(out)])
    assert verify.exit_code == 1 and "fields/target.bin: SHA-256 is" in verify.stderr


def test_show_captions_every_field(flat, tmp_path: Path) -> None:
    src, paths = flat
    rows = rows_for(paths[:3])
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, shuffle=False,
                       labels=write_csv(tmp_path / "labels.csv", rows))
    from dsc.storage import open_dataset
    assert caption_lines(open_dataset(tmp_path / "out"), 2) == ["#2 emu", "tags=a+b", "target=0.5,-2", "count=2"]
    result = runner.invoke(app, ["show", str(tmp_path / "out"), "-o", str(tmp_path / "s.png"), "--n", "3"])
    assert result.exit_code == 0 and "3 records" in result.stdout


def test_assert_roundtrip_catches_a_field_that_disagrees_with_the_table(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = write_csv(tmp_path / "labels.csv", rows_for(paths))
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    assert_roundtrip(src, tmp_path / "out")
    table.write_text(table.read_text().replace(f"{paths[3]},cat", f"{paths[3]},dog"))  # the table changed since
    with pytest.raises(AssertionError, match=rf"\({paths[3]}\): label 'cat', but the table says 'dog'"):
        assert_roundtrip(src, tmp_path / "out")


def test_a_resume_carries_the_fields_and_refuses_another_table(flat, tmp_path: Path) -> None:
    src, paths = flat
    rows = rows_for(paths)
    table = write_csv(tmp_path / "labels.csv", rows)
    dsc.compile_folder(src, tmp_path / "ref", size=8, workers=1, labels=table)

    def stop(n: int) -> None:
        raise KeyboardInterrupt  # after the first results are journalled

    with pytest.raises(KeyboardInterrupt):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, progress=stop)
    rows[0]["count"] = 99
    write_csv(tmp_path / "changed.csv", rows)
    with pytest.raises(CompileError, match=r"the label table.s values changed since it began, and a resume would "
                                           "mix old and new values; pass --force to start over$"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=tmp_path / "changed.csv", resume=True)
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, resume=True)
    for name in ("labels.bin", "fields/tags.bin", "fields/target.bin", "fields/count.bin", "shards/00000.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


# ----------------------------------------------------------------------------- tables as written (issue 26)

def test_integer_labels_are_stored_as_given(flat, tmp_path: Path) -> None:
    """0, 3, 70000, -1, 5 stay 0, 3, 70000, -1 (no label), 5: the classes are named 0..70000, none
    renumbered; --column label:class asks for a vocabulary of the names instead."""
    src, paths = flat
    given = [0, 3, 70000, -1, 5]
    table = tmp_path / "t.csv"
    table.write_text("path,label\n" + "".join(f"{p},{given[k % 5]}\n" for k, p in enumerate(paths)))
    summary = dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == [str(k) for k in range(70001)] and summary.empty_classes == []  # gaps are no classes
    by_path = {p: given[k % 5] for k, p in enumerate(paths)}
    assert [int(ds.labels[i]) for i in range(len(ds))] == [by_path[ds.opened.source(i)] for i in range(len(ds))]
    assert_roundtrip(src, tmp_path / "out")
    result = runner.invoke(app, ["verify", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    info = runner.invoke(app, ["info", str(tmp_path / "out")])  # the -1 records counted, not 70,001 names listed
    assert info.exit_code == 0 and len(info.stdout) < 2000, info.stdout[:2000]
    assert "70001 classes: 0 (3), 1 (0), 2 (0), 3 (3), 4 (0), 5 (2), 6 (0)" in info.stdout
    assert "19 (0), ... and 69981 more (dsc info --json lists them all); 2 record(s) without a label (-1)\n" \
        in info.stdout
    data = json.loads(runner.invoke(app, ["info", str(tmp_path / "out"), "--json"]).stdout)
    assert len(data["classes"]) == 70001 and data["unlabeled"] == 2 and sum(data["classes"].values()) == 10
    dsc.compile_folder(src, tmp_path / "named", size=8, workers=1, labels=table, columns={"label": "class"})
    assert MemmapDataset(tmp_path / "named").classes == ["-1", "0", "3", "5", "70000"]


def test_integer_labels_that_cannot_be_stored_as_given_are_refused(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    compile_ = ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1", "--labels", str(table)]
    for bad, why in [("-2", "is below -1"), (str(1 << 20), "is above 1048575"), (str(1 << 70), "is above 1048575")]:
        table.write_text("path,label\n" + "".join(f"{p},{[1, bad][k == 5]}\n" for k, p in enumerate(paths)))
        result = runner.invoke(app, compile_)
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.output
        assert result.stderr.startswith(f"error: {table}, line 7, column 'label': label {bad} {why}")
        assert "--column label:class" in result.stderr and not (tmp_path / "out").exists()
    table.write_text("path,label\n" + "".join(f"{p},{k % 2}\n" for k, p in enumerate(paths)))
    with pytest.raises(CompileError, match=r"column 'label' holds integers, stored as given, but the given classes "
                                           r"are not named 0 to 1 \(they start cat, dog\); give --column label:class"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table, classes=["cat", "dog"])


def test_an_integer_validation_table_keeps_the_training_labels(flat, tmp_path: Path) -> None:
    src, paths = flat
    train, val = tmp_path / "train.csv", tmp_path / "val.csv"
    train.write_text("path,label\n" + "".join(f"{p},{k % 4}\n" for k, p in enumerate(paths[:8])))
    val.write_text("path,label\n" + "".join(f"{p},{[2, -1][k % 2]}\n" for k, p in enumerate(paths[8:])))
    dsc.compile_folder(src, tmp_path / "out" / "train", size=8, workers=1, labels=train)
    dsc.compile_folder(src, tmp_path / "out" / "val", size=8, workers=1, labels=val,
                       classes=tmp_path / "out" / "train")
    v = MemmapDataset(tmp_path / "out" / "val")
    assert v.classes == ["0", "1", "2", "3"] and sorted(v.labels.tolist()) == [-1, -1, 2, 2]


@pytest.mark.parametrize(("first", "cell"), [("{p},cat", "{p}"), ("img_07,3", "3"),
                                             ("photos/x.jpg,cat", "photos/x.jpg")])
def test_a_table_without_a_header_row_is_refused(flat, tmp_path: Path, first, cell) -> None:
    """Read with its first row as the header, it would lose that image and label the rest -1."""
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text(first.format(p=paths[0]) + "\n" + "".join(f"{p},dog\n" for p in paths[1:]))
    result = runner.invoke(app, ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1",
                                 "--labels", str(table)])
    what = "a number" if cell == "3" else "an image path"
    assert result.exit_code == 1 and result.stderr == (
        f"error: {table}, line 1: the header cell {cell.format(p=paths[0])!r} is {what}, so the table seems to have "
        "no header row; add one as its first line (e.g. 'path,label': the image path column, then names)\n")


def test_a_table_without_a_label_column_is_compiled_only_when_said_unlabeled(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,weight\n" + "".join(f"{p},{k}.5\n" for k, p in enumerate(paths)))
    compile_ = ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1", "--labels", str(table)]
    result = runner.invoke(app, compile_)
    assert result.exit_code == 1 and result.stderr == (
        f"error: {table}: no 'label' column (its columns: 'path', 'weight'), so every record would be unlabeled; "
        "name the class column 'label', or give --column label:none to compile the images unlabeled\n")
    assert not (tmp_path / "out").exists()
    result = runner.invoke(app, [*compile_, "--column", "label:none"])
    assert result.exit_code == 0, result.output
    ds = MemmapDataset(tmp_path / "out")
    assert ds.classes == [] and set(ds.labels.tolist()) == {-1} and ds.fields["weight"].dtype == np.float32
    table.write_text("path,label\n" + "".join(f"{p},cat\n" for p in paths))
    result = runner.invoke(app, [*compile_, "--force", "--column", "label:none"])
    assert result.exit_code == 1 and "--column label:none: " in result.stderr and "has a 'label' column" in \
        result.stderr
    result = runner.invoke(app, [*compile_, "--force", "--column", "weight:none"])
    assert result.exit_code == 2 and "expected NAME:KIND" in result.output


def test_class_names_that_join_several_classes_are_warned_about(flat, tmp_path: Path, caplog) -> None:
    src, paths = flat
    table = tmp_path / "t.csv"
    table.write_text("path,label,species,kind\n" + "".join(
        f'{p},{["cat|dog", "cat"][k % 4 == 0]},"{["owl,emu", "owl"][k % 4 == 0]}",{["a|b", "a"][k % 2]}\n'
        for k, p in enumerate(paths)))
    with caplog.at_level(logging.WARNING, logger="dsc"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)
    assert [r.getMessage() for r in caplog.records] == [
        f"{table}: 9 of 12 values of column 'label' hold '|' (e.g. 'cat|dog' on line 3) and each is read as one "
        "class name; the 'label' column holds one class per record: for several, name the column otherwise (e.g. "
        "'tags'), separate its classes with ';' and give --column tags:multilabel",
        f"{table}: 9 of 12 values of column 'species' hold ',' (e.g. 'owl,emu' on line 3) and each is read as one "
        "class name; if they list several classes, separate them with ';' (the multilabel separator) and give "
        "--column species:multilabel"]  # 'kind': half its values only, no warning
    assert MemmapDataset(tmp_path / "out").classes == ["cat", "cat|dog"]  # as written: a warning, no guess


def test_a_jsonl_row_that_gives_a_key_twice_is_refused(flat, tmp_path: Path) -> None:
    src, paths = flat
    table = tmp_path / "t.jsonl"
    table.write_text(f'{{"path": "{paths[0]}", "label": "cat"}}\n'
                     f'{{"path": "{paths[1]}", "label": "cat", "path": "{paths[2]}"}}\n')
    result = runner.invoke(app, ["compile", str(src), str(tmp_path / "out"), "--size", "8", "-j", "1",
                                 "--labels", str(table)])
    assert result.exit_code == 1 and result.stderr == (
        f"error: {table}, line 2: key 'path' is given twice in one object; keep one\n")
    table.write_text(f'{{"path": "{paths[0]}", "label": "cat", "box": {{"x": 1, "x": 2}}}}\n')
    with pytest.raises(CompileError, match=r"t.jsonl, line 1: key 'x' is given twice"):
        dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, labels=table)


def species_table(path: Path, paths: list[str], species: list[str], tags: list[str], label: bool = True) -> Path:
    path.write_text(("path,label,species,tags\n" if label else "path,species,tags\n") + "".join(
        f"{p},{'a,' if label else ''}{species[k % len(species)]},{tags[k % len(tags)]}\n"
        for k, p in enumerate(paths)))
    return path


def test_class_fields_of_splits_compiled_apart_are_flagged(flat, tmp_path: Path, caplog) -> None:
    """species a,b,c in train and b,c in val: 'b' would be 1 in one and 0 in the other."""
    src, paths = flat
    train = species_table(tmp_path / "train.csv", paths[:6], ["a", "b", "c"], ["x;y", "z"])
    val = species_table(tmp_path / "val.csv", paths[6:], ["b", "c"], ["y;z", "z"])
    dsc.compile_folder(src, tmp_path / "out" / "train", size=8, workers=1, labels=train)
    with caplog.at_level(logging.WARNING, logger="dsc"):
        dsc.compile_folder(src, tmp_path / "out" / "val", size=8, workers=1, labels=val)
        assert [r.getMessage() for r in caplog.records] == [
            f"the classes of field 'species' of val differ from those of the dataset beside it, {tmp_path}/out/train "
            f"(val lacks a): 'b' is index 0 here and 1 in {tmp_path}/out/train (and 1 more); to use train's, "
            f"compile with --classes-from {tmp_path}/out/train",
            f"the classes of field 'tags' of val differ from those of the dataset beside it, {tmp_path}/out/train "
            f"(val lacks x): 'y' is position 0 here and 1 in {tmp_path}/out/train (and 1 more); to use train's, "
            f"compile with --classes-from {tmp_path}/out/train"]
        caplog.clear()
        dsc.compile_folder(src, tmp_path / "out" / "val2", size=8, workers=1, labels=val,
                           classes=tmp_path / "out" / "train")
        assert caplog.records == []
    v = MemmapDataset(tmp_path / "out" / "val2")
    assert v.field_classes("species") == ["a", "b", "c"] and v.field_classes("tags") == ["x", "y", "z"]


def test_classes_from_an_unlabeled_dataset_fixes_its_class_fields(flat, tmp_path: Path) -> None:
    src, paths = flat
    train = species_table(tmp_path / "train.csv", paths[:6], ["a", "b", "c"], ["x;y", "z"], label=False)
    val = species_table(tmp_path / "val.csv", paths[6:], ["b", "c"], ["y;z", "z"], label=False)
    dsc.compile_folder(src, tmp_path / "train", size=8, workers=1, labels=train, columns={"label": "none"})
    dsc.compile_folder(src, tmp_path / "val", size=8, workers=1, labels=val, columns={"label": "none"},
                       classes=tmp_path / "train")
    v = MemmapDataset(tmp_path / "val")
    assert v.classes == [] and v.field_classes("species") == ["a", "b", "c"] and v.field_classes("tags") == [
        "x", "y", "z"]
    with pytest.raises(CompileError, match="that dataset is unlabeled"):  # a folder's classes: none to take
        dsc.compile_folder(src, tmp_path / "folder", size=8, workers=1, classes=tmp_path / "train")


# ----------------------------------------------------------------------------- reading fields

@pytest.fixture
def with_fields(flat, tmp_path: Path) -> Path:
    src, paths = flat
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, records_per_shard=5,
                       labels=write_csv(tmp_path / "labels.csv", rows_for(paths)))
    return tmp_path / "out"


def test_loader_batches_carry_every_field_in_its_dtype(with_fields: Path) -> None:
    ds = MemmapDataset(with_fields)
    seen = []
    for batch in ds.loader(5, order="random", seed=1):
        idx = batch["index"].numpy()
        assert batch["tags"].dtype == torch.uint8 and batch["target"].dtype == torch.float32
        assert batch["count"].dtype == torch.int64 and batch["target"].shape == (len(idx), 2)
        for name, values in ds.fields.items():
            assert np.array_equal(batch[name].numpy(), values[idx]), name
        assert np.array_equal(batch["label"].numpy(), ds.labels[idx])
        seen += idx.tolist()
    assert sorted(seen) == list(range(len(ds)))


def test_the_packed_upload_slot_gives_back_every_field(with_fields: Path) -> None:
    """What the CUDA ring does with the small fields (one byte slot, aligned views), on CPU tensors."""
    from dsc.reader.producer import batch_fields

    ds = MemmapDataset(with_fields)
    idx = np.array([7, 2, 9])
    fields = batch_fields(ds.opened, idx)
    slot = torch.zeros(packed_bytes(field_specs(ds.opened), 4), dtype=torch.uint8)
    layout = pack_fields(fields, slot.numpy())
    views = unpack_fields(slot.clone(), layout)
    assert list(views) == list(fields)
    for name, value in fields.items():
        assert views[name].dtype == torch.from_numpy(value).dtype and np.array_equal(views[name].numpy(), value)


def test_the_dataloader_drop_in_takes_a_target_transforms_and_the_index(with_fields: Path) -> None:
    ds = MemmapDataset(with_fields, target="target", return_index=True)
    image, target, index = ds[3]
    assert image.shape == (3, 8, 8) and torch.equal(target, torch.from_numpy(ds.fields["target"][3].copy()))
    assert index == 3
    images_, targets, indices = next(iter(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=False)))
    assert targets.dtype == torch.float32 and torch.equal(targets, torch.from_numpy(ds.fields["target"][:4].copy()))
    assert indices.tolist() == [0, 1, 2, 3]
    scaled = MemmapDataset(with_fields, target="count", transform=lambda x: x.float() / 255,
                           target_transform=lambda t: t * 10)
    images_, targets = next(iter(torch.utils.data.DataLoader(scaled, batch_size=4, num_workers=1)))
    assert images_.dtype == torch.float32 and images_.max() <= 1
    assert targets.tolist() == [10 * int(c) for c in scaled.fields["count"][:4]]
    with pytest.raises(ValueError, match="no such field"):
        MemmapDataset(with_fields, target="nope")


def test_as_tensordict_maps_the_fields(with_fields: Path) -> None:
    ds = MemmapDataset(with_fields)
    td = ds.as_tensordict()
    assert torch.equal(td["fields", "tags"], torch.from_numpy(ds.fields["tags"].copy()))
    assert torch.equal(td["shards", "1", "target"], torch.from_numpy(ds.fields["target"][5:10].copy()))


def test_the_readme_labels_section_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    """Its commands (with a val folder lacking a class), its CSV and its Python, in a fresh folder."""
    root = Path(__file__).parent.parent
    readme = (root / "README.md").read_text()
    section = readme[readme.index("## Labels and splits"):readme.index("## Read\n")]
    commands = [line[2:].split() for line in section.splitlines() if line.startswith("$ dsc ")]
    csv = section[section.index("```csv\n") + 7:section.index("```", section.index("```csv\n") + 7)]
    python = section[section.index("```python\n") + 10:section.index("```", section.index("```python\n") + 10)]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(root / "examples")
    for name in ("cat", "people", "space"):  # lacks coffee and texture
        shutil.copytree(root / "examples" / "images" / name, tmp_path / "val_images" / name)
    (tmp_path / "labels.csv").write_text(csv)
    assert len(commands) == 3
    for command in commands:
        result = runner.invoke(app, command[1:])
        assert result.exit_code == 0, (command, result.output)
    assert "note: 16 image(s) in examples/images are not listed in labels.csv" in result.stderr
    namespace: dict = {}
    exec(compile(python, "README.md", "exec"), namespace)
    val, train = namespace["val"], MemmapDataset("out/train")
    assert val.classes == train.classes and namespace["label"] == train.classes.index(folder_of(val, 0))
    assert namespace["tag_names"] == ["animal", "drink", "indoor"]
    assert namespace["weight"].dtype == torch.float32 and namespace["tags"].shape == (4, 3)
    assert_roundtrip(tmp_path / "examples" / "images", "out/tagged")
