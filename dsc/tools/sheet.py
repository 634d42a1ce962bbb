"""Contact sheets (`dsc show`): a grid of records with their index, label and fields, to check a compile by eye.

People look at data: a sheet shows at once whether the crop, the rotation and the colours are
what was meant.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from dsc import storage
from dsc.errors import DscError

CAPTION_HEIGHT = 14  # pixels under each tile per caption line: "#index label", then one per field
MAX_TILES = 1024  # records on one sheet: more are not looked at, and the sheet must fit in memory
MAX_SHEET_PIXELS = 1 << 28  # ~0.8 GB as RGB: larger records make fewer tiles fit
MAX_CAPTION_CHARS = 40


def caption_lines(d: storage.OpenedDataset, i: int) -> list[str]:
    """What a tile says about record i: its index and label, then `name=value` for each field
    (class names for class and multilabel fields, numbers otherwise)."""
    m = d.manifest
    label = int(d.labels[i])
    lines = [f"#{i} {m.classes[label] if label >= 0 else 'unlabeled'}"]
    for f in m.fields:
        value = d.fields[f.name][i]
        if f.kind == "class":
            text = f.classes[int(value)]
        elif f.kind == "multilabel":
            text = "+".join(f.classes[k] for k in np.flatnonzero(value)) or "-"
        else:
            text = ",".join(f"{v:.4g}" if f.kind == "float" else str(v) for v in np.atleast_1d(value).tolist())
        line = f"{f.name}={text}"
        lines.append(line if len(line) <= MAX_CAPTION_CHARS else line[:MAX_CAPTION_CHARS - 3] + "...")
    return lines


def pick_records(d: storage.OpenedDataset, n: int, indices: Sequence[int] | None = None,
                 class_name: str | None = None, seed: int = 0) -> list[int]:
    """Which records to show: the given indices, else `n` seeded random ones (of one class if asked)."""
    m = d.manifest
    if indices:
        bad = [i for i in indices if not 0 <= i < m.count]
        if bad:
            raise DscError(f"record index {bad[0]} is out of range for a dataset of {m.count} records")
        if len(indices) > MAX_TILES:
            raise DscError(f"{len(indices)} records asked for; a sheet shows at most {MAX_TILES}")
        return list(indices)
    pool = np.arange(m.count)
    if class_name is not None:
        if class_name not in m.classes:
            raise DscError(f"no class {class_name!r}; the classes are {', '.join(m.classes) or '(none: unlabeled)'}")
        pool = np.flatnonzero(d.labels == m.classes.index(class_name))
    if n < 1:
        raise DscError(f"the number of records to show must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    return sorted(int(i) for i in rng.choice(pool, size=min(n, len(pool), MAX_TILES), replace=False))


def contact_sheet(path: str | os.PathLike, records: Sequence[int], columns: int | None = None) -> Image.Image:
    """A grid of the given records, each captioned with its index, label name and fields."""
    d = storage.open_dataset(path)
    m = d.manifest
    columns = columns or max(1, math.ceil(math.sqrt(len(records))))
    rows = max(1, math.ceil(len(records) / columns))
    tile_h = m.height + CAPTION_HEIGHT * (1 + len(m.fields))
    if columns * m.width * rows * tile_h > MAX_SHEET_PIXELS:
        raise DscError(f"a sheet of {len(records)} tiles of {m.width}x{tile_h} in {columns} column(s) would be "
                       f"{columns * m.width}x{rows * tile_h} pixels, more than {MAX_SHEET_PIXELS:,}; show fewer "
                       "records (--n, --indices) or fewer columns")
    sheet = Image.new("RGB", (columns * m.width, rows * tile_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for k, i in enumerate(records):
        x, y = (k % columns) * m.width, (k // columns) * tile_h
        sheet.paste(Image.fromarray(d.read_records([i])[0]), (x, y))
        for line, caption in enumerate(caption_lines(d, i)):
            draw.text((x + 2, y + m.height + 1 + line * CAPTION_HEIGHT), caption, fill=(0, 0, 0), font=font)
    return sheet


def save_sheet(path: str | os.PathLike, output: str | os.PathLike, records: Sequence[int],
               columns: int | None = None) -> tuple[int, int]:
    """Write the sheet as an image file (format from the suffix); return its (width, height)."""
    output = Path(output)
    try:
        if output.is_dir():
            raise DscError(f"{output} is a folder; give an image file to write, e.g. {output / 'sheet.png'}")
        if not output.parent.is_dir():
            raise DscError(f"cannot write {output}: the folder {output.parent} does not exist")
    except OSError as e:  # a name too long, a folder that may not be searched
        raise DscError(f"cannot write {output}: {e.strerror or e}") from e
    if output.suffix.lower() not in Image.registered_extensions():
        raise DscError(f"cannot write {output}: its name does not say an image format; end it in .png or .jpg")
    sheet = contact_sheet(path, records, columns)
    try:
        sheet.save(output)
    except (OSError, ValueError) as e:
        raise DscError(f"cannot write {output}: {getattr(e, 'strerror', None) or e}") from e
    return sheet.size
