"""dsc side by side with the tools its users would pick instead: LitData and MosaicML Streaming.

    python benchmarks/peer_bench.py SRC [--images N] [--size 224] [--workers 2] [--epochs 5] [--repeat 3]
                                        [--peers litdata streaming]

SRC is any ImageFolder tree (e.g. `python benchmarks/corpus.py /tmp/corpus`, built from this clone);
`--images N` takes its first N images (in dsc's discovery order). Every tool gets the same
photos, the same size and the same number of workers, and runs in a fresh process each time
(`peer_runs.py`); one table is printed:

- prepare: `dsc compile` vs LitData `optimize` and MosaicML Streaming's `MDSWriter` (one writer
  process per worker, then `merge_index`), each storing raw uint8 [S, S, 3] arrays or the files'
  JPEG bytes; wall time of the whole process, best of --repeat;
- warm read: batch 256, shuffled, samples/s over epochs 2..E (the first warms up), each peer at its
  best documented settings for raw arrays (printed with its row); the peak resident memory of the
  process tree, anonymous, shared-memory and file-backed pages apart;
- mid-epoch resume: stopped half way through an epoch, resumed from the state in a new loader:
  every sample must be served exactly once across the break.

The peers install into their own virtual environment under a cache folder ($DSC_PEER_CACHE, else
~/.cache/dsc/peers), never into dsc's: `pip install --no-deps` of the pinned releases plus the
packages they import, because both declare torchvision, whose builds do not load beside the CPU
torch. `import streaming` imports torchvision for its vision datasets only, so its runs get a
stand-in package that defines just the two names it imports (`torchvision.datasets.VisionDataset`,
`torchvision.transforms.functional.to_tensor`), neither used here. A peer that cannot be installed
gets the row `not installed: <why>`; the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
RUNS = HERE / "peer_runs.py"
PEERS = {"litdata": "litdata==0.2.76", "streaming": "mosaicml-streaming==0.13.0"}
PEER_IMPORTS = ["torch==2.13.0", "numpy<2.2", "Pillow", "lightning-utilities", "filelock", "boto3", "requests",
                "tifffile", "obstore", "transformers<5", "xxhash<4", "zstd", "python-snappy", "Brotli", "tqdm",
                "catalogue", "matplotlib", "paramiko<4"]
STAND_IN = {  # the two torchvision names `import streaming` needs; nothing here calls them
    "torchvision/__init__.py": '"""A stand-in for torchvision, written by dsc\'s peer_bench.py: not torchvision."""\n',
    "torchvision/datasets/__init__.py": "class VisionDataset:\n    def __init__(self, *args, **kwargs):\n"
                                        "        raise NotImplementedError('torchvision stand-in')\n",
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": "def to_tensor(pic):\n"
                                            "    raise NotImplementedError('torchvision stand-in')\n",
}
SAMPLE_S = 0.01  # how often the process tree's memory is read


# ----------------------------------------------------------------------------- the peers' environment

