"""The first hour of a new user: the package's name and version, the loader's signature and its
torch spellings, reprs, and messages that say what is wrong."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import dsc
from dsc import MemmapDataset
from dsc.cli import app

from conftest import tiny_dataset

ROOT = Path(__file__).parent.parent
runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("surface"), seed=1, records_per_shard=4)


def test_the_distribution_is_not_pypis_other_dsc_and_ships_its_type_hints() -> None:
    installed = importlib.metadata.distribution("dsc-images")  # "dsc" on PyPI is Dynamic Statistical Comparisons
    assert installed.version == dsc.__version__ and "dsc = dsc.__main__:main" in installed.read_text("entry_points.txt")
    assert 'dsc = ["py.typed"]' in (ROOT / "pyproject.toml").read_text()
    assert (Path(dsc.__file__).parent / "py.typed").is_file()


def test_dsc_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"dsc {dsc.__version__}\n"


def test_info_on_a_missing_folder_says_it_does_not_exist(tmp_path: Path) -> None:
    result = runner.invoke(app, ["info", str(tmp_path / "nope")])
    assert result.exit_code == 1 and result.stderr == f"error: {tmp_path / 'nope'}: does not exist (expected a " \
                                                      "compiled dsc dataset)\n"


def test_ds_loader_shows_every_option(ds: MemmapDataset) -> None:
    parameters = inspect.signature(ds.loader).parameters
    assert {"order", "seed", "drop_last", "device", "prefetch", "num_threads", "rank", "world_size", "locality",
            "shuffle"} <= set(parameters)
    assert "drop_last" in inspect.getdoc(ds.loader) and "locality" in inspect.getdoc(ds.loader)


def test_shuffle_is_understood_as_torch_means_it(ds: MemmapDataset) -> None:
    assert ds.loader(4, shuffle=True).order == "random" and ds.loader(4, shuffle=False).order == "sequential"
    assert ds.loader(4, shuffle=True, order="block").order == "block" and ds.loader(4).order == "block"
    with pytest.raises(ValueError, match="shuffle=True contradicts order='sequential'"):
        ds.loader(4, shuffle=True, order="sequential")
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        ds.loader(4, shuffle="yes")


def test_a_flag_given_as_a_string_is_refused_not_taken_as_true(ds: MemmapDataset) -> None:
    # "no" is truthy: taken as a truth value it would silently drop every rank's last batch
    with pytest.raises(ValueError, match="drop_last must be True or False, got 'no'"):
        ds.loader(4, drop_last="no")
    with pytest.raises(ValueError, match="return_index must be True or False, got 'false'"):
        MemmapDataset(ds.path, return_index="false")
    assert ds.loader(4, drop_last=np.bool_(True)).drop_last is True  # numpy's bools are bools


def test_reprs_say_what_they_are(ds: MemmapDataset) -> None:
    assert repr(ds) == f"MemmapDataset({str(ds.path)!r}, count={len(ds)}, shape={list(ds.record_shape)})"
    assert repr(ds.loader(4, seed=3)) == (f"Loader({str(ds.path)!r}, batch_size=4, order='block', seed=3, "
                                          f"drop_last=False, epoch=0, batches={-(-len(ds) // 4)})")


def test_drop_last_with_less_than_one_batch_warns_instead_of_serving_nothing_silently(ds: MemmapDataset) -> None:
    loader = ds.loader(len(ds) + 1, drop_last=True)
    with pytest.warns(UserWarning, match=rf"drop_last=True, but the {len(ds)} records .* this epoch is empty") as w:
        assert list(loader) == [] and loader.epoch == 1  # and the epoch moves on, as an empty one must
    assert w[0].filename == __file__  # it points at the caller's loop
    assert len(list(ds.loader(len(ds) + 1))) == 1
    sampled = ds.loader(2, drop_last=True, samples_per_epoch=1)  # was: named the dataset's records
    with pytest.warns(UserWarning, match=r"but epoch 0's 1 samples \(of the sampling options\) split over 1 rank"):
        assert list(sampled) == []


@pytest.mark.parametrize("command", ["compile", "info", "verify", "show", "bench"])
def test_help_is_plain_text_that_fits_80_columns(command: str) -> None:
    result = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1"}).invoke(app, [command, "--help"])
    assert result.exit_code == 0
    text = result.stdout
    assert "<bool>" not in text and "…" not in text and "╭" not in text
    assert not re.search(r"\w \.(?!\.)", text)  # "Worker processes ." : a default eaten as markup
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "[default:" in text or command in ("info", "verify")


def test_usage_errors_are_plain_lines_like_data_errors(tmp_path: Path) -> None:
    result = runner.invoke(app, ["compile", str(tmp_path), str(tmp_path / "out"), "--size", "x"])
    assert result.exit_code == 2 and "╭" not in result.output
    assert "Error: Invalid value for '--size': size 'x' is not N or HxW" in result.output


def test_a_compile_counts_discovery_then_tells_its_total_before_its_progress(tmp_path: Path) -> None:
    """What the CLI's bars need: a running count while discovery walks (each image once, nested
    folders too), then the total for n/total, percent and ETA, then progress."""
    import shutil

    from dsc.testing import make_image_folder

    src = make_image_folder(tmp_path / "src", classes=2, per_class=3, size=(16, 16))
    (src / "class_0" / "bad.jpg").write_bytes(b"no")
    (src / "class_1" / "deeper" / "deepest").mkdir(parents=True)
    for n, folder in enumerate(["deeper", "deeper/deepest", "deeper/deepest"]):
        shutil.copy(next((src / "class_0").glob("*.png")), src / "class_1" / folder / f"copy_{n}.png")
    events: list[tuple[str, int]] = []
    dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, on_found=lambda n: events.append(("found", n)),
                       on_total=lambda n: events.append(("total", n)), progress=lambda n: events.append(("done", n)),
                       on_skip=lambda *_: None)
    kinds = [kind for kind, _ in events]
    assert kinds == sorted(kinds, key=["found", "total", "done"].index) and kinds.count("total") == 1
    assert sum(n for kind, n in events if kind == "found") == 10 and kinds.count("found") == 4  # one per folder
    assert ("total", 10) in events and sum(n for kind, n in events if kind == "done") == 10


def test_the_lock_file_goes_away_and_two_compiles_never_hold_out_at_once(tmp_path: Path) -> None:
    """The lock is removed by its holder; one waiting on the removed file must lock the new one."""
    import threading

    from dsc.compiler import publish

    out = tmp_path / "out"
    first = publish.lock(out)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(publish.lock(out, wait_s=10)))
    waiter.start()  # opens the same lock file and polls for it
    time.sleep(0.3)
    publish.unlock(out, first)
    waiter.join()
    assert publish.lock_path(out).exists()  # the waiter holds a file that the name leads to
    with pytest.raises(dsc.CompileError, match="another dsc compile is writing"):
        publish.lock(out, wait_s=0.2)
    publish.unlock(out, got[0])
    assert not publish.lock_path(out).exists()


def test_the_readmes_compile_and_look_commands_run_as_written(tmp_path: Path, monkeypatch) -> None:
    """Every `$ dsc` line of "Compile" and "Look at a dataset", in a folder holding a copy of the
    bundled examples, and the lines of output that do not depend on the machine (the corpus of
    /tmp/o1 is the example dataset here; bench gets a short time budget)."""
    import shutil

    readme = (ROOT / "README.md").read_text()
    sections = readme[readme.index("## Compile"):readme.index("## Labels and splits")] + \
        readme[readme.index("## Look at a dataset"):readme.index("## Augment on the device")]
    blocks = [b.splitlines() for b in sections.split("```console\n")[1:]]
    blocks = [[line for line in b[:b.index("```")]] for b in blocks if b[0].startswith("$ dsc ")]
    assert [b[0].split()[2] for b in blocks] == ["compile", "info", "verify", "show", "bench"]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "examples" / "images", tmp_path / "examples" / "images")
    (tmp_path / "docs").mkdir()
    for block in blocks:
        command = block[0][2:].split("#")[0].replace("/tmp/o1", "examples/out").replace("--seconds 3", "--seconds 0.1")
        result = runner.invoke(app, command.split()[1:])
        assert result.exit_code == 0, (command, result.output)
        shown, real = block[1:], result.stdout.splitlines()
        if command.startswith("dsc compile"):
            assert real[0].split(" on disk")[0] == shown[0].split(" on disk")[0]
        elif command.startswith("dsc info"):
            assert real[1:3] == shown[1:3] and real[4:] == shown[4:]  # not the absolute paths
            assert real[0].split(": ", 1)[1] == shown[0].split(": ", 1)[1]
        elif command.startswith("dsc show"):
            assert real == shown
        elif command.startswith("dsc verify"):
            size = re.compile(r"\([\d.]+ [KMGT]?B\)")  # all but the size, what follows it too
            assert size.sub("(SIZE)", real[0]) == size.sub("(SIZE)", shown[0])
        else:
            assert real[0] == shown[0]  # the bench table's header


@pytest.mark.parametrize("layout", ["unlabeled", "label table"])
def test_discovery_counts_images_without_class_folders_too(tmp_path: Path, layout: str) -> None:
    from dsc.testing import make_image_folder

    src = make_image_folder(tmp_path / "src", classes=2, per_class=3, size=(16, 16))
    options = {}
    if layout == "unlabeled":
        for image in list(src.glob("*/*")):
            image.rename(src / f"{image.parent.name}_{image.name}")
        for folder in [p for p in src.iterdir() if p.is_dir()]:
            folder.rmdir()
    else:
        table = tmp_path / "labels.csv"
        table.write_text("path,label\n" + "".join(f"{p.relative_to(src)},x\n" for p in sorted(src.glob("*/*"))[:4]))
        options = {"labels": table}
    found: list[int] = []
    summary = dsc.compile_folder(src, tmp_path / "out", size=8, workers=1, on_found=found.append, **options)
    assert sum(found) == 6 and summary.kept == (6 if layout == "unlabeled" else 4)


def test_images_beside_empty_class_folders_are_not_called_missing(tmp_path: Path) -> None:
    from dsc.testing import make_image_folder

    src = make_image_folder(tmp_path / "src", classes=1, per_class=2, size=(16, 16))
    for image in list((src / "class_0").iterdir()):
        image.rename(src / image.name)  # an empty class folder left behind
    result = runner.invoke(app, ["compile", str(src), str(tmp_path / "out")])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == (f"error: the 2 image(s) directly in {src} are outside every class "
                                             "folder, and the class folders hold none: move the images into class "
                                             "folders, or remove the empty folders to compile them unlabeled")


def test_the_demo_runs_as_the_readme_shows_and_leaves_nothing_but_its_dataset(tmp_path: Path) -> None:
    """scripts/demo.sh's commands after set-up, in a copy of examples/: the lines the README shows
    (machine-independent parts), and no lock or partial-build file left beside the dataset."""
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "examples" / "images", tmp_path / "examples" / "images")
    shutil.copy(ROOT / "examples" / "read_back.py", tmp_path / "examples")
    commands = [line.split() for line in (ROOT / "scripts" / "demo.sh").read_text().splitlines()
                if line.startswith(".venv/bin/")]
    assert [c[0] for c in commands] == [".venv/bin/dsc", ".venv/bin/python"]
    printed = []
    for command in commands:
        program = [sys.executable, "-m", "dsc"] if command[0].endswith("/dsc") else [sys.executable]
        run = subprocess.run(program + command[1:], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        printed += run.stdout.splitlines()
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index("```console\n$ dsc compile examples/images"):].split("```")[1].splitlines()[2:]
    shown += readme[readme.index("`examples/read_back.py`:\n\n```console\n"):].split("```")[1].splitlines()[1:]
    assert printed[0].split(" on disk")[0] == shown[0].split(" on disk")[0]
    assert printed[1] == shown[1]
    assert printed[2].split(", from ")[0] == shown[2].split(", from ")[0]
    assert printed[2].endswith("examples/images/coffee/coffee_0.jpg")
    for real, readme_line in zip(printed[3:6], shown[3:6]):
        assert real.split()[0] == readme_line.split()[0] and real.split("per class")[1] == readme_line.split(
            "per class")[1]
    assert len(printed) == len(shown) == 7
    assert sorted(p.name for p in (tmp_path / "examples").iterdir()) == ["images", "out", "read_back.py"]
