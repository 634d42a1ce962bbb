"""Datasets in an S3-compatible bucket, against a real S3 server on 127.0.0.1 (moto's, over HTTP):
the same batches as the local dataset, a node-local cache that downloads each file once and never
touches what it did not create, corruption named, a dead endpoint a quick clear error, and
DataLoader workers started by fork and by spawn."""

from __future__ import annotations

import gc
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from typer.testing import CliRunner

from dsc import MemmapDataset
from dsc import format as fmt
from dsc.cli import app
from dsc.errors import DatasetError, LoaderError
from dsc.reader import order as orders
from dsc.storage import ledger, open_dataset, s3, slots

from conftest import in_forked_child, tiny_dataset
from s3server import S3Server, closed_port, serving  # skips this module when the server packages are missing

BUCKET = "dsc-tests"
JOIN_S = 120  # a DataLoader worker that hangs fails the test instead


server = serving(BUCKET)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("s3-local"), seed=4, records_per_shard=5)  # 24 records, 5 shards


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> Path:
    """The AWS environment pointing at the loopback server, and a fresh cache folder (returned)."""
    server.point_at(monkeypatch)
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSC_CACHE_DIR", str(cache))
    return cache


_uploads = iter(range(1 << 30))


@pytest.fixture
def url(server: S3Server, local: MemmapDataset) -> str:
    """A fresh upload of the local dataset under its own prefix (tests may damage theirs)."""
    return server.upload(local.path, BUCKET, f"sets/tiny-{next(_uploads)}")


def cached_files(cache: Path) -> dict[str, tuple[int, int]]:
    """'/'-path -> (inode, mtime_ns) of every file in the cache folder."""
    return {p.relative_to(cache).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(cache.rglob("*")) if p.is_file()}


def batches(ds: MemmapDataset, order: str) -> list[dict]:
    return [{k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)}
            for b in ds.loader(5, order=order, seed=7)]


# ----------------------------------------------------------------------------- reading

@pytest.mark.parametrize("order", orders.ORDERS)
def test_an_s3_dataset_serves_the_same_batches_as_the_local_one(env: Path, url: str, local: MemmapDataset,
                                                                order: str) -> None:
    remote = MemmapDataset(url, cache_dir=env)
    assert len(remote) == len(local) and remote.classes == local.classes and remote.path == url
    got, want = batches(remote, order), batches(local, order)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
    assert torch.equal(remote[23].image, local[23].image)


def read_all(ds: MemmapDataset) -> torch.Tensor:
    return ds.__getitems__(list(range(len(ds)))).images


def held_records(cache: Path) -> set[int]:
    """The records the cache under `cache` holds (its one dataset's state of the records)."""
    states = list(cache.rglob(f"{slots.SLOT_DIR}/{slots.STATE_FILE}"))
    assert len(states) <= 1
    return set(np.flatnonzero(np.fromfile(states[0], slots.STATE_DTYPE) & 1).tolist()) if states else set()


