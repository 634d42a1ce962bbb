"""`--engine ray` on a real local Ray cluster: identical bytes, and a killed worker is retried."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
from stopping import chunk_task_workers
from typer.testing import CliRunner

from dsc import CompileError, compile_folder, storage
from dsc.cli import app
from dsc.compiler.jobs import MAX_CHUNK

from archives import write_parquet, write_tar_shards, write_zip
from conftest import make_folder, pattern, save


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """One local Ray instance of 2 CPUs for the module (compile_folder joins it)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


def file_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_ray_output_is_byte_identical_to_the_local_engine(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=3, per_class=6)
    (src / "class_1" / "bad.jpg").write_bytes(b"nope")
    quiet = {"on_skip": lambda s, r: None, "size": (20, 24), "records_per_shard": 4}
    compile_folder(src, tmp_path / "local", workers=2, **quiet)
    summary = compile_folder(src, tmp_path / "ray", engine="ray", **quiet)
    assert summary.kept == 18 and summary.shards == 5 and len(summary.skipped) == 1
    assert file_bytes(tmp_path / "ray") == file_bytes(tmp_path / "local")


def test_ray_compiles_archives_to_the_local_engines_bytes(tmp_path: Path) -> None:
    """Archive chunks (a run of tar or zip members, a Parquet row group) travel to Ray tasks as they are."""
    src = make_folder(tmp_path / "src", classes=3, per_class=6)
    quiet = {"on_skip": lambda s, r: None, "size": (20, 24), "records_per_shard": 4}
    for archive in (write_tar_shards(src, tmp_path / "shards", per_shard=5), write_zip(src, tmp_path / "src.zip"),
                    write_parquet(src, tmp_path / "src.parquet", rows_per_group=4)):
        name = Path(archive).suffix
        compile_folder(archive, tmp_path / f"local{name}", workers=2, **quiet)
        summary = compile_folder(archive, tmp_path / f"ray{name}", engine="ray", **quiet)
        assert summary.kept == 18 and file_bytes(tmp_path / f"ray{name}") == file_bytes(tmp_path / f"local{name}")


def test_ray_splits_one_shard_into_many_bounded_tasks_with_identical_bytes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(2000):  # one shard at the default 1 GiB: a task per shard would be one task
        save(src / f"c{i % 4}" / f"{i:04d}.png", pattern(6, 7, seed=i % 11), "PNG")
    (src / "c1" / "junk.jpg").write_bytes(b"no image")
    quiet = {"on_skip": lambda s, r: None, "size": 8}
    compile_folder(src, tmp_path / "local", workers=2, **quiet)
    tasks: list[int] = []  # the Ray engine reports each finished task's results at once
    summary = compile_folder(src, tmp_path / "ray", engine="ray", progress=tasks.append, **quiet)
    tasks = [n for n in tasks if n]  # (a resume first reports the records it reuses: none here)
    assert summary.shards == 1 and sum(tasks) == 2001
    assert len(tasks) >= 16 * 2, f"{len(tasks)} tasks for 2 CPUs"  # no long tail on one slow task
    assert max(tasks) <= MAX_CHUNK
    assert file_bytes(tmp_path / "ray") == file_bytes(tmp_path / "local")


def _kill_first_task_worker(stop: threading.Event, killed: list[int]) -> None:
    """Kill -9 the first Ray worker of this test seen running a dsc chunk task, once."""
    while not stop.is_set() and not killed:
        found = chunk_task_workers(os.getpid())
        if found:
            os.kill(found[0], signal.SIGKILL)
            killed.append(found[0])
        time.sleep(0.002)


def test_a_killed_ray_worker_is_retried_and_the_bytes_do_not_change(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for i in range(48):
        save(src / f"c{i % 2}" / f"{i}.png", pattern(300, 400, seed=i % 5), "PNG", compress_level=1)
    options = {"size": 32, "records_per_shard": 6, "on_skip": lambda s, r: None}
    compile_folder(src, tmp_path / "local", workers=2, **options)
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_first_task_worker, args=(stop, killed), daemon=True)
    killer.start()
    try:
        compile_folder(src, tmp_path / "ray", engine="ray", **options)
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "no task was running to be killed: the test proved nothing"
    assert file_bytes(tmp_path / "ray") == file_bytes(tmp_path / "local")


def test_the_cli_runs_the_ray_engine_and_checks_its_options(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=2, per_class=3)
    runner = CliRunner(env={"COLUMNS": "250", "NO_COLOR": "1"})
    ran = runner.invoke(app, ["compile", str(src), str(tmp_path / "out"), "--engine", "ray", "--size", "16"])
    assert ran.exit_code == 0, ran.stderr
    assert storage.open_dataset(tmp_path / "out").manifest.count == 6
    wrong = runner.invoke(app, ["compile", str(src), str(tmp_path / "o2"), "--address", "127.0.0.1:1"])
    assert wrong.exit_code == 2 and "Invalid value for --address: only with --engine ray" in wrong.stderr
    with pytest.raises(CompileError, match="an address is only for --engine ray"):  # the library says so too
        compile_folder(src, tmp_path / "o2", address="127.0.0.1:1")
    with pytest.raises(CompileError, match="unknown engine 'spark'"):
        compile_folder(src, tmp_path / "o3", engine="spark")


def test_an_unreachable_cluster_fails_fast_and_leaves_nothing(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=2, per_class=2)
    started = time.monotonic()
    with pytest.raises(CompileError, match="cannot reach the Ray cluster at 127.0.0.1:1"):
        compile_folder(src, tmp_path / "out", engine="ray", address="127.0.0.1:1")
    assert time.monotonic() - started < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no partial build to explain


def test_ray_carries_label_table_fields_byte_identically(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=2, per_class=4)
    names = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    table = tmp_path / "labels.csv"
    table.write_text("path,label,tags,score\n" + "".join(f"{n},{n.split('/')[0]},{'a;b' if k % 2 else 'b'},{k / 3}\n"
                                                         for k, n in enumerate(names)))
    options = {"size": (12, 16), "records_per_shard": 3, "labels": table}
    compile_folder(src, tmp_path / "local", workers=2, **options)
    compile_folder(src, tmp_path / "ray", engine="ray", **options)
    local, by_ray = file_bytes(tmp_path / "local"), file_bytes(tmp_path / "ray")
    assert {"fields/tags.bin", "fields/score.bin"} <= set(local) and local == by_ray
