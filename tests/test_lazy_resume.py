"""A mid-epoch resume computes what is left of the epoch as runs of positions of its order (`progress.Left`),
never an array of every sample (issue 27, point 7): before, a resume of random order on another world or
batch size built the epoch's whole int64 order, every rank's share of it and a boolean and a sorted copy of
the epoch (several GB at 10^8 records), and so did the check that warns Lightning users on every mid-epoch
load, even on the same world size.

The batches must not change: `naive_share` below is the definition (dsc 0.4's arrays, written as plain
loops), and hypothesis drives chains of rounds of any world size, batch size, drop_last, order, sampling and
locality through both.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsc.reader import order as orders
from dsc.reader import progress, sampling


def naive_first_round(epoch: progress.Epoch, split: progress.Split) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's share of the epoch's first round (rows), and the sequence they are cut from: under
    locality="shard", every rank's group in its order, in rank order (since `ORDER_VERSION` 3; in record order
    before, which made what drop_last cut a function of every group's order)."""
    if split.locality is not None:
        args = (epoch.count, epoch.records_per_shard, epoch.seed, epoch.epoch)
        shares = [orders.shard_share(*args, r, split.world_size, split.batch_size, split.drop_last)
                  for r in range(split.world_size)]
        units, group_of = orders.shard_groups(epoch.count, epoch.records_per_shard, split.world_size)
        groups = [orders.shard_group(r, split.world_size, epoch.seed, epoch.epoch) for r in range(split.world_size)]
        owns = [orders.group_records(units, group_of, g) for g in groups]
        owns = [own[orders.block(len(own), epoch.seed, epoch.epoch, stream=(g,))] for own, g in zip(owns, groups)]
        return np.array(shares, dtype=np.int64).reshape(split.world_size, -1), np.concatenate(owns)
    if epoch.sampling is not None:
        base = np.arange(epoch.positions(split))
    else:
        base = orders.epoch_order(epoch.count, epoch.order, epoch.seed, epoch.epoch)
    return orders.rank_shares(base, split.world_size, split.batch_size, split.drop_last), base


def naive_unserved(shares: np.ndarray, taken: int, base: np.ndarray) -> list[int]:
    """Every rank's untaken part in rank order, then the sequence, each sample once, less what was served."""
    served = {int(v) for v in shares[:, :taken].ravel()}
    seen, left = set(), []
    for v in [*shares[:, taken:].ravel().tolist(), *base.tolist()]:
        if v not in seen and v not in served:
            left.append(v)
        seen.add(v)
    return left


def naive_remaining(epoch: progress.Epoch, done: list[progress.Round]) -> np.ndarray:
    remaining = None
    for k, past in enumerate(done):
        if k == 0:
            shares, base = naive_first_round(epoch, past.split)
        else:
            base = remaining
            shares = orders.rank_shares(base, past.split.world_size, past.split.batch_size, past.split.drop_last)
        remaining = np.asarray(naive_unserved(shares, past.batches * past.split.batch_size, base), dtype=np.int64)
    return remaining


def naive_share(epoch: progress.Epoch, done: list[progress.Round], split: progress.Split, rank: int) -> np.ndarray:
    items = orders.rank_share(naive_remaining(epoch, done), rank, split.world_size, split.batch_size,
                              split.drop_last)
    return epoch.records(done[0].split, items)


def naive_cut_off(epoch: progress.Epoch, rounds: list[progress.Round], split: progress.Split,
                  batches: int) -> tuple[int, int]:
    done, start = progress.resume_point(rounds, split)
    if done:
        base = naive_remaining(epoch, done)
        shares = orders.rank_shares(base, split.world_size, split.batch_size, split.drop_last)
    else:
        shares, base = naive_first_round(epoch, split)
    whole = len(naive_unserved(shares, shares.shape[1], base))
    return (len(naive_unserved(shares, (start + batches) * split.batch_size, base)) - whole,
            len(naive_unserved(shares, start * split.batch_size, base)) - whole)


def _per_rank(epoch: progress.Epoch, split: progress.Split, left: int) -> int:
    if split.locality:
        return orders.share_length(epoch.count, split.world_size, split.batch_size, split.drop_last,
                                   locality="shard", records_per_shard=epoch.records_per_shard)
    return orders.share_length(left, split.world_size, split.batch_size, split.drop_last)


@st.composite
def resumes(draw):
    """An epoch, the rounds a run could have served of it (at least one), and the split it is resumed with."""
    n = draw(st.integers(1, 120))
    kind = draw(st.sampled_from(["plain", "locality", "indices", "repeats"]))
    order = "block" if kind == "locality" else draw(st.sampled_from(orders.ORDERS))
    options = {"indices": sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))} if kind == "indices" else \
        {"repeats": draw(st.integers(2, 3))} if kind == "repeats" else {}
    _, sampled = sampling.checked(n, order, **options)
    epoch = progress.Epoch(n, order, draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(1, 9)),
                           sampled)
    splits = st.builds(progress.Split, st.integers(1, 7), st.integers(1, 6), st.booleans())
    done: list[progress.Round] = []
    for k in range(draw(st.integers(1, 4))):
        split = draw(splits)
        if k == 0 and kind == "locality":
            split = progress.Split(split.world_size, split.batch_size, split.drop_last, "shard")
        left = epoch.positions(split) if k == 0 else len(naive_remaining(epoch, done))
        per_rank = _per_rank(epoch, split, left) if 0 < split.world_size <= left else 0
        if per_rank == 0:
            break
        done.append(progress.Round(split, draw(st.integers(1, orders.batch_count(per_rank, split.batch_size)))))
    return epoch, done, draw(splits)


