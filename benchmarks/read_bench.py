"""Read throughput of the dsc loader against its limits and the usual alternatives, in one run.

    python benchmarks/read_bench.py CORPUS [--out DIR] [--copies 8] [--batch 256] [--repeat 3]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`, built from this clone).
Unless DIR already holds a dataset, the corpus is repeated `--copies` times through a folder of
symlinks and compiled at 224×224 into DIR (≥ 2 GiB with the 2000-image corpus and 8 copies).
Every shard is then read once (page cache warm); each row reads one epoch, batch 256, on as many
threads as cores; the fast rows run round-robin `--repeat` times and the best is kept:

  limit     plain copies from the same maps into one preallocated buffer: contiguous slices, and a
            random gather (np.take per shard, sorted batch), on one thread and on all threads; and the
            contiguous copy into 4 buffers used in turn, as many as the loader has in flight at
            prefetch=2 (on a machine whose L3 holds a whole batch, one buffer stays cache-hot)
  dsc       ds.loader(order=...) for sequential, block, random (batches dropped as they come); and one
            loader reading 10 sequential epochs back to back (with --copies 1, the many-small-epochs case);
            sequential and random again over a twin of the dataset (the same shard files, hard-linked) with
            three per-record fields of format 1.1 (multi-hot [20], float32 [4], int64), which every batch
            carries
  (b)       torch DataLoader over a per-item memmap dataset (`__getitem__` only), 0 and N workers;
            and DataLoader over MemmapDataset itself (its `__getitems__`)
  (c)       the tensordict approach: a TensorDict of MemoryMappedTensors (shard 0) through a DataLoader
  (d)       DataLoader + ImageFolder-style Pillow open/convert/resize per item, N workers (a slice of an epoch)

Samples/s and GB/s per row, then ratios against the targets of issue 3, and the peak growth of this
process's RssAnon / RssFile during each row over their values at the row's start (sampled every 5 ms;
DataLoader workers are other processes and are not counted; the page cache was warmed first).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import dsc
from dsc import format as fmt
from dsc.compiler import output
from dsc.reader import MemmapDataset
from dsc.reader.gather import split

CORES = len(os.sched_getaffinity(0))
EPOCHS = 10  # epochs read back to back by one loader: on a small dataset (--copies 1) their edges weigh


def rss_mb() -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["RssAnon"].split()[0]) / 1024, int(fields["RssFile"].split()[0]) / 1024


@contextmanager
def peak_rss(out: dict):
    """Peak growth of RssAnon / RssFile over their values when the block starts (sampled every 5 ms)."""
    stop = threading.Event()
    start = rss_mb()
    peaks = [0.0, 0.0]

    def sample() -> None:
        while not stop.wait(0.005):
            anon, file = rss_mb()
            peaks[0], peaks[1] = max(peaks[0], anon - start[0]), max(peaks[1], file - start[1])
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        out["anon"], out["file"] = peaks


def build(corpus: Path, out: Path, copies: int) -> MemmapDataset:
    """Compile `copies` repetitions of the corpus (via symlinks) unless `out` is already a dataset."""
    if not (out / "manifest.json").exists():
        with tempfile.TemporaryDirectory() as tmp:
            files = sorted(p for p in corpus.rglob("*") if p.is_file())
            for f in files:
                folder = Path(tmp) / f.parent.relative_to(corpus)
                folder.mkdir(parents=True, exist_ok=True)
                for k in range(copies):
                    (folder / f"r{k}_{f.name}").symlink_to(f.resolve())
            dsc.compile_folder(tmp, out, size=224, workers=CORES, seed=0)
    return MemmapDataset(out)


def with_fields(ds: MemmapDataset, out: Path) -> MemmapDataset:
    """A twin of `ds` sharing its files (hard links) plus three fields: what labels from a table add."""
    if out.exists():
        shutil.rmtree(out)
    (out / fmt.SHARD_DIR).mkdir(parents=True)
    m = ds.manifest
    for entry in m.files:
        os.link(ds.path / entry.file, out / entry.file)
    rng = np.random.default_rng(0)
    fields = output.write_fields(out, [
        (fmt.FieldEntry("", 0, "", "tags", "multilabel", (20,), tuple(f"t{k}" for k in range(20))),
         rng.integers(0, 2, (m.count, 20))),
        (fmt.FieldEntry("", 0, "", "box", "float", (4,)), rng.random((m.count, 4))),
        (fmt.FieldEntry("", 0, "", "year", "int", ()), rng.integers(1990, 2025, m.count))])
    (one,) = m.index_segments  # a compile's one index, and the fields added to it: one segment again (format 1.5)
    output.write_manifest(out, dataclasses.replace(m, fields=fields, version=fmt.FORMAT_VERSION, segments=(),
                                                   index=one.index, checksums=one.checksums, warnings=one.warnings))
    return MemmapDataset(out)


def warm(ds: MemmapDataset) -> None:
    for path in ds.opened.shard_paths():
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


# ----------------------------------------------------------------------------- the rows

def limit_contiguous(ds: MemmapDataset, batch: int, threads: int, buffers: int = 1) -> Callable[[], int]:
    """Contiguous batch copies into `buffers` preallocated buffers used in turn (1: the issue's limit)."""
    shards = ds.opened.shards
    bufs = [np.zeros((batch, *ds.record_shape), np.uint8) for _ in range(buffers)]
    pool = ThreadPoolExecutor(threads)

    def epoch() -> int:
        n = 0
        for shard in shards:
            for lo in range(0, len(shard), batch):
                src, buf = shard[lo:lo + batch], bufs[(n // batch) % buffers]
                list(pool.map(lambda r, src=src, buf=buf: np.copyto(buf[r[0]:r[1]], src[r[0]:r[1]]),
                              split(len(src), threads)))
                n += len(src)
        return n
    return epoch


def limit_gather(ds: MemmapDataset, batch: int, threads: int) -> Callable[[], int]:
    shards, per_shard = ds.opened.shards, ds.manifest.records_per_shard
    buf = np.empty((batch, *ds.record_shape), np.uint8)
    buf.fill(0)
    pool = ThreadPoolExecutor(threads)
    perm = np.random.default_rng(0).permutation(len(ds))

    def take(idx: np.ndarray, dst: np.ndarray) -> None:
        shard, local = fmt.locate(idx, per_shard)
        edges = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(idx)]
        for a, b in zip(edges[:-1], edges[1:]):
            np.take(shards[shard[a]], local[a:b], axis=0, out=dst[a:b], mode="clip")

    def epoch() -> int:
        for lo in range(0, len(perm), batch):
            idx = np.sort(perm[lo:lo + batch])
            list(pool.map(lambda r, idx=idx: take(idx[r[0]:r[1]], buf[r[0]:r[1]]), split(len(idx), threads)))
        return len(perm)
    return epoch


def drain(batches: Iterable, count: Callable = len, max_batches: int | None = None) -> int:
    n = 0
    for k, b in enumerate(batches):
        n += count(b)
        del b
        if max_batches is not None and k + 1 >= max_batches:
            break
    return n


class PerItem(Dataset):
    """What people write by hand: one record per `__getitem__` from a memmap, collated by torch."""

    def __init__(self, path: Path) -> None:
        self.path, self.ds = path, None

    def __len__(self) -> int:
        return len(MemmapDataset(self.path)) if self.ds is None else len(self.ds)

    def __getitem__(self, i: int):
        if self.ds is None:
            self.ds = MemmapDataset(self.path)
        return self.ds[i].image, self.ds[i].label


class PillowFolder(Dataset):
    """ImageFolder-style: decode and resize every file on every epoch."""

    def __init__(self, files: list[Path], classes: dict[str, int]) -> None:
        self.files, self.classes = files, classes

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        img = Image.open(self.files[i]).convert("RGB").resize((224, 224), Image.BILINEAR)
        return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1), self.classes[self.files[i].parent.name]


def rows(ds: MemmapDataset, corpus: Path, batch: int, twin: MemmapDataset) -> dict[str, Callable[[], int]]:
    shuffle = dict(shuffle=True, generator=torch.Generator().manual_seed(0))
    td0 = ds.as_tensordict()["shards", "0"]  # shard 0's TensorDict {image, label}, batch size [n]
    files = sorted(p for p in corpus.rglob("*") if p.is_file())
    files = [files[i] for i in np.random.default_rng(0).permutation(len(files))[:batch * 4]]
    folder = PillowFolder(files, {c: i for i, c in enumerate(sorted({f.parent.name for f in files}))})
    table = {
        "limit: contiguous copy, 1 thread": limit_contiguous(ds, batch, 1),
        f"limit: contiguous copy, {CORES} threads": limit_contiguous(ds, batch, CORES),
        f"limit: contiguous, {CORES} thr, 4 buffers in turn": limit_contiguous(ds, batch, CORES, 4),
        "limit: random gather, 1 thread": limit_gather(ds, batch, 1),
        f"limit: random gather, {CORES} threads": limit_gather(ds, batch, CORES),
    }
    for order in ("sequential", "block", "random"):
        loader = ds.loader(batch, order=order, num_threads=CORES)
        table[f"dsc loader, {order}"] = lambda loader=loader: drain(loader)
        fielded = twin.loader(batch, order=order, num_threads=CORES)
        if order != "block":
            table[f"dsc loader, {order}, + 3 fields"] = lambda loader=fielded: drain(loader)
    many = ds.loader(batch, order="sequential", num_threads=CORES)  # epochs back to back: their edges count
    table[f"dsc loader, sequential, {EPOCHS} epochs"] = lambda: sum(drain(many) for _ in range(EPOCHS))
    for w in (0, CORES):
        table[f"(b) DataLoader per-item, {w} workers"] = lambda w=w: drain(
            DataLoader(PerItem(ds.path), batch_size=batch, num_workers=w, **shuffle), lambda b: len(b[1]))
    table[f"(b') DataLoader + __getitems__, {CORES} workers"] = lambda: drain(
        DataLoader(ds, batch_size=batch, num_workers=CORES, **shuffle), lambda b: len(b[1]))
    table["(c) tensordict memmap + DataLoader"] = lambda: drain(
        DataLoader(td0, batch_size=batch, collate_fn=lambda x: x, **shuffle))
    table[f"(d) DataLoader + Pillow decode, {CORES} workers"] = lambda: drain(
        DataLoader(folder, batch_size=batch, num_workers=CORES), lambda b: len(b[1]))
    return table


def measure(table: dict[str, Callable[[], int]], repeat: int, record_bytes: int) -> dict[str, dict]:
    """Fast rows round-robin `repeat` times (best kept: load from elsewhere only slows a run); slow rows once."""
    speeds: dict[str, list[float]] = {name: [] for name in table}
    peaks: dict[str, dict] = {name: {"anon": 0.0, "file": 0.0} for name in table}
    for rep in range(repeat):
        for name, fn in table.items():
            if rep and name.startswith("("):
                continue
            stats: dict = {}
            with peak_rss(stats):
                start = time.perf_counter()
                n = fn()
                speeds[name].append(n / (time.perf_counter() - start))
            peaks[name] = {k: max(v, stats[k]) for k, v in peaks[name].items()}
            print(f"  [{rep + 1}/{repeat}] {name}: {speeds[name][-1]:,.0f} samples/s", flush=True)
    results = {}
    for name, values in speeds.items():
        best = max(values)
        results[name] = {"sps": best, "gbs": best * record_bytes / 1e9,
                         "spread": statistics.pstdev(values) / best, **peaks[name]}
    return results


def report(results: dict[str, dict]) -> None:
    print(f"\n{'row':<44}{'samples/s':>11}{'GB/s':>7}{'spread':>7}{'+RssAnon MB':>12}{'+RssFile MB':>12}")
    for name, r in results.items():
        print(f"{name:<44}{r['sps']:>11,.0f}{r['gbs']:>7.2f}{r['spread']:>7.0%}{r['anon']:>12,.0f}{r['file']:>12,.0f}")
    s = {k: v["sps"] for k, v in results.items()}
    contiguous, gather = s[f"limit: contiguous copy, {CORES} threads"], s[f"limit: random gather, {CORES} threads"]
    best = max(s[f"dsc loader, {o}"] for o in ("sequential", "block", "random"))
    slowest = min(s[f"dsc loader, {o}"] for o in ("sequential", "block", "random"))
    per_item = max(v for k, v in s.items() if k.startswith("(b)"))
    checks = [
        ("sequential / contiguous limit", s["dsc loader, sequential"] / contiguous, 0.9),
        ("block / contiguous limit", s["dsc loader, block"] / contiguous, 0.9),
        ("sequential / contiguous limit, 4 buffers in turn",
         s["dsc loader, sequential"] / s[f"limit: contiguous, {CORES} thr, 4 buffers in turn"], 0.9),
        (f"sequential, {EPOCHS} epochs in a row / 4 buffers in turn",
         s[f"dsc loader, sequential, {EPOCHS} epochs"] / s[f"limit: contiguous, {CORES} thr, 4 buffers in turn"], 0.9),
        ("random / gather limit", s["dsc loader, random"] / gather, 0.8),
        ("sequential + 3 fields / sequential", s["dsc loader, sequential, + 3 fields"] / s["dsc loader, sequential"],
         0.9),
        ("random + 3 fields / random", s["dsc loader, random, + 3 fields"] / s["dsc loader, random"], 0.9),
        ("slowest dsc order / best per-item DataLoader (b)", slowest / per_item, 5),
        ("slowest dsc order / tensordict (c)", slowest / s["(c) tensordict memmap + DataLoader"], 8),
        ("slowest dsc order / Pillow ImageFolder (d)", slowest / s[f"(d) DataLoader + Pillow decode, {CORES} workers"],
         100),
    ]
    print(f"\n{'ratio':<52}{'value':>8}{'target':>8}")
    for name, value, target in checks:
        print(f"{name:<52}{value:>8.2f}{'≥' + format(target, 'g'):>8}  {'ok' if value >= target else 'MISSED'}")
    print(f"best dsc order: {best:,.0f} samples/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "dsc_read_bench")
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", default="", help="run only rows whose name contains this text")
    args = parser.parse_args()
    ds = build(args.corpus, args.out, args.copies)
    size = sum(p.stat().st_size for p in ds.opened.shard_paths())
    print(f"dataset {args.out}: {len(ds)} records of {ds.record_shape}, {len(ds.opened.shards)} shards, "
          f"{size / 2**30:.2f} GiB; {CORES} cores; batch {args.batch}; best of {args.repeat}")
    twin = with_fields(ds, args.out.with_name(args.out.name + "_fields"))
    warm(ds)
    anon, file = rss_mb()
    print(f"this process before the rows: RssAnon {anon:,.0f} MB, RssFile {file:,.0f} MB")
    table = {k: v for k, v in rows(ds, args.corpus, args.batch, twin).items() if args.only in k}
    results = measure(table, args.repeat, int(np.prod(ds.record_shape)))
    if not args.only:
        report(results)


if __name__ == "__main__":
    main()
