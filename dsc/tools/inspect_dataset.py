"""Look at a compiled dataset: a summary (`dsc info`) and a full check (`dsc verify`).

Both start from `format.open_dataset`, so whatever they report has passed validation; the
checks here go further: every byte against its checksum, and records against their sources.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.arguments import is_int
from dsc.compiler.resize import FITS, Target
from dsc.compiler.write import compile_image
from dsc.errors import DatasetError, ImageError


def summary(path: str | os.PathLike) -> dict[str, Any]:
    """Everything `dsc info` shows, as plain JSON-able values."""
    d = storage.open_dataset(path)
    m = d.manifest
    counts = np.bincount(d.labels[d.labels >= 0], minlength=len(m.classes)) if m.classes else []
    return {
        "path": str(Path(path).absolute()), "format_version": m.version, "records": m.count,
        "record_shape": list(m.record_shape), "dtype": "uint8", "labeled": m.labeled,
        "classes": {name: int(n) for name, n in zip(m.classes, counts)},
        "skipped": storage.read_skipped(d.root, m),
        "shards": len(m.shards), "records_per_shard": m.records_per_shard,
        "bytes_on_disk": sum(f.bytes for f in m.files) + (d.root / fmt.MANIFEST_FILE).stat().st_size,
        "jpeg_decoder": m.compile.get("jpeg_decoder"), "compile": m.compile,
        "fields": [field_summary(f, d.fields[f.name]) for f in m.fields],
    }


def field_summary(entry: fmt.FieldEntry, values: np.ndarray) -> dict[str, Any]:
    """A field's kind, dtype, shape and vocabulary, and what its values span: the range of numbers,
    or how many records have each class (for multilabel: each tag)."""
    about: dict[str, Any] = {"name": entry.name, "kind": entry.kind, "dtype": entry.dtype.name,
                             "shape": list(entry.shape), "classes": list(entry.classes)}
    if entry.kind == "class":
        about["counts"] = np.bincount(values, minlength=len(entry.classes)).tolist()
    elif entry.kind == "multilabel":
        about["counts"] = values.sum(axis=0, dtype=np.int64).tolist()
    elif values.size:
        about["min"], about["max"] = values.min().item(), values.max().item()
    return about


@dataclass(frozen=True)
class DecodeCheck:
    """How records compare with a fresh compile of their sources (`dsc verify --decode N`)."""

    checked: int
    missing: list[str]  # sources no longer there (or no longer decodable)
    worst_record: int | None = None
    worst_source: str = ""
    worst_max_abs: int = 0
    worst_mean_abs: float = 0.0


def _recipe(d: storage.OpenedDataset) -> tuple[str, Target, int, str]:
    """(source root, target, max_pixels, decode mode) as the manifest's "compile" records them, checked."""
    c, m = d.manifest.compile, d.manifest
    root, size, fit, max_pixels = c.get("source_root"), c.get("size"), c.get("fit"), c.get("max_pixels")
    mode = c.get("decode", fmt.DECODE_MODE_UNRECORDED)
    ok = (isinstance(root, str) and isinstance(size, list) and size == [m.height, m.width]
          and fit in FITS and is_int(max_pixels) and max_pixels > 0
          and mode in fmt.DECODE_MODES)
    if not ok:
        raise DatasetError(f"{d.root / fmt.MANIFEST_FILE}: 'compile' does not say how the records were made "
                           "(source_root, size, fit, max_pixels, decode), so they cannot be decoded again")
    return root, Target(m.height, m.width, fit), max_pixels, mode


def check_against_sources(path: str | os.PathLike, n: int, seed: int = 0) -> DecodeCheck:
    """Re-decode `n` random records from their source files and compare with the stored pixels."""
    d = storage.open_dataset(path)
    m = d.manifest
    root, target, max_pixels, mode = _recipe(d)
    picks = np.random.default_rng(seed).choice(m.count, size=min(n, m.count), replace=False)
    fresh = np.empty(m.record_shape, np.uint8)
    missing, worst = [], DecodeCheck(0, [])
    for i in sorted(int(i) for i in picks):
        source = d.source(i)
        try:
            compile_image(os.path.join(root, source), target, fresh, max_pixels, mode)
        except ImageError as e:
            missing.append(f"{source} ({e})")
            continue
        shard, pos = fmt.locate(i, m.records_per_shard)
        diff = np.abs(fresh.astype(np.int16) - d.shards[shard][pos])
        if worst.worst_record is None or diff.max() > worst.worst_max_abs:
            worst = DecodeCheck(0, [], i, source, int(diff.max()), float(diff.mean()))
    return DecodeCheck(len(picks) - len(missing), missing, worst.worst_record, worst.worst_source,
                       worst.worst_max_abs, worst.worst_mean_abs)
