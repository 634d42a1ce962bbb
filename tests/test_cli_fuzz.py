"""Every CLI command driven with generated option values (issue 27, point 9): whatever a script with a
typo or a hostile user passes, dsc answers with a clean message and exit 0, 1 or 2 — never a
traceback, never a hang.

The values mix the absurd (negative, 10^20, inf, nan, empty, 300-byte names, control characters, a
FIFO, /dev/zero) with small valid ones, on a 12-image folder and its tiny
dataset, so a run stays short; valid durations and sizes are drawn small for the same reason (the
option's own bound is asserted separately, with the values that must be refused).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import dsc
from dsc.cli import app

from conftest import make_folder

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
FUZZ = settings(deadline=None, max_examples=30,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MEMORY_ROOM = 4 << 30
LONG_NAME = "a" * 255  # NAME_MAX: its staging name (".NAME.dsc-partial") is too long

INTS = st.sampled_from(["-1", "0", "1", "2", "3", "7", str(2**31), str(2**63), str(10**20), "1e3", "", "x", "nan"])
COUNTS = st.one_of(st.sampled_from(["1", "2", "3"]), INTS)  # valid ones half the time, so commands also run
# argv cannot hold a NUL; undecodable bytes (surrogates) are left out: CliRunner cannot print them, a terminal can
TEXT = st.one_of(st.sampled_from(["", LONG_NAME, "a" * 300, "\n", "../..", "-", "--"]),
                 st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12))


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """Where the generated paths point: a real folder and dataset, and things that are not what they claim."""
    root = tmp_path_factory.mktemp("fuzz")
    make_folder(root / "src", classes=3, per_class=4, sides=(16, 24))
    dsc.compile_folder(root / "src", root / "ds", size=8, workers=1)
    os.mkfifo(root / "fifo")
    (root / "file.txt").write_text("not a dataset\n")
    return {"src": str(root / "src"), "ds": str(root / "ds"), "fifo": str(root / "fifo"),
            "file": str(root / "file.txt"), "missing": str(root / "missing"), "long": str(root / LONG_NAME),
            "longer": str(root / (LONG_NAME * 2)), "dev": "/dev/zero", "root": str(root)}


@pytest.fixture
def bounded_memory():
    """Room for 4 GiB more than this process maps now: a command that reads without end (a label table
    that is /dev/zero) fails with MemoryError instead of taking the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limit = mapped + MEMORY_ROOM if hard == resource.RLIM_INFINITY else min(hard, mapped + MEMORY_ROOM)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _path(places: dict[str, str], *keys: str) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from([places[k] for k in keys]), TEXT)


def _options(table: dict[str, st.SearchStrategy]) -> st.SearchStrategy[list[str]]:
    """Some of the command's options, each with a generated value (flags alone)."""
    def flatten(chosen: dict) -> list[str]:
        args = []
        for name, value in chosen.items():
            args += [name] if value is None else [name, value]
        return args
    return st.fixed_dictionaries({}, optional=table).map(flatten)


def _check(args: list[str]) -> None:
    result = runner.invoke(app, args)
    output = result.stdout + result.stderr
    event(f"{args[0]}: exit {result.exit_code}")  # pytest --hypothesis-show-statistics: how often each ends how
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, output)
    assert "Traceback" not in output, (args, output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, repr(result.exception))
    if result.exit_code:
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith(("error: ", "Error: ")) or "Error" in result.stderr, (args, result.stderr)


@pytest.mark.timeout(600)
@settings(FUZZ)
@given(data=st.data())
def test_info_verify_show(places: dict[str, str], bounded_memory, data: st.DataObject) -> None:
    dataset = data.draw(_path(places, "ds", "ds", "fifo", "file", "missing", "long", "longer", "dev", "root"))
    command = data.draw(st.sampled_from(["info", "verify", "show"]))
    table = {"info": {"--json": st.none()},
             "verify": {"--decode": COUNTS, "--seed": INTS},
             "show": {"--n": COUNTS, "--indices": st.one_of(TEXT, st.sampled_from(["0,1", "-1", "1," * 2000, "99"])),
                      "--class": TEXT, "--seed": INTS, "--columns": COUNTS}}[command]
    args = [command, dataset, *data.draw(_options(table))]
    if command == "show":
        out = data.draw(st.one_of(st.sampled_from(["x.png", "x.txt", "", LONG_NAME + ".png", "missing/x.png"]),
                                  TEXT))
        args += ["-o", out if out in ("", "x.txt") else os.path.join(tempfile.mkdtemp(dir=places["root"]), out)]
    _check(args)


@pytest.mark.timeout(600)
@settings(FUZZ)
@given(data=st.data())
def test_bench(places: dict[str, str], bounded_memory, data: st.DataObject) -> None:
    dataset = data.draw(st.one_of(st.just(places["ds"]), _path(places, "fifo", "missing", "longer")))
    options = data.draw(_options({"--batch-size": COUNTS, "--threads": COUNTS, "--cold": st.none(),
                                  "--device": st.sampled_from(["cpu", "cuda", "cuda:99", "meta", "", "x"])}))
    seconds = data.draw(st.sampled_from(["inf", "nan", "-1", "1e308", "3601", "0.1", "0.1", "0.1"]))  # valid: small
    _check(["bench", dataset, "--seconds", seconds, "--no-cold", *options])


