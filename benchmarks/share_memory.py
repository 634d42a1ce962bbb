"""Memory one rank pays for its share of an epoch: the peak while `order.epoch_share` computes it,
and what stays allocated while the share is held (a loader holds it for the whole epoch, and its
producer plans the next epoch's before this one ends).

Each case runs in a fresh interpreter, numpy's allocations traced by tracemalloc (numpy reports
them to it), so one case's garbage is not the next one's.

    python benchmarks/share_memory.py --records 100000000 --world-size 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CASE = """
import json, sys, time, tracemalloc
from dsc.reader import order as orders
n, order, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tracemalloc.start()
started = time.perf_counter()
share = orders.epoch_share(n, order, 0, 0, world - 1, world, 256, False)  # the last rank: it wraps to pad
seconds = time.perf_counter() - started
held, peak = tracemalloc.get_traced_memory()
print(json.dumps({"share": share.nbytes, "held": held, "peak": peak, "seconds": seconds}))
"""


def measure(records: int, order: str, world_size: int) -> dict:
    run = subprocess.run([sys.executable, "-c", CASE, str(records), order, str(world_size)],
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000_000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--orders", nargs="+", default=["block", "random", "sequential"])
    args = parser.parse_args()
    print(f"{args.records:,} records, {args.world_size} ranks, the last rank's share (MB = 10^6 bytes)")
    print(f"{'order':<11}{'share MB':>10}{'held MB':>10}{'peak MB':>10}{'seconds':>9}")
    for order in args.orders:
        m = measure(args.records, order, args.world_size)
        print(f"{order:<11}{m['share'] / 1e6:>10.0f}{m['held'] / 1e6:>10.0f}{m['peak'] / 1e6:>10.0f}"
              f"{m['seconds']:>9.2f}")


if __name__ == "__main__":
    main()
