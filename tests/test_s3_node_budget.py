"""One `cache_bytes` for the whole node (`dsc.storage.ledger`), against a real S3 server on 127.0.0.1: two
ranks of a job (spawned processes, each with its own client) read their shares of two epochs through one cache
folder on a tmpfs of its own, whose used blocks (`statvfs`: the whole file system at one instant) are sampled
while they run. Together they never pass the limit each was given; each gets the local dataset's batches;
and by sharing their plans the second epoch fetches close to the optimum for the node (Belady over both
ranks' reads), where evicting by a rank's own plan alone lets go first what the other rank reads next."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dsc import MemmapDataset
from dsc.errors import DatasetError
from dsc.storage import ledger, slots

from s3server import serving  # skips this module when the server packages are missing

from test_publish_states import tmpfs  # isort: skip
from test_s3_cache import (BATCH, BUCKET, COST, belady_misses, env, index_bytes, local, synthetic,  # isort: skip
                           url)

server = serving(BUCKET)  # the cache tests' fixtures (a dataset, the environment, its upload), on a server of its own
__all__ = ["env", "local", "url"]  # pytest fixtures, used by name
RANKS = 2
SEED = 5
# records of whole blocks (64x64x3 = 3 blocks of 4 KiB), so that the disk they take is what the budget counts
# for them: records that share blocks take less than their count, and the disk would not show two budgets
BLOCKS_SIDE, BLOCKS_COUNT, BLOCKS_PER_SHARD = 64, 800, 100
SAMPLE_S = 0.002  # how often the file system's use is read while the ranks run
RUN_S = 240  # a rank that has not answered by then failed


def _rank(url: str, cache: str, budget: int, rank: int, start, answers) -> None:
    """A rank: its share of two epochs of random order through the shared cache; per epoch, a digest of each
    batch and what it fetched; and the most its cache counted for the node after a batch."""
    try:
        remote = MemmapDataset(url, cache_dir=cache, cache_bytes=budget)
        loader = remote.loader(BATCH, order="random", seed=SEED, rank=rank, world_size=RANKS)
        start.wait(timeout=60)
        epochs, counted = [], 0
        for _ in range(2):
            batches = []
            for b in loader:
                batches.append((b["index"].numpy().tolist(), int(b["image"].sum())))
                counted = max(counted, remote.opened.records.used)
            epochs.append((batches, loader.stats(reset=True).fetched_bytes))
        answers.put((rank, (epochs, counted)))
    except BaseException as e:  # said, not lost in the child's stderr
        answers.put((rank, f"{type(e).__name__}: {e}"))


def _used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _run_ranks(url: str, cache: Path, budget: int) -> tuple[dict[int, list], int]:
    """Both ranks at once; (each rank's epochs, the most the cache's file system held meanwhile)."""
    context = multiprocessing.get_context("spawn")
    start, answers = context.Barrier(RANKS + 1), context.Queue()
    ranks = [context.Process(target=_rank, args=(url, str(cache), budget, r, start, answers)) for r in range(RANKS)]
    for rank in ranks:
        rank.start()
    try:
        start.wait(timeout=120)  # every rank has opened the dataset (its index is in the folder)
        most, got, deadline = 0, {}, time.monotonic() + RUN_S
        while len(got) < RANKS and time.monotonic() < deadline:
            most = max(most, _used(cache))
            while not answers.empty():
                rank, answer = answers.get()
                assert not isinstance(answer, str), f"rank {rank}: {answer}"
                got[rank] = answer
            time.sleep(SAMPLE_S)
        assert len(got) == RANKS, f"ranks {sorted(set(range(RANKS)) - set(got))} did not answer in {RUN_S} s"
    finally:
        for rank in ranks:
            rank.join(timeout=30)
            if rank.is_alive():
                rank.kill()
    assert [rank.exitcode for rank in ranks] == [0] * RANKS
    return got, most


def _not_counted(cache: Path, plans: int) -> int:
    """The disk the cache's files take that cache_bytes does not count: what the cache folder holds outside the
    dataset's own folder (the manifest's copy, shard tables: kept once per node), and the rest of the pages
    of its files that are not sparse (counted by their size: the index files, the records' state, the node's
    table, and the `plans` of the processes, which they removed when they ended). tmpfs gives folders and empty
    files none."""
    folders = [p for p in cache.iterdir() if p.is_dir() and (p / ledger.NODE_DIR).is_dir()]
    assert len(folders) == 1
    page = os.statvfs(cache).f_frsize
    outside = inside = 0
    for path in cache.rglob("*"):
        if path.is_file() and folders[0] not in path.parents:
            outside += path.stat().st_blocks * 512
        elif path.is_file() and (path.parent.name != slots.SLOT_DIR or path.name == slots.STATE_FILE):
            inside += path.stat().st_blocks * 512 - path.stat().st_size
    plan = ledger.NEXT_DTYPE.itemsize * BLOCKS_COUNT
    return outside + inside + plans * (-(-plan // page) * page - plan)


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> MemmapDataset:
    root = tmp_path_factory.mktemp("node-budget") / "ds"
    return MemmapDataset(synthetic(root, BLOCKS_COUNT, BLOCKS_PER_SHARD, seed=2, side=BLOCKS_SIDE))


def test_the_ranks_of_a_node_share_one_cache_bytes(server, env: Path, blocks: MemmapDataset, tmp_path: Path) -> None:
    url = server.upload(blocks.path, BUCKET, f"node/set-{time.time_ns()}")
    record = blocks.manifest.record_bytes
    capacity = BLOCKS_COUNT // 2  # records: each rank reads half the dataset an epoch
    with tmpfs(tmp_path / "node-disk", "64m") as disk:
        cache = disk / "cache"
        budget = index_bytes(blocks, processes=RANKS) + capacity * record
        got, most = _run_ranks(url, cache, budget)
        held = most - _not_counted(cache, plans=RANKS)
    assert held <= budget, f"the node's cache took {held} bytes of its disk; cache_bytes={budget}"
    counted = max(counted for _, counted in got.values())
    assert budget - 2 * BATCH * record < counted <= budget  # it did fill up: the limit was what held it back
    sequence = []
    for rank in range(RANKS):
        reference = blocks.loader(BATCH, order="random", seed=SEED, rank=rank, world_size=RANKS)
        for epoch in range(2):
            want = [(b["index"].numpy().tolist(), int(b["image"].sum())) for b in reference]
            assert got[rank][0][epoch][0] == want, f"rank {rank}, epoch {epoch}: not the local dataset's batches"
    for epoch in range(2):  # the node's reads, the ranks in step: rank 0's batch b, then rank 1's
        for b in range(len(got[0][0][epoch][0])):
            for rank in range(RANKS):
                sequence.extend(got[rank][0][epoch][0][b][0])
    optimum = belady_misses(np.array(sequence), capacity, counted_from=len(sequence) // 2) * record
    fetched = sum(got[rank][0][1][1] for rank in range(RANKS))
    assert optimum >= (BLOCKS_COUNT - capacity) * record  # a record is read once an epoch, by one rank
    assert fetched <= optimum + 0.05 * BLOCKS_COUNT * record, (fetched, optimum)


def test_a_rank_whose_batches_do_not_fit_beside_the_others_is_refused_naming_the_minimum(
        env: Path, url: str, local: MemmapDataset) -> None:
    """What each process needs for its batches (fetched `prefetch` ahead) adds up over the node: a second
    process whose batches do not fit beside the first one's is refused when its loader is made."""
    one = (2 + 1) * BATCH * COST  # a batch made and 2 ahead
    budget = index_bytes(local, processes=2) + one + one // 2
    first = MemmapDataset(url, cache_dir=env, cache_bytes=budget).loader(BATCH, prefetch=2)
    second = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    need = index_bytes(local, processes=2) + 2 * one
    with pytest.raises(DatasetError, match=rf"cache_bytes={budget} is too small for batches of {BATCH} fetched 2 "
                                           rf"batches ahead: at least {need} bytes are needed .* {one} bytes for the "
                                           r"batches of the node's other processes"):
        second.loader(BATCH, prefetch=2)
    del first


