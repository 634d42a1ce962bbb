"""Block order's trade-off, both ways: how often stored neighbours share a batch, against cold-read speed.

    python benchmarks/cooccurrence_bench.py DATASET [--batch 256] [--epochs 4] [--cold-repeat 2]
                                            [--warm-repeat 5] [--settings ...]

DATASET is any compiled dataset; the figures in the README come from 8,000 records at 224×224
(`python benchmarks/corpus.py /tmp/c8k-src --images 8000 --seed 1`, then
`dsc compile /tmp/c8k-src /tmp/c8k --size 224`: 1.2 GB). For each order setting (random order,
and block order with its block and window lengths: `block:64/32` is 64-record blocks, each
window of 32 blocks served in a random order of its records), columns:

  same batch 1 ep  of the stored-neighbour pairs (i, i+1), the fraction that share a batch in one
                   epoch (mean over epochs); random order: about batch/records
  2 consecutive    the fraction that share a batch in epoch e and again in e+1 (mean over e):
                   batch-mates that do not change from one epoch to the next
  partner = nbr    the fraction of samples whose position partner (k-1, torchvision's MixUp and
                   CutMix) is a stored neighbour, as the loader serves the batches
  cold samples/s   one epoch through `ds.loader` right after the dataset's shard files were dropped
                   from the page cache with `posix_fadvise(POSIX_FADV_DONTNEED)` (checked with
                   `mincore`: at most 5% resident), best of --cold-repeat
  warm samples/s   the same with the page cache warm, best of --warm-repeat

Then the cost of arranging records within a batch (`order.batch_indices`): warm epochs of one
dataset's loader with the batches sorted (the layout before issue 21), arranged shard by shard (the
loader's: one gather per shard) and arranged uniformly (i21-mix: one gather per switch between
shards), alternating in one process --cost-repeat times, as samples/s and ratios to sorted.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dsc.reader import MemmapDataset
from dsc.reader import order as orders
from dsc.tools.bench import COLD_RESIDENT_MAX, evict, warm_up

DEFAULT_SETTINGS = ("random", "block:64/2", "block:64/8", "block:64/32", "block:64/128", "block")


def parse(setting: str) -> tuple[str, dict[str, int]]:
    """("block", {block_records, window}) from "block:64/32"; a bare order name: its defaults."""
    name, _, spec = setting.partition(":")
    if not spec:
        return name, {}
    block_records, window = (int(v) for v in spec.split("/"))
    return name, {"block_records": block_records, "window": window}


@contextlib.contextmanager
def block_setting(params: dict[str, int]) -> Iterator[None]:
    """Block order with other lengths than its defaults, for the loader too (it calls `order.block_slice`)."""
    real = orders.block_slice
    if params:
        orders.block_slice = functools.partial(real, **params)
    try:
        yield
    finally:
        orders.block_slice = real


def sorted_layout(share: np.ndarray, batch: int, batch_size: int, order: str, seed: int, epoch: int,
                  records_per_shard: int) -> np.ndarray:
    """The loader's batches as before issue 21: indices sorted within a batch, no arrangement."""
    return np.sort(share[batch * batch_size:(batch + 1) * batch_size])


def uniform_layout(share: np.ndarray, batch: int, batch_size: int, order: str, seed: int, epoch: int,
                   records_per_shard: int) -> np.ndarray:
    """A uniformly random arrangement (branch i21-mix): the copy takes one gather per switch between shards."""
    index = share[batch * batch_size:(batch + 1) * batch_size]
    return index[np.argsort(orders.position_keys(index, seed, epoch), kind="stable")]


def served(path: Path, batch: int, order: str, epoch: int) -> tuple[list[np.ndarray], float]:
    """(the batches' index entries, seconds) of one epoch through the loader of a fresh `MemmapDataset`,
    let go after: the process's own maps would keep the shards' pages in the page cache."""
    loader = MemmapDataset(path).loader(batch, order=order, seed=0)
    loader.set_epoch(epoch)
    start = time.perf_counter()
    out = [b["index"].numpy().copy() for b in loader]
    seconds = time.perf_counter() - start
    loader.close()
    del loader
    gc.collect()
    return out, seconds


