"""What `--force` may delete, and the names dsc makes beside OUT (issue 26, points 1 and 2), tried
on real folders, real files and real symbolic links through the real command line: a user's files
inside or beside a dataset are never replaced or deleted, and a link planted at any name dsc makes
beside OUT (a shared or world-writable parent folder) is never followed, its target never touched."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsc import CompileError, DatasetError, compile_folder, storage
from dsc.cli import app
from dsc.compiler import publish
from dsc.compiler.publish import lock_path, record_path, retired_prefix, staging_path
from dsc.storage.local import RENAME_EXCHANGE

from conftest import make_folder

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
OPTIONS = ["--size", "8", "-j", "1"]


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def dsc_compile(src: Path, out: Path, *extra: str):
    return runner.invoke(app, ["compile", str(src), str(out), *OPTIONS, *extra])


def one_error_line(result) -> str:
    """The command failed with exit 1 and one `error:` line, no traceback; that line."""
    assert result.exit_code == 1, (result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def interrupted_build(src: Path, out: Path) -> Path:
    """A compile of `src` into `out` stopped by Ctrl-C at its first progress report: its partial build."""
    def ctrl_c(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_folder(src, out, size=8, workers=1, progress=ctrl_c)
    return staging_path(out)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src", per_class=3, sides=(16, 40))


# ----------------------------------------------------------------------------- 1: what --force replaces

def test_force_never_replaces_a_fake_manifest_beside_a_users_file(src: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "manifest.json").write_text('{"format": "dsc"}')
    (precious / "thesis.tex").write_text("years of work")
    line = one_error_line(dsc_compile(src, precious, "--force"))
    assert "is a folder that is not a dsc dataset" in line and "thesis.tex" in line and "move it away" in line
    assert files_of(precious) == {"manifest.json": b'{"format": "dsc"}', "thesis.tex": b"years of work"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious", "src"]  # no build was even started


@pytest.mark.parametrize("mine", ["notes.txt", "README", "metrics/run1.csv", "shards/notes.txt"])
def test_force_never_deletes_a_users_file_kept_inside_a_dataset(src: Path, tmp_path: Path, mine: str) -> None:
    out = tmp_path / "out"
    assert dsc_compile(src, out).exit_code == 0
    (out / mine).parent.mkdir(exist_ok=True)
    (out / mine).write_text("my own")
    before = files_of(out)
    line = one_error_line(dsc_compile(src, out, "--force", "--size", "12"))
    shown = mine if mine.count("/") != 1 or mine.startswith("shards/") else mine.split("/")[0] + "/"
    assert f"also holds what its manifest does not list: {shown};" in line and f"move those out of {out}" in line
    assert files_of(out) == before  # the dataset and the user's file, untouched
    (out / mine).unlink()
    if mine.startswith("metrics/"):
        (out / "metrics").rmdir()  # an empty folder of the user's is the user's too
    assert dsc_compile(src, out, "--force", "--size", "12").exit_code == 0  # moved out: replaced
    assert storage.open_dataset(out).manifest.height == 12


def test_the_refusal_names_a_few_entries_and_is_a_dataset_error_in_python(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1)
    for name in ("a.txt", "b.txt", "c.txt", "d.txt", "e.txt"):
        (out / name).write_text(name)
    with pytest.raises(CompileError, match=r"does not list: a\.txt, b\.txt, c\.txt and 2 more;") as caught:
        compile_folder(src, out, size=12, workers=1, force=True)
    assert isinstance(caught.value, DatasetError) and isinstance(caught.value, CompileError)
    assert len(files_of(out)) == len(storage.open_dataset(out).manifest.files) + 1 + 5


def test_a_users_file_written_into_out_while_compiling_is_never_swapped_out(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1)

    def user_writes_notes(n: int) -> None:
        (out / "notes.txt").write_text("written during the compile")

    with pytest.raises(CompileError, match="left untouched, even with --force, and the finished build waits"):
        compile_folder(src, out, size=12, workers=1, force=True, progress=user_writes_notes)
    assert (out / "notes.txt").read_text() == "written during the compile"
    assert storage.open_dataset(out).manifest.height == 8
    (out / "notes.txt").unlink()
    compile_folder(src, out, size=12, workers=1, force=True, resume=True)  # the build waited
    assert storage.open_dataset(out).manifest.height == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def _killed_right_after_the_swap(src: Path, out: Path) -> None:
    """A --force compile killed just after exchanging the build with OUT: the old dataset waits in the
    build folder for its deletion (formats.md state 4)."""
    def child() -> None:
        real_rename = os.rename
        os.rename = lambda a, b, *r: os.kill(os.getpid(), signal.SIGKILL) if "dsc-old" in str(b) \
            else real_rename(a, b, *r)
        compile_folder(src, out, size=12, workers=1, force=True)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL


def test_the_replaced_dataset_is_checked_again_before_it_is_deleted(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1)
    _killed_right_after_the_swap(src, out)
    old = staging_path(out)
    assert storage.open_dataset(old).manifest.height == 8
    (old / "notes.txt").write_text("written into the old dataset after the check")
    result = dsc_compile(src, out, "--force", "--resume", "--size", "12")
    assert result.exit_code == 0, result.stderr
    graves = list(tmp_path.glob(f"{retired_prefix(out)}*"))
    assert len(graves) == 1 and (graves[0] / "notes.txt").read_text() == "written into the old dataset after the check"
    assert f"waits at {graves[0]}: it holds what dsc did not make (notes.txt)" in result.stderr
    assert storage.open_dataset(graves[0]).manifest.height == 8  # left whole
    assert storage.open_dataset(out).manifest.height == 12
    assert dsc_compile(src, out, "--force").exit_code == 0  # later compiles leave it too
    assert (graves[0] / "notes.txt").exists()


def test_a_users_folder_swapped_out_by_a_killed_force_compile_is_never_deleted(src: Path, tmp_path: Path) -> None:
    """The race no check before the swap closes: OUT is a dataset when checked, a user's folder by the
    time RENAME_EXCHANGE runs, and the compile is killed right after the exchange, so the build folder
    holds the user's folder and nothing re-checked it. The resume (which once rmtree'd whatever the
    build folder held) deletes only what dsc made: every file stays, byte for byte, where it says -
    even the user's files that carry names dsc gives its own."""
    out, theirs = tmp_path / "out", tmp_path / "theirs"
    compile_folder(src, out, size=8, workers=1)
    (theirs / "shards").mkdir(parents=True)
    (theirs / "notes.txt").write_text("a user's notes")
    (theirs / "labels.bin").write_bytes(b"a user's file named like an index file")
    (theirs / "shards" / "00000.bin").write_bytes(bytes(range(256)))
    (theirs / "photo.jpg").write_bytes((src / "class_0" / "img_0.jpg").read_bytes())
    kept = files_of(theirs)

    def child() -> None:
        real = publish.renameat2

        def swap_then_die(a: Path, b: Path, flags: int) -> bool:
            if flags != RENAME_EXCHANGE:
                return real(a, b, flags)
            os.rename(out, tmp_path / "moved-away")  # after publish checked OUT: someone replaces it
            os.rename(theirs, out)
            real(a, b, flags)
            os.kill(os.getpid(), signal.SIGKILL)

        publish.renameat2 = swap_then_die
        compile_folder(src, out, size=12, workers=1, force=True)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    assert files_of(staging_path(out)) == kept  # the exchange took the user's folder out
    result = dsc_compile(src, out, "--force", "--resume", "--size", "12")
    assert result.exit_code == 0, result.stderr
    assert storage.open_dataset(out).manifest.height == 12
    graves = list(tmp_path.glob(f"{retired_prefix(out)}*"))
    assert len(graves) == 1 and files_of(graves[0]) == kept
    assert f"waits at {graves[0]}: it holds what dsc did not make" in result.stderr
    assert storage.open_dataset(tmp_path / "moved-away").manifest.height == 8