@settings(max_examples=300, deadline=None)
@given(resumes(), st.data())
def test_what_a_resumed_rank_serves_is_what_the_arrays_gave(case, data) -> None:
    epoch, done, live = case
    if not done:  # the first split drawn could serve nothing: not a state
        return
    rank = data.draw(st.integers(0, live.world_size - 1))
    share = progress.remaining_share(epoch, done, live, rank)
    np.testing.assert_array_equal(np.asarray(share[:]), naive_share(epoch, done, live, rank))
    per_rank = _per_rank(epoch, live, len(naive_remaining(epoch, done)))
    start = data.draw(st.integers(0, orders.batch_count(per_rank, live.batch_size)))
    rounds = [*done, progress.Round(live, start)] if start else done
    batches = data.draw(st.integers(0, 5))
    assert progress.cut_off(epoch, rounds, live, batches) == naive_cut_off(epoch, rounds, live, batches)


def test_a_share_served_in_small_chunks_is_the_whole_share(monkeypatch) -> None:
    """A resumed share is computed a chunk at a time, and a chunk of a locality round's rest stops after
    `ShardRest.SEGMENTS` groups: served batch by batch with chunks of 1 to 3 groups and 5 positions, it is
    what the arrays give."""
    monkeypatch.setattr(orders, "CHUNK", 5)
    for segments in (1, 3):
        monkeypatch.setattr(orders.ShardRest, "SEGMENTS", segments)
        for n, per_shard, world, drop_last in ((50, 3, 4, True), (50, 3, 4, False), (37, 10, 6, True)):
            epoch = progress.Epoch(n, "block", 2, 1, per_shard)
            done = [progress.Round(progress.Split(world, 2, drop_last, "shard"), 1)]
            for live in (progress.Split(2, 3, False), progress.Split(world, 1, drop_last)):
                for rank in range(live.world_size):
                    share = progress.remaining_share(epoch, done, live, rank)
                    pieces = [share[a:a + live.batch_size] for a in range(0, len(share), live.batch_size)]
                    np.testing.assert_array_equal(np.concatenate(pieces), naive_share(epoch, done, live, rank))


N = 1 << 24  # records: an int64 array of every one is 128 MiB


def _peak(fn, *args) -> int:
    tracemalloc.start()
    try:
        fn(*args)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _first_batch(epoch: progress.Epoch, rounds: list[progress.Round], live: progress.Split) -> np.ndarray:
    """What a resumed loader computes before its first batch: the last rank's share, and that batch's indices."""
    done, start = progress.resume_point(rounds, live)
    share = progress.remaining_share(epoch, done, live, live.world_size - 1)
    return orders.batch_indices(share, start, live.batch_size, epoch.order, epoch.seed, epoch.epoch,
                                epoch.records_per_shard)


def test_a_random_order_resume_holds_no_array_of_the_epoch() -> None:
    """Saved on 8 ranks after 1,000 batches of 256, resumed on 3 ranks with batch 192 and on the same 8: the
    first batch and the Lightning check each peak below one int64 array of the epoch's records (numpy reports
    its allocations to tracemalloc). Before, the check alone built several such arrays, on either world."""
    epoch = progress.Epoch(N, "random", 7, 1, 1 << 20)
    saved = progress.Round(progress.Split(8, 256, False), 1000)
    for live in (progress.Split(3, 192, False), progress.Split(8, 256, False)):
        assert _peak(_first_batch, epoch, [saved], live) < N * 8
        assert _peak(progress.cut_off, epoch, [saved], live, 10) < N * 8
    share = progress.remaining_share(epoch, [saved], progress.Split(3, 192, False), 2)
    assert isinstance(share, orders.LazyShare)
    assert len(share) == -(-(N - 8 * 1000 * 256) // 3)  # the rest split over 3, padded (drop_last=False)


def test_resuming_on_the_saved_split_replays_nothing(tmp_path, monkeypatch) -> None:
    """A state loaded on the world and batch size that saved it goes on with its own round: nothing to replay,
    and nothing a consumer bounded by len(loader) skips, so load_state_dict computes no rank's share. Before,
    its check for Lightning users built every rank's share of the epoch (under locality="shard", one block
    order per shard group: minutes at 2^16 ranks)."""
    import dsc
    from dsc.reader import MemmapDataset

    from conftest import make_folder

    make_folder(tmp_path / "src", classes=2, per_class=12, sides=(16, 24))
    dsc.compile_folder(tmp_path / "src", tmp_path / "ds", size=8, records_per_shard=3, workers=1)
    ds = MemmapDataset(tmp_path / "ds")
    for options in ({"order": "random"}, {"order": "block", "locality": "shard"}):
        loader = ds.loader(2, seed=3, world_size=2, rank=1, **options)
        batches = iter(loader)
        next(batches), next(batches)
        state = loader.state_dict()
        rest = [b["index"].tolist() for b in batches]

        def replayed(*args, **kwargs):
            raise AssertionError("replayed the epoch to resume it on its own split")

        with monkeypatch.context() as patch:
            patch.setattr(progress, "replay", replayed)
            patch.setattr(progress.Epoch, "shard_rest", replayed, raising=False)
            patch.setattr(progress.Epoch, "shard_round", replayed, raising=False)  # its name before
            patch.setattr(progress.Epoch, "first_round", replayed, raising=False)  # its first name
            resumed = ds.loader(2, seed=3, world_size=2, rank=1, **options)
            resumed.load_state_dict(state)
            assert [b["index"].tolist() for b in resumed] == rest
