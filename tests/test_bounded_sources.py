"""Every source read opens only a regular file and reads only the bytes `fstat` gave (issue 27, point 2).

A source may become something else after discovery (between a compile's walk and its decode, or
long after, when `verify --decode` reads it again): a FIFO would block the read for ever, a link
to /dev/zero would be read without end, a file that grows while read would never end either.
Each is a named skip, at once. The reads run in a child process under a timeout and an address
space limit, so a hang or an endless read fails the test instead of the suite.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import dsc

from conftest import make_folder

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="FIFOs, /dev/zero, /proc: Linux")

TIMEOUT_S = 60  # each read is refused in milliseconds; a blocked open or an endless read runs into this
ADDRESS_SPACE = 4 << 30  # an endless read of /dev/zero fails fast against it instead of filling the machine

READ = """
import sys
import numpy as np
from dsc.compiler.target import Target
from dsc.compiler.write import compile_image
from dsc.errors import ImageError
try:
    compile_image(sys.argv[1], Target(8, 8), np.empty((8, 8, 3), np.uint8), 10**6)
    print("decoded")
except ImageError as e:
    print(f"skipped: {e}")
"""


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _run(args: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[2:]} was still running after {TIMEOUT_S} s")


@pytest.mark.parametrize(("make", "reason"), [
    (os.mkfifo, "not a regular file (a FIFO); not read"),
    (lambda path: os.symlink("/dev/zero", path), "not a regular file (a character device); not read"),
    # procfs files are regular files that stat as 0 bytes and hold more: as a file that grows while read
    (lambda path: os.symlink("/proc/self/status", path), "file grew while read (stat said 0 bytes); not read"),
])
def test_a_source_that_is_no_regular_file_is_skipped_at_once(tmp_path: Path, make, reason: str) -> None:
    make(tmp_path / "x.jpg")
    result = _run([sys.executable, "-c", READ, str(tmp_path / "x.jpg")])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"skipped: {reason}"


def test_a_regular_source_still_decodes(tmp_path: Path) -> None:
    make_folder(tmp_path / "src", classes=1, per_class=1)
    result = _run([sys.executable, "-c", READ, str(tmp_path / "src" / "class_0" / "img_0.jpg")])
    assert result.stdout.strip() == "decoded", result.stderr


def test_verify_decode_names_sources_that_became_a_fifo_or_a_device(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=1, per_class=3)
    dsc.compile_folder(src, tmp_path / "ds", size=8, workers=1, shuffle=False)
    os.remove(src / "class_0" / "img_0.jpg")
    os.mkfifo(src / "class_0" / "img_0.jpg")
    os.remove(src / "class_0" / "img_1.jpg")
    os.symlink("/dev/zero", src / "class_0" / "img_1.jpg")
    result = _run([sys.executable, "-m", "dsc", "verify", str(tmp_path / "ds"), "--decode", "3"])
    assert "Traceback" not in result.stderr
    assert result.returncode == 0, result.stderr
    assert "not checked: class_0/img_0.jpg (not a regular file (a FIFO); not read)" in result.stderr
    assert "not checked: class_0/img_1.jpg (not a regular file (a character device); not read)" in result.stderr
    assert "decoded 1 record(s) again" in result.stdout


CLASSES = """
import sys
import dsc
try:
    dsc.compile_folder(sys.argv[1], sys.argv[2], size=8, workers=1, classes=__import__("pathlib").Path(sys.argv[3]))
except dsc.CompileError as e:
    print(f"refused: {e}")
"""


@pytest.mark.parametrize(("make", "said"), [
    (os.mkfifo, ": not a regular file (a FIFO); not read"),
    (lambda path: os.symlink("/dev/zero", path), ": not a regular file (a character device); not read"),
    (lambda path: os.truncate(os.open(path, os.O_CREAT | os.O_WRONLY), 8 << 30),  # sparse: no disk used
     f" is {8 << 30} bytes, more than 1024 MiB: not a file of class names"),
])
def test_a_classes_file_is_read_only_if_regular_and_small(tmp_path: Path, make, said: str) -> None:
    """`--classes FILE` given a FIFO blocked, /dev/zero said "does not exist", and a large file (a tar given
    by mistake) was read whole into memory before its names were checked."""
    src = make_folder(tmp_path / "src", classes=2, per_class=1)
    make(str(tmp_path / "classes.txt"))
    done = _run([sys.executable, "-c", CLASSES, str(src), str(tmp_path / "out"), str(tmp_path / "classes.txt")])
    assert done.stdout.strip() == f"refused: classes file {tmp_path / 'classes.txt'}{said}", done.stderr
