"""Sampling on the fast loader (issue 21): a subset, weights with and without replacement, repeated
augmentation, an epoch length and a user's order, each exact in its counts, equal to the reference
loader, deterministic, resumable on another world; and loader states no run could have produced,
refused before anything is replayed (issue 27, point 1)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dsc
from dsc.reader import MemmapDataset, progress
from dsc.reader import sampling as samplers
from dsc.reader.reference import reference_batches
from dsc.testing import make_image_folder

from conftest import tiny_dataset
from test_resume import indices, ranks, resumed_ranks, step_together

CHOSEN = np.array([17, 2, 9, 23, 4, 11, 0, 15, 6, 20, 13, 8])  # 12 of the 24 records, not sorted


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> MemmapDataset:
    return tiny_dataset(tmp_path_factory.mktemp("sampling"), seed=3, records_per_shard=4)


def reversed_twice(n: int, seed: int, epoch: int) -> np.ndarray:
    """A user's order: every record twice, last first, shifted by the epoch."""
    return np.roll(np.r_[np.arange(n)[::-1], np.arange(n)], epoch)


def shifted(by: int, n: int, seed: int, epoch: int) -> np.ndarray:
    return np.roll(np.arange(n), by + epoch)


class Reversed:
    """A user's order as a callable object (no __qualname__ of its own, like a functools.partial)."""

    def __call__(self, n: int, seed: int, epoch: int) -> np.ndarray:
        return np.arange(n)[::-1]


CALLABLE_OBJECTS = {"partial": functools.partial(shifted, 2), "object": Reversed()}


OPTIONS = {
    "indices": {"indices": CHOSEN},
    "indices, sequential": {"indices": CHOSEN, "order": "sequential"},
    "repeats": {"repeats": 3},
    "samples_per_epoch, longer": {"samples_per_epoch": 60},
    "samples_per_epoch, shorter": {"samples_per_epoch": 10},
    "weights, replacement": {"weights": np.arange(1.0, 25.0), "replacement": True},
    "weights, no replacement": {"weights": np.r_[np.zeros(6), np.ones(18)], "replacement": False},
    "callable": {"order": reversed_twice},
    "indices, repeats, callable": {"indices": CHOSEN, "repeats": 2, "order": reversed_twice},
}


def served_by_rank(ds, world: int, batch_size: int, epoch: int = 0, **options) -> list[list[int]]:
    loaders = ranks(ds, world, batch_size, seed=5, **options)
    for ld in loaders:
        ld.set_epoch(epoch)
    return [indices(ld) for ld in loaders]


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_option_equals_the_reference_loader_on_every_rank(ds: MemmapDataset, name: str, world: int) -> None:
    options = OPTIONS[name]
    fast = served_by_rank(ds, world, 4, **options)
    assert fast == [indices(reference_batches(ds, 4, seed=5, rank=r, world_size=world, **options))
                    for r in range(world)]
    assert len({len(share) for share in fast}) == 1  # every rank the same number of samples


@pytest.mark.parametrize("world", [1, 2, 3])
def test_counts_over_an_epoch_are_exact(ds: MemmapDataset, world: int) -> None:
    def counts(**options) -> Counter:
        return Counter(i for share in served_by_rank(ds, world, 2, **options) for i in share)

    assert counts(indices=CHOSEN) == Counter(CHOSEN.tolist())  # each chosen record once (12 / world: no padding)
    assert counts(repeats=3) == Counter({i: 3 for i in range(24)})
    longer = counts(samples_per_epoch=60)  # 60 = 24 + 24 + 12 over 1, 2 or 3 ranks: no padding
    assert sum(longer.values()) == 60 and sorted(set(longer.values())) == [2, 3]
    assert list(longer.values()).count(3) == 12
    shorter = counts(samples_per_epoch=12)
    assert sum(shorter.values()) == 12 and set(shorter.values()) == {1}
    distinct = counts(weights=np.r_[np.zeros(6), np.ones(18)], replacement=False)  # 18: no padding on 1-3 ranks
    assert distinct == Counter(range(6, 24))
    assert counts(order=reversed_twice) == Counter({i: 2 for i in range(24)})


