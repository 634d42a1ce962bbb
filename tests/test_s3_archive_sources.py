"""Archive sources in a bucket (issue 24): tar shards, a Parquet file and a zip written by the real tools
(tests/archives.py), uploaded to a real S3 server on 127.0.0.1 (moto), compile from their `s3://` URLs
to the same bytes as from the local copies, read by ranged GETs; a missing object or prefix, an
archive truncated in the bucket and a dead endpoint are what they are locally: one clear line, the
same skips, a bounded error."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsc import CompileError, compile_folder, storage
from dsc.cli import app
from dsc.compiler.publish import staging_path

from archives import write_parquet, write_tar_shards, write_zip
from s3server import S3Server, closed_port, serving  # skips this module when the server packages are missing

BUCKET = "dsc-archives"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "images"
CLASSES = sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir())
SIZE = 32
RUN_S = 300  # a compile in a child process that hangs fails the test instead
runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})

server = serving(BUCKET)


def quiet(**options):
    return {"size": SIZE, "workers": 1, "on_skip": lambda source, reason: None, **options}


def files(out: Path) -> dict[str, bytes]:
    """Every file of a dataset but its manifest (which records where the sources were)."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def skips(out: Path) -> dict[str, str]:
    return {s["source"]: s["reason"] for s in storage.read_skipped(out, storage.parse_manifest(out))}


def sources(out: Path) -> list[str]:
    ds = storage.open_dataset(out)
    return [ds.source(i) for i in range(ds.manifest.count)]


@pytest.fixture
def env(server: S3Server, monkeypatch) -> dict[str, str]:
    """The AWS environment pointing at the loopback server (also for child processes)."""
    server.point_at(monkeypatch)
    return {**os.environ}


@pytest.fixture(scope="module")
def made(server: S3Server, tmp_path_factory) -> dict:
    """The photos as tar shards, a Parquet file and a zip, each uploaded; {kind: (local SRC, s3 SRC)}."""
    root = tmp_path_factory.mktemp("s3-archives")
    folder = root / "images"
    shutil.copytree(EXAMPLES, folder)
    shards = write_tar_shards(folder, root / "shards", per_shard=7)
    parquet = write_parquet(folder, root / "train.parquet", rows_per_group=6)
    archive = write_zip(folder, root / "photos.zip")
    for path in sorted((root / "shards").iterdir()) + [parquet, archive]:
        server.put(BUCKET, f"in/{path.relative_to(root).as_posix()}", path.read_bytes())
    sizes = {"tar": sum(p.stat().st_size for p in (root / "shards").iterdir()), "parquet": parquet.stat().st_size,
             "zip": archive.stat().st_size}
    return {"root": root, "bytes": sizes, "tar": (shards, f"s3://{BUCKET}/in/shards/train-{{000000..000002}}.tar"),
            "parquet": (str(parquet), f"s3://{BUCKET}/in/train.parquet"),
            "zip": (str(archive), f"s3://{BUCKET}/in/photos.zip")}


@pytest.mark.parametrize("kind", ["tar", "parquet", "zip"])
def test_each_archive_in_a_bucket_compiles_to_the_local_archives_bytes(made: dict, env, kind: str,
                                                                        tmp_path: Path) -> None:
    local, url = made[kind]
    options = {"classes": CLASSES} if kind == "tar" else {}
    compile_folder(local, tmp_path / "local", **quiet(**options))
    summary = compile_folder(url, tmp_path / "remote", **quiet(**options))
    assert summary.kept == 20
    assert files(tmp_path / "remote") == files(tmp_path / "local")
    assert sources(tmp_path / "remote") == sources(tmp_path / "local")
    assert all("#" in s and not s.startswith(("s3:", "/")) for s in sources(tmp_path / "remote"))
    root = storage.open_dataset(tmp_path / "remote").manifest.compile["source_root"]
    assert root == url.rsplit("/", 1)[0]


def test_a_prefix_a_glob_and_a_brace_pattern_name_the_same_shards(made: dict, env, tmp_path: Path) -> None:
    base = f"s3://{BUCKET}/in/shards"
    outs = []
    for k, src in enumerate([base, base + "/", base + "/train-*.tar", base + "/train-{000000..000002}.tar"]):
        compile_folder(src, tmp_path / f"out{k}", **quiet(classes=CLASSES))
        outs.append(files(tmp_path / f"out{k}"))
    assert all(out == outs[0] for out in outs)


def test_the_cli_with_workers_reads_the_bucket_from_its_worker_processes(made: dict, env, tmp_path: Path) -> None:
    """In a fresh process (obstore's runtime does not survive fork): the driver lists, forked workers read."""
    local, url = made["tar"]
    compile_folder(local, tmp_path / "local", **quiet(classes=CLASSES))
    out = tmp_path / "remote"
    result = subprocess.run([sys.executable, "-m", "dsc", "compile", url, str(out), "--size", str(SIZE), "-j", "2",
                             "--classes", ",".join(CLASSES)], capture_output=True, text=True, timeout=RUN_S, env=env)
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "20 records" in result.stdout
    assert files(out) == files(tmp_path / "local")


