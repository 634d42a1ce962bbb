"""Batch copies out of the shard maps: one slice copy per run, or one gather per shard.

A batch is an index array. `fill` splits it into pieces that each come from one shard and
copies every piece with a single numpy call, so the Python cost is per run or per shard,
never per record:

- when the batch is made of long runs of consecutive records (sequential and block
  orders), each run is one `np.copyto` of a slice of the map (the fastest copy measured);
- otherwise (random order) each stretch of same-shard records is one
  `np.take(shard, local, axis=0, out=..., mode="clip")`, the fastest gather measured;
- a batch whose records hop between shards many times (unsorted indices, e.g. from a
  DataLoader sampler) is copied in sorted order into a scratch buffer, a few pieces, then put
  back in the caller's order with one `np.take`.

The loader's batches are sorted, so they always take one of the first two paths.

`fill_parallel` cuts the batch into equal record ranges, one per thread; numpy releases the
GIL while copying, so the threads copy at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from dsc import format as fmt

MIN_RUN = 4  # batches whose runs average fewer records than this are gathered, not sliced
INTERLEAVED = 2  # a batch with this many shard changes per shard or more is copied in sorted order


def check_indices(indices, count: int) -> np.ndarray:
    """Indices (a 1-D sequence of integers) as int64, negatives counted from the end.

    Checked once per batch here, so the copies below may use `mode="clip"` (no per-record check).
    Floats, bools and strings are refused, not cast: a cast would serve other records silently.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
        kinds = {"b": "bools", "f": "floats", "c": "complex numbers", "U": "strings", "S": "bytes", "O": "objects"}
        got = f"{idx.ndim}-D input" if idx.ndim != 1 else kinds.get(idx.dtype.kind, idx.dtype.name)
        raise TypeError(f"record indices must be a 1-D sequence of integers (a list of ints, as DataLoader "
                        f"passes), got {got}")
    if idx.size == 0:
        return idx.astype(np.int64)
    low, high = int(idx.min()), int(idx.max())  # Python ints: a uint64 2**64 - 1 stays itself
    if low < -count or high >= count:
        raise IndexError(out_of_range(int(idx[(idx < -count) | (idx >= count)][0]), count))
    idx = idx.astype(np.int64, copy=False)
    return np.where(idx < 0, idx + count, idx) if low < 0 else idx


def out_of_range(i: int, count: int) -> str:
    """The message for index `i` as the caller gave it, with the range that would have been valid."""
    valid = f"valid: {-count}..{count - 1}" if count else "it has none"
    return f"record index {i} is out of range for a dataset of {count} records ({valid})"


def _bounds(starts: np.ndarray, n: int) -> list[tuple[int, int]]:
    edges = [0, *starts.tolist(), n]
    return list(zip(edges[:-1], edges[1:]))


def fill(dst: np.ndarray, shards: Sequence[np.ndarray], idx: np.ndarray, per_shard: int) -> None:
    """Copy records `idx` (checked, in any order) into `dst[:len(idx)]`, a few numpy calls in all."""
    n = len(idx)
    if n == 0:
        return
    shard, local = fmt.locate(idx, per_shard)
    if np.count_nonzero(shard[1:] != shard[:-1]) < INTERLEAVED * len(shards):
        _copy_pieces(dst, shards, shard, local)
        return
    order = np.argsort(idx, kind="stable")  # shards interleave: sorted, the batch is a few pieces
    scratch = np.empty_like(dst[:n])
    _copy_pieces(scratch, shards, shard[order], local[order])
    np.take(scratch, np.argsort(order), axis=0, out=dst[:n], mode="clip")


def _copy_pieces(dst: np.ndarray, shards: Sequence[np.ndarray], shard: np.ndarray, local: np.ndarray) -> None:
    """One slice copy per run of consecutive records, or one gather per stretch of one shard."""
    n = len(shard)
    shard_change = shard[1:] != shard[:-1]
    run_starts = np.flatnonzero(shard_change | (local[1:] != local[:-1] + 1)) + 1
    if (len(run_starts) + 1) * MIN_RUN <= n:
        for a, b in _bounds(run_starts, n):
            lo = int(local[a])
            np.copyto(dst[a:b], shards[int(shard[a])][lo:lo + b - a])
    else:
        for a, b in _bounds(np.flatnonzero(shard_change) + 1, n):
            np.take(shards[int(shard[a])], local[a:b], axis=0, out=dst[a:b], mode="clip")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into at most `parts` contiguous, nearly equal, non-empty ranges."""
    parts = max(1, min(parts, n))
    edges = [n * k // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def fill_parallel(dst: np.ndarray, shards: Sequence[np.ndarray], idx: np.ndarray, per_shard: int,
                  pool: Executor | None, threads: int) -> None:
    """`fill`, with the batch's record ranges shared between the caller and `threads - 1` pool threads."""
    ranges = split(len(idx), threads if pool is not None else 1)
    futures = [pool.submit(fill, dst[a:b], shards, idx[a:b], per_shard) for a, b in ranges[1:]]
    try:
        if ranges:
            a, b = ranges[0]
            fill(dst[a:b], shards, idx[a:b], per_shard)
    finally:
        for f in futures:
            f.result()  # re-raises a copy thread's error here, in the caller
