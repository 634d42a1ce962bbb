"""`dsc compile` on the command line: output, exit codes, one clear line per error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsc import storage
from dsc.cli import app
from dsc.compiler.journal import JOURNAL_FILE
from dsc.compiler.publish import staging_path

from conftest import pattern, save

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})


def test_compile_prints_a_summary(folder: Path, tmp_path: Path) -> None:
    (folder / "class_0" / "bad.jpg").write_bytes(b"oops")
    result = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), "--size", "24x32", "-j", "2",
                                 "--fit", "pad", "--seed", "3"])
    assert result.exit_code == 0, result.stderr
    assert "12 records of 24x32x3 uint8 in 1 shard(s), 3 classes, 1 skipped" in result.stdout
    assert "skipped class_0/bad.jpg: not a recognised image file" in result.stderr
    manifest = storage.open_dataset(tmp_path / "out").manifest
    assert manifest.compile["fit"] == "pad" and manifest.compile["seed"] == 3


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--size", "big"], 2, "is not N or HxW"),
    (["--fit", "zoom"], 2, "'zoom' is not one of center-crop, stretch, pad"),
    (["--workers", "0"], 2, r"Invalid value for '--workers'.*greater than or equal to 1"),
    (["--seed", "-1"], 2, r"Invalid value for '--seed'.*greater than or equal to 0"),
    (["--strict"], 1, "error: .*bad.jpg: not a recognised image file .*--strict"),
])
def test_bad_options_and_strict(folder: Path, tmp_path: Path, args: list[str], code: int, message: str) -> None:
    (folder / "class_2" / "bad.jpg").write_bytes(b"oops")
    result = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), *args])
    assert result.exit_code == code
    assert re.search(message, result.stderr.replace("\n", " "))
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "out").exists()


def test_runtime_errors_are_one_line(folder: Path, tmp_path: Path) -> None:
    missing = runner.invoke(app, ["compile", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert missing.exit_code == 1
    assert missing.stderr.strip().splitlines() == [f"error: source folder {tmp_path / 'nope'} does not exist"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    exists = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out")])
    assert exists.exit_code == 1 and "is a folder that is not a dsc dataset" in exists.stderr
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"
    nested = runner.invoke(app, ["compile", str(folder), str(tmp_path / "no" / "such" / "out")])
    assert nested.exit_code == 0 and (tmp_path / "no" / "such" / "out" / "manifest.json").is_file()  # mkdir -p
    (tmp_path / "file").write_text("")
    blocked = runner.invoke(app, ["compile", str(folder), str(tmp_path / "file" / "out")])
    assert blocked.exit_code == 1
    assert blocked.stderr.strip().splitlines() == [f"error: {tmp_path / 'file'} is a file, not a folder, so it "
                                                   "cannot hold out"]


def test_help_lists_every_option() -> None:
    result = runner.invoke(app, ["compile", "--help"])
    assert result.exit_code == 0
    for option in ("--size", "--fit", "--seed", "--no-shuffle", "--workers", "--strict", "--force",
                   "--records-per-shard", "--max-pixels"):
        assert option in result.stdout


def test_the_console_script_runs_without_the_system_libjpeg_turbo(folder: Path, tmp_path: Path) -> None:
    env = {"DSC_JPEG_DECODER": "pillow", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "dsc", "compile", str(folder), str(tmp_path / "out"),
                          "--size", "16", "-j", "1"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert "libturbojpeg" not in run.stderr  # nothing to say: simplejpeg's libjpeg-turbo does the same work
    assert "simplejpeg" in storage.open_dataset(tmp_path / "out").manifest.compile["jpeg_decoder"]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 PNGs of 600x800, slow enough to decode that a signal lands mid-compile: encoded once and
    written 240 times (the encoding was most of this test's time), read-only to the compiles."""
    root = tmp_path_factory.mktemp("interrupted") / "big"
    data = save(root / "c0" / "0.png", pattern(600, 800), "PNG", compress_level=1).read_bytes()
    (root / "c1").mkdir()
    for i in range(1, 240):
        (root / f"c{i % 2}" / f"{i}.png").write_bytes(data)
    return root


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_cli_compile_with_workers_cleans_up(big: Path, tmp_path: Path, sig: int) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "dsc", "compile", str(big), str(out),
                             "--size", "64", "-j", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,  # a foreground job: Ctrl-C not ignored, even if
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # pytest runs in `&`
    deadline = time.monotonic() + 60
    journal = staging_path(out) / JOURNAL_FILE
    while not (journal.exists() and journal.stat().st_size):  # workers are busy decoding
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.005)
    os.killpg(proc.pid, sig)  # as a terminal's Ctrl-C (or a scheduler) signals the whole group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert stderr.strip().splitlines() == [  # one line, nothing from the workers
        f"error: interrupted; {out} was not written; the work so far is kept in {staging_path(out)}: "
        "add --resume to continue"]
    assert not out.exists() and staging_path(out).exists()
    resumed = runner.invoke(app, ["compile", str(big), str(out), "--size", "64", "--resume"])
    assert resumed.exit_code == 0 and "240 records" in resumed.stdout


