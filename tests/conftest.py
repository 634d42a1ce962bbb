"""Shared fixtures: small real image files written by Pillow (`pattern`, `save` and the Pillow
reference of each fit policy live in dsc.testing, which users' own CI uses too)."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from dsc import format as fmt
from dsc.boxes import ATTEMPTS
from dsc.testing import _pattern as pattern
from dsc.testing import _save as save
from dsc.testing import pillow_reference

# the tests import these from here
__all__ = ["pattern", "save", "pillow_reference", "make_folder", "ref_box", "tiny_dataset", "SLEEP_CYCLES"]
SLEEP_CYCLES = 20_000_000  # tens of milliseconds of GPU time (torch.cuda._sleep spins this many cycles)


def make_folder(root: Path, classes: int = 3, per_class: int = 4, seed: int = 0,
                sides: tuple[int, int] = (40, 120)) -> Path:
    """An ImageFolder of real JPEG and PNG files with varied sizes: the suite's fixed layout, on which
    test_compile's LIMITS were measured (users get dsc.testing.make_image_folder)."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(*sides, size=2))
            arr = pattern(h, w, seed=seed * 1000 + c * 100 + i)
            if i % 4 == 3:
                save(root / f"class_{c}" / f"img_{i}.png", arr, "PNG")
            else:
                save(root / f"class_{c}" / f"img_{i}.jpg", arr)
    return root


def tiny_dataset(root: Path, seed: int, records_per_shard: int):
    """24 records of 8x8 (3 classes of 8 real images) compiled under root/ds: for the loader's tests."""
    import dsc
    from dsc.reader import MemmapDataset
    from dsc.testing import make_image_folder

    make_image_folder(root / "src", classes=3, per_class=8, size=(24, 32), seed=seed)
    dsc.compile_folder(root / "src", root / "ds", size=(8, 8), records_per_shard=records_per_shard, workers=1)
    return MemmapDataset(root / "ds")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src")


def ref_box(draws: torch.Tensor, height: int, width: int, scale, ratio) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params for one image, fed the given draws."""
    for k in range(ATTEMPTS):
        area = height * width * float(draws[k])
        aspect = math.exp(float(draws[ATTEMPTS + k]))
        w, h = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(draws[-2] * (height - h + 1)), int(draws[-1] * (width - w + 1)), h, w
    if width / height < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif width / height > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        h, w = height, width
    return (height - h) // 2, (width - w) // 2, h, w


def whole_index_doc(doc: dict) -> dict:
    """Manifest JSON of one index segment (format 1.5, as a compile writes it) as 1.4 and before wrote it: the
    segment's files as the whole dataset's `index`, `checksums`, `warnings` and fields' files; version 1.4."""
    doc = dict(doc)
    (segment,) = doc.pop("segments")
    doc["index"] = segment["index"]
    doc["checksums"] = segment["checksums"]
    if "warnings" in segment:
        doc["warnings"] = segment["warnings"]
    doc["fields"] = [{**f, **e} for f, e in zip(doc["fields"], segment["fields"])]
    return {**doc, "version": "1.4"}


def listed_shards_doc(root: Path) -> dict:
    """The dataset's manifest as format 1.3 wrote it, every shard listed in it (1.4 keeps their digests in a
    shard table), its index whole (1.5 keeps it in segments): what a test that edits a shard's or an index
    file's entry starts from; dsc still reads 1.3."""
    import dataclasses

    from dsc import storage

    doc = whole_index_doc(json.loads((root / fmt.MANIFEST_FILE).read_text()))
    doc.pop("shard_tables", None)
    return {**doc, "version": "1.3", "shards": [dataclasses.asdict(s) for s in storage.parse_manifest(root).shards]}


def rewrite_manifest(root: Path, doc: dict) -> None:
    """Write `doc` as the dataset's manifest with its own checksum made to agree, as a careful
    forger would: only the checks beyond that checksum can then catch what was changed."""
    doc = {**doc, fmt.SEAL_KEY: "0" * 64}
    (root / fmt.MANIFEST_FILE).write_text(fmt.sealed(json.dumps(doc, ensure_ascii=True)))


def in_forked_child(work: Callable[[], str], limit_s: int = 60) -> tuple[int, str]:
    """(wait status, what `work()` returned or "error: ...") of `work` run in a child forked now, which
    SIGALRM ends after `limit_s` (a child that would wait forever fails the test instead)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(limit_s)
        try:
            os.write(write, work().encode())
        except BaseException as e:
            os.write(write, f"error: {e}".encode())
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        return status, f.read().decode()
