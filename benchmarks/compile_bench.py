"""Compile throughput of dsc against a naive Pillow baseline, on the same files, side by side.

    python benchmarks/compile_bench.py CORPUS [--size 224] [--limit N] [--out-dir DIR]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`, built from this clone).
Runs, after reading every file once to warm the page cache:
  dsc `compile_folder` with workers=1 (in-process) and workers=os.cpu_count() (worker processes),
  baseline Pillow `open → convert('RGB') → resize((S, S), BILINEAR)` (no draft/DCT scaling) in one process
  and in a Pool of one process per core, started like dsc's workers. Baseline pixels go into a numpy
  array that is then discarded.
dsc times are end to end (discover, workers' start-up, decode/resize, fsync, index, publish); the baseline
pool is timed with and without its start-up. Only module-level imports here are stdlib, numpy and Pillow,
so the baseline's workers do not pay for importing torch.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
from PIL import Image

CHUNK = 16  # files per task, the smallest chunk dsc's compiler uses


def pick_sources(corpus: Path, limit: int | None) -> list[str]:
    """The files dsc would compile (relative paths), evenly thinned to `limit` so every class stays in."""
    from dsc.compiler.discover import discover

    sources = discover(corpus).sources
    if limit and limit < len(sources):
        sources = [sources[i] for i in np.linspace(0, len(sources) - 1, limit).round().astype(int)]
    return sources


def link_tree(corpus: Path, sources: list[str], dest: Path) -> Path:
    """A folder of symlinks holding only `sources`, for compiling a subset of the corpus."""
    for s in sources:
        (dest / s).parent.mkdir(parents=True, exist_ok=True)
        (dest / s).symlink_to(corpus / s)
    return dest


def warm_cache(paths: list[str]) -> int:
    """Read every file once; return the bytes read."""
    return sum(len(Path(p).read_bytes()) for p in paths)


def baseline_one(path: str, size: int) -> np.ndarray:
    """The naive pipeline: full decode, convert to RGB, bilinear resize to size×size."""
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB").resize((size, size), Image.BILINEAR))


def baseline_chunk(task: tuple[list[str], int]) -> int:
    """Run the baseline on a list of files; pixels are discarded, only the count comes back."""
    paths, size = task
    for p in paths:
        baseline_one(p, size)
    return len(paths)


def _wait(barrier) -> None:
    barrier.wait()


def start_pool(n: int, init=_wait) -> tuple[Pool, float]:
    """A Pool of n processes started like dsc's workers, returned once all run `init`; and how long that took."""
    from dsc.compiler.engines.local import START_METHOD

    ctx = mp.get_context(START_METHOD)
    barrier = ctx.Barrier(n + 1)
    t0 = time.perf_counter()
    pool = ctx.Pool(n, init, (barrier,))
    barrier.wait()
    return pool, time.perf_counter() - t0


def run_baseline(paths: list[str], size: int, procs: int) -> tuple[float, float]:
    """(seconds including pool start-up, seconds without) for the baseline over `paths`."""
    tasks = [(paths[i:i + CHUNK], size) for i in range(0, len(paths), CHUNK)]
    if procs == 1:
        t0 = time.perf_counter()
        assert sum(map(baseline_chunk, tasks)) == len(paths)
        return (time.perf_counter() - t0,) * 2
    pool, startup = start_pool(procs)
    t0 = time.perf_counter()
    assert sum(pool.imap_unordered(baseline_chunk, tasks)) == len(paths)
    pool.close()
    pool.join()
    work = time.perf_counter() - t0
    return startup + work, work


def run_dsc(src: Path, out: Path, size: int, workers: int, fast_decode: bool = False) -> float:
    """Seconds for one end-to-end `dsc.compile_folder`, output deleted afterwards."""
    import dsc

    summary = dsc.compile_folder(src, out, size=size, fit="center-crop", workers=workers, force=True,
                                 fast_decode=fast_decode, on_skip=lambda source, reason: None)
    shutil.rmtree(out)
    return summary.seconds