def cooccurrence(epochs: list[list[np.ndarray]], n: int) -> tuple[float, float, float]:
    """(neighbours in one batch per epoch, neighbours in one batch in two consecutive epochs, partner = neighbour)."""
    same, partner = [], []
    for batches in epochs:
        batch_of = np.empty(n, np.int64)
        for k, idx in enumerate(batches):
            batch_of[idx] = k
            partner.append(np.mean(np.abs(idx - np.roll(idx, 1)) == 1))
        same.append(batch_of[1:] == batch_of[:-1])
    one = float(np.mean([s.mean() for s in same]))
    two = float(np.mean([(a & b).mean() for a, b in zip(same, same[1:])]))
    return one, two, float(np.mean(partner))


def cold_rate(path: Path, shards: list[Path], batch: int, order: str, repeat: int) -> float | None:
    """Samples/s of one epoch from an evicted page cache, or None where the OS keeps the pages."""
    best = None
    for r in range(repeat):
        resident = evict(shards)
        if resident is None or resident > COLD_RESIDENT_MAX:
            return None
        batches, seconds = served(path, batch, order, 100 + r)
        rate = sum(len(b) for b in batches) / seconds
        best = rate if best is None else max(best, rate)
    return best


def permutation_cost(path: Path, shards: list[Path], batch: int, repeat: int) -> None:
    """Warm epochs through one dataset's loader, the batches sorted / arranged shard by shard (the loader's) /
    arranged uniformly, alternating in one process; median samples/s of each epoch after its first batch."""
    warm_up(shards)
    ds = MemmapDataset(path)
    layouts = {"sorted": sorted_layout, "shard by shard": orders.batch_indices, "uniform": uniform_layout}
    real = orders.batch_indices
    for order in ("block", "random"):
        rates: dict[str, list[float]] = {name: [] for name in layouts}
        try:
            for r in range(repeat):
                for name, layout in layouts.items():
                    orders.batch_indices = layout
                    loader = ds.loader(batch, order=order, seed=0)
                    loader.set_epoch(r)
                    batches = iter(loader)
                    next(batches)  # the producer is running: time the rest
                    start, n = time.perf_counter(), 0
                    for b in batches:
                        n += len(b)
                    rates[name].append(n / (time.perf_counter() - start))
                    loader.close()
        finally:
            orders.batch_indices = real
        med = {name: float(np.median(v)) for name, v in rates.items()}
        print(f"arrangement cost, order={order} (median of {repeat}, warm): "
              + "  ".join(f"{name} {v:,.0f} samples/s" for name, v in med.items())
              + f"; shard by shard / sorted {med['shard by shard'] / med['sorted']:.3f}, uniform / sorted "
              f"{med['uniform'] / med['sorted']:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--cold-repeat", type=int, default=2)
    parser.add_argument("--warm-repeat", type=int, default=5)
    parser.add_argument("--cost-repeat", type=int, default=40)
    parser.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS))
    parser.add_argument("--skip-cold", action="store_true")
    args = parser.parse_args()
    ds = MemmapDataset(args.dataset)
    n, shape, shards = len(ds), ds.record_shape, ds.opened.shard_paths()
    del ds  # its maps would keep the pages in the page cache
    print(f"{args.dataset}: {n} records of {'x'.join(map(str, shape))}, batch {args.batch}, "
          f"{args.epochs} epochs; defaults: block {orders.BLOCK_RECORDS}/{orders.WINDOW_BLOCKS}")
    print(f"{'setting':<16}{'same batch 1 ep':>16}{'2 consecutive':>15}{'partner = nbr':>15}"
          f"{'cold samples/s':>16}{'warm samples/s':>16}")
    for setting in args.settings:
        order, params = parse(setting)
        with block_setting(params):
            epochs = [served(args.dataset, args.batch, order, e)[0] for e in range(args.epochs)]
            one, two, partner = cooccurrence(epochs, n)
            cold = None if args.skip_cold else cold_rate(args.dataset, shards, args.batch, order, args.cold_repeat)
            warm_up(shards)
            warm = max(n / served(args.dataset, args.batch, order, 200 + r)[1] for r in range(args.warm_repeat))
        cold_text = "n/a" if cold is None else f"{cold:,.0f}"
        print(f"{setting:<16}{one:>16.1%}{two:>15.1%}{partner:>15.1%}{cold_text:>16}{warm:>16,.0f}", flush=True)
    permutation_cost(args.dataset, shards, args.batch, args.cost_repeat)


if __name__ == "__main__":
    main()
