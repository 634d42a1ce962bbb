"""Nothing lost and nothing left for ever in a bucket, against a real S3 server on 127.0.0.1 (moto) and real
processes: `dsc append` killed (-9) at random moments and while a request of its upload or its commit is in
flight; two `dsc merge` processes racing into one prefix; a killed merge named by the next one and cleaned
by `dsc prune`; a `compile --force` that meets the partial build of a compile still running."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import test_versions

from dsc import format as fmt
from dsc import storage
from dsc.compiler import bucket_publish, bucket_versions
from dsc.compiler.append import append
from dsc.compiler.merge import merge
from dsc.compiler.pipeline import compile_folder
from dsc.errors import DatasetError
from dsc.storage.bucket import Bucket

from conftest import make_folder
from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)

BUCKET = "dsc-kills"
SIZE = 16
KILLS = 10  # kill -9s of an append, some while the proxy holds its upload, its version's PUT, manifest.json
RUN_S = 120  # one command, killed or not, ends within this
LAND_S = 0.5  # after a kill, the request the proxy held goes on to the server (as one in flight does)
APPEND_HOLDS = [("PUT", "/appends/"), ("PUT", "/versions/"), ("PUT", "/manifest.json")]

server = serving(BUCKET)
grown = test_versions.grown  # `a` compiled into tmp/ds (12 records, 5 a shard), `b` to append
_prefixes = iter(range(1 << 30))


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> dict[str, str]:
    server.point_at(monkeypatch)
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    return {**os.environ}


def prefix() -> str:
    return f"sets/k{next(_prefixes)}"


def records(where) -> np.ndarray:
    data = storage.open_dataset(where)
    return data.read_records(range(data.manifest.count))


def seen(url: str, expected: list[np.ndarray]) -> int | None:
    """Which of the whole datasets `expected` a fresh open of `url` reads; None when there is no dataset."""
    try:
        got = records(url)
    except DatasetError as e:
        assert "no manifest.json" in str(e), e
        return None
    matches = [k for k, want in enumerate(expected) if want.shape == got.shape and np.array_equal(want, got)]
    assert matches, "a reader saw a dataset that is none of the whole ones expected"
    return matches[0]


def dsc(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dsc", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_killed(args: list[str], env: dict[str, str], proxy: FaultProxy, kill_after: float | None,
               hold: tuple[str, str] | None) -> tuple[bool, str]:
    """`dsc ARGS` through `proxy`, killed (-9) `kill_after` s after its start or once the proxy holds its
    request `hold`; the held request then goes on. (whether it was killed, its stderr)."""
    proxy.clear()
    if hold is not None:
        proxy.hold(1, match=hold[1], method=hold[0])
    before = proxy.count(*hold) if hold else 0
    child, started = dsc(args, {**env, "AWS_ENDPOINT_URL": proxy.endpoint}), time.monotonic()
    killed = False
    while child.poll() is None and time.monotonic() - started < RUN_S:
        if proxy.count(*hold) > before if hold else kill_after is not None and time.monotonic() - started >= kill_after:
            child.kill()
            killed = True
            break
        time.sleep(0.005)
    _, err = child.communicate(timeout=RUN_S)
    proxy.release()
    time.sleep(LAND_S if hold else 0)
    assert killed or child.returncode == 0, err
    return killed, err


def unlisted(url: str) -> set[str]:
    """The objects of `url` that no version lists (but the versions' manifests and manifest.json)."""
    bucket = Bucket(url)
    listed = set().union(*(fmt.listed_files(bucket.get(fmt.version_file(v))[0])
                           for v in bucket_versions.versions(bucket)))
    return {o.name for o in bucket.list() if o.name not in listed and o.name != fmt.MANIFEST_FILE
            and not o.name.startswith(f"{fmt.VERSIONS_DIR}/")}


def assert_a_clean_append(url: str, clean: Path) -> None:
    """Version 2 of `url` is the append that made version 2 of the folder `clean`: the same files, object bytes
    equal to file bytes (the append's folder tag aside)."""
    remote, here = storage.parse_manifest(url), storage.parse_manifest(clean)
    assert remote.dataset_version == here.dataset_version == 2
    theirs, ours = (m.index_segments[-1].index["labels"].file.split("/")[1] for m in (remote, here))
    assert [e.file.replace(theirs, ours) for e in remote.files] == [e.file for e in here.files]
    for mine, local in zip(remote.files, here.files):
        assert Bucket(url).get(mine.file)[0] == (clean / local.file).read_bytes(), mine.file


def test_appends_killed_at_random_moments_and_inside_the_commit_land_once_and_leave_nothing_for_ever(
        server: S3Server, env: dict[str, str], grown, monkeypatch) -> None:
    """≥ KILLS kill -9s of `dsc append URL SRC` (the first while the proxy holds its upload, its version's PUT
    and manifest.json's), each followed by the same command run again while version N is all a reader sees. A
    reader between kills sees version 1 or 2, whole; each round ends as a clean append; what the killed ones
    uploaded is left by a prune within the grace and deleted by one after it."""
    tmp, _, _, b = grown
    v1 = records(tmp / "ds")
    clean = tmp / "clean"
    shutil.copytree(tmp / "ds", clean)
    append(clean, b, workers=1)
    v2 = records(clean)
    proxy = FaultProxy(server.endpoint)
    rng = random.Random(5)
    urls, kills, states = [], 0, []
    try:
        started = time.monotonic()
        assert not run_killed(["append", server.upload(tmp / "ds", BUCKET, prefix()), str(b), "-j", "1"], env,
                              proxy, None, None)[0]
        whole_s = time.monotonic() - started
        for k in range(3 * KILLS):
            if kills >= KILLS:
                break
            if not urls or seen(urls[-1], [v1, v2]) == 1:  # the last round's append landed: a new round
                urls.append(server.upload(tmp / "ds", BUCKET, prefix()))
            hold = APPEND_HOLDS[k] if k < len(APPEND_HOLDS) else None
            killed, _ = run_killed(["append", urls[-1], str(b), "-j", "1"], env, proxy,
                                   rng.uniform(0.2, 1.0) * whole_s, hold)
            kills += killed
            states.append(seen(urls[-1], [v1, v2]))
            assert states[-1] in (0, 1)
        if seen(urls[-1], [v1, v2]) == 0:
            assert not run_killed(["append", urls[-1], str(b), "-j", "1"], env, proxy, None, None)[0]
    finally:
        proxy.kill()
    assert kills >= KILLS and 0 in states and 1 in states, states
    strays = {url: unlisted(url) for url in urls}
    assert any(strays.values()), "no kill left an upload behind: the test did not reach the upload"
    for url in urls:
        assert seen(url, [v1, v2]) == 1 and storage.dataset_versions(url) == [1, 2]
        assert_a_clean_append(url, clean)
        assert all(name.startswith(f"{fmt.APPENDS_DIR}/") for name in strays[url])
        assert bucket_versions.prune(url, 2).removed_files == []  # within the grace: maybe a live append's
    monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", 0.0)  # a day later
    for url in urls:
        assert sorted(bucket_versions.prune(url, 2).removed_files) == sorted(strays[url])
        assert unlisted(url) == set()
        assert seen(url, [v1, v2]) == 1
        storage.verify_checksums(url, storage.parse_manifest(url))


def two_datasets(tmp_path: Path, server: S3Server, where: str) -> tuple[str, str, Path, Path]:
    """Datasets A (classes class_0, class_1) and B (class_1, eel), 6 records each in 2 whole shards, compiled
    here and uploaded under `where`: (A's URL, B's URL, A's folder, B's folder)."""
    make_folder(tmp_path / "a", classes=2, per_class=3)
    make_folder(tmp_path / "b", classes=2, per_class=3, seed=7)
    (tmp_path / "b" / "class_0").rename(tmp_path / "b" / "eel")
    for name in ("a", "b"):
        compile_folder(tmp_path / name, tmp_path / name.upper(), size=SIZE, records_per_shard=3, workers=1)
    return (server.upload(tmp_path / "A", BUCKET, f"{where}/A"), server.upload(tmp_path / "B", BUCKET, f"{where}/B"),
            tmp_path / "A", tmp_path / "B")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.strip().splitlines() if not line.startswith("warning: ")]