class PeerEnv:
    """The peers' own virtual environment: its python, and which peers import there (or why not)."""

    def __init__(self, cache: Path) -> None:
        self.cache, self.python = cache, cache / "venv" / "bin" / "python"
        self.missing: dict[str, str] = {}

    def env(self, tool: str) -> dict[str, str]:
        env = {**os.environ, "LITDATA_DISABLE_VERSION_CHECK": "1"}
        if tool == "streaming":
            env["PYTHONPATH"] = str(self.cache / "stand-in")
        return env

    def ensure(self, peers: list[str]) -> None:
        """Create the environment once; then check each of `peers` imports (a reason per one that does not)."""
        self.missing = {tool: "not asked for (--peers)" for tool in PEERS if tool not in peers}
        if not peers:
            return
        if not self.python.exists():
            steps = [[sys.executable, "-m", "venv", str(self.cache / "venv")],
                     [str(self.python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PEER_IMPORTS],
                     [str(self.python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                      *PEERS.values()]]
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True)
                if done.returncode:
                    shutil.rmtree(self.cache / "venv", ignore_errors=True)
                    why = (done.stderr.strip().splitlines() or ["failed"])[-1]
                    self.missing |= {tool: f"{' '.join(step[2:5])}: {why}" for tool in peers}
                    return
        for name, text in STAND_IN.items():
            (self.cache / "stand-in" / name).parent.mkdir(parents=True, exist_ok=True)
            (self.cache / "stand-in" / name).write_text(text)
        for tool in peers:
            done = subprocess.run([str(self.python), "-c", f"import {tool}"], capture_output=True, text=True,
                                  env=self.env(tool))
            if done.returncode:
                self.missing[tool] = (done.stderr.strip().splitlines() or ["import failed"])[-1]


# ----------------------------------------------------------------------------- running and measuring

class TreeMemory:
    """Peak resident memory of a process and its descendants, by kind (RssAnon, RssShmem, RssFile), in MB."""

    FIELDS = ("RssAnon", "RssShmem", "RssFile")

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, dict.fromkeys(self.FIELDS, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        pids, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            pids.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
        return pids

    def _run(self) -> None:
        while not self._stop.is_set():
            now = dict.fromkeys(self.FIELDS, 0)
            for pid in self._tree():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        key, _, value = line.partition(":")
                        if key in now:
                            now[key] += int(value.split()[0]) // 1024
                except OSError:
                    pass
            self.peak = {k: max(self.peak[k], now[k]) for k in self.FIELDS}
            time.sleep(SAMPLE_S)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(python: Path | str, args: list, env: dict | None = None, measure: bool = False) -> tuple[dict, dict, float]:
    """Run peer_runs.py in a fresh process: (its JSON report or {}, peak memory or {}, wall seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen([str(python), str(RUNS), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    memory = TreeMemory(proc.pid) if measure else None
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    peak = memory.stop() if memory else {}
    if proc.returncode:
        raise RuntimeError(f"{' '.join(map(str, args[:2]))} failed: {(err.strip().splitlines() or ['?'])[-1]}")
    return (json.loads(out.strip().splitlines()[-1]) if out.strip() else {}), peak, wall


def subset(src: Path, n: int | None, work: Path) -> tuple[Path, Path, int]:
    """The first n images of src as a symlinked image folder (for dsc) and a "path<TAB>label" list (for the peers)."""
    from dsc.compiler.discover import discover

    found = discover(src)
    pairs = list(zip(found.sources, found.labels.tolist()))[:n]
    folder, lines = work / "images", []
    for source, label in pairs:
        (folder / source).parent.mkdir(parents=True, exist_ok=True)
        (folder / source).symlink_to((src / source).resolve())
        lines.append(f"{(src / source).resolve()}\t{label}")
    (work / "list.txt").write_text("\n".join(lines) + "\n")
    return folder, work / "list.txt", len(pairs)


# ----------------------------------------------------------------------------- the table

def prepare_rows(args, env: PeerEnv, folder: Path, listing: Path, work: Path) -> dict[str, tuple]:
    """name -> (best seconds, output folder) or (reason, None)."""
    jobs = {"dsc compile": ("dsc", None)}
    for tool, label in (("litdata", "LitData optimize"), ("streaming", "MDSWriter")):
        for mode in ("raw", "jpeg"):
            jobs[f"{label} ({mode})"] = (tool, mode)
    rows = {}
    for name, (tool, mode) in jobs.items():
        if tool in env.missing:
            rows[name] = (env.missing[tool] if tool not in args.peers else f"not installed: {env.missing[tool]}", None)
            continue
        out, best = work / name.replace(" ", "_").replace("(", "").replace(")", ""), float("inf")
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            if tool == "dsc":
                subprocess.run([sys.executable, "-m", "dsc", "compile", str(folder), str(out), "--size",
                                str(args.size), "-j", str(args.workers)], check=True, capture_output=True)
            else:
                run(env.python, [tool, "prepare", listing, out, args.size, args.workers, mode], env.env(tool))
            best = min(best, time.perf_counter() - start)
        rows[name] = (best, out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("--images", type=int, default=None, help="take the first N images [default: all]")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(os.environ.get("DSC_PEER_CACHE", "~/.cache/dsc/peers")))
    parser.add_argument("--peers", nargs="*", choices=list(PEERS), default=list(PEERS),
                        help="the peers to run beside dsc [default: all]; none (--peers alone) runs dsc's rows only")
    args = parser.parse_args()
    env = PeerEnv(args.cache.expanduser())
    env.ensure(args.peers)
    with tempfile.TemporaryDirectory(prefix="dsc-peers-") as tmp:
        work = Path(tmp)
        folder, listing, count = subset(args.src, args.images, work)
        print(f"{count} images of {args.src} at {args.size}x{args.size}, {args.workers} workers, "
              f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
        prepared = prepare_rows(args, env, folder, listing, work)
        print(f"\nprepare (wall from a fresh process, best of {args.repeat})")
        base = prepared["dsc compile"][0]
        for name, (seconds, _) in prepared.items():
            print(f"  {name:<26} " + (f"{seconds:6.2f} s  {seconds / base:5.2f}x dsc's time" if isinstance(
                seconds, float) else seconds))
        reads = read_rows(args, env, prepared)
        targets(prepared, reads)


def targets(prepared: dict[str, tuple], reads: dict[str, tuple[dict, dict]]) -> None:
    """The issue's targets, against the best peer that ran. Preparing is compared like for like (peers
    storing raw arrays decode as dsc does); the peers storing JPEG bytes decode nothing here and every
    epoch of training instead, so that ratio is printed beside it, with no target."""
    def fastest(kind: str) -> float | None:
        times = [seconds for name, (seconds, _) in prepared.items() if name.endswith(f"({kind})")
                 and isinstance(seconds, float)]
        return min(times) if times else None

    raw, jpeg = fastest("raw"), fastest("jpeg")
    read_peers = {tool: row for tool, row in reads.items() if tool != "dsc"}
    if raw is None or not read_peers or "dsc" not in reads:
        print("\ntargets: no peer ran, nothing to compare")
        return
    dsc_read, dsc_memory = reads["dsc"]
    checks = [("prepare >= 2x the faster peer storing raw arrays", raw / prepared["dsc compile"][0], 2.0),
              ("warm read >= 5x the best raw peer",
               dsc_read["samples_per_s"] / max(r["samples_per_s"] for r, _ in read_peers.values()), 5.0),
              ("anonymous RSS <= the best peer's (peer / dsc)",
               min(m["RssAnon"] + m["RssShmem"] for _, m in read_peers.values())
               / max(1, dsc_memory["RssAnon"] + dsc_memory["RssShmem"]), 1.0)]
    print("\ntargets")
    for name, ratio, want in checks:
        print(f"  {name:<50} {ratio:6.2f}x  {'ok' if ratio >= want else 'MISSED'}")
    if jpeg is not None:
        print(f"  {'prepare vs the faster peer storing JPEG bytes':<50} {jpeg / prepared['dsc compile'][0]:6.2f}x  "
              "(no target: those decode at every epoch of training instead)")


def read_rows(args, env: PeerEnv, prepared: dict[str, tuple]) -> dict[str, tuple[dict, dict]]:
    sources = {"dsc": "dsc compile", "litdata": "LitData optimize (raw)", "streaming": "MDSWriter (raw)"}
    print(f"\nwarm read (batch 256, shuffled, samples/s over epochs 2..{args.epochs}; peak MB of the process tree)")
    print(f"  {'tool':<10} {'samples/s':>10} {'anon':>6} {'shmem':>6} {'file':>6}  settings")
    resumes, reads = {}, {}
    for tool, row in sources.items():
        out = prepared[row][1]
        if out is None:
            print(f"  {tool:<10} {prepared[row][0]}")
            continue
        python = sys.executable if tool == "dsc" else env.python
        report, peak, _ = run(python, [tool, "read", out, args.workers, args.epochs], env.env(tool), measure=True)
        reads[tool] = (report, peak)
        print(f"  {tool:<10} {report['samples_per_s']:>10,.0f} {peak['RssAnon']:>6} {peak['RssShmem']:>6} "
              f"{peak['RssFile']:>6}  {report['settings']}")
        half = -(-report["samples"] // 256) // 2
        if half < 1:  # an epoch of one batch has no middle: stopping after it is the epoch's end
            resumes[tool] = None
            continue
        resumes[tool], _, _ = run(python, [tool, "resume", out, args.workers, half], env.env(tool))
        resumes[tool]["after"] = half
    print("\nmid-epoch resume (stopped after half an epoch's batches, resumed in a new loader)")
    for tool, r in resumes.items():
        if r is None:
            print(f"  {tool:<10} not measured: an epoch of {reads[tool][0]['samples']} samples is one batch of 256, "
                  "with no middle to stop in (give --images above 256)")
            continue
        verdict = "exact" if r["missing"] == r["repeated"] == 0 else "NOT exact"
        print(f"  {tool:<10} stopped after {r['after']} batches: {r['served']} served, {r['missing']} missing, "
              f"{r['repeated']} repeated: {verdict}")
    return reads


if __name__ == "__main__":
    main()
