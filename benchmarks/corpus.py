"""A benchmark corpus built from this checkout alone: an ImageNet-like folder of realistic files.

    python benchmarks/corpus.py OUT [--images 2000] [--classes 10] [--seed 0]

Every benchmark takes any ImageFolder tree (one sub-folder per class); use your own if you have
one. This one needs nothing but the clone: it cuts `--images` crops out of the 20 public-domain
and CC0 photos bundled in `examples/images/` and writes them as `OUT/class_K/img_NNNNN.jpg`, with
sizes and encodings like a photo collection's: long side mostly 250-500 px with a tail up to
1,600 (larger ones are upscaled crops, so they compress better than real photos of that size and
decode a little faster), JPEG quality 75-95, mostly 4:2:0 chroma subsampling with some 4:2:2 and
4:4:4, about one in five progressive, ~1.5% grayscale and 1% PNG (half of them RGBA). The same
seed and Pillow build give the same bytes. The content repeats (20 photos), so a figure that
depends on image content (decode fidelity) is better measured on a corpus of your own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

PHOTOS = Path(__file__).resolve().parent.parent / "examples" / "images"
SUBSAMPLING = {"4:2:0": 2, "4:2:2": 1, "4:4:4": 0}  # Pillow's codes


def long_side(rng: np.random.Generator) -> int:
    """Mostly 250-500 px, like ImageNet's photos; one in ten up to 1,600."""
    if rng.random() < 0.1:
        return int(rng.integers(500, 1601))
    return int(rng.integers(250, 501))


def crop(photo: Image.Image, rng: np.random.Generator) -> Image.Image:
    """A random crop of 50-100% of each side, resized to a random long side."""
    w, h = photo.size
    cw, ch = int(w * rng.uniform(0.5, 1.0)), int(h * rng.uniform(0.5, 1.0))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    side = long_side(rng)
    scale = side / max(cw, ch)
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    return photo.crop((x, y, x + cw, y + ch)).resize(size, Image.Resampling.BICUBIC)


def with_alpha(image: Image.Image) -> Image.Image:
    """An RGBA copy whose alpha falls off from the centre (transparent corners)."""
    w, h = image.size
    yy, xx = np.mgrid[0:h, 0:w]
    d = np.hypot((xx - w / 2) / (w / 2), (yy - h / 2) / (h / 2))
    alpha = np.clip(255 * (1.3 - d), 0, 255).astype(np.uint8)
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def write_one(image: Image.Image, path: Path, rng: np.random.Generator) -> Path:
    """`image` saved as a PNG (1%) or a JPEG with realistic settings; returns the path written."""
    kind = rng.random()
    if kind < 0.01:
        path = path.with_suffix(".png")
        (with_alpha(image) if rng.random() < 0.5 else image.convert("RGB")).save(path)
        return path
    if kind < 0.025:
        image = image.convert("L")
    else:
        image = image.convert("RGB")
    chroma = rng.choice(list(SUBSAMPLING), p=[0.7, 0.15, 0.15])
    image.save(path, "JPEG", quality=int(rng.integers(75, 96)), subsampling=SUBSAMPLING[chroma],
               progressive=bool(rng.random() < 0.2), optimize=bool(rng.random() < 0.5))
    return path


def build(out: Path, images: int, classes: int, seed: int = 0) -> Path:
    """Write the corpus into `out` (which must not exist yet); returns `out`."""
    if out.exists():
        raise FileExistsError(f"{out} exists; give a new folder")
    photos = [Image.open(p) for p in sorted(PHOTOS.glob("*/*")) if p.is_file()]
    for photo in photos:
        photo.load()
    rng = np.random.default_rng(seed)
    for k in range(classes):
        (out / f"class_{k:02d}").mkdir(parents=True)
    for i in range(images):
        photo = photos[int(rng.integers(len(photos)))]
        write_one(crop(photo.convert("RGB"), rng), out / f"class_{i % classes:02d}" / f"img_{i:05d}.jpg", rng)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="a new folder for the corpus")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.images < 1 or args.classes < 1:
        parser.error("--images and --classes must be at least 1")
    try:
        build(args.out, args.images, args.classes, args.seed)
    except FileExistsError as e:
        sys.exit(f"error: {e}")
    files = [p for p in args.out.rglob("*") if p.is_file()]
    print(f"wrote {args.out}: {len(files)} images in {args.classes} classes, "
          f"{sum(p.stat().st_size for p in files) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
