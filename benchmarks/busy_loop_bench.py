"""Does the loader keep up with a training loop that keeps the GIL busy? Both switch intervals, side by side.

    python benchmarks/busy_loop_bench.py DATASET [--batch 64] [--busy-ms 2,5,12] [--steps 200]
        [--device cuda] [--also 0.0005]

A loop that launches kernels as fast as it can (a small model on a fast GPU) runs Python nearly all
the time. Here each step is `--busy-ms` of pure Python work (no GPU needed). For each busy time the
loader runs twice in the same process: with DSC_SWITCH_INTERVAL=off (the interpreter's 5 ms switch
interval, left alone) and with dsc's default (dsc.reader.turns lowers it while the producer runs).
Printed: the producer's time per batch with the loop idle, then per busy time the loop's wait for
each batch and its steps per second under both. Where the loader keeps up, the wait is near zero and
the steps take the busy time; where the producer is locked out of the GIL, the wait approaches the
producer's own time per batch (no overlap at all).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from dsc import MemmapDataset
from dsc.reader import turns

MODES = (("5 ms (left alone)", "off"), (f"dsc default ({turns.SWITCH_S * 1e3:g} ms)", ""))


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
    parser.add_argument("--also", default="", help="more DSC_SWITCH_INTERVAL values to run, in seconds")
    args = parser.parse_args()
    modes = [*MODES, *((f"{float(v) * 1e3:g} ms", v) for v in args.also.split(",") if v)]
    ds = MemmapDataset(args.dataset)
    os.environ[turns.ENV] = "off"
    idle_ms = 1e3 / run(ds, args, 0.0)[1]
    print(f"{len(ds)} records of {ds.record_shape}, batch {args.batch}, random order, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}; the loop idle takes a batch every {idle_ms:.2f} ms")
    print(f"{'busy ms':>8}  {'switch interval':<22}{'wait ms/step':>14}{'steps/s':>10}{'x ideal':>9}")
    for busy_ms in (float(v) for v in args.busy_ms.split(",")):
        ideal = 1e3 / max(busy_ms, idle_ms)  # the producer overlapping the step entirely
        for label, value in modes:
            os.environ[turns.ENV] = value
            wait_ms, rate = run(ds, args, busy_ms / 1e3)
            print(f"{busy_ms:>8g}  {label:<22}{wait_ms:>14.2f}{rate:>10.1f}{rate / ideal:>9.2f}")


if __name__ == "__main__":
    main()
