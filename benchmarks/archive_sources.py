"""Compile from archives against compiling the unpacked folder: the same images, one run each, side by side.

    python benchmarks/archive_sources.py CORPUS [--size 224] [--limit N] [--workers N] [--out-dir DIR]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`). Its images (evenly
thinned to --limit) are copied into a folder and written, by the tools users have, as WebDataset tar
shards (webdataset's ShardWriter, 1,000 samples a shard), one Parquet file (Hugging Face `datasets`,
an Image and a ClassLabel column, 100 rows a row group as the Hub writes image datasets) and a zip
(Python's zipfile, deflated). After reading every file once (page cache warm), each is compiled with
`dsc.compile_folder` end to end, the folder first and last (its two runs show the noise), and the
images/s of each archive is printed as a ratio to the folder's mean (target: at least 0.95).
Needs the test extra (webdataset, datasets, pyarrow).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
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


def compile_rate(src: str | Path, out: Path, size: int, workers: int, **options) -> tuple[int, float]:
    """(records, images/s) of one end-to-end compile; its output removed."""
    import dsc

    summary = dsc.compile_folder(src, out, size=size, workers=workers, on_skip=lambda s, r: None, **options)
    shutil.rmtree(out)
    return summary.kept, summary.images_per_second


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path, help="ImageFolder tree of images")
    ap.add_argument("--size", type=int, default=224, help="target side (square records)")
    ap.add_argument("--limit", type=int, help="use only N images, spread evenly over the classes")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="compile workers [all cores]")
    ap.add_argument("--out-dir", type=Path, help="where the copies and outputs go (default: a temp dir)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dsc-archives-", dir=args.out_dir))
    try:
        folder = work / "folder"
        n = copy_subset(args.corpus.absolute(), args.limit, folder)
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        sources = {"tar shards (webdataset)": write_tar_shards(folder, work / "shards", SAMPLES_PER_SHARD),
                   "Parquet (datasets)": write_parquet(folder, work / "train.parquet", ROWS_PER_GROUP),
                   "zip (zipfile, deflated)": write_zip(folder, work / "images.zip")}
        nbytes = sum(len(p.read_bytes()) for p in work.rglob("*") if p.is_file())  # warm the page cache
        print(f"{n} images of {args.corpus} in {len(classes)} classes; {nbytes / 1e6:.0f} MB of folder and archives "
              f"(page cache warm); size {args.size}; {args.workers} workers; load average {os.getloadavg()[0]:.2f}")
        first = compile_rate(folder, work / "out", args.size, args.workers)
        rates = {name: compile_rate(src, work / "out", args.size, args.workers,
                                    **({"classes": classes} if "tar" in name else {}))
                 for name, src in sources.items()}
        last = compile_rate(folder, work / "out", args.size, args.workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    folder_rate = (first[1] + last[1]) / 2
    print(f"\n{'source':<28} {'records':>8} {'images/s':>9} {'/ folder':>9}")
    print(f"{'folder (first, last run)':<28} {first[0]:>8} {first[1]:>4.0f}, {last[1]:<4.0f} {1.0:>8.2f}x")
    for name, (kept, rate) in rates.items():
        print(f"{name:<28} {kept:>8} {rate:>9.0f} {rate / folder_rate:>8.2f}x  (target >= 0.95)")
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes on the machine skew the figures)")


if __name__ == "__main__":
    main()
