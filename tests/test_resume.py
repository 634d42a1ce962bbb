"""Epochs that advance however the consumer stops, and one loader state for every rank and world size.

The frameworks themselves (Lightning, Accelerate, torchrun) are run for real in test_frameworks.py;
these tests pin the loader's own rules with in-process loaders standing for the ranks.
"""

from __future__ import annotations

import itertools
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsc
from dsc.reader import MemmapDataset
from dsc.reader import order as orders
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

from conftest import tiny_dataset


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("resume"), seed=3, records_per_shard=4)


def indices(batches) -> list[int]:
    return [i for b in batches for i in b["index"].tolist()]


def reference(ds, batch_size: int, epoch: int, **options) -> list[int]:
    return indices(reference_batches(ds, batch_size, epoch=epoch, **options))


# ----------------------------------------------------------------------------- epochs advance

@pytest.mark.parametrize("order", orders.ORDERS)
def test_the_next_epoch_comes_once_the_last_batch_is_handed_out(ds: MemmapDataset, order: str) -> None:
    """Lightning, islice and zip take len(loader) batches and never exhaust the generator."""
    loader = ds.loader(5, order=order, seed=1)
    epochs = [indices(itertools.islice(loader, len(loader))) for _ in range(3)]
    assert epochs == [reference(ds, 5, e, order=order, seed=1) for e in range(3)]
    assert loader.epoch == 3 and loader.state_dict()["epoch"] == 3
    if order != "sequential":
        assert epochs[0] != epochs[1]


def test_a_pass_after_an_abandoned_one_moves_on_and_set_epoch_still_picks(ds: MemmapDataset) -> None:
    """Issue 20: an abandoned pass used to be served again from where it began (this test said "a peek does
    not eat the epoch"), so a loop capped at a few steps trained on the same batches every epoch."""
    loader = ds.loader(5, order="random", seed=1)
    assert indices(itertools.islice(loader, 2)) == reference(ds, 5, 0, order="random", seed=1)[:10]
    assert indices(loader) == reference(ds, 5, 1, order="random", seed=1)  # a new order, as DataLoader's iter()
    loader.set_epoch(7)
    assert indices(loader) == reference(ds, 5, 7, order="random", seed=1)
    loader.set_epoch(7)  # asked again: epoch 7 again, as DistributedSampler would
    assert indices(loader) == reference(ds, 5, 7, order="random", seed=1)


def test_a_loop_that_stops_every_epoch_early_without_set_epoch_moves_on(ds: MemmapDataset) -> None:
    """`for i, b in enumerate(loader): if i >= k: break` served the same first batches every epoch."""
    loader = ds.loader(5, order="random", seed=1)
    seen = []
    for _ in range(3):
        for i, batch in enumerate(loader):
            seen.append((loader.state_dict()["epoch"], batch["index"].tolist()))
            assert loader.epoch == seen[-1][0]  # while a pass is open, the epoch it serves
            if i >= 1:
                break
    assert [e for e, _ in seen] == [0, 0, 1, 1, 2, 2] and loader.epoch == 3
    assert [i for _, b in seen for i in b] == [i for e in range(3) for i in reference(ds, 5, e, order="random",
                                                                                       seed=1)[:10]]
    state = loader.state_dict()  # saved after the break: epoch 2, two batches in
    resumed = ds.loader(5, order="random", seed=1)
    resumed.load_state_dict(state)  # a loaded position wins over the move: the rest of epoch 2, as saved
    assert indices(resumed) == reference(ds, 5, 2, order="random", seed=1)[10:]
    loader.set_epoch(2)  # so does an epoch asked for
    assert indices(loader) == reference(ds, 5, 2, order="random", seed=1)


def test_lightning_style_set_epoch_through_the_sampler_hook(ds: MemmapDataset) -> None:
    """Lightning calls .sampler.set_epoch(e) before each epoch, also when it stops early (limit_train_batches)."""
    loader = ds.loader(5, order="random", seed=1)
    seen = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        seen.append(indices(itertools.islice(loader, 2)))
    assert seen == [reference(ds, 5, e, order="random", seed=1)[:10] for e in range(3)]


