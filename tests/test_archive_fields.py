"""An archive's other columns and members as fields (issue 24, `--column`): a Parquet column, a tar
member's text or a field of its .json member becomes a typed per-record field, parsed and checked as
a label table's columns are, each value landing on its own sample's record (matched by source)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from dsc import CompileError, compile_folder
from dsc.cli import app
from dsc.reader import MemmapDataset

from archives import write_tar_shards, write_zip

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "images"
CLASSES = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


def quiet(**options):
    return {"size": 16, "workers": 2, "on_skip": lambda source, reason: None, **options}


def by_member(out: Path) -> tuple[MemmapDataset, dict[str, int]]:
    """The dataset, and each record's index by the member part of its source (ARCHIVE#MEMBER)."""
    ds = MemmapDataset(out)
    return ds, {ds.opened.source(i).rsplit("#", 1)[1]: i for i in range(len(ds))}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, list[tuple[str, Path]]]:
    root = tmp_path_factory.mktemp("fields")
    shutil.copytree(EXAMPLES, root / "images")
    return root / "images", [(c, f) for c in CLASSES for f in sorted((root / "images" / c).iterdir())]


def write_plain_parquet(path: Path, files: list[tuple[str, Path]], **columns) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"jpeg": pa.array([f.read_bytes() for _, f in files], pa.binary()),
                      "path": [f.name for _, f in files], "species": [c for c, _ in files], **columns})
    pq.write_table(table, path, row_group_size=7)
    return path


def test_parquet_columns_become_fields_record_by_record(photos, tmp_path: Path) -> None:
    _, files = photos
    views = [(k * 7919) % 1000 - 300 for k in range(len(files))]  # negative ones too
    score = [round(0.25 + k / 8, 3) for k in range(len(files))]
    pose = [("up", "down", "side")[k % 3] for k in range(len(files))]
    write_plain_parquet(tmp_path / "t.parquet", files, views=views, score=score, pose=pose)
    compile_folder(tmp_path / "t.parquet", tmp_path / "out", **quiet(
        image_column="jpeg", label_key="species", columns={"views": "int", "score": "float", "pose": "class"}))
    ds, index = by_member(tmp_path / "out")
    assert {f.name: (f.kind, f.shape) for f in ds.manifest.fields} == {
        "views": ("int", ()), "score": ("float", ()), "pose": ("class", ())}
    assert ds.field_classes("pose") == ["down", "side", "up"]
    assert len(index) == len(files)
    for row in range(len(files)):  # the row's own values, wherever its record landed
        i = index[f"row={row}"]
        assert ds.classes[ds.labels[i]] == files[row][0]
        assert int(ds.fields["views"][i]) == views[row] and ds.fields["views"].dtype == np.int64
        assert ds.fields["score"][i] == np.float32(score[row]) and ds.fields["score"].dtype == np.float32
        assert ds.field_classes("pose")[ds.fields["pose"][i]] == pose[row]


def test_tar_members_and_json_fields_become_fields(photos, tmp_path: Path) -> None:
    folder, files = photos
    rank = {f.name: k for k, (_, f) in enumerate(files)}
    pattern = write_tar_shards(folder, tmp_path / "shards", per_shard=5, extra=lambda c, f: {
        "txt": f"{rank[f.name] * 3}", "json": json.dumps({"weight": rank[f.name] / 4, "tags": [c, "photo"]})})
    result = runner.invoke(app, ["compile", pattern, str(tmp_path / "out"), "--size", "16", "--column", "txt:int",
                                 "--column", "json:weight:float", "--column", "json:tags:multilabel"])
    assert result.exit_code == 0, result.stderr
    ds, index = by_member(tmp_path / "out")
    assert ds.field_classes("tags") == sorted([*CLASSES, "photo"])
    assert len(index) == len(files)
    for c, f in files:
        i = index[f"{c}/{f.name}"]  # the key c/stem, the image member c/stem.jpg
        assert int(ds.fields["txt"][i]) == rank[f.name] * 3
        assert ds.fields["weight"][i] == np.float32(rank[f.name] / 4)
        tags = [ds.field_classes("tags")[k] for k in np.flatnonzero(ds.fields["tags"][i])]
        assert sorted(tags) == sorted([c, "photo"])


