"""Does the loader keep up with a training loop that keeps the GIL busy? Switch intervals side by side.

    python benchmarks/busy_loop_bench.py DATASET [--batch 64] [--busy-ms 2,5,12] [--steps 200]
        [--device cuda] [--switch-intervals 0.005,0.001,0.0005]

A loop that launches kernels as fast as it can (a small model on a fast GPU) runs Python nearly all
the time. Here each step is `--busy-ms` of pure Python work (no GPU needed). CPython hands the GIL to
a waiting thread only after it has waited a whole switch interval (5 ms by default), and the
producer gives the GIL up many times per batch, so under such a loop it is locked out for a switch
interval at each turn. For each busy time the loader runs once per interpreter switch interval
(`sys.setswitchinterval`): printed are the loop's wait for each batch and its steps per second
against the ideal (the producer overlapping the step entirely: the larger of the busy time and the
producer's idle time per batch).

What it showed (2026-11-28): a lower interval lets a pure-Python loop's producer keep up (5 ms busy,
batch 256, 16 cores: 0.61x ideal at 5 ms, 0.74x at 1 ms, 0.85x at 0.2 ms), but on an H200 training
resnet18 at 160 px it changed nothing (benchmarks/train_bench.py: 0.36-0.52x synthetic at every
interval), so dsc leaves the interval alone. See docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from dsc import MemmapDataset


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(ds: MemmapDataset, args: argparse.Namespace, busy_s: float) -> tuple[float, float]:
    """(ms waited per step, steps per second) over `args.steps` steps after 10 untimed ones."""
    loader = ds.loader(args.batch, order="random", seed=0, drop_last=True, device=args.device)
    batches = (b for epoch in itertools.count() for b in (loader.set_epoch(epoch) or loader))
    for _ in range(10):
        next(batches)
    waited, start = 0.0, time.perf_counter()
    for _ in range(args.steps):
        asked = time.perf_counter()
        next(batches)
        waited += time.perf_counter() - asked
        busy(busy_s)
    wall = time.perf_counter() - start
    loader.close()
    return waited / args.steps * 1e3, args.steps / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--busy-ms", default="2,5,12")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default=None)
    parser.add_argument("--switch-intervals", default="0.005,0.001", help="seconds, comma-separated")
    args = parser.parse_args()
    ds = MemmapDataset(args.dataset)
    intervals = [float(v) for v in args.switch_intervals.split(",")]
    if not all(0 < v <= 1 for v in intervals):
        parser.error(f"--switch-intervals: seconds between 0 and 1, got {args.switch_intervals}")
    sys.setswitchinterval(intervals[0])
    idle_ms = 1e3 / run(ds, args, 0.0)[1]
    print(f"{len(ds)} records of {ds.record_shape}, batch {args.batch}, random order, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}; the loop idle takes a batch every {idle_ms:.2f} ms")
    print(f"{'busy ms':>8}  {'switch interval':>16}{'wait ms/step':>14}{'steps/s':>10}{'x ideal':>9}")
    for busy_ms in (float(v) for v in args.busy_ms.split(",")):
        ideal = 1e3 / max(busy_ms, idle_ms)
        for interval in intervals:
            sys.setswitchinterval(interval)
            wait_ms, rate = run(ds, args, busy_ms / 1e3)
            print(f"{busy_ms:>8g}  {interval * 1e3:>13g} ms{wait_ms:>14.2f}{rate:>10.1f}{rate / ideal:>9.2f}")


if __name__ == "__main__":
    main()
