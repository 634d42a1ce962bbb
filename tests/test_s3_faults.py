"""Faults between dsc and a real S3 server (moto's, or $DSC_TEST_S3_ENDPOINT), made by a loopback
proxy of our own (tests/faultproxy.py): 503 SlowDown and connections cut mid-answer are retried
and the dataset serves the same batches; a persistent 503, a slow endpoint and a server killed
mid-download are one clear error within seconds that names the object and the tries, with nothing
partial left in the cache; a later open, the server back, completes. Retries are counted at the
proxy (what the server side saw), not by dsc's word."""

from __future__ import annotations

import logging
import multiprocessing
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsc import MemmapDataset
from dsc import format as fmt
from dsc.cli import app
from dsc.errors import StorageError
from dsc.reader import order as orders
from dsc.storage import ledger, s3, slots

from conftest import in_forked_child, tiny_dataset
from s3server import S3Server, serving  # skips this module when the server packages are missing

from faultproxy import FaultProxy  # isort: skip (after s3server, which may skip the module)

BUCKET = "dsc-fault-tests"
QUICK_S = 10  # ATTEMPTS tries with their pauses (0.25 + 0.5 + 1 s) fit well within this


server = serving(BUCKET)


@pytest.fixture(scope="module")
def proxy_running(server: S3Server):
    running = FaultProxy(server.endpoint)
    yield running
    running.kill()


@pytest.fixture
def proxy(proxy_running: FaultProxy) -> FaultProxy:
    """The proxy, listening, with no faults armed."""
    proxy_running.clear()
    if proxy_running.server is None:
        proxy_running.start()
    return proxy_running


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp("s3-faults-local"), seed=5, records_per_shard=5)  # 24 records


@pytest.fixture
def env(server: S3Server, proxy: FaultProxy, monkeypatch, tmp_path: Path) -> Path:
    """The AWS environment pointing dsc at the proxy (not the server), and a fresh cache (returned)."""
    server.point_at(monkeypatch, proxy.endpoint)
    monkeypatch.delenv(s3.TIMEOUT_ENV, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSC_CACHE_DIR", str(cache))
    return cache


_uploads = iter(range(1 << 30))


@pytest.fixture
def url(server: S3Server, local) -> str:
    return server.upload(local.path, BUCKET, f"faults/tiny-{next(_uploads)}")


def key(url: str, name: str) -> str:
    """The request path of a dataset file (path-style: /bucket/prefix/name)."""
    return f"/{url.removeprefix('s3://')}/{name}"


def same_batches(remote: MemmapDataset, local: MemmapDataset) -> None:
    for order in orders.ORDERS:
        got = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}
               for b in remote.loader(5, order=order, seed=3)]
        want = [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}
                for b in local.loader(5, order=order, seed=3)]
        assert len(got) == len(want) == 5
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)


def read_all(ds: MemmapDataset) -> torch.Tensor:
    """Every record, in record order: one coalesced ranged GET per shard (24 records of 192 bytes)."""
    return ds.__getitems__(list(range(len(ds)))).images


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.rglob("*.tmp"))


# ----------------------------------------------------------------------------- transient faults

@pytest.mark.parametrize("fault", ["slow_down", "drop"])
def test_a_transient_fault_is_retried_and_the_batches_are_identical(env: Path, url: str, local, proxy: FaultProxy,
                                                                     fault: str) -> None:
    shard = fmt.shard_file(2)
    getattr(proxy, fault)(2, match=key(url, shard))  # the next two GETs of shard 2 fail, the third succeeds
    remote = MemmapDataset(url, cache_dir=env)
    read_all(remote)
    assert proxy.count("GET", key(url, shard), action=fault) == 2  # the server side saw both failures...
    assert proxy.count("GET", key(url, shard), action="forwarded") == 1  # ...and then one good answer
    assert proxy.count("GET", key(url, fmt.shard_file(1))) == 1  # the other files: one GET each
    same_batches(remote, local)
    assert leftovers(env) == []