def test_on_a_terminal_the_bar_counts_discovery_then_shows_total_rate_and_eta(folder: Path, tmp_path: Path) -> None:
    """The progress bar as a person sees it: stderr is a real pseudo-terminal, stdout a pipe."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))  # 100 columns, as a terminal has
    proc = subprocess.Popen([sys.executable, "-m", "dsc", "compile", str(folder), str(tmp_path / "out"),
                             "--size", "16", "-j", "1"], stdout=subprocess.PIPE, stderr=follower, text=True)
    os.close(follower)
    screen = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the compile closed its end of the terminal
            break
        if not data:
            break
        screen += data
    stdout = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    os.close(leader)
    text = screen.decode()
    assert "wrote" not in text and stdout.startswith(f"wrote {tmp_path / 'out'}: 12 records")
    lines = text.replace("\r\n", "\n").split("\n")
    discovered = [line.rsplit("\r", 1)[-1] for line in lines if "discovering:" in line]
    assert len(discovered) == 1 and discovered[0].startswith("discovering: 12img [")  # left on screen, final count
    final = lines[lines.index(next(line for line in lines if "compiling:" in line))].rsplit("\r", 1)[-1]
    assert re.match(r"compiling: 100%\|[^|]+\| 12/12 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+img/s\]", final), final


@pytest.mark.parametrize(("args", "option", "message"), [
    (["--engine", "spark"], "--engine", "'spark' is not one of local, ray"),
    (["--address", "1.2.3.4:6379"], "--address", "only with --engine ray"),
    (["--column", "weight:float"], "--column", "only with --labels"),
])
def test_option_mistakes_are_usage_errors(folder: Path, tmp_path: Path, args: list[str], option: str,
                                          message: str) -> None:
    result = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert f"Error: Invalid value for {option}: {message}" in result.stderr
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["SRC", "OUT"])
def test_an_empty_path_is_not_taken_for_the_current_folder(folder: Path, tmp_path: Path, monkeypatch,
                                                           which: str) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["", str(tmp_path / "out")] if which == "SRC" else [str(folder), ""]
    result = runner.invoke(app, ["compile", *args])
    assert result.exit_code == 2 and f"Invalid value for '{which}': is empty (an unset shell variable?)" in \
        result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_swapped_or_identical_src_and_out_are_named(folder: Path, tmp_path: Path) -> None:
    same = runner.invoke(app, ["compile", str(folder), str(folder)])
    assert same.exit_code == 1 and same.stderr == (f"error: the source folder and the output are the same folder, "
                                                   f"{folder}; give OUT another name\n")
    runner.invoke(app, ["compile", str(folder), str(tmp_path / "ds"), "--size", "8"])
    swapped = runner.invoke(app, ["compile", str(tmp_path / "ds"), str(tmp_path / "new")])
    assert swapped.exit_code == 1 and swapped.stderr == (f"error: source {tmp_path / 'ds'} is a compiled dsc dataset, "
                                                         "not an image folder; did you swap SRC and OUT?\n")


def test_a_resume_says_what_it_reused_or_that_there_was_nothing(folder: Path, tmp_path: Path) -> None:
    fresh = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), "--size", "8", "--resume"])
    assert fresh.exit_code == 0 and "resumed:" not in fresh.stderr
    assert f"warning: nothing to resume at {staging_path(tmp_path / 'out')}: compiling from scratch" in fresh.stderr
    proc = subprocess.run([sys.executable, "-c", "import os, sys, dsc, dsc.compiler.publish as p\n"
                           "p.publish = lambda *a: os._exit(9)\n"  # dies right before publishing
                           "dsc.compile_folder(sys.argv[1], sys.argv[2], size=8, workers=1)",
                           str(folder), str(tmp_path / "again")], capture_output=True, text=True)
    assert proc.returncode == 9 and not (tmp_path / "again").exists()
    resumed = runner.invoke(app, ["compile", str(folder), str(tmp_path / "again"), "--size", "8", "--resume"])
    assert resumed.exit_code == 0 and "note: resumed: 12 of 12 sources were done already" in resumed.stderr


def test_a_ctrl_c_while_the_command_is_still_starting_ends_it_quietly(folder: Path, tmp_path: Path) -> None:
    """The `dsc` script as installed, interrupted while it still imports its modules: frozen (SIGSTOP)
    as soon as numpy's extension is mapped, signalled, then let go, so the Ctrl-C lands mid-import (once
    the imports are done, a Ctrl-C is the compile's own and says "interrupted" on stderr)."""
    script = Path(sys.executable).parent / "dsc"
    proc = subprocess.Popen([str(script), "compile", str(folder), str(tmp_path / "out")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    deadline = time.monotonic() + 60
    while "_multiarray_umath" not in Path(f"/proc/{proc.pid}/maps").read_text():  # the CLI's imports are under way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.0002)
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr == "" and stdout == ""  # not the compile's own "interrupted" line
    assert not (tmp_path / "out").exists()


def test_the_summary_counts_in_words(tmp_path: Path) -> None:
    save(tmp_path / "one" / "only.png", pattern(20, 20), "PNG")
    result = runner.invoke(app, ["compile", str(tmp_path / "one"), str(tmp_path / "out"), "--size", "8"])
    assert result.exit_code == 0
    assert result.stdout.startswith(f"wrote {tmp_path / 'out'}: 1 record of 8x8x3 uint8 in 1 shard(s), 0 classes, ")


def test_an_image_folder_with_a_manifest_json_of_its_own_compiles(folder: Path, tmp_path: Path) -> None:
    (folder / "manifest.json").write_text('{"images": 12, "source": "a download"}')  # not a dsc dataset
    result = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), "--size", "8"])
    assert result.exit_code == 0 and "12 records" in result.stdout


