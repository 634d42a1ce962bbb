"""How close dsc's records are to an independent full-resolution reference, per decode mode and size.

    python benchmarks/decode_fidelity.py CORPUS [--sizes 32 64 112 160 224] [--limit 200] [--margins 4:3,2:2]

The reference is Pillow alone: a full decode, EXIF-transposed, converted to RGB and resized by
``BILINEAR`` over the centre-crop box formats.md specifies (computed here from the spec's words,
not dsc's code). CORPUS is any ImageFolder tree; what is measured depends on image content, so
photos of your own say more than the 20 bundled ones `benchmarks/corpus.py` cuts its corpus from.
For every JPEG of CORPUS (evenly thinned to --limit) and every size it prints, per mode, the mean
and worst per-record mean |diff|. ``--margins`` adds a candidate policy
(denominator:margin pairs) to compare with "faithful" and "fast".
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def spec_box(h: int, w: int, th: int, tw: int) -> tuple[int, int, int, int]:
    """formats.md's centre-crop box as Pillow's (left, upper, right, lower)."""
    if w * th > h * tw:
        bw = max(1, min(w, round(h * tw / th)))
        return ((w - bw) // 2, 0, (w - bw) // 2 + bw, h)
    bh = max(1, min(h, round(w * th / tw)))
    return (0, (h - bh) // 2, w, (h - bh) // 2 + bh)


def reference(path: Path, size: int) -> np.ndarray:
    with Image.open(path) as img:
        img = ImageOps.exif_transpose(img).convert("RGB")
        box = spec_box(img.height, img.width, size, size)
        return np.asarray(img.resize((size, size), Image.BILINEAR, box=box))


def record(path: Path, size: int, mode: str) -> np.ndarray:
    from dsc.compiler.target import Target
    from dsc.compiler.write import compile_image

    out = np.empty((size, size, 3), np.uint8)
    compile_image(str(path), Target(size, size), out, 100_000_000, mode)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 112, 160, 224])
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--margins", default="", help="a candidate policy, e.g. 4:3,2:2")
    args = ap.parse_args()
    from dsc.compiler import decode

    modes = list(decode.DCT_MARGINS)
    if args.margins:
        decode.DCT_MARGINS["candidate"] = {int(k): float(v) for k, v in
                                           (pair.split(":") for pair in args.margins.split(","))}
        modes.append("candidate")
    files = sorted(p for p in args.corpus.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
    files = [files[i] for i in np.unique(np.linspace(0, len(files) - 1, args.limit).round().astype(int))]
    print(f"{len(files)} JPEGs of {args.corpus}; per-record mean |diff| vs Pillow full decode + BILINEAR over the box")
    for size in args.sizes:
        refs = [reference(p, size).astype(np.int16) for p in files]
        cells = []
        for mode in modes:
            diffs = np.array([np.abs(record(p, size, mode) - r).mean() for p, r in zip(files, refs)])
            cells.append(f"{mode}: mean {diffs.mean():.2f} worst {diffs.max():.2f}")
        print(f"size {size:4d}  " + "  |  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
