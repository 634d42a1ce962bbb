"""`dsc info`, `verify`, `show` and `bench` on a real compiled dataset."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from dsc import compile_folder, storage
from dsc import format as fmt
from dsc.cli import app
from dsc.storage import local
from dsc.tools.bench import BenchReport, Rate, diagnose, evict, resident_fraction
from dsc.tools.sheet import CAPTION_HEIGHT, pick_records

from conftest import listed_shards_doc, make_folder, rewrite_manifest

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Path]:
    """(sources, dataset): 3 classes x 5 images plus one bad file, 24x32 records, shards of 4."""
    root = tmp_path_factory.mktemp("tools")
    src = make_folder(root / "src", classes=3, per_class=5)
    (src / "class_1" / "broken.jpg").write_bytes(b"\xff\xd8 nope")
    compile_folder(src, root / "out", size=(24, 32), records_per_shard=4, workers=1, on_skip=lambda s, r: None)
    return src, root / "out"


@pytest.fixture
def copy(compiled, tmp_path: Path) -> Path:
    """A private copy of the dataset, free to damage."""
    return Path(shutil.copytree(compiled[1], tmp_path / "copy"))


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_info_text_and_json(compiled) -> None:
    text = invoke("info", compiled[1])
    assert text.exit_code == 0, text.stderr
    assert "15 records of 24x32x3 uint8, 4 shard(s) of up to 4" in text.stdout
    assert "3 classes: class_0 (5), class_1 (5), class_2 (5)" in text.stdout
    assert "class_1/broken.jpg: not a recognised image file" in text.stdout
    data = json.loads(invoke("info", compiled[1], "--json").stdout)
    assert data["records"] == 15 and sum(data["classes"].values()) == 15 and data["shards"] == 4
    assert data["record_shape"] == [24, 32, 3] and len(data["skipped"]) == 1
    assert data["bytes_on_disk"] == sum(p.stat().st_size for p in compiled[1].rglob("*") if p.is_file())


def test_info_on_a_folder_that_is_not_a_dataset(tmp_path: Path) -> None:
    result = invoke("info", tmp_path)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path}: no manifest.json; not a dsc dataset, "
                                                  "or its compile never finished"]


def test_verify_passes_and_re_decodes_identically(compiled) -> None:
    result = invoke("verify", compiled[1], "--decode", "6")
    assert result.exit_code == 0, result.stderr
    assert "ok: manifest, 4 shard(s) and index files match" in result.stdout
    size = invoke("info", compiled[1]).stdout.splitlines()[0].split(", ")[-1].removesuffix(" on disk")
    assert f"match ({size});" in result.stdout  # the dataset's size, as info gives it
    assert "decoded 6 record(s) again: worst difference record" in result.stdout
    assert ": max 0, mean 0.000" in result.stdout


def test_verify_names_a_corrupted_shard(copy: Path) -> None:
    with open(copy / fmt.shard_file(2), "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02\x03")
    result = invoke("verify", copy)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {copy / fmt.shard_file(2)}: SHA-256 is ")
    assert "00000.bin" not in result.stderr


def test_verify_decode_catches_an_altered_record(copy: Path, compiled) -> None:
    records = np.memmap(copy / fmt.shard_file(0), np.uint8, "r+")
    records[:] = 255 - records  # every record of shard 0 inverted
    records.flush()
    result = invoke("verify", copy, "--decode", "15", "--seed", "1")  # checksums fail first...
    assert result.exit_code == 1 and "00000.bin: SHA-256" in result.stderr
    manifest = listed_shards_doc(copy)  # ...so make them agree with the damage
    manifest["shards"][0]["sha256"] = local.sha256_file(copy / fmt.shard_file(0))
    crcs = [c for s in manifest["shards"]  # and the records' CRC-32s (format 1.3)
            for c in fmt.record_checksums((copy / s["file"]).read_bytes(), manifest["record"]["bytes"])]
    (copy / fmt.CHECKSUMS_FILE).write_bytes(fmt.checksums_payload(np.array(crcs))[1])
    manifest["checksums"]["sha256"] = local.sha256_file(copy / fmt.CHECKSUMS_FILE)
    rewrite_manifest(copy, manifest)
    result = invoke("verify", copy, "--decode", "15")
    assert result.exit_code == 1 and "differs from its source" in result.stderr


def test_verify_decode_without_sources(copy: Path, tmp_path: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["compile"]["source_root"] = str(tmp_path / "gone")
    rewrite_manifest(copy, manifest)
    result = invoke("verify", copy, "--decode", "2")
    assert result.exit_code == 1
    assert "not checked:" in result.stderr and "none of the 2 records could be checked" in result.stderr


def test_show_writes_a_contact_sheet(compiled, tmp_path: Path) -> None:
    result = invoke("show", compiled[1], "-o", tmp_path / "sheet.png", "--n", "7", "--columns", "3")
    assert result.exit_code == 0, result.stderr
    with Image.open(tmp_path / "sheet.png") as sheet:
        assert sheet.size == (3 * 32, 3 * (24 + CAPTION_HEIGHT)) and sheet.mode == "RGB"
    indices = invoke("show", compiled[1], "-o", tmp_path / "some.png", "--indices", "0,14")
    assert indices.exit_code == 0 and "2 records" in indices.stdout
    with Image.open(tmp_path / "some.png") as sheet:
        first = np.asarray(sheet)[:24, :32]
    assert np.array_equal(first, storage.open_dataset(compiled[1]).shards[0][0])


def test_show_picks_one_class_and_reports_bad_choices(compiled, tmp_path: Path) -> None:
    d = storage.open_dataset(compiled[1])
    picked = pick_records(d, 10, class_name="class_2", seed=3)
    assert len(picked) == 5 and set(d.labels[picked].tolist()) == {2}
    assert pick_records(d, 4, seed=3) == pick_records(d, 4, seed=3) != pick_records(d, 4, seed=4)
    wrong = invoke("show", compiled[1], "-o", tmp_path / "x.png", "--class", "dogs")
    assert wrong.exit_code == 1 and "no class 'dogs'; the classes are class_0, class_1, class_2" in wrong.stderr
    outside = invoke("show", compiled[1], "-o", tmp_path / "x.png", "--indices", "3,99")
    assert outside.exit_code == 1 and "record index 99 is out of range" in outside.stderr
    garbled = invoke("show", compiled[1], "-o", tmp_path / "x.png", "--indices", "a,b")
    assert garbled.exit_code == 2 and not (tmp_path / "x.png").exists()
    both = invoke("show", compiled[1], "-o", tmp_path / "x.png", "--class", "class_1", "--indices", "0")
    assert both.exit_code == 2 and "give --class or --indices, not both" in both.stderr  # was: --class ignored
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(("output", "message"), [
    ("nodir/s.png", "cannot write {tmp}/nodir/s.png: the folder {tmp}/nodir does not exist"),
    (".", "{tmp} is a folder; give an image file to write, e.g. {tmp}/sheet.png"),
    ("sheet", "cannot write {tmp}/sheet: its name does not say an image format; end it in .png or .jpg"),
])
def test_show_names_what_is_wrong_with_its_output(compiled, tmp_path: Path, output: str, message: str) -> None:
    result = invoke("show", compiled[1], "-o", f"{tmp_path}/{output}".rstrip("/."))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == f"error: {message.format(tmp=tmp_path)}\n"


def test_a_dataset_missing_because_its_compile_was_interrupted_says_how_to_finish_it(compiled, tmp_path: Path) -> None:
    from dsc.compiler.publish import staging_path

    out = tmp_path / "out"
    staging_path(out).mkdir()
    for command in (["info"], ["verify"], ["show", "-o", tmp_path / "s.png"]):
        result = invoke(command[0], out, *command[1:])
        assert result.exit_code == 1 and result.stderr.splitlines() == [
            f"error: {out}: does not exist (expected a compiled dsc dataset)",
            f"error: an interrupted compile left its work in {staging_path(out)}: run that compile again with "
            "--resume to finish it"]


def test_bench_prints_rows_ratios_and_a_diagnosis(compiled) -> None:
    result = invoke("bench", compiled[1], "--seconds", "0.2", "--batch-size", "4")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[1].startswith("limit: contiguous copy") and lines[1].endswith("1.00")
    for order in ("sequential", "block", "random"):
        assert any(line.startswith(f"dsc loader, {order}") for line in lines)
    assert any(line.startswith("cold: dsc loader") for line in lines) or "cold: not measured" in result.stdout
    notes = ("copy bandwidth", "loader overhead", "above the copy limit")
    assert sum(f"- {note}:" in result.stdout for note in notes) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_refuses_a_missing_cuda_device(compiled) -> None:
    result = invoke("bench", compiled[1], "--device", "cuda")
    assert result.exit_code == 2 and "no CUDA device is available here" in result.stderr


def test_eviction_empties_the_page_cache_of_a_file(compiled) -> None:
    shards = storage.open_dataset(compiled[1]).shard_paths()
    for path in shards:
        path.read_bytes()
    before = resident_fraction(shards)
    after = evict(shards)
    if before is None:
        pytest.skip("mincore is not available here")
    assert before == 1.0 and after is not None and after < before


def test_diagnosis_names_the_bottleneck() -> None:
    limit = Rate("limit", 1000, 1.0, 150_000)
    warm = [Rate("dsc loader, block", 900, 1.0, 150_000)]
    assert diagnose(BenchReport(10**9, 24 * 10**9, limit, warm))[0].startswith("copy bandwidth: warm, the fastest "
                                                                              "order (block) runs at 90%")
    notes = diagnose(BenchReport(200 * 10**9, 24 * 10**9, limit, warm,
                                 cold=[Rate("cold: dsc loader, block", 100, 1.0, 150_000)],
                                 device=[Rate("dsc loader, block, to cuda", 300, 1.0, 150_000)]))
    assert [n.split(":")[0] for n in notes] == ["page cache too small", "disk", "copy bandwidth", "host→device"]
    slow = diagnose(BenchReport(10**9, 24 * 10**9, limit, [Rate("dsc loader, random", 300, 1.0, 150_000)]))
    assert slow[0].startswith("loader overhead: warm, the fastest order reaches only 30%")
    cached = diagnose(BenchReport(10**8, 24 * 10**9, limit, [Rate("dsc loader, block", 1560, 1.0, 150_000)]))
    assert cached[0].startswith("above the copy limit: the fastest order (block) runs at 156% of the plain copy "
                                "limit, which can only be a cache effect")


def test_device_rows_are_measured_against_the_host_to_device_limit() -> None:
    """The h2d limit is a limit, never "the upload path"; device rows divide by it, not by the host copy limit."""
    limit, warm = Rate("limit", 1000, 1.0, 150_000), [Rate("dsc loader, block", 900, 1.0, 150_000)]
    h2d = Rate("limit: pinned host → cuda:1 copy", 400, 1.0, 150_000)
    bound = BenchReport(10**9, 24 * 10**9, limit, warm, h2d=h2d,
                        device=[Rate("dsc loader, block, to cuda:1", 380, 1.0, 150_000)])
    assert [round(ratio, 2) for _, ratio in bound.rows()] == [1.0, 0.9, 1.0, 0.95]
    note = diagnose(bound)[-1]
    assert note.startswith("host→device: dsc loader, block, to cuda:1 reaches") and "copy bounds it" in note
    assert "pinned host" not in note
    slow = BenchReport(10**9, 24 * 10**9, limit, warm, h2d=h2d,
                       device=[Rate("dsc loader, block, to cuda:1", 100, 1.0, 150_000)])
    assert "the upload path itself" in diagnose(slow)[-1]


TRAIN_LINES = (r"step +(\d+)  epoch +\d+  loss (\d+\.\d{3})  [\d,]+ samples/s on (cpu|cuda:?\d*)",
               r"data: (\d+) batches, waited \d+\.\d\d s of \d+\.\d\d s \(\d+\.\d%\); "
               r"per batch: gather \d+\.\d\d ms, upload \d+\.\d\d ms")


def test_the_training_example_trains_and_prints_what_the_readme_shows(tmp_path: Path) -> None:
    example = Path(__file__).parent.parent / "examples" / "train.py"
    run = subprocess.run([sys.executable, str(example), "--steps", "10", "--batch-size", "4",
                          "--data", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "out" / "manifest.json").exists()
    *_, last, data = run.stdout.strip().splitlines()
    step = re.fullmatch(TRAIN_LINES[0], last)
    assert step and step[1] == "10" and 0 < float(step[2]) < 10
    assert re.fullmatch(TRAIN_LINES[1], data)[1] == "10"  # the wait meter, printed
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    command = "(`python examples/train.py --steps 40`; CUDA when available):\n\n```console\n"
    shown = readme[readme.index(command) + len(command):].split("```")[0].splitlines()
    assert [int(re.fullmatch(TRAIN_LINES[0], line)[1]) for line in shown[:-1]] == [10, 20, 30, 40]
    assert re.fullmatch(TRAIN_LINES[1], shown[-1])[1] == "40"