def breakdown(paths: list[str], size: int) -> dict[str, float]:
    """Mean ms per image of each dsc stage, and of the baseline's decode and resize, on `paths` (one process)."""
    import torch

    from dsc.compiler.decode import decode, probe
    from dsc.compiler.resize import resize_into
    from dsc.compiler.target import Target, needed_size

    torch.set_num_threads(1)  # as in dsc's compile workers
    target, out, ms = Target(size, size), np.empty((size, size, 3), np.uint8), dict.fromkeys(
        ("read", "probe", "decode", "resize", "pil decode", "pil resize", "src MP", "decoded MP"), 0.0)
    for path in paths:
        t0 = time.perf_counter()
        data = Path(path).read_bytes()
        t1 = time.perf_counter()
        p = probe(data)
        t2 = time.perf_counter()
        rgb = decode(data, p, *needed_size(*p.oriented_size, target))  # the default (faithful) mode
        t3 = time.perf_counter()
        resize_into(rgb, target, out)
        t4 = time.perf_counter()
        with Image.open(path) as img:
            full = img.convert("RGB")
        t5 = time.perf_counter()
        np.asarray(full.resize((size, size), Image.BILINEAR))
        t6 = time.perf_counter()
        for key, dt in zip(ms, np.diff([t0, t1, t2, t3, t4, t5, t6])):
            ms[key] += 1e3 * dt
        ms["src MP"] += p.width * p.height / 1e6
        ms["decoded MP"] += rgb.shape[0] * rgb.shape[1] / 1e6
    return {k: v / len(paths) for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path, help="ImageFolder tree of images")
    ap.add_argument("--size", type=int, default=224, help="target side (square records)")
    ap.add_argument("--limit", type=int, help="use only N files, spread evenly over the classes")
    ap.add_argument("--out-dir", type=Path, help="where temporary outputs go (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=1, help="run each measurement R times, keep the fastest")
    args = ap.parse_args()
    import dsc
    from dsc.compiler.decode import decoder_name

    corpus, cores = args.corpus.absolute(), os.cpu_count() or 1
    sources = pick_sources(corpus, args.limit)
    paths = [str(corpus / s) for s in sources]
    work = Path(tempfile.mkdtemp(prefix="dsc-bench-", dir=args.out_dir))
    try:
        src = link_tree(corpus, sources, work / "src") if args.limit else corpus
        nbytes = warm_cache(paths)
        print(f"load average before: {os.getloadavg()[0]:.2f}; best of {args.repeat} run(s)")
        print(f"corpus {corpus}: {len(paths)} files, {nbytes / 1e6:.0f} MB (page cache warmed); size {args.size}; "
              f"{cores} cores; dsc {dsc.__version__}, JPEG decoder {decoder_name()}")
        bd = breakdown(paths[:: max(1, len(paths) // 200)], args.size)  # also imports torch/jpeg4py here
        runs = []
        for _ in range(args.repeat):
            runs.append((run_baseline(paths, args.size, 1)[0], run_dsc(src, work / "out1", args.size, 1),
                         *run_baseline(paths, args.size, cores), run_dsc(src, work / "outN", args.size, cores),
                         run_dsc(src, work / "out1f", args.size, 1, fast_decode=True),
                         run_dsc(src, work / "outNf", args.size, cores, fast_decode=True)))
        b1, d1, bn, bn_work, dn, f1, fn = np.min(runs, axis=0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {k: len(paths) / s for k, s in
            {"b1": b1, "d1": d1, "bn": bn, "bn_work": bn_work, "dn": dn, "f1": f1, "fn": fn}.items()}
    rows = [("dsc compile_folder, workers=1 (in-process, end to end)", 1, d1, rate["d1"]),
            (f"dsc compile_folder, workers={cores} (end to end, incl. start-up)", cores, dn, rate["dn"]),
            ("dsc compile_folder --fast-decode, workers=1", 1, f1, rate["f1"]),
            (f"dsc compile_folder --fast-decode, workers={cores}", cores, fn, rate["fn"]),
            ("baseline Pillow, 1 process", 1, b1, rate["b1"]),
            (f"baseline Pillow, Pool({cores}) incl. start-up", cores, bn, rate["bn"]),
            (f"baseline Pillow, Pool({cores}) without start-up", cores, bn_work, rate["bn_work"])]
    print(f"load average after: {os.getloadavg()[0]:.2f} (other processes on the machine skew the figures)")
    print(f"\n{'run':<62} {'procs':>5} {'seconds':>8} {'img/s':>8} {'img/s/proc':>10}")
    for name, procs, secs, r in rows:
        print(f"{name:<62} {procs:>5} {secs:>8.2f} {r:>8.1f} {r / procs:>10.1f}")
    print("\nratios (target)")
    print(f"  dsc 1 worker / baseline 1 process              {rate['d1'] / rate['b1']:6.2f}x  (>= 2)")
    print(f"  dsc {cores} workers / ({cores} x dsc 1 worker)            "
          f"{rate['dn'] / (cores * rate['d1']):6.2f}   (>= 0.9)")
    print(f"  dsc {cores} workers / baseline {cores} processes            {rate['dn'] / rate['bn']:6.2f}x  "
          f"(both incl. start-up)")
    print(f"\nper-image breakdown, one process, {len(paths[:: max(1, len(paths) // 200)])} files "
          f"(mean source {bd['src MP']:.3f} MP, dsc decodes {bd['decoded MP']:.3f} MP: the default faithful decode, "
          "no DCT scaling), ms:")
    print("  dsc:      " + "  ".join(f"{k} {bd[k]:.2f}" for k in ("read", "probe", "decode", "resize")) +
          f"  = {sum(bd[k] for k in ('read', 'probe', 'decode', 'resize')):.2f}")
    print(f"  baseline: open+convert {bd['pil decode']:.2f}  resize {bd['pil resize']:.2f}"
          f"  = {bd['pil decode'] + bd['pil resize']:.2f}")


if __name__ == "__main__":
    main()
