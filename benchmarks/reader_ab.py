"""The loader of two checkouts of dsc side by side on one dataset: did a change cost read speed?

    python benchmarks/reader_ab.py DATASET OLD_CHECKOUT [NEW_CHECKOUT] [--rounds 3] [--epochs 6] [--batch 256]

Each round runs one fresh process per checkout (PYTHONPATH pointing at it, old then new), which
reads `--epochs` epochs of DATASET in each order (`ds.loader(batch, order=..., seed=0)`, batches
dropped as they come) and reports its best epoch after the first (warm page cache). Prints every
round and, per order, the ratio new / old of the rounds' sums. NEW_CHECKOUT defaults to this one.
A checkout is a folder holding `dsc/` (e.g. `git worktree add /tmp/old 868d9ed`); both must read
DATASET's format version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ORDERS = ("sequential", "block", "random")
READ = """
import json, sys, time
from dsc import MemmapDataset
ds, epochs, batch = MemmapDataset(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
best = {}
for order in sys.argv[4].split(","):
    loader = ds.loader(batch, order=order, seed=0)
    for epoch in range(epochs):
        start, n = time.perf_counter(), 0
        for b in loader:
            n += len(b)
        if epoch:
            best[order] = max(best.get(order, 0), n / (time.perf_counter() - start))
print(json.dumps(best))
"""


def read(checkout: Path, dataset: str, epochs: int, batch: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    argv = [sys.executable, "-c", READ, str(dataset), str(epochs), str(batch), ",".join(ORDERS)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", help="a dataset folder, or an s3:// URL (read through its cache)")
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    if args.rounds < 1 or args.epochs < 2 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1, --epochs at least 2")
    sums = {"old": dict.fromkeys(ORDERS, 0.0), "new": dict.fromkeys(ORDERS, 0.0)}
    print(f"samples/s, best epoch after the first; {args.dataset}, batch {args.batch}")
    for k in range(args.rounds):
        for side in ("old", "new"):
            got = read(getattr(args, side), args.dataset, args.epochs, args.batch)
            sums[side] = {o: sums[side][o] + got[o] for o in ORDERS}
            print(f"round {k + 1} {side}: " + "  ".join(f"{o} {got[o]:>9,.0f}" for o in ORDERS))
    print("new / old: " + "  ".join(f"{o} {sums['new'][o] / sums['old'][o]:.3f}" for o in ORDERS))


if __name__ == "__main__":
    main()
