"""Start-up of the dsc command against the floor of its imports, side by side in one run.

    python benchmarks/startup_bench.py [--repeat 5] [--images examples/images]

Each row is the best wall time of `--repeat` fresh processes (page cache warm after the first):
  python -c "import typer, numpy"       the floor of a light command
  dsc --help, dsc info OUT              light commands (target: <= 3x the floor)
  python -c "import torch"              the floor of anything that decodes
  dsc compile IMAGES OUT -j 2 --force   the 20 bundled images (target: <= 1.6x import torch)
dsc runs as `python -m dsc` in a temporary folder, so PYTHONPATH=/path/to/another/checkout measures
that checkout.
Also prints each row's peak RSS (of the process, or of its largest worker).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGETS = {"dsc --help": ("import typer, numpy", 3.0), "dsc info OUT": ("import typer, numpy", 3.0),
           "dsc compile IMAGES -j 2": ("import torch", 1.6)}


def best_of(command: list[str], repeat: int, cwd: str) -> tuple[float, int]:
    """(best wall seconds, peak RSS in MB of the process or its largest worker) over `repeat` runs."""
    best, peak = float("inf"), 0
    for _ in range(repeat):
        start = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
        _, status, usage = os.wait4(proc.pid, 0)
        best = min(best, time.perf_counter() - start)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise SystemExit(f"{' '.join(command)} failed with exit code {proc.returncode}")
        peak = max(peak, usage.ru_maxrss // 1024)
    return best, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--images", type=Path, default=Path(__file__).parent.parent / "examples" / "images")
    args = parser.parse_args()
    py, dsc = sys.executable, [sys.executable, "-m", "dsc"]
    with tempfile.TemporaryDirectory(prefix="dsc-startup-") as tmp:
        out = Path(tmp) / "out"
        subprocess.run([*dsc, "compile", str(args.images.absolute()), str(out), "--size", "64"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        rows = {
            "import typer, numpy": [py, "-c", "import typer, numpy"],
            "dsc --help": [*dsc, "--help"],
            "dsc info OUT": [*dsc, "info", str(out)],
            "import torch": [py, "-c", "import torch"],
            "dsc compile IMAGES -j 2": [*dsc, "compile", str(args.images.absolute()), str(Path(tmp) / "again"),
                                        "-j", "2", "--force"],
        }
        times = {}
        print(f"{'row':<26} {'best s':>8} {'peak MB':>8} {'ratio':>7}  target")
        for name, command in rows.items():
            times[name], peak = best_of(command, args.repeat, tmp)
            floor, target = TARGETS.get(name, (None, None))
            ratio = times[name] / times[floor] if floor else 1.0
            verdict = "" if target is None else f"<= {target} x '{floor}'" + (": ok" if ratio <= target else ": MISSED")
            print(f"{name:<26} {times[name]:>8.3f} {peak:>8} {ratio:>7.2f}  {verdict}")


if __name__ == "__main__":
    main()
