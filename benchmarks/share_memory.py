"""Memory and time one rank pays for the order of an epoch, on the loader's own path: the share
(`progress.Epoch.first_round_share`, as `Planner.plan` and the reference loader take it) and its
first batch's indices (`order.batch_indices`), then what an epoch's whole order costs.

Per case, in a fresh interpreter (so one case's garbage is not the next one's):

- seconds to the first batch's indices;
- peak RSS beyond the interpreter after its imports (`ru_maxrss`), and numpy's peak and held
  allocations (tracemalloc, which numpy reports to): what the rank pays while computing and
  while serving (a loader holds its share for the whole epoch and plans the next one ahead);
- with --whole-epoch: seconds for every position of the epoch's order in `order.CHUNK` chunks,
  beside the `rng.permutation(n)` that drew random order before issue 27 (the ratio in one run).

    python benchmarks/share_memory.py --records 100000000 --world-size 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = """
import json, resource, sys, time, tracemalloc
import numpy as np
from dsc.reader import order as orders, progress
n, order, world, whole = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
base = rss()
tracemalloc.start()
started = time.perf_counter()
spec = progress.Epoch(n, order, 0, 0, 1 << 20)
share = spec.first_round_share(progress.Split(world, 256, False), world - 1)  # the last rank: it wraps to pad
first = orders.batch_indices(share, 0, 256, order, 0, 0, 1 << 20)
seconds = time.perf_counter() - started
held, peak = tracemalloc.get_traced_memory()
tracemalloc.stop()
out = {"held": held, "peak": peak, "seconds": seconds,
       "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}
if whole:
    chunk = getattr(orders, "CHUNK", n)
    started = time.perf_counter()
    for a in range(0, n, chunk):
        orders.order_slice(n, order, 0, 0, a, min(n, a + chunk))
    out["epoch"] = time.perf_counter() - started
    started = time.perf_counter()
    orders.generator(0, 0).permutation(n)
    out["permutation"] = time.perf_counter() - started
print(json.dumps(out))
"""


def measure(records: int, order: str, world_size: int, whole: bool) -> dict:
    run = subprocess.run([sys.executable, "-c", CASE, str(records), order, str(world_size), str(int(whole))],
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000_000)
    parser.add_argument("--world-size", type=int, nargs="+", default=[8])
    parser.add_argument("--orders", nargs="+", default=["block", "random", "sequential"])
    parser.add_argument("--whole-epoch", action="store_true",
                        help="also time every position of an epoch's order against rng.permutation(n)")
    args = parser.parse_args()
    print(f"{args.records:,} records, the last rank's share and first batch (MB = 10^6 bytes)")
    print(f"{'order':<11}{'ranks':>6}{'first s':>9}{'RSS peak MB':>13}{'np peak MB':>12}{'held MB':>9}"
          + (f"{'epoch s':>9}{'perm s':>8}{'ratio':>7}" if args.whole_epoch else ""))
    for world in args.world_size:
        for order in args.orders:
            m = measure(args.records, order, world, args.whole_epoch)
            line = (f"{order:<11}{world:>6}{m['seconds']:>9.2f}{m['rss_peak'] / 1e6:>13.0f}{m['peak'] / 1e6:>12.0f}"
                    f"{m['held'] / 1e6:>9.0f}")
            if args.whole_epoch:
                line += f"{m['epoch']:>9.2f}{m['permutation']:>8.2f}{m['epoch'] / m['permutation']:>7.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
