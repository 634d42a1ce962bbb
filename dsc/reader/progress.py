"""How far an epoch has got, in a form that every rank shares and that survives a new world size.

Lightning and Accelerate save rank 0's loader state and load it on every rank, and a job may
come back on another number of GPUs. So the state cannot say "rank r took k batches of its
slice"; it says which samples of the epoch have been served, as a list of *rounds*:

- A **round** is one split of the samples the epoch has not served yet among `world_size`
  ranks (`Split`: world size, batch size, drop_last, locality), plus how many batches every
  rank has taken from its share in it. Ranks take batches in step (DDP's collectives make
  them), so that number is the same on every rank, and so is the whole state.
- An epoch starts with one round over all its samples, split by `order.epoch_share` (the
  epoch's order cut into rank slices, or shard groups with locality="shard"); a rank's slice
  is computed a chunk at a time as it is served (`order.LazyShare`).
- A loader that resumes with the split of the last round continues that round exactly where
  it stopped: the same batches an uninterrupted run would have served.
- A loader with another split starts a new round over the samples not served yet, kept in the
  order they would have come (every rank's untaken part in rank order, then what no share
  held, i.e. drop_last tails; after a locality="shard" round, each rank's group's drop_last tail
  in rank order: `order.ShardRest`) and cut by `order.rank_shares`. Nothing is lost and nothing is
  served twice, except each round's padding (drop_last=False: at most world_size - 1 samples
  repeated, as with DistributedSampler; under locality="shard", which applies to an epoch's
  first round only, what `order.shard_share` pads: up to the difference between shard groups).

With sampling options (`sampling.py`: a subset, weights, repeats, an epoch length, an order callable) the
epoch's global order is a sequence of records that may repeat, so the rounds count *positions* of it
(`Epoch.records` maps them back); a sequence laid out for its first round's world (repeats) is
rebuilt from that round's split. `check_rounds` refuses, before any replay, what no run could have
written.

A state also says which version of the orders it was saved under (`order.ORDER_VERSION`): its rounds
name samples of that version's order. Random order changed in version 2 (issue 27: numpy's permutation
became a seeded bijection, computed a chunk at a time), so a random-order state saved mid-epoch by
version 1 is refused (`check_order_version`) rather than resumed on a different order, which would
serve some samples twice and skip others; one saved at an epoch's end (no rounds) served nothing of
its epoch and resumes. Replaying version 1 would mean drawing its whole permutation again, the cost
version 2 removed, for states of one release.

`remaining_share` replays the finished rounds to find the live round's share of this rank; the state
itself stays a handful of integers. What a round leaves is the sequence it was cut from less what its
ranks served, in the sequence's own order (`Left.after`), so the replay is arithmetic on runs of the
first round's positions, O(world size) per round; the share is computed a chunk at a time as it is
served (`order.LazyShare` over those runs), never an array of the epoch (1.4 GB at 2^24 records before).
What a first round under locality="shard" left is `order.ShardRest`, whose positions are computed from
the groups they fall in (before `ORDER_VERSION` 3, every rank's share was built: 16 s at 2^16 ranks;
the drop_last tails then came in record order, which needs every group's order, so a state of that
version whose round would be replayed is refused by `check_order_version`). A `Planner` turns that into the
loader's passes: the batches one iteration takes, and the epochs after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dsc.arguments import check_int
from dsc.reader import order as orders
from dsc.reader.sampling import Sampling

ROUND_KEYS = {"world_size", "batch_size", "drop_last", "locality", "batches"}
MAX_WORLD_SIZE = 1 << 20  # a saved state naming more ranks than this is not from a real job
MAX_BATCH_SIZE = 1 << 40  # nor a larger batch (a TiB of 1-byte records)


@dataclass(frozen=True)
class Split:
    """How one round deals its samples to ranks."""

    world_size: int
    batch_size: int
    drop_last: bool
    locality: str | None = None


@dataclass(frozen=True)
class Round:
    """A split and the batches every rank has taken in it."""

    split: Split
    batches: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.split), "batches": self.batches}

    @staticmethod
    def from_dict(value: Any) -> Round:
        """A round from a saved state, checked field by field (a state file is input, not trusted)."""
        if not isinstance(value, dict) or set(value) != ROUND_KEYS:
            raise ValueError(f"a round of a loader state has exactly the keys {sorted(ROUND_KEYS)}, got {value!r}")
        for key, low, high in (("world_size", 1, MAX_WORLD_SIZE), ("batch_size", 1, MAX_BATCH_SIZE),
                                ("batches", 0, None)):
            check_int(f"a round's {key}", value[key], low, high)
        if not isinstance(value["drop_last"], bool):
            raise ValueError(f"a round's drop_last must be true or false, got {value['drop_last']!r}")
        if value["locality"] is not None and value["locality"] not in orders.LOCALITIES:
            raise ValueError(f"a round's locality must be null or one of {orders.LOCALITIES}, "
                             f"got {value['locality']!r}")
        return Round(Split(int(value["world_size"]), int(value["batch_size"]), value["drop_last"], value["locality"]),
                     int(value["batches"]))


@dataclass(frozen=True)
class Epoch:
    """What fixes an epoch's order: dataset size, order, seed, epoch, the shard size locality needs, and the
    sampling options (`sampling.Sampling`). Without sampling the epoch's items are its records (each once);
    with it, positions of its global order (`sampling.Sampling.epoch_order`), which may repeat records."""

    count: int
    order: str
    seed: int
    epoch: int
    records_per_shard: int
    sampling: Sampling | None = None

    def _sampled(self, first: Split) -> np.ndarray:
        return self.sampling.epoch_order(self.order, self.seed, self.epoch, first.world_size, first.batch_size,
                                         first.drop_last)

    def length(self) -> int:
        """Samples in the epoch (before a first round's padding)."""
        return self.count if self.sampling is None else self.sampling.length(self.order, self.seed, self.epoch)

    def positions(self, first: Split) -> int:
        """How many items the epoch has when its first round is split like `first`."""
        return self.count if self.sampling is None else len(self._sampled(first))

    def records(self, first: Split, items: np.ndarray | slice) -> np.ndarray:
        """The records at `items` (the records themselves without sampling)."""
        return items if self.sampling is None else self._sampled(first)[items]

    def first_round_share(self, split: Split, rank: int) -> np.ndarray | orders.LazyShare:
        """This rank's share of the first round: computed a chunk at a time as it is served (`order.LazyShare`)
        unless sampling options or locality make the epoch's sequence whole anyway."""
        if self.sampling is not None:
            return orders.rank_share(self._sampled(split), rank, split.world_size, split.batch_size, split.drop_last)
        if split.locality is None:
            return orders.lazy_share(self.count, self.order, self.seed, self.epoch, rank, split.world_size,
                                     split.batch_size, split.drop_last)
        return orders.epoch_share(self.count, self.order, self.seed, self.epoch, rank, split.world_size,
                                  split.batch_size, split.drop_last, locality=split.locality,
                                  records_per_shard=self.records_per_shard)

    def shard_rest(self, split: Split, taken: int) -> orders.ShardRest:
        """What a first round under locality="shard" leaves once every rank took `taken` samples."""
        return orders.shard_rest(self.count, self.records_per_shard, self.seed, self.epoch, split.world_size,
                                 split.batch_size, split.drop_last, taken)


@dataclass(frozen=True)
class Left:
    """What an epoch has left to serve, in the order it would come: runs [starts[k], stops[k]) of the positions
    of its first round's sequence (the epoch's order, a sampled sequence, or what a locality="shard" round left),
    each position once. A round over it is arithmetic on the runs (`after`), O(world size + runs), never an
    array of every sample."""

    starts: np.ndarray
    stops: np.ndarray

    @staticmethod
    def whole(m: int) -> Left:
        return Left(np.zeros(min(m, 1), dtype=np.int64), np.full(min(m, 1), m, dtype=np.int64))

    def __len__(self) -> int:
        return int((self.stops - self.starts).sum())

    def after(self, split: Split, batches: int) -> Left:
        """What is left once every rank took `batches` batches of a round split like `split` over this sequence.

        A rank's share is a slice of the sequence repeated end to end (`order.rank_shares`); the samples left
        come in the order they would have come: every rank's untaken part in rank order, then what no share
        held. Each sample of the sequence comes once in it and the shares are its consecutive slices, so that
        order is the sequence's own: what is left is the sequence less the samples the shares' heads served."""
        gaps = self._unserved(split, batches)
        return self if gaps is None else self.take(*gaps)

    def count_after(self, split: Split, batches: int) -> int:
        """len(self.after(split, batches)), without the runs (a Lightning user's check needs only counts)."""
        gaps = self._unserved(split, batches)
        return len(self) if gaps is None else int((gaps[1] - gaps[0]).sum())

    def _unserved(self, split: Split, batches: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The sequence places [a[k], b[k]) that no share's first `batches` batches hold; None: all of them."""
        n = len(self)
        per_rank = orders.share_length(n, split.world_size, split.batch_size, split.drop_last)
        taken = min(batches * split.batch_size, per_rank)
        if not n or not taken:
            return None
        head = np.arange(split.world_size, dtype=np.int64) * per_rank % n  # heads [head, head + taken), mod n
        end = head + taken  # taken <= per_rank <= n: a head wraps past the sequence's end at most once
        starts = np.concatenate([head, np.zeros(int((end > n).sum()), dtype=np.int64)])
        stops = np.concatenate([np.minimum(end, n), end[end > n] - n])
        order = np.argsort(starts, kind="stable")
        starts, stops = starts[order], np.maximum.accumulate(stops[order])
        gaps_from = np.concatenate([[0], stops])  # the served runs' complement in [0, n): gaps between them
        gaps_to = np.concatenate([starts, [n]])
        keep = gaps_to > gaps_from
        return gaps_from[keep], gaps_to[keep]

    def take(self, a: np.ndarray, b: np.ndarray) -> Left:
        """The runs of positions at sequence places [a[k], b[k]), increasing and disjoint."""
        if not len(a) or not len(self.starts):
            return Left(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        ends = np.cumsum(self.stops - self.starts)
        begins = ends - (self.stops - self.starts)
        cuts = np.sort(np.concatenate([a, b, begins, ends]))  # distinct (np.unique hashes: 10x slower here)
        cuts = cuts[np.concatenate([[True], cuts[1:] != cuts[:-1]])]
        lo, hi = cuts[:-1], cuts[1:]
        inside = np.searchsorted(a, lo, side="right") - 1
        keep = (inside >= 0) & (lo < b[np.maximum(inside, 0)]) & (lo < ends[-1])
        lo, hi = lo[keep], hi[keep]
        run = np.searchsorted(ends, lo, side="right")
        starts = self.starts[run] + (lo - begins[run])
        stops = starts + (hi - lo)
        joined = np.flatnonzero(starts[1:] != stops[:-1]) + 1  # merge runs that continue one another
        first = np.concatenate([[0], joined])
        last = np.concatenate([joined - 1, [len(starts) - 1]]) if len(starts) else first
        return Left(starts[first], stops[last])

    def share(self, split: Split, rank: int) -> Left:
        """Rank `rank`'s share of a round split like `split` over this sequence (`order.rank_share`)."""
        n = len(self)
        per_rank = orders.share_length(n, split.world_size, split.batch_size, split.drop_last)
        pieces = [self.take(np.array([a]), np.array([b])) for a, b in orders.wrapped(rank * per_rank,
                                                                                       (rank + 1) * per_rank, n)]
        if not pieces:
            return Left(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))
        return Left(np.concatenate([p.starts for p in pieces]), np.concatenate([p.stops for p in pieces]))

    def positions(self) -> np.ndarray:
        return orders.expand_runs(self.starts, self.stops - self.starts)


def replay(epoch: Epoch, done: list[Round]) -> tuple[Left, np.ndarray | orders.EpochOrder | orders.ShardRest]:
    """What the finished rounds `done` (at least one) left unserved, in the order it would have come: runs of
    positions of the first round's sequence, and that sequence (an array when sampled)."""
    first = done[0].split
    if first.locality is not None:  # shard groups, not slices of one sequence: what the first round left
        sequence = epoch.shard_rest(first, done[0].batches * first.batch_size)
        left, rest = Left.whole(len(sequence)), done[1:]
    elif epoch.sampling is not None:
        sequence, rest = epoch.records(first, slice(None)), done  # the sampled sequence
        left = Left.whole(len(sequence))
    else:
        sequence, rest = orders.EpochOrder(epoch.count, epoch.order, epoch.seed, epoch.epoch), done
        left = Left.whole(epoch.count)
    for past in rest:
        left = left.after(past.split, past.batches)
    return left, sequence


def remaining_share(epoch: Epoch, done: list[Round], split: Split, rank: int) -> np.ndarray | orders.LazyShare:
    """This rank's share of the round that follows the finished rounds `done` (module docstring)."""
    if not done:
        return epoch.first_round_share(split, rank)
    left, sequence = replay(epoch, done)
    share = left.share(split, rank)
    if isinstance(sequence, np.ndarray):
        return sequence[share.positions()]
    return orders.LazyShare(sequence, runs=(share.starts, share.stops))  # computed a chunk at a time as served


def cut_off(epoch: Epoch, rounds: list[Round], split: Split, batches: int) -> tuple[int, int]:
    """(samples left unserved, samples the epoch has left) when every rank takes only `batches` more batches
    of the round `split` goes on with: what a consumer that stops early skips, beyond the samples the whole
    round would leave out too (drop_last tails)."""
    done, start = resume_point(rounds, split)
    if done:
        left = replay(epoch, done)[0]
    elif split.locality is None:
        left = Left.whole(epoch.positions(split))
    else:  # the first round under locality="shard": lengths of what it leaves
        per_rank = orders.share_length(epoch.count, split.world_size, split.batch_size, split.drop_last,
                                       locality=split.locality, records_per_shard=epoch.records_per_shard)
        whole = len(epoch.shard_rest(split, per_rank))
        return (len(epoch.shard_rest(split, min(per_rank, (start + batches) * split.batch_size))) - whole,
                len(epoch.shard_rest(split, min(per_rank, start * split.batch_size))) - whole)
    whole = left.count_after(split, 1 << 62)
    return left.count_after(split, start + batches) - whole, left.count_after(split, start) - whole


def check_rounds(epoch: Epoch, rounds: list[Round]) -> None:
    """Refuse rounds that no run could have produced, naming the field, with arithmetic alone (O(rounds) after
    the epoch's length): a world larger than the epoch's samples, a round that served no batch (a run records
    a round once it has served one, so rounds never outnumber the batches served), more batches than a whole
    epoch split that way holds. Checked before anything is replayed, whose cost grows with the world size
    (locality="shard" orders every rank's group; the padding of a world larger than the records)."""
    n = epoch.length() if rounds else 0
    fresh = 0  # samples the rounds served for the first time, at least (below)
    for k, r in enumerate(rounds):
        s = r.split
        where = f"round {k} of {len(rounds)} of this loader state"
        if s.world_size > n:
            raise ValueError(f"{where}: world_size={s.world_size} is larger than the epoch's {n} samples; no run "
                             "splits an epoch over more ranks than it has samples")
        if r.batches == 0:
            raise ValueError(f"{where}: batches=0; a run records a round only once it has served a batch")
        share = n if s.locality is not None else orders.share_length(n, s.world_size, s.batch_size, s.drop_last)
        most = orders.batch_count(share, s.batch_size)
        if r.batches > most:
            raise ValueError(f"{where}: batches={r.batches} is past the epoch's end; {n} samples over "
                             f"{s.world_size} rank(s) at batch_size={s.batch_size} give at most {most} per rank")
        # rank 0's slice of a round holds distinct samples not served before (padding goes to the end), so its
        # `batches` served at least (batches - 1) * batch_size + 1 of them (a shard group may repeat: 1)
        fresh += 1 if s.locality is not None else (r.batches - 1) * s.batch_size + 1
    padding = rounds[0].split.world_size - 1 if rounds and epoch.sampling is not None else 0  # `deit_layout`'s
    if fresh > n + padding:
        raise ValueError(f"the {len(rounds)} rounds of this loader state served at least {fresh} samples for the "
                         f"first time, more than the epoch's {n}: past the epoch's end")


def check_order_version(version: Any, order: str, epoch: int, rounds: list[Round], live: Split) -> None:
    """Refuse a state whose rounds name samples of another version's order (module docstring), as the loader
    splitting like `live` would replay them; `version` is the state's ``order_version`` (1 when absent: saved
    before it was recorded)."""
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= orders.ORDER_VERSION:
        raise ValueError(f"a loader state's order_version must be an integer from 1 to {orders.ORDER_VERSION} "
                         f"(this dsc's), got {version!r}: a state saved by a newer dsc cannot be resumed here")
    if version == 1 and order == "random" and rounds:
        raise ValueError(f"this loader state was saved in the middle of epoch {epoch} by a dsc whose random order "
                         f"was numpy's permutation (order_version 1); this dsc computes random order another way "
                         f"(order_version {orders.ORDER_VERSION}), so resuming would serve some samples of the epoch "
                         "twice and skip others. Resume from a state saved at an epoch's end, or finish epoch "
                         f"{epoch} with the dsc that saved this state")
    first = rounds[0].split if rounds else None
    if version < 3 and first is not None and first.locality is not None and first.drop_last \
            and resume_point(rounds, live)[0]:
        same = (f"resume on the split that saved it (world_size={first.world_size}, batch_size={first.batch_size}, "
                f"drop_last=True, locality={first.locality!r}: its round goes on as it was), "
                if len(rounds) == 1 else "")
        raise ValueError(f"this loader state was saved in the middle of epoch {epoch} by a dsc whose locality="
                         f"{first.locality!r} rounds with drop_last=True left what drop_last cut in record order "
                         f"(order_version {version}); this dsc leaves it in rank order (order_version "
                         f"{orders.ORDER_VERSION}), so replaying the round on this split would serve some samples "
                         f"of the epoch twice and skip others. To continue, {same}resume from a state saved at an "
                         f"epoch's end, or finish epoch {epoch} with the dsc that saved this state")


def resume_point(rounds: list[Round], split: Split) -> tuple[list[Round], int]:
    """(finished rounds, batches already taken in the live one): the last round goes on if its split is ours."""
    if rounds and rounds[-1].split == split:
        return rounds[:-1], rounds[-1].batches
    return rounds, 0


@dataclass(frozen=True)
class Pass:
    """One pass over (what is left of) an epoch on one rank: which batches the consumer takes."""

    epoch: int
    done: tuple[Round, ...]
    split: Split
    start: int
    rank: int
    count: int


@dataclass(frozen=True)
class Planner:
    """Plans one rank's passes. It holds no reference to the Loader, so a producer thread that
    plans ahead never keeps a dropped Loader alive."""

    count: int
    order: str
    seed: int
    records_per_shard: int
    rank: int
    sampling: Sampling | None = None

    def plan(self, epoch: int, done: list[Round], split: Split,
             start: int) -> tuple[Pass, np.ndarray | orders.LazyShare]:
        """The pass and this rank's share of what the epoch has left."""
        spec = Epoch(self.count, self.order, self.seed, epoch, self.records_per_shard, self.sampling)
        share = remaining_share(spec, done, split, self.rank)
        return Pass(epoch, tuple(done), split, start, self.rank, orders.batch_count(len(share), split.batch_size)), \
            share

    def fresh(self, epoch: int, split: Split) -> Pass:
        """A whole epoch's pass, without computing its order (its length does not depend on it)."""
        locality = {"locality": split.locality, "records_per_shard": self.records_per_shard} if split.locality else {}
        count = Epoch(self.count, self.order, self.seed, epoch, self.records_per_shard, self.sampling).length()
        share = orders.share_length(count, split.world_size, split.batch_size, split.drop_last, **locality)
        return Pass(epoch, (), split, 0, self.rank, orders.batch_count(share, split.batch_size))

    def jobs(self, first: Pass, share: np.ndarray) -> Iterator[tuple[Pass, int, np.ndarray]]:
        """(pass, batch, share) for the rest of `first`, then for every following epoch (ends at an empty one)."""
        p = first
        while p.count > p.start:
            for b in range(p.start, p.count):
                yield p, b, share
            p, share = self.plan(p.epoch + 1, [], p.split, 0)