def test_an_empty_epoch_still_moves_on(ds: MemmapDataset) -> None:
    loader = ds.loader(len(ds), drop_last=True, rank=0, world_size=2, seed=0)  # not one full batch per rank
    assert len(loader) == 0 and list(loader) == [] and loader.epoch == 1


# ----------------------------------------------------------------------------- one state for all ranks

def ranks(ds, world: int, batch_size: int, **options) -> list:
    return [ds.loader(batch_size, rank=r, world_size=world, **options) for r in range(world)]


def step_together(loaders: list, batches: int) -> list[int]:
    """Every rank takes `batches` batches, as DDP ranks do; the indices they were served."""
    return [i for ld in loaders for i in indices(itertools.islice(ld, batches))]


@pytest.mark.parametrize("order", orders.ORDERS)
def test_every_rank_reports_the_same_state_and_any_rank_loads_rank_0s(ds: MemmapDataset, order: str) -> None:
    first = ranks(ds, 3, 2, order=order, seed=4)
    step_together(first, 2)
    states = [ld.state_dict() for ld in first]
    assert states[0] == states[1] == states[2]
    for r in range(3):
        uninterrupted = indices(ds.loader(2, order=order, seed=4, rank=r, world_size=3))
        resumed = ds.loader(2, order=order, seed=4, rank=r, world_size=3)
        resumed.load_state_dict(states[0])  # what Lightning and Accelerate do on every rank
        assert indices(resumed) == uninterrupted[4:]


def served_once(ds, plan: list[tuple[int, int, bool, int | None]], order: str, seed: int):
    """Run an epoch through rounds of (world, batch size, drop_last, batches taken or None = to the end),
    each round's loaders loading the state the last one left. Returns every index served, in order,
    and the rounds that ran (the epoch may end before the plan does)."""
    state, got, ran = None, [], []
    for world, batch_size, drop_last, taken in plan:
        loaders = ranks(ds, world, batch_size, order=order, seed=seed, drop_last=drop_last)
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        got += step_together(loaders, len(loaders[0]) if taken is None else taken)
        state, ran = loaders[0].state_dict(), [*ran, (world, batch_size, drop_last)]
        if state["epoch"] == 1:  # a resumed round may hold fewer batches than len() (a whole epoch's)
            break
    assert state["epoch"] == 1 and state["rounds"] == []  # the epoch is over
    return got, ran


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.booleans(), st.integers(0, 3)),
                     min_size=1, max_size=3),
       last=st.tuples(st.integers(1, 4), st.integers(1, 6), st.booleans()), order=st.sampled_from(orders.ORDERS))
def test_a_new_world_or_batch_size_serves_the_rest_of_the_epoch(ds: MemmapDataset, plan, last, order) -> None:
    """None lost, none repeated beyond each round's padding (drop_last=False: at most world - 1 repeats); a
    tail that a drop_last round leaves is taken up by the next round, so only the round that ends the epoch
    may leave samples out (with drop_last: fewer than world x batch size of them)."""
    got, ran = served_once(ds, [*plan, (*last, None)], order, seed=2)
    world, batch_size, drop_last = ran[-1]
    missing = set(range(len(ds))) - set(got)
    assert len(missing) < world * batch_size if drop_last else not missing
    assert len(got) - len(set(got)) <= sum(w - 1 for w, _, drop in ran if not drop)


def test_two_ranks_resumed_on_three_continue_the_same_epoch(ds: MemmapDataset) -> None:
    got, _ = served_once(ds, [(2, 3, False, 2), (3, 3, False, None)], "block", seed=0)
    first_round = ds.loader(3, order="block", rank=0, world_size=2, seed=0)
    assert got[:6] == indices(itertools.islice(first_round, 2))  # the first round is the plain 2-rank epoch
    left = len(ds) - 2 * 6
    assert set(got) == set(range(len(ds))) and len(got) == len(ds) + (-left) % 3  # the new round's padding