def test_a_short_delay_within_the_timeout_is_no_error(env: Path, url: str, local, proxy: FaultProxy,
                                                       monkeypatch) -> None:
    monkeypatch.setenv(s3.TIMEOUT_ENV, "5")
    proxy.delay(0.5, 1, match=key(url, fmt.shard_file(0)))
    same_batches(MemmapDataset(url, cache_dir=env), local)
    assert proxy.count("GET", key(url, fmt.shard_file(0))) == 1  # answered late, not retried


def test_an_open_asks_for_the_index_files_together_not_one_by_one(env: Path, url: str, local,
                                                                  proxy: FaultProxy) -> None:
    """Each request waits a round trip (tens of ms to a real endpoint, 44 ms to radosgw on loopback), so an open
    asks for the index files together: held at the proxy, they are all in flight at once (asked one by one, the
    first held would hold up the others)."""
    index = [e.file for e in local.manifest.files if e.bytes and not e.file.startswith(f"{fmt.SHARD_DIR}/")
             and not e.file.endswith(fmt.SHARD_TABLE_FILE)]  # (the shard table is read to parse the manifest)
    assert len(index) >= 4
    for name in index:
        proxy.hold(1, match=key(url, name))
    opened: list[MemmapDataset] = []
    opener = threading.Thread(target=lambda: opened.append(MemmapDataset(url, cache_dir=env)), daemon=True)
    opener.start()
    together = min(len(index), s3.OPEN_REQUESTS)
    deadline = time.monotonic() + QUICK_S
    ours = key(url, "")
    while proxy.count("GET", ours, action="hold") < together and time.monotonic() < deadline:
        time.sleep(0.05)
    held = proxy.count("GET", ours, action="hold")
    proxy.release()
    opener.join(timeout=60)
    assert held == together  # asked before any of them was answered
    same_batches(opened[0], local)