def test_two_merges_racing_into_one_prefix_never_mix_their_shards(server: S3Server, env: dict[str, str],
                                                                  tmp_path: Path) -> None:
    """`merge A B OUT` stopped by the proxy at its first shard's server-side copy (it found OUT empty); `merge B
    A OUT`, another process, copies its own shards to the same shard numbers and commits; then the first goes
    on. A reader of OUT sees the second merge whole, never a shard of the first; the first says in one line that
    it lost, and leaves nothing behind."""
    where = prefix()
    a, b, a_dir, b_dir = two_datasets(tmp_path, server, where)
    out = f"s3://{BUCKET}/{where}/M"
    merge([a_dir, b_dir], tmp_path / "AB")
    merge([b_dir, a_dir], tmp_path / "BA")
    expected = [records(tmp_path / "AB"), records(tmp_path / "BA")]
    proxy = FaultProxy(server.endpoint)
    try:
        proxy.hold(1, match="/shards/00000.bin", method="PUT")
        held = dsc(["merge", a, b, out], {**env, "AWS_ENDPOINT_URL": proxy.endpoint})
        deadline = time.monotonic() + RUN_S
        while held.poll() is None and not proxy.count("PUT", "/shards/00000.bin") and time.monotonic() < deadline:
            time.sleep(0.005)
        other = dsc(["merge", b, a, out], env)
        won = other.communicate(timeout=RUN_S)
        proxy.release()
        lost = held.communicate(timeout=RUN_S)
    finally:
        proxy.kill()
    assert other.returncode == 0, won
    assert seen(out, expected) == 1
    assert held.returncode == 1, lost
    assert error_lines(lost[1]) == [f"error: {out}: another merge or compile committed a dataset there first; this "
                                    "merge's objects were deleted and that dataset is untouched: merge into another "
                                    "prefix"], lost[1]
    assert storage.dataset_versions(out) == [1]
    storage.verify_checksums(out, storage.parse_manifest(out))
    assert unlisted(out) == set()  # the loser deleted its build


