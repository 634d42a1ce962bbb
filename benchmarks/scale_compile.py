"""Compile a million tiny real images locally and on a local Ray cluster: does everything grow linearly?

    python benchmarks/scale_compile.py [--files 1000000] [--scales 200000 1000000] [--root /tmp/scale]
                                       [--engines local ray] [--workers N] [--resume-engine local]

Writes `--files` real 16x16 images (PNG and JPEG, a few hundred distinct ones, 1000 class folders)
under ROOT/src once (kept for the next run; delete ROOT when done: about 4 GB of small files).
A smaller scale is the first classes of the same tree (a folder of links to them). For each
scale and engine, `dsc compile --size 16` runs as a child process (OUT under ROOT), and prints:

  s, img/s          wall time of the whole command (imports, discovery, decode, finish, publish)
  driver MB         peak RSS of the compile process
  worker MB         peak RSS of its largest descendant (a local worker; for Ray, a task worker)
  tree MB           peak RSS of the compile process and all its descendants together (Ray's raylet,
                    GCS and workers included)
  index B/rec       labels + sizes + source offsets + source paths, bytes per record
  manifest KB       manifest.json (and the skip list beside it)
  open ms           MemmapDataset(OUT) in a fresh process, imports excluded

then the same figures per million images, their growth per million between the smallest and
the largest scale (constant when everything grows linearly), and checks that both engines wrote
identical bytes.
Last, one compile (`--resume-engine`) is killed with SIGKILL when half its records are journalled
and resumed with --resume: the time of both parts, and whether the result is identical.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = 1000
VARIANTS = 256  # distinct images; files repeat them (decoding cost does not depend on which)
SIDE = 16
PAGE = os.sysconf("SC_PAGE_SIZE")
INDEX_FILES = ("labels.bin", "sizes.bin", "source_offsets.bin", "sources.bin")


def variants() -> list[tuple[str, bytes]]:
    """(extension, file bytes) of VARIANTS real 16x16 images, half PNG, half JPEG."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(VARIANTS):
        pixels = rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, "PNG" if i % 2 else "JPEG", quality=90)
        out.append((".png" if i % 2 else ".jpg", buffer.getvalue()))
    return out


