"""Every `python benchmarks/...` and `python examples/...` command the README (or a page of docs/) shows runs as
written, from a clone alone: each is run here with the README's own arguments, its paths pointed
into a temporary folder and a few arguments added that make it tiny (argparse lets a later
option override an earlier one). The corpus they read is the one the README tells users to build
(`benchmarks/corpus.py`), built here by the README's own command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the documentation
DOCUMENTATION = "\n".join(page.read_text() for page in PAGES)
SHOWN = re.compile(r"`(python (?:benchmarks|examples)/[^`]+)`")

# script -> the arguments that make a run tiny (added after the README's own)
TINY = {
    "benchmarks/corpus.py": ["--images", "24", "--classes", "3"],
    "benchmarks/compile_bench.py": ["--size", "32", "--limit", "12"],
    "benchmarks/archive_sources.py": ["--size", "16", "--limit", "12", "--workers", "1", "--out-dir", "{tmp}"],
    "benchmarks/append_bench.py": ["--size", "16", "--limit", "20", "--new", "0.2", "0.5", "--workers", "1"],
    "benchmarks/read_bench.py": ["--copies", "1", "--batch", "8", "--repeat", "1", "--out", "{tmp}/read_ds"],
    "benchmarks/decode_fidelity.py": ["--sizes", "32", "--limit", "3"],
    "benchmarks/transforms_bench.py": ["--batch", "2", "--record", "32", "--repeat", "1"],
    "benchmarks/engine_bench.py": ["--size", "16", "--workers", "1", "--repeat", "1", "--out-dir", "{tmp}"],
    "benchmarks/scale_compile.py": ["--files", "30", "--scales", "30", "--engines", "local", "--workers", "1",
                                    "--resume-engine", "", "--root", "{tmp}/scale"],
    "benchmarks/scale_sim.py": ["--ranks", "2", "--batch", "4", "--epochs", "1", "--repeat", "1"],
    "benchmarks/startup_bench.py": ["--repeat", "1"],
    "benchmarks/open_scale.py": ["--counts", "2000", "--dir", "{tmp}"],
    "benchmarks/reader_ab.py": ["--rounds", "1", "--epochs", "2", "--batch", "4"],
    "benchmarks/cooccurrence_bench.py": ["--batch", "4", "--epochs", "2", "--cold-repeat", "1", "--warm-repeat", "1",
                                         "--settings", "random", "block:4/2", "block", "--cost-repeat", "1"],
    "benchmarks/sampling_cost.py": ["--batch", "4", "--repeat", "1"],
    "benchmarks/share_memory.py": ["--records", "10000", "--world-size", "1", "2", "--orders", "random",
                                   "--whole-epoch"],
    "benchmarks/locality_scale.py": ["--records", "4096", "--records-per-shard", "64", "--world-size", "16",
                                     "--cases", "batch"],
    "benchmarks/partner_rates.py": ["--records", "300", "--records-per-shard", "100", "--batch", "16", "--epochs", "2"],
    "benchmarks/s3_read_bench.py": ["--records", "48", "--size", "16", "--records-per-shard", "16", "--batch", "8",
                                    "--fetch-batch", "4", "--server", "moto", "--repeat", "1", "--peers"],
    "benchmarks/compile_s3_bench.py": ["--images", "12", "--size", "16", "--workers", "1", "--server", "moto"],
    "benchmarks/peer_bench.py": ["--images", "12", "--size", "32", "--epochs", "2", "--repeat", "1", "--peers"],
    "examples/train.py": ["--steps", "2", "--data", "{tmp}/train_ds"],
    "examples/s3_quickstart.py": ["--work", "{tmp}/s3_quickstart"],
    "examples/imagenet_recipe.py": ["--steps", "2", "--size", "40", "--crop", "32", "--batch-size", "8",
                                    "--data", "{tmp}/recipe_ds"],
    "examples/frameworks/lightning_train.py": ["--epochs", "1", "--max-steps", "2", "--checkpoint-dir",
                                               "{tmp}/checkpoints"],
}
PATHS = {"/tmp/corpus": "{tmp}/corpus", "/tmp/scale_ds": "{tmp}/scale_ds", "out/": "{tmp}/dataset",
         "/tmp/ab_ds": "{tmp}/dataset", "/tmp/dsc-old": str(ROOT),  # reader_ab, locality_scale: against itself
         "/tmp/c8k": "{tmp}/dataset"}


def shown_commands() -> list[str]:
    """Each distinct command in backticks, its line breaks undone."""
    return list(dict.fromkeys(" ".join(m.split()) for m in SHOWN.findall(DOCUMENTATION)))


def runnable(command: str, tmp: Path) -> list[str]:
    words = shlex.split(command)
    words = [PATHS.get(w, w) for w in words]
    return [sys.executable, *words[1:], *TINY[words[1]]]


def test_every_shown_command_has_a_tiny_run() -> None:
    scripts = {shlex.split(c)[1] for c in shown_commands()}
    assert "benchmarks/read_bench.py" in scripts and "benchmarks/corpus.py" in scripts  # the reading sees them
    assert scripts - set(TINY) == set(), "a README command without a tiny run here"
    assert all((ROOT / s).is_file() for s in scripts)


def test_every_shown_command_runs_as_written(tmp_path: Path) -> None:
    """The corpus first (the others read it), then the scripts two at a time: most of each run is starting
    Python and importing torch, or waiting for a server. One script's commands run one after the other,
    as they share their output paths here."""
    commands = shown_commands()
    corpus = [c for c in commands if "benchmarks/corpus.py" in c]
    assert len(corpus) == 1
    subprocess.run([sys.executable, "-m", "dsc", "compile", str(ROOT / "examples" / "images"),
                    str(tmp_path / "dataset"), "--size", "32", "-j", "1"], check=True, capture_output=True)
    by_script: dict[str, list[str]] = {}
    for command in commands:
        if command not in corpus:
            by_script.setdefault(shlex.split(command)[1], []).append(command)

    def run_all(group: list[str]) -> list[str]:
        failed = []
        for command in group:
            argv = [a.replace("{tmp}", str(tmp_path)) for a in runnable(command, tmp_path)]
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
            if done.returncode:
                failed.append(f"{command}\n  ran: {shlex.join(argv[1:])}\n  " + done.stderr.strip()[-800:])
        return failed

    failed = run_all(corpus)
    assert failed == [], failed[0]
    with ThreadPoolExecutor(2) as pool:
        failed = [f for group_failed in pool.map(run_all, by_script.values()) for f in group_failed]
    assert failed == [], "\n".join(failed)


def test_nothing_points_outside_the_clone() -> None:
    """A user's clone has no `../shared` folder: no benchmark, example or README line may need one."""
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in
             [*PAGES, *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/**/*.py")]}
    assert [name for name, text in texts.items() if "../shared" in text] == []
