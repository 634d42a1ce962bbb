"""In what order an epoch visits the records: plain functions of (n, seed, epoch) → index arrays.

All randomness comes from a numpy Generator seeded with ``(seed, epoch)`` only, so every rank
and every resumed run computes the same epoch order.

- ``sequential``: 0, 1, …, n-1.
- ``block``: the records are cut into blocks of `BLOCK_RECORDS` contiguous records (block edges
  move by a random shift each epoch), the blocks are shuffled, and within each window of
  `WINDOW_BLOCKS` consecutive blocks, runs of `RUN_RECORDS` records are shuffled. Records were
  stored shuffled at compile time, so a block is already class-mixed; the window mixes which
  records share a batch from epoch to epoch, and reads stay runs of contiguous records
  (slice copies when warm, large sequential reads when cold).
- ``random``: a full permutation.

An epoch is then split between ranks (`rank_share`) and cut into batches (`batch_indices`);
inside a batch the indices are sorted, which turns neighbours into runs and groups records by
shard, so every batch is a few large copies. The batch's ``index`` entry says what was served.
"""

from __future__ import annotations

import numpy as np

ORDERS = ("sequential", "block", "random")
BLOCK_RECORDS = 64  # ~10 MB at 224×224: large enough for fast reads from a cold disk
WINDOW_BLOCKS = 8  # blocks whose runs are mixed together
RUN_RECORDS = 8  # the unit of mixing inside a window; stays one slice copy


def generator(seed: int, epoch: int) -> np.random.Generator:
    """The only source of randomness of an epoch's order."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([seed, epoch])


def sequential(n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def random(n: int, seed: int, epoch: int) -> np.ndarray:
    return generator(seed, epoch).permutation(n).astype(np.int64)


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ranges [starts[k], starts[k] + lengths[k]) without a Python loop."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    offset = np.arange(total, dtype=np.int64) - np.repeat(ends - lengths, lengths)
    return np.repeat(starts.astype(np.int64), lengths) + offset


def block(n: int, seed: int, epoch: int, block_records: int = BLOCK_RECORDS,
          window: int = WINDOW_BLOCKS, run: int = RUN_RECORDS) -> np.ndarray:
    """Shuffled blocks of contiguous records, runs mixed within windows of blocks (module docstring)."""
    rng = generator(seed, epoch)
    shift = int(rng.integers(block_records)) if n > block_records else 0
    edges = np.unique(np.r_[0, np.arange(shift, n, block_records), n]).astype(np.int64)
    perm = rng.permutation(len(edges) - 1)
    starts, lengths = edges[:-1][perm], np.diff(edges)[perm]
    runs_per_block = -(-lengths // run)
    block_of_run = np.repeat(np.arange(len(perm)), runs_per_block)
    k = np.arange(len(block_of_run)) - np.repeat(np.cumsum(runs_per_block) - runs_per_block, runs_per_block)
    run_starts = starts[block_of_run] + k * run
    run_lengths = np.minimum(run, lengths[block_of_run] - k * run)
    mix = np.lexsort((rng.random(len(run_starts)), block_of_run // window))
    return expand_runs(run_starts[mix], run_lengths[mix])


_ORDER_FUNCTIONS = {"sequential": sequential, "block": block, "random": random}


def epoch_order(n: int, order: str, seed: int, epoch: int) -> np.ndarray:
    """Every index of [0, n) exactly once, in the epoch's order."""
    if order not in _ORDER_FUNCTIONS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return _ORDER_FUNCTIONS[order](n, seed, epoch)


def rank_share(order: np.ndarray, rank: int, world_size: int, batch_size: int, drop_last: bool) -> np.ndarray:
    """This rank's contiguous slice of the epoch order; every rank gets the same length.

    drop_last=False pads like DistributedSampler (the order repeats from its start, so at most
    `world_size - 1` records are served twice); drop_last=True keeps only full batches on every rank.
    A contiguous slice (not DistributedSampler's stride) keeps block order's runs intact.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    per_rank = share_length(len(order), world_size, batch_size, drop_last)
    pad = per_rank * world_size - len(order)
    if pad > 0:
        order = np.concatenate([order, np.resize(order, pad)])
    return order[rank * per_rank:(rank + 1) * per_rank]


def share_length(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """How many indices each rank serves per epoch (see `rank_share`)."""
    if drop_last:
        return n // world_size // batch_size * batch_size
    return -(-n // world_size)


def batch_count(share: int, batch_size: int) -> int:
    return -(-share // batch_size)


def batch_indices(share: np.ndarray, batch: int, batch_size: int) -> np.ndarray:
    """Batch number `batch` of a rank's share, sorted (see the module docstring)."""
    return np.sort(share[batch * batch_size:(batch + 1) * batch_size])


def epoch_share(n: int, order: str, seed: int, epoch: int, rank: int, world_size: int,
                batch_size: int, drop_last: bool) -> np.ndarray:
    """The indices this rank serves in `epoch`, in order; batch k is `batch_indices(share, k, ...)`."""
    return rank_share(epoch_order(n, order, seed, epoch), rank, world_size, batch_size, drop_last)
