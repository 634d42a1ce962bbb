"""The epoch order a chunk at a time (issue 27): random order as a seeded bijection computed for any
positions, a rank's share computed as it is served, the same batches in the loader and the reference
loader, and loader states of the old random order refused rather than resumed on the new one."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from dsc.reader import MemmapDataset, progress
from dsc.reader import order as orders
from dsc.reader.reference import reference_batches

from conftest import tiny_dataset


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("random_order"), seed=4, records_per_shard=5)


def indices(batches) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


# ----------------------------------------------------------------------------- a bijection, any positions alone

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 63, 64, 65, 1000, 4097])
def test_random_order_is_a_permutation_of_every_size(n: int) -> None:
    for seed, epoch in ((0, 0), (3, 1), (2**40, 7)):
        assert np.array_equal(np.sort(orders.random(n, seed, epoch)), np.arange(n))


@pytest.mark.parametrize("order", orders.ORDERS)
def test_any_positions_alone_are_those_of_the_whole_order(order: str, monkeypatch) -> None:
    """order_slice and LazyShare compute chunks of CHUNK positions: each chunk, a slice across chunks, and the
    wrap to the order's start (padding) hold what the whole order holds there."""
    monkeypatch.setattr(orders, "CHUNK", 1000)
    n = 5003
    whole = orders.epoch_order(n, order, 7, 2)
    for start, stop in ((0, n), (999, 1001), (1234, 4321), (4000, n + 2500)):
        expected = np.resize(np.roll(whole, -start), stop - start)  # the order repeated end to end
        assert np.array_equal(orders.order_slice(n, order, 7, 2, start, stop), expected)
        share = orders.LazyShare(orders.EpochOrder(n, order, 7, 2), start, stop)
        assert np.array_equal(np.concatenate([share[a:a + 333] for a in range(0, len(share), 333)]), expected)


def test_random_order_never_draws_a_permutation_of_every_record(monkeypatch) -> None:
    """Before issue 27 every process drew numpy's permutation of all n records (0.8 GB at 10^8) for any share."""
    real = orders.generator

    class SmallPermutationsOnly:
        def __init__(self, rng: np.random.Generator) -> None:
            self.rng = rng

        def permutation(self, x):
            if (x if isinstance(x, int) else len(x)) > 100:
                raise AssertionError(f"a permutation of {x} records")
            return self.rng.permutation(x)

        def __getattr__(self, name: str):
            return getattr(self.rng, name)

    monkeypatch.setattr(orders, "generator", lambda *args: SmallPermutationsOnly(real(*args)))
    n = 50_000
    share = orders.epoch_share(n, "random", 1, 0, 3, 8, 64, False)
    assert len(share) == n // 8 and len(np.unique(share)) == len(share)
    lazy = progress.Epoch(n, "random", 1, 0, 100).first_round_share(progress.Split(8, 64, False), 3)
    assert np.array_equal(lazy[:], share)


def test_a_loaders_share_holds_one_chunk_not_the_share(monkeypatch) -> None:
    monkeypatch.setattr(orders, "CHUNK", 1000)
    n, batch = 100_000, 64
    planner = progress.Planner(n, "block", 3, 1000, 0)
    p, share = planner.plan(0, [], progress.Split(1, batch, False), 0)
    assert isinstance(share, orders.LazyShare) and len(share) == n
    served = np.concatenate([orders.batch_indices(share, b, batch, "block", 3, 0, 1000) for b in range(p.count)])
    assert np.array_equal(np.sort(served), np.arange(n))
    assert len(share._chunk[1]) <= orders.CHUNK + batch


# ----------------------------------------------------------------------------- statistical quality