def test_a_killed_merge_is_named_by_the_next_one_and_cleaned_by_prune(server: S3Server, env: dict[str, str],
                                                                      tmp_path: Path, monkeypatch) -> None:
    """kill -9 of `dsc merge A B OUT` while its first shard's server-side copy, its checksums' and its index's
    uploads are in flight: no reader sees a dataset; nothing it left is "not a dsc dataset's" to a compile;
    `dsc prune` on the prefix (no dataset yet) names the young builds and leaves them, and a day later deletes
    them; the next merge names a killed one's build and commits beside it; a prune a day later deletes it."""
    where = prefix()
    a, b, a_dir, b_dir = two_datasets(tmp_path, server, where)
    out = f"s3://{BUCKET}/{where}/M"
    merge([a_dir, b_dir], tmp_path / "AB")
    expected = [records(tmp_path / "AB")]
    proxy = FaultProxy(server.endpoint)
    args = ["merge", a, b, out]
    try:
        for hold in [("PUT", "/shards/00000.bin"), ("PUT", "/checksums.bin"), ("PUT", "/labels.bin")]:
            assert run_killed(args, env, proxy, None, hold)[0]
            assert seen(out, expected) is None
        state = bucket_publish.survey(Bucket(out))
        assert state.foreign == [] and len(state.partial) == 3  # a compile --force would not refuse them
        pruned = dsc(["prune", out, "--keep", "1"], env)
        said = pruned.communicate(timeout=RUN_S)
        assert pruned.returncode == 0 and "no dataset yet (only partial builds)" in said[0], said
        assert "removed 0 versions and 0 files" in said[0]
        assert all(f"warning: left the partial build {out}/builds/{tag}/ in place" in said[1] for tag in state.partial)
        grace = bucket_publish.ABANDONED_AFTER_S
        monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", 0.0)  # a day later
        assert len(bucket_versions.prune(out, 1).removed_files) == sum(map(len, state.builds.values()))
        assert Bucket(out).list() == []
        monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", grace)
        assert run_killed(args, env, proxy, None, ("PUT", "/labels.bin"))[0]
        (left,) = bucket_publish.survey(Bucket(out)).partial
        killed, said = run_killed(args, env, proxy, None, None)
    finally:
        proxy.kill()
    assert not killed and f"warning: left the partial build {out}/builds/{left}/ in place" in said, said
    assert seen(out, expected) == 0
    assert bucket_publish.survey(Bucket(out)).partial == [left]
    monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", 0.0)
    removed = bucket_versions.prune(out, 1).removed_files
    assert removed and all(name.startswith(f"{fmt.build_folder(left)}/") for name in removed)
    assert unlisted(out) == set() and seen(out, expected) == 0


