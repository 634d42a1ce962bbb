"""Resize: an upright RGB array → exactly (height, width) by one of three fit policies.

- ``center-crop``: the largest centred box of the target's aspect ratio, resized to the target.
- ``stretch``: the whole image, resized to the target, aspect ratio not kept.
- ``pad``: the whole image scaled to fit inside the target, centred on a black (0) canvas.

Resizing is antialiased bilinear (torch's uint8 kernel, which matches Pillow's
``BILINEAR`` to within rounding and is ~3x faster on one core).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

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
        return (text, text)
    if isinstance(text, tuple) and len(text) == 2 and all(isinstance(v, int) for v in text):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX×]\s*(\d+))?\s*", str(text))
    if not match:
        raise CompileError(f"size {text!r} is not N or HxW (for example 224 or 192x256)")
    height = int(match.group(1))
    return (height, int(match.group(2)) if match.group(2) else height)


def resize_backend() -> str:
    """What computes the resize here (its version can change pixels by a rounding step)."""
    return f"torch {torch.__version__}"


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


def _hwc_tensor(a: np.ndarray) -> torch.Tensor:
    """An HWC uint8 array as an NCHW tensor view (channels-last strides, no copy)."""
    return torch.from_numpy(a).permute(2, 0, 1).unsqueeze(0)


def resample_into(rgb: np.ndarray, out: np.ndarray) -> None:
    """Antialiased bilinear resize of HWC uint8 `rgb` into the HWC uint8 view `out`.

    torch's `_upsample_bilinear2d_aa` with `out=` writes channels-last pixels straight into
    `out` (0.18 ms at 500x375 -> 224 here, against 0.36 ms for interpolate + permute copy);
    where that private op is missing or lands elsewhere, the public path is used instead.
    """
    src = _hwc_tensor(np.require(rgb, requirements=("C", "W")))  # torch refuses read-only arrays
    dst = _hwc_tensor(out)
    if src.shape == dst.shape:
        dst.copy_(src)
        return
    result = None
    if out.flags.c_contiguous:  # the kernel assumes a dense channels-last `out`: never give it a sub-view
        try:
            result = torch._C._nn._upsample_bilinear2d_aa(src, dst.shape[2:], False, None, None, out=dst)
        except (AttributeError, TypeError, RuntimeError):
            result = None
    if result is None or result.data_ptr() != dst.data_ptr() or result.stride() != dst.stride():
        dst.copy_(F.interpolate(src, size=tuple(dst.shape[2:]), mode="bilinear", antialias=True,
                                align_corners=False))


def resize_into(rgb: np.ndarray, target: Target, out: np.ndarray, original: tuple[int, int] | None = None) -> None:
    """Write `rgb` resized by `target`'s policy into `out` ([H, W, 3] uint8, e.g. a record of a shard).

    `original` is the upright (height, width) before any DCT-domain downscale: the geometry
    (crop box, pad content size) is computed on it, so it does not depend on the decode scale.
    """
    h, w = rgb.shape[:2]
    oh, ow = original or (h, w)
    if target.fit == "stretch":
        resample_into(rgb, out)
    elif target.fit == "center-crop":
        top, left, bh, bw = crop_box(oh, ow, target)
        sy, sx = h / oh, w / ow
        top, left, bottom, right = round(top * sy), round(left * sx), round((top + bh) * sy), round((left + bw) * sx)
        resample_into(rgb[top:max(bottom, top + 1), left:max(right, left + 1)], out)
    else:
        ch, cw = pad_content_size(oh, ow, target)
        top, left = (target.height - ch) // 2, (target.width - cw) // 2
        out.fill(PAD_VALUE)
        resample_into(rgb, out[top:top + ch, left:left + cw])
