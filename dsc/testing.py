"""Helpers for round-trip tests in your own CI, the same ones dsc's test-suite uses.

- `make_image_folder` writes a small ImageFolder of real encoded files (varied sizes, a
  grayscale JPEG, an EXIF-rotated JPEG, a PNG with alpha), byte for byte the same for a seed.
- `pillow_reference` is an independent implementation of each fit policy of formats.md
  ("compile"): a full Pillow decode, EXIF transpose, alpha onto black, then Pillow's resize.
- `assert_roundtrip` checks a compiled dataset (or, asked with `compile_first=True`, compiles
  the folder first) record by record: label, original size and pixels against that reference,
  naming the worst offender.

Nothing here imports pytest: a failed check is a plain AssertionError, so the helpers work
under any test runner.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from dsc import format as fmt
from dsc import storage
from dsc.arguments import check_int, is_int
from dsc.compiler.discover import is_image_name
from dsc.compiler.labels import LABEL_COLUMN, SEPARATOR, read_table
from dsc.compiler.pipeline import compile_folder
from dsc.errors import ChecksumError
from dsc.reader import MemmapDataset

__all__ = ["make_image_folder", "pillow_reference", "assert_roundtrip", "RoundTrip", "MAX_MEAN_ABS_DIFF",
           "DEFAULT_MAX_MEAN_ABS_DIFF"]

# The per-record limit on the mean absolute difference (over all H·W·3 channel values, 0-255)
# between a record and `pillow_reference`, by the decode mode the manifest records. A faithful
# compile (the default: JPEGs decoded at full size) differs from Pillow only by the resize
# kernel's rounding: the README bounds it at 2.5 on real photos at every size (held by
# tests/test_fidelity.py; make_image_folder's pictures give 0.002-0.35). With fast_decode=True,
# sources 2-8x the target are first downscaled by libjpeg-turbo in the DCT domain, a box-like
# filter unlike Pillow's full-size bilinear, which costs up to ~5 on small synthetic images (3.9
# at the 99th percentile of a photo corpus at 224x224): 10 is twice that. It is not a bound on
# every record of detailed photos: the worst records of benchmarks/corpus.py's 1,500 images reach
# 13-15 at 24-32 px and 10.4-10.8 at 64-112 px (under 10 at 160 and 224), and the README's decode
# section gives ~20 at 32 px on real photos; such datasets need max_mean_abs_diff=20. Real errors
# give far more (measured on make_image_folder's pictures, 24-224 px records): another image's pixels
# > 21, a missed EXIF rotation > 49, swapped R and B > 25 (> 14 under pad, whose black border
# agrees anyway); test_compile.py: a wrong crop > 20. Both limits assume records of about 24 px a
# side or more: a 16 or 8 px record fast-decoded from sources 4-8x larger holds a few DCT
# blocks' worth of pixels, and honest differences then reach 12-20; pass a limit for such sizes.
MAX_MEAN_ABS_DIFF = {"faithful": 2.5, "fast": 10.0}
DEFAULT_MAX_MEAN_ABS_DIFF = MAX_MEAN_ABS_DIFF["fast"]  # the larger of the two, kept for older callers
EXTENSIONS = {"jpeg": ".jpg", "png": ".png", "bmp": ".bmp", "tiff": ".tif", "webp": ".webp"}
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "La", "RGBa"})
_FITS = ("center-crop", "stretch", "pad")


# ----------------------------------------------------------------------------- image folders

def _pattern(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth, asymmetric RGB picture (gradients + blobs): JPEG-friendly, orientation-revealing."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 6.28)
        out[..., c] = 127 + 90 * np.sin(fx * x / w * 6.28 + phase) * np.cos(fy * y / h * 3.14)
    out[: h // 4, : w // 3] = (250, 30, 30)  # a red corner marks the top-left
    return out.clip(0, 255).astype(np.uint8)


def _save(path: Path, array: np.ndarray, fmt: str = "JPEG", orientation: int = 1, **kw) -> Path:
    """Encode `array` (HxW gray, HxWx3 RGB or HxWx4 RGBA) to `path`; JPEGs get an EXIF orientation."""
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.fromarray(array)
    if fmt == "JPEG":
        kw.setdefault("quality", 92)
        if orientation != 1:
            exif = Image.Exif()
            exif[0x0112] = orientation
            kw["exif"] = exif.tobytes()
    img.save(path, fmt, **kw)
    return path


def _check_folder_options(classes: int, per_class: int, size: Any, formats: Any) -> None:
    for name, value in (("classes", classes), ("per_class", per_class)):
        check_int(name, value, 1)
    if (not isinstance(size, (tuple, list)) or len(size) != 2
            or not all(is_int(s) and s >= 1 for s in size)):
        raise ValueError(f"size must be (height, width), two positive integers, got {size!r}")
    if isinstance(formats, str) or not formats or any(f not in EXTENSIONS for f in formats):
        raise ValueError(f"formats must be a non-empty tuple drawn from {sorted(EXTENSIONS)}, got {formats!r}")


def _kind(k: int, n: int, formats: tuple[str, ...]) -> tuple[str, str]:
    """File k's (format, kind): the special files first, then formats in turn."""
    if "jpeg" in formats and k == 0:
        return "jpeg", "gray"
    if "jpeg" in formats and k == n - 1:
        return "jpeg", "rotated"
    first_png = next((j for j in range(1, n - 1) if formats[j % len(formats)] == "png"), None)
    return formats[k % len(formats)], "alpha" if k == first_png else "plain"


