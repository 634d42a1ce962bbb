"""Quick to start: the light commands never import torch or tensordict, and a compile's driver imports
torch only when it decodes itself (one worker). Each runs in a fresh process, as a user's shell would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsc.testing import make_image_folder

HEAVY = ("torch", "tensordict")
RUN = """
import json, sys
sys.argv = ["dsc", *json.loads(sys.argv[1])]
from dsc.__main__ import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
print(json.dumps({"code": code, "heavy": [m for m in ("torch", "tensordict") if m in sys.modules]}), file=sys.stderr)
"""


def run_dsc(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True, timeout=300)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("startup")
    src = make_image_folder(root / "src", classes=2, per_class=3, size=(20, 24))
    assert run_dsc("compile", str(src), str(root / "out"), "--size", "16", "-j", "1")["code"] == 0
    return root


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["info", "{out}"], ["info", "--json", "{out}"],
                                  ["verify", "{out}"], ["show", "{out}", "-o", "{root}/sheet.png", "--n", "4"],
                                  ["compile", "--help"], ["bench", "--help"]])
def test_light_commands_import_neither_torch_nor_tensordict(dataset: Path, args: list[str]) -> None:
    ran = run_dsc(*(a.format(out=dataset / "out", root=dataset) for a in args))
    assert ran == {"code": 0, "heavy": []}


def test_a_compile_driver_with_workers_never_imports_torch(dataset: Path) -> None:
    ran = run_dsc("compile", str(dataset / "src"), str(dataset / "out2"), "--size", "16", "-j", "2")
    assert ran == {"code": 0, "heavy": []}
    assert (dataset / "out2" / "manifest.json").is_file()


def test_a_compile_into_an_existing_dataset_is_refused_before_any_decoder_is_imported(dataset: Path) -> None:
    """With one worker the driver decodes itself (it imports torch for that): an OUT it would refuse anyway is
    refused first, so the refusal costs a second or two less, and leaves OUT as it was."""
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (dataset / "out").rglob("*"))
    ran = run_dsc("compile", str(dataset / "src"), str(dataset / "out"), "--size", "16", "-j", "1")
    assert ran == {"code": 1, "heavy": []}
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (dataset / "out").rglob("*")) == before


def test_the_commands_that_need_the_reader_or_the_decoders_import_them(dataset: Path) -> None:
    """The other side of the rule: the subprocess check above would see torch if it were imported."""
    assert run_dsc("verify", str(dataset / "out"), "--decode", "2")["heavy"] == ["torch"]
    assert run_dsc("bench", str(dataset / "out"), "--seconds", "0.1", "--no-cold")["heavy"] == list(HEAVY)


def test_a_broken_decoder_install_fails_before_any_build(dataset: Path, tmp_path: Path) -> None:
    """The workers import the decoders while the driver discovers; if that import fails, the compile
    says so before it has made a partial build (which a --resume could not help)."""
    broken = tmp_path / "site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("this torch is broken on purpose")\n')
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "dsc", "compile", str(dataset / "src"), str(out), "--size", "16",
                           "-j", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == ("error: the worker processes cannot decode: ImportError: this torch is "
                                            "broken on purpose")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]  # no partial build, no lock left