def test_states_that_belong_to_another_order_are_refused(ds: MemmapDataset, tmp_path: Path) -> None:
    loader = ds.loader(4, order="random", seed=3)
    next(iter(loader))
    state = loader.state_dict()
    for other, field in [(ds.loader(4, order="block", seed=3), "order"), (ds.loader(4, order="random", seed=4),
                                                                          "seed")]:
        with pytest.raises(ValueError, match=f"another epoch order.*'{field}'.*keeps its dataset, order and seed"):
            other.load_state_dict(state)
    make_image_folder(tmp_path / "src", classes=2, per_class=12, size=(24, 32), seed=9)
    dsc.compile_folder(tmp_path / "src", tmp_path / "other", size=(8, 8), workers=1)
    with pytest.raises(ValueError, match="another epoch order.*'dataset'"):
        MemmapDataset(tmp_path / "other").loader(4, order="random", seed=3).load_state_dict(state)
    bad_rounds = [[{"world_size": 0, "batch_size": 4, "drop_last": False, "locality": None, "batches": 1}],
                  [{"world_size": 1, "batch_size": 4, "drop_last": "no", "locality": None, "batches": 1}],
                  [{"world_size": 1, "batch_size": 4, "drop_last": False, "locality": None}], "all"]
    for rounds in bad_rounds:
        with pytest.raises(ValueError, match="round"):
            loader.load_state_dict(dict(state, rounds=rounds))
    with pytest.raises(ValueError, match="not a dsc loader state"):
        loader.load_state_dict({"epoch": 1})
    one = {"world_size": 2, "batch_size": 4, "drop_last": False, "locality": None, "batches": 1}
    with pytest.raises(ValueError, match=r"world_size must be an integer >= 1 and <= 1048576, got 10000000"):
        loader.load_state_dict(dict(state, rounds=[dict(one, world_size=10**7)]))  # not a hang at iteration
    with pytest.raises(ValueError, match="cannot be replayed: locality='shard' works with order='block' only"):
        loader.load_state_dict(dict(state, rounds=[dict(one, locality="shard")]))  # not a failure at iteration
    loader.load_state_dict(dict(state, rounds=[{k: np.int64(v) if k in ("world_size", "batches") else v
                                                for k, v in one.items()}]))  # numpy integers, as epoch takes


def test_a_state_saved_by_dsc_0_1_still_loads(ds: MemmapDataset) -> None:
    old = {"epoch": 2, "batch": 3, "order": "block", "seed": 3, "batch_size": 4, "drop_last": False, "rank": 1,
           "world_size": 2, "count": len(ds), "locality": None}
    for r in range(2):  # a per-rank state, but every rank had the same position: any rank may load it
        resumed = ds.loader(4, order="block", seed=3, rank=r, world_size=2)
        resumed.load_state_dict(old)
        assert indices(resumed) == reference(ds, 4, 2, order="block", seed=3, rank=r, world_size=2)[12:]
    with pytest.raises(ValueError, match=r"middle of epoch 2 by a dsc whose random order was numpy's permutation"):
        ds.loader(4, order="random", seed=3, rank=0, world_size=2).load_state_dict({**old, "order": "random"})


def test_the_world_is_taken_when_an_epoch_starts(ds: MemmapDataset, tmp_path: Path) -> None:
    """In one process only a world of one can be made; test_frameworks runs two ranks under torchrun."""
    import torch.distributed as dist

    loader = ds.loader(4)  # made before init_process_group
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert (loader.rank, loader.world_size) == (0, 1) and len(indices(loader)) == len(ds)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the seed of a loader made without one

def test_a_loader_made_anew_orders_its_epoch_anew_and_torch_manual_seed_repeats_it(ds: MemmapDataset) -> None:
    """Made anew each epoch, a loader served the same order every time (seed 0 by default; issue 26)."""
    firsts = [indices(ds.loader(5, order="random")) for _ in range(3)]
    assert len({tuple(f) for f in firsts}) == 3
    for order in ("block", "random"):
        torch.manual_seed(7)
        a = ds.loader(5, order=order)
        torch.manual_seed(7)
        b = ds.loader(5, order=order)
        assert a.seed == b.seed != ds.loader(5, order=order).seed and a.config.seed is None
        assert indices(a) == indices(b) == reference(ds, 5, 0, order=order, seed=a.seed)