def test_repeated_copies_go_to_different_ranks_in_the_same_step(ds: MemmapDataset) -> None:
    """DeiT's RASampler: with world_size >= repeats, the k copies of a record are on k different ranks, in the
    same batch; with fewer ranks, on every rank."""
    three = served_by_rank(ds, 3, 4, repeats=3)
    for r in range(3):
        assert sorted(three[r]) == list(range(24))  # every rank sees every record once
    for b in range(6):
        assert len({tuple(sorted(share[4 * b:4 * b + 4])) for share in three}) == 1  # the same records, same step
    two = served_by_rank(ds, 2, 4, repeats=3)
    assert set(two[0]) == set(two[1]) == set(range(24))
    block_like = served_by_rank(ds, 3, 4, order="block", samples_per_epoch=72)  # 72 samples without repeats
    assert len({tuple(sorted(share[:4])) for share in block_like}) == 3  # which is not what made the copies meet


def test_a_callable_order_is_served_as_given(ds: MemmapDataset) -> None:
    assert served_by_rank(ds, 1, 5, epoch=3, order=reversed_twice)[0] == reversed_twice(24, 5, 3).tolist()
    chosen = served_by_rank(ds, 1, 5, indices=CHOSEN, order=reversed_twice)[0]
    assert chosen == CHOSEN[reversed_twice(12, 5, 0)].tolist()  # it orders positions of indices=


def test_weighted_draws_follow_the_weights(ds: MemmapDataset) -> None:
    """Record i is drawn with probability p_i = w_i / sum(w), so its count over N draws is Binomial(N, p_i):
    each count within 5 standard deviations of N p_i (a false alarm for one record has probability 5.7e-7),
    and Pearson's statistic over the 24 records, chi-square with 23 degrees of freedom (mean 23, standard
    deviation sqrt(46)), within its mean + 5 standard deviations. Uniform draws miss both by far."""
    weights = np.arange(1.0, 25.0)
    n = 24_000
    loader = ds.loader(1_000, seed=9, weights=weights, replacement=True, samples_per_epoch=n)
    got = np.bincount(np.concatenate([b["index"].numpy() for b in loader]), minlength=24)
    p = weights / weights.sum()
    assert got.sum() == n
    assert np.all(np.abs(got - n * p) <= 5 * np.sqrt(n * p * (1 - p)))
    assert ((got - n * p) ** 2 / (n * p)).sum() <= 23 + 5 * math.sqrt(46)


def test_class_balanced_weights_draw_every_class_equally_often(tmp_path: Path) -> None:
    make_image_folder(tmp_path / "src", classes=3, per_class=8, size=(24, 32), seed=4)
    for extra in sorted((tmp_path / "src" / "class_0").iterdir())[2:]:  # class 0 keeps 2 of its 8 images
        extra.unlink()
    dsc.compile_folder(tmp_path / "src", tmp_path / "ds", size=(8, 8), workers=1)
    ds = MemmapDataset(tmp_path / "ds")
    assert np.bincount(ds.labels).tolist() == [2, 8, 8]
    n = 9_000
    loader = ds.loader(500, seed=1, weights=dsc.class_balanced_weights(ds), replacement=True, samples_per_epoch=n)
    got = np.bincount(np.concatenate([b["label"].numpy() for b in loader]), minlength=3)
    assert np.all(np.abs(got - n / 3) <= 5 * math.sqrt(n * (1 / 3) * (2 / 3)))  # uniform would give class 0 1/9


@pytest.mark.filterwarnings("ignore:this loader state was saved on 2")  # Lightning's cut (test_resume)
@pytest.mark.parametrize("name", OPTIONS)
def test_two_ranks_resumed_on_three_serve_exactly_the_rest(ds: MemmapDataset, name: str) -> None:
    """The state counts positions of the epoch's sequence, so the 3 new ranks serve the positions the 2 ranks
    left, records repeated or not, plus at most 2 of padding (the new round's, as DistributedSampler pads)."""
    options = {"seed": 5, **OPTIONS[name]}
    first = ranks(ds, 2, 2, **options)
    head = step_together(first, 2)
    assert head[:4] == indices(reference_batches(ds, 2, rank=0, world_size=2, **options))[:4]
    state = first[0].state_dict()
    rest = step_together(resumed_ranks(ds, state, 3, 2, **options), 1_000)
    again = step_together(resumed_ranks(ds, state, 3, 2, **options), 1_000)
    spec = first[0]._epoch_spec(0)
    whole = Counter(spec.records(progress.Split(2, 2, False), np.arange(spec.positions(progress.Split(2, 2, False))))
                    .tolist())
    left = whole - Counter(head)
    assert sum((Counter(head) - whole).values()) == 0  # the first part was part of the epoch
    assert sum((left - Counter(rest)).values()) == 0  # nothing left out
    assert len(rest) - sum(left.values()) <= 2  # nothing served twice beyond the padding
    assert rest == again  # determinism across runs
    assert first[0].state_dict()["sampling"] == state["sampling"] is not None