def test_the_cache_is_keyed_by_the_manifest_and_holds_each_record_read(env: Path, url: str,
                                                                       local: MemmapDataset) -> None:
    remote = MemmapDataset(url)  # cache_dir from $DSC_CACHE_DIR
    folder = env / hashlib.sha256((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    assert remote.opened.local_root == folder
    assert held_records(env) == set()  # opening fetches the index, no record
    assert torch.equal(remote.__getitems__([7, 3]).images, local.__getitems__([7, 3]).images)
    assert held_records(env) == {3, 7}
    assert sorted(p.name for p in (folder / slots.SLOT_DIR).glob("*.bin")) == ["00000.bin", "00001.bin", "state.bin"]
    rb = local.manifest.record_bytes  # record 7 is record 2 of shard 1, at its offset in the shard
    assert (folder / "slots/00001.bin").read_bytes()[2 * rb:3 * rb] == local.opened.shards[1][2].tobytes()


def test_a_second_open_on_the_node_downloads_nothing(server: S3Server, env: Path, url: str,
                                                     local: MemmapDataset) -> None:
    first = MemmapDataset(url, cache_dir=env)  # kept alive: while it lives, the node's default cache_bytes is
    read_all(first)  # its (`ledger.node_default`); the first process gone, a later open computes it anew
    before = cached_files(env)
    for entry in local.manifest.files:  # only the manifest stays in the bucket: nothing else can be fetched
        server.delete(BUCKET, f"{url.split('/', 3)[3]}/{entry.file}")
    again = MemmapDataset(url, cache_dir=env)
    assert torch.equal(read_all(again), read_all(local))
    assert cached_files(env) == before  # not one file written, renamed or replaced
    assert any(name.endswith(fmt.MANIFEST_FILE) for name in before)


def test_a_damaged_cached_record_is_fetched_again(env: Path, url: str, local: MemmapDataset) -> None:
    remote = MemmapDataset(url, cache_dir=env)
    read_all(remote)
    path, rb = remote.opened.local_root / "slots/00002.bin", local.manifest.record_bytes  # record 11: 1 of shard 2

    def damage() -> None:
        with open(path, "r+b") as f:
            f.seek(rb + 5)
            f.write(bytes([f.read(1)[0] ^ 0xFF]))  # same size: only its CRC-32 can tell
            f.seek(rb + 5)

    for _ in range(2):  # damaged in place, then read by a process that has not checked it: checked, fetched again
        damage()
        again = MemmapDataset(url, cache_dir=env)
        assert torch.equal(again.__getitems__([10, 11]).images, local.__getitems__([10, 11]).images)
        assert path.read_bytes()[rb:2 * rb] == local.opened.shards[2][1].tobytes()  # put right in place
        assert again.opened.records.stats.fetched_bytes == rb


def test_a_corrupted_object_is_named_and_never_served(server: S3Server, env: Path, url: str,
                                                      local: MemmapDataset) -> None:
    name = fmt.shard_file(1)
    data = bytearray((Path(local.path) / name).read_bytes())
    data[17 + 192] ^= 0xFF  # record 6 (1 of shard 1; 192 bytes each), same size: only the checksum can tell
    server.put(BUCKET, f"{url.split('/', 3)[3]}/{name}", bytes(data))
    remote = MemmapDataset(url, cache_dir=env)
    assert torch.equal(remote.__getitems__([5, 7]).images, local.__getitems__([5, 7]).images)  # its neighbours
    with pytest.raises(DatasetError, match=rf"{url}/{name}: record 6 \(bytes 192-383 of the object\) has CRC-32 "
                                           r"[0-9a-f]{8}, but checksums.bin says [0-9a-f]{8}; fetched 2 times"):
        remote.__getitems__([6])
    assert not list(env.rglob("records/00001/1.bin"))  # nothing wrong was put in place
    assert [p.name for p in env.rglob("*.tmp")] == []  # and no temporary file left behind


def test_a_missing_object_is_named(server: S3Server, env: Path, url: str) -> None:
    name = fmt.shard_file(3)
    server.delete(BUCKET, f"{url.split('/', 3)[3]}/{name}")
    remote = MemmapDataset(url, cache_dir=env)  # shards are not asked for at open: their ranges are checked
    with pytest.raises(DatasetError, match=rf"{url}/{name}: missing"):
        remote.__getitems__([15])
    name = fmt.LABELS_FILE
    server.delete(BUCKET, f"{url.split('/', 3)[3]}/{name}")
    with pytest.raises(DatasetError, match=rf"{url}/{name}: missing \(segments\[0\].index.labels in the manifest\)"):
        MemmapDataset(url, cache_dir=env.parent / "other-cache")


def test_no_dataset_at_the_prefix_is_a_clear_error(env: Path, server: S3Server) -> None:
    with pytest.raises(DatasetError, match=rf"s3://{BUCKET}/nothing/here: no manifest.json"):
        MemmapDataset(f"s3://{BUCKET}/nothing/here", cache_dir=env)


def test_a_dead_endpoint_is_a_clear_error_within_seconds(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    began = time.monotonic()
    with pytest.raises(DatasetError, match=rf"s3://{BUCKET}/x/versions/: LIST failed {s3.ATTEMPTS} times in "):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)
    assert time.monotonic() - began < 10


def test_plain_http_is_refused_for_an_endpoint_off_this_machine(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://192.0.2.1:9000")  # TEST-NET-1: never contacted
    with pytest.raises(DatasetError, match="plain http is allowed only to a loopback address"):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)


def test_a_cache_too_small_for_the_index_is_refused_at_open_naming_the_minimum(env: Path, url: str,
                                                                              local: MemmapDataset) -> None:
    files = [e for e in local.manifest.files if not e.file.startswith("shards/")]
    need = len((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()) + sum(e.bytes + s3.SEAL_MAX for e in files) + \
        slots.state_bytes(local.manifest.count) + ledger.TABLE_BYTES + \
        slots.record_cost(192, slots.block_size(env.parent))
    with pytest.raises(DatasetError, match=rf"cache_bytes={need - 1} cannot hold this dataset's index, the node's "
                                           rf"table and one record: at least {need} bytes are needed"):
        MemmapDataset(url, cache_dir=env, cache_bytes=need - 1)
    assert not list(env.rglob("*.bin"))  # refused before anything was fetched
    with pytest.raises(DatasetError) as refused:
        MemmapDataset(url, cache_dir=env, cache_bytes=1000)
    named = int(re.search(r"at least (\d+) bytes are needed", str(refused.value)).group(1))
    at_least = MemmapDataset(url, cache_dir=env, cache_bytes=named)
    for i in (0, 23, 7):  # the minimum it names reads every record, one at a time
        assert np.array_equal(at_least[i].image.numpy(), local[i].image.numpy())


def test_a_shard_table_copy_is_named_by_its_sealed_sha256_and_a_damaged_one_is_fetched_again(
        env: Path, url: str, local: MemmapDataset) -> None:
    (table,) = {t.file: t for t in local.manifest.shard_tables}.values()  # format 1.4: one table
    want = [0, 7, 23]
    first = MemmapDataset(url, cache_dir=env)
    copy = env / s3.TABLES_DIR / table.sha256  # kept once per node, outside the dataset's folder
    assert copy.read_bytes() == (Path(local.path) / table.file).read_bytes()
    assert (first.opened.local_root / table.file).read_bytes() == copy.read_bytes()  # the folder's, from it
    (first.opened.local_root / table.file).unlink()
    copy.write_bytes(bytes(table.bytes))  # damaged: the right size, the wrong SHA-256
    again = MemmapDataset(url, cache_dir=env)  # not trusted: fetched again, the dataset opens
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == table.sha256
    assert torch.equal(again.__getitems__(want).images, local.__getitems__(want).images)


def test_the_default_cache_bytes_is_half_the_free_space_for_the_whole_node(
        env: Path, url: str, local: MemmapDataset, monkeypatch) -> None:
    """The node's processes share one budget (dsc.storage.ledger), so a rank's default is not split again."""
    monkeypatch.setattr(s3, "free_bytes", lambda path: 1000)  # a nearly full disk, without filling one
    folder = env / hashlib.sha256((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()).hexdigest()

    def refused_default() -> int:
        with pytest.raises(DatasetError, match=r"cache_bytes=\d+ cannot hold this dataset's index, ") as refused:
            MemmapDataset(url, cache_dir=env)
        return int(re.search(r"cache_bytes=(\d+)", str(refused.value)).group(1))
    first = refused_default()
    assert first == 500 + len((Path(local.path) / fmt.MANIFEST_FILE).read_bytes())  # half the free space, and
    # what the folder held: the manifest's copy (the node's table is made after)
    table = (folder / ledger.NODE_DIR / ledger.TABLE_FILE).stat()  # made since, its blocks reserved
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: 4 ranks of this node share the cache and its disk
    assert refused_default() == first + min(table.st_size, table.st_blocks * 512) + len(str(first))  # not split
    # by 4: what the folder holds now, the table and the default the first open wrote for the node, added


def test_the_cache_never_touches_files_it_did_not_create(env: Path, url: str, local: MemmapDataset) -> None:
    key = hashlib.sha256((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    foreign = {env / "notes.txt": b"mine", env / key / "README": b"also mine",
               env / key / fmt.SHARD_DIR / "00000.bin.bak": b"a backup", env / "other" / "x.bin": b"x"}
    for path, data in foreign.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    stamps = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in foreign}
    MemmapDataset(url, cache_dir=env)
    assert {p: p.read_bytes() for p in foreign} == foreign
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in foreign} == stamps


def test_a_link_planted_at_a_cached_name_is_refused_not_followed(env: Path, url: str, local: MemmapDataset,
                                                                 tmp_path: Path) -> None:
    key = hashlib.sha256((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    link = env / key / fmt.LABELS_FILE
    link.parent.mkdir(parents=True)
    link.symlink_to(target)  # an index file's name
    with pytest.raises(DatasetError, match="not a regular file; the cache of .* leaves it alone"):
        MemmapDataset(url, cache_dir=env)
    assert target.read_bytes() == b"precious" and link.is_symlink()
    link.unlink()
    record = env / key / "slots/00000.bin"  # the slot file of shard 0
    record.parent.mkdir(parents=True)
    record.symlink_to(target)
    with pytest.raises(DatasetError, match="00000.bin: not a regular file; the cache of .* leaves it alone"):
        MemmapDataset(url, cache_dir=env).__getitems__([0])
    assert target.read_bytes() == b"precious" and record.is_symlink()


def test_cache_dir_has_no_meaning_for_a_folder(local: MemmapDataset, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_dir and cache_bytes are for datasets in object storage"):
        MemmapDataset(local.path, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="cache_dir and cache_bytes are for datasets in object storage"):
        MemmapDataset(local.path, cache_bytes=1 << 20)


def test_an_unknown_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not gs://"):
        open_dataset("gs://bucket/x")


# ----------------------------------------------------------------------------- workers

@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_fetch_records_not_cached(env: Path, url: str, local: MemmapDataset, context: str) -> None:
    """Workers fetch what they read, none of it cached before: spawned ones with a client of their own,
    forked ones (whose parent started obstore's runtime, which fork does not carry) through a helper process."""
    remote = MemmapDataset(url, cache_dir=env)
    assert s3._runtime_pid == os.getpid()  # this process has used the client: a forked child cannot
    assert held_records(env) == set()  # no record cached yet
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist() * 2
    loader = DataLoader(remote, batch_size=4, sampler=order, num_workers=2, multiprocessing_context=context,
                        timeout=JOIN_S)
    images = torch.cat([b[0] for b in loader])
    assert torch.equal(images, local.__getitems__(order).images)
    assert remote.opened.records.stats.fetched_bytes == 0  # the workers fetched every record, not this process
    assert held_records(env) == set(range(24))


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


def test_a_forked_child_fetches_through_a_helper_that_is_replaced_when_killed_and_exits_with_it(
        env: Path, url: str, local: MemmapDataset) -> None:
    remote = MemmapDataset(url, cache_dir=env)
    remote.__getitems__([0])  # the parent has used the client
    def work() -> str:
        first = remote.__getitems__([1, 2]).images
        helper = s3.fetch_helper.helper_pid()
        os.kill(helper, signal.SIGKILL)  # a helper that dies: the next request starts another
        second = remote.__getitems__([3, 17]).images
        return f"{helper} {s3.fetch_helper.helper_pid()} {int(first.sum())} {int(second.sum())}"

    status, answer = in_forked_child(work)
    assert status == 0 and not answer.startswith("error"), answer
    killed, helper, first, second = map(int, answer.split())
    assert helper != killed and s3.fetch_helper.helper_pid() is None  # the child's own; none in this process
    assert first == int(local.__getitems__([1, 2]).images.sum())
    assert second == int(local.__getitems__([3, 17]).images.sum())
    deadline = time.monotonic() + 30
    while not _process_gone(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _process_gone(helper)  # its child exited: the pipe closed, and it followed


def test_a_forked_child_reopens_from_the_cache_without_the_bucket(env: Path, url: str) -> None:
    read_all(MemmapDataset(url, cache_dir=env))
    status, answer = in_forked_child(  # the child opens it again (as a worker's copy would), from the cache only
        lambda: str(int(MemmapDataset(url, cache_dir=env).__getitems__([0, 23]).images.sum())))
    assert status == 0 and answer.isdigit(), answer


# ----------------------------------------------------------------------------- the command line

def test_info_and_verify_on_an_s3_url(env: Path, url: str, local: MemmapDataset) -> None:
    runner = CliRunner()
    info = runner.invoke(app, ["info", url])
    assert info.exit_code == 0, info.output
    assert info.stdout.startswith(f"{url}: dsc format {local.manifest.version}, 24 records of 8x8x3 uint8")
    assert info.stdout.splitlines()[0].endswith(" in the bucket")  # as the compile that wrote it says, not "on disk"
    verify = runner.invoke(app, ["verify", url])
    assert verify.exit_code == 0, verify.output
    assert verify.stdout.startswith("ok: manifest, 5 shard(s)")
    size = info.stdout.splitlines()[0].split(", ")[-1].removesuffix(" in the bucket")
    assert f"match ({size});" in verify.stdout  # the dataset's size, as info gives it


def test_verify_reads_the_bucket_and_names_a_damaged_record(server: S3Server, env: Path, url: str,
                                                            local: MemmapDataset) -> None:
    name = fmt.shard_file(4)
    data = bytearray((Path(local.path) / name).read_bytes())
    data[192 * 2 + 1] ^= 0xFF  # record 22 (2 of shard 4), same size: only checksums see it
    server.put(BUCKET, f"{url.split('/', 3)[3]}/{name}", bytes(data))
    result = CliRunner().invoke(app, ["verify", url])
    assert result.exit_code == 1
    assert f"error: {url}/{name}: SHA-256 is" in result.stderr  # the object itself, nothing cached
    assert f"{url}/{name}: record(s) 22 do not match their CRC-32 in checksums.bin" in result.stderr
    assert not list(env.rglob("records")) and not list(env.rglob("shards"))


def test_show_on_an_s3_url(env: Path, url: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["show", url, "-o", str(tmp_path / "sheet.png"), "--n", "4"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sheet.png").stat().st_size > 0


@pytest.mark.parametrize("args", [["info", "{url}"], ["info", "--json", "{url}"], ["verify", "{url}"],
                                  ["show", "{url}", "-o", "{tmp}/sheet.png", "--n", "4"]])
def test_the_light_commands_on_an_s3_url_import_neither_torch_nor_tensordict(env: Path, url: str, tmp_path: Path,
                                                                            args: list[str]) -> None:
    """As on a folder (test_startup.py): the cache's storage code is no reason to import the reader's torch."""
    argv = [a.format(url=url, tmp=tmp_path) for a in args]
    code = ("import sys; from dsc.cli import app; from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, {argv!r}); "
            "print(r.exit_code, [m for m in ('torch', 'tensordict') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[-2] == "0 []", done.stdout + done.stderr


def test_a_dead_endpoint_on_the_command_line_is_one_line(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    result = CliRunner().invoke(app, ["info", f"s3://{BUCKET}/x"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: s3://{BUCKET}/x/versions/: LIST failed"), lines


@pytest.mark.parametrize("name, value, says", [
    ("AWS_ENDPOINT_URL", "", "AWS_ENDPOINT_URL is set but empty"),
    ("AWS_ENDPOINT_URL_S3", " ", "AWS_ENDPOINT_URL_S3 is set but empty"),
    ("AWS_REGION", "", "AWS_REGION is set but empty"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:notaport", "not a URL the S3 client can use"),
    ("AWS_ENDPOINT_URL", "http://127.0.0.1:70000", "not a URL the S3 client can use"),
    ("AWS_ENDPOINT_URL", "https://:443", "no host name in it"),
    ("AWS_ENDPOINT_URL", "https://[::1", "not a URL the S3 client can use")])
def test_an_empty_or_malformed_endpoint_setting_is_one_line_from_every_command(env: Path, monkeypatch, name: str,
                                                                              value: str, says: str) -> None:
    """The S3 client reads the environment itself and panics on such values (a Rust panic, past every `except
    Exception`): dsc says which setting is wrong before the client is made."""
    monkeypatch.setenv(name, value)
    for command in (["info"], ["verify"], ["show", "-o", str(env.parent / "sheet.png")], ["bench"]):
        result = CliRunner().invoke(app, [*command[:1], f"s3://{BUCKET}/x", *command[1:]])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], \
            (command, result.output)
    with pytest.raises(DatasetError, match=re.escape(says)):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)


def test_records_are_byte_identical_through_the_cache(env: Path, url: str, local: MemmapDataset) -> None:
    remote = open_dataset(url)
    assert remote.shards == () and remote.records is not None
    everything = list(range(24))
    assert np.array_equal(remote.read_records(everything), open_dataset(local.path).read_records(everything))


def test_without_obstore_an_s3_url_names_the_extra(env: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore", None)  # what a base install without the extra has
    monkeypatch.setitem(sys.modules, "obstore.store", None)
    monkeypatch.setattr(s3, "_clients", {})
    with pytest.raises(DatasetError, match=r"needs obstore, which is not installed: pip install 'dsc-images\[s3\]'"):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)


def test_a_local_dataset_never_imports_the_s3_client(local: MemmapDataset) -> None:
    code = ("import sys; from dsc.cli import app; from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, ['info', {str(local.path)!r}]); "
            "print(r.exit_code, sorted(m for m in sys.modules if m.startswith(('obstore', 'dsc.storage.s3'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split("\n")[-2] == "0 []", done.stderr


# ----------------------------------------------------------------------------- AWS profiles

def profile_files(tmp_path: Path, server: S3Server, monkeypatch, endpoint: str | None = None) -> None:
    """A profile `dsc-test` in a config file (region, endpoint) and a credentials file (keys), as the AWS CLI
    writes them, and an environment without any AWS_* setting but AWS_PROFILE and the files' paths."""
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "config").write_text(f"[default]\nregion = eu-west-3\n\n[profile dsc-test]\nregion = {server.region}\n"
                                     f"endpoint_url = {endpoint or server.endpoint}\n")
    (tmp_path / "credentials").write_text(f"[dsc-test]\naws_access_key_id = {server.key}\n"
                                          f"aws_secret_access_key = {server.secret}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_PROFILE", "dsc-test")


def test_an_aws_profile_gives_the_endpoint_keys_and_region(server: S3Server, env: Path, url: str,
                                                           local: MemmapDataset, tmp_path: Path, monkeypatch) -> None:
    profile_files(tmp_path, server, monkeypatch)
    remote = MemmapDataset(url, cache_dir=env)
    assert torch.equal(read_all(remote), read_all(local))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")  # the environment wins
    with pytest.raises(DatasetError, match="connection refused"):
        MemmapDataset(url, cache_dir=env)
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(DatasetError, match=r"AWS_PROFILE=nobody: no such profile in .*config"):
        MemmapDataset(url, cache_dir=env)


def test_bench_on_an_s3_url_measures_the_network_limit_beside_the_loader(env: Path, url: str) -> None:
    result = CliRunner().invoke(app, ["bench", url, "--seconds", "0.2", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    rows = {line[:44].strip(): line[44:].split() for line in result.stdout.splitlines()[1:5]}
    assert list(rows) == ["limit: ranged GETs, 8 at a time", "dsc loader, block", "dsc loader, random",
                          "cold: dsc loader, block"], result.stdout
    assert all(float(row[0].replace(",", "")) > 0 for row in rows.values())
    assert list(env.iterdir()) == []  # its own cache folders are gone, and nothing else was there


def test_a_grown_dataset_uploaded_reads_as_its_latest_version(server: S3Server, env: Path, tmp_path: Path) -> None:
    """An appended dataset (format 1.3) in a bucket: its `manifest.json`, the copy of the latest version, names
    the appended files too, so a store that does not list `versions/` serves the latest records."""
    from dsc.compiler.append import append
    from dsc.testing import make_image_folder

    grown = tiny_dataset(tmp_path / "grown", seed=6, records_per_shard=5)
    make_image_folder(tmp_path / "more", classes=3, per_class=2, size=(24, 32), seed=8)
    append(grown.path, tmp_path / "more", workers=1)
    latest = MemmapDataset(grown.path)
    ds = MemmapDataset(server.upload(grown.path, BUCKET, "sets/grown"))
    assert (ds.version, len(ds), latest.version, len(latest)) == (2, 30, 2, 30)
    assert all(torch.equal(ds[i].image, latest[i].image) and ds[i].label == latest[i].label for i in range(30))
    url = server.upload(grown.path, BUCKET, "sets/grown-old")
    assert MemmapDataset(url, version=2).version == 2  # the latest, asked for by number
    assert (MemmapDataset(url, version=1).version, len(MemmapDataset(url, version=1))) == (1, 24)  # by LIST
    with pytest.raises(DatasetError, match="has no version 99 .*versions 1 to 2"):  # was: the latest served
        MemmapDataset(url, version=99)
    result = CliRunner().invoke(app, ["verify", url, "--version", "1"])
    assert result.exit_code == 0 and "ok: manifest of version 1," in result.output, result.output


def test_a_process_opening_later_gets_the_nodes_default_cache_bytes(env: Path, url: str, local: MemmapDataset,
                                                                   monkeypatch) -> None:
    """While a process of the node uses the cache, a process opening the dataset later gets the default the
    first one computed, not half of what is left free on top of what the folder holds by then (fails before:
    each open added half the free space again, and the node's limit grew with every process that joined)."""
    monkeypatch.setattr(s3, "free_bytes", lambda path: 1 << 30)
    first = MemmapDataset(url, cache_dir=env)
    budget = first.opened.records.budget
    first.__getitems__(list(range(0, len(first), 7)))  # the folder fills; this process has a row of the node's table
    later = MemmapDataset(url, cache_dir=env)
    assert later.opened.records.budget == budget
    del first
    gc.collect()  # its cache is closed: its row is freed, no process of the node uses the folder
    alone = MemmapDataset(url, cache_dir=env)  # computed anew: what the folder holds now counts
    assert alone.opened.records.budget > budget


def test_a_read_only_or_full_cache_folder_is_one_line_naming_it(env: Path, url: str, local: MemmapDataset,
                                                                tmp_path: Path, monkeypatch) -> None:
    """Real file systems: a read-only tmpfs (every command, and the API), then one that fills up while a
    loader fetches: one line naming the folder or file and what to do, never a traceback or a bare errno."""
    from test_publish_states import fill_up, tmpfs

    with tmpfs(tmp_path / "ro", "1m") as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        monkeypatch.setenv("DSC_CACHE_DIR", str(ro / "cache"))
        for command in (["info"], ["verify"], ["show", "-o", str(tmp_path / "sheet.png")], ["bench"]):
            result = CliRunner().invoke(app, [*command[:1], url, *command[1:]])
            lines = result.stderr.strip().splitlines()
            assert result.exit_code == 1 and len(lines) == 1, (command, result.output)
            assert lines[0].startswith(f"error: {ro / 'cache'}") and "cannot be written there (Read-only file " \
                "system); give cache_dir (or $DSC_CACHE_DIR) a folder" in lines[0], (command, lines)
        with pytest.raises(DatasetError, match="cannot be written there \\(Read-only file system\\)"):
            MemmapDataset(url)
    with tmpfs(tmp_path / "small", "1m") as small:
        remote = MemmapDataset(url, cache_dir=small / "cache")
        fill_up(small / "filler")
        with pytest.raises(LoaderError) as failed:
            for _ in remote.loader(4, order="sequential"):
                pass
        message = str(failed.value)
        assert "\n" not in message and f"{small / 'cache'}" in message, message
        assert "cannot be written there (No space left on device); give cache_dir" in message, message