@pytest.mark.timeout(600)
@settings(FUZZ)
@given(data=st.data())
def test_compile(places: dict[str, str], bounded_memory, data: st.DataObject) -> None:
    src = data.draw(_path(places, "src", "src", "src", "fifo", "file", "missing", "longer", "ds"))
    out = data.draw(st.one_of(st.sampled_from(["out", LONG_NAME, "ds"]), TEXT))
    table = {"--size": st.sampled_from(["8", "0", "-1", "x", "99999", "8x12", "1x100000", "", "inf", "4×4"]),
             "--fit": st.sampled_from(["pad", "stretch", "", "zoom"]), "--seed": INTS, "--no-shuffle": st.none(),
             "--workers": st.sampled_from(["1", "2", "0", "-1", str(10**6), "x"]),
             "--strict": st.none(), "--force": st.none(), "--resume": st.none(),
             "--engine": st.sampled_from(["local", "", "spark"]), "--address": TEXT,
             "--records-per-shard": COUNTS, "--max-pixels": INTS, "--fast-decode": st.none(),
             "--alpha": st.sampled_from(["white", "drop", "", "pink"]),
             "--classes": st.one_of(TEXT, st.sampled_from(["class_0,class_1,class_2", places["fifo"], places["dev"]])),
             "--classes-from": _path(places, "ds", "fifo", "src", "missing"),
             "--skip-unknown-classes": st.none(),
             "--labels": _path(places, "file", "fifo", "dev", "missing", "ds"),
             "--column": st.sampled_from(["label:none", "x:float", "label", ":", "a:b"]),
             "--stall-seconds": st.sampled_from(["0", "inf", "nan", "-1", "1e9", "x", "5"])}
    options = data.draw(_options(table))
    work = tempfile.mkdtemp(dir=places["root"])
    try:
        _check(["compile", src, os.path.join(work, out) if out not in ("ds",) else places["ds"] + "-copy",
                *options, *([] if "--workers" in options else ["-j", "1"]), *([] if "--size" in options else
                                                                               ["--size", "8"])])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(places["ds"] + "-copy", ignore_errors=True)


@pytest.mark.timeout(600)
@settings(FUZZ)
@given(data=st.data())
def test_append_merge_prune(places: dict[str, str], bounded_memory, data: st.DataObject) -> None:
    """On copies of the tiny dataset: these commands write into their DATASET (or create OUT)."""
    work = tempfile.mkdtemp(dir=places["root"])
    copy = os.path.join(work, "ds")
    shutil.copytree(places["ds"], copy)
    def target() -> st.SearchStrategy[str]:
        return st.one_of(st.just(copy), _path(places, "fifo", "file", "missing", "longer", "src"))
    command = data.draw(st.sampled_from(["append", "merge", "prune"]))
    if command == "append":
        args = ["append", data.draw(target()), data.draw(_path(places, "src", "src", "fifo", "missing", "ds")),
                *data.draw(_options({"--labels": _path(places, "file", "fifo", "dev", "missing"),
                                     "--column": st.sampled_from(["label:none", "x:float", ":"]),
                                     "--new-classes": st.none(), "--strict": st.none(),
                                     "--workers": st.sampled_from(["1", "0", str(10**6), "x"])}))]
        args += [] if "--workers" in args else ["-j", "1"]
    elif command == "merge":
        args = ["merge", data.draw(target()), data.draw(target()),
                os.path.join(work, data.draw(st.one_of(st.sampled_from(["out", LONG_NAME]), TEXT))),
                *data.draw(_options({"--force": st.none()}))]
    else:
        args = ["prune", data.draw(target()), "--keep", data.draw(COUNTS)]
    try:
        _check(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "{ds}", "--seconds", "inf"], "Invalid value for '--seconds'"),
    (["bench", "{ds}", "--batch-size", "100000000"], "Invalid value for --batch-size: batches of 100,000,000"),
    (["bench", "{ds}", "--threads", "100000"], "Invalid value for '--threads'"),
    (["compile", "{src}", "{root}/x", "--records-per-shard", str(10**20)], "Invalid value for '--records-per-shard'"),
    (["compile", "{src}", "{root}/x", "--workers", str(10**6)], "Invalid value for '--workers'"),
    (["show", "{ds}", "-o", "{root}/x.png", "--columns", str(10**9)], "Invalid value for '--columns'"),
    (["show", "{ds}", "-o", "{root}/x.png", "--indices", "0," * 1025], "1025 records asked for"),
    (["compile", "{src}", "{root}/x", "--labels", "{dev}"], "cannot read label table /dev/zero: not a regular file"),
    (["compile", "{src}", "{root}/x", "--labels", "{fifo}"], "cannot read label table .*: not a regular file .a FIFO"),
    (["info", "{long}"], "does not exist"),
    (["info", "{longer}"], "cannot be opened: File name too long"),
    (["compile", "{longer}", "{root}/x", "--column", "label:none"], "source .*: File name too long"),  # (was: OSError)
    (["compile", "{src}", "{longer}", "-j", "1"], "cannot write in .* File name too long"),  # (was: OSError)
    (["show", "{ds}", "-o", "{root}/" + LONG_NAME + ".png"], "cannot write .*: File name too long"),
])
@pytest.mark.timeout(120)
def test_absurd_values_are_refused_up_front(places: dict[str, str], bounded_memory, args: list[str],
                                            message: str) -> None:
    result = runner.invoke(app, [a.format(**places) for a in args])
    assert result.exit_code in (1, 2), result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr

    assert re.search(message, " ".join(result.stderr.split())), result.stderr
