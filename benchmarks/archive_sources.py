"""Compile from archives against compiling the unpacked folder: the same images, one run each, side by side.

    python benchmarks/archive_sources.py CORPUS [--size 224] [--limit N] [--workers N] [--repeat R] [--out-dir DIR]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`). Its images (evenly
thinned to --limit) are copied into a folder and written, by the tools users have, as WebDataset tar
shards (webdataset's ShardWriter, 1,000 samples a shard), one Parquet file (Hugging Face `datasets`,
an Image and a ClassLabel column, 100 rows a row group as the Hub writes image datasets) and two zips
(Python's zipfile, deflated and stored: inflating is the one cost a folder does not have). After
reading every file once (page cache warm), each is compiled with `dsc.compile_folder` end to end, in
turn: the folder, tar, Parquet, the zips, R times over (each source's best run is kept; the folder's
runs are all printed, to show the noise), and the images/s of each archive is printed as a ratio to
the folder's (target: at least 0.95), with images per CPU-second of the compile's processes
(steadier when other work shares the machine).
Needs the test extra (webdataset, datasets, pyarrow).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the archive writers the tests use
from archives import write_parquet, write_tar_shards, write_zip  # noqa: E402

SAMPLES_PER_SHARD = 1000
ROWS_PER_GROUP = 100  # datasets' row group size for image datasets


def copy_subset(corpus: Path, limit: int | None, dest: Path) -> int:
    """Copy the corpus (or `limit` of its images, every class kept) into `dest`; the count copied."""
    from dsc.compiler.discover import discover

    sources = discover(corpus).sources
    if limit and limit < len(sources):
        sources = [sources[i] for i in np.linspace(0, len(sources) - 1, limit).round().astype(int)]
    for s in sources:
        (dest / s).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(corpus / s, dest / s)
    return len(sources)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the compile's host and workers, reaped)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def compile_rate(src: str | Path, out: Path, size: int, workers: int, **options) -> tuple[int, float, float]:
    """(records, images/s, images per CPU-second) of one end-to-end compile; its output removed. The CPU
    figure moves less than the wall clock's when other work shares the machine."""
    import dsc

    cpu = cpu_seconds()
    summary = dsc.compile_folder(src, out, size=size, workers=workers, on_skip=lambda s, r: None, **options)
    cpu = cpu_seconds() - cpu
    shutil.rmtree(out)
    return summary.kept, summary.images_per_second, summary.kept / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path, help="ImageFolder tree of images")
    ap.add_argument("--size", type=int, default=224, help="target side (square records)")
    ap.add_argument("--limit", type=int, help="use only N images, spread evenly over the classes")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compile workers [all cores]")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole sequence R times, keep each best")
    ap.add_argument("--out-dir", type=Path, help="where the copies and outputs go (default: a temp dir)")
    args = ap.parse_args()
    runs: list[float] = []  # the folder's, in order
    work = Path(tempfile.mkdtemp(prefix="dsc-archives-", dir=args.out_dir))
    try:
        folder = work / "folder"
        n = copy_subset(args.corpus.absolute(), args.limit, folder)
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        sources = {"tar shards (webdataset)": write_tar_shards(folder, work / "shards", SAMPLES_PER_SHARD),
                   "Parquet (datasets)": write_parquet(folder, work / "train.parquet", ROWS_PER_GROUP),
                   "zip (zipfile, deflated)": write_zip(folder, work / "images.zip"),
                   "zip (zipfile, stored)": write_zip(folder, work / "stored.zip", method=zipfile.ZIP_STORED)}
        nbytes = sum(len(p.read_bytes()) for p in work.rglob("*") if p.is_file())  # warm the page cache
        print(f"{n} images of {args.corpus} in {len(classes)} classes; {nbytes / 1e6:.0f} MB of folder and archives "
              f"(page cache warm); size {args.size}; {args.workers} workers; load average {os.getloadavg()[0]:.2f}")
        import dsc.compiler.pipeline  # noqa: F401  (this process's imports are no compile's CPU time)

        best: dict[str, tuple[int, float, float]] = {}
        for _ in range(args.repeat):
            for name, src in [("folder", folder), *sources.items()]:
                result = compile_rate(src, work / "out", args.size, args.workers,
                                      **({"classes": classes} if "tar" in name else {}))
                if name == "folder":
                    runs.append(result[1])
                best[name] = max(best.get(name, result), result, key=lambda r: r[1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _, folder_rate, folder_cpu = best["folder"]
    print(f"\n{'source':<28} {'records':>8} {'images/s':>9} {'/ folder':>9} {'img/CPU-s':>10} {'/ folder':>9}")
    for name, (kept, rate, per_cpu) in best.items():
        print(f"{name:<28} {kept:>8} {rate:>9.0f} {rate / folder_rate:>8.2f}x {per_cpu:>10.0f} "
              f"{per_cpu / folder_cpu:>8.2f}x")
    print(f"(best of {args.repeat} run(s) each, by images/s; the folder's runs: {', '.join(f'{r:.0f}' for r in runs)}; "
          "target: each archive >= 0.95x the folder)")
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes on the machine skew the figures)")


if __name__ == "__main__":
    main()
