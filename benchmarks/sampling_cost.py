"""What the within-batch arrangement and each sampling option cost per batch, as a share of loader time.

    python benchmarks/sampling_cost.py DATASET [--batch 256] [--repeat 10]

For each setting, side by side in one process (settings alternating, `--repeat` rounds, medians):

  loader ms/batch  a warm epoch through `ds.loader` (page cache warm), after its first batch
  vs base          that time over the plain block order's (the order work plus the records it reads)
  order us/batch   the order work alone, measured directly: computing the epoch's share
                   (`progress.Planner.plan` for a new epoch: the sampling sequence, per epoch) divided
                   by the epoch's batches, plus cutting and arranging one batch (`order.batch_indices`)
  share            order us/batch over loader ms/batch; the target is <= 5%

The arrangement's own row ("block, sorted batches") takes the batches sorted instead of arranged;
the permutation's cost is the block row's order work less the sorted row's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsc
from dsc.reader import MemmapDataset, progress
from dsc.reader import order as orders
from dsc.tools.bench import warm_up

TARGET = 0.05


def settings(ds: MemmapDataset) -> dict[str, dict[str, Any]]:
    n = len(ds)
    rng = np.random.default_rng(0)
    return {
        "block (no sampling)": {"order": "block"},
        "block, sorted batches": {"order": "block", "sorted": True},
        "random": {"order": "random"},
        "indices (half, sorted)": {"indices": np.sort(rng.permutation(n)[:n // 2])},
        "weights, replacement": {"weights": dsc.class_balanced_weights(ds), "replacement": True},
        "weights, no replacement": {"weights": rng.random(n), "replacement": False},
        "repeats=3": {"repeats": 3},
        "samples_per_epoch=n/2": {"samples_per_epoch": n // 2},
        "order=callable": {"order": lambda m, seed, epoch: np.random.default_rng([seed, epoch]).permutation(m)},
    }


def sorted_batches(share, batch, batch_size, order, seed, epoch, records_per_shard):
    return np.sort(share[batch * batch_size:(batch + 1) * batch_size])


def loader_ms(ds: MemmapDataset, batch: int, epoch: int, options: dict[str, Any]) -> float:
    loader = ds.loader(batch, seed=0, **options)
    loader.set_epoch(epoch)
    batches = iter(loader)
    next(batches)  # the producer is running: time the rest
    start, k = time.perf_counter(), 0
    for _ in batches:
        k += 1
    took = (time.perf_counter() - start) / max(k, 1)
    loader.close()
    return took * 1e3


def order_us(ds: MemmapDataset, batch: int, epoch: int, options: dict[str, Any]) -> float:
    loader = ds.loader(batch, seed=0, **options)
    planner = loader._planner(0)
    split = progress.Split(1, batch, False)
    start = time.perf_counter()
    p, share = planner.plan(epoch, [], split, 0)  # a new epoch: its sequence is not cached yet
    per_epoch = time.perf_counter() - start
    start = time.perf_counter()
    for b in range(p.count):
        orders.batch_indices(share, b, batch, loader.order, 0, epoch, ds.manifest.records_per_shard)
    per_batch = (time.perf_counter() - start) / p.count
    loader.close()
    return (per_epoch / p.count + per_batch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    ds = MemmapDataset(args.dataset)
    warm_up(ds.opened.shard_paths())
    table = settings(ds)
    ms: dict[str, list[float]] = {name: [] for name in table}
    us: dict[str, list[float]] = {name: [] for name in table}
    real = orders.batch_indices
    for r in range(args.repeat):
        for name, options in table.items():
            options = dict(options)
            if options.pop("sorted", False):
                orders.batch_indices = sorted_batches
            try:
                ms[name].append(loader_ms(ds, args.batch, r, options))
                us[name].append(order_us(ds, args.batch, 1000 + r, options))
            finally:
                orders.batch_indices = real
    print(f"{args.dataset}: {len(ds)} records of {'x'.join(map(str, ds.record_shape))}, batch {args.batch}, "
          f"medians of {args.repeat} warm epochs per setting, alternating")
    print(f"{'setting':<26}{'loader ms/batch':>16}{'vs base':>9}{'order us/batch':>16}{'share':>8}")
    base = float(np.median(ms["block (no sampling)"]))
    shares = {}
    for name in table:
        m, u = float(np.median(ms[name])), float(np.median(us[name]))
        shares[name] = u / (m * 1e3)
        print(f"{name:<26}{m:>16.2f}{m / base:>9.3f}{u:>16.1f}{shares[name]:>8.2%}")
    arrangement = (float(np.median(us["block (no sampling)"])) - float(np.median(us["block, sorted batches"])))
    print(f"within-batch arrangement: {arrangement:.1f} us/batch, {arrangement / (base * 1e3):.2%} of block order's "
          f"loader time; every setting's order work within {TARGET:.0%}: "
          f"{'yes' if max(shares.values()) <= TARGET else 'no'} (largest {max(shares.values()):.2%})")


if __name__ == "__main__":
    main()
