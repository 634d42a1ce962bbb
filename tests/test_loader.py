"""Orders, distributed splits, the fast Loader against the reference loader, resume, lifetime, errors."""

from __future__ import annotations

import re
import threading
import tracemalloc
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps
from typer.testing import CliRunner

import dsc
from dsc.cli import app
from dsc.reader import MemmapDataset
from dsc.reader import order as orders
from dsc.reader import producer as producer_module
from dsc.reader.gather import fill, fill_parallel, one_stretch_per_shard, split
from dsc.reader.loader import LoaderError
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

SIZE = (16, 20)
COUNT = 21


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    """21 real compiled records in shards of 5 (the last holds 1)."""
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(1)
    for c in range(3):
        (root / "src" / f"c{c}").mkdir(parents=True)
        for i in range(7):
            h, w = (int(v) for v in rng.integers(40, 90, size=2))
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "src" / f"c{c}" / f"{i}.png")
    dsc.compile_folder(root / "src", root / "ds", size=SIZE, records_per_shard=5, workers=1, seed=0)
    return MemmapDataset(root / "ds")


def served(loader) -> list[np.ndarray]:
    return [b["index"].numpy().copy() for b in loader]


def taken(state: dict) -> int:
    """Batches taken in the epoch of a state with one round (one world size and batch size so far)."""
    assert len(state["rounds"]) <= 1
    return state["rounds"][0]["batches"] if state["rounds"] else 0


def check_batch(ds: MemmapDataset, batch) -> None:
    """Every served record equals ds[i] for its `index`, label included."""
    for k, i in enumerate(batch["index"].tolist()):
        image, label = ds[i]
        assert torch.equal(batch["image"][k].cpu(), image)
        assert batch["label"][k].item() == label


# ----------------------------------------------------------------------------- orders (pure functions)

@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 700), seed=st.integers(0, 2**32), epoch=st.integers(0, 50),
       order=st.sampled_from(orders.ORDERS))
def test_every_order_is_a_permutation(n: int, seed: int, epoch: int, order: str) -> None:
    idx = orders.epoch_order(n, order, seed, epoch)
    assert idx.dtype == np.int64
    assert np.array_equal(np.sort(idx), np.arange(n))
    assert np.array_equal(idx, orders.epoch_order(n, order, seed, epoch))  # deterministic


@pytest.mark.parametrize("order", ["block", "random"])
def test_orders_change_with_epoch_and_seed(order: str) -> None:
    n = 5000
    base = orders.epoch_order(n, order, 3, 0)
    assert not np.array_equal(base, orders.epoch_order(n, order, 3, 1))
    assert not np.array_equal(base, orders.epoch_order(n, order, 4, 0))
    assert not np.array_equal(base, np.arange(n))


def test_block_order_keeps_locality_within_windows() -> None:
    """Block order reads one window of WINDOW_BLOCKS blocks at a time (dsc before 0.4 also kept runs of 8
    contiguous records together; since issue 21 a window's records come in a random order instead)."""
    n = 10_000
    idx = orders.block(n, seed=0, epoch=0)
    window = orders.BLOCK_RECORDS * orders.WINDOW_BLOCKS
    for start in range(0, n - window, window):
        # a stretch of one window's length overlaps at most two windows of shifted blocks, and a shifted
        # block straddles two aligned ones: at most 4 * WINDOW_BLOCKS aligned blocks (random order: ~all 157)
        blocks = np.unique(idx[start:start + window] // orders.BLOCK_RECORDS)
        assert len(blocks) <= 4 * orders.WINDOW_BLOCKS
    first = idx[:window]
    assert not np.array_equal(np.sort(first), np.arange(first.min(), first.min() + window))  # blocks were moved
    assert np.count_nonzero(np.diff(idx) == 1) < n / 100  # no runs: records mixed within their window


@pytest.mark.parametrize("n,batch", [(16_384, 256), (16_384, 32), (100_000, 256), (3_000, 64)])
def test_block_orders_batch_mates_change_every_epoch(n: int, batch: int) -> None:
    """Issue 21: stored neighbours shared a batch in two consecutive epochs 75-84% of the time (runs of 8
    records stayed together). Now at most `cooccurrence_bound`, derived from the design (its docstring),
    plus four binomial standard errors over the n - 1 pairs."""
    bound = orders.cooccurrence_bound(n, batch)
    assert bound < 0.03 or n <= orders.BLOCK_RECORDS * orders.WINDOW_BLOCKS * 2
    for seed in (0, 1):
        measured = [orders.neighbour_cooccurrence(orders.block(n, seed, e), orders.block(n, seed, e + 1), batch)
                    for e in range(3)]
        assert np.mean(measured) <= bound + 4 * np.sqrt(bound / (n - 1)), (measured, bound)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n,batch", [(21, 4), (21, 1), (100, 7), (3, 2), (64, 16)])
def test_rank_shares(world: int, drop_last: bool, n: int, batch: int) -> None:
    order = orders.epoch_order(n, "random", 0, 0)
    shares = [orders.rank_share(order, r, world, batch, drop_last) for r in range(world)]
    lengths = {len(s) for s in shares}
    assert len(lengths) == 1  # every rank the same length, so the same number of batches
    per_rank = lengths.pop()
    assert per_rank == orders.share_length(n, world, batch, drop_last)
    joined = np.concatenate(shares)
    if drop_last:
        assert per_rank % batch == 0 and per_rank * world > n - world * batch
        assert len(np.unique(joined)) == len(joined)  # disjoint
    else:
        assert set(joined.tolist()) == set(range(n))  # the union covers the dataset
        assert len(joined) - n == per_rank * world - n < world  # padding, like DistributedSampler
        assert np.array_equal(joined[:n], order)  # contiguous shares of one epoch order


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 2000), order=st.sampled_from(orders.ORDERS), world=st.integers(1, 9),
       batch=st.integers(1, 70), drop_last=st.booleans(), seed=st.integers(0, 2**32), epoch=st.integers(0, 9))