def _one_batch_then_wait(url: str, cache: str, budget: int, ready) -> None:
    """A rank that makes one batch (its plan published, a row of the node's table held), then waits to be killed."""
    loader = MemmapDataset(url, cache_dir=cache, cache_bytes=budget).loader(BATCH, order="random", seed=SEED)
    next(iter(loader))
    ready.set()
    time.sleep(RUN_S)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_a_killed_rank_stops_counting_before_it_is_reaped_and_its_plan_is_removed(
        env: Path, url: str, local: MemmapDataset) -> None:
    """A rank killed (SIGKILL) and not yet waited for by its parent is a zombie: its pid is still there. It
    counts for nothing from then on (its row's lock let go with its files), and the next fetch of a process of
    the node frees its row and removes its plan (failed before the zombie check, when pids told live rows: a
    zombie counted as alive, its plan and row kept while its parent lived)."""
    budget = index_bytes(local, processes=2) + local.manifest.count // 10 * COST  # the rank fetches part of it
    remote = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    remote.__getitems__([0])  # a fetch: this process has a row too
    node = remote.opened.local_root / ledger.NODE_DIR
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    rank = context.Process(target=_one_batch_then_wait, args=(url, str(env), budget, ready))
    rank.start()
    try:
        assert ready.wait(timeout=120)
        assert len(list(node.glob("plan.*.bin"))) == 1 and remote.opened.records.ledger.processes() == 2
        os.kill(rank.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _state(rank.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(rank.pid) == "Z"  # killed, not waited for
        # its row's lock goes with its files, as its last threads end: within milliseconds of the zombie
        while remote.opened.records.ledger.processes() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(rank.pid) == "Z" and remote.opened.records.ledger.processes() == 1
        absent = int(np.flatnonzero((remote.opened.records.files.state & 1) == 0)[0])
        remote.__getitems__([absent])  # a fetch: the node's table is read under its lock
        assert list(node.glob("plan.*.bin")) == []
        assert np.count_nonzero(remote.opened.records.ledger._table[:, 0]) == 1  # only this process's row
    finally:
        rank.kill()
        rank.join(timeout=30)


IN_ANOTHER_PID_NAMESPACE = """
import sys, time
from dsc import MemmapDataset
url, cache, budget, batch, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
loader = MemmapDataset(url, cache_dir=cache, cache_bytes=budget).loader(batch, order="random", seed=seed)
next(iter(loader))
print("ready", flush=True)
time.sleep(float(sys.argv[6]))
"""


def test_a_rank_in_another_pid_namespace_counts_while_it_lives(env: Path, url: str, local: MemmapDataset) -> None:
    """Containers of one machine may share a cache folder; a process in another pid namespace (its pid there is 1)
    counts while it lives, and stops counting once killed. Failed before, when pids told live rows: its row said
    pid 1 with the start time of /proc/1 as it saw it (this machine's init: it had no /proc of its own), so it
    was counted alive for ever, its reservations too, after it was killed (with a /proc of its own, it would have
    been counted dead while it ran)."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot make a pid namespace here (unshare --pid needs root)")
    budget = index_bytes(local, processes=2) + local.manifest.count // 10 * COST
    remote = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    remote.__getitems__([0])  # a fetch: this process has a row too
    node, records = remote.opened.local_root / ledger.NODE_DIR, remote.opened.records
    rank = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", IN_ANOTHER_PID_NAMESPACE, url,
                             str(env), str(budget), str(BATCH), str(SEED), str(RUN_S)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert rank.stdout.readline().strip() == "ready"
        assert records.ledger.processes() == 2
        absent = int(np.flatnonzero((records.files.state & 1) == 0)[0])
        remote.__getitems__([absent])  # a fetch: rows of processes gone are freed under the node's lock
        assert records.ledger.processes() == 2 and len(list(node.glob("plan.*.bin"))) == 1  # its plan kept
        os.killpg(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + 30
        while records.ledger.processes() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert records.ledger.processes() == 1
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)


def test_a_live_process_of_an_earlier_dsc_sharing_the_folder_is_refused_and_its_files_go_once_it_is_gone(
        env: Path, url: str, local: MemmapDataset) -> None:
    """Earlier versions told live rows by pid and start time in `node/table.bin` (plans in `next.<row>.bin`): their
    fetches would not count in this version's table, so a live one is named and refused; once it is gone, its
    files are removed and the folder is used."""
    budget = index_bytes(local, processes=2) + local.manifest.count // 10 * COST
    first = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
    node = first.opened.local_root / ledger.NODE_DIR
    older = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        table = np.zeros((ledger.ROWS, 5), dtype=np.int64)
        table[3, :2] = older.pid, ledger._started(older.pid)  # (pid, start time): its row, as it wrote it
        (node / "table.bin").write_bytes(table.tobytes())
        (node / "next.3.bin").write_bytes(np.zeros(local.manifest.count, np.int32).tobytes())
        with pytest.raises(DatasetError, match=rf"process {older.pid}, of an earlier dsc, uses this cache folder"):
            MemmapDataset(url, cache_dir=env, cache_bytes=budget).__getitems__([0])
        older.kill()
        older.wait(timeout=30)
        again = MemmapDataset(url, cache_dir=env, cache_bytes=budget)
        assert torch.equal(again.__getitems__([0, 5]).images, local.__getitems__([0, 5]).images)
        assert not (node / "table.bin").exists() and not (node / "next.3.bin").exists()
    finally:
        older.kill()
        older.wait(timeout=30)
