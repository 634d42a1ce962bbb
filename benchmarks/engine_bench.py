"""The Ray engine against the local engine on the same corpus, with the same options and cores.

    python benchmarks/engine_bench.py CORPUS [--size 224] [--workers N] [--repeat 2] [--out-dir DIR]

CORPUS is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`, built from this clone).
A local Ray instance of `--workers` CPUs is started first and joined by every Ray compile, so the
figures are "once Ray has started": its first compile still starts the task workers (each imports
torch), the later ones reuse them. The local compiles run in a child process started before Ray,
as `dsc compile` runs: forked from a process that is a Ray driver, the local workers ran at half
speed here. Runs alternate local, Ray, local, Ray...; every compile is end to end (discover,
decode, finish, publish), the page cache warmed by a first read of the corpus. Prints images/s
per run, the best of each engine and their ratio, the number of Ray tasks (one progress report
per finished task), and whether both engines wrote the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import dsc


def compile_once(corpus: Path, out: Path, size: int, workers: int, engine: str) -> tuple[dsc.CompileSummary, int]:
    """One end-to-end compile; the summary and the number of progress reports (finished chunks)."""
    calls: list[int] = []
    summary = dsc.compile_folder(corpus, out, size=size, workers=workers, engine=engine, force=True,
                                 progress=calls.append, on_skip=lambda source, reason: None)
    return summary, sum(1 for n in calls if n)


def digest(out: Path) -> str:
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return hashlib.sha256(b"".join(p.relative_to(out).as_posix().encode() + p.read_bytes() for p in files)).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out-dir", type=Path)
    args = ap.parse_args()
    for path in args.corpus.rglob("*"):  # warm the page cache
        if path.is_file():
            path.read_bytes()
    local = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"))  # no Ray in it: see the docstring
    local.submit(int).result()
    import ray

    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    work = Path(tempfile.mkdtemp(prefix="dsc-engines-", dir=args.out_dir))
    best, digests = {"local": 0.0, "ray": 0.0}, {}
    try:
        for run in range(args.repeat):
            for engine in ("local", "ray"):
                job = (args.corpus, work / engine, args.size, args.workers, engine)
                summary, tasks = local.submit(compile_once, *job).result() if engine == "local" else \
                    compile_once(*job)
                digests[engine] = digest(work / engine)
                best[engine] = max(best[engine], summary.images_per_second)
                images = summary.kept + len(summary.skipped)
                print(f"run {run + 1} {engine:5}: {images} images in {summary.seconds:.2f} s = "
                      f"{summary.images_per_second:.1f} images/s, {tasks} chunks, {summary.shards} shard(s)",
                      flush=True)
    finally:
        ray.shutdown()
        local.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"best: local {best['local']:.1f} images/s, ray {best['ray']:.1f} images/s, "
          f"ray / local = {best['ray'] / best['local']:.2f} (target >= 0.7); "
          f"identical bytes: {digests['local'] == digests['ray']}")


if __name__ == "__main__":
    main()
