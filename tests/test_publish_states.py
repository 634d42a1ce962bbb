"""The partial build's states and the publish (formats.md, "Partial builds"), attacked the way a
hostile world does: folders appearing at OUT, kill -9 inside the publish, full disks on a real
tmpfs, a mount point as OUT, tampered and stray files in the partial build."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import dsc.compiler
from dsc import CompileError, compile_folder, storage
from dsc import format as fmt
from dsc.compiler import output
from dsc.compiler.engines.local import LocalEngine
from dsc.compiler.publish import staging_path

from conftest import make_folder, pattern, save


def file_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def quiet(source: str, reason: str) -> None:
    pass


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real, small file system that fills up (needs root; the test is skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill_up(path: Path) -> None:
    """Take every free block of the file system holding `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def killed_compile(patch: Callable[[], None], *args, **kwargs) -> None:
    """Run compile_folder in a forked child that `patch` arranges to SIGKILL itself at one point."""
    def child() -> None:
        patch()
        compile_folder(*args, on_skip=quiet, **kwargs)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, "the compile was meant to be killed at the patched point"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def src(tmp_path: Path) -> Path:
    root = make_folder(tmp_path / "src", per_class=20, sides=(16, 40))
    for c in range(2):
        (root / f"class_{c}" / f"bad_{c}.jpg").write_bytes(b"\xff\xd8 not an image")
    return root


def reference(src: Path, tmp_path: Path, **options) -> dict[str, bytes]:
    out = tmp_path / "refs" / "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    out.parent.mkdir(exist_ok=True)
    compile_folder(src, out, workers=1, on_skip=quiet, **options)
    return file_bytes(out)


# 1: nothing at OUT is replaced without --force; with it, only a dsc dataset.
@pytest.mark.parametrize("force", [False, True])
def test_a_folder_that_appears_at_out_while_compiling_is_left_alone(src: Path, tmp_path: Path, force) -> None:
    out = tmp_path / "out"

    def someone_else_writes_out(n: int) -> None:
        if not out.exists():
            out.mkdir()
            (out / "notes.txt").write_text("notes")

    with pytest.raises(CompileError, match="left untouched"):
        compile_folder(src, out, size=8, workers=1, force=force, progress=someone_else_writes_out, on_skip=quiet)
    assert file_bytes(out) == {"notes.txt": b"notes"}
    shutil.move(out, tmp_path / "notes")
    compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)  # the finished build waited
    assert file_bytes(out) == reference(src, tmp_path, size=8)


# 2: a kill after the --force exchange never rolls back; a finished build is only published for its own plan.
def test_a_kill_right_after_the_force_swap_resumes_to_the_new_dataset(src: Path, tmp_path: Path,
                                                                      monkeypatch) -> None:
    out = tmp_path / "out"
    compile_folder(src, out, size=8, workers=1, on_skip=quiet)

    def kill_after_exchange() -> None:
        real_rename, real_rmtree = os.rename, shutil.rmtree
        os.rename = lambda a, b, *r: die() if str(a).endswith(".dsc-partial") and "dsc-old" in str(b) \
            else real_rename(a, b, *r)
        shutil.rmtree = lambda p, *a, **k: die() if str(p).endswith(".dsc-partial") else real_rmtree(p, *a, **k)

    killed_compile(kill_after_exchange, src, out, size=12, workers=1, force=True)
    summary = compile_folder(src, out, size=12, workers=1, force=True, resume=True, on_skip=quiet)
    assert summary.record_shape == (12, 12, 3)
    assert file_bytes(out) == reference(src, tmp_path, size=12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "refs", "src"]


def test_a_finished_build_is_not_published_by_a_resume_with_other_options(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed_compile(lambda: setattr(dsc.compiler.publish, "publish", lambda *a: die()), src, out, size=12, workers=1)
    with pytest.raises(CompileError, match="other settings"):
        compile_folder(src, out, size=16, workers=1, resume=True, on_skip=quiet)
    assert not out.exists()
    compile_folder(src, out, size=12, workers=1, resume=True, on_skip=quiet)
    assert file_bytes(out) == reference(src, tmp_path, size=12)


# 3: a full disk while decoding: a CompileError, the lock released, a resume in the same process works.
def test_a_disk_filling_up_while_decoding_keeps_the_cause_and_releases_the_lock(tmp_path: Path) -> None:
    many = make_folder(tmp_path / "src", per_class=80, sides=(16, 24))
    with tmpfs(tmp_path / "disk", "4m") as disk:
        out = disk / "out"

        def fill_disk_once(n: int) -> None:
            if not (disk / "filler").exists():
                fill_up(disk / "filler")

        with pytest.raises(CompileError, match="No space left on device.*--resume"):
            compile_folder(many, out, size=8, workers=1, progress=fill_disk_once)
        (disk / "filler").unlink()
        compile_folder(many, out, size=8, workers=1, resume=True)
        assert file_bytes(out) == reference(many, tmp_path, size=8)


# 4: a stop after compaction reuses every decoded record.
def test_a_kill_after_compaction_reuses_every_decoded_record(src: Path, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    killed_compile(lambda: setattr(output, "shard_digests", lambda *a, **k: die()), src, out, size=8, workers=1,
                   records_per_shard=7)  # where the compacted shards are hashed
    decoded = []
    real_fill = LocalEngine.fill
    monkeypatch.setattr(LocalEngine, "fill", lambda self, job, chunks, on_results: real_fill(
        self, job, [decoded.extend(c) or c for c in chunks], on_results))
    compile_folder(src, out, size=8, workers=1, records_per_shard=7, resume=True, on_skip=quiet)
    assert sorted(Path(s).name for _, s in decoded) == ["bad_0.jpg", "bad_1.jpg"]  # only the skipped, again
    assert file_bytes(out) == reference(src, tmp_path, size=8, records_per_shard=7)


# 6: one way out of every stop; stray files, a mount point, a touched source.
def test_a_disk_full_at_the_start_has_one_way_out(src: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "1m") as disk:
        out = disk / "out"
        fill_up(disk / "filler")
        with pytest.raises(CompileError, match="No space left on device"):
            compile_folder(src, out, size=8, workers=1, on_skip=quiet)
        (disk / "filler").unlink()
        with pytest.raises(CompileError, match="with --resume to continue"):
            compile_folder(src, out, size=8, workers=1, on_skip=quiet)
        compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)
        assert file_bytes(out) == reference(src, tmp_path, size=8)


def _interrupted(src: Path, out: Path, **options) -> None:
    """A compile stopped by Ctrl-C after its first chunk of records."""
    def ctrl_c(n: int) -> None:
        if n:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_folder(src, out, size=8, workers=1, progress=ctrl_c, on_skip=quiet, **options)


def test_stray_files_in_the_partial_shards_do_not_break_a_resume(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _interrupted(src, out)
    for name in ("notes.bin", "._00000.bin"):
        (staging_path(out) / fmt.SHARD_DIR / name).write_bytes(b"not ours")
    summary = compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)
    assert summary.kept == 60 and storage.open_dataset(out).manifest.count == 60


def test_an_out_that_is_a_mount_point_is_refused_up_front(src: Path, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "out", "1m") as out:
        with pytest.raises(CompileError, match="mount point"):
            compile_folder(src, out, size=8, workers=1, force=True, on_skip=quiet)
        assert not staging_path(out).exists() and not any(out.iterdir())


def _touch_a_source(src: Path, out: Path) -> None:
    os.utime(src / "class_1" / "img_2.jpg", ns=(1, 1))


def _plan_from_another_decoder(src: Path, out: Path) -> None:
    import json

    plan_file = staging_path(out) / "plan.json"
    plan_file.write_text(json.dumps({**json.loads(plan_file.read_text()), "decoder": "another decoder"}))


@pytest.mark.parametrize(("change", "message"), [
    (_touch_a_source,  # the source is named, with its sizes and times
     r"the sources changed since it began \(1 modified, e\.g\. 'class_1/img_2\.jpg' \([\d,]+ bytes, modified "
     r"20\d\d-\d\d-\d\d [\d:]+ then, [\d,]+ bytes, modified 1970-01-01 [\d:]+ now\)\)"),
    (_plan_from_another_decoder,  # no option of the user's differs, so none is named
     r"it was begun by another dsc or decoder \(decoder 'another decoder' \(now '.+'\)\), and a resume would mix "
     r"records made two ways; pass --force to start over$"),
])
def test_a_refused_resume_names_what_changed(src: Path, tmp_path: Path, change, message: str) -> None:
    out = tmp_path / "out"
    _interrupted(src, out)
    change(src, out)
    with pytest.raises(CompileError, match=message):
        compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)


# 7: journal lines protect the sizes; no resume file is ever published.
def test_an_edited_size_in_the_journal_is_decoded_again(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _interrupted(src, out)
    journal = staging_path(out) / "journal.jsonl"
    lines = journal.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if '"h"' in line)
    entry = json.loads(lines[first])
    entry["h"] += 1
    lines[first] = json.dumps(entry)
    journal.write_text("\n".join(lines) + "\n")
    compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)
    assert file_bytes(out) == reference(src, tmp_path, size=8)


def test_a_kill_while_removing_the_resume_files_publishes_none_of_them(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"

    def kill_after_unlinking_the_plan() -> None:
        real_unlink = Path.unlink

        def unlink(self: Path, missing_ok: bool = False) -> None:
            real_unlink(self, missing_ok=missing_ok)
            if self.name == "plan.json":
                die()
        Path.unlink = unlink

    killed_compile(kill_after_unlinking_the_plan, src, out, size=8, workers=1)
    compile_folder(src, out, size=8, workers=1, resume=True, on_skip=quiet)
    assert file_bytes(out) == reference(src, tmp_path, size=8)


# 5: --strict fails on every skip, wherever it is found.
@pytest.mark.parametrize("bad", ["broken symlink", "fifo", "outside a class folder"])
def test_strict_fails_on_bad_input_found_while_scanning(src: Path, tmp_path: Path, bad: str) -> None:
    where = src / "class_0" / "odd.jpg"
    if bad == "broken symlink":
        where.symlink_to(tmp_path / "nowhere.jpg")
    elif bad == "fifo":
        os.mkfifo(where)
    else:
        save(src / "loose.png", pattern(20, 20), "PNG")
    for path in src.rglob("bad_*.jpg"):
        path.unlink()
    with pytest.raises(CompileError, match="--strict"):
        compile_folder(src, tmp_path / "out", size=8, workers=1, strict=True, on_skip=quiet)
    assert not (tmp_path / "out").exists() and not staging_path(tmp_path / "out").exists()
