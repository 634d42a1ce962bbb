"""Look at a compiled dataset: the summary `dsc info` shows.

It starts from `storage.open_dataset`, so whatever it reports has passed validation (the index values
it reads, as it reads them; a large dataset's are read only when asked: `summary(counts=...)`); `dsc
verify` goes further (`storage.verify_checksums`, and `recheck` for records against sources).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from dsc import format as fmt
from dsc import storage
from dsc.errors import DatasetError

COUNT_PIECE = 1 << 22  # labels counted at a time (32 MiB of int64)
COUNTED_UNASKED = 10_000_000  # records whose values `summary` reads unasked: ~0.1 s of labels; more only if asked


def summary(path: str | os.PathLike, every_skip: bool = True, version: int | None = None,
            counts: bool | None = None) -> dict[str, Any]:
    """Everything `dsc info` shows, as plain JSON-able values. `every_skip=False` lists only the skipped
    sources the manifest holds (the first SKIPPED_IN_MANIFEST), without reading the skip list file,
    whose size grows with the skips; "skipped_count" counts them all either way. `version`: which version
    of a grown dataset (format 1.3) [default: the latest].

    `counts`: whether to read every record's values — records per class ("classes", "unlabeled"), per
    field class or range ("fields"), the records with decoder warnings ("warned") — which is linear in the
    records (0.8 GB of labels at 10^8); None: only up to COUNTED_UNASKED records. Not read, those are None
    (a field's summary without counts or range) and "counted" is False. Opening reads no index value either:
    the values read are checked as they are (`storage.OpenedDataset`)."""
    d = storage.open_dataset(path, version=version, check_values=False)
    m = d.manifest
    counted = m.count <= COUNTED_UNASKED if counts is None else counts
    try:
        stored, damaged = storage.class_counts(d.root, m), None  # (1.5) each segment's, summed: no label is read
    except DatasetError as e:  # a summary file damaged: the labels (checked as read) are counted instead
        stored, damaged = None, str(e)
    if stored is not None:
        per_class, unlabeled = stored[1:], int(stored[0])
    else:
        per_class, unlabeled = _label_counts(d.labels, len(m.classes)) if counted else ([None] * len(m.classes), None)
    return {
        "path": os.fspath(path) if storage.is_url(path) else str(Path(path).absolute()),
        "format_version": m.version, "records": m.count,
        "record_shape": list(m.record_shape), "dtype": "uint8", "labeled": m.labeled,
        "counted": counted,
        "stored_counts_problem": damaged,  # (1.5) why the stored class counts were not used, or None
        "classes": {name: None if n is None else int(n) for name, n in zip(m.classes, per_class)},
        "unlabeled": unlabeled,  # label -1: every record of an unlabeled dataset
        "skipped": storage.read_skipped(d.root, m) if every_skip else [dict(s) for s in m.skipped],
        "skipped_count": m.skipped_count,
        "warned": [{"record": int(i), "source": d.source(int(i)), "warnings": int(n)}
                   for i, n in zip(*_warned(storage.read_warnings(d.root, m)))] if counted else None,
        # a warnings file is written only when some record of its segment has a decoder warning
        "has_warnings": any(s.warnings is not None for s in m.index_segments),
        "shards": len(m.shards), "records_per_shard": m.records_per_shard,
        "bytes_on_disk": d.stored_bytes,
        "jpeg_decoder": m.compile.get("jpeg_decoder"), "compile": m.compile,
        "fields": [field_summary(f, d.fields[f.name] if counted else None) for f in m.fields],
        "version": m.dataset_version,  # format 1.3: the version shown, and every one kept
        "versions": storage.dataset_versions(path),
        "parts": [{"first": p.first, "count": p.count, "source_root": p.compile.get("source_root"),
                   "compile": p.compile} for p in m.record_parts],  # (1.3) what each compile, append, merge input made
    }


def _label_counts(labels: np.ndarray, classes: int) -> tuple[np.ndarray, int]:
    """Records per class and records without a label (-1), counted a piece of the mapped labels at a
    time: memory stays bounded however many records there are (a mask and a copy of all of them took
    9 bytes a record). Labels are checked at open to lie in [-1, classes - 1], so label + 1 counts the
    unlabeled in bin 0 in the same pass (a mask and its copy per piece took twice as long)."""
    counts = np.zeros(classes + 1, np.int64)
    for start in range(0, len(labels), COUNT_PIECE):
        counts += np.bincount(np.asarray(labels[start:start + COUNT_PIECE]) + 1, minlength=classes + 1)
    return counts[1:], int(counts[0])


def _warned(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The records with decoder warnings, and how many each."""
    records = np.flatnonzero(counts)
    return records, counts[records]


def field_summary(entry: fmt.FieldEntry, values: ArrayLike | None) -> dict[str, Any]:
    """A field's kind, dtype, shape and vocabulary, and what its values span: the range of numbers,
    or how many records have each class (for multilabel: each tag); `values` None: not read, not said."""
    about: dict[str, Any] = {"name": entry.name, "kind": entry.kind, "dtype": entry.dtype.name,
                             "shape": list(entry.shape), "classes": list(entry.classes)}
    if values is None:
        return about
    values = np.asarray(values)  # an appended dataset's column (`storage.columns.Column`) joined
    if entry.kind == "class":
        about["counts"] = np.bincount(values, minlength=len(entry.classes)).tolist()
    elif entry.kind == "multilabel":
        about["counts"] = values.sum(axis=0, dtype=np.int64).tolist()
    elif values.size:
        about["min"], about["max"] = values.min().item(), values.max().item()
    return about
