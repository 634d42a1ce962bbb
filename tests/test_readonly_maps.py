"""Shards are mapped read-only and shared (issue 27, point 6): no commit charge, so a dataset larger
than RAM + swap maps under strict overcommit; `ds[i]` is a copy an in-place edit cannot carry to the file."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsc import format as fmt

from conftest import tiny_dataset

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _permissions(path: Path) -> set[str]:
    """The permissions of every mapping of `path` in this process (e.g. 'r--s')."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == str(path):
                found.add(fields[1])
    return found


def test_shards_are_mapped_read_only_and_shared(tmp_path: Path) -> None:
    ds = tiny_dataset(tmp_path, seed=0, records_per_shard=10)
    shards = [tmp_path / "ds" / s.file for s in ds.manifest.shards]
    assert len(shards) == 3
    assert [_permissions(p.resolve()) for p in shards] == [{"r--s"}] * 3


def test_an_in_place_edit_of_a_record_never_reaches_the_file(tmp_path: Path) -> None:
    ds = tiny_dataset(tmp_path, seed=0, records_per_shard=10)
    shard_file = tmp_path / "ds" / fmt.shard_file(1)
    before = shard_file.read_bytes()
    image, _ = ds[12]
    original = image.clone()
    image.fill_(7)  # would crash (SIGSEGV) on a view of a read-only map; on a copy it is the caller's own
    assert torch.equal(ds[12].image, original) and not torch.equal(original, image)
    assert shard_file.read_bytes() == before
    with pytest.raises(ValueError, match="read-only"):
        ds.opened.shards[1][2] = 0  # the map itself refuses writes


def test_batches_still_come_out_of_the_maps(tmp_path: Path) -> None:
    ds = tiny_dataset(tmp_path, seed=0, records_per_shard=10)
    batch = ds.__getitems__([3, 12, 23])
    expected = np.stack([ds.opened.shards[i // 10][i % 10] for i in (3, 12, 23)])
    assert np.array_equal(batch.images.permute(0, 2, 3, 1).numpy(), expected)
    assert torch.equal(batch.images[1], ds[12].image)
