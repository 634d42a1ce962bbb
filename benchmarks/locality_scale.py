"""Seconds to the first batch under locality="shard" at a huge world size, fresh and resumed, on the loader's
own path: the check of a loaded state (`progress.check_rounds`), the warning's count (`progress.cut_off`), the
plan of the pass (`progress.Planner`: the rank's share, `order.LazyShare` or an array) and the first batch's
indices (`order.batch_indices`). Each case in a fresh interpreter (no cache of another case helps it), for
the last rank (its share wraps to pad).

    python benchmarks/locality_scale.py --records 16777216 --world-size 65536 1048576

Cases, per world size W (shards of --records-per-shard records; batch 8, so that a rank of 2^20 has batches),
by their --cases key:

  fresh  fresh        the first epoch: no state
  same   same split   a state saved after 1 batch per rank, loaded on the same split: that round goes on
  batch  batch 4      the same state loaded on W ranks with batch 4: the first round is replayed
  half   W/2 ranks    ... on W/2 ranks
  eight  8 ranks      ... on 8 ranks (a rank's share spans many groups: its chunk stops after
                      `ShardRest.SEGMENTS` of them)

with drop_last False and True. With --baseline CHECKOUT, each case runs on that checkout's dsc too, right
after this one's (alternating, so both see the same load), and the ratio is printed: before issue 27's last
round, replaying a first round under locality built every rank's share (one block order per group: a
Python loop over the world size) and a queue of the epoch, and the deal of the shards was a heap's loop.

    python benchmarks/locality_scale.py --baseline /path/to/older/checkout --timeout 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASE = """
import json, resource, sys, time
from dsc.reader import order as orders, progress
n, per_shard, world, live_world, live_batch, drop_last, saved = (int(a) for a in sys.argv[1:])
batch, seed, epoch = 8, 3, 1
started, cpu = time.perf_counter(), time.process_time()
spec = progress.Epoch(n, "block", seed, epoch, per_shard)
first = progress.Split(world, batch, bool(drop_last), "shard")
live = progress.Split(live_world, live_batch, bool(drop_last), "shard" if live_world == world else None)
rounds = [progress.Round(first, 1)] if saved else []
if rounds:
    progress.check_rounds(spec, rounds)
    if rounds != [progress.Round(live, 1)]:  # what load_state_dict counts for its warning
        progress.cut_off(spec, rounds, live, 1)
done, start = progress.resume_point(rounds, live)
planner = progress.Planner(n, "block", seed, per_shard, live_world - 1)
if done:
    plan, share = planner.plan(epoch, done, live, start)
else:
    plan, share = planner.plan(epoch, [], live, start)
indices = orders.batch_indices(share, plan.start, live_batch, "block", seed, epoch, per_shard)
print(json.dumps({"seconds": time.perf_counter() - started, "cpu": time.process_time() - cpu, "share": len(share),
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


HERE = Path(__file__).resolve().parents[1]  # this checkout: its dsc is measured
CASES = {  # --cases key: (name, world -> (live world size, live batch size, a state saved after 1 batch))
    "fresh": ("fresh", lambda w: (w, 8, False)),
    "same": ("same split", lambda w: (w, 8, True)),
    "batch": ("batch 4", lambda w: (w, 4, True)),
    "half": ("W/2 ranks", lambda w: (max(1, w // 2), 8, True)),
    "eight": ("8 ranks", lambda w: (8, 8, True)),
}


def measure(checkout: Path, records: int, per_shard: int, world: int, live_world: int, live_batch: int,
            drop_last: bool, saved: bool, timeout: float) -> dict:
    """One case in a fresh interpreter importing `checkout`'s dsc (run outside any checkout: `-c` puts the
    working folder first on the path)."""
    args = [records, per_shard, world, live_world, live_batch, int(drop_last), int(saved)]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    try:
        with tempfile.TemporaryDirectory() as elsewhere:
            run = subprocess.run([sys.executable, "-c", CASE, *map(str, args)], capture_output=True, text=True,
                                 check=True, timeout=timeout, env=env, cwd=elsewhere)
    except subprocess.TimeoutExpired:
        return {"seconds": float("inf"), "cpu": float("inf"), "share": -1, "rss_mb": float("nan")}
    return json.loads(run.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1 << 24)
    parser.add_argument("--records-per-shard", type=int, default=1024)
    parser.add_argument("--world-size", type=int, nargs="+", default=[1 << 16, 1 << 20])
    parser.add_argument("--baseline", type=Path, help="another dsc checkout to run each case on too")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which cases to run")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may take (shown as inf)")
    args = parser.parse_args()
    print(f"{args.records} records in shards of {args.records_per_shard}, batch 8: seconds to the last rank's "
          "first batch (wall, and CPU time of the process: the wall's share of a loaded machine's waits left out) "
          "and peak RSS, each case in a fresh interpreter" + (f"; baseline {args.baseline}" if args.baseline else ""))
    print(f"{'world':>8} {'drop_last':>9} {'case':<12}{'seconds':>9}{'cpu s':>8}{'rss MB':>8}{'share':>10}"
          + (f"{'baseline s':>12}{'cpu s':>8}{'rss MB':>8}{'ratio':>8}" if args.baseline else ""))
    for world in args.world_size:
        for drop_last in (False, True):
            for key in args.cases:
                name, (live_world, live_batch, saved) = CASES[key][0], CASES[key][1](world)
                case = (args.records, args.records_per_shard, world, live_world, live_batch, drop_last, saved,
                        args.timeout)
                m = measure(HERE, *case)
                line = (f"{world:>8} {str(drop_last):>9} {name:<12}{m['seconds']:>9.3f}{m['cpu']:>8.3f}"
                        f"{m['rss_mb']:>8.0f}{m['share']:>10}")
                if args.baseline:
                    b = measure(args.baseline, *case)
                    line += (f"{b['seconds']:>12.3f}{b['cpu']:>8.3f}{b['rss_mb']:>8.0f}"
                             f"{b['cpu'] / m['cpu']:>8.1f}")
                print(line, flush=True)


if __name__ == "__main__":
    main()
