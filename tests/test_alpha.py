"""--alpha black|white|drop: what becomes of transparent pixels, recorded in the manifest, shown by
`dsc info`, honoured by dsc.testing's reference and by `verify --decode`, never mixed by a resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from dsc import CompileError, compile_folder
from dsc import format as fmt
from dsc.cli import app
from dsc.compiler.publish import staging_path
from dsc.storage import open_dataset
from dsc.testing import assert_roundtrip, make_image_folder

H, W = 4, 8
runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})


def rgba_source() -> np.ndarray:
    """Every alpha from opaque to transparent along the rows, colours that differ per pixel."""
    rgb = np.random.default_rng(3).integers(0, 256, (H, W, 3), dtype=np.uint8)
    alpha = np.linspace(255, 0, H * W).round().astype(np.uint8).reshape(H, W, 1)
    return np.dstack([rgb, alpha])


def expected(rgba: np.ndarray, alpha: str) -> np.ndarray:
    rgb, a = rgba[..., :3].astype(float), rgba[..., 3:].astype(float)
    if alpha == "drop":
        return rgba[..., :3]
    background = 0.0 if alpha == "black" else 255.0 * (255 - a) / 255
    return np.rint(rgb * a / 255 + background).astype(np.uint8)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = tmp_path / "src"
    (root / "rgba").mkdir(parents=True)
    Image.fromarray(rgba_source(), "RGBA").save(root / "rgba" / "one.png")
    palette = Image.fromarray(rgba_source()[..., :3]).quantize(8)  # a palette PNG with its first colour keyed out
    palette.save(root / "rgba" / "two.png", transparency=0)
    return root


@pytest.mark.parametrize("alpha", ["black", "white", "drop"])
def test_each_choice_gives_its_pixels_and_is_recorded(src: Path, tmp_path: Path, alpha: str) -> None:
    out = tmp_path / alpha
    compile_folder(src, out, size=(H, W), fit="stretch", alpha=alpha, workers=1, shuffle=False)
    ds = open_dataset(out)
    records = {ds.source(i): np.asarray(ds.shards[0][i]) for i in range(ds.manifest.count)}
    np.testing.assert_array_equal(records["rgba/one.png"], expected(rgba_source(), alpha))
    keyed = Image.open(src / "rgba" / "two.png")
    index = np.asarray(keyed)
    palette_rgb = np.asarray(keyed.convert("RGB"))
    key = np.dstack([palette_rgb, np.where(index == 0, 0, 255).astype(np.uint8)])
    np.testing.assert_array_equal(records["rgba/two.png"], expected(key, alpha))
    assert ds.manifest.compile["alpha"] == fmt.ALPHA[alpha]
    info = runner.invoke(app, ["info", str(out)])
    assert info.exit_code == 0 and f"alpha={fmt.ALPHA[alpha]}" in info.stdout


@pytest.mark.parametrize("alpha", ["white", "drop"])
def test_the_round_trip_check_uses_the_recorded_choice(tmp_path: Path, alpha: str) -> None:
    src = make_image_folder(tmp_path / "src", classes=2, per_class=3, size=(32, 40))  # one PNG with alpha
    result = assert_roundtrip(src, tmp_path / "out", compile_first=True, size=32, alpha=alpha, workers=1)
    assert result.records == 6 and result.worst_abs_diff < 1.0
    check = runner.invoke(app, ["verify", str(tmp_path / "out"), "--decode", "6"])
    assert check.exit_code == 0 and "max 0," in check.stdout, check.stdout


def test_a_resume_with_another_choice_is_refused(src: Path, tmp_path: Path) -> None:
    for i in range(40):  # enough sources for two chunks: the compile dies after the first
        Image.fromarray(rgba_source(), "RGBA").save(src / "rgba" / f"more_{i}.png")
    out = tmp_path / "out"
    code = ("import os, sys, dsc, dsc.compiler.write as write\n"
            "real, done = write.write_chunk, []\n"
            "def first_then_die(job, chunk):\n"
            "    if done: os._exit(9)\n"
            "    done.append(1)\n"
            "    return real(job, chunk)\n"
            "write.write_chunk = first_then_die\n"
            "dsc.compile_folder(sys.argv[1], sys.argv[2], size=8, workers=1, alpha='white')")
    killed = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True)
    assert killed.returncode == 9 and staging_path(out).is_dir(), killed.stderr
    with pytest.raises(CompileError, match=r"other settings: alpha 'white' \(now 'black'\)"):
        compile_folder(src, out, size=8, workers=1, resume=True)  # the default, black
    with pytest.raises(CompileError, match=r"other settings: alpha 'white' \(now 'drop'\)"):
        compile_folder(src, out, size=8, workers=1, resume=True, alpha="drop")
    summary = compile_folder(src, out, size=8, workers=1, resume=True, alpha="white")
    assert summary.reused == 16 and json.loads((out / fmt.MANIFEST_FILE).read_text())["compile"]["alpha"] == \
        "composited onto white"


def test_an_unknown_choice_is_a_usage_error(src: Path, tmp_path: Path) -> None:
    ran = runner.invoke(app, ["compile", str(src), str(tmp_path / "out"), "--alpha", "grey"])
    assert ran.exit_code == 2 and "'grey' is not one of black, white, drop" in ran.stderr
    with pytest.raises(CompileError, match="unknown alpha 'grey'; choose one of black, white, drop"):
        compile_folder(src, tmp_path / "out", alpha="grey")
