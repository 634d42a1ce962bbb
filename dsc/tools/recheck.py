"""Records against their sources (`dsc verify --decode N`): decode N random records again, as the
compiler did, and compare with the stored pixels. It runs the compiler's decoding (and torch)."""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

import numpy as np

from dsc import format as fmt
from dsc import storage
from dsc.arguments import is_int
from dsc.compiler import sources
from dsc.compiler.target import FITS, Target
from dsc.compiler.write import compile_data, compile_image, max_file_bytes
from dsc.errors import DatasetError, ImageError


@dataclass(frozen=True)
class DecodeCheck:
    """How records compare with a fresh compile of their sources (`dsc verify --decode N`)."""

    checked: int
    missing: list[str]  # sources no longer there (or no longer decodable)
    worst_record: int | None = None
    worst_source: str = ""
    worst_max_abs: int = 0
    worst_mean_abs: float = 0.0


def _recipe(d: storage.OpenedDataset, c: dict) -> tuple[str, Target, int, str, str]:
    """(source root, target, max_pixels, decode mode, alpha) as a "compile" object records them, checked; the
    source root is the dataset's own (format 1.3: every part's sources are named relative to it)."""
    m = d.manifest
    root, size, fit, max_pixels = m.compile.get("source_root"), c.get("size"), c.get("fit"), c.get("max_pixels")
    mode = c.get("decode", fmt.DECODE_MODE_UNRECORDED)
    alpha = {text: name for name, text in fmt.ALPHA.items()}.get(c.get("alpha"))
    ok = (isinstance(root, str) and isinstance(size, list) and size == [m.height, m.width]
          and fit in FITS and is_int(max_pixels) and max_pixels > 0
          and mode in fmt.DECODE_MODES and alpha is not None)
    if not ok:
        raise DatasetError(f"{d.root / fmt.MANIFEST_FILE}: 'compile' does not say how the records were made "
                           "(source_root, size, fit, max_pixels, decode, alpha), so they cannot be decoded again")
    return root, Target(m.height, m.width, fit), max_pixels, mode, alpha


def _under_own_root(whole: str, part_root) -> tuple[str, str]:
    """A whole source (`fmt.is_whole_source`) as (its part's source root, the path under it): archive members
    (`ARCHIVE#MEMBER`) and objects of a bucket's image folder are read relative to the root they were listed in."""
    if isinstance(part_root, str) and whole.startswith(f"{part_root.rstrip('/')}/"):
        return part_root, whole[len(part_root.rstrip("/")) + 1:]
    head, _, tail = whole.rpartition("/")
    return head, tail


def check_against_sources(path: str | os.PathLike, n: int, seed: int = 0) -> DecodeCheck:
    """Re-decode `n` random records from their source files (or archive members), each as the compile that
    made it did (an appended or merged dataset's parts may differ), and compare with the stored pixels."""
    d = storage.open_dataset(path)
    m = d.manifest
    parts = m.record_parts
    recipes = [_recipe(d, p.compile) for p in parts]
    firsts = [p.first for p in parts]
    picks = np.random.default_rng(seed).choice(m.count, size=min(n, m.count), replace=False)
    fresh = np.empty(m.record_shape, np.uint8)
    missing, worst = [], DecodeCheck(0, [])
    for i in sorted(int(i) for i in picks):
        source, part = d.source(i), bisect.bisect_right(firsts, i) - 1
        root, target, max_pixels, mode, alpha = recipes[part]
        if fmt.is_whole_source(source):  # a part from another kind of root: under its own
            root, source = _under_own_root(source, parts[part].compile.get("source_root"))
        try:
            member = sources.read_source(root, source, max_file_bytes(max_pixels))
            if member is None:
                compile_image(os.path.join(root, source), target, fresh, max_pixels, mode, alpha)
            else:
                compile_data(member, target, fresh, max_pixels, mode, alpha)
        except ImageError as e:
            missing.append(f"{source} ({e})")
            continue
        diff = np.abs(fresh.astype(np.int16) - d.read_records([i])[0])
        if worst.worst_record is None or diff.max() > worst.worst_max_abs:
            worst = DecodeCheck(0, [], i, source, int(diff.max()), float(diff.mean()))
    return DecodeCheck(len(picks) - len(missing), missing, worst.worst_record, worst.worst_source,
                       worst.worst_max_abs, worst.worst_mean_abs)
