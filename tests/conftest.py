"""Shared fixtures: small real image files written by Pillow, and a Pillow reference of each fit policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps


def pattern(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth, asymmetric RGB picture (gradients + blobs): JPEG-friendly, orientation-revealing."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = np.empty((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 6.28)
        out[..., c] = 127 + 90 * np.sin(fx * x / w * 6.28 + phase) * np.cos(fy * y / h * 3.14)
    out[: h // 4, : w // 3] = (250, 30, 30)  # a red corner marks the top-left
    return out.clip(0, 255).astype(np.uint8)


def save(path: Path, array: np.ndarray, fmt: str = "JPEG", orientation: int = 1, **kw) -> Path:
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


def make_folder(root: Path, classes: int = 3, per_class: int = 4, seed: int = 0,
                sides: tuple[int, int] = (40, 120)) -> Path:
    """An ImageFolder of real JPEG and PNG files with varied sizes."""
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


def pillow_reference(path: Path, height: int, width: int, fit: str = "center-crop") -> np.ndarray:
    """An independent reference: full Pillow decode, EXIF transpose, then the fit policy in Pillow."""
    img = ImageOps.exif_transpose(Image.open(path))
    if img.mode in ("RGBA", "LA", "P"):
        rgba = np.asarray(img.convert("RGBA")).astype(np.uint16)
        img = Image.fromarray(((rgba[..., :3] * rgba[..., 3:] + 127) // 255).astype(np.uint8))
    img = img.convert("RGB")
    w, h = img.size
    if fit == "stretch":
        return np.asarray(img.resize((width, height), Image.BILINEAR))
    if fit == "pad":
        k = min(height / h, width / w)
        ch, cw = min(height, max(1, round(h * k))), min(width, max(1, round(w * k)))
        canvas = Image.new("RGB", (width, height))
        canvas.paste(img.resize((cw, ch), Image.BILINEAR), ((width - cw) // 2, (height - ch) // 2))
        return np.asarray(canvas)
    if w * height > h * width:  # formats.md: the centred box of the target's aspect, sides rounded
        bw, bh = max(1, min(w, round(h * width / height))), h
    else:
        bw, bh = w, max(1, min(h, round(w * height / width)))
    box = ((w - bw) // 2, (h - bh) // 2, (w - bw) // 2 + bw, (h - bh) // 2 + bh)
    return np.asarray(img.resize((width, height), Image.BILINEAR, box=box))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "src")
