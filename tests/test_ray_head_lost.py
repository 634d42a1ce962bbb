"""The Ray head killed mid-compile (issue 27, point 4): dsc says within seconds that the cluster was
lost and how to resume, and the partial build stays for --resume. Ray alone waited 60 s for its head,
then ended the process without a word from dsc.

A real head (`ray start --head --block`: its own session and process group, a temp dir of its own
in /tmp) is killed with SIGKILL to its process group once the compile has started building.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dsc.compiler.publish import staging_path

pytest.importorskip("ray")

START_TIMEOUT_S = 90  # a Ray head starts in ~10 s here
LOST_WITHIN_S = 30  # dsc checks the head every 2 s (PROBE_S); Ray alone took 60 s and said nothing of dsc's


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_lost_head_is_said_at_once_and_the_build_kept(tmp_path: Path) -> None:
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        pytest.skip("no ray command beside this Python")
    src = tmp_path / "src" / "noise"
    src.mkdir(parents=True)
    first = src / "img_000.png"  # slow to decode: the compile is still running when the head dies
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (2000, 2000, 3), dtype=np.uint8)).save(first)
    for i in range(1, 120):
        os.link(first, src / f"img_{i:03d}.png")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}  # a second process joins the head by address alone
    port, out = _free_port(), tmp_path / "out"
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--port", str(port), "--num-cpus", "1",
                             "--temp-dir", ray_dir, "--include-dashboard=false", "--block"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    compile_ = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(port):
            assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
            time.sleep(0.5)
        compile_ = subprocess.Popen([sys.executable, "-m", "dsc", "compile", str(src.parent), str(out),
                                     "--engine", "ray", "--address", f"127.0.0.1:{port}", "--size", "16"],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not (staging_path(out) / "shards").exists():  # building: connected, tasks submitted
            assert compile_.poll() is None and time.monotonic() < deadline, compile_.communicate()[1]
            time.sleep(0.2)
        time.sleep(2)
        os.killpg(head.pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = compile_.communicate(timeout=LOST_WITHIN_S + 30)
        took = time.monotonic() - killed
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        if compile_ is not None and compile_.poll() is None:
            compile_.kill()
            compile_.communicate()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert "error: lost the Ray cluster at " in stderr, stderr
    assert "run the same dsc compile command with --resume to continue" in stderr
    assert took < LOST_WITHIN_S, f"took {took:.0f} s"
    assert compile_.returncode == 1
    assert not out.exists() and staging_path(out).is_dir()  # kept for --resume