def epoch_in_rounds(ds, plan: list[tuple[int, int, bool, int | None]], options: dict):
    """An epoch through rounds of (world, batch size, drop_last, batches taken or None = to the end), each
    round's loaders loading the state the last one left: every record served, and the split of the first
    round that served a batch (the epoch's sequence is laid out for it)."""
    state, got, first = None, [], None
    for world, batch_size, drop_last, taken in plan:
        loaders = ranks(ds, world, batch_size, drop_last=drop_last, **options)
        for ld in loaders:
            if state is not None:
                ld.load_state_dict(state)
        served = step_together(loaders, 1_000 if taken is None else taken)  # None: to the end, even an empty one
        first = first or (progress.Split(world, batch_size, drop_last) if served else None)
        got += served
        state = loaders[0].state_dict()
        if state["epoch"] == 1:
            break
    assert state["epoch"] == 1 and state["rounds"] == []
    return got, first, (world, batch_size, drop_last)


@pytest.mark.filterwarnings("ignore:this loader state was saved on")
@settings(max_examples=60, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6), st.booleans(), st.integers(0, 3)),
                     min_size=1, max_size=3),
       last=st.tuples(st.integers(1, 4), st.integers(1, 6), st.booleans()), name=st.sampled_from(sorted(OPTIONS)))
def test_any_chain_of_worlds_and_batch_sizes_serves_the_epochs_sequence(ds: MemmapDataset, plan, last, name) -> None:
    """The sampled twin of test_resume's: of the epoch's sequence, nothing lost (a drop_last round that ends the
    epoch leaves fewer than world x batch size), nothing repeated beyond each round's padding."""
    options = {"seed": 2, **OPTIONS[name]}
    got, first, (world, batch_size, drop_last) = epoch_in_rounds(ds, [*plan, (*last, None)], options)
    if first is None:  # no round served a batch: every split left the epoch empty
        return
    spec = ds.loader(1, **options)._epoch_spec(0)
    whole = Counter(spec.records(first, np.arange(spec.positions(first))).tolist())
    lost, extra = whole - Counter(got), Counter(got) - whole
    assert sum(lost.values()) < world * batch_size if drop_last else not lost
    assert sum(extra.values()) <= sum(w - 1 for w, _, drop, _ in [*plan, (*last, None)] if not drop)


@pytest.mark.parametrize("name", [n for n in OPTIONS if n != "indices, sequential"])
def test_epochs_repeat_with_the_seed_and_change_with_the_epoch(ds: MemmapDataset, name: str) -> None:
    options = OPTIONS[name]
    assert served_by_rank(ds, 2, 4, epoch=1, **options) == served_by_rank(ds, 2, 4, epoch=1, **options)
    assert served_by_rank(ds, 2, 4, epoch=1, **options) != served_by_rank(ds, 2, 4, epoch=2, **options)


ACROSS_RUNS = """
import json, sys
import numpy as np
sys.path.insert(0, "tests")
import test_sampling as t
from dsc.reader import MemmapDataset
ds = MemmapDataset(sys.argv[1])
out = {name: t.served_by_rank(ds, 2, 4, epoch=1, **options) for name, options in t.OPTIONS.items()}
out["state"] = t.ranks(ds, 1, 4, seed=5, **t.OPTIONS["indices"])[0].state_dict()["sampling"]
for name, fn in t.CALLABLE_OBJECTS.items():
    out[name] = t.ranks(ds, 1, 4, seed=5, order=fn)[0].state_dict()["sampling"]
print(json.dumps(out))
"""