def test_a_ranks_share_is_todays_slice_of_the_padded_order(n: int, order: str, world: int, batch: int,
                                                           drop_last: bool, seed: int, epoch: int) -> None:
    """Computed without the whole order (or a view of it), every rank's share is what it was: the
    rank's row of the epoch order, padded DistributedSampler's way by repeating it from its start."""
    whole = orders.epoch_order(n, order, seed, epoch)
    per_rank = orders.share_length(n, world, batch, drop_last)
    rows = np.resize(whole, per_rank * world).reshape(world, per_rank) if n else np.empty((world, 0), np.int64)
    for rank in range(world):
        share = orders.epoch_share(n, order, seed, epoch, rank, world, batch, drop_last)
        assert share.dtype == np.int64 and np.array_equal(share, rows[rank])
        assert np.array_equal(orders.rank_share(whole, rank, world, batch, drop_last), rows[rank])
        assert np.array_equal(orders.rank_shares(whole, world, batch, drop_last)[rank], rows[rank])


@pytest.mark.parametrize("order", orders.ORDERS)
def test_a_ranks_share_does_not_keep_the_epoch_order_alive(order: str) -> None:
    """A share that is a view keeps the whole order allocated as long as the loader holds the share
    (0.8 GB per rank at 10^8 records); every order's share is computed in chunks of its positions alone
    (random order drew numpy's whole permutation before issue 27), so its peak stays under one whole
    order (benchmarks/share_memory.py gives the figures at 10^8). Block order keeps its epoch's blocks
    cached for the next chunk: three int64 arrays of n / BLOCK_RECORDS."""
    n, world = 1_000_000, 8
    orders.block_windows.cache_clear()
    tracemalloc.start()
    try:
        share = orders.epoch_share(n, order, 0, 0, world - 1, world, 256, False)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(share) == n // world
    blocks = 3 * 8 * (n // orders.BLOCK_RECORDS + 2) if order == "block" else 0
    assert held < share.nbytes + blocks + (64 << 10), f"{held / share.nbytes:.1f}x the share's bytes held"
    assert peak < n * 8, f"peak {peak / (n * 8):.1f}x a whole order"
    whole = orders.epoch_order(n, order, 0, 0)
    mine = orders.rank_share(whole, 3, world, 256, False)
    assert not np.shares_memory(mine, whole)


def partner_is_neighbour(batches: list[np.ndarray], records_per_shard: int) -> tuple[float, float]:
    """(the fraction of samples whose position partner k - 1 is a stored neighbour, as torchvision's MixUp and
    CutMix pair them; the fraction the design gives the same batches in expectation). The design
    (`order.arrange`): each shard's records of a batch are one segment of positions in a uniformly random order,
    so two adjacent positions inside a segment of s records hold a uniformly random pair of its records, a
    stored-neighbour pair with probability pairs / C(s, 2); across the edge of segments A and B they hold a
    uniformly random record of A and one of B, neighbours with probability pairs(A, B) / (|A| |B|)."""
    hits = expected = total = 0.0
    for idx in batches:
        if len(idx) < 2:
            continue
        shard = idx // records_per_shard
        starts = np.r_[0, np.flatnonzero(shard[1:] != shard[:-1]) + 1, len(idx)]
        segments = [np.sort(idx[a:b]) for a, b in zip(starts[:-1], starts[1:])]
        for seg in segments:
            s = len(seg)
            if s > 1:
                expected += (s - 1) * np.count_nonzero(np.diff(seg) == 1) / (s * (s - 1) / 2)
        for left, right in zip(segments, segments[1:]):
            expected += np.count_nonzero(np.abs(left[:, None] - right[None, :]) == 1) / (len(left) * len(right))
        hits += np.count_nonzero(np.abs(np.diff(idx)) == 1)
        total += len(idx) - 1
    return hits / total, expected / total


@pytest.mark.parametrize("order", ["block"])
@pytest.mark.parametrize("records_per_shard", [20_000, 1_000, 100])
def test_a_batchs_positions_are_a_seeded_arrangement_not_stored_neighbours(order: str, records_per_shard: int) -> None:
    """Issue 21: batches sorted within (dsc before 0.4) made a MixUp/CutMix partner the stored neighbour 85%
    of the time in block order. Positions are now a seeded arrangement, shard by shard (`order.arrange`): each
    shard's records one contiguous segment (one gather each), the segments and the records within them in a
    random order. The partner is a stored neighbour as often as that design makes it (`partner_is_neighbour`):
    with one shard, as often as a uniformly random arrangement of the batch; with more, as often as a random
    arrangement of each shard's part."""
    n, b = 20_000, 32
    share = orders.epoch_share(n, order, 7, 0, 0, 1, b, False)
    batches = [orders.batch_indices(share, k, b, order, 7, 0, records_per_shard)
               for k in range(orders.batch_count(n, b))]
    assert np.array_equal(np.sort(np.concatenate(batches)), np.arange(n))  # the same records, once each
    for k, idx in enumerate(batches):
        assert np.array_equal(np.sort(idx), np.sort(share[k * b:(k + 1) * b]))  # each batch the same records
        assert one_stretch_per_shard(idx // records_per_shard)  # each shard one segment
    rate, designed = partner_is_neighbour(batches, records_per_shard)
    sigma = np.sqrt(designed / (n - len(batches)))  # binomial over the n - batches adjacent pairs
    assert abs(rate - designed) <= 5 * sigma + 1e-9, (rate, designed)
    again = [orders.batch_indices(share, k, b, order, 7, 0, records_per_shard) for k in range(len(batches))]
    assert all(np.array_equal(x, y) for x, y in zip(batches, again))  # deterministic
    other = [orders.batch_indices(share, k, b, order, 7, 1, records_per_shard) for k in range(len(batches))]
    assert sum(np.array_equal(x, y) for x, y in zip(batches, other)) < len(batches) / 10  # new each epoch


def test_random_orders_batches_are_sorted_samples() -> None:
    """Random order's batches are random samples of the dataset: kept sorted (the fastest read), their
    position partners are stored neighbours about as rarely as an arrangement's (README's table)."""
    share = orders.epoch_share(20_000, "random", 7, 0, 0, 1, 32, False)
    batches = [orders.batch_indices(share, k, 32, "random", 7, 0, 1_000) for k in range(625)]
    assert all(np.array_equal(idx, np.sort(share[k * 32:(k + 1) * 32])) for k, idx in enumerate(batches))
    rate = np.mean([np.count_nonzero(np.diff(idx) == 1) / 31 for idx in batches])
    assert rate < 0.01  # expected 31 / 20,000 per pair ~ 0.16%: a neighbour pair in a 32-sample is rare


def test_the_segments_come_in_a_random_order() -> None:
    """The segments' order is seeded too, not by shard number: over many batches of two shards, each comes
    first about half the time."""
    n, b = 2_000, 64
    share = orders.epoch_share(n, "block", 3, 0, 0, 1, b, False)
    firsts = [orders.batch_indices(share, k, b, "block", 3, e, 1_000)[0] // 1_000
              for e in range(20) for k in range(orders.batch_count(n, b))]
    assert 0.3 < np.mean(firsts) < 0.7, np.mean(firsts)  # 620 batches: 0.5 ± 0.02 (1 sigma)


def test_fill_gathers_an_arranged_batch_with_one_take_per_shard(monkeypatch) -> None:
    """The loader's arranged batches cost the calls a sorted batch did: one `np.take` per shard, straight
    into the shard's segment of rows (the arrangement of i21-mix took one per switch between shards)."""
    shards = [np.arange(k * 100, k * 100 + 100).reshape(100, 1, 1, 1).astype(np.uint16) for k in range(4)]
    share = orders.epoch_share(400, "block", 5, 0, 0, 1, 64, False)
    idx = orders.batch_indices(share, 0, 64, "block", 5, 0, 100)
    assert not np.array_equal(idx, np.sort(idx))
    calls = []
    real = np.take
    monkeypatch.setattr(np, "take", lambda *a, **k: calls.append(1) or real(*a, **k))
    dst = np.zeros((64, 1, 1, 1), np.uint16)
    fill(dst, shards, idx, 100)
    monkeypatch.undo()
    assert dst.reshape(-1).tolist() == idx.tolist()
    assert len(calls) == len(np.unique(idx // 100)), calls


def test_the_loader_serves_the_arrangement_and_sequential_order_stays_in_order(ds: MemmapDataset) -> None:
    """`index` says what is where: every image is its record's, in the arranged order."""
    got = served(ds.loader(8, order="block", seed=2))
    share = orders.epoch_share(len(ds), "block", 2, 0, 0, 1, 8, False)
    rps = ds.manifest.records_per_shard
    assert all(np.array_equal(g, orders.batch_indices(share, k, 8, "block", 2, 0, rps)) for k, g in enumerate(got))
    assert any(not np.array_equal(g, np.sort(g)) for g in got)
    for batch in ds.loader(8, order="random", seed=2):
        check_batch(ds, batch)
    assert [g.tolist() for g in served(ds.loader(8, order="sequential"))] == [list(range(0, 8)), list(range(8, 16)),
                                                                               list(range(16, 21))]


def test_gather_fill_and_split() -> None:
    shards = [np.arange(k * 10, k * 10 + n).reshape(n, 1, 1, 1).astype(np.uint8) for k, n in enumerate([10, 10, 3])]
    for idx in [np.arange(23), np.arange(23)[::-1].copy(), np.array([22, 0, 5, 5, 13, 9, 10]), np.array([4])]:
        dst = np.zeros((len(idx), 1, 1, 1), np.uint8)
        fill(dst, shards, idx, 10)
        assert dst.reshape(-1).tolist() == idx.tolist()
    assert split(10, 3) == [(0, 3), (3, 6), (6, 10)] and split(2, 4) == [(0, 1), (1, 2)]


def test_fill_copies_interleaved_shards_in_sorted_pieces(monkeypatch) -> None:
    """Indices hopping between shards (a DataLoader sampler's batch) cost a few copies, not one per hop."""
    shards = [np.arange(k * 10, k * 10 + n).reshape(n, 1, 1, 1).astype(np.uint8) for k, n in enumerate([10, 10, 3])]
    idx = np.array([0, 10, 20, 1, 11, 21, 2, 12, 22, 3, 13, 4, 14, 5, 15, 6, 16, 7, 17, 8, 18, 9, 19])
    calls = []
    for name in ("take", "copyto"):
        real = getattr(np, name)
        monkeypatch.setattr(np, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    dst = np.zeros((len(idx), 1, 1, 1), np.uint8)
    fill(dst, shards, idx, 10)
    monkeypatch.undo()
    assert dst.reshape(-1).tolist() == idx.tolist()
    # read in sorted order, each of the 3 runs written straight into its rows (`dst[rows] = run`, not counted
    # here): no gather per hop and no second copy back into order (dsc before 0.4: one take per shard + one)
    assert calls == [], calls
    for threads in (1, 3):  # the loader's threaded fill takes any order too
        dst[:] = 0
        with ThreadPoolExecutor(2) as pool:
            fill_parallel(dst, shards, idx[::-1].copy(), 10, pool, threads)
        assert dst.reshape(-1).tolist() == idx[::-1].tolist()


# ----------------------------------------------------------------------------- the loader

@pytest.mark.parametrize("order", orders.ORDERS)
@pytest.mark.parametrize("batch_size,drop_last,threads", [(4, False, 2), (4, True, 1), (1, False, 3),
                                                          (21, False, 2), (32, False, 2), (6, True, 3)])
def test_loader_equals_reference(ds: MemmapDataset, order: str, batch_size: int, drop_last: bool,
                                 threads: int) -> None:
    loader = ds.loader(batch_size, order=order, seed=5, drop_last=drop_last, num_threads=threads)
    for epoch in range(2):
        ref = list(reference_batches(ds, batch_size, order=order, seed=5, epoch=epoch, drop_last=drop_last))
        got = list(loader)
        assert len(got) == len(ref) == len(loader)
        for b, r in zip(got, ref):
            assert b["image"].shape == r["image"].shape and b["image"].dtype == torch.uint8
            assert b["image"].is_contiguous(memory_format=torch.channels_last)
            assert torch.equal(b["image"], r["image"])
            assert torch.equal(b["label"], r["label"]) and torch.equal(b["index"], r["index"])
            assert torch.equal(b["size"], r["size"])
            check_batch(ds, b)


@pytest.mark.parametrize("order", orders.ORDERS)
def test_epoch_covers_each_index_once(ds: MemmapDataset, order: str) -> None:
    loader = ds.loader(4, order=order, seed=1)
    epochs = [np.concatenate(served(loader)) for _ in range(3)]
    for idx in epochs:
        assert np.array_equal(np.sort(idx), np.arange(COUNT))
    assert loader.epoch == 3
    if order != "sequential":
        assert not np.array_equal(epochs[0], epochs[1])
        again = ds.loader(4, order=order, seed=1)
        again.set_epoch(1)
        assert np.array_equal(np.concatenate(served(again)), epochs[1])  # same (seed, epoch), same order


@pytest.mark.parametrize("order", orders.ORDERS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_distributed_loaders(ds: MemmapDataset, order: str, world: int, drop_last: bool) -> None:
    loaders = [ds.loader(3, order=order, seed=2, drop_last=drop_last, rank=r, world_size=world) for r in range(world)]
    per_rank = [served(ld) for ld in loaders]
    assert len({len(batches) for batches in per_rank}) == 1  # equal batch counts
    assert all(len(b) == len(ld) for b, ld in zip(per_rank, loaders))
    joined = np.concatenate([np.concatenate(b) if b else np.zeros(0, np.int64) for b in per_rank])
    if drop_last:
        assert all(len(x) == 3 for b in per_rank for x in b)
        assert len(np.unique(joined)) == len(joined)
    else:
        assert set(joined.tolist()) == set(range(COUNT)) and len(joined) - COUNT < world


def test_distributed_from_torch_distributed(ds: MemmapDataset, tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        loader = ds.loader(4)
        assert (loader.rank, loader.world_size) == (0, 1)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="both rank and world_size"):
        ds.loader(4, rank=1)
    with pytest.raises(ValueError, match="rank < world_size"):
        ds.loader(4, rank=2, world_size=2)


@pytest.mark.parametrize("order", orders.ORDERS)
def test_resume_mid_epoch(ds: MemmapDataset, order: str) -> None:
    full = [served(ds.loader(4, order=order, seed=9, world_size=2, rank=1)) for _ in range(1)][0]
    uninterrupted = ds.loader(4, order=order, seed=9, world_size=2, rank=1)
    epoch0, epoch1 = served(uninterrupted), served(uninterrupted)
    assert all(np.array_equal(a, b) for a, b in zip(full, epoch0))
    for k in range(len(epoch0) + 1):
        first = ds.loader(4, order=order, seed=9, world_size=2, rank=1)
        it = iter(first)
        for _ in range(k):
            next(it)
        state = first.state_dict()
        del it
        resumed = ds.loader(4, order=order, seed=9, world_size=2, rank=1)
        resumed.load_state_dict(state)
        rest = served(resumed)
        expected = epoch0[k:] if k < len(epoch0) else epoch1
        assert len(rest) == len(expected) and all(np.array_equal(a, b) for a, b in zip(rest, expected))
    with pytest.raises(ValueError, match="another epoch order.*'seed': \\(9, 10\\)"):
        ds.loader(4, order=order, seed=10).load_state_dict(state)


def training_loop(loader, epochs: range) -> list[np.ndarray]:
    """The README's loop: set_epoch at the top of every epoch, then iterate."""
    batches = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        batches += served(loader)
    return batches


@pytest.mark.parametrize("order", orders.ORDERS)
def test_resume_in_a_set_epoch_training_loop(ds: MemmapDataset, order: str) -> None:
    per_epoch = len(ds.loader(2))
    uninterrupted = training_loop(ds.loader(2, order=order, seed=4), range(4))
    first = ds.loader(2, order=order, seed=4)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    del it
    assert (state["epoch"], taken(state)) == (2, 5)
    resumed = ds.loader(2, order=order, seed=4)
    resumed.load_state_dict(state)
    rest = training_loop(resumed, range(state["epoch"], 4))  # set_epoch(2) must keep batch 5 pending
    expected = uninterrupted[2 * per_epoch + 5:]
    assert len(rest) == len(expected) == 2 * per_epoch - 5
    assert all(np.array_equal(a, b) for a, b in zip(rest, expected))
    other = ds.loader(2, order=order, seed=4)
    other.load_state_dict(state)
    other.set_epoch(3)  # another epoch: the pending position is dropped, epoch 3 starts at its first batch
    assert (other.state_dict()["epoch"], taken(other.state_dict())) == (3, 0)
    assert all(np.array_equal(a, b) for a, b in zip(served(other), uninterrupted[3 * per_epoch:]))


def test_state_dict_right_after_load_reports_the_loaded_position(ds: MemmapDataset) -> None:
    first = ds.loader(2, order="random", seed=4)
    for _k, _batch in zip(range(3), first):
        pass
    state = first.state_dict()
    assert (state["epoch"], taken(state)) == (0, 3)
    resumed = ds.loader(2, order="random", seed=4)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # not batch 0: saving again before iterating must not lose the place
    resumed.set_epoch(0)
    assert resumed.state_dict() == state
    done = dict(state, rounds=[dict(state["rounds"][0], batches=len(resumed))])  # every batch taken
    resumed.load_state_dict(done)
    assert served(resumed) == [] and resumed.epoch == 1  # nothing left of epoch 0: an empty pass ends it
    assert np.array_equal(np.concatenate(served(resumed)),
                          np.concatenate([b["index"] for b in reference_batches(ds, 2, order="random", seed=4,
                                                                                epoch=1)]))


def test_batches_kept_stay_valid(ds: MemmapDataset) -> None:
    loader = ds.loader(2, order="random", seed=0, prefetch=1, num_threads=2)
    kept = [b for _ in range(3) for b in loader]
    pieces = [b["image"][0] for b in loader]  # only a view of each batch survives
    for batch in kept:
        check_batch(ds, batch)
    assert len({b["image"].data_ptr() for b in kept}) == len(kept)
    for piece, index in zip(pieces, [b["index"][0].item() for b in reference_batches(ds, 2, order="random",
                                                                                     epoch=3)]):
        assert torch.equal(piece, ds[index].image)


def test_dropped_batches_are_recycled(ds: MemmapDataset) -> None:
    loader = ds.loader(2, order="sequential", prefetch=1, num_threads=1)
    pointers = set()
    for batch in loader:
        pointers.add(batch["image"].data_ptr())
        check_batch(ds, batch)
        del batch
    assert len(pointers) <= loader.prefetch + 4  # the pool and the short last batch, not one per batch


def test_worker_error_reaches_consumer(ds: MemmapDataset, monkeypatch) -> None:
    real = producer_module.fill_parallel
    calls = []

    def failing(dst, shards, idx, *args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk on fire")
        return real(dst, shards, idx, *args)

    monkeypatch.setattr(producer_module, "fill_parallel", failing)
    got = []
    with pytest.raises(LoaderError, match=r"batch 2 of epoch 0 \(rank 0/1\) failed: OSError: disk on fire") as e:
        for b in ds.loader(4, order="sequential"):
            got.append(b)
    assert isinstance(e.value.__cause__, OSError) and len(got) == 2


def test_early_break_stops_the_producer(ds: MemmapDataset) -> None:
    before = threading.active_count()
    loader = ds.loader(1, order="random", prefetch=1, num_threads=3)
    for _k, _batch in zip(range(2), loader):
        pass
    assert threading.active_count() == before
    assert taken(loader.state_dict()) == 2 and loader.epoch == 1  # was 0: a pass after a break moves on (issue 20)
    assert len(served(loader)) == COUNT  # a new iteration serves a whole epoch, the next one


def test_bad_arguments(ds: MemmapDataset) -> None:
    with pytest.raises(ValueError, match="order must be one of"):
        ds.loader(4, order="shuffled")
    for kwargs in [{"batch_size": 0}, {"batch_size": 2, "prefetch": 0}, {"batch_size": 2, "num_threads": 0},
                   {"batch_size": 2, "seed": -1}]:
        with pytest.raises(ValueError, match="must be a (positive|non-negative) integer"):
            ds.loader(**kwargs)


def test_settings_are_read_only_so_the_thread_ahead_never_disagrees_with_the_state(ds: MemmapDataset) -> None:
    loader = ds.loader(4, seed=3, order="random")
    first = next(iter(loader))["index"].tolist()  # the producer is now making batches ahead with seed 3
    for name, value in [("seed", 7), ("batch_size", 8), ("order", "sequential"), ("drop_last", True),
                        ("device", None), ("prefetch", 5), ("num_threads", 1), ("locality", "shard")]:
        with pytest.raises(AttributeError, match=f"a loader's {name} is fixed when it is made"):
            setattr(loader, name, value)
    assert loader.seed == loader.config.seed == loader.state_dict()["seed"] == 3 and loader.batch_size == 4
    fresh = ds.loader(4, seed=3, order="random")
    assert next(iter(fresh))["index"].tolist() == first


def test_cpu_device_and_batch_layout(ds: MemmapDataset) -> None:
    batch = next(iter(ds.loader(5, device="cpu", order="sequential")))
    assert batch.batch_size == (5,) and batch["image"].shape == (5, 3, *SIZE)
    assert batch["label"].dtype == torch.int64 and batch["index"].tolist() == [0, 1, 2, 3, 4]
    assert batch["size"].dtype == torch.int64 and batch["size"].shape == (5, 2)
    for k, i in enumerate(batch["index"].tolist()):  # the sources' own upright (height, width)
        with Image.open(ds.source(i)) as img:
            width, height = ImageOps.exif_transpose(img).size
        assert batch["size"][k].tolist() == [height, width]


@pytest.fixture(scope="module")
def sorted_ds(tmp_path_factory) -> MemmapDataset:
    """4 classes of 12 real images compiled with shuffle off: stored class after class."""
    root = tmp_path_factory.mktemp("sorted")
    make_image_folder(root / "src", classes=4, per_class=12, size=(12, 16), seed=2)
    dsc.compile_folder(root / "src", root / "ds", size=(8, 8), shuffle=False, workers=1)
    return MemmapDataset(root / "ds")


def test_a_dataset_stored_sorted_is_read_in_random_order_by_default(sorted_ds: MemmapDataset, ds) -> None:
    """--no-shuffle + the default block order gave batches of one or two classes (14.5% top-1; issue 26)."""
    labels = sorted_ds.opened.labels
    assert np.array_equal(labels, np.sort(labels))  # stored class after class
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default warns about nothing
        loader = sorted_ds.loader(8)
        assert loader.order == "random" and ds.loader(8).order == "block"  # a shuffled dataset keeps blocks
        assert sorted_ds.loader(8, order="sequential").order == "sequential"  # asked for: served as asked
        ds.loader(8, order="block")
    assert loader.state_dict()["order"] == "random"
    epoch = np.concatenate([b["index"].numpy() for b in loader])
    assert np.array_equal(np.sort(epoch), np.arange(len(sorted_ds))) and not np.array_equal(epoch, np.sort(epoch))
    with pytest.warns(UserWarning, match=r"compiled with shuffle off.*order='block' serves batches of few classes "
                                         r"\(\d+\.\d distinct classes per batch of 8 on average, against \d+\.\d in "
                                         r"random order, of 4\); use order='random'"):
        assert sorted_ds.loader(8, order="block").order == "block"
    with pytest.warns(UserWarning, match="compiled with shuffle off"):  # blocks are what locality reads
        assert sorted_ds.loader(8, locality="shard", rank=0, world_size=2).order == "block"


@pytest.mark.parametrize("batch_size", [1, 2, 3, 21])
def test_unpacking_a_batch_fails_naming_as_tuple_and_as_tuple_gives_tuples(ds: MemmapDataset,
                                                                           batch_size: int) -> None:
    """`x, y = batch` (the DataLoader habit) gave two samples at batch size 2: it fails at every size (issue 26)."""
    batch = next(iter(ds.loader(batch_size, order="sequential")))
    for unpack in (lambda: tuple(batch), lambda: [s for s in batch], lambda: tuple(batch.to("cpu"))):
        with pytest.raises(TypeError, match=r"as_tuple=\('image', 'label'\)"):
            unpack()
    with pytest.raises(TypeError, match="as_tuple"):
        x, y = batch
    assert [tuple(s.batch_size) for s in batch.unbind(0)] == [()] * batch_size  # samples stay one call away
    tuples = ds.loader(batch_size, order="sequential", as_tuple=("image", "label"))
    x, y = next(iter(tuples))
    assert torch.equal(x, batch["image"]) and torch.equal(y, batch["label"])
    assert x.is_contiguous(memory_format=torch.channels_last)
    for got, want in zip(tuples, ds.loader(batch_size, order="sequential"), strict=True):  # the next epoch too
        assert isinstance(got, tuple) and len(got) == 2 and torch.equal(got[1], want["label"])
    index, size = next(iter(ds.loader(batch_size, order="sequential", as_tuple=["index", "size"])))
    assert torch.equal(index, batch["index"]) and torch.equal(size, batch["size"])


@pytest.mark.parametrize(("as_tuple", "message"), [("image", "a tuple of field names"), ((), "a tuple of field"),
                                                   (("image", 1), "a tuple of field"),
                                                   (("image", "target"), r"as_tuple names \['target'\]")])
def test_bad_as_tuple_is_refused_where_the_loader_is_made(ds: MemmapDataset, as_tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ds.loader(4, as_tuple=as_tuple)


@pytest.mark.parametrize(("device", "message"), [
    ("gpu", "unknown device 'gpu'; use 'cuda', 'cuda:N' or None"),
    ("cuda:x", "unknown device 'cuda:x'; use 'cuda', 'cuda:N' or None"),
    ("mps", "the loader copies to CUDA devices only; got 'mps'"),
    (torch.device("meta"), "the loader copies to CUDA devices only; got 'meta'")])
def test_devices_that_are_not_cuda_are_refused_where_the_loader_is_made(ds: MemmapDataset, device,
                                                                         message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ds.loader(4, device=device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "cpu:0"])
def test_cpu_device_is_the_same_as_none(ds: MemmapDataset, device) -> None:
    loader, plain = ds.loader(4, device=device, seed=3), ds.loader(4, seed=3)
    assert loader.device is None and repr(loader) == repr(plain)
    for a, b in zip(loader, plain, strict=True):
        assert a.device is None and (a == b).all()


def bench(*args: str):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


@pytest.mark.parametrize(("device", "message"), [("gpu", "unknown device 'gpu'"), ("cuda:x", "unknown device"),
                                                 ("mps", "the loader copies to CUDA devices only; got 'mps'")])
def test_bench_refuses_a_device_as_the_loader_does(ds: MemmapDataset, device: str, message: str) -> None:
    result = bench(ds.path, "--device", device)
    assert result.exit_code == 2 and result.stdout == ""
    assert re.search(rf"Invalid value for '?--device'?: {re.escape(message)}", result.stderr)
    assert "Traceback" not in result.stderr


def test_bench_device_cpu_is_noted_and_rows_give_producer_costs_not_waits(ds: MemmapDataset) -> None:
    result = bench(ds.path, "--device", "cpu", "--seconds", "0.1", "--batch-size", "4", "--no-cold")
    assert result.exit_code == 0, result.stderr
    assert "note: --device cpu is the host path the other rows already measure\n" in result.stderr
    assert "waited" not in result.stdout and ", to " not in result.stdout
    for order in orders.ORDERS:
        assert re.search(rf"^dsc loader, {order}: producer: \d+ batches; per batch gather \d+\.\d\d ms, "
                         r"upload \d+\.\d\d ms$", result.stdout, re.M), result.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("order", orders.ORDERS)
def test_cuda_path_equals_reference(ds: MemmapDataset, order: str) -> None:
    loader = ds.loader(4, order=order, device="cuda", prefetch=2)
    for _epoch in range(2):
        ref = list(reference_batches(ds, 4, order=order, seed=loader.seed, epoch=loader.epoch))  # its drawn seed
        kept = list(loader)  # kept across ring wrap-arounds: must all stay valid
        torch.cuda.synchronize()
        assert len(ref) > 0 and len(kept) == len(ref) == len(loader)
        for b, r in zip(kept, ref, strict=True):
            assert b["image"].device.type == "cuda"
            assert torch.equal(b["image"].cpu(), r["image"]) and torch.equal(b["index"].cpu(), r["index"])
            assert torch.equal(b["label"].cpu(), r["label"]) and torch.equal(b["size"].cpu(), r["size"])
