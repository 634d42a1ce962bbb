"""Target: the record size and fit policy every source is brought to, and each fit's geometry.

- ``center-crop``: the largest centred box of the target's aspect ratio, resized to the target.
- ``stretch``: the whole image, resized to the target, aspect ratio not kept.
- ``pad``: the whole image scaled to fit inside the target, centred on a black (0) canvas.

Pure arithmetic: what the driver plans with and `resize` computes pixels by (formats.md, "fit").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

from dsc.arguments import is_int
from dsc.errors import CompileError

FITS = ("center-crop", "stretch", "pad")
PAD_VALUE = 0
INTERPOLATION = "bilinear-antialias"
MAX_TARGET_SIDE = 8192


@dataclass(frozen=True)
class Target:
    """The record size and fit policy every source is brought to."""

    height: int
    width: int
    fit: str = "center-crop"

    def __post_init__(self) -> None:
        if self.fit not in FITS:
            raise CompileError(f"unknown fit {self.fit!r}; choose one of {', '.join(FITS)}")
        if not (1 <= self.height <= MAX_TARGET_SIDE and 1 <= self.width <= MAX_TARGET_SIDE):
            raise CompileError(f"size {self.height}x{self.width} must be between 1 and {MAX_TARGET_SIDE} per side")


def parse_size(text: str | int | tuple[int, int]) -> tuple[int, int]:
    """'224' → (224, 224); '192x256' (height x width) → (192, 256)."""
    if is_int(text):
        return (int(text), int(text))
    if isinstance(text, tuple) and len(text) == 2 and all(is_int(v) for v in text):
        return (int(text[0]), int(text[1]))
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX×]\s*(\d+))?\s*", str(text))
    if not match:
        raise CompileError(f"size {text!r} is not N or HxW (for example 224 or 192x256)")
    height = int(match.group(1))
    return (height, int(match.group(2)) if match.group(2) else height)


def resize_backend() -> str:
    """What computes the resize (`resize`: torch; its version can change pixels by a rounding step),
    read from torch's installed metadata: the driver records it without importing torch."""
    return f"torch {metadata.version('torch')}"


def pad_content_size(h: int, w: int, target: Target) -> tuple[int, int]:
    """The size the whole image is scaled to inside the pad canvas."""
    k = min(target.height / h, target.width / w)
    return (min(target.height, max(1, round(h * k))), min(target.width, max(1, round(w * k))))


def needed_size(h: int, w: int, target: Target) -> tuple[int, int]:
    """How large the upright decode must be so that the resize only ever shrinks it or upsamples a small source."""
    if target.fit == "pad":
        return pad_content_size(h, w, target)
    return (min(h, target.height), min(w, target.width))


def crop_box(h: int, w: int, target: Target) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the centred box with the target's aspect ratio."""
    if w * target.height > h * target.width:  # wider than the target: keep full height
        bw = max(1, min(w, round(h * target.width / target.height)))
        return (0, (w - bw) // 2, h, bw)
    bh = max(1, min(h, round(w * target.height / target.width)))
    return ((h - bh) // 2, 0, bh, w)