def chi_square_critical(dof: int, z: float = 4.753) -> float:
    """The chi-square value exceeded with probability 1e-6 (z: the normal's), by Wilson and Hilferty."""
    c = 2 / (9 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


def chi_square(a: np.ndarray, b: np.ndarray, n: int, buckets: int = 16) -> float:
    """Of the pairs (a[k], b[k]), each uniform on [0, n) and independent of the other: counts in buckets²."""
    counts = np.bincount(a * buckets // n * buckets + b * buckets // n, minlength=buckets**2)
    expected = len(a) / buckets**2
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seed", range(4))
def test_positions_and_records_are_independent_and_uniform(seed: int) -> None:
    """order[i] against i, and order[i + 1] against order[i]: uniform over the buckets' pairs. (The identity
    gives a chi-square of ~10^6 against a bound of ~370; numpy's permutation passes as this does.)"""
    n = 16 * 4099  # buckets of equal size
    order = orders.random(n, seed, 1)
    bound = chi_square_critical(16**2 - 1)
    assert chi_square(np.arange(n), order, n) < bound
    assert chi_square(order[:-1], order[1:], n) < bound


def test_neighbours_in_position_are_neighbours_in_storage_no_more_than_chance() -> None:
    """Positions i and i + 1 hold records within 8 of each other with probability ~16/n (k of them at
    distance k... counted over 5 epochs: ~80 expected; the bound is 6 standard deviations above)."""
    n = 1 << 16
    close = sum(int((np.abs(np.diff(orders.random(n, 9, epoch))) <= 8).sum()) for epoch in range(5))
    expected = 5 * 16 * (n - 1) / n
    assert close < expected + 6 * math.sqrt(expected)


# ----------------------------------------------------------------------------- the loader, the reference, block order

@pytest.mark.parametrize("order", orders.ORDERS)
def test_the_loader_and_the_reference_serve_the_rank_slices_of_the_whole_order(ds: MemmapDataset, order: str,
                                                                               monkeypatch) -> None:
    """Chunks smaller and larger than a batch: both loaders serve `rank_share` of the whole epoch order."""
    for chunk in (5, 1000):
        monkeypatch.setattr(orders, "CHUNK", chunk)
        for rank in range(3):
            served = indices(ds.loader(3, order=order, seed=2, rank=rank, world_size=3))
            assert served == indices(reference_batches(ds, 3, order=order, seed=2, rank=rank, world_size=3))
            whole = orders.rank_share(orders.epoch_order(len(ds), order, 2, 0), rank, 3, 3, False)
            assert sorted(served) == sorted(whole.tolist())
            if order == "sequential":
                assert served == whole.tolist()


def test_block_order_is_the_one_before_issue_27() -> None:
    """Block order's chunks, windows and first batch changed how they are computed, not what they give: the
    order of dsc 0.4 (np.unique of the edges, one lexsort of the windows) for (n=5000, seed=5, epoch=2)."""
    order = orders.block(5000, 5, 2)
    assert order[:12].tolist() == [4007, 3934, 3049, 850, 141, 2529, 1448, 2532, 2837, 247, 2801, 4067]
    assert hashlib.sha256(order.tobytes()).hexdigest()[:16] == "68e46bbd0fa04885"


# ----------------------------------------------------------------------------- states of the old random order

def mid_epoch_state(ds: MemmapDataset, order: str) -> dict:
    loader = ds.loader(3, order=order, seed=1, rank=0, world_size=2)
    return {**loader.state_dict(), "epoch": 1,
            "rounds": [{"world_size": 2, "batch_size": 3, "drop_last": False, "locality": None, "batches": 2}]}


def test_a_state_records_its_order_version(ds: MemmapDataset) -> None:
    assert ds.loader(3, order="random").state_dict()["order_version"] == orders.ORDER_VERSION == 3


def test_a_random_order_state_of_version_1_is_refused_mid_epoch(ds: MemmapDataset) -> None:
    state = mid_epoch_state(ds, "random")
    del state["order_version"]  # saved before it was recorded
    with pytest.raises(ValueError, match=r"middle of epoch 1 by a dsc whose random order was numpy's permutation "
                                         r"\(order_version 1\).* serve some samples of the epoch twice"):
        ds.loader(3, order="random", seed=1, rank=0, world_size=2).load_state_dict(state)
    ended = {**state, "rounds": []}  # saved at an epoch's end: nothing of epoch 1 served, it starts whole
    loader = ds.loader(3, order="random", seed=1, rank=0, world_size=2)
    loader.load_state_dict(ended)
    assert indices(loader) == indices(reference_batches(ds, 3, order="random", seed=1, epoch=1, world_size=2))


def test_a_block_order_state_of_version_1_resumes_exactly(ds: MemmapDataset) -> None:
    state = {**mid_epoch_state(ds, "block"), "order_version": 1}
    loader = ds.loader(3, order="block", seed=1, rank=0, world_size=2)
    loader.load_state_dict(state)
    assert indices(loader) == indices(reference_batches(ds, 3, order="block", seed=1, epoch=1, world_size=2))[6:]


@pytest.mark.parametrize("version", [4, 0, "3", True, None])
def test_an_unknown_order_version_is_refused(ds: MemmapDataset, version) -> None:
    state = {**mid_epoch_state(ds, "block"), "order_version": version}
    with pytest.raises(ValueError, match=r"order_version must be an integer from 1 to 3"):
        ds.loader(3, order="block", seed=1, rank=0, world_size=2).load_state_dict(state)