def test_a_drawn_seed_is_saved_and_a_loader_without_one_takes_the_states(ds: MemmapDataset) -> None:
    first = ds.loader(5, order="random")
    uninterrupted = [reference(ds, 5, e, order="random", seed=first.seed) for e in (0, 1)]
    assert indices(itertools.islice(first, 2)) == uninterrupted[0][:10]
    state = first.state_dict()
    assert state["seed"] == first.seed
    resumed = ds.loader(5, order="random")
    assert resumed.seed != state["seed"]
    resumed.load_state_dict(state)
    assert resumed.seed == state["seed"] and indices(resumed) == uninterrupted[0][10:]
    ahead = ds.loader(5, order="random")
    indices(ahead)  # its thread is now making epoch 1 with its own seed
    resumed.set_epoch(1)
    ahead.load_state_dict(resumed.state_dict())
    assert indices(ahead) == uninterrupted[1]  # with the state's seed, not the batches made ahead
    with pytest.raises(ValueError, match=r"another epoch order.*'seed'"):  # a seed given must be the state's
        ds.loader(5, order="random", seed=state["seed"] + 1).load_state_dict(state)


def test_ranks_without_a_process_group_need_a_seed(ds: MemmapDataset) -> None:
    loader = ds.loader(2, order="block", rank=0, world_size=2)
    with pytest.raises(ValueError, match="2 ranks and no seed: .*give every rank the same seed="):
        next(iter(loader))
    assert indices(ds.loader(2, order="sequential", rank=1, world_size=2))  # sequential order uses no seed
    assert indices(ds.loader(2, order="block", rank=1, world_size=2, seed=5))


def _rank(rank: int, path: str, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.manual_seed(rank)  # the ranks' generators differ: only the broadcast makes them agree
    loader = MemmapDataset(path).loader(2, order="random")  # made before init_process_group, as torchrun scripts do
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        drawn = loader.seed
        got = indices(loader)
        Path(out, f"{rank}.json").write_text(json.dumps({"drawn": drawn, "seed": loader.seed, "indices": got,
                                                         "state": loader.state_dict()["seed"]}))
    finally:
        dist.destroy_process_group()


def test_ranks_in_a_process_group_take_rank_0s_drawn_seed(ds: MemmapDataset, tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(_rank, (str(ds.path), f"file://{tmp_path / 'pg'}", str(tmp_path)),
                                          nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2))
    assert r0["drawn"] != r1["drawn"]
    assert r0["seed"] == r1["seed"] == r0["state"] == r1["state"] == r0["drawn"]
    assert sorted(r0["indices"] + r1["indices"]) == list(range(len(ds)))  # disjoint shares of one order



def resumed_ranks(ds, state: dict, world: int, batch_size: int, **options) -> list:
    loaders = ranks(ds, world, batch_size, **options)
    for ld in loaders:
        ld.load_state_dict(state)
    return loaders


@pytest.mark.parametrize("world, batch_size, drop_last", [(1, 5, False), (2, 3, False), (3, 2, True), (1, 2, False),
                                                          (2, 2, False), (1, 8, False), (1, 12, False)])
def test_the_warning_at_load_counts_exactly_what_a_len_bounded_consumer_skips(
        ds: MemmapDataset, world: int, batch_size: int, drop_last: bool) -> None:
    """Lightning ends a resumed epoch after len(loader) batches, counting those taken before the checkpoint
    (test_frameworks runs the real Trainer); the warning at load must name exactly what that skips, or say nothing.
    When those batches already reach len(loader) (batch 8 or 12 of 24 records), Lightning goes on to the pass's
    end (measured with lightning_train.py at batch 16 and 20 of 40 records): nothing is skipped, nothing said."""
    options = {"order": "random", "seed": 2, "drop_last": drop_last}
    first = ds.loader(4, **options)
    indices(itertools.islice(first, 3))
    state = first.state_dict()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cut = resumed_ranks(ds, state, world, batch_size, **options)
    whole = set(step_together(resumed_ranks(ds, state, world, batch_size, **options), len(ds)))  # to the end
    lightning_takes = len(cut[0]) - 3 if len(cut[0]) > 3 else len(ds)  # to the end
    skipped = len(whole - set(step_together(cut, lightning_takes)))
    messages = [str(w.message) for w in caught if "will skip" in str(w.message)]
    assert skipped == 0 if (world, batch_size) in [(1, 2), (2, 2), (1, 8), (1, 12)] else skipped > 0  # both kinds
    if skipped:
        assert len(messages) == world and all(f"will skip {skipped} of the" in m for m in messages)
    else:
        assert messages == []
