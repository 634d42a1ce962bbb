"""`--engine ray` on a real local Ray cluster with the bucket of a real S3 server on 127.0.0.1 (moto): an
image folder of objects compiled into the bucket by Ray tasks (each GETs its own sources, PUTs its own
chunk objects) to the local engine's bytes; a Ray worker killed (-9) in the middle of a bucket build is
retried, the dataset is the clean build's, and no reader ever sees part of it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from stopping import chunk_task_workers

from dsc import compile_folder, storage
from dsc import format as fmt
from dsc.errors import DatasetError
from dsc.storage.bucket import Bucket

from conftest import make_folder, pattern, save
from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)
from test_compile_s3 import assert_same_as  # isort: skip

ray = pytest.importorskip("ray")
BUCKET = "dsc-ray-buckets"
KILL_WAIT_S = 120  # the killer gives up (and the test fails: nothing was killed) after this long
server = serving(BUCKET)
PROXY: list[FaultProxy] = []  # the module's proxy in front of the server (made with the cluster)
_prefixes = iter(range(1 << 30))


@pytest.fixture(scope="module", autouse=True)
def cluster(server: S3Server, tmp_path_factory):
    """One local Ray instance of 2 CPUs, started with the environment that points at the loopback server
    (its workers inherit it), joined by every compile of the module."""
    saved = {name: os.environ.get(name) for name in [*server.env, "AWS_ENDPOINT_URL_S3", "DSC_CACHE_DIR"]}
    os.environ.update(server.env)
    PROXY.append(FaultProxy(server.endpoint))  # every request of the module's compiles and workers goes through it
    os.environ["AWS_ENDPOINT_URL"] = PROXY[0].endpoint
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    os.environ["DSC_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()
    PROXY.pop().kill()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def quiet(**options) -> dict:
    return {"size": 32, "records_per_shard": 6, "seed": 3, "on_skip": lambda source, reason: None, **options}


def files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != fmt.MANIFEST_FILE}


def upload(server: S3Server, folder: Path) -> str:
    prefix = f"trees/t{next(_prefixes)}"
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        server.put(BUCKET, f"{prefix}/{path.relative_to(folder).as_posix()}", path.read_bytes())
    return f"s3://{BUCKET}/{prefix}"


def test_ray_compiles_an_image_folder_in_the_bucket_into_the_bucket(server: S3Server, tmp_path: Path,
                                                                    monkeypatch) -> None:
    src = make_folder(tmp_path / "src", classes=3, per_class=6, seed=8)
    (src / "class_1" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    url = upload(server, src)
    compile_folder(url, tmp_path / "reference", workers=1, **quiet())  # the local engine, into a folder
    local = tmp_path / "from-folder"
    compile_folder(src, local, workers=1, **quiet())
    assert files(tmp_path / "reference") == files(local)  # (the manifests differ: one names the URL as SRC)
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    out = f"s3://{BUCKET}/out/r{next(_prefixes)}"
    summary = compile_folder(url, out, engine="ray", **quiet())
    assert summary.kept == 18 and [s for s, _ in summary.skipped] == ["class_1/bad.jpg"]
    assert list(work.iterdir()) == []
    assert_same_as(tmp_path / "reference", out)


HOLDS = {"decode": "/work/chunks/", "assemble": "/shards/"}  # PUTs of each phase: a chunk object, a shard
HOLD_S = 0.5  # the held PUT reaches the server this long after the proxy got it: after the kill


def _kill_workers_holding_a_put(stop: threading.Event, proxy: FaultProxy, match: str, url: str,
                                killed: list[int], seen: list[str]) -> None:
    """Once the proxy holds a task's PUT whose path has `match`, kill -9 every Ray worker of this cluster that
    runs a dsc task (one of them sent it: it dies with its work in hand); then note what a reader opening
    `url` sees at that moment."""
    deadline, earlier = time.monotonic() + KILL_WAIT_S, proxy.count("PUT", match)  # (the module's earlier tests')
    while not stop.is_set() and not killed and time.monotonic() < deadline:
        workers = chunk_task_workers(os.getpid()) if proxy.count("PUT", match) > earlier else []
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        if workers:
            try:
                storage.open_dataset(url)
                seen.append("a dataset")
            except DatasetError as e:
                seen.append(str(e))
        time.sleep(0.002)


@pytest.mark.parametrize("where, phase", [("folder", "decode"), ("bucket", "decode"), ("folder", "assemble")])
def test_a_ray_worker_killed_during_a_bucket_build_is_retried_and_nothing_partial_shows(
        server: S3Server, tmp_path: Path, where: str, phase: str) -> None:
    """SRC a folder or a tree in the bucket, OUT a prefix: kill -9 of the workers running tasks while one's PUT
    (of a chunk object, or of an assembled shard) is in flight. Ray runs the tasks again; the dataset committed
    is the clean build's, byte for byte; at the kill a reader found no dataset, and once the held PUT has
    landed nothing but the committed build is left in the prefix."""
    src = tmp_path / "src"
    for i in range(48):
        save(src / f"c{i % 2}" / f"{i}.png", pattern(300, 400, seed=i % 5), "PNG", compress_level=1)
    source = str(src) if where == "folder" else upload(server, src)
    compile_folder(source, tmp_path / "clean", workers=2, **quiet())
    out = f"s3://{BUCKET}/out/k{next(_prefixes)}"
    proxy = PROXY[0]
    proxy.clear()
    proxy.delay(HOLD_S, 1, match=HOLDS[phase], method="PUT")
    stop, killed, seen = threading.Event(), [], []
    killer = threading.Thread(target=_kill_workers_holding_a_put, args=(stop, proxy, HOLDS[phase], out, killed, seen),
                              daemon=True)
    killer.start()
    try:
        summary = compile_folder(source, out, engine="ray", **quiet())
    finally:
        stop.set()
        killer.join(timeout=10)
        proxy.settle()  # the held PUT lands now, as one in flight at a kill does
    assert killed, "no task was running to be killed: the test proved nothing"
    assert len(seen) == 1 and "no manifest.json" in seen[0], seen
    assert summary.kept == 48
    manifest = assert_same_as(tmp_path / "clean", out)
    tag = manifest.shards[0].file.split("/")[1]
    left = {i.name for i in Bucket(out).list()}
    assert {name.split("/")[0] for name in left} == {fmt.MANIFEST_FILE, fmt.VERSIONS_DIR, fmt.BUILDS_DIR}
    assert {name.split("/")[1] for name in left if name.startswith(fmt.BUILDS_DIR)} == {tag}
    assert not any("/work/" in name for name in left), sorted(left)
