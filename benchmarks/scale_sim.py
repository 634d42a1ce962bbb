"""N training ranks on one machine: what each rank reads per epoch, how mixed its batches are, how fast.

    python benchmarks/scale_sim.py [DATASET] [--corpus DIR] [--ranks 2 4 8] [--ranks-per-node 2]
                                   [--batch 64] [--epochs 3] [--repeat 3]

DATASET (default /tmp/scale_ds) is compiled from CORPUS (any ImageFolder tree, e.g.
`python benchmarks/corpus.py /tmp/corpus`) at 224×224 with 125 records per shard unless it
already exists. The page cache is warmed, then for each N and each order (sequential, block,
random, block + locality="shard") N threads each iterate `ds.loader(rank=r, world_size=N)` for
`--epochs` epochs at the same time (one copy thread each), `--repeat` times (the fastest run is
kept); the served `index` entries say what every rank read. Columns:

  shards/rank    distinct shard files a rank touches in one epoch (mean over ranks and epochs)
  files/rank     the bytes of those shard files: what a node must cache or stage per rank per epoch
  pages/rank     the 4 KiB pages of the records it actually served (kernel readahead not counted)
  node files     the shard files a node of `--ranks-per-node` consecutive ranks touches per epoch
  node pages     the pages that node reads per epoch
  kept           of those pages, the share the node already read the epoch before (its page cache
                 can serve them if it holds one epoch's node pages)
  classes, bits  distinct classes per batch and label entropy per batch (random order = reference)
  samples/s GB/s all ranks together, page cache warm, on this one machine (ranks compete for its cores)
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np

import dsc
from dsc.reader import MemmapDataset
from dsc.reader import order as orders
from dsc.storage import is_dataset

PAGE = 4096
CONFIGS = (("sequential", None), ("block", None), ("random", None), ("block", "shard"))


def warm(ds: MemmapDataset) -> None:
    """Touch every page of every shard once, so the timings read the page cache."""
    for shard in ds.opened.shards:
        int(shard.reshape(-1)[::PAGE].sum())


def run_ranks(ds: MemmapDataset, world: int, order: str, locality: str | None, batch: int,
              epochs: int) -> tuple[list[list[list[np.ndarray]]], float]:
    """([epoch][rank] → batches' indices], seconds): every rank's loader on its own thread, all at once."""
    served = [[[] for _ in range(world)] for _ in range(epochs)]
    errors: list[BaseException] = []
    start = threading.Barrier(world + 1)

    def rank(r: int) -> None:
        try:
            loader = ds.loader(batch, order=order, seed=0, locality=locality, rank=r, world_size=world, num_threads=1)
            start.wait()
            for e in range(epochs):
                loader.set_epoch(e)
                served[e][r] = [b["index"].numpy().copy() for b in loader]
        except BaseException as e:  # re-raised by the caller, with the rank
            errors.append(RuntimeError(f"rank {r}/{world} failed: {e!r}"))
            start.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return served, seconds


def pages(indices: np.ndarray, per_shard: int, record_bytes: int) -> np.ndarray:
    """Ids (shard << 40 | page) of the distinct 4 KiB pages of the shard files that records `indices` occupy."""
    shard, local = np.divmod(np.unique(indices), per_shard)
    first, last = local * record_bytes // PAGE, ((local + 1) * record_bytes - 1) // PAGE
    page = orders.expand_runs(first, last - first + 1)
    return np.unique(np.repeat(shard, last - first + 1) * (1 << 40) + page)


def files_bytes(shards: set[int], shard_bytes: np.ndarray) -> int:
    return int(shard_bytes[sorted(shards)].sum())


def measure(ds: MemmapDataset, served: list[list[list[np.ndarray]]], per_node: int) -> dict[str, float]:
    """The columns of one row except the timing (module docstring)."""
    m = ds.manifest
    shard_bytes = np.array([s.bytes for s in m.shards], dtype=np.int64)
    per_shard, world = m.records_per_shard, len(served[0])
    flat = [[np.concatenate(b) if b else np.zeros(0, np.int64) for b in ep] for ep in served]
    rank_files = [[set((f // per_shard).tolist()) for f in ep] for ep in flat]
    rank_pages = [[pages(f, per_shard, m.record_bytes) for f in ep] for ep in flat]
    node_files = [[set().union(*ep[k:k + per_node]) for k in range(0, world, per_node)] for ep in rank_files]
    node_pages = [[np.unique(np.concatenate(ep[k:k + per_node])) for k in range(0, world, per_node)]
                  for ep in rank_pages]
    kept = [len(np.intersect1d(now, before)) / len(now) for e in range(1, len(node_pages))
            for now, before in zip(node_pages[e], node_pages[e - 1]) if len(now)]
    classes, bits = orders.class_mix(ds.labels, [b for ep in served for r in ep for b in r])
    return {"shards": np.mean([len(s) for ep in rank_files for s in ep]),
            "files": np.mean([files_bytes(s, shard_bytes) for ep in rank_files for s in ep]),
            "pages": np.mean([len(p) * PAGE for ep in rank_pages for p in ep]),
            "node files": np.mean([files_bytes(s, shard_bytes) for ep in node_files for s in ep]),
            "node pages": np.mean([len(p) * PAGE for ep in node_pages for p in ep]),
            "kept": float(np.mean(kept)) if kept else float("nan"), "classes": classes, "bits": bits,
            "samples": sum(len(f) for ep in flat for f in ep)}


HEADER = (f"{'N':>2} {'order':<13} {'shards/rank':>11} {'files/rank':>10} {'pages/rank':>10} {'node files':>10} "
          f"{'node pages':>10} {'kept':>5} {'classes':>7} {'bits':>5} {'samples/s':>9} {'GB/s':>5}")


def row(world: int, name: str, r: dict[str, float], rate: float, record_bytes: int) -> str:
    mb = "".join(f" {r[k] / 1e6:>8.1f}MB" for k in ("files", "pages", "node files", "node pages"))
    kept = "n/a" if np.isnan(r["kept"]) else f"{r['kept']:.0%}"  # one epoch: no epoch before it to keep from
    return (f"{world:>2} {name:<13} {r['shards']:>11.1f}{mb} {kept:>5} {r['classes']:>7.2f} "
            f"{r['bits']:>5.2f} {rate:>9.0f} {rate * record_bytes / 1e9:>5.2f}")


def dataset(path: Path, corpus: Path | None) -> MemmapDataset:
    if not is_dataset(path):
        if corpus is None:
            raise SystemExit(f"error: {path} is not a dataset yet; give --corpus, an image folder to compile it from")
        dsc.compile_folder(corpus, path, size=224, records_per_shard=125)
    return MemmapDataset(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", nargs="?", type=Path, default=Path("/tmp/scale_ds"))
    parser.add_argument("--corpus", type=Path, help="ImageFolder tree to compile DATASET from, when it does not exist")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ds = dataset(args.dataset, args.corpus)
    m = ds.manifest
    total = sum(s.bytes for s in m.shards)
    print(f"{args.dataset}: {m.count} records of {m.height}x{m.width}x3 ({m.record_bytes / 1e3:.1f} kB), "
          f"{len(m.shards)} shards of {m.records_per_shard}, {total / 1e6:.1f} MB, {len(m.classes)} classes; "
          f"batch {args.batch}, {args.epochs} epochs, nodes of {args.ranks_per_node} ranks")
    warm(ds)
    print(HEADER)
    for world in args.ranks:
        for order, locality in CONFIGS:
            runs = [run_ranks(ds, world, order, locality, args.batch, args.epochs) for _ in range(args.repeat)]
            r = measure(ds, runs[0][0], args.ranks_per_node)
            rate = r["samples"] / min(seconds for _, seconds in runs)
            print(row(world, order + ("+shard" if locality else ""), r, rate, m.record_bytes))

if __name__ == "__main__":
    main()
