"""RandomResizedCrop's boxes: torchvision's sampling rules, for a whole batch at once.

Random numbers are drawn on the CPU (`draws`); `boxes` turns them into whole-pixel boxes for
each sample's image size, on whatever device the numbers and sizes are, so boxes over
per-sample original sizes need no host sync. `map_boxes` carries a box drawn on an original
image into a record that stretched that image.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

ATTEMPTS = 10  # boxes RandomResizedCrop tries per sample before its centre-crop fallback, as torchvision


class BoxParams(NamedTuple):
    """Per-sample crop box in input pixels (int64 [B] each; on the CPU when `RandomResizedCrop.draw`
    made it): rows top..top+height-1."""

    top: torch.Tensor
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor


class BoxDraws(NamedTuple):
    """RandomResizedCrop's random numbers for a batch (float64 [B, 2 * ATTEMPTS + 2], CPU): per
    sample ATTEMPTS area fractions, ATTEMPTS log aspect ratios, then two uniforms for the corner.
    They turn into boxes only once each sample's image size is known (`boxes`)."""

    draws: torch.Tensor


def draws(b: int, scale: tuple[float, float], ratio: tuple[float, float], g: torch.Generator) -> BoxDraws:
    """Every random number `b` boxes need, from `g` (in torchvision's order of use per sample)."""
    area = torch.empty(b, ATTEMPTS, dtype=torch.float64).uniform_(*scale, generator=g)
    log_ratio = torch.empty(b, ATTEMPTS, dtype=torch.float64).uniform_(*map(math.log, ratio), generator=g)
    corner = torch.rand(b, 2, dtype=torch.float64, generator=g)  # for every sample: a fixed number of draws
    return BoxDraws(torch.cat([area, log_ratio, corner], dim=1))


def boxes(draws: BoxDraws, height: torch.Tensor, width: torch.Tensor, ratio: tuple[float, float]) -> BoxParams:
    """torchvision's box search for every sample at once, on the draws' device: the first of
    ATTEMPTS boxes that fits in its (height[b], width[b]) image, else the whole image cropped to
    the nearest allowed ratio and centred (its fallback). Sides and corners are whole pixels."""
    d, height, width = draws.draws, height.to(torch.float64)[:, None], width.to(torch.float64)[:, None]
    area = d[:, :ATTEMPTS] * (height * width)
    aspect = torch.exp(d[:, ATTEMPTS:2 * ATTEMPTS])
    w, h = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.long().argmax(dim=1, keepdim=True)  # argmax returns the first maximum
    found = fits.any(dim=1)
    height, width = height[:, 0], width[:, 0]
    narrow, wide = width / height < ratio[0], width / height > ratio[1]
    fall_h = torch.where(narrow, torch.round(width / ratio[0]), height)
    fall_w = torch.where(wide, torch.round(height * ratio[1]), width)
    h = torch.where(found, h.gather(1, first)[:, 0], fall_h)
    w = torch.where(found, w.gather(1, first)[:, 0], fall_w)
    top = torch.minimum(torch.floor(d[:, -2] * (height - h + 1)), height - h)
    left = torch.minimum(torch.floor(d[:, -1] * (width - w + 1)), width - w)
    top = torch.where(found, top, torch.floor((height - h) / 2))  # the fallback box is centred
    left = torch.where(found, left, torch.floor((width - w) / 2))
    return BoxParams(*(v.long() for v in (top, left, h, w)))


def map_boxes(box: BoxParams, sizes: torch.Tensor, record: Sequence[int], work: torch.dtype) -> list[torch.Tensor]:
    """Boxes in original-image pixels -> the same region of a record that stretched the whole
    image to `record` (height, width): each axis scales by record side / original side."""
    sy, sx = record[0] / sizes[:, 0].to(work), record[1] / sizes[:, 1].to(work)
    return [box.top * sy, box.left * sx, box.height * sy, box.width * sx]
