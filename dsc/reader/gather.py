"""Batch copies out of the shard maps: one slice copy per run, or one gather per shard.

A batch is an index array. `fill` splits it into pieces that each come from one shard and
copies every piece with a single numpy call, so the Python cost is per run or per shard,
never per record:

- when the batch is made of long runs of consecutive records (sequential order), each run is
  one `np.copyto` of a slice of the map (the fastest copy measured);
- otherwise (block and random order) each stretch of same-shard records is one
  `np.take(shard, local, axis=0, out=..., mode="clip")`, the fastest gather measured.

Indices in another order than ascending (the loader's batches, whose positions are a seeded
arrangement, or a DataLoader sampler's) are copied so that every byte is still copied once:

- when each shard's records are one contiguous stretch of rows (the loader's arrangement,
  `order.arrange`), each stretch is one `np.take` straight into its rows, in the order asked: the
  same calls as for the sorted batch, whatever the record size;
- otherwise, when their sorted form makes long runs (a sampler's contiguous batches), the runs
  are read in order and each is written straight into the rows the caller wants it in, `dst[rows] = shard[lo:hi]`
  (one row copy per record, no temporary; measured as fast as the slice copy);
- when it does not (a sampler's shuffled batches), records of `HOP_MIN_BYTES` or more are gathered in the
  order asked, one `np.take` per stretch of one shard: a call per shard hop (~1 µs) costs less
  than copying a 150 KB record twice; smaller records are gathered sorted into a scratch
  buffer (a few pieces) and put in order with one more `np.take`.

`fill_parallel` cuts the batch into equal ranges (of its rows, or of its sorted records), one per
thread; numpy releases the GIL while copying, so the threads copy at the same time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

from dsc import format as fmt

MIN_RUN = 4  # batches whose runs average fewer records than this are gathered, not sliced
HOP_MIN_BYTES = 32 << 10  # records at least this large are gathered in the caller's order, one call per shard hop
MAX_DEFAULT_THREADS = 4  # copies saturate memory bandwidth with a few threads


def default_threads() -> int:
    """Threads a gather uses unless told: one per core this process may run on, up to MAX_DEFAULT_THREADS (more
    threads than cores only take turns: a record cache gathering on 4 threads on 2 cores read its warm epochs
    up to 15% slower than the local loader on 2)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores))


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


def ascending(idx: np.ndarray) -> bool:
    """Whether `idx` never decreases (then every piece is copied straight into its rows)."""
    return bool(np.all(idx[1:] >= idx[:-1]))


def _runs(shard: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, bool]:
    """(where each run of consecutive records of one shard starts, whether runs are long enough to slice)."""
    run_starts = np.flatnonzero((shard[1:] != shard[:-1]) | (local[1:] != local[:-1] + 1)) + 1
    return run_starts, (len(run_starts) + 1) * MIN_RUN <= len(shard)


def one_stretch_per_shard(shard: np.ndarray) -> bool:
    """Whether the records of every shard in the batch are one contiguous stretch of it."""
    firsts = shard[np.r_[0, np.flatnonzero(shard[1:] != shard[:-1]) + 1]]
    return len(np.unique(firsts)) == len(firsts)


def fill(dst: np.ndarray, shards: Sequence[np.ndarray], idx: np.ndarray, per_shard: int) -> None:
    """Copy records `idx` (checked, in any order) into `dst[:len(idx)]`, a few numpy calls in all."""
    fill_parallel(dst, shards, idx, per_shard, None, 1)


def _copy_pieces(dst: np.ndarray, shards: Sequence[np.ndarray], shard: np.ndarray, local: np.ndarray,
                 slots: np.ndarray | None = None) -> None:
    """Ascending records into rows `slots` (default: 0, 1, ...): one copy per run of consecutive records,
    or one gather per stretch of one shard (rows 0, 1, ... only: `np.take` writes contiguous rows; a
    caller gives `slots` only for records whose runs are long)."""
    n = len(shard)
    run_starts, long_runs = _runs(shard, local)
    if long_runs or slots is not None:
        for a, b in _bounds(run_starts, n):
            lo = int(local[a])
            if slots is None:
                np.copyto(dst[a:b], shards[int(shard[a])][lo:lo + b - a])
            else:  # one row copy per record, no temporary (the source is a slice of the map)
                dst[slots[a:b]] = shards[int(shard[a])][lo:lo + b - a]
    else:
        _gather_stretches(dst, shards, shard, local)


def _gather_stretches(dst: np.ndarray, shards: Sequence[np.ndarray], shard: np.ndarray, local: np.ndarray) -> None:
    """Records in the order given into rows 0, 1, ...: one `np.take` per stretch of one shard."""
    for a, b in _bounds(np.flatnonzero(shard[1:] != shard[:-1]) + 1, len(shard)):
        np.take(shards[int(shard[a])], local[a:b], axis=0, out=dst[a:b], mode="clip")


def _through_scratch(dst: np.ndarray, shards: Sequence[np.ndarray], shard: np.ndarray, local: np.ndarray,
                     order: np.ndarray) -> None:
    """Small records hopping between shards: sorted into a scratch buffer (a few pieces), then put in order."""
    n = len(shard)
    scratch = np.empty_like(dst[:n])
    _copy_pieces(scratch, shards, shard[order], local[order])
    np.take(scratch, np.argsort(order), axis=0, out=dst[:n], mode="clip")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) cut into at most `parts` contiguous, nearly equal, non-empty ranges."""
    parts = max(1, min(parts, n))
    edges = [n * k // parts for k in range(parts + 1)]
    return list(zip(edges[:-1], edges[1:]))


def fill_parallel(dst: np.ndarray, shards: Sequence[np.ndarray], idx: np.ndarray, per_shard: int,
                  pool: Executor | None, threads: int) -> None:
    """`fill`, with the batch shared between the caller and `threads - 1` pool threads (module docstring)."""
    n = len(idx)
    if n == 0:
        return
    shard, local = fmt.locate(idx, per_shard)
    ranges = split(n, threads if pool is not None else 1)
    if ascending(idx):
        jobs = [functools.partial(_copy_pieces, dst[a:b], shards, shard[a:b], local[a:b]) for a, b in ranges]
    elif one_stretch_per_shard(shard):  # each thread a range of rows, one gather per stretch in it
        jobs = [functools.partial(_gather_stretches, dst[a:b], shards, shard[a:b], local[a:b]) for a, b in ranges]
    else:
        order = np.argsort(idx, kind="stable")
        if _runs(shard[order], local[order])[1]:  # each thread a range of the sorted runs, into their rows
            jobs = [functools.partial(_copy_pieces, dst, shards, shard[order[a:b]], local[order[a:b]], order[a:b])
                    for a, b in ranges]
        elif dst[0].nbytes >= HOP_MIN_BYTES:  # each thread a range of rows, gathered in the order asked
            jobs = [functools.partial(_gather_stretches, dst[a:b], shards, shard[a:b], local[a:b])
                    for a, b in ranges]
        else:
            jobs = [functools.partial(_through_scratch, dst, shards, shard, local, order)]
    futures = [pool.submit(job) for job in jobs[1:]] if pool is not None else []
    try:
        jobs[0]()
    finally:
        for f in futures:
            f.result()  # re-raises a copy thread's error here, in the caller
