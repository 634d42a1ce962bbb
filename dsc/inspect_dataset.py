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
from dsc.compiler.resize import Target
from dsc.compiler.write import compile_image
from dsc.errors import ImageError


def summary(path: str | os.PathLike) -> dict[str, Any]:
    """Everything `dsc info` shows, as plain JSON-able values."""
    d = fmt.open_dataset(path)
    m = d.manifest
    counts = np.bincount(d.labels[d.labels >= 0], minlength=len(m.classes)) if m.classes else []
    files = [*m.shards, *m.index.values()]
    return {
        "path": str(Path(path).absolute()), "format_version": m.version, "records": m.count,
        "record_shape": list(m.record_shape), "dtype": "uint8", "labeled": m.labeled,
        "classes": {name: int(n) for name, n in zip(m.classes, counts)},
        "skipped": [dict(s) for s in m.skipped],
        "shards": len(m.shards), "records_per_shard": m.records_per_shard,
        "bytes_on_disk": sum(f.bytes for f in files) + (d.root / fmt.MANIFEST_FILE).stat().st_size,
        "jpeg_decoder": m.compile.get("jpeg_decoder"), "compile": m.compile,
    }


@dataclass(frozen=True)
class DecodeCheck:
    """How records compare with a fresh compile of their sources (`dsc verify --decode N`)."""

    checked: int
    missing: list[str]  # sources no longer there (or no longer decodable)
    worst_record: int | None = None
    worst_source: str = ""
    worst_max_abs: int = 0
    worst_mean_abs: float = 0.0


def check_against_sources(path: str | os.PathLike, n: int, seed: int = 0) -> DecodeCheck:
    """Re-decode `n` random records from their source files and compare with the stored pixels."""
    d = fmt.open_dataset(path)
    m = d.manifest
    root = m.compile.get("source_root")
    size, fit = m.compile.get("size", [m.height, m.width]), m.compile.get("fit", "center-crop")
    target = Target(int(size[0]), int(size[1]), str(fit))
    picks = np.random.default_rng(seed).choice(m.count, size=min(n, m.count), replace=False)
    fresh = np.empty(m.record_shape, np.uint8)
    missing, worst = [], DecodeCheck(0, [])
    for i in sorted(int(i) for i in picks):
        source = d.source(i)
        try:
            compile_image(os.path.join(str(root), source), target, fresh, int(m.compile.get("max_pixels", 1 << 62)))
        except (ImageError, TypeError) as e:
            missing.append(f"{source} ({e})")
            continue
        shard, pos = fmt.locate(i, m.records_per_shard)
        diff = np.abs(fresh.astype(np.int16) - d.shards[shard][pos])
        if worst.worst_record is None or diff.max() > worst.worst_max_abs:
            worst = DecodeCheck(0, [], i, source, int(diff.max()), float(diff.mean()))
    return DecodeCheck(len(picks) - len(missing), missing, worst.worst_record, worst.worst_source,
                       worst.worst_max_abs, worst.worst_mean_abs)