def test_a_missing_or_bad_value_is_refused_naming_the_sample(photos, tmp_path: Path) -> None:
    folder, files = photos
    missing = files[3][1].name
    pattern = write_tar_shards(folder, tmp_path / "shards", per_shard=5, extra=lambda c, f: {
        **({} if f.name == missing else {"txt": "4"}), "json": json.dumps({"weight": "heavy" if f.name == missing
                                                                           else 1.5})})
    with pytest.raises(CompileError, match=rf"sample train-\d+\.tar#{files[3][0]}/{missing}, column 'txt': no value"):
        compile_folder(pattern, tmp_path / "a", **quiet(columns={"txt": "int"}))
    with pytest.raises(CompileError, match=rf"#{files[3][0]}/{missing}, column 'weight': 'heavy' is not a finite"):
        compile_folder(pattern, tmp_path / "b", **quiet(columns={"json:weight": "float"}))
    write_plain_parquet(tmp_path / "t.parquet", files, views=[None if k == 2 else k for k in range(len(files))])
    with pytest.raises(CompileError, match=r"t\.parquet, sample t\.parquet#row=2, column 'views': no value"):
        compile_folder(tmp_path / "t.parquet", tmp_path / "c", **quiet(image_column="jpeg", columns={"views": "int"}))
    assert not any((tmp_path / name).exists() for name in "abc")


@pytest.mark.parametrize(("column", "says"), [
    ("nope:int", "--column nope: .*has no column 'nope' other than its image and label"),
    ("species:class", "--column species: .*has no column 'species' other than its image and label"),
    ("views:floot", "--column 'views:floot': expected NAME:KIND with KIND one of"),
    ("label:int", "--column label: 'label' is the label"),
])
def test_bad_columns_are_one_clear_line(photos, tmp_path: Path, column: str, says: str) -> None:
    _, files = photos
    write_plain_parquet(tmp_path / "t.parquet", files, views=list(range(len(files))))
    result = runner.invoke(app, ["compile", str(tmp_path / "t.parquet"), str(tmp_path / "out"), "--image-column",
                                 "jpeg", "--label-key", "species", "--column", column])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert re.search(says, " ".join(result.stderr.split())), result.stderr
    assert not (tmp_path / "out").exists()


def test_a_zip_takes_no_columns(photos, tmp_path: Path) -> None:
    folder, _ = photos
    write_zip(folder, tmp_path / "images.zip")
    with pytest.raises(CompileError, match="--column is for tar and Parquet sources"):
        compile_folder(tmp_path / "images.zip", tmp_path / "out", **quiet(columns={"txt": "int"}))


def test_classes_from_a_split_fixes_the_vocabulary_of_a_class_column(photos, tmp_path: Path) -> None:
    """The val split lacks pose "down": with --classes-from train, "up" keeps train's index."""
    _, files = photos
    write_plain_parquet(tmp_path / "train.parquet", files, pose=[("up", "down")[k % 2] for k in range(len(files))])
    write_plain_parquet(tmp_path / "val.parquet", files[:4], pose=["up"] * 4)
    options = {"image_column": "jpeg", "label_key": "species", "columns": {"pose": "class"}}
    compile_folder(tmp_path / "train.parquet", tmp_path / "train", **quiet(**options))
    compile_folder(tmp_path / "val.parquet", tmp_path / "val", **quiet(classes=str(tmp_path / "train"), **options))
    train, val = MemmapDataset(tmp_path / "train"), MemmapDataset(tmp_path / "val")
    assert train.field_classes("pose") == val.field_classes("pose") == ["down", "up"]
    assert val.fields["pose"].tolist() == [1, 1, 1, 1]


def test_a_field_member_that_is_not_text_skips_its_sample_with_the_reason(photos, tmp_path: Path) -> None:
    folder, files = photos
    bad = files[5][1]
    pattern = write_tar_shards(folder, tmp_path / "shards", per_shard=5, extra=lambda c, f: {
        "txt": b"\xff\xfe7" if f == bad else b"7"})
    skipped = []
    summary = compile_folder(pattern, tmp_path / "out", **quiet(columns={"txt": "int"},
                                                                on_skip=lambda s, r: skipped.append((s, r))))
    assert summary.kept == len(files) - 1
    assert len(skipped) == 1 and skipped[0][0].endswith(f"#{files[5][0]}/{bad.name}")
    assert "unreadable member" in skipped[0][1] and "--column txt" in skipped[0][1]
    ds, index = by_member(tmp_path / "out")
    assert sorted(ds.fields["txt"].tolist()) == [7] * (len(files) - 1)