def test_a_folder_at_a_retired_name_is_deleted_only_if_dsc_made_it(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1)
    theirs = tmp_path / f"{retired_prefix(out)}planted"
    theirs.mkdir()
    (theirs / "data.csv").write_text("someone's")
    half_deleted = tmp_path / f"{retired_prefix(out)}0123456789ab"  # what a kill left of a deletion
    compile_folder(src, half_deleted, size=8, workers=1)
    (half_deleted / storage.parse_manifest(half_deleted).shards[0].file).unlink()
    (half_deleted / "labels.bin").unlink()
    result = dsc_compile(src, out, "--force", "--size", "12")
    assert result.exit_code == 0, result.stderr
    assert (theirs / "data.csv").read_text() == "someone's" and f"waits at {theirs}" in result.stderr
    assert not half_deleted.exists()


def test_force_never_discards_a_partial_build_holding_a_users_file(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    stage = interrupted_build(src, out)
    (stage / "mine.txt").write_text("not dsc's")
    before = files_of(stage)
    line = one_error_line(dsc_compile(src, out, "--force"))
    assert f"the partial build at {stage} holds what dsc did not make (mine.txt)" in line
    assert files_of(stage) == before and not out.exists()
    (stage / "mine.txt").unlink()
    assert dsc_compile(src, out, "--force").exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


# ----------------------------------------------------------------------------- 2: links beside OUT

BESIDE_OUT = {  # every name dsc makes beside OUT, and the publish record's temporary name before issue 26
    "the publish record's old temporary name": lambda out: out.parent / f".{record_path(out).name}.tmp",
    "the publish record": record_path,
    "the lock": lock_path,
    "the build folder": staging_path,
    "a retired dataset": lambda out: out.parent / f"{retired_prefix(out)}planted",
}


@pytest.mark.parametrize("target", ["file", "folder", "missing"])
@pytest.mark.parametrize("name", list(BESIDE_OUT))
def test_a_link_planted_beside_out_is_never_followed(src: Path, tmp_path: Path, name: str, target: str) -> None:
    out = tmp_path / "out"
    assert dsc_compile(src, out).exit_code == 0
    victim = tmp_path / "victim"
    if target == "file":
        victim.write_text("the victim's")
    elif target == "folder":
        victim.mkdir()
        (victim / "keep.txt").write_text("the victim's")
    planted = BESIDE_OUT[name](out)
    planted.symlink_to(victim)
    before = files_of(victim) if target == "folder" else victim.read_bytes() if target == "file" else None
    results = [dsc_compile(src, out, *args) for args in (["--force", "--size", "12"], ["--force", "--resume"], [])]
    for result in results:
        assert result.exit_code in (0, 1) and "Traceback" not in result.stderr, result.stderr
    if target == "missing":
        assert not os.path.lexists(victim)  # nothing created through the link
    else:
        assert (files_of(victim) if target == "folder" else victim.read_bytes()) == before
    assert storage.open_dataset(out).manifest.height in (8, 12)


def test_the_record_is_written_under_an_unguessable_name_and_leaves_none(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".{record_path(out).name}.tmp").symlink_to(victim)
    assert dsc_compile(src, out).exit_code == 0
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{record_path(out).name}.tmp", "out", "src", "victim.txt"]


@pytest.mark.parametrize("kind", ["link", "fifo", "folder", "another user's file"])
def test_a_lock_file_dsc_did_not_make_is_refused_with_one_line(src: Path, tmp_path: Path, kind: str) -> None:
    out = tmp_path / "out"
    lock = lock_path(out)
    victim = tmp_path / "victim.txt"
    if kind == "link":
        lock.symlink_to(victim)  # missing: O_CREAT through it would make it
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        lock.touch()
        os.chown(lock, 4242, 4242)
    line = one_error_line(dsc_compile(src, out))
    assert f"the lock file {lock}" in line and "run again" in line
    assert not out.exists() and not victim.exists() and os.path.lexists(lock)


def test_a_partial_build_others_can_write_is_not_resumed(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    stage = interrupted_build(src, out)
    os.chmod(stage, 0o777)
    line = one_error_line(dsc_compile(src, out, "--resume"))
    assert f"cannot resume {stage}: it is not a folder that only you can write" in line
    os.chmod(stage, 0o755)
    assert dsc_compile(src, out, "--resume").exit_code == 0


def test_the_build_folder_is_writable_by_its_owner_alone(src: Path, tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        compile_folder(src, tmp_path / "out", size=8, workers=1)
    finally:
        os.umask(old)
    for folder in (tmp_path / "out", tmp_path / "out" / "shards"):
        assert folder.stat().st_mode & 0o777 == 0o755
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["format"] == "dsc"


def test_force_deletes_the_whole_replaced_dataset_when_it_has_decoder_warnings(tmp_path: Path, caplog) -> None:
    """warnings.bin (format 1.2) is dsc's own file: a dataset holding one is deleted whole once replaced,
    not left beside OUT as if it held a user's file (and warned about at every later compile)."""
    from test_decoder_parity import damaged_folder

    src = damaged_folder(tmp_path / "src")
    (src / "dog" / "cut.jpg").unlink()
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1)
    assert (out / "warnings.bin").is_file()
    with caplog.at_level("WARNING", logger="dsc"):
        compile_folder(src, out, size=8, workers=1, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no .out.dsc-old-* left
    assert "not deleted" not in caplog.text
    assert publish.replace_problem(out) is None