def make_corpus(src: Path, files: int) -> None:
    marker = src / ".complete"
    if marker.exists() and marker.read_text() == str(files):
        return
    shutil.rmtree(src, ignore_errors=True)
    images, started = variants(), time.perf_counter()
    per_class = -(-files // CLASSES)
    for i in range(files):
        folder = src / f"n{i // per_class:05d}"
        if i % per_class == 0:
            folder.mkdir(parents=True)
        ext, data = images[i % VARIANTS]
        with open(folder / f"{i:07d}{ext}", "wb") as f:
            f.write(data)
    marker.write_text(str(files))
    print(f"wrote {files} files in {time.perf_counter() - started:.0f} s under {src}", flush=True)


def subset(root: Path, src: Path, files: int, total: int) -> Path:
    """The first classes of `src` holding `files` images: a folder of links to them."""
    if files == total:
        return src
    folder = root / f"src_{files}"
    if not folder.exists():
        folder.mkdir()
        for name in sorted(p.name for p in src.iterdir() if p.is_dir())[:files * CLASSES // total]:
            (folder / name).symlink_to(src / name)
    return folder


class TreeMemory:
    """Samples the RSS of a process and all its descendants from /proc until stopped."""

    def __init__(self, pid: int, every_s: float = 0.25) -> None:
        self.pid, self.every_s = pid, every_s
        self.driver = self.worker = self.tree = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> dict[int, int]:
        parents, rss = {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/statm") as f:
                    rss[int(entry)] = int(f.read().split()[1]) * PAGE
            except (OSError, IndexError):
                continue
            parents[int(entry)] = int(fields[1])
        tree, frontier = {self.pid}, [self.pid]
        while frontier:
            frontier = [p for p, parent in parents.items() if parent in frontier and p not in tree]
            tree.update(frontier)
        return {p: rss[p] for p in tree if p in rss}

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            rss = self._rss()
            self.driver = max(self.driver, rss.get(self.pid, 0))
            self.worker = max([self.worker, *(v for p, v in rss.items() if p != self.pid)])
            self.tree = max(self.tree, sum(rss.values()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def compile_command(src: Path, out: Path, engine: str, workers: int, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "dsc", "compile", str(src), str(out), "--size", str(SIDE), "--engine", engine,
            "-j", str(workers), "--force", *(["--resume"] if resume else [])]


def run_compile(command: list[str]) -> tuple[float, TreeMemory]:
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    memory = TreeMemory(proc.pid)
    stdout, stderr = proc.communicate()
    memory.stop()
    if proc.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return time.perf_counter() - started, memory


def open_ms(out: Path) -> float:
    code = ("import sys, time\nfrom dsc.reader import MemmapDataset\nt = time.perf_counter()\n"
            "MemmapDataset(sys.argv[1])\nprint((time.perf_counter() - t) * 1000)")
    return float(subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                                check=True).stdout)


def measure(src: Path, out: Path, engine: str, workers: int) -> dict:
    seconds, memory = run_compile(compile_command(src, out, engine, workers))
    manifest = json.loads((out / "manifest.json").read_text())
    count = manifest["count"]
    extra = sum((out / name).stat().st_size for name in ("skipped.jsonl",) if (out / name).exists())
    return {"engine": engine, "records": count, "s": seconds, "img/s": count / seconds,
            "driver MB": memory.driver / 1e6, "worker MB": memory.worker / 1e6, "tree MB": memory.tree / 1e6,
            "index B/rec": sum((out / n).stat().st_size for n in INDEX_FILES) / count,
            "manifest KB": ((out / "manifest.json").stat().st_size + extra) / 1e3, "open ms": open_ms(out),
            "digest": {k: manifest[k] for k in ("shard_tables", "segments", "count")}}


COLUMNS = ("s", "img/s", "driver MB", "worker MB", "tree MB", "index B/rec", "manifest KB", "open ms")


def print_rows(rows: list[dict]) -> None:
    print(f"{'engine':8} {'records':>9} " + " ".join(f"{c:>11}" for c in COLUMNS))
    for r in rows:
        print(f"{r['engine']:8} {r['records']:>9,} " + " ".join(f"{r[c]:>11,.1f}" for c in COLUMNS))
    print("per million records, from the largest run (img/s and B/rec as they are):")
    for engine in dict.fromkeys(r["engine"] for r in rows):
        big = max((r for r in rows if r["engine"] == engine), key=lambda r: r["records"])
        m = 1e6 / big["records"]
        print(f"{engine:8} {'1M':>9} " + " ".join(f"{big[c] * (1 if c in ('img/s', 'index B/rec') else m):>11,.1f}"
                                                   for c in COLUMNS))
    print("growth per million more records, between the smallest and the largest run (linear = constant):")
    for engine in dict.fromkeys(r["engine"] for r in rows):
        runs = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["records"])
        small, big = runs[0], runs[-1]
        if big["records"] == small["records"]:
            continue
        m = 1e6 / (big["records"] - small["records"])
        grown = {c: (big[c] - small[c]) * m for c in COLUMNS}
        grown["img/s"] = (big["records"] - small["records"]) / (big["s"] - small["s"])  # the marginal rate
        print(f"{engine:8} {'+1M':>9} " + " ".join(f"{grown[c]:>11,.1f}" for c in COLUMNS))


def journalled(stage: Path, state: dict) -> int:
    """Lines in the partial build's journal so far (read incrementally)."""
    try:
        with open(stage / "journal.jsonl", "rb") as f:
            f.seek(state.get("offset", 0))
            data = f.read()
    except FileNotFoundError:
        return 0
    state["offset"] = state.get("offset", 0) + len(data)
    state["lines"] = state.get("lines", 0) + data.count(b"\n")
    return state["lines"]


def kill_and_resume(src: Path, out: Path, engine: str, workers: int, files: int) -> dict:
    """Kill -9 the compile when half its records are journalled, then --resume it."""
    shutil.rmtree(out, ignore_errors=True)
    stage, state = out.parent / f".{out.name}.dsc-partial", {}
    started = time.perf_counter()
    proc = subprocess.Popen(compile_command(src, out, engine, workers), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    while proc.poll() is None and journalled(stage, state) < files // 2:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_s, at = time.perf_counter() - started, journalled(stage, state)
    resumed_s, memory = run_compile(compile_command(src, out, engine, workers, resume=True))
    manifest = json.loads((out / "manifest.json").read_text())
    return {"killed after s": killed_s, "journalled": at, "resume s": resumed_s,
            "resume driver MB": memory.driver / 1e6,
            "digest": {k: manifest[k] for k in ("shard_tables", "segments", "count")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=1_000_000)
    parser.add_argument("--scales", type=int, nargs="*", help="image counts to compile [default: --files]")
    parser.add_argument("--root", type=Path, default=Path("/tmp/scale"))
    parser.add_argument("--engines", nargs="*", default=["local", "ray"])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--resume-engine", default="local", help="engine of the kill-and-resume run ('' for none)")
    args = parser.parse_args()
    src = args.root / "src"
    make_corpus(src, args.files)
    subprocess.run([sys.executable, "-c", "import dsc, ray"], check=True)  # warm the page cache for the imports
    rows = []
    for files in args.scales or [args.files]:
        folder = subset(args.root, src, files, args.files)
        for engine in args.engines:
            out = args.root / f"out_{engine}"
            rows.append(measure(folder, out, engine, args.workers))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "digest"}), flush=True)
        same = [r for r in rows if r["records"] == rows[-1]["records"]]
        print(f"{files} images: engines wrote identical shards and index: "
              f"{all(r['digest'] == same[0]['digest'] for r in same)}", flush=True)
    print_rows(rows)
    if args.resume_engine:
        resumed = kill_and_resume(src, args.root / "out_resumed", args.resume_engine, args.workers, args.files)
        reference = next((r["digest"] for r in rows if r["records"] == resumed["digest"]["count"]), None)
        print(f"kill -9 at {resumed['journalled']:,} journalled records after {resumed['killed after s']:.1f} s; "
              f"--resume took {resumed['resume s']:.1f} s (driver {resumed['resume driver MB']:.0f} MB); "
              f"identical to the uninterrupted compile: {resumed['digest'] == reference}")


if __name__ == "__main__":
    main()
