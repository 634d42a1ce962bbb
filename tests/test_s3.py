"""Datasets in an S3-compatible bucket, against a real S3 server on 127.0.0.1 (moto's, over HTTP):
the same batches as the local dataset, a node-local cache that downloads each file once and never
touches what it did not create, corruption named, a dead endpoint a quick clear error, and
DataLoader workers started by fork and by spawn."""

from __future__ import annotations

import os
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
from dsc.errors import DatasetError
from dsc.reader import order as orders
from dsc.storage import open_dataset, s3, verify_checksums

from conftest import tiny_dataset
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
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
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


def test_the_cache_is_keyed_by_the_manifest_and_holds_a_whole_dataset_folder(env: Path, url: str,
                                                                             local: MemmapDataset) -> None:
    remote = MemmapDataset(url)  # cache_dir from $DSC_CACHE_DIR
    text = (Path(local.path) / fmt.MANIFEST_FILE).read_bytes()
    import hashlib

    folder = env / hashlib.sha256(text).hexdigest()
    assert remote.opened.local_root == folder
    copy = MemmapDataset(folder)  # the cached copies make a dataset folder of their own
    assert torch.equal(copy.__getitems__(list(range(24))).images, local.__getitems__(list(range(24))).images)


def test_a_second_open_on_the_node_downloads_nothing(server: S3Server, env: Path, url: str,
                                                     local: MemmapDataset) -> None:
    MemmapDataset(url, cache_dir=env)
    before = cached_files(env)
    manifest = fmt.MANIFEST_FILE
    for entry in local.manifest.files:  # only the manifest stays in the bucket: nothing else can be fetched
        server.delete(BUCKET, f"{url.split('/', 3)[3]}/{entry.file}")
    again = MemmapDataset(url, cache_dir=env)
    assert cached_files(env) == before  # not one file written, renamed or replaced
    assert torch.equal(again.__getitems__(list(range(24))).images, local.__getitems__(list(range(24))).images)
    assert any(name.endswith(manifest) for name in before)


def test_a_damaged_cached_copy_is_fetched_again(env: Path, url: str, local: MemmapDataset) -> None:
    remote = MemmapDataset(url, cache_dir=env)
    shard = remote.opened.local_root / fmt.shard_file(2)
    del remote
    with open(shard, "r+b") as f:
        f.truncate(7)
    again = MemmapDataset(url, cache_dir=env)
    assert shard.stat().st_size == local.manifest.shards[2].bytes
    assert torch.equal(again.__getitems__([10, 11]).images, local.__getitems__([10, 11]).images)


def test_a_corrupted_object_is_named_and_never_served(server: S3Server, env: Path, url: str,
                                                      local: MemmapDataset) -> None:
    name = fmt.shard_file(1)
    data = bytearray((Path(local.path) / name).read_bytes())
    data[17] ^= 0xFF  # same size: only the checksum can tell
    server.put(BUCKET, f"{url.split('/', 3)[3]}/{name}", bytes(data))
    with pytest.raises(DatasetError, match=rf"{url}/{name}: downloaded 2 times, wrong each time \(SHA-256 "):
        MemmapDataset(url, cache_dir=env)
    assert not list(env.rglob(name.split("/")[-1]))  # nothing wrong was put in place
    assert [p.name for p in env.rglob("*.tmp")] == []  # and no temporary file left behind


def test_a_missing_object_is_named(server: S3Server, env: Path, url: str) -> None:
    name = fmt.shard_file(3)
    server.delete(BUCKET, f"{url.split('/', 3)[3]}/{name}")
    with pytest.raises(DatasetError, match=rf"{url}/{name}: missing \(shards\[3\] in the manifest\)"):
        MemmapDataset(url, cache_dir=env)


def test_no_dataset_at_the_prefix_is_a_clear_error(env: Path, server: S3Server) -> None:
    with pytest.raises(DatasetError, match=rf"s3://{BUCKET}/nothing/here: no manifest.json"):
        MemmapDataset(f"s3://{BUCKET}/nothing/here", cache_dir=env)


def test_a_dead_endpoint_is_a_clear_error_within_seconds(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    began = time.monotonic()
    with pytest.raises(DatasetError, match=rf"s3://{BUCKET}/x/manifest.json: HEAD failed {s3.ATTEMPTS} times in "):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)
    assert time.monotonic() - began < 10


