"""`verify` of a sparse file (issue 27, point 8): dsc never writes a hole, so one is damage, found with
SEEK_HOLE before any byte is hashed — a sparse shard claiming terabytes would be hashed for hours."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import dsc
from dsc import format as fmt
from dsc import storage
from dsc.cli import app
from dsc.errors import ChecksumError

from conftest import save

runner = CliRunner(env={"COLUMNS": "250", "TERMINAL_WIDTH": "250", "NO_COLOR": "1"})
RECORDS = 64  # of 32x32x3: a 192 KiB shard of zeros, many file system blocks


def _sparse_copy_in_place(path: Path) -> None:
    """Rewrite an all-zero file as a sparse one holding the same bytes: only its last byte is written."""
    size = path.stat().st_size
    assert path.read_bytes() == bytes(size)
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(size - 1)
        f.seek(size - 1)
        f.write(b"\0")
    assert path.read_bytes() == bytes(size)


@pytest.fixture
def black(tmp_path: Path) -> Path:
    """A dataset of black records (every shard byte zero), its shard made sparse with the same bytes, so
    that its SHA-256 still matches the manifest: only the hole betrays it."""
    for i in range(RECORDS):
        save(tmp_path / "src" / f"{i:03d}.png", np.zeros((32, 32, 3), np.uint8), "PNG")
    dsc.compile_folder(tmp_path / "src", tmp_path / "ds", size=32, workers=1)
    shard = tmp_path / "ds" / fmt.shard_file(0)
    storage.verify_checksums(tmp_path / "ds", storage.parse_manifest(tmp_path / "ds"))  # as compiled: no hole
    _sparse_copy_in_place(shard)
    with open(shard, "rb") as f:
        if os.lseek(f.fileno(), 0, os.SEEK_HOLE) == shard.stat().st_size:
            pytest.skip("this file system stores no holes")
    return tmp_path / "ds"


def test_a_hole_is_damage_found_before_hashing(black: Path) -> None:
    hashed = []
    with pytest.raises(ChecksumError, match=rf"{fmt.shard_file(0)}: a hole \(bytes never written\) at byte 0 of "
                                            r"196,608; dsc never writes sparse files"):
        storage.verify_checksums(black, storage.parse_manifest(black), progress=hashed.append)
    assert hashed == []  # refused before a byte was hashed


def test_verify_names_the_hole_in_one_line(black: Path) -> None:
    result = runner.invoke(app, ["verify", str(black)])
    assert result.exit_code == 1
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(f"error: {black / fmt.shard_file(0)}: a hole (bytes never written) at byte 0")
