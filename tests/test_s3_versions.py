"""Versions (format 1.3) of datasets in a bucket, against a real S3 server on 127.0.0.1 (moto's): older
versions read by LIST of versions/, `dsc append` / `merge` / `prune` on s3:// datasets, two racing appends in
two processes, an append while a reader iterates. Real compiles of real JPEGs and PNGs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_versions import split_folder
from typer.testing import CliRunner

from dsc import storage
from dsc.cli import app
from dsc.compiler.append import append
from dsc.compiler.pipeline import compile_folder
from dsc.errors import DatasetError
from dsc.reader.dataset import MemmapDataset

from conftest import make_folder
from s3server import S3Server, serving  # skips this module when the server packages are missing

BUCKET = "dsc-versions"
SIZE = 16

server = serving(BUCKET)
_prefixes = iter(range(1 << 30))


@pytest.fixture
def env(server: S3Server, monkeypatch, tmp_path: Path) -> Path:
    """The AWS environment pointing at the loopback server, and a fresh cache folder (returned)."""
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("DSC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def grown(tmp_path: Path):
    """A master folder split in two: `a` compiled (5 records a shard: a partial last shard), `b` to append."""
    master = make_folder(tmp_path / "master", classes=3, per_class=5)
    a, b = tmp_path / "a", tmp_path / "b"
    split_folder(master, {"a": a, "b": b}, lambda cls, name: "a" if int(name[4]) < 3 else "b")
    compile_folder(a, tmp_path / "ds", size=SIZE, records_per_shard=5, workers=1)
    return tmp_path, master, a, b


def prefix() -> str:
    return f"sets/v{next(_prefixes)}"


def pixels(ds: MemmapDataset) -> np.ndarray:
    return ds.__getitems__(list(range(len(ds)))).images.numpy()


def test_older_versions_of_a_bucket_dataset_open_by_listing_versions(server: S3Server, env: Path, grown) -> None:
    tmp, _, _, b = grown
    v1 = pixels(MemmapDataset(tmp / "ds"))
    append(tmp / "ds", b, workers=1)
    url = server.upload(tmp / "ds", BUCKET, prefix())
    latest, first = MemmapDataset(url), MemmapDataset(url, version=1)
    assert (latest.version, len(latest), first.version, len(first)) == (2, 15, 1, 9)
    assert np.array_equal(pixels(first), v1)
    assert np.array_equal(pixels(latest), pixels(MemmapDataset(tmp / "ds")))
    assert storage.dataset_versions(url) == [1, 2]
    runner = CliRunner()
    info = runner.invoke(app, ["info", url, "--version", "1", "--json"])
    assert info.exit_code == 0, info.output
    shown = json.loads(info.stdout)
    assert (shown["version"], shown["records"], shown["versions"]) == (1, 9, [1, 2])
    verify = runner.invoke(app, ["verify", url, "--version", "1"])
    assert verify.exit_code == 0 and "ok: manifest of version 1," in verify.stdout, verify.output
    with pytest.raises(DatasetError, match="has no version 3"):
        MemmapDataset(url, version=3)
    shutil.rmtree(env)
