"""`dsc append` of a share of new images against a full recompile of all of them, side by side.

    python benchmarks/append_bench.py CORPUS [--size 224] [--new 0.05 0.1 0.2] [--limit N] [--workers N]
                                     [--onto 2000 20000 200000 --add 100]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`). For each share of new
images (`--new`), its images are split evenly across classes into an old set and a new one; the old set
is compiled (untimed), then `dsc append` of the new set is timed end to end (decode of the new images
only, a copy of the old last shard when partial, the index written again, the commit). Then a compile of
every image (what growing a dataset cost before: a full recompile) is timed once. The target is time ∝
the new images: each append's time over the recompile's near its share, growing with it; what stays
is a fixed cost (the worker processes' start-up, which the recompile pays too). Page cache warmed first.

`--onto N ...` then times what an append costs as the dataset grows: `--add` images of CORPUS appended onto
datasets of N records each, built with the format's own writer (`open_scale.build`: real index files, sparse
shards, nothing decoded; the compile options those of a real compile of a few CORPUS images, so the append
makes its records the same way). Format 1.5 writes only the new records' index segment: the time should
stay flat as N grows (1.4 wrote the whole index again: it grew with N). Run it under another dsc
(`PYTHONPATH=<checkout>`) to compare.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from compile_bench import link_tree, pick_sources
from open_scale import build

from dsc import __version__, storage
from dsc.compiler.append import append
from dsc.compiler.pipeline import compile_folder


def warmed(corpus: Path, limit: int | None) -> list[str]:
    """`compile_bench.pick_sources`, each file read once so that every compile starts from a warm page cache."""
    sources = pick_sources(corpus, limit)
    for s in sources:
        (corpus / s).read_bytes()
    return sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--new", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="shares of new images")
    parser.add_argument("--limit", type=int, default=None, help="use at most this many images")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--records-per-shard", type=int, default=None)
    parser.add_argument("--onto", type=int, nargs="*", default=[], help="record counts of datasets to append onto")
    parser.add_argument("--add", type=int, default=100, help="images appended onto each --onto dataset")
    parser.add_argument("--skip-shares", action="store_true", help="only the --onto series")
    args = parser.parse_args()
    if args.skip_shares:
        args.new = []
    args.corpus = args.corpus.absolute()  # the links made to its files must hold from anywhere
    sources = warmed(args.corpus, args.limit)
    options = {"size": args.size, "workers": args.workers, "records_per_shard": args.records_per_shard}
    rows = []
    with tempfile.TemporaryDirectory(prefix="dsc-append-bench-") as tmp:
        tmp = Path(tmp)
        for share in args.new:
            every = max(1, round(1 / share))
            new = [s for k, s in enumerate(sources) if k % every == every - 1]
            old = [s for k, s in enumerate(sources) if k % every != every - 1]
            work = tmp / f"share-{share}"
            compile_folder(link_tree(args.corpus, old, work / "old"), work / "grown", **options)
            started = time.perf_counter()
            summary = append(work / "grown", link_tree(args.corpus, new, work / "new"), workers=args.workers)
            rows.append((summary, time.perf_counter() - started))
            shutil.rmtree(work)
        if rows or not args.onto:
            started = time.perf_counter()
            full = compile_folder(link_tree(args.corpus, sources, tmp / "all"), tmp / "full", **options)
            full_s = time.perf_counter() - started
        grown = onto(args, sources, tmp, options)
    if rows or not args.onto:
        print_shares(args, sources, rows, full, full_s)
    if grown:
        print(f"dsc {__version__}: {args.add} images appended onto a dataset of N records (format of the result)")
        print(f"{'N':>12} {'append s':>9} {'format':>7}")
        for count, seconds, version in grown:
            print(f"{count:>12,} {seconds:>9.2f} {version:>7}")


def onto(args, sources: list[str], tmp: Path, options: dict) -> list[tuple[int, float, str]]:
    """`--onto`: the time of one append of `--add` images onto a built dataset of each size."""
    if not args.onto:
        return []
    add = sources[:args.add]
    few = tmp / "few"  # a folder of its own: no sibling dataset whose classes it would be compared with
    compile_folder(link_tree(args.corpus, sources[-10:], few / "src"), few / "ds", **options)
    compile_options = storage.parse_manifest(few / "ds").compile
    results = []
    for count in args.onto:
        base = tmp / f"onto-{count}"
        build(base, count, args.size, args.records_per_shard or 1000, compile_options=compile_options)
        new = link_tree(args.corpus, add, tmp / f"add-{count}")
        started = time.perf_counter()
        append(base, new, workers=args.workers, new_classes=True)
        results.append((count, time.perf_counter() - started, storage.parse_manifest(base).version))
        shutil.rmtree(base)
    return results


def print_shares(args, sources, rows, full, full_s) -> None:
    print(f"{len(sources)} images at {args.size}x{args.size}; full recompile: {full_s:.2f} s "
          f"({full.kept / full_s:.0f} images/s)")
    print(f"{'new images':>10} {'share':>6} {'append s':>9} {'append / recompile':>19}  new version's shard files")
    for summary, seconds in rows:
        print(f"{summary.added:>10} {summary.added / full.kept:>6.2f} {seconds:>9.2f} {seconds / full_s:>19.2f}  "
              f"{', '.join(summary.shard_files)}")
    if len(rows) > 1:
        (a, ta), (b, tb) = rows[0], rows[-1]
        per_image = (tb - ta) / max(b.added - a.added, 1)
        print(f"marginal cost of a new image: {per_image * 1000:.1f} ms (append) vs {full_s / full.kept * 1000:.1f} ms "
              f"per image of a recompile; fixed cost ~{ta - per_image * a.added:.2f} s")


if __name__ == "__main__":
    main()