def test_a_second_compile_in_one_process_starts_its_workers_afresh(made: dict, env, tmp_path: Path) -> None:
    """This process has used the S3 client (its runtime does not survive fork): the engine's host is
    spawned, not forked, so its workers can read the bucket."""
    from dsc.storage.object_file import ObjectFile

    local, url = made["parquet"]
    ObjectFile(url).close()
    compile_folder(local, tmp_path / "local", **quiet())
    compile_folder(url, tmp_path / "remote", **quiet(workers=2))
    assert files(tmp_path / "remote") == files(tmp_path / "local")


def test_verify_decode_reads_the_members_again_from_the_bucket(made: dict, env, tmp_path: Path) -> None:
    compile_folder(made["zip"][1], tmp_path / "out", **quiet())
    result = runner.invoke(app, ["verify", str(tmp_path / "out"), "--decode", "20"])
    assert result.exit_code == 0, result.stderr
    assert "decoded 20 record(s) again" in result.stdout and ": max 0, mean 0.000" in result.stdout


def test_missing_objects_and_prefixes_are_one_clear_line(made: dict, server: S3Server, env, tmp_path: Path) -> None:
    cases = {f"s3://{BUCKET}/in/gone.tar": f"error: source s3://{BUCKET}/in/gone.tar does not exist",
             f"s3://{BUCKET}/nothing-here": "holds no objects at all: is the prefix right?",
             f"s3://{BUCKET}/in/shards/train-{{000000..000009}}.tar": "7 of the 10 objects the pattern",
             f"s3://{BUCKET}/in/shards/*.zip": "names no objects",
             f"s3://{BUCKET}/notes": f"no images found in s3://{BUCKET}/notes"}  # no archives: an image folder
    server.put(BUCKET, "notes/readme.txt", b"not an archive")
    for src, says in cases.items():
        result = runner.invoke(app, ["compile", src, str(tmp_path / "out")])
        assert result.exit_code == 1, (src, result.stdout, result.stderr)
        assert says in result.stderr and "Traceback" not in result.stderr, (src, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()


def truncated(server: S3Server, local: Path, cut: float, folder: Path) -> tuple[Path, str]:
    """The archive cut to `cut` of its size, written locally and to the bucket; (path, URL)."""
    data = local.read_bytes()[:int(local.stat().st_size * cut)]
    folder.mkdir()
    (folder / local.name).write_bytes(data)
    server.put(BUCKET, f"cut/{folder.name}/{local.name}", data)
    return folder / local.name, f"s3://{BUCKET}/cut/{folder.name}/{local.name}"


def test_a_shard_truncated_in_the_bucket_gives_the_local_skips(made: dict, server: S3Server, env,
                                                               tmp_path: Path) -> None:
    path, url = truncated(server, Path(made["tar"][0].replace("{000000..000002}", "000001")), 0.6, tmp_path / "tar")
    compile_folder(path, tmp_path / "local", **quiet(classes=CLASSES))
    compile_folder(url, tmp_path / "remote", **quiet(classes=CLASSES))
    assert skips(tmp_path / "remote") == skips(tmp_path / "local")
    assert "truncated" in skips(tmp_path / "local")["train-000001.tar"]
    assert files(tmp_path / "remote") == files(tmp_path / "local")


@pytest.mark.parametrize("kind, says", [("zip", "not a readable zip archive"), ("parquet", "not a readable Parquet")])
def test_a_zip_or_parquet_cut_short_in_the_bucket_is_refused_as_locally(made: dict, server: S3Server, env, kind: str,
                                                                        says: str, tmp_path: Path) -> None:
    path, url = truncated(server, Path(made[kind][0]), 0.9, tmp_path / kind)  # its directory or footer is gone
    errors = []
    for src in (path, url):
        with pytest.raises(CompileError, match=f"no images found in {src} .*{says}") as caught:
            compile_folder(src, tmp_path / "out", **quiet())
        errors.append(str(caught.value).replace(str(src), "SRC"))
    assert errors[0] == errors[1]


def test_a_dead_endpoint_is_a_bounded_clear_error(made: dict, env, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    result = runner.invoke(app, ["compile", made["tar"][1], str(tmp_path / "out")])
    assert time.monotonic() - started < 60
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert "LIST failed 4 times" in result.stderr and "connection refused" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_an_object_file_reads_ranges_within_its_window(made: dict, env) -> None:
    from dsc.storage.object_file import ObjectFile

    local, url = made["zip"]
    data = Path(local).read_bytes()
    with ObjectFile(url, read_ahead=4096) as f:
        assert f.size == len(data)
        assert f.pread(100, 5000) == data[5000:5100] and f._window_start == 5000 and len(f._window) == 4096
        assert f.pread(10, len(data) - 4) == data[-4:]
        assert f.pread(10_000, 10) == data[10:10_010] and len(f._window) <= 4096  # a large read bypasses it
        f.seek(-7, os.SEEK_END)
        assert f.read() == data[-7:] and f.read(3) == b""


@pytest.fixture(scope="module")
def big(server: S3Server, tmp_path_factory) -> dict:
    """120 PNGs of 400x500 (~14 MB) as tar shards, a zip and a Parquet file, uploaded; their sizes."""
    from dsc.testing import make_image_folder

    root = tmp_path_factory.mktemp("s3-big")
    make_image_folder(root / "src", classes=3, per_class=40, size=(400, 500), formats=("png",))
    pattern = write_tar_shards(root / "src", root / "shards", per_shard=25)
    made = [*sorted((root / "shards").iterdir()), write_zip(root / "src", root / "big.zip"),
            write_parquet(root / "src", root / "big.parquet", rows_per_group=20)]
    for path in made:
        server.put(BUCKET, f"big/{path.name}", path.read_bytes())
    return {"pattern": pattern, "tar": f"s3://{BUCKET}/big/{Path(pattern).name}", "zip": f"s3://{BUCKET}/big/big.zip",
            "parquet": f"s3://{BUCKET}/big/big.parquet",
            "bytes": {"tar": sum(p.stat().st_size for p in made[:-2]), "zip": made[-2].stat().st_size,
                      "parquet": made[-1].stat().st_size}}


@pytest.mark.parametrize("kind, times", [("tar", 2.0), ("zip", 1.25), ("parquet", 1.25)])
def test_a_compile_reads_each_archive_by_ranges_not_again_and_again(big: dict, env, monkeypatch, kind: str,
                                                                      times: float, tmp_path: Path) -> None:
    """Bytes fetched, against the archives' size: a tar is walked once at discovery (its headers are
    between the members) and read once by the workers; a zip or Parquet file once, plus its directory
    or footer again at each open. A read-ahead running past a chunk's last member would fetch more."""
    from dsc.storage.object_file import ObjectFile

    fetched = []
    get = ObjectFile._get
    monkeypatch.setattr(ObjectFile, "_get", lambda self, start, stop: fetched.append(stop - start) or get(self, start,
                                                                                                           stop))
    compile_folder(big[kind], tmp_path / "out", **quiet())  # chunks of 16 members, 8 MiB read-ahead
    assert 0 < sum(fetched) <= times * big["bytes"][kind], (sum(fetched), big["bytes"][kind])


def test_a_killed_compile_from_the_bucket_resumes_to_identical_bytes(big: dict, env, tmp_path: Path) -> None:
    compile_folder(big["pattern"], tmp_path / "whole", size=64, workers=1, records_per_shard=16)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dsc", "compile", big["tar"], str(out), "--size", "64", "-j", "2",
               "--records-per-shard", "16"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    journal, deadline = staging_path(out) / "journal.jsonl", time.monotonic() + RUN_S
    while (not journal.exists() or journal.read_bytes().count(b"\n") < 30) and proc.poll() is None:
        assert time.monotonic() < deadline, "the compile never got that far"
        time.sleep(0.005)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    if not out.exists():  # else it finished first
        result = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=RUN_S, env=env)
        assert result.returncode == 0, result.stderr
        assert "resumed" in result.stderr
    assert files(out) == files(tmp_path / "whole")


def test_column_fields_from_a_bucket_are_the_local_archives_fields(made: dict, server: S3Server, env,
                                                                   tmp_path: Path) -> None:
    """`--column` reads a tar member and a Parquet column by the same ranged GETs: the same field bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = made["root"] / "images"
    photos = [f for c in CLASSES for f in sorted((folder / c).iterdir())]
    rank = {f.name: k for k, f in enumerate(photos)}
    shards = write_tar_shards(folder, tmp_path / "shards", per_shard=7, extra=lambda c, f: {"txt": str(rank[f.name])})
    pq.write_table(pa.table({"jpeg": pa.array([f.read_bytes() for f in photos], pa.binary()),
                             "score": [k / 8 for k in range(len(photos))]}), tmp_path / "t.parquet", row_group_size=6)
    for path in sorted((tmp_path / "shards").iterdir()) + [tmp_path / "t.parquet"]:
        server.put(BUCKET, f"fields/{path.relative_to(tmp_path).as_posix()}", path.read_bytes())
    for local, url, options in ((shards, f"s3://{BUCKET}/fields/shards/", {"columns": {"txt": "int"}}),
                                (str(tmp_path / "t.parquet"), f"s3://{BUCKET}/fields/t.parquet",
                                 {"columns": {"score": "float"}, "image_column": "jpeg"})):
        name = next(iter(options["columns"]))
        compile_folder(local, tmp_path / f"local-{name}", **quiet(**options))
        compile_folder(url, tmp_path / f"remote-{name}", **quiet(**options))
        local_files = files(tmp_path / f"local-{name}")
        assert f"fields/{name}.bin" in local_files and files(tmp_path / f"remote-{name}") == local_files
