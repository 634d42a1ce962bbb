"""`dsc info` reads no more than it shows (issue 27, point 7): its text lists the first skipped sources,
which the manifest holds, so the skip list file — whose size grows with the skips — is not read;
`--json`, which lists every skip, reads it."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

import dsc
from dsc import format as fmt
from dsc.cli import SHOW_SKIPPED, app

from conftest import make_folder

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
BAD = 30


def test_info_text_does_not_read_the_skip_list_file(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", classes=1, per_class=2)
    for i in range(BAD):
        (src / "class_0" / f"bad_{i:02d}.jpg").write_bytes(b"oops")
    dsc.compile_folder(src, tmp_path / "ds", size=8, workers=1)
    skip_list = tmp_path / "ds" / fmt.SKIP_LIST_FILE
    skip_list.write_bytes(b"\x00" * skip_list.stat().st_size)  # same size, unreadable as a skip list
    text = runner.invoke(app, ["info", str(tmp_path / "ds")])
    assert text.exit_code == 0, text.stderr
    assert f"{BAD} skipped:" in text.stdout
    assert "  class_0/bad_00.jpg: not a recognised image file" in text.stdout
    assert f"  ... and {BAD - SHOW_SKIPPED} more (dsc info --json lists them all)" in text.stdout
    every = runner.invoke(app, ["info", str(tmp_path / "ds"), "--json"])
    assert every.exit_code == 1 and fmt.SKIP_LIST_FILE in every.stderr  # the one that reads the file says so