def test_every_option_serves_the_same_batches_in_another_process(ds: MemmapDataset) -> None:
    """Nothing hangs on the process (hash seeds, object ids): a run resumed in a new process gets the same order
    and recognises its own state."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    done = subprocess.run([sys.executable, "-c", ACROSS_RUNS, str(ds.path)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    theirs = json.loads(done.stdout)
    assert theirs.pop("state") == ranks(ds, 1, 4, seed=5, **OPTIONS["indices"])[0].state_dict()["sampling"]
    for name, fn in CALLABLE_OBJECTS.items():  # was: their repr's memory address in the fingerprint
        assert theirs.pop(name) == ranks(ds, 1, 4, seed=5, order=fn)[0].state_dict()["sampling"], name
    assert theirs == {name: served_by_rank(ds, 2, 4, epoch=1, **options) for name, options in OPTIONS.items()}


def test_a_state_of_other_sampling_is_refused(ds: MemmapDataset) -> None:
    loader = ds.loader(4, seed=1, indices=CHOSEN)
    next(iter(loader))
    for other in ({"indices": CHOSEN[::-1]}, {}, {"indices": CHOSEN, "repeats": 2}):
        with pytest.raises(ValueError, match="belongs to another epoch order.*'sampling'"):
            ds.loader(4, seed=1, **other).load_state_dict(loader.state_dict())


def floats(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.arange(n) * 1.0


def grid(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.arange(n).reshape(2, -1)


def past_the_end(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.arange(n + 1)


@pytest.mark.parametrize("options, message", [
    ({"weights": -np.ones(24), "replacement": True}, r"weights= must be finite and >= 0, got -1.0 for record 0"),
    ({"weights": np.r_[np.ones(23), np.nan], "replacement": True}, r"finite and >= 0, got nan for record 23"),
    ({"weights": np.zeros(24), "replacement": True}, r"weights= are all zero: no record could be drawn"),
    ({"weights": np.r_[np.zeros(12), np.ones(12)], "replacement": False, "indices": np.arange(12)},
     r"all zero over the chosen indices"),
    ({"weights": np.ones(23), "replacement": True}, r"one weight per record of the dataset, shape \(24,\)"),
    ({"weights": np.ones(24)}, r"weights= needs replacement=True .* or replacement=False"),
    ({"weights": np.ones(24), "replacement": True, "order": "block"}, r"do not combine with order='block'"),
    ({"replacement": "yes"}, r"replacement must be True or False, got 'yes'"),
    ({"indices": [0, 24]}, r"indices= holds records in \[0, 24\], outside the dataset's \[0, 24\)"),
    ({"indices": [-1, 3]}, r"outside the dataset's"),
    ({"indices": [0.0, 1.0]}, r"indices= must hold integer record indices, got dtype float64"),
    ({"indices": []}, r"indices= must be a non-empty 1-D array"),
    ({"repeats": 0}, r"repeats must be an integer >= 1"),
    ({"repeats": True}, r"repeats must be an integer >= 1 and <= 65536, got True"),
    ({"samples_per_epoch": True}, r"samples_per_epoch must be an integer >= 1"),
    ({"samples_per_epoch": 1 << 40}, r"samples_per_epoch must be an integer >= 1 and <= 17179869184"),
    ({"indices": CHOSEN, "locality": "shard"}, r"locality='shard' .* does not combine with indices"),
    ({"order": floats, "shuffle": True}, r"order= is a callable; shuffle="),
])
def test_bad_sampling_options_are_refused_where_the_loader_is_made(ds: MemmapDataset, options: dict,
                                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ds.loader(4, seed=0, **options)
    if "shuffle" not in options:  # torch's spelling is the loader's alone
        with pytest.raises(ValueError, match=message):
            next(reference_batches(ds, 4, **options))


@pytest.mark.parametrize("fn, message", [
    (floats, r"the order callable must return integer indices, got dtype float64"),
    (grid, r"must return a 1-D array of indices, got shape \(2, 12\)"),
    (past_the_end, r"returned indices in \[0, 24\], outside \[0, 24\)"),
    (lambda n, seed, epoch: [], r"returned no indices"),
])
def test_a_bad_order_callable_is_refused_with_what_it_returned(ds: MemmapDataset, fn, message: str) -> None:
    loader = ds.loader(4, seed=0, order=fn)
    with pytest.raises(ValueError, match=message):
        next(iter(loader))
    with pytest.raises(ValueError, match=message):
        next(reference_batches(ds, 4, order=fn))


def test_class_balanced_weights_need_labels() -> None:
    assert samplers.class_balanced_weights(np.array([0, 0, 1, -1])).tolist() == [0.5, 0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match="needs labels"):
        samplers.class_balanced_weights(np.array([-1, -1]))


# ----------------------------------------------------------------------------- issue 27.1: hostile states

def state_with(ds, **round_fields) -> dict:
    loader = ds.loader(4, order="block", seed=1)
    list(itertools.islice(loader, 1))
    state = loader.state_dict()
    state["rounds"] = [{**state["rounds"][0], **round_fields}]
    return state


@pytest.mark.parametrize("fields, message", [
    ({"world_size": 1 << 20, "locality": "shard"},
     r"round 0 .*: world_size=1048576 is larger than the epoch's 24 samples"),
    ({"world_size": 25}, r"world_size=25 is larger than the epoch's 24 samples"),
    ({"world_size": (1 << 20) + 1}, r"a round's world_size must be an integer >= 1 and <= 1048576"),
    ({"batches": 0}, r"round 0 .*: batches=0; a run records a round only once it has served a batch"),
    ({"batches": 7}, r"batches=7 is past the epoch's end; 24 samples over 1 rank\(s\) at batch_size=4 give at most 6"),
    ({"batches": 10 ** 30}, r"batches=1000000000000000000000000000000 is past the epoch's end"),
    ({"batches": -1}, r"a round's batches must be a non-negative integer, got -1"),
    ({"batch_size": 1 << 50}, r"a round's batch_size must be an integer >= 1 and <= 1099511627776"),
    ({"world_size": "2"}, r"a round's world_size must be an integer >= 1 and <= 1048576, got '2'"),
    ({"drop_last": 1}, r"a round's drop_last must be true or false, got 1"),
])
def test_states_no_run_could_have_produced_are_refused_before_any_replay(ds: MemmapDataset, monkeypatch,
                                                                          fields: dict, message: str) -> None:
    """A state claiming locality="shard" at world 2**20 kept dsc 0.4's load_state_dict busy for minutes: it
    ordered every rank's shard group (a loop over the world size) before anything was checked."""
    state = state_with(ds, **fields)

    def replayed(*args, **kwargs):
        raise AssertionError("replayed a state before checking it")

    for name in ("shard_rest", "first_round_share"):
        monkeypatch.setattr(progress.Epoch, name, replayed)
    monkeypatch.setattr(progress, "replay", replayed)
    with pytest.raises(ValueError, match=message):
        ds.loader(4, order="block", seed=1).load_state_dict(state)


def test_a_plausible_state_still_loads_and_a_later_round_is_bounded_too(ds: MemmapDataset) -> None:
    state = state_with(ds, world_size=2, batch_size=3, batches=2)
    ds.loader(4, order="block", seed=1).load_state_dict(state)  # 2 ranks x 2 batches of 3: fine
    state["rounds"].append({**state["rounds"][0], "world_size": 3, "batches": 9})
    with pytest.raises(ValueError, match=r"round 1 of 2 .*: batches=9 is past the epoch's end"):
        ds.loader(4, order="block", seed=1).load_state_dict(state)
    one, other = ({**state["rounds"][0], "world_size": 1, "batch_size": b, "batches": 2} for b in (4, 3))
    state["rounds"] = [one, other, one, other, one]  # rank 0 alone served 5 + 4 + 5 + 4 + 5 = 23 of 24: possible
    ds.loader(4, order="block", seed=1).load_state_dict(state)
    state["rounds"].append(other)  # 23 + 4 > 24: no run gets there
    with pytest.raises(ValueError, match=r"the 6 rounds of this loader state served at least 27 samples for the "
                                         r"first time, more than the epoch's 24"):
        ds.loader(4, order="block", seed=1).load_state_dict(state)
