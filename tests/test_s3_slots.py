"""The record cache's slot files (`dsc.storage.slots`) against a real S3 server on 127.0.0.1: a record let go by
another process while it is copied is never served, holes punched give the disk back, an interrupted write
counts as nothing, on ext4 and tmpfs."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from dsc import MemmapDataset
from dsc.errors import DatasetError
from dsc.storage import slots

from s3server import serving  # skips this module when the server packages are missing

from test_s3_cache import (BUCKET, COST, COUNT, PER_SHARD, RECORD_BYTES, env, index_bytes,  # isort: skip
                           local, url)

server = serving(BUCKET)  # the cache tests' fixtures (a dataset, the environment, its upload), on a server of its own
RACE_S = 6.0  # how long the reader races the evicting process
SHM = Path("/dev/shm")
__all__ = ["env", "local", "url"]  # pytest fixtures, used by name


def _evict_and_fetch_again(url: str, cache: str, budget: int, ready, stop) -> None:
    """Another process of the node: lets the records go (words bumped, bytes punched) and fetches them back,
    over and over, until told to stop (or 60 s)."""
    files = MemmapDataset(url, cache_dir=cache, cache_bytes=budget).opened.records.files
    ready.set()
    began = time.monotonic()
    while not stop.is_set() and time.monotonic() - began < 60:
        for shard in range(COUNT // PER_SHARD):
            first = shard * PER_SHARD
            files.remove_all(np.arange(first, first + PER_SHARD))
            files.fetch_run(shard, first, first + PER_SHARD)


@pytest.mark.parametrize("where", ["tmp", "shm"])
def test_a_record_punched_by_another_process_while_it_is_copied_is_never_served(env: Path, url: str,
                                                                             local: MemmapDataset, where: str) -> None:
    if where == "shm" and not SHM.is_dir():
        pytest.skip("no /dev/shm (tmpfs) here")
    cache = env if where == "tmp" else Path(os.environ.get("DSC_TEST_SHM", SHM)) / f"dsc-slots-{os.getpid()}"
    budget = index_bytes(local) + COUNT * COST
    remote = MemmapDataset(url, cache_dir=cache, cache_bytes=budget)
    everything = list(range(COUNT))
    want = local.__getitems__(everything).images.numpy()
    assert np.array_equal(remote.__getitems__(everything).images.numpy(), want)  # all fetched and checked once
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    evictor = context.Process(target=_evict_and_fetch_again, args=(url, str(cache), budget, ready, stop))
    evictor.start()
    try:
        assert ready.wait(timeout=60)
        rng, batches, began = np.random.default_rng(0), 0, time.monotonic()
        while time.monotonic() - began < RACE_S:
            idx = rng.permutation(COUNT)[:512]
            got = remote.__getitems__(idx.tolist()).images.numpy()
            wrong = np.flatnonzero((got != want[idx]).reshape(len(idx), -1).any(axis=1))
            assert len(wrong) == 0, f"batch {batches}: records {idx[wrong][:8].tolist()} served wrong"
            batches += 1
    finally:
        stop.set()
        evictor.join(timeout=60)
        if where == "shm":
            import shutil

            shutil.rmtree(cache, ignore_errors=True)
    assert evictor.exitcode == 0 and batches > 10
    assert remote.opened.records.stats.fetched_bytes > 0  # it did lose records to the other process, and got them back


def test_punched_holes_give_the_disk_back(env: Path, url: str, local: MemmapDataset) -> None:
    remote = MemmapDataset(url, cache_dir=env, cache_bytes=index_bytes(local) + COUNT * COST)
    remote.__getitems__(list(range(PER_SHARD)))  # shard 0, whole
    files = remote.opened.records.files
    path = files.path(0)
    full = os.stat(path).st_blocks * 512
    assert full >= PER_SHARD * RECORD_BYTES and os.stat(path).st_size == PER_SHARD * RECORD_BYTES
    files.remove_all(np.arange(0, PER_SHARD, 2))  # every other record: each block still holds one
    assert os.stat(path).st_blocks * 512 == full
    files.remove_all(np.arange(0, PER_SHARD // 2))  # the first half: only the blocks the second half touches stay
    block = files.block
    touched = -(-PER_SHARD * RECORD_BYTES // block) - PER_SHARD // 2 * RECORD_BYTES // block
    assert os.stat(path).st_blocks * 512 == touched * block < full
    files.remove_all(np.arange(PER_SHARD // 2, PER_SHARD))  # the rest: every block free
    assert os.stat(path).st_blocks == 0
    assert not any(files.present(u) for u in range(PER_SHARD))


def test_a_write_cut_short_counts_as_nothing_and_its_blocks_are_reclaimed(env: Path, url: str,
                                                                        local: MemmapDataset) -> None:
    budget = index_bytes(local) + COUNT * COST
    remote = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    files = remote.opened.records.files
    remote.__getitems__([100])  # record 0 of shard 1
    path = files.path(150)  # a writer killed between its write and its mark leaves bytes of records 150-159
    with open(path, "r+b") as f:
        f.seek(50 * RECORD_BYTES)
        f.write(b"\1" * (10 * RECORD_BYTES))
    assert os.stat(path).st_blocks * 512 > files.block
    again = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    records = again.opened.records
    assert records.used == index_bytes(local, processes=0) + COST  # record 100 only (no plan: no loader)
    assert os.stat(path).st_blocks * 512 == files.block  # reclaimed at open: the block record 100 touches stays
    picks = list(range(145, 165))
    assert np.array_equal(again.__getitems__(picks).images.numpy(), local.__getitems__(picks).images.numpy())


def test_a_file_system_that_cannot_punch_holes_is_refused_at_open(env: Path, url: str, local: MemmapDataset,
                                                                 monkeypatch) -> None:
    monkeypatch.setattr(slots, "_fallocate_call", None)  # as where fallocate is missing
    with pytest.raises(DatasetError, match=r"cannot punch holes in a file .*put cache_dir on ext4, xfs, btrfs"):
        MemmapDataset(url, cache_dir=env, cache_bytes=index_bytes(local) + COUNT * COST)
    assert not [p for p in env.rglob("*") if p.name.startswith(".punch-probe")]  # its probe removed


def test_a_link_planted_at_a_rows_lock_is_refused_not_followed(tmp_path: Path) -> None:
    """A row's lock file (`node/row.<n>.lock`) is one of dsc's own names: a link planted there (here for a row
    another process claimed) is named in one line when the node's live processes are counted; its target is
    untouched."""
    from dsc.storage import ledger

    node = ledger.NodeLedger(tmp_path, 10)
    with node.locked():
        node.mine()
    node._table[1, 0] = 12345  # another process's row
    target = tmp_path / "users-file"
    target.write_bytes(b"mine")
    (tmp_path / ledger.NODE_DIR / "row.1.lock").symlink_to(target)
    with pytest.raises(DatasetError, match=r"row\.1\.lock: not a regular file; the cache holds something dsc did not"):
        node.processes()
    assert target.read_bytes() == b"mine"
    node.leave()
