"""locality="shard": each rank reads its own rotating subset of the shards; coverage, balance, resume."""

from __future__ import annotations

import heapq
import warnings

import numpy as np
import pytest
import torch

import dsc
from dsc.reader import MemmapDataset, progress
from dsc.reader import order as orders
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

COUNT = 21  # 3 classes × 7 images
SHARDINGS = {2: 11, 4: 6, 9: 3, 32: 1}  # records_per_shard → shards (the last shard is short, except at 32)
WORLDS = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[int, MemmapDataset]:
    """One 21-record dataset per records_per_shard: more shards than ranks, fewer, and a single shard."""
    root = tmp_path_factory.mktemp("locality")
    src = make_image_folder(root / "src", classes=3, per_class=7, size=(24, 32))
    out = {}
    for per_shard, shards in SHARDINGS.items():
        dsc.compile_folder(src, root / f"ds{per_shard}", size=8, records_per_shard=per_shard, workers=1)
        out[per_shard] = MemmapDataset(root / f"ds{per_shard}")
        assert len(out[per_shard]) == COUNT and len(out[per_shard].manifest.shards) == shards
    return out


def epoch_indices(loader) -> list[np.ndarray]:
    return [b["index"].numpy().copy() for b in loader]


def shards_of(indices: np.ndarray, per_shard: int) -> set[int]:
    return set((np.asarray(indices) // per_shard).tolist())


def run_epoch(ds: MemmapDataset, world: int, epoch: int, **options) -> list[list[np.ndarray]]:
    """One epoch of every rank: per rank, its batches' indices."""
    out = []
    for r in range(world):
        loader = ds.loader(3, order="block", locality="shard", rank=r, world_size=world, **options)
        loader.set_epoch(epoch)
        out.append(epoch_indices(loader))
    return out


# ----------------------------------------------------------------------------- units and groups (pure)

@pytest.mark.parametrize("world", range(1, 10))
def test_groups_partition_the_records_within_one_unit_of_balance(world: int) -> None:
    for n in range(1, 120):
        for per_shard in (1, 2, 3, 7, 16, 50, 200):
            units, group_of = orders.shard_groups(n, per_shard, world)
            sizes, shards = np.diff(units), -(-n // per_shard)
            assert units[0] == 0 and units[-1] == n and (sizes > 0).all()
            assert all(len(shards_of([a, b - 1], per_shard)) == 1 for a, b in zip(units[:-1], units[1:]))
            if shards >= world:  # whole shards
                assert np.array_equal(units, np.r_[np.arange(0, n, per_shard), n])
            else:  # each shard cut into equal parts: at least `world` of them when there are records enough
                assert len(sizes) >= min(world, n)
                full = sizes[units[1:] <= (shards - 1) * per_shard]
                assert len(full) == 0 or full.max() - full.min() <= 1
            groups = [orders.group_records(units, group_of, g) for g in range(world)]
            assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(n))
            counts = np.array([len(g) for g in groups])
            assert np.array_equal(counts, orders.group_sizes(units, group_of, world))
            assert counts.max() - counts.min() <= sizes.max()  # the imbalance rule
            if shards >= world:
                assert counts.max() - counts.min() <= per_shard
            if n >= world:
                assert (counts > 0).all()  # every rank gets work


def test_refused_settings(datasets) -> None:
    ds = datasets[4]
    for order in ("sequential", "random"):
        with pytest.raises(ValueError, match="works with order='block' only"):
            ds.loader(3, order=order, locality="shard", rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"locality must be None or one of \('shard',\), got 'node'"):
        ds.loader(3, locality="node", rank=0, world_size=2)
    with pytest.raises(ValueError, match="works with order='block' only"):
        orders.epoch_share(COUNT, "random", 0, 0, 0, 2, 3, False, locality="shard", records_per_shard=4)


# ----------------------------------------------------------------------------- the loader

@pytest.mark.parametrize("per_shard", list(SHARDINGS))
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_rank_reads_its_own_shards_and_the_epoch_covers_all(datasets, per_shard: int, world: int,
                                                                 drop_last: bool) -> None:
    ds = datasets[per_shard]
    shards = len(ds.manifest.shards)
    for epoch in (0, 1):
        ranks = run_epoch(ds, world, epoch, seed=7, drop_last=drop_last)
        lengths = {len(batches) for batches in ranks}
        assert len(lengths) == 1  # equal batch counts
        loader = ds.loader(3, locality="shard", rank=0, world_size=world, drop_last=drop_last)
        assert lengths == {len(loader)}
        served = [np.concatenate(b) if b else np.zeros(0, np.int64) for b in ranks]
        distinct = [np.unique(s) for s in served]
        if shards >= world:  # whole shards: no shard is read by two ranks in one epoch
            touched = [shards_of(d, per_shard) for d in distinct]
            assert sum(len(t) for t in touched) == len(set().union(*touched))
            assert all(len(t) <= -(-shards // world) for t in touched)
        else:  # parts of shards: disjoint records, at most two shards a rank
            assert all(len(shards_of(d, per_shard)) <= 2 for d in distinct)
        joined = np.concatenate(distinct)
        assert len(np.unique(joined)) == len(joined)  # no record on two ranks
        if drop_last:
            assert all(len(x) == 3 for b in ranks for x in b)
            assert all(len(s) == len(d) for s, d in zip(served, distinct))  # nothing twice
        else:
            assert np.array_equal(np.sort(joined), np.arange(COUNT))  # the union covers the dataset once
            counts = [len(d) for d in distinct]
            assert max(counts) - min(counts) <= per_shard  # within one unit
            assert all(len(s) == max(counts) for s in served)  # the padding repeats a rank's own records


@pytest.mark.parametrize("per_shard", [2, 9])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_assignment_rotates_and_every_rank_sees_every_shard(datasets, per_shard: int, world: int) -> None:
    ds = datasets[per_shard]
    batches = [run_epoch(ds, world, e, seed=3) for e in range(world + 1)]
    epochs = [[set(np.concatenate(b).tolist()) for b in ranks] for ranks in batches]
    for e in range(world):
        assert epochs[e] != epochs[e + 1]  # the assignment changes every epoch
        for r in range(world):  # a group passes from rank r + 1 to rank r: a node keeps most of its shards
            assert epochs[e + 1][r] == epochs[e][(r + 1) % world]
    for r in range(world):
        seen = set().union(*(epochs[e][r] for e in range(world)))
        assert seen == set(range(COUNT))  # every record, so every shard, within `world` epochs
    again = run_epoch(ds, world, 1, seed=3)
    assert all(np.array_equal(x, y) for a, b in zip(again, batches[1]) for x, y in zip(a, b))  # per (seed, epoch)
    other = [set(np.concatenate(b).tolist()) for b in run_epoch(ds, world, 1, seed=4)]
    assert other == epochs[2]  # the rule (rank + seed + epoch) % world: seed 4 at epoch 1 = seed 3 at epoch 2


def test_order_is_deterministic_and_block_like_within_a_rank() -> None:
    share = orders.epoch_share(20_000, "block", 5, 3, 1, 4, 64, False, locality="shard", records_per_shard=1000)
    again = orders.epoch_share(20_000, "block", 5, 3, 1, 4, 64, False, locality="shard", records_per_shard=1000)
    assert np.array_equal(share, again)
    assert not np.array_equal(share, orders.epoch_share(20_000, "block", 5, 4, 1, 4, 64, False,
                                                        locality="shard", records_per_shard=1000))
    assert orders.distinct_shards(share, 1000) == 5  # 20 shards over 4 ranks
    window = orders.BLOCK_RECORDS * orders.WINDOW_BLOCKS  # block order's windows: each a few blocks' records
    for start in range(0, len(share) - window, window):
        assert len(np.unique(share[start:start + window] // orders.BLOCK_RECORDS)) <= 4 * orders.WINDOW_BLOCKS
    assert not np.array_equal(np.sort(share[:512]), np.arange(share[:512].min(), share[:512].min() + 512))


@pytest.mark.parametrize("per_shard,world", [(2, 3), (9, 5), (32, 2)])
def test_batches_equal_the_dataset(datasets, per_shard: int, world: int) -> None:
    ds = datasets[per_shard]
    for r in range(world):
        loader = ds.loader(4, locality="shard", rank=r, world_size=world, num_threads=2, seed=3)
        reference = reference_batches(ds, 4, locality="shard", rank=r, world_size=world, seed=3)
        for batch, ref in zip(loader, reference, strict=True):  # the plain reference loader agrees
            assert torch.equal(batch["index"], ref["index"]) and torch.equal(batch["image"], ref["image"])
            assert torch.equal(batch["label"], ref["label"])


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_mid_epoch(datasets, drop_last: bool) -> None:
    ds = datasets[2]
    options = dict(order="block", locality="shard", seed=9, rank=1, world_size=3, drop_last=drop_last)
    uninterrupted = ds.loader(2, **options)
    epoch0, epoch1 = epoch_indices(uninterrupted), epoch_indices(uninterrupted)
    for k in range(len(epoch0) + 1):
        first = ds.loader(2, **options)
        it = iter(first)
        for _ in range(k):
            next(it)
        state = first.state_dict()
        del it
        assert state["rounds"][0]["locality"] == "shard" if 0 < k < len(epoch0) else state["rounds"] == []
        resumed = ds.loader(2, **options)
        resumed.load_state_dict(state)
        rest = epoch_indices(resumed)
        expected = epoch0[k:] if k < len(epoch0) else epoch1
        assert len(rest) == len(expected) and all(np.array_equal(a, b) for a, b in zip(rest, expected))


def test_an_epoch_begun_with_locality_ends_without_it(datasets) -> None:
    """Locality shapes an epoch's first round; a resume with another split deals the rest plainly."""
    ds, world = datasets[2], 3
    options = dict(order="block", locality="shard", seed=9, world_size=world)
    firsts = [ds.loader(2, rank=r, **options) for r in range(world)]
    before = [b["index"] for ld in firsts for _, b in zip(range(2), ld)]
    state = firsts[0].state_dict()
    rest = []
    for r in range(2):
        plain = ds.loader(3, order="block", seed=9, rank=r, world_size=2)
        plain.load_state_dict(state)
        rest += [b["index"] for b in plain]
    got = torch.cat(before + rest).tolist()
    assert set(got) == set(range(len(ds))) and len(got) - len(ds) <= 2 - 1  # the new round's padding only


def test_trade_off_measures() -> None:
    labels = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    assert orders.class_mix(labels, [np.array([0, 1]), np.array([0, 2, 4, 6])]) == (2.5, 1.0)
    assert orders.distinct_shards(np.array([0, 3, 4, 9]), 4) == 3
    n, per_shard, world = 20_000, 1000, 4
    default = orders.epoch_share(n, "block", 0, 0, 0, world, 64, False)
    local = orders.epoch_share(n, "block", 0, 0, 0, world, 64, False, locality="shard", records_per_shard=per_shard)
    assert orders.distinct_shards(default, per_shard) >= 15  # a slice of a global block order: nearly every shard
    assert orders.distinct_shards(local, per_shard) == 5


# ----------------------------------------------------------------------------- what drop_last leaves out

def test_imagenet_in_1_gib_shards_at_64_ranks_is_told_what_drop_last_leaves_out() -> None:
    """1,281,167 records of 224x224 in 1 GiB shards (7,133 records): 180 shards in groups of 2 or 3 at
    64 ranks, every rank cut to a group of 2: 71% served. The advice given, followed, serves >= 95%."""
    n, per_shard, world, batch = 1_281_167, (1 << 30) // (224 * 224 * 3), 64, 32
    said = orders.dropped_by_locality(n, per_shard, world, batch)
    assert said is not None and "serves 911360 of the 1281167 records per epoch (29% left out)" in said
    assert "compile with --records-per-shard 969 (or fewer)" in said
    served = orders.share_length(n, world, batch, True, locality="shard", records_per_shard=969) * world
    assert served >= 0.95 * n and orders.dropped_by_locality(n, 969, world, batch) is None
    for fits in (1, 100, 969):  # the bound behind the advice holds for any shard size up to it, not just at it
        assert orders.share_length(n, world, batch, True, locality="shard", records_per_shard=fits) * world >= 0.95 * n
    assert orders.dropped_by_locality(n, per_shard, 8, batch) is None  # 180 shards over 8 ranks: 2% left out
    big_batches = orders.dropped_by_locality(n, per_shard, world, 1024)
    assert big_batches is not None and "no --records-per-shard is sure to keep that under 5%" in big_batches


def test_the_loader_warns_when_drop_last_leaves_out_more_than_5_percent(tmp_path) -> None:
    """48 records in shards of 7 (6 shards and one of 6) over 2 ranks: groups of 27 and 21, each rank
    serves 21, 12.5% left out every epoch; in shards of 8 the groups are equal and nothing is said."""
    src = make_image_folder(tmp_path / "src", classes=3, per_class=16, size=(16, 16))
    for per_shard in (7, 8):
        dsc.compile_folder(src, tmp_path / f"ds{per_shard}", size=8, records_per_shard=per_shard, workers=1)
    uneven, even = MemmapDataset(tmp_path / "ds7"), MemmapDataset(tmp_path / "ds8")
    loader = uneven.loader(1, order="block", locality="shard", rank=0, world_size=2, drop_last=True, seed=0)
    with pytest.warns(UserWarning, match=r"serves 42 of the 48 records per epoch \(12% left out\).*"
                                         r"--records-per-shard 1 \(or fewer\)"):
        assert len(epoch_indices(loader)) == 21
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ds, drop_last in ((even, True), (uneven, False)):
            loader = ds.loader(1, order="block", locality="shard", rank=1, world_size=2, drop_last=drop_last, seed=0)
            epoch_indices(loader)


# ----------------------------------------------------------------------------- at a huge world size (issue 27)

def heap_deal(sizes: np.ndarray, world: int) -> np.ndarray:
    """The rule as written (module docstring of `order`), one unit at a time: dsc 0.4's loop."""
    heap = [(0, g) for g in range(world)]
    group_of = np.empty(len(sizes), dtype=np.int64)
    for u in np.argsort(-sizes, kind="stable"):
        load, g = heapq.heappop(heap)
        group_of[u] = g
        heapq.heappush(heap, (load + int(sizes[u]), g))
    return group_of


def test_units_are_dealt_as_the_rule_says_a_run_of_equal_sizes_at_a_time() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):  # any sizes, many ties
        world = int(rng.integers(1, 20))
        sizes = rng.integers(1, 6, size=int(rng.integers(1, 60)))
        assert np.array_equal(orders.deal(sizes, world), heap_deal(sizes, world))
    for n, per_shard, world in ((100, 7, 16), (1000, 3, 400), (5000, 64, 3000), (99_999, 1000, 77)):
        units, group_of = orders.shard_groups(n, per_shard, world)
        assert np.array_equal(group_of, heap_deal(np.diff(units), world))


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_resume_at_2_16_ranks_orders_only_the_groups_it_serves(monkeypatch, drop_last: bool) -> None:
    """2^24 records over 2^16 ranks, saved after one batch, resumed on another batch size and on 8 ranks: the
    last rank's first batch orders at most `ShardRest.SEGMENTS` groups (+1 for the group its share begins in)
    and holds no array of the epoch. Before, the replay ordered every rank's group (65,536 block orders,
    16 s) and queued the whole epoch (several arrays of 2^24 int64)."""
    from test_lazy_resume import _first_batch, _peak  # the loader's own path to a resumed first batch

    n, world = 1 << 24, 1 << 16
    epoch = progress.Epoch(n, "block", 3, 1, 1024)
    saved = progress.Round(progress.Split(world, 8, drop_last, "shard"), 1)
    real, streams = orders.block_windows, set()

    def counted(size, seed, epoch, block_records=orders.BLOCK_RECORDS, stream=()):
        streams.add(stream)
        return real(size, seed, epoch, block_records, stream)

    monkeypatch.setattr(orders, "block_windows", counted)
    for live in (progress.Split(world, 4, drop_last), progress.Split(8, 8, drop_last)):
        streams.clear()
        assert _peak(_first_batch, epoch, [saved], live) < n * 8
        assert 1 <= len(streams) <= orders.ShardRest.SEGMENTS + 1
        assert _peak(progress.cut_off, epoch, [saved], live, 10) < n * 8


def test_a_state_of_order_version_2_with_drop_last_is_refused_where_its_order_changed(datasets) -> None:
    """What a locality="shard" round with drop_last=True leaves out comes in rank order since order_version 3
    (record order before: every group's order to compute it). A version-2 state whose round is replayed is
    refused, saying how to go on; on its own split the round goes on, unchanged; drop_last=False is unchanged."""
    ds = datasets[2]
    options = dict(order="block", locality="shard", seed=9, rank=1, world_size=3)
    first = ds.loader(2, drop_last=True, **options)
    it = iter(first)
    next(it)
    state = {**first.state_dict(), "order_version": 2}
    rest = [b["index"].tolist() for b in it]
    with pytest.raises(ValueError, match=r"middle of epoch 0 .* left what drop_last cut in record order \(order_"
                                         r"version 2\); .* To continue, resume on the split that saved it "
                                         r"\(world_size=3, batch_size=2, drop_last=True, locality='shard'"):
        ds.loader(3, drop_last=True, **options).load_state_dict(state)
    same = ds.loader(2, drop_last=True, **options)
    same.load_state_dict(state)
    assert [b["index"].tolist() for b in same] == rest
    plain = ds.loader(2, drop_last=False, **options)
    it = iter(plain)
    next(it)
    state = {**plain.state_dict(), "order_version": 2}
    ds.loader(3, drop_last=False, **options).load_state_dict(state)  # the same order in both versions: loads
