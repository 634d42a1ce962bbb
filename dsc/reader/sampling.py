"""Sampling beyond the three built-in orders: a subset, weights, repeated augmentation, an epoch length
and a user's order, as one epoch *sequence* (the records an epoch serves, in order, repeats allowed).

The sequence is a function of (seed, epoch) alone, built in four steps:

1. The pool: `indices` (any int array of records; default every record), m of them.
2. One pass over the pool, one of:
   - the pool in the loader's built-in order (`order.epoch_order` over the pool's positions: sequential
     keeps `indices` as given, block keeps runs of them together, so pass them sorted for local reads);
   - weights, replacement=True: m independent draws, record i with probability w_i / sum(w) (uniform
     when only replacement=True is given), as torch's WeightedRandomSampler;
   - weights, replacement=False: every record of positive weight once, in a weighted random order
     (Efraimidis-Spirakis: key u ** (1 / w), largest first), as torch.multinomial without replacement;
   - the user's callable ``order(m, seed, epoch)``: positions of the pool (the records themselves when
     no `indices` are given), checked: integers in [0, m); any length, repeats allowed.
3. ``repeats=k``: each entry of a pass k times in a row (DeiT's RASampler).
4. ``samples_per_epoch=L``: passes end to end, pass p > 0 drawn from its own stream (a callable's
   output repeated as it is), cut to L (default: one pass, times k).

With repeats, the sequence is then laid out for the world of the epoch's first round (`deit_layout`) so
that the contiguous rank slices `order.rank_shares` cuts are DeiT's strided ones: the k copies of a
record go to k different ranks in the same step (when world_size >= k). Everything else is split like
the built-in orders. Resume (`progress`) counts positions of the sequence, so an epoch resumed on
another world serves exactly the positions not served yet.

Within a batch, records take the built-in order's arrangement (`order.batch_indices`); a callable's
batches keep the callable's order. `locality="shard"` deals whole shard groups to ranks and combines
with none of these options.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dsc.arguments import check_bool, check_int, is_int
from dsc.reader import order as orders

CUSTOM = "custom"  # the loader's order name when `order=` is a callable
PASS_STREAM = (1 << 32) + 1  # `order.generator` stream of pass p > 0 (shard groups use 0..world_size-1)
WEIGHTS_STREAM = (1 << 32) + 2  # stream of the weighted draws
MAX_EPOCH_SAMPLES = 1 << 34  # a sequence longer than this (128 GiB of int64) is a typo, not a plan


def callable_name(fn: Callable[..., Any]) -> str:
    """An order callable's name, the same in every process (no memory address): a function's or method's
    qualified name, a `functools.partial`'s function with its arguments, an instance's class."""
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)}, {fn.args!r}, {sorted(fn.keywords.items())!r})"
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{getattr(named, '__module__', '')}.{named.__qualname__}"


@dataclass(frozen=True, eq=False)
class Sampling:
    """The sampling options of one loader, checked (`checked`); hashed by identity (`sequence` caches by it)."""

    records: int
    pool: np.ndarray | None  # int64 records, read-only; None: every record
    weights: np.ndarray | None  # float64 per record of the dataset, read-only; None: uniform
    replacement: bool | None  # None: no weighted draw (the pool in the built-in order)
    repeats: int
    samples_per_epoch: int | None
    order_fn: Callable[[int, int, int], Any] | None

    @property
    def pool_size(self) -> int:
        return self.records if self.pool is None else len(self.pool)

    def fingerprint(self) -> str:
        """What fixes the sequence besides (order, seed, epoch), for a saved state to be checked against."""
        h = hashlib.sha256()
        for part in (self.pool, self.weights):
            h.update(b"-" if part is None else part.tobytes())
        name = None if self.order_fn is None else callable_name(self.order_fn)
        h.update(repr((self.replacement, self.repeats, self.samples_per_epoch, name)).encode())
        return h.hexdigest()[:16]

    def one_pass(self, order: str, seed: int, epoch: int, p: int) -> np.ndarray:
        """Pass `p` over the pool, as records (module docstring, step 2)."""
        m = self.pool_size
        if self.order_fn is not None:
            positions = checked_positions(self.order_fn(m, seed, epoch), m)  # every pass the same: it is theirs
        elif self.replacement is not None:
            return self._weighted(seed, epoch, p)
        elif p == 0:
            positions = orders.epoch_order(m, order, seed, epoch)
        elif order == "random":
            positions = orders.generator(seed, epoch, PASS_STREAM, p).permutation(m)
        elif order == "block":
            positions = orders.block(m, seed, epoch, stream=(PASS_STREAM, p))
        else:
            positions = np.arange(m, dtype=np.int64)
        return positions if self.pool is None else self.pool[positions]

    def _weighted(self, seed: int, epoch: int, p: int) -> np.ndarray:
        pool = np.arange(self.records, dtype=np.int64) if self.pool is None else self.pool
        w = self._pool_weights()
        rng = orders.generator(seed, epoch, WEIGHTS_STREAM, p)
        if self.replacement:
            cumulative = np.cumsum(w)
            draws = rng.random(len(pool)) * cumulative[-1]
            return pool[np.minimum(np.searchsorted(cumulative, draws, side="right"), len(pool) - 1)]
        positive = np.flatnonzero(w > 0)
        keys = np.log(rng.random(len(positive))) / w[positive]  # log of u ** (1 / w): larger comes first
        return pool[positive[np.argsort(-keys, kind="stable")]]

    def sequence(self, order: str, seed: int, epoch: int) -> np.ndarray:
        """The epoch's sequence before any layout for ranks (steps 1-4), read-only."""
        return _sequence(self, order, seed, epoch)

    def epoch_order(self, order: str, seed: int, epoch: int, world_size: int, batch_size: int,
                    drop_last: bool) -> np.ndarray:
        """The epoch's global order for a first round over `world_size` ranks: the sequence, laid out for
        DeiT's strided split when records repeat (`deit_layout`)."""
        seq = self.sequence(order, seed, epoch)
        return deit_layout(seq, world_size, batch_size, drop_last) if self.repeats > 1 else seq

    def length(self, order: str, seed: int, epoch: int) -> int:
        """How many samples the epoch's sequence holds (a callable's output is drawn to know it)."""
        if self.samples_per_epoch is not None:
            return self.samples_per_epoch
        if self.order_fn is not None:
            return len(self.sequence(order, seed, epoch))
        if self.replacement is False:  # each record of positive weight once
            return int(np.count_nonzero(self._pool_weights() > 0)) * self.repeats
        return self.pool_size * self.repeats

    def _pool_weights(self) -> np.ndarray:
        if self.weights is None:
            return np.ones(self.pool_size)
        return self.weights if self.pool is None else self.weights[self.pool]


