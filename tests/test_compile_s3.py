"""`dsc compile SRC s3://bucket/prefix` against a real S3 server on 127.0.0.1 (moto): no local OUT at all,
every object byte-identical to the folder compile's file, the commit create-only, kill -9 of the driver at
random moments and inside the commit (a reader between kills sees nothing, the old dataset or the new
one, whole), a worker killed, tasks run twice, --force while a reader keeps reading the old dataset."""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dsc import compile_folder
from dsc import format as fmt
from dsc.compiler import bucket_build, bucket_versions, pipeline, write
from dsc.compiler.engines import local as local_engine
from dsc.compiler.engines.local import LocalEngine
from dsc.compiler.jobs import WriteJob
from dsc.errors import CompileError, DatasetError, Interrupted
from dsc.storage import open_dataset
from dsc.storage.bucket import Bucket

from archives import write_tar_shards
from conftest import make_folder, save
from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)

BUCKET = "dsc-compile-tests"
OPTIONS = {"size": 24, "records_per_shard": 5, "seed": 3}
KILLS = 20  # the issue asks for at least 20 kills of the driver, some inside the commit
RUN_S = 120  # one compile, killed or not, ends within this
server = serving(BUCKET)
_prefixes = iter(range(1 << 30))


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """27 real images (JPEG, PNG) in 3 classes, one of them damaged: records after it move down."""
    root = make_folder(tmp_path_factory.mktemp("s3c") / "src", classes=3, per_class=9, seed=7)
    (root / "class_1" / "img_2.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    return root


@pytest.fixture(scope="module")
def reference(src: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("s3c-local") / "ds"
    compile_folder(src, out, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    return out


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> dict[str, str]:
    server.point_at(monkeypatch)
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    return {**server.env, "DSC_CACHE_DIR": str(tmp_path / "cache")}


@pytest.fixture
def url(env) -> str:
    return f"s3://{BUCKET}/sets/c{next(_prefixes)}"


@contextlib.contextmanager
def _through(proxy: FaultProxy, env: dict[str, str], monkeypatch) -> Iterator[None]:
    """This process's requests go through `proxy` (a relay on 127.0.0.1 that counts them and injects faults)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        yield
    finally:
        proxy.kill()
        monkeypatch.setenv("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])


def assert_same_as(reference: Path, url: str) -> fmt.Manifest:
    """Every file of the folder compile (but its manifest) is an object of identical bytes under the build's
    folder; the manifests differ only there; nothing else is left in the prefix."""
    bucket = Bucket(url)
    manifest = fmt.parse_manifest(bucket.get(fmt.MANIFEST_FILE)[0], url, lambda n, w: bucket.head(n).size,
                                  lambda n, limit: bucket.get(n)[0][:limit])
    tag = manifest.shards[0].file.split("/")[1]
    base = f"{fmt.build_folder(tag)}/"
    files = {p.relative_to(reference).as_posix(): p.read_bytes() for p in reference.rglob("*") if p.is_file()}
    local = files.pop(fmt.MANIFEST_FILE)
    version = max(int(i.name[9:17]) for i in bucket.list(fmt.VERSIONS_DIR))
    assert sorted(i.name for i in bucket.list(fmt.build_folder(tag))) == sorted(base + n for n in files)
    for name, data in files.items():
        assert bucket.get(base + name)[0] == data, name
    text = bucket.get(fmt.MANIFEST_FILE)[0]
    assert bucket.get(fmt.version_file(version))[0] == text
    doc, ours = json.loads(text), json.loads(local)
    assert doc.pop("dataset_version", 1) == version
    for d in (doc, ours):
        d.pop("manifest_sha256")
    assert json.loads(json.dumps(doc).replace(base, "")) == ours
    return manifest


def test_the_local_engine_writes_the_folder_compiles_bytes_and_commits_version_1(src: Path, reference: Path,
                                                                                  url: str, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a URL folded into a path would make a folder "s3:" here
    summary = compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    assert list(tmp_path.iterdir()) == []
    assert (summary.out, summary.kept, len(summary.skipped)) == (url, 26, 1)
    assert_same_as(reference, url)
    assert [i.name for i in Bucket(url).list(fmt.VERSIONS_DIR)] == [fmt.version_file(1)]
    data = open_dataset(url)
    assert np.array_equal(data.read_records(range(26)), open_dataset(reference).read_records(range(26)))
    with pytest.raises(CompileError, match=r"already exists; pass --force to replace it \(readers that opened it "
                                           r"keep reading it\)$"):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    with pytest.raises(CompileError, match=r"\(--resume found no partial build of it to continue: an earlier run "
                                           rf"may have finished before it was stopped; dsc info {url} shows"):
        compile_folder(src, url, workers=1, resume=True, on_skip=lambda s, r: None, **OPTIONS)


def test_the_cli_with_two_workers_leaves_no_local_output(src: Path, reference: Path, url: str, env,
                                                         tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "dsc", "compile", str(src), url, "-j", "2", "--size", "24",
                          "--records-per-shard", "5", "--seed", "3"], cwd=tmp_path, env={**os.environ, **env},
                         capture_output=True, text=True, timeout=RUN_S)
    assert run.returncode == 0, run.stderr
    assert f"wrote {url}: 26 records" in run.stdout
    assert not (tmp_path / "s3:").exists()
    assert_same_as(reference, url)


INTERRUPTED = {  # where a Ctrl-C lands (the request the driver or a worker is in), and what the compile then says
    "build": (("PUT", "/work/chunks/"), r"interrupted; nothing was committed to {url}, which holds what it held "
              r"before; the work so far is kept in {url}/builds/[0-9a-f]+/: add --resume to continue"),
    "commit": (("PUT", "/versions/"), r"interrupted while committing {url}: it holds what it held before or the new "
               r"dataset, never a mix: add --resume to finish"),
    "clean-up": (("POST", "?delete"), r"interrupted after {url} committed the new dataset \(version 1\); the "
                 r"clean-up of its work objects in {url}/builds/[0-9a-f]+/ was cut short: the next compile, append "
                 r"or prune deletes them"),
}


@pytest.mark.parametrize("stage", INTERRUPTED)
def test_a_ctrl_c_says_truly_what_it_left_and_the_resume_finishes(src: Path, reference: Path, url: str, env,
                                                                  server: S3Server, tmp_path: Path,
                                                                  stage: str) -> None:
    (method, path), says = INTERRUPTED[stage]
    proxy = FaultProxy(server.endpoint)
    proxy.hold(1, match=path, method=method)
    argv = [sys.executable, "-m", "dsc", "compile", str(src), url, "-j", "2", "--size", "24", "--records-per-shard",
            "5", "--seed", "3"]
    try:
        proc = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, **env, "AWS_ENDPOINT_URL": proxy.endpoint},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + RUN_S
        while not proxy.count(method, path):  # the request is held at the proxy: the compile is inside it
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C
        time.sleep(0.2)
        proxy.release()  # the request goes on, as one in flight does
        _, stderr = proc.communicate(timeout=RUN_S)
    finally:
        proxy.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr  # the skip of the damaged source, then one line
    assert re.fullmatch("error: " + says.format(url=re.escape(url)), stderr.strip().splitlines()[-1]), stderr
    if stage != "clean-up":
        resumed = subprocess.run([*argv, "--resume"], cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                                 text=True, timeout=RUN_S)
        assert resumed.returncode == 0, resumed.stderr
    else:  # committed: the next compile deletes what the clean-up left, and replaces nothing without --force
        again = subprocess.run(argv, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
                               timeout=RUN_S)
        assert again.returncode == 1 and "already exists" in again.stderr, again.stderr
    assert_same_as(reference, url)


def test_a_compile_into_an_existing_dataset_is_refused_before_any_decoder_is_imported(src: Path, url: str,
                                                                                       env) -> None:
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    argv = ["compile", str(src), url, "-j", "1", "--size", "24"]  # one worker: the driver would decode (torch)
    code = ("import sys; from dsc.cli import app; from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, {argv!r}); "
            "print(r.exit_code, [m for m in ('torch', 'tensordict') if m in sys.modules], repr(r.stderr))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_S,
                          env={**os.environ, **env})
    assert done.stdout.split("\n")[-2].startswith(f"1 [] 'error: output {url} already exists; pass --force"), \
        done.stdout + done.stderr


def test_the_worker_host_is_forked_before_the_bucket_is_checked_which_still_refuses_before_discovery(
        src: Path, url: str, env) -> None:
    """The check that refuses an existing dataset uses the S3 client, whose runtime a forked process cannot use:
    run before the local engine's host starts, it would make that host spawned, importing numpy, torch and the
    decoders anew. It runs once the host is forked, and still refuses before the sources are even listed."""
    code = ("import sys; from dsc import compile_folder; from dsc.compiler import pipeline; "
            "from dsc.compiler.engines import local; chosen, listing = local._host_start_method, pipeline._discover; "
            "local._host_start_method = lambda: print('host:', chosen()) or chosen(); "
            "pipeline._discover = lambda *a: print('discovering') or listing(*a); "
            f"compile_folder({str(src)!r}, sys.argv[1], workers=2, on_skip=lambda s, r: None, **{OPTIONS!r}); "
            "print('compiled')")
    for expected in (["discovering", "compiled"], []):
        done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=RUN_S,
                              env={**os.environ, **env})
        assert done.stdout.split() == ["host:", local_engine.START_METHOD, *expected], done.stdout + done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"dsc.errors.CompileError: output {url} already exists; pass "
                                                   "--force"), done.stderr


def test_a_ray_compile_into_an_existing_dataset_is_refused_before_it_joins_the_cluster(src: Path, url: str,
                                                                                         monkeypatch) -> None:
    """Ray's workers are not forked from the driver: its check comes first, not after a cluster starts (seconds)."""
    from dsc.compiler.engines import ray_cluster

    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)

    def joined(*arguments):
        raise AssertionError("the cluster was joined before the output was checked")
    monkeypatch.setattr(ray_cluster, "_connect", joined)
    with pytest.raises(CompileError, match=r"already exists; pass --force"):
        compile_folder(src, url, engine="ray", workers=2, on_skip=lambda s, r: None, **OPTIONS)


class _TwiceEngine(LocalEngine):
    """Decodes in this process and runs every chunk twice (a task that Ray ran again). With `split`, a chunk
    runs as two tasks (a stalled worker's rest handed to another) before its second, whole run; with
    `lose`, the first chunk's object is deleted after it was written (a worker stopped before its PUT):
    a second round must decode it again."""

    split, lose = False, False
    fills: list[int] = []
    largest: list[int] = []  # the most sources in a chunk, per fill

    def fill(self, job, chunks, on_results) -> None:
        chunks = list(chunks)
        _TwiceEngine.fills.append(sum(len(getattr(c, "tasks", c)) for c in chunks))
        _TwiceEngine.largest.append(max(len(getattr(c, "tasks", c)) for c in chunks))
        decoding = isinstance(job, WriteJob)
        for k, chunk in enumerate(chunks):
            if decoding and self.split and len(chunk) > 1:
                results = write.write_chunk(job, chunk[:1]) + write.write_chunk(job, chunk[1:])
            else:
                results = write.write_chunk(job, chunk)
            if decoding and self.lose and len(_TwiceEngine.fills) == 1 and k == 0:
                work = Bucket(job.stage)
                for info in work.list("chunks"):
                    work.delete(info.name)
            else:
                assert write.write_chunk(job, chunk) == results
            on_results(results)


@pytest.mark.parametrize("split, lose", [(False, False), (True, False), (False, True)])
def test_tasks_run_twice_split_or_lost_give_the_same_bytes(src: Path, reference: Path, url: str, monkeypatch,
                                                           split: bool, lose: bool) -> None:
    monkeypatch.setattr(_TwiceEngine, "split", split)
    monkeypatch.setattr(_TwiceEngine, "lose", lose)
    monkeypatch.setattr(_TwiceEngine, "fills", [])
    monkeypatch.setattr(_TwiceEngine, "largest", [])
    monkeypatch.setattr(pipeline, "make_engine", lambda *arguments: _TwiceEngine(1))
    monkeypatch.setattr(bucket_build, "CHUNK_BYTES", 7 * 24 * 24 * 3 if split else bucket_build.CHUNK_BYTES)
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    assert_same_as(reference, url)
    shards = 6  # 26 records, 5 a shard: the last fill assembles them
    # one worker: its chunk is all 27 sources (a bucket build's chunks are S3's smallest part at least, as far as
    # every worker still gets one), or 7 with CHUNK_BYTES that small (a worker holds at most CHUNK_BYTES of records)
    lost = 26  # the lost first chunk's sources but the damaged one (slot 10 with seed 3): its skip is known
    assert _TwiceEngine.fills == ([27, lost, shards] if lose else [27, shards])
    assert _TwiceEngine.largest[0] == (7 if split else 27)


def test_each_record_is_uploaded_once_the_shards_are_copied_by_the_server(server: S3Server, env, url: str,
                                                                          tmp_path: Path, monkeypatch) -> None:
    """Bytes the client sent, counted at a proxy: the chunk objects carry every record once; the shards are
    composed by the server from their ranges (no PUT of bytes to a shard's key), and the rest (index files, trailers,
    plan, manifests) is small next to the records."""
    clean = make_folder(tmp_path / "clean", classes=3, per_class=9, seed=7)
    proxy = FaultProxy(server.endpoint)
    with _through(proxy, env, monkeypatch):
        summary = compile_folder(clean, url, workers=1, on_skip=lambda s, r: None, **{**OPTIONS, "size": 64})
    records = summary.kept * 64 * 64 * fmt.CHANNELS
    assert (summary.kept, len(summary.skipped)) == (27, 0)
    chunks, total = proxy.sent(contains="/work/chunks/"), proxy.sent()
    to_shards = [seen for seen in proxy.seen if f"/{fmt.SHARD_DIR}/" in seen.path and "/work/" not in seen.path]
    assert len(to_shards) > 0 and sum(seen.sent for seen in to_shards if seen.method == "PUT") == 0  # POST: XML
    assert records <= chunks < records + records // 10  # the records, and each chunk's trailer
    assert total - chunks < records // 2
    reference = tmp_path / "reference"
    compile_folder(clean, reference, workers=1, on_skip=lambda s, r: None, **{**OPTIONS, "size": 64})
    assert_same_as(reference, url)


def test_a_worker_reusing_its_buffer_writes_each_chunk_object_once_and_whole(server: S3Server, env, url: str,
                                                                            tmp_path: Path, monkeypatch) -> None:
    """Two forked workers, each writing several chunk objects from one reused buffer, a later chunk shorter than
    an earlier one (a damaged source in it, the last chunk's 3 sources): each object holds only its own chunk's
    records and trailer, so every one is taken at once (7 PUTs, no second round) and the build is the folder's."""
    folder = make_folder(tmp_path / "src", classes=3, per_class=9, seed=7)
    (folder / "class_1" / "img_2.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")
    options = {**OPTIONS, "size": 64}
    monkeypatch.setattr(bucket_build, "CHUNK_BYTES", 4 * 64 * 64 * fmt.CHANNELS)  # chunks of 4 sources: 7 of them
    proxy = FaultProxy(server.endpoint)
    with _through(proxy, env, monkeypatch):
        compile_folder(folder, url, workers=2, on_skip=lambda s, r: None, **options)
    assert proxy.count("PUT", "/work/chunks/") == 7
    compile_folder(folder, tmp_path / "reference", workers=1, on_skip=lambda s, r: None, **options)
    assert_same_as(tmp_path / "reference", url)


def test_a_run_shorter_than_s3s_smallest_part_is_topped_up_and_sent_once_more(server: S3Server, env, url: str,
                                                                             tmp_path: Path, monkeypatch) -> None:
    """Records of 224x224 (147 KiB): a chunk is 35 of them (ceil(5 MiB / 147 KiB), S3's smallest part), so 80
    sources on two workers are chunks of 35, 35 and 10; shards of 40 records. Shard 0 is chunk 0 (copied) and 5
    records of chunk 1 (copied: its last part); shard 1 starts with the other 30 records of chunk 1, too few for
    a part: they go up again with 5 of chunk 2 as one part of 35, and chunk 2's last 5 are copied. Moto refuses
    a part under 5 MiB but the last, so the shard objects exist only if the parts were laid out so."""
    clean = make_folder(tmp_path / "big", classes=2, per_class=40, seed=5)
    options = {"size": 224, "records_per_shard": 40, "workers": 2}
    proxy = FaultProxy(server.endpoint)
    with _through(proxy, env, monkeypatch):
        compile_folder(clean, url, on_skip=lambda s, r: None, **options)
    to_shards = [seen for seen in proxy.seen if f"/{fmt.SHARD_DIR}/" in seen.path and "/work/" not in seen.path]
    assert sum(seen.sent for seen in to_shards if seen.method == "PUT") == 35 * 224 * 224 * fmt.CHANNELS
    compile_folder(clean, tmp_path / "reference", on_skip=lambda s, r: None, **options)
    assert_same_as(tmp_path / "reference", url)


def test_a_part_copy_answered_slow_down_is_retried(src: Path, reference: Path, server: S3Server, env, url: str,
                                                   monkeypatch) -> None:
    """The shards' part copies go through another client (botocore) than every other request: a 503 SlowDown
    on one is retried as theirs are, and the build is the folder compile's."""
    proxy = FaultProxy(server.endpoint)
    proxy.slow_down(2, match="partNumber=", method="PUT")
    with _through(proxy, env, monkeypatch):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    assert proxy.count("PUT", "partNumber=", action="slow_down") == 2
    assert_same_as(reference, url)

@pytest.fixture(scope="module")
def children():
    """Compiles run in children forked from a process that never used obstore (its runtime does not survive
    fork), with dsc's modules imported once: a child starts in milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dsc.compiler.pipeline", "dsc.compiler.write", "dsc.storage.bucket"])
    return context


def _compile_child(env: dict[str, str], src: str, url: str, options: dict) -> None:
    os.environ.update(env)
    compile_folder(src, url, on_skip=lambda s, r: None, **options)


def _reader_sees(url: str, expected: list[np.ndarray]) -> int | None:
    """Which of the whole datasets `expected` (their records) a fresh open of `url` sees; None: no dataset."""
    try:
        data = open_dataset(url)
    except DatasetError as e:
        assert "no manifest.json" in str(e), e
        return None
    records = data.read_records(range(data.manifest.count))
    matches = [k for k, e in enumerate(expected) if e.shape == records.shape and np.array_equal(e, records)]
    assert matches, "a reader saw a dataset that is neither the old one nor the new one"
    return matches[0]


HOLDS = [("PUT", "/work/chunks/"), ("PUT", "/versions/"), ("PUT", "/manifest.json"),
         ("POST", "?delete")]  # obstore deletes an object by a DeleteObjects POST
HOLD_S = 0.5  # a held request reaches the server this long after the proxy got it: after the kill


def test_kill_9_of_the_driver_at_random_moments_and_inside_the_commit(src: Path, reference: Path, env,
                                                                      server: S3Server, tmp_path: Path,
                                                                      children) -> None:
    """Kills at random moments and right after the driver sent a request of the commit (a chunk object, the
    version's create-only PUT, manifest.json, the clean-up), each followed by --resume; then the same for
    --force over the dataset. A reader between kills sees no dataset or a whole one, old or new."""
    proxy = FaultProxy(server.endpoint)
    child_env = {**env, "AWS_ENDPOINT_URL": proxy.endpoint}
    url = f"s3://{BUCKET}/sets/k{next(_prefixes)}"
    rng = random.Random(11)
    old = open_dataset(reference).read_records(range(26))
    other = tmp_path / "seed4"
    compile_folder(src, other, workers=1, on_skip=lambda s, r: None, **{**OPTIONS, "seed": 4})
    new = open_dataset(other).read_records(range(26))

    def run(options: dict, kill_after: float | None = None, hold: tuple[str, str] | None = None) -> bool:
        """One compile in a child; killed (-9) `kill_after` s after its start or once the proxy got `hold`."""
        proxy.clear()
        if hold is not None:
            proxy.delay(HOLD_S, 1, match=hold[1], method=hold[0])
        child = children.Process(target=_compile_child, args=(child_env, str(src), url, {**options, "workers": 2}))
        started, killed, earlier = time.monotonic(), False, proxy.count(*hold) if hold else 0  # (earlier runs')
        child.start()
        while kill_after is not None and child.is_alive() and time.monotonic() - started < RUN_S:
            if proxy.count(*hold) > earlier if hold else time.monotonic() - started >= kill_after:
                child.kill()
                killed = True
                break
            time.sleep(0.002)
        child.join(RUN_S)
        proxy.settle()  # the held request lands now, as one in flight at a kill does, before a reader looks
        assert child.exitcode == 0 or killed, f"a compile failed on its own (exit code {child.exitcode})"
        return child.exitcode == 0

    def finished() -> bool:
        """Whether the first compile is done: committed, its work objects deleted (its --resume is refused then,
        as a local one's is: the dataset exists)."""
        return _reader_sees(url, [old]) == 0 and not any("/work/" in i.name for i in Bucket(url).list())

    try:
        for _ in range(2):  # the first starts the fork server: the second says how long a compile takes here
            started = time.monotonic()
            assert run({**OPTIONS, "force": True})
        whole_s = time.monotonic() - started
        for info in Bucket(url).list():
            Bucket(url).delete(info.name)
        kills, runs = 0, []  # runs: (stage, request held, how it ended, what a reader saw) each
        for stage, options in enumerate([{**OPTIONS, "resume": True}, {**OPTIONS, "seed": 4, "force": True,
                                                                       "resume": True}]):
            for k in range(3 * KILLS):  # a kill that came too late lets the compile finish: a --force one goes on
                if kills >= KILLS * (stage + 1) // 2 or stage == 0 and finished():
                    break
                hold = HOLDS[k] if k < len(HOLDS) else None
                killed = not run(options, rng.uniform(0.05, 0.95) * whole_s, hold)
                kills += killed
                runs.append((stage, hold, "killed" if killed else "finished", _reader_sees(url, [old, new])))
                assert runs[-1][-1] in ((None, 0) if stage == 0 else (0, 1))
            assert (stage == 0 and finished()) or run(options)
            assert _reader_sees(url, [old, new]) == stage
        assert_same_as(tmp_path / "seed4", url)
    finally:
        proxy.kill()
    assert kills >= KILLS
    seen = [reader_saw for *_, reader_saw in runs]
    assert seen.count(None) and seen.count(0) and seen.count(1), runs  # each state was seen between kills


@pytest.mark.parametrize("replacing", [False, True])
def test_a_resume_whose_own_commit_lands_late_meanwhile_takes_it_for_its_own(src: Path, reference: Path, url: str,
                                                                             monkeypatch, replacing: bool) -> None:
    """A driver killed with its create-only PUT of the version in flight: the PUT may land after the --resume has
    looked (a loaded server, a slow network). That version is this very build's: the resume finishes with it,
    neither refusing the dataset as one that "appeared meanwhile" nor committing the same build again."""
    if replacing:
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **{**OPTIONS, "seed": 4})
    options = {**OPTIONS, "force": replacing}
    commit = bucket_build.bp.commit

    def killed(dataset, manifest, force):
        raise KeyboardInterrupt
    monkeypatch.setattr(bucket_build.bp, "commit", killed)
    with pytest.raises(Interrupted, match="interrupted while committing"):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **options)

    def landed_late(dataset, manifest, force):  # the killed driver's PUT arrives now, just before this commit's
        number = 1 + replacing
        dataset.create(fmt.version_file(number), replace(manifest, dataset_version=number).to_json().encode())
        return commit(dataset, manifest, force)
    monkeypatch.setattr(bucket_build.bp, "commit", landed_late)
    summary = compile_folder(src, url, workers=1, on_skip=lambda s, r: None, resume=True, **options)
    assert summary.kept == 26
    assert [i.name for i in Bucket(url).list(fmt.VERSIONS_DIR)] == [fmt.version_file(n) for n in
                                                                      range(1, 2 + replacing)]
    assert_same_as(reference, url)


def test_a_resume_after_the_commit_only_finishes_it_and_reports_its_skips(src: Path, reference: Path, url: str,
                                                                          monkeypatch) -> None:
    delete_build = bucket_build.bp.delete_build

    def stopped(dataset, objects, keep=frozenset()):
        if keep:  # the clean-up after the commit: stop as a kill would
            raise KeyboardInterrupt
        delete_build(dataset, objects, keep)
    monkeypatch.setattr(bucket_build.bp, "delete_build", stopped)
    with pytest.raises(KeyboardInterrupt):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    monkeypatch.setattr(bucket_build.bp, "delete_build", delete_build)
    summary = compile_folder(src, url, workers=1, resume=True, **OPTIONS)
    assert (summary.reused, summary.kept, [s for s, _ in summary.skipped]) == (27, 26, ["class_1/img_2.jpg"])
    assert_same_as(reference, url)


def test_a_compile_into_a_bucket_writes_format_1_4_with_its_shard_table(src: Path, reference: Path, url: str,
                                                                        tmp_path: Path) -> None:
    """The manifest names a shard table (no shard listed in it), uploaded before the commit, whose rows are the
    SHA-256s of the shard objects; a fresh cache opens it and reads the records of the folder compile."""
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    bucket = Bucket(url)
    doc = json.loads(bucket.get(fmt.MANIFEST_FILE)[0])
    assert doc["version"] == fmt.FORMAT_VERSION and "shards" not in doc and len(doc["shard_tables"]) == 1
    (segment,) = doc["segments"]  # (1.5) the index in one segment, its files the build's, as the shards are
    assert all(e["file"].startswith(f"{fmt.BUILDS_DIR}/") for e in [*segment["index"].values(), segment["checksums"],
                                                                   segment["class_counts"]])
    table = doc["shard_tables"][0]
    assert table["file"].endswith(f"/{fmt.SHARD_TABLE_FILE}") and table["count"] == 6  # 26 records, 5 a shard
    shards = sorted(i.name for i in bucket.list(table["folder"]))
    assert len(shards) == 6
    assert bucket.get(table["file"])[0] == b"".join(hashlib.sha256(bucket.get(n)[0]).digest() for n in shards)
    opened = open_dataset(url, cache_dir=tmp_path / "fresh")
    assert opened.manifest.shard_tables and len(opened.manifest.shards) == 6
    assert np.array_equal(opened.read_records(range(26)), open_dataset(reference).read_records(range(26)))


def test_force_commits_the_next_version_while_a_reader_keeps_reading_the_old_one(src: Path, url: str,
                                                                                 reference: Path) -> None:
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    reader = open_dataset(url)
    first = reader.read_records([0])
    save(src.parent / "more" / "class_0" / "a.png", np.full((30, 30, 3), 200, np.uint8), "PNG")
    compile_folder(src.parent / "more", url, workers=1, force=True, size=24)
    assert open_dataset(url).manifest.dataset_version == 2
    assert open_dataset(url).manifest.count == 1
    whole = reader.read_records(range(26))  # fetched now, from the old version's objects: untouched
    assert np.array_equal(whole, open_dataset(reference).read_records(range(26)))
    assert np.array_equal(whole[:1], first)
    versions = [i.name for i in Bucket(url).list(fmt.VERSIONS_DIR)]
    assert versions == [fmt.version_file(1), fmt.version_file(2)]


def _children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def test_a_worker_killed_is_resumed_and_the_partial_build_named(src: Path, reference: Path, url: str, env,
                                                                server: S3Server, children) -> None:
    """A worker killed (-9) while its chunk object's PUT is held by the proxy (so it dies with work in hand):
    the compile stops, the next compile names the partial build, --resume reuses what was written."""
    proxy = FaultProxy(server.endpoint)
    try:
        proxy.delay(HOLD_S, 2, match="/work/chunks/", method="PUT")
        child = children.Process(target=_compile_child, args=({**env, "AWS_ENDPOINT_URL": proxy.endpoint}, str(src),
                                                              url, {**OPTIONS, "workers": 2}))
        child.start()
        killed, deadline = False, time.monotonic() + RUN_S
        while not killed and time.monotonic() < deadline and child.is_alive():
            workers = [w for host in _children(child.pid) for w in _children(host)]  # the host's children
            if workers and proxy.count("PUT", "/work/chunks/"):
                os.kill(workers[0], signal.SIGKILL)
                killed = True
            time.sleep(0.002)
        child.join(RUN_S)
        proxy.settle()  # the held PUTs land
    finally:
        proxy.kill()
    assert killed and child.exitcode == 1  # the driver said "a worker process died" and stopped
    with pytest.raises(CompileError, match=r"left a partial build at s3://.*/builds/[0-9a-f]{16}/: .*--resume"):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    with pytest.raises(CompileError, match=r"cannot resume s3://.*: made with other settings .*\(seed, sources\)"):
        compile_folder(src, url, workers=1, resume=True, on_skip=lambda s, r: None, **{**OPTIONS, "seed": 4})
    summary = compile_folder(src, url, workers=1, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert summary.reused > 0
    assert_same_as(reference, url)


def test_the_ray_engine_compiles_from_the_bucket_into_the_bucket_with_no_local_output(
        src: Path, url: str, server: S3Server, tmp_path: Path, monkeypatch) -> None:
    """SRC as tar shards in the bucket, OUT a prefix of it: Ray tasks read and write objects, nothing local."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("webdataset")
    shards = tmp_path / "shards"
    write_tar_shards(src, shards, per_shard=10)
    for path in sorted(shards.iterdir()):
        server.put(BUCKET, f"{url[len(f's3://{BUCKET}/'):]}-src/{path.name}", path.read_bytes())
    source = f"{url}-src/train-{{000000..000002}}.tar"
    compile_folder(source, tmp_path / "reference", workers=1, on_skip=lambda s, r: None, **OPTIONS)
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        compile_folder(source, url, engine="ray", on_skip=lambda s, r: None, **OPTIONS)
    finally:
        ray.shutdown()
    assert list(work.iterdir()) == []
    assert_same_as(tmp_path / "reference", url)


def _partial_build_of_force(src: Path, url: str, monkeypatch) -> set[str]:
    """Version 1 committed, then a --force compile killed between its finished build and its commit; the
    objects of that partial build, which its --resume would reuse."""
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    before = {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}
    commit = bucket_build.bp.commit

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stops where a kill -9 just before the commit would
    monkeypatch.setattr(bucket_build.bp, "commit", killed)
    with pytest.raises(KeyboardInterrupt):
        compile_folder(src, url, workers=1, force=True, on_skip=lambda s, r: None, **OPTIONS)
    monkeypatch.setattr(bucket_build.bp, "commit", commit)
    return {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)} - before


def test_prune_leaves_a_young_partial_build_whole_for_its_resume_and_deletes_an_abandoned_one(
        src: Path, reference: Path, url: str, monkeypatch) -> None:
    """formats.md: a partial build is its writer's (or its --resume's) while any of its objects is younger than
    ABANDONED_AFTER_S: a prune deletes none of it. Once all are older its writer is gone, and a prune deletes it
    whole, its work objects and plan included (nothing of it is left for ever); the committed version stays."""
    partial = _partial_build_of_force(src, url, monkeypatch)
    assert any(name.endswith("/shards/00000.bin") for name in partial)
    assert any(name.endswith("/work/plan.json") for name in partial)
    assert bucket_versions.prune(url, 1).removed_files == []
    assert partial <= {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}
    monkeypatch.setattr(bucket_build.bp, "ABANDONED_AFTER_S", 0.0)  # the partial build is now a day old
    pruned = bucket_versions.prune(url, 1)
    assert sorted(pruned.removed_files) == sorted(partial)
    assert not partial & {i.name for i in Bucket(url).list()}
    assert_same_as(reference, url)


def test_deleting_an_abandoned_build_leaves_another_tools_objects_in_its_folder(src: Path, url: str,
                                                                                 monkeypatch) -> None:
    """Objects another tool put into a partial build's folder (beside its shards, in its work folder) are not dsc's:
    a prune that deletes the abandoned build deletes every object dsc named there and none of those."""
    partial = _partial_build_of_force(src, url, monkeypatch)
    folder = "/".join(next(iter(partial)).split("/")[:2])  # builds/<tag>
    foreign = {f"{folder}/README.txt", f"{folder}/shards/NOTES.md", f"{folder}/work/notes.txt",
               f"{folder}/work/chunks/mine.bin", f"{folder}/work/shards/00000.json.bak"}
    for name in foreign:
        Bucket(url).put(name, b"not dsc's")
    monkeypatch.setattr(bucket_build.bp, "ABANDONED_AFTER_S", 0.0)  # the partial build is now a day old
    pruned = bucket_versions.prune(url, 1)
    assert sorted(pruned.removed_files) == sorted(partial)
    assert {i.name for i in Bucket(url).list(folder)} == foreign


def test_a_partial_build_within_the_grace_is_resumed_after_a_prune(src: Path, reference: Path, url: str,
                                                                   monkeypatch) -> None:
    """A prune within the grace leaves the partial build of a --force compile whole: its --resume reuses every
    slot and commits the next version."""
    _partial_build_of_force(src, url, monkeypatch)
    assert bucket_versions.prune(url, 1).removed_files == []
    summary = compile_folder(src, url, workers=1, force=True, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert summary.reused == 27
    assert_same_as(reference, url)


def test_prune_keeps_what_a_version_committed_after_its_versions_were_read_lists(src: Path, reference: Path,
                                                                                 url: str, monkeypatch) -> None:
    """A build older than a day (a resumed one) committed and cleaned up while a prune runs, between its
    reading of the versions and its LIST of the objects: the new version's objects all stay."""
    _partial_build_of_force(src, url, monkeypatch)
    monkeypatch.setattr(bucket_build.bp, "ABANDONED_AFTER_S", 0.0)
    listing, resumed = Bucket.list, []

    def list_after_a_commit(self, folder: str = ""):
        if not folder and self.root == Bucket(url).root and not resumed:
            resumed.append(True)
            compile_folder(src, url, workers=1, force=True, resume=True, on_skip=lambda s, r: None, **OPTIONS)
        return listing(self, folder)
    monkeypatch.setattr(Bucket, "list", list_after_a_commit)
    bucket_versions.prune(url, 1)
    monkeypatch.setattr(Bucket, "list", listing)
    assert resumed
    assert open_dataset(url).manifest.dataset_version == 2
    assert_same_as(reference, url)
    assert np.array_equal(open_dataset(url).read_records(range(26)), open_dataset(reference).read_records(range(26)))


def test_a_damaged_chunk_object_is_decoded_again_by_the_resume(src: Path, reference: Path, url: str,
                                                               monkeypatch) -> None:
    """A chunk object whose records no longer match its trailer's CRC-32s (same size) stops the assembly, is
    deleted, and the message says so: the --resume decodes its slots again instead of failing the same way
    every time."""
    assemble = bucket_build._assemble

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stops where a kill -9 between the decoding and the assembly would
    monkeypatch.setattr(bucket_build, "_assemble", killed)
    with pytest.raises(KeyboardInterrupt):
        compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    monkeypatch.setattr(bucket_build, "_assemble", assemble)
    (tag,) = {name.split("/")[1] for name in (i.name for i in Bucket(url).list(fmt.BUILDS_DIR))}
    work = Bucket(f"{url}/{fmt.build_folder(tag)}/work")
    chunk = work.list("chunks")[0].name
    data = bytearray(work.get(chunk)[0])
    data[0] ^= 0xFF  # the first record's first byte: the size and the trailer unchanged
    work.put(chunk, bytes(data))
    deleted = r"CRC-32 .* damaged; the chunk object was deleted, to be decoded again; run .* --resume"
    with pytest.raises(CompileError, match=deleted):
        compile_folder(src, url, workers=1, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert chunk not in {i.name for i in work.list("chunks")}
    summary = compile_folder(src, url, workers=1, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert summary.reused < 27
    assert_same_as(reference, url)


def test_a_resumed_build_whose_objects_are_deleted_meanwhile_is_never_committed(src: Path, reference: Path,
                                                                                 url: str, monkeypatch) -> None:
    """A resume the next day reuses a build every object of which is a day old: another process's prune or
    --force may take it for abandoned. The resume makes it young again (a fresh work object), and its commit
    checks that every object it lists is still there (was: a version committed whose shards were gone)."""
    _partial_build_of_force(src, url, monkeypatch)
    (tag,) = {i.name.split("/")[1] for i in Bucket(url).list(fmt.BUILDS_DIR)
              if i.name.endswith("/work/plan.json")}
    build = Bucket(f"{url}/{fmt.build_folder(tag)}")
    commit, started, seen = bucket_build.bp.commit, time.time(), []

    def deleted_first(dataset, manifest, force):
        seen.append({i.name: i.modified for i in build.list("work")})
        build.delete(fmt.shard_file(1))  # as a prune elsewhere deletes a build it takes for abandoned
        return commit(dataset, manifest, force)
    monkeypatch.setattr(bucket_build.bp, "commit", deleted_first)
    with pytest.raises(CompileError, match=rf"{build.root}/shards/00001.bin: written by this compile, now missing .*"
                                           r"nothing was committed: run the same command with --resume"):
        compile_folder(src, url, workers=1, force=True, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert seen[0]["work/resumed.json"] >= started - 1  # the build was made young again before it was reused
    assert open_dataset(url).manifest.dataset_version == 1  # nothing committed
    monkeypatch.setattr(bucket_build.bp, "commit", commit)
    summary = compile_folder(src, url, workers=1, force=True, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    assert summary.reused == 27 and open_dataset(url).manifest.dataset_version == 2  # the shard assembled again
    assert_same_as(reference, url)


def test_a_resume_whose_plan_cannot_be_read_for_now_fails_and_keeps_the_build(src: Path, server: S3Server, env,
                                                                              url: str, monkeypatch) -> None:
    """Was: four 503s on the build's plan.json read as "no plan": "nothing to resume", everything decoded again
    into a new build (and a day-old build deleted as abandoned)."""
    _partial_build_of_force(src, url, monkeypatch)
    before = {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}
    proxy = FaultProxy(server.endpoint)
    proxy.slow_down(100, match="/work/plan.json", method="GET")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        with pytest.raises(DatasetError, match="plan.json"):
            compile_folder(src, url, workers=1, force=True, resume=True, on_skip=lambda s, r: None, **OPTIONS)
    finally:
        proxy.kill()
        monkeypatch.setenv("AWS_ENDPOINT_URL", env["AWS_ENDPOINT_URL"])
    assert {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)} == before  # kept whole, and nothing new begun


def test_another_tools_manifest_json_is_refused_even_with_force(src: Path, url: str) -> None:
    """Was: refused as "already exists" without --force, and with it replaced, its bytes kept as version 1."""
    theirs = b'{"name": "another tool\'s manifest"}'
    Bucket(url).put(fmt.MANIFEST_FILE, theirs)
    for force in (False, True):
        with pytest.raises(CompileError, match=r"holds objects that are not a dsc dataset's \(manifest.json\)"):
            compile_folder(src, url, workers=1, force=force, on_skip=lambda s, r: None, **OPTIONS)
    assert [(i.name, Bucket(url).get(i.name)[0]) for i in Bucket(url).list()] == [(fmt.MANIFEST_FILE, theirs)]


def test_what_a_killed_append_uploaded_is_dscs_not_foreign_to_a_force(src: Path, reference: Path, url: str) -> None:
    """Was: "holds objects that are not a dsc dataset's (appends/<tag>/...)": the prefix refused to --force."""
    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    left = f"{fmt.append_folder('0123456789abcdef')}/{fmt.shard_file(5)}"  # a killed append's upload
    Bucket(url).put(left, b"x" * 100)
    compile_folder(src, url, workers=1, force=True, on_skip=lambda s, r: None, **OPTIONS)
    assert open_dataset(url).manifest.dataset_version == 2
    assert Bucket(url).head(left) is not None  # deleted by a prune once a day old, as formats.md says


def test_a_prune_leaves_a_day_old_build_whose_resume_began_after_it_listed_the_prefix(src: Path, url: str,
                                                                                       monkeypatch) -> None:
    """Was: the prune deleted every build its one listing showed abandoned, a build a --resume had meanwhile
    made young again (and then committed, its shards gone) included."""
    partial = _partial_build_of_force(src, url, monkeypatch)
    (tag,) = {name.split("/")[1] for name in partial}
    grace = 3.0  # S3's times are whole seconds: an object written now may list as up to 1 s old at once (and more
    time.sleep(grace)  # on a loaded machine, by the prune's listing); the partial build's are older than the grace
    monkeypatch.setattr(bucket_build.bp, "ABANDONED_AFTER_S", grace)  # the partial build is now "a day old"
    clear = bucket_build.bp.clear_abandoned

    def resumed_first(dataset, builds):
        bucket_build.bp.renew(Bucket(url), tag)  # a --resume begins elsewhere, after the prune's listing
        return clear(dataset, builds)
    monkeypatch.setattr(bucket_build.bp, "clear_abandoned", resumed_first)
    assert bucket_versions.prune(url, 1).removed_files == []
    assert partial <= {i.name for i in Bucket(url).list(fmt.BUILDS_DIR)}


@pytest.mark.parametrize("command", [["prune", "URL", "--keep", "1"],
                                     ["compile", "SRC", "URL", "--force", "--size", "24"]])
def test_a_key_that_cannot_be_listed_in_the_dataset_prefix_is_one_line_naming_it(src: Path, url: str, server: S3Server,
                                                                                  command: list[str]) -> None:
    """Another tool's object whose key the S3 client cannot take as a path (an empty part) spoils every LIST of
    the prefix: prune and a compile --force stop with one line naming the key and what to do; nothing changes."""
    import urllib.parse

    from typer.testing import CliRunner

    from dsc.cli import app

    compile_folder(src, url, workers=1, on_skip=lambda s, r: None, **OPTIONS)
    before = {i.name: i.etag for i in Bucket(url).list()}
    key = f"{url.removeprefix(f's3://{BUCKET}/')}/notes//draft.txt"
    server.put_raw(BUCKET, urllib.parse.quote(key, safe="/"), b"another tool's")
    result = CliRunner().invoke(app, [{"SRC": str(src), "URL": url}.get(a, a) for a in command])
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and line.startswith("error: ") and repr(key) in line, line
    assert "cannot be read as a path" in line and "rename or delete that object" in line, line
    server.delete_raw(BUCKET, urllib.parse.quote(key, safe="/"))
    assert {i.name: i.etag for i in Bucket(url).list()} == before