def test_a_resume_counts_only_the_sources_of_the_build(tmp_path: Path) -> None:
    """A broken link found while scanning never enters the build: it is neither 'done already'
    nor work of this run. A compile killed after its first chunk reuses exactly what its journal holds."""
    from dsc.testing import make_image_folder

    folder = make_image_folder(tmp_path / "src", classes=2, per_class=20, size=(16, 16))  # chunks of 16
    (folder / "class_0" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    code = ("import os, sys, dsc, dsc.compiler.write as write\n"
            "real, done = write.write_chunk, []\n"
            "def first_then_die(job, chunk):\n"
            "    if done: os._exit(9)\n"
            "    done.append(1)\n"
            "    return real(job, chunk)\n"
            "write.write_chunk = first_then_die\n"
            "dsc.compile_folder(sys.argv[1], sys.argv[2], size=8, workers=1, on_skip=lambda *a: None)")
    killed = subprocess.run([sys.executable, "-c", code, str(folder), str(tmp_path / "out")], capture_output=True,
                            text=True)
    assert killed.returncode == 9, killed.stderr
    journalled = (staging_path(tmp_path / "out") / JOURNAL_FILE).read_text().count("\n")
    assert journalled == 16
    resumed = runner.invoke(app, ["compile", str(folder), str(tmp_path / "out"), "--size", "8", "--resume"])
    assert resumed.exit_code == 0 and "40 records" in resumed.stdout and "1 skipped" in resumed.stdout
    assert "note: resumed: 16 of 40 sources were done already" in resumed.stderr