@functools.lru_cache(maxsize=2)  # the planner, len() and the state's checks ask for an epoch's, the next one ahead
def _sequence(sampling: Sampling, order: str, seed: int, epoch: int) -> np.ndarray:
    first = sampling.one_pass(order, seed, epoch, 0)
    if len(first) == 0:
        raise ValueError("the sampling options leave no sample in the epoch")
    k, wanted = sampling.repeats, sampling.samples_per_epoch
    passes, have, p = [np.repeat(first, k)], len(first) * k, 1
    while wanted is not None and have < wanted:  # a callable's order is the user's: repeated as it is
        again = first if sampling.order_fn is not None else sampling.one_pass(order, seed, epoch, p)
        passes.append(np.repeat(again, k))
        have, p = have + len(passes[-1]), p + 1
    seq = np.concatenate(passes)[:wanted] if len(passes) > 1 or wanted is not None else passes[0]
    seq.setflags(write=False)
    return seq


def deit_layout(sequence: np.ndarray, world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """`sequence` reordered so that `order.rank_shares`' contiguous slices are DeiT's strided ones (rank r takes
    entries r, r + world_size, ...): consecutive copies of a record land on consecutive ranks at the same step.
    The padding (drop_last=False) repeats the start of the sequence, as `rank_shares` would; a drop_last tail
    stays at the end, unserved by this round as it would have been."""
    per = orders.share_length(len(sequence), world_size, batch_size, drop_last)
    if drop_last:
        head, tail = sequence[:per * world_size], sequence[per * world_size:]
    else:
        head, tail = np.resize(sequence, per * world_size), sequence[:0]
    return np.concatenate([head.reshape(per, world_size).T.ravel(), tail])


def checked_positions(value: Any, m: int) -> np.ndarray:
    """A callable order's output as int64 positions of the pool, or one clear error saying what is wrong."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"the order callable must return a 1-D array of indices, got shape {arr.shape}")
    if len(arr) == 0:
        raise ValueError("the order callable returned no indices; an epoch needs at least one")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"the order callable must return integer indices, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= m:
        raise ValueError(f"the order callable returned indices in [{low}, {high}], outside [0, {m}) (its first "
                         f"argument, n={m}, is the number of records it orders)")
    return arr.astype(np.int64, copy=False)


def _checked_indices(indices: Any, records: int) -> np.ndarray:
    arr = np.asarray(indices)
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError(f"indices= must be a non-empty 1-D array of record indices, got shape {arr.shape}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"indices= must hold integer record indices, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= records:
        raise ValueError(f"indices= holds records in [{low}, {high}], outside the dataset's [0, {records})")
    pool = arr.astype(np.int64)
    pool.setflags(write=False)
    return pool


def _checked_weights(weights: Any, records: int, pool: np.ndarray | None, replacement: bool) -> np.ndarray:
    arr = np.asarray(weights.numpy() if hasattr(weights, "numpy") else weights)
    if arr.shape != (records,):
        raise ValueError(f"weights= must hold one weight per record of the dataset, shape ({records},), got shape "
                         f"{arr.shape} (with indices=, the weights of the chosen records are used)")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"weights= must be numbers, got dtype {arr.dtype}")
    w = arr.astype(np.float64)
    if not np.isfinite(w).all() or (w < 0).any():
        bad = int(np.flatnonzero(~np.isfinite(w) | (w < 0))[0])
        raise ValueError(f"weights= must be finite and >= 0, got {w[bad]} for record {bad}")
    chosen = w if pool is None else w[pool]
    if not (chosen > 0).any():
        raise ValueError("weights= are all zero" + (" over the chosen indices" if pool is not None else "") +
                         ": no record could be drawn")
    if replacement and chosen.sum() == np.inf:
        raise ValueError("weights= sum to infinity; scale them down")
    w.setflags(write=False)
    return w


def checked(records: int, order: Any, *, indices: Any = None, weights: Any = None, replacement: bool | None = None,
            repeats: int = 1, samples_per_epoch: int | None = None,
            locality: str | None = None) -> tuple[Any, Sampling | None]:
    """(the order's name, or `order` unchanged when no sampling option is given; the checked `Sampling` or None).

    Refused with one message: options that make no sense together (weights with a non-random order or a
    callable, locality="shard" with any of them), and bad values (out-of-range indices, negative or all-zero
    weights, a non-integer repeats or samples_per_epoch)."""
    fn = order if callable(order) else None
    given = [name for name, value in (("indices", indices), ("weights", weights), ("replacement", replacement),
                                      ("samples_per_epoch", samples_per_epoch)) if value is not None]
    given += [] if is_int(repeats) and repeats == 1 else ["repeats"]
    given += ["order=<callable>"] if fn is not None else []
    if not given:
        return order, None
    if locality is not None:
        raise ValueError(f"locality={locality!r} deals whole shard groups to ranks and does not combine with "
                         f"{', '.join(given)}; drop locality to sample")
    replacement = None if replacement is None else check_bool("replacement", replacement)
    if weights is not None and replacement is None:
        raise ValueError("weights= needs replacement=True (independent draws, records may repeat) or "
                         "replacement=False (each record of positive weight once, in a weighted order)")
    if replacement is not None and (fn is not None or order not in (None, "random")):
        shown = "a callable" if fn is not None else repr(order)
        raise ValueError(f"weights=/replacement= draw records at random (order='random'); they do not combine with "
                         f"order={shown}")
    repeats = check_int("repeats", repeats, 1, 1 << 16)
    if samples_per_epoch is not None:
        samples_per_epoch = check_int("samples_per_epoch", samples_per_epoch, 1, MAX_EPOCH_SAMPLES)
    pool = None if indices is None else _checked_indices(indices, records)
    w = None if weights is None else _checked_weights(weights, records, pool, bool(replacement))
    if (len(pool) if pool is not None else records) * repeats > MAX_EPOCH_SAMPLES:
        raise ValueError(f"repeats={repeats} makes an epoch longer than {MAX_EPOCH_SAMPLES} samples")
    name = CUSTOM if fn is not None else ("random" if replacement is not None else order)
    return name, Sampling(records, pool, w, replacement, repeats, samples_per_epoch, fn)


def class_balanced_weights(dataset) -> np.ndarray:
    """Per-record weights 1 / (records of its class), for ``weights=..., replacement=True``: every class is
    drawn equally often. An unlabelled record (label -1) gets weight 0."""
    labels = np.asarray(dataset.labels if hasattr(dataset, "labels") else dataset)
    labelled = labels >= 0
    if not labelled.any():
        raise ValueError("class_balanced_weights needs labels; this dataset has none (every label is -1)")
    counts = np.bincount(labels[labelled])
    weights = np.zeros(len(labels))
    weights[labelled] = 1.0 / counts[labels[labelled]]
    return weights