def _compile_child(env: dict[str, str], src: str, url: str, options: dict) -> None:
    os.environ.update(env)
    compile_folder(src, url, on_skip=lambda s, r: None, **options)


def test_force_leaves_the_partial_build_of_a_compile_still_running(server: S3Server, env: dict[str, str],
                                                                   tmp_path: Path, caplog) -> None:
    """A `--force` compile (a child process) stopped by the proxy after its shards are assembled, before its
    index; meanwhile another `--force` compile (this process) of other settings runs to its end. It names the
    running one's build and leaves it whole: both commit, each version whole."""
    src = make_folder(tmp_path / "src", classes=2, per_class=6, seed=1)
    options = {"size": SIZE, "records_per_shard": 4, "workers": 1}
    compile_folder(src, tmp_path / "s0", seed=0, **options)
    compile_folder(src, tmp_path / "s1", seed=1, **options)
    expected = [records(tmp_path / "s0"), records(tmp_path / "s1")]
    url = f"s3://{BUCKET}/{prefix()}"
    proxy = FaultProxy(server.endpoint)
    context = multiprocessing.get_context("spawn")
    try:
        proxy.hold(1, match="/labels.bin", method="PUT")
        running = context.Process(target=_compile_child, args=({**env, "AWS_ENDPOINT_URL": proxy.endpoint}, str(src),
                                                               url, {**options, "seed": 0, "force": True}))
        running.start()
        deadline = time.monotonic() + RUN_S
        while running.is_alive() and not proxy.count("PUT", "/labels.bin") and time.monotonic() < deadline:
            time.sleep(0.01)
        (tag,) = bucket_publish.survey(Bucket(url)).partial
        with caplog.at_level(logging.WARNING, logger="dsc"):
            compile_folder(src, url, seed=1, force=True, on_skip=lambda s, r: None, **options)
        proxy.release()
        running.join(RUN_S)
    finally:
        proxy.kill()
    assert running.exitcode == 0
    assert storage.dataset_versions(url) == [1, 2]
    assert seen(url, expected) == 0  # the compile that was running committed version 2, whole
    assert f"left the partial build {url}/builds/{tag}/ in place" in caplog.text
    version1 = storage.open_dataset(url, version=1)
    assert np.array_equal(version1.read_records(range(version1.manifest.count)), expected[1])
    for v in (1, 2):
        storage.verify_checksums(url, storage.parse_manifest(url, version=v))
    assert json.loads(Bucket(url).get(fmt.MANIFEST_FILE)[0])["dataset_version"] == 2


def test_prune_aborts_the_unfinished_uploads_a_killed_writer_left_once_abandoned(
        server: S3Server, env: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    """A writer killed in a multipart upload (a shard being composed, an append's large file) leaves parts that
    no listing of objects shows, stored and billed: `dsc prune` aborts those under the dataset once they are as
    old as an abandoned build, and never one for a name dsc does not give, nor a young one."""
    from dsc.storage import compose

    where = prefix()
    a, _, _, _ = two_datasets(tmp_path, server, where)
    client, root = compose.client(), f"{where}/A"
    mine, foreign = f"{root}/builds/0123456789abcdef/shards/00000.bin", f"{root}/notes/upload.bin"
    for key in (mine, foreign):  # as a killed writer leaves them: created, a part sent, never completed
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1024)

    def uploads() -> list[dict]:
        return client.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{root}/").get("Uploads", [])
    assert {u["Key"] for u in uploads()} == {mine, foreign}
    # moto reports one fixed initiation time (in 2010) for every upload: "young" is a grace longer than that age
    age = time.time() - min(u["Initiated"].timestamp() for u in uploads())
    monkeypatch.setattr(bucket_publish, "ABANDONED_AFTER_S", age + 3600)
    assert bucket_versions.prune(a, 1).aborted_uploads == [] and len(uploads()) == 2  # young: maybe still writing
    pruned = dsc(["prune", a, "--keep", "1"], env)  # the real grace (a day) against moto's age: abandoned
    said = pruned.communicate(timeout=RUN_S)
    assert pruned.returncode == 0 and "aborted 1 unfinished upload" in said[0], said
    assert [u["Key"] for u in uploads()] == [foreign]  # a name dsc does not give: never
    assert records(a) is not None  # the dataset itself untouched