def test_a_run_of_records_is_fetched_in_pieces_each_placed_as_it_comes(env: Path, url: str, local,
                                                                      proxy: FaultProxy, monkeypatch) -> None:
    """A coalesced run is asked for in GETs of `slots.PIECE_BYTES` (fewer, longer answers left the client and
    the server waiting on each other), and the records are the local dataset's."""
    monkeypatch.setattr(slots, "PIECE_BYTES", 2 * local.manifest.record_bytes)
    remote = MemmapDataset(url, cache_dir=env)
    assert torch.equal(read_all(remote), read_all(local))  # one run per shard of 5 records: pieces of 2, 2, 1
    pieces = [-(-e.bytes // slots.PIECE_BYTES) for e in local.manifest.shards]
    assert pieces == [3, 3, 3, 3, 2]  # (the last shard holds 4 records)
    assert [proxy.count("GET", key(url, fmt.shard_file(s))) for s in range(5)] == pieces
    same_batches(remote, local)


def test_the_loaders_fetched_bytes_are_what_the_server_sent(env: Path, url: str, local, proxy: FaultProxy) -> None:
    """`stats()`'s bytes fetched and requests are the records' GETs counted at the proxy, also with a cache of
    a third of the records, which fetches some twice (the node-budget test counts a second epoch's bytes by
    them)."""
    count, rb = local.manifest.count, local.manifest.record_bytes
    cost = slots.record_cost(rb, slots.block_size(env.parent))

    def two_epochs(folder: str, bound: dict) -> int:
        before_bytes, before_gets = proxy.served("GET", "/shards/"), proxy.answered("GET", "/shards/")
        remote = MemmapDataset(url, cache_dir=env / folder, **bound)
        loader = remote.loader(2, order="random", seed=1)
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        records = remote.opened.records
        records.close()  # its fetches ended (the next epoch's first batches are fetched while a pass ends)
        assert records.stats.fetched_bytes == proxy.served("GET", "/shards/") - before_bytes
        assert records.stats.requests == proxy.answered("GET", "/shards/") - before_gets  # (a try the machine's
        # load failed upstream and the client made again is not one of the loader's requests)
        return records.base_bytes, records.stats.fetched_bytes

    index, everything = two_epochs("whole", {})
    third = index + ledger.TABLE_BYTES + count * ledger.NEXT_DTYPE.itemsize + count // 3 * cost
    _, bounded = two_epochs("third", {"cache_bytes": third})
    fetched = [everything, bounded]
    assert fetched[0] == count * rb < fetched[1]  # everything once; then some records twice


# ----------------------------------------------------------------------------- persistent faults

def test_a_persistent_503_is_one_clear_error_naming_the_object_and_the_tries(env: Path, url: str,
                                                                             proxy: FaultProxy) -> None:
    shard = fmt.shard_file(1)
    proxy.slow_down(1000, match=key(url, shard))
    began = time.monotonic()
    with pytest.raises(StorageError) as raised:
        read_all(MemmapDataset(url, cache_dir=env))
    took = time.monotonic() - began
    message = str(raised.value)
    assert message.splitlines() == [message]  # one line
    assert message.startswith(f"{url}/{shard}: GET failed {s3.ATTEMPTS} times in "), message
    assert message.endswith("; last: HTTP 503 Service Unavailable (SlowDown)"), message
    assert proxy.count("GET", key(url, shard)) == s3.ATTEMPTS  # tried exactly that often, no more
    assert 0.25 + 0.5 + 1 <= took < QUICK_S  # with the pauses between tries, and bounded
    assert not list(env.rglob(f"records/{shard[7:12]}/*.bin")) and leftovers(env) == []


def test_a_slow_endpoint_beyond_the_timeout_is_a_clear_error_not_a_hang(env: Path, url: str, proxy: FaultProxy,
                                                                        monkeypatch) -> None:
    monkeypatch.setenv(s3.TIMEOUT_ENV, "0.5")
    shard = fmt.shard_file(3)
    proxy.delay(3, 1000, match=key(url, shard))  # each answer 3 s late: every try times out
    began = time.monotonic()
    with pytest.raises(StorageError) as raised:
        read_all(MemmapDataset(url, cache_dir=env))
    took = time.monotonic() - began
    message = str(raised.value)
    assert message.startswith(f"{url}/{shard}: GET failed {s3.ATTEMPTS} times in "), message
    assert message.endswith(f"; last: no complete answer within 0.5 s (the limit per request; "
                            f"${s3.TIMEOUT_ENV} sets it)"), message
    assert proxy.count("GET", key(url, shard)) == s3.ATTEMPTS
    assert took < s3.ATTEMPTS * 0.5 + 1.75 + 3  # never waited for the slow answers
    assert not list(env.rglob(f"records/{shard[7:12]}/*.bin")) and leftovers(env) == []


def test_a_bad_timeout_setting_is_named(env: Path, url: str, monkeypatch) -> None:
    monkeypatch.setenv(s3.TIMEOUT_ENV, "soon")
    with pytest.raises(StorageError, match=f"{s3.TIMEOUT_ENV}=soon: expected seconds per request"):
        MemmapDataset(url, cache_dir=env)


# ----------------------------------------------------------------------------- a server killed

def test_a_server_killed_mid_download_leaves_nothing_partial_and_a_later_open_completes(
        env: Path, url: str, local, proxy: FaultProxy) -> None:
    shard = fmt.shard_file(3)
    proxy.kill_mid_response(match=key(url, shard))  # half of shard 3's bytes, then the server is gone
    began = time.monotonic()
    with pytest.raises(StorageError) as raised:
        read_all(MemmapDataset(url, cache_dir=env))
    message = str(raised.value)
    # the shards are fetched at once: whichever GET the reader waits on first names the error (the cut one,
    # or on a slower server one that found the server gone), each with the tries it made
    assert re.fullmatch(rf"{re.escape(url)}/{fmt.SHARD_DIR}/\d{{5}}\.bin: GET failed {s3.ATTEMPTS} times in "
                        r"[\d.]+ s; last: connection refused \(nothing listens at the endpoint\)", message), message
    assert time.monotonic() - began < QUICK_S
    assert proxy.count("GET", key(url, shard)) == 1  # the server saw one try; the others found no server
    assert proxy.server is None
    assert not list(env.rglob(f"records/{shard[7:12]}/*.bin")) and leftovers(env) == []  # nothing partial in place
    folder = next(p for p in env.iterdir() if p.is_dir())  # the dataset's (beside the manifest's lock)
    placed = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")}

    proxy.restart()  # the server is back, on the same port
    before = len(proxy.seen)
    remote = MemmapDataset(url, cache_dir=env)
    same_batches(remote, local)
    again = {s.path for s in proxy.seen[before:] if s.method == "GET"}
    assert key(url, shard) in again
    whole = {fmt.shard_file(k) for k, s in enumerate(local.manifest.shards)
             if all(f"records/{k:05d}/{j}.bin" in placed for j in range(s.records))}
    kept = {name for name in placed if not name.startswith("records/")} | whole
    assert kept - {fmt.MANIFEST_FILE} and not {key(url, name) for name in kept if name != fmt.MANIFEST_FILE} & again
    assert leftovers(env) == []


def _open_only(url: str, cache: str) -> None:
    MemmapDataset(url, cache_dir=cache)


def test_a_temporary_a_process_killed_mid_download_left_is_removed_by_the_next_download(
        env: Path, url: str, local, proxy: FaultProxy) -> None:
    """A rank killed while its GET of an index file hangs leaves that file's temporary; the next process to
    download the file (under its lock, which every download holds while it writes) removes it. A file at a
    name of that shape that is not a regular file, or a name dsc does not make, is left alone."""
    labels = local.manifest.index_segments[0].index["labels"].file
    proxy.hold(1, match=key(url, labels))
    rank = multiprocessing.get_context("spawn").Process(target=_open_only, args=(url, str(env)), daemon=True)
    rank.start()
    deadline = time.monotonic() + 60
    while proxy.count("GET", key(url, labels), action="hold") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    rank.kill()
    rank.join(timeout=30)
    proxy.release()
    left = sorted(env.rglob(f".{Path(labels).name}.*{s3.TEMP_SUFFIX}"))
    assert len(left) == 1 and left[0].is_file()  # the killed download's
    folder = left[0].parent
    planted = folder / f".{Path(labels).name}.{'0' * 16}{s3.TEMP_SUFFIX}"
    planted.mkdir()  # dsc's shape of name, but a folder: not dsc's
    foreign = folder / f".{Path(labels).name}.notes{s3.TEMP_SUFFIX}"
    foreign.write_text("mine")
    same_batches(MemmapDataset(url, cache_dir=env), local)
    assert not left[0].exists() and planted.is_dir() and foreign.read_text() == "mine"


def test_a_server_killed_after_open_does_not_disturb_the_epoch(env: Path, url: str, local,
                                                               proxy: FaultProxy) -> None:
    remote = MemmapDataset(url, cache_dir=env)
    read_all(remote)
    proxy.kill()  # mid-epoch: everything this process reads is in the node's cache already
    same_batches(remote, local)


# ----------------------------------------------------------------------------- once per node, and offline

def _open_and_read(url: str, cache: str, start, answers) -> None:
    """A rank of the node: waits for the others, opens the dataset on the shared cache, reads two records."""
    start.wait(timeout=60)
    remote = MemmapDataset(url, cache_dir=cache)
    answers.put(int(remote.__getitems__([0, 23]).images.sum()))


def test_ranks_of_a_node_fetch_the_manifest_and_index_once(env: Path, url: str, local, proxy: FaultProxy) -> None:
    """Two ranks opening at once (spawned: each its own client) GET the manifest and each index file once
    between them, counted at the server side; each asks one HEAD of the manifest (is it still the one cached?)."""
    context = multiprocessing.get_context("spawn")
    start, answers = context.Barrier(2), context.Queue()
    ranks = [context.Process(target=_open_and_read, args=(url, str(env), start, answers)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    got = [answers.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0
    assert got == [int(local.__getitems__([0, 23]).images.sum())] * 2
    assert proxy.count("GET", key(url, fmt.MANIFEST_FILE)) == 1
    assert proxy.count("HEAD", key(url, fmt.MANIFEST_FILE)) == 2
    index = {e.file: min(1, e.bytes) for e in local.manifest.files if not e.file.startswith(f"{fmt.SHARD_DIR}/")}
    assert sum(index.values()) >= 4  # an empty file (no skips) is not fetched at all
    assert {n: proxy.count("GET", key(url, n)) for n in index} == index
    MemmapDataset(url, cache_dir=env)  # a later open: its HEAD, nothing fetched
    assert proxy.count("GET", key(url, fmt.MANIFEST_FILE)) == 1
    assert proxy.count("HEAD", key(url, fmt.MANIFEST_FILE)) == 3


def test_a_changed_manifest_is_fetched_again(server: S3Server, env: Path, url: str, local, proxy: FaultProxy,
                                             tmp_path: Path) -> None:
    first = MemmapDataset(url, cache_dir=env)
    other = tiny_dataset(tmp_path / "other", seed=9, records_per_shard=5)  # other records under the same URL
    server.upload(other.path, BUCKET, url.removeprefix(f"s3://{BUCKET}/"))
    second = MemmapDataset(url, cache_dir=env)
    assert proxy.count("GET", key(url, fmt.MANIFEST_FILE)) == 2
    assert first.opened.local_root != second.opened.local_root
    assert torch.equal(second.__getitems__([0, 5]).images, other.__getitems__([0, 5]).images)


@pytest.mark.parametrize("dead", ["refusing", "silent"])
def test_offline_what_the_cache_holds_opens_with_one_warning_and_the_rest_is_a_quick_error(
        env: Path, url: str, local, proxy: FaultProxy, caplog, monkeypatch, dead: str) -> None:
    read = [0, 1, 2, 7, 23]
    MemmapDataset(url, cache_dir=env).__getitems__(read)
    if dead == "refusing":
        proxy.kill()  # the endpoint is unreachable from now on
        reason = "connection refused"
    else:  # it takes connections and never answers within the limit per request
        monkeypatch.setenv(s3.TIMEOUT_ENV, "0.5")
        for method in ("HEAD", "GET"):
            proxy.delay(2.0, 100, method=method)
        reason = "no complete answer within 0.5 s"
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dsc"):
        remote = MemmapDataset(url, cache_dir=env)
    assert time.monotonic() - began < QUICK_S
    warned = [r.getMessage() for r in caplog.records if r.name == "dsc"]
    assert len(warned) == 1 and "\n" not in warned[0], warned
    assert warned[0].startswith(f"{url}: the endpoint cannot be reached ({reason}"), warned
    assert torch.equal(remote.__getitems__(read).images, local.__getitems__(read).images)
    began = time.monotonic()
    with pytest.raises(StorageError) as raised:
        remote.__getitems__([12])  # not in the cache
    assert time.monotonic() - began < QUICK_S
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{url}/{fmt.shard_file(2)}: GET failed {s3.ATTEMPTS} times")

    info = subprocess.run([sys.executable, "-m", "dsc", "info", url], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and info.stdout.startswith(f"{url}: dsc format"), info.stderr
    assert info.stderr.splitlines() == [warned[0]], info.stderr  # the warning, one line, and nothing else


def test_offline_a_dataset_never_cached_is_one_clear_error_within_seconds(env: Path, url: str,
                                                                          proxy: FaultProxy) -> None:
    proxy.kill()
    began = time.monotonic()
    with pytest.raises(StorageError) as raised:
        MemmapDataset(url, cache_dir=env)
    assert time.monotonic() - began < QUICK_S
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{url}/{fmt.VERSIONS_DIR}/: LIST failed {s3.ATTEMPTS} times")
    assert message.endswith(f"the cache {env} holds no copy of this dataset's manifest fetched through the endpoint "
                            f"{proxy.endpoint}, to open it without the endpoint"), message
    result = CliRunner().invoke(app, ["info", url])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "holds no copy" in result.stderr, result.stderr


# ----------------------------------------------------------------------------- fork during a fetch

def test_a_child_forked_while_its_parent_fetches_fetches_for_itself(env: Path, url: str, local,
                                                                     proxy: FaultProxy) -> None:
    """The parent's fetch in flight at the fork never ends in the child (its thread is not there): the child
    fetches what it needs itself (through its helper) instead of waiting for it forever."""
    remote = MemmapDataset(url, cache_dir=env)
    proxy.delay(3.0, 1, match=key(url, fmt.shard_file(1)))  # the parent's GET of record 5 answers late
    parent = threading.Thread(target=remote.__getitems__, args=([5],))
    parent.start()
    deadline = time.monotonic() + QUICK_S
    while not (proxy.count("GET", key(url, fmt.shard_file(1))) and remote.opened.records._pending) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote.opened.records._pending  # in flight now, its answer 3 s away
    status, answer = in_forked_child(lambda: str(int(remote.__getitems__([5, 6]).images.sum())))
    parent.join(timeout=60)
    assert status == 0 and answer == str(int(local.__getitems__([5, 6]).images.sum())), (status, answer)


def test_offline_a_versioned_dataset_the_node_opened_opens_from_the_cache(server: S3Server, env: Path, url: str,
                                                                         local, proxy: FaultProxy, caplog) -> None:
    """A dataset with versions/ (every one compiled or grown in a bucket) is opened through versions/N.json, not
    manifest.json: that copy too is what an open finds when the endpoint stops answering."""
    prefix = url.removeprefix(f"s3://{BUCKET}/")
    server.put(BUCKET, f"{prefix}/{fmt.version_file(1)}", (local.path / fmt.MANIFEST_FILE).read_bytes())
    read = [0, 7, 23]
    MemmapDataset(url, cache_dir=env).__getitems__(read)
    assert proxy.count("GET", key(url, fmt.version_file(1))) == 1
    proxy.kill()
    with caplog.at_level(logging.WARNING, logger="dsc"):
        remote = MemmapDataset(url, cache_dir=env)
    warned = [r.getMessage() for r in caplog.records if r.name == "dsc"]
    assert len(warned) == 1 and warned[0].startswith(f"{url}: the endpoint cannot be reached"), warned
    assert torch.equal(remote.__getitems__(read).images, local.__getitems__(read).images)


def test_offline_the_latest_version_the_node_read_opens_and_others_by_number(env: Path, url: str, local, server,
                                                                            proxy: FaultProxy, caplog,
                                                                            tmp_path: Path) -> None:
    """Offline, "the latest" is the version this node last read as the latest: not the copy it read last (here
    version 1, opened by number after version 2), nor, once the prefix was emptied and compiled anew (version 1
    again), the old dataset's higher version. Another version it holds opens by number; one it lacks is one line
    naming those it holds."""
    from dsc.compiler.append import append
    from dsc.storage.bucket import Bucket

    append(url, local.path.parent / "src", workers=1, again=True)  # version 2: the same 24 images again
    assert (MemmapDataset(url, cache_dir=env).version, len(MemmapDataset(url, cache_dir=env))) == (2, 48)
    assert len(MemmapDataset(url, cache_dir=env, version=1)) == 24  # read last
    proxy.kill()
    with caplog.at_level(logging.WARNING, logger="dsc"):
        latest = MemmapDataset(url, cache_dir=env)
    assert (latest.version, len(latest)) == (2, 48)
    warned = [r.getMessage() for r in caplog.records if r.name == "dsc"]
    assert len(warned) == 1 and "opened version 2, the latest it read, from the copy cached in" in warned[0], warned
    assert (MemmapDataset(url, cache_dir=env, version=1).version, len(MemmapDataset(url, cache_dir=env, version=1))) \
        == (1, 24)
    with pytest.raises(StorageError, match=r"holds no copy of this dataset's version 3's manifest fetched through the "
                                           r"endpoint http://127.0.0.1:\d+, to open it without the endpoint \(it holds "
                                           r"copies of versions 1 to 2\)$"):
        MemmapDataset(url, cache_dir=env, version=3)

    proxy.start()  # the prefix emptied, and another dataset uploaded there: its version 1
    for info in Bucket(url).list():
        Bucket(url).delete(info.name)
    other = tiny_dataset(tmp_path / "other", seed=9, records_per_shard=5)
    server.upload(other.path, BUCKET, url.removeprefix(f"s3://{BUCKET}/"))
    fresh = MemmapDataset(url, cache_dir=env)
    assert fresh.version == 1 and torch.equal(fresh.__getitems__([0, 5]).images, other.__getitems__([0, 5]).images)
    proxy.kill()
    offline = MemmapDataset(url, cache_dir=env)
    assert offline.version == 1 and torch.equal(offline.__getitems__([0, 5]).images, other.__getitems__([0, 5]).images)