def test_plain_http_is_refused_for_an_endpoint_off_this_machine(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://192.0.2.1:9000")  # TEST-NET-1: never contacted
    with pytest.raises(DatasetError, match="plain http is allowed only to a loopback address"):
        MemmapDataset(f"s3://{BUCKET}/x", cache_dir=env)


def test_a_cache_that_cannot_hold_the_dataset_is_refused_at_open(env: Path, url: str, local: MemmapDataset,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(s3, "free_bytes", lambda path: 1000)  # a nearly full disk, without filling one
    total = sum(e.bytes for e in local.manifest.files)
    with pytest.raises(DatasetError, match=rf"has 1000 bytes free, but {total} more bytes of this dataset"):
        MemmapDataset(url, cache_dir=env)


def test_the_cache_never_touches_files_it_did_not_create(env: Path, url: str, local: MemmapDataset) -> None:
    import hashlib

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
    import hashlib

    key = hashlib.sha256((Path(local.path) / fmt.MANIFEST_FILE).read_bytes()).hexdigest()
    target = tmp_path / "precious.bin"
    target.write_bytes(b"precious")
    link = env / key / fmt.shard_file(0)
    link.parent.mkdir(parents=True)
    link.symlink_to(target)
    with pytest.raises(DatasetError, match="not a regular file; the cache of .* leaves it alone"):
        MemmapDataset(url, cache_dir=env)
    assert target.read_bytes() == b"precious" and link.is_symlink()


def test_cache_dir_has_no_meaning_for_a_folder(local: MemmapDataset, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_dir is for datasets in object storage"):
        MemmapDataset(local.path, cache_dir=tmp_path)


def test_an_unknown_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="not gs://"):
        open_dataset("gs://bucket/x")


# ----------------------------------------------------------------------------- workers

@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_an_s3_dataset(env: Path, url: str, local: MemmapDataset, context: str) -> None:
    """Spawned workers open the dataset again (its manifest from the bucket, the rest from the cache);
    forked ones, which cannot use the parent's S3 client, read what the parent cached."""
    remote = MemmapDataset(url, cache_dir=env)
    order = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist() * 2
    loader = DataLoader(remote, batch_size=4, sampler=order, num_workers=2, multiprocessing_context=context,
                        timeout=JOIN_S)
    images = torch.cat([b[0] for b in loader])
    assert torch.equal(images, local.__getitems__(order).images)


def test_a_forked_child_reopens_from_the_cache_without_the_bucket(env: Path, url: str) -> None:
    MemmapDataset(url, cache_dir=env)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child opens it again (as a worker's copy would), from the cache only
        try:
            ds = MemmapDataset(url, cache_dir=env)
            os.write(write, str(int(ds.__getitems__([0, 23]).images.sum())).encode())
        except BaseException as e:
            os.write(write, f"error: {e}".encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    answer = os.read(read, 4096).decode()
    os.close(read)
    assert status == 0 and answer.isdigit(), answer


# ----------------------------------------------------------------------------- the command line

def test_info_and_verify_on_an_s3_url(env: Path, url: str, local: MemmapDataset) -> None:
    runner = CliRunner()
    info = runner.invoke(app, ["info", url])
    assert info.exit_code == 0, info.output
    assert info.stdout.startswith(f"{url}: dsc format {local.manifest.version}, 24 records of 8x8x3 uint8")
    verify = runner.invoke(app, ["verify", url])
    assert verify.exit_code == 0, verify.output
    assert verify.stdout.startswith("ok: manifest, 5 shard(s)")


def test_verify_names_a_damaged_cached_copy(env: Path, url: str) -> None:
    remote = open_dataset(url)
    shard = remote.local_root / fmt.shard_file(4)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size: only verify's checksums see it
    result = CliRunner().invoke(app, ["verify", url])
    assert result.exit_code == 1
    assert f"error: {shard} (the cached copy of {url}/{fmt.shard_file(4)}): SHA-256 is" in result.stderr
    with pytest.raises(DatasetError, match="the file is damaged"):
        verify_checksums(url, remote.manifest)


def test_show_on_an_s3_url(env: Path, url: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["show", url, "-o", str(tmp_path / "sheet.png"), "--n", "4"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "sheet.png").stat().st_size > 0


def test_a_dead_endpoint_on_the_command_line_is_one_line(env: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    result = CliRunner().invoke(app, ["info", f"s3://{BUCKET}/x"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: s3://{BUCKET}/x/manifest.json: HEAD failed"), lines


def test_records_are_byte_identical_in_the_cache(env: Path, url: str, local: MemmapDataset) -> None:
    remote = open_dataset(url)
    for a, b in zip(remote.shards, open_dataset(local.path).shards):
        assert np.array_equal(a, b)


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
