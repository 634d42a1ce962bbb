"""A stalled worker is stopped and its work retried (issue 27, point 3): real worker processes of a real
compile are stopped with SIGSTOP, as a decoder that never returns or a read from a dead mount would
stall them. The compile ends anyway: the stalled worker is killed, another redoes its sources, and a
source two workers stalled on is skipped with a reason; while it waits, the compile names the worker.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from stopping import children, run_stopping

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the worker processes")

STALL_S = 2  # the compile's stall limit here; the default is 300
IMAGES = 16  # one chunk (MIN_CHUNK), so one worker at a time works on it
SIDE = 2000  # a noise PNG this large takes ~0.2 s to decode: a worker is caught in the middle of its chunk
TIMEOUT_S = 180

COMPILE = f"""
import json, sys
import dsc
src, out = sys.argv[1:]
summary = dsc.compile_folder(src, out, size=16, workers=2, stall_seconds={STALL_S}, shuffle=False,
                             on_skip=lambda source, reason: None)
print(json.dumps({{"kept": summary.kept, "skipped": summary.skipped}}))
"""


@pytest.fixture(scope="module")
def slow_folder(tmp_path_factory) -> Path:
    """IMAGES hard links to one large noise PNG: slow to decode, one file on disk."""
    src = tmp_path_factory.mktemp("stalls") / "src"
    (src / "noise").mkdir(parents=True)
    first = src / "noise" / "img_00.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)).save(first)
    for i in range(1, IMAGES):
        os.link(first, src / "noise" / f"img_{i:02d}.png")
    return src


def _compile_stopping(src: Path, out: Path, workers_to_stop: int) -> tuple[dict, str, list[int]]:
    """Run a compile, SIGSTOP the first `workers_to_stop` worker processes the moment they appear."""
    def workers(pid: int, _: list[str]) -> list[int]:
        return [worker for host in children(pid) for worker in children(host)]

    done, stopped = run_stopping([sys.executable, "-c", COMPILE, str(src), str(out)], workers_to_stop, workers,
                                 TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert len(stopped) == workers_to_stop
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, stopped


def test_a_stopped_worker_is_replaced_and_its_work_redone(slow_folder: Path, tmp_path: Path) -> None:
    summary, stderr, (stopped,) = _compile_stopping(slow_folder, tmp_path / "out", workers_to_stop=1)
    assert summary == {"kept": IMAGES, "skipped": []}
    assert f"worker {stopped} has made no progress for 1 s on noise/img_" in stderr  # said while it waits
    assert f"worker {stopped} made no progress for {STALL_S} s on noise/img_" in stderr
    assert "another worker tries it again" in stderr
    from dsc.reader import MemmapDataset
    ds = MemmapDataset(tmp_path / "out")
    first = ds[0].image
    assert all(np.array_equal(ds[i].image, first) for i in range(IMAGES))  # every record written in full


def test_a_source_two_workers_stall_on_is_skipped(slow_folder: Path, tmp_path: Path) -> None:
    summary, stderr, stopped = _compile_stopping(slow_folder, tmp_path / "out", workers_to_stop=2)
    assert summary["kept"] == IMAGES - 1
    [(source, reason)] = summary["skipped"]
    assert reason == f"decode did not finish in {STALL_S} s (2 workers stalled on it)"
    assert f"worker {stopped[1]} made no progress for {STALL_S} s on {source}: stopped; the source is skipped" \
        in stderr