def _picture(kind: str, h: int, w: int, seed: int, orientation: int) -> np.ndarray:
    """The array to encode: upright (h, w), except a rotated file, which is stored sideways."""
    image = _pattern(h, w, seed)
    if kind == "gray":
        return image[..., 0]
    if kind == "alpha":  # opaque at the left edge, a quarter opaque at the right
        alpha = np.broadcast_to(np.linspace(255, 64, w).round().astype(np.uint8), (h, w))
        return np.dstack([image, alpha])
    if kind == "rotated":  # orientation 6 means "turn 90° clockwise to view": store it turned back
        return np.ascontiguousarray(np.rot90(image, 1 if orientation == 6 else -1))
    return image


def make_image_folder(path: str | os.PathLike, classes: int = 3, per_class: int = 4,
                      size: tuple[int, int] = (48, 64), formats: tuple[str, ...] = ("jpeg", "png"),
                      seed: int = 0) -> Path:
    """Write a small ImageFolder of real encoded images under `path` and return `path`.

    Class folders are `class_0`, `class_1`, ... (zero-padded beyond ten classes, so that
    label == folder number), each with `per_class` files `img_<i>[_<kind>].<ext>`. Every
    upright image is about `size` (height, width): each side drawn from [3/4, 3/2] of it, so
    the aspect ratio varies both ways. File k (class k // per_class) is in
    `formats[k % len(formats)]` (from "jpeg", "png", "bmp", "tiff", "webp"), except that when
    "jpeg" is among the formats the first file is a grayscale JPEG (`_gray`) and the last
    (with two or more files) a JPEG stored sideways with EXIF orientation 6 or 8
    (`_exif6`/`_exif8`); the first PNG that is neither the first nor the last file has an
    alpha channel (`_alpha`). The same arguments write the same bytes (with the same Pillow).
    """
    _check_folder_options(classes, per_class, size, formats)
    formats = tuple(formats)
    root = Path(path)
    rng = np.random.default_rng(seed)
    n, digits = classes * per_class, len(str(classes - 1))
    for k in range(n):
        c, i = divmod(k, per_class)
        h, w = (int(rng.integers(max(1, s * 3 // 4), s * 3 // 2 + 1)) for s in size)
        picture_seed, orientation = int(rng.integers(2**32)), int(rng.choice((6, 8)))
        form, kind = _kind(k, n, formats)
        suffix = {"plain": "", "rotated": f"_exif{orientation}"}.get(kind, f"_{kind}")
        target = root / f"class_{c:0{digits}d}" / f"img_{i}{suffix}{EXTENSIONS[form]}"
        _save(target, _picture(kind, h, w, picture_seed, orientation), form.upper(),
              orientation if kind == "rotated" else 1)
    return root


# ----------------------------------------------------------------------------- the reference

def _upright_rgb(path: Path, alpha: str = "black") -> Image.Image:
    """A full Pillow decode, EXIF transpose and colour rules of formats.md → an RGB image."""
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img)
    mode = img.mode
    if mode.startswith("I;16") or mode == "I":  # 16-bit samples keep their high byte
        a = np.asarray(img).astype(np.int64)
        if mode != "I" or a.max(initial=0) > 255:
            a = a >> 8
        return Image.fromarray(a.clip(0, 255).astype(np.uint8)).convert("RGB")
    if (mode in _ALPHA_MODES or "transparency" in img.info) and alpha != "drop":  # onto black or white
        rgba = np.asarray(img.convert("RGBA")).astype(np.uint32)
        rgb, a = rgba[..., :3], rgba[..., 3:]
        return Image.fromarray(((rgb * a + (255 * (255 - a) if alpha == "white" else 0) + 127) // 255)
                               .astype(np.uint8))
    return img.convert("RGBA").convert("RGB") if mode in _ALPHA_MODES else img.convert("RGB")


def _fit(img: Image.Image, height: int, width: int, fit: str) -> np.ndarray:
    """One fit policy of formats.md, in Pillow (BILINEAR, which antialiases when shrinking)."""
    w, h = img.size
    if fit == "stretch":
        return np.asarray(img.resize((width, height), Image.BILINEAR))
    if fit == "pad":
        k = min(height / h, width / w)
        ch, cw = min(height, max(1, round(h * k))), min(width, max(1, round(w * k)))
        canvas = Image.new("RGB", (width, height))
        canvas.paste(img.resize((cw, ch), Image.BILINEAR), ((width - cw) // 2, (height - ch) // 2))
        return np.asarray(canvas)
    if fit != "center-crop":
        raise ValueError(f"unknown fit {fit!r}; choose one of {', '.join(_FITS)}")
    if w * height > h * width:  # the centred box of the target's aspect, sides rounded
        bw, bh = max(1, min(w, round(h * width / height))), h
    else:
        bw, bh = w, max(1, min(h, round(w * height / width)))
    box = ((w - bw) // 2, (h - bh) // 2, (w - bw) // 2 + bw, (h - bh) // 2 + bh)
    return np.asarray(img.resize((width, height), Image.BILINEAR, box=box))


def pillow_reference(path: str | os.PathLike, height: int, width: int, fit: str = "center-crop",
                     alpha: str = "black") -> np.ndarray:
    """What a record of `path` should hold, made by Pillow alone: an (height, width, 3) uint8 array.

    It shares no code with the compiler: a full decode (no DCT scaling), `ImageOps.exif_transpose`,
    the colour rules of formats.md (alpha and colour keys composited onto black or white as `alpha`
    says, or dropped; 16-bit → high byte; anything else through Pillow's RGB conversion), then
    `fit` with Pillow's BILINEAR.
    """
    return _fit(_upright_rgb(Path(path), alpha), height, width, fit)


# ----------------------------------------------------------------------------- the round trip

@dataclass(frozen=True)
class RoundTrip:
    """What a passing `assert_roundtrip` measured, for logs: pixel differences are mean
    absolute differences per channel value against `pillow_reference`."""

    records: int
    mean_abs_diff: float
    worst_abs_diff: float
    worst_record: int
    worst_source: str


def _expected_label(source: str, classes: tuple[str, ...]) -> int | None:
    """The label a source's class folder gives it (-1 when unlabeled); None for no class."""
    if not classes:
        return fmt.UNLABELED
    folder = source.split("/")[0] if "/" in source else None
    return classes.index(folder) if folder in classes else None


def _table_rows(ds: MemmapDataset) -> dict[str, dict[str, Any]] | None:
    """The label table the dataset was compiled from (its manifest names it), as {source: {column: cell}}."""
    path = ds.manifest.compile.get("label_table")
    if not isinstance(path, str):
        return None
    source_root = ds.manifest.compile.get("source_root")
    table = read_table(path, source_root if isinstance(source_root, str) else None)  # absolute paths inside SRC
    return {source: {name: cells[row] for name, cells in table.columns.items()}
            for row, source in enumerate(table.sources)}


def _cell_items(cell: Any) -> list[str]:
    """A table cell's values as text, however the table wrote them (a JSON list, or ';'-separated)."""
    values = cell if isinstance(cell, list) else str(cell).split(SEPARATOR)
    return [str(v).strip() for v in values if str(v).strip()]


def _field_problems(ds: MemmapDataset, i: int, source: str, row: dict[str, Any]) -> list[str]:
    """Record i's label and fields against its row of the label table, value by value."""
    problems, label = [], int(ds.labels[i])
    named = ds.classes[label] if label != fmt.UNLABELED else str(label)  # an integer table's -1: no label
    if LABEL_COLUMN in row and named != _cell_items(row[LABEL_COLUMN])[0]:
        problems.append(f"record {i} ({source}): label {named!r}, but the table says {row[LABEL_COLUMN]!r}")
    for f in ds.manifest.fields:
        stored, cell = ds.fields[f.name][i], row[f.name]
        if f.kind == "class":
            ok = f.classes[int(stored)] == _cell_items(cell)[0]
        elif f.kind == "multilabel":
            ok = {f.classes[k] for k in np.flatnonzero(stored)} == set(_cell_items(cell))
        else:
            want = np.asarray([float(v) for v in _cell_items(cell)], dtype=f.dtype)
            ok = np.array_equal(np.atleast_1d(stored), want)
        if not ok:
            problems.append(f"record {i} ({source}): field {f.name!r} holds {stored!r}, but the table says {cell!r}")
    return problems


def _label_problems(ds: MemmapDataset, wrong: dict[tuple[int, int | None], list[int]]) -> list[str]:
    """One line per pair of stored label and the label the folder gives (a renamed class is one
    line, not one per record), naming its first record and how many more share it."""
    lines = []
    for (label, want), records in wrong.items():
        i, named = records[0], [f"{k} ({ds.classes[k]!r})" if k is not None and 0 <= k < len(ds.classes) else str(k)
                                for k in (label, want)]
        more = f" (and {len(records) - 1} more records like it)" if len(records) > 1 else ""
        lines.append(f"record {i} ({ds.opened.source(i)}): label {named[0]}, but its folder gives {named[1]}{more}")
    return lines


def _check_record(src: Path, ds: MemmapDataset, i: int, fit: str, alpha: str,
                  rows: dict[str, dict[str, Any]] | None) -> tuple[list[str], float, int | None]:
    """Record i's field and size problems, its pixels' mean abs diff from the reference, and the
    label its folder gives when the stored one differs (else the stored label)."""
    opened, (height, width, _) = ds.opened, ds.record_shape
    source, problems = opened.source(i), []
    image, label = ds[i]
    if rows is not None:
        problems += _field_problems(ds, i, source, rows[source]) if source in rows else \
            [f"record {i} ({source}): not listed in the label table"]
    want = label if rows is not None else _expected_label(source, ds.manifest.classes)
    try:
        upright = _upright_rgb(src / source, alpha)
    except OSError as e:  # missing, unreadable, or not an image to Pillow
        return problems + [f"record {i} ({source}): no reference, Pillow cannot open the source: {e}"], np.inf, want
    if tuple(opened.sizes[i]) != upright.size[::-1]:
        problems.append(f"record {i} ({source}): recorded size {tuple(map(int, opened.sizes[i]))}, "
                        f"but the upright source is {upright.size[::-1]} (height, width)")
    got = image.permute(1, 2, 0).numpy().astype(np.int16)
    return problems, float(np.abs(got - _fit(upright, height, width, fit)).mean()), want


def _uncovered_sources(src: Path, ds: MemmapDataset, rows: dict[str, dict[str, Any]] | None) -> list[str]:
    """Image files under `src` (none of the path hidden; only those the label table lists, if any)
    that are neither a record nor listed as skipped (themselves, or their skipped class folder)."""
    covered = {ds.opened.source(i) for i in range(len(ds))}
    skipped = {s["source"] for s in storage.read_skipped(ds.path, ds.manifest)}  # undecodable name bytes as \xNN
    found = [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]
    images = [s for s in found if is_image_name(s.rsplit("/", 1)[-1]) and "/." not in f"/{s}"]
    if rows is not None:
        images = sorted(rows)
    printable = {s: os.fsencode(s).decode("utf-8", "backslashreplace") for s in images}
    return sorted(s for s in images if s not in covered and printable[s] not in skipped
                  and printable[s].split("/")[0] not in skipped)


def _recorded_policy(ds: MemmapDataset) -> tuple[str, str, str, list[str]]:
    """The fit policy, alpha rule and decode mode the manifest records, and any disagreement with
    the record shape or the format's names."""
    compiled, (height, width, _) = ds.manifest.compile, ds.record_shape
    fit, size = compiled.get("fit"), compiled.get("size")
    decode = compiled.get("decode", fmt.DECODE_MODE_UNRECORDED)
    alpha = {text: name for name, text in fmt.ALPHA.items()}.get(compiled.get("alpha"))
    problems = [] if alpha else [f"manifest 'compile' records alpha {compiled.get('alpha')!r}, not one of "
                                 f"{', '.join(map(repr, fmt.ALPHA.values()))}"]
    if fit not in _FITS:
        problems.append(f"manifest 'compile' records fit {fit!r}, not one of {', '.join(_FITS)}")
    if decode not in MAX_MEAN_ABS_DIFF:
        problems.append(f"manifest 'compile' records decode {decode!r}, not one of {', '.join(MAX_MEAN_ABS_DIFF)}")
    if size != [height, width]:
        problems.append(f"manifest 'compile' records size {size!r}, but records are {height}x{width}")
    return ((fit if fit in _FITS else "center-crop"), alpha or "black",
            (decode if decode in MAX_MEAN_ABS_DIFF else "fast"), problems)


def _check_dataset(src: Path, out: Path, limit: float | None) -> RoundTrip:
    ds = MemmapDataset(out)
    fit, alpha, decode, problems = _recorded_policy(ds)
    limit = MAX_MEAN_ABS_DIFF[decode] if limit is None else limit
    rows = _table_rows(ds)
    diffs, wrong = np.zeros(len(ds)), {}
    for i in range(len(ds)):
        record_problems, diffs[i], want = _check_record(src, ds, i, fit, alpha, rows)
        problems += record_problems
        if want != (label := int(ds.opened.labels[i])):
            wrong.setdefault((label, want), []).append(i)
    problems += _label_problems(ds, wrong)
    worst = int(np.argmax(diffs))
    over = int(np.sum(diffs > limit))
    if over:
        problems.append(f"{over} of {len(ds)} records differ from pillow_reference by more than the limit; worst: "
                        f"record {worst} ({ds.opened.source(worst)}), mean abs diff {diffs[worst]:.2f} "
                        f"> max_mean_abs_diff {limit}")
    sources = [ds.opened.source(i) for i in range(len(ds))]
    if len(set(sources)) != len(sources):
        problems.append(f"{len(sources) - len(set(sources))} sources are compiled more than once")
    problems += [f"{s}: found in {src} but neither a record nor listed in 'skipped'"
                 for s in _uncovered_sources(src, ds, rows)]
    try:
        storage.verify_checksums(out, ds.manifest)
    except ChecksumError as e:
        problems.append(str(e))
    if problems:
        h, w, _ = ds.record_shape
        raise AssertionError(f"dsc round trip {src} -> {out} ({len(ds)} records, {fit} to {h}x{w}) failed:\n- "
                             + "\n- ".join(problems))
    return RoundTrip(len(ds), float(diffs.mean()), float(diffs[worst]), worst, ds.opened.source(worst))


def assert_roundtrip(src: str | os.PathLike, out: str | os.PathLike | None = None, *, compile_first: bool = False,
                     max_mean_abs_diff: float | None = None, **compile_options: Any) -> RoundTrip:
    """Check the dataset at `out` record by record against its sources in `src`.

    Checking and compiling are apart, so that a CI check pointed at the wrong path fails instead
    of compiling a dataset nobody ships: `out` must hold a dataset, unless `compile_first=True`
    asks to compile `src` into it first with `compile_options` (`dsc.compile_folder`'s: size,
    fit, seed, workers, force, ...; with `out=None`, into a temporary folder removed afterwards).
    A missing `out` fails the check (AssertionError); one that is not a valid dataset raises
    dsc.DatasetError; compile options without `compile_first` are a ValueError.

    Checked, against the sources in `src` (each record's source path is relative to it):
    every record's label is its class folder's index in `classes` (-1 when unlabeled) or, for a
    dataset compiled from a label table (the manifest names it), its label and every field hold
    what the record's row of the table says; its recorded size is the source's upright
    (height, width); its pixels are within `max_mean_abs_diff` mean absolute difference per
    channel value (0-255) of `pillow_reference` with the size and fit the manifest records. The
    default limit follows the manifest's decode mode (MAX_MEAN_ABS_DIFF: 2.5 for a faithful
    compile, 10 for fast_decode), below what a wrong crop, a missed rotation, swapped colours or
    another image's pixels cause (> 14). The fast limit is not a bound: fast-decoded records of
    detailed photos under ~160 px a side reach 13-20 (README, dsc.testing), and records under
    ~24 px a side from much larger sources more; raise it for them (e.g. 20). Also: every image
    file under `src` (outside hidden folders; only those a label table lists) is a record or
    listed in the manifest's "skipped", no source is compiled twice, and every file (the
    manifest's own content included) matches its checksum.

    Raises AssertionError listing every failed check, naming the worst pixel offender (record,
    source, its difference and the limit) and each wrong label once per pair of class folder and
    stored label. Returns a `RoundTrip` with the measured differences.
    """
    if compile_options and not compile_first:
        raise ValueError(f"compile options {sorted(compile_options)} given without compile_first=True: "
                         "assert_roundtrip only checks an existing dataset unless asked to compile it first")
    if out is None:
        if not compile_first:
            raise ValueError("no dataset to check: give out=, or compile_first=True to compile src into a "
                             "temporary folder")
        with tempfile.TemporaryDirectory(prefix="dsc-roundtrip-") as tmp:
            return assert_roundtrip(src, Path(tmp) / "out", compile_first=True, max_mean_abs_diff=max_mean_abs_diff,
                                    **compile_options)
    src, out = Path(src), Path(out)
    if compile_first:
        compile_folder(src, out, **compile_options)
    elif not os.path.lexists(out):
        raise AssertionError(f"dsc round trip {src} -> {out} failed: {out} does not exist, so there is no "
                             "dataset to check (compile_first=True compiles it first)")
    return _check_dataset(src, out, max_mean_abs_diff)
