"""Validation transforms: the usual eval recipe, ``Resize(short side)`` then ``CenterCrop``, batched.

They take a uint8 (or float) [B, C, H, W] batch where it is — CPU or GPU — and draw nothing at
random. `Resize` and `CenterCrop` follow torchvision's geometry (new long side
``int(size * long / short)``; crop corner ``round((H - h) / 2)``) with antialiased bilinear
resampling. `OriginalCenterCrop` is for records compiled with ``--fit stretch``: given the
batch's original sizes (``batch["size"]``), it cuts the region that ``Resize + CenterCrop`` would
keep of each *original* image out of its stretched record, so eval sees undistorted images.
Each refuses records of the other fit when the loader's batch says which it is (`dsc.fits`):
`OriginalCenterCrop` takes stretched records only, `Resize` and `CenterCrop` refuse them unless
``allow_stretched=True`` (a squeezed view on purpose).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dsc import fits
from dsc.arguments import check_bool, is_int
from dsc.transforms import Transform, _check_batch, _check_sizes, _memory_format, _resample, _size


def _short_side(value: object, who: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{who} resize must be a positive int (the short side), got {value!r}")
    return value


def _flag(value: object, who: str) -> bool:
    return check_bool(f"{who} allow_stretched", value)


def resized_shape(height: torch.Tensor | int, width: torch.Tensor | int, short: int):
    """torchvision's Resize(int) output (height, width): the short side to `short`, the long side
    to ``int(short * long / short_side)``; works on ints or per-sample tensors."""
    if isinstance(height, int):
        return (short, int(short * width / height)) if height <= width else (int(short * height / width), short)
    h, w = height.to(torch.float64), width.to(torch.float64)
    wide = h <= w
    return (torch.where(wide, short, torch.floor(short * h / w)), torch.where(wide, torch.floor(short * w / h), short))


def _instead(crop: str, resize: str) -> str:
    """What to use on stretched records instead of Resize + CenterCrop (the arguments as they will read)."""
    return (f"OriginalCenterCrop({crop}, resize={resize})(images, sizes=batch['size']), which crops that region of "
            "the undistorted original")


def _spelled(size: tuple[int, int]) -> str:
    return str(size[0]) if size[0] == size[1] else str(size)


class Resize(Transform):
    """Resize every sample's short side to `size`, keeping the aspect ratio (all samples share a shape).

    On records compiled with ``--fit stretch`` that aspect ratio is not the source's, so a batch the
    loader marked so is refused unless ``allow_stretched=True``.
    """

    def __init__(self, size: int, *, allow_stretched: bool = False) -> None:
        self.size = _short_side(size, "Resize")
        self.allow_stretched = _flag(allow_stretched, "Resize")
        self._describe = f"size={self.size}" + (", allow_stretched=True" if allow_stretched else "")

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = _check_batch(batch, "Resize")
        fits.refuse_stretch("Resize", fits.of(batch), self.allow_stretched, _instead("crop", str(self.size)))
        shape = resized_shape(batch.shape[2], batch.shape[3], self.size)
        work = torch.float64 if batch.dtype == torch.float64 else torch.float32
        out = F.interpolate(batch.to(work), size=shape, mode="bilinear", antialias=True, align_corners=False)
        if not batch.is_floating_point():
            out = out.round_().clamp_(0, 255)
        result = torch.empty(out.shape, dtype=batch.dtype, device=batch.device, memory_format=_memory_format(batch))
        return result.copy_(out)


class CenterCrop(Transform):
    """Cut the centred `size` box (int or (height, width)) out of every sample, as torchvision does.

    A batch the loader marked as ``--fit stretch`` records is refused unless ``allow_stretched=True``
    (see `Resize`).
    """

    def __init__(self, size: int | Sequence[int], *, allow_stretched: bool = False) -> None:
        self.size = _size(size, "CenterCrop")
        self.allow_stretched = _flag(allow_stretched, "CenterCrop")
        self._describe = f"size={self.size}" + (", allow_stretched=True" if allow_stretched else "")

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = _check_batch(batch, "CenterCrop")
        fits.refuse_stretch("CenterCrop", fits.of(batch), self.allow_stretched,
                            _instead(_spelled(self.size), "short_side"))
        (h, w), (ch, cw) = batch.shape[2:], self.size
        if ch > h or cw > w:
            raise ValueError(f"CenterCrop size {self.size} is larger than the images ({h}, {w})")
        top, left = int(round((h - ch) / 2)), int(round((w - cw) / 2))
        return batch[:, :, top:top + ch, left:left + cw].contiguous(memory_format=_memory_format(batch))


class OriginalCenterCrop(Transform):
    """``Resize(resize) + CenterCrop(size)`` of each original image, cut from its stretched record.

    The crop box is computed in the resized original's pixels (torchvision's rounding) and
    scaled into the record, then resampled bilinearly to `size` in one grid_sample. Call it as
    ``t(batch["image"], sizes=batch["size"])``; everything happens on the batch's device.
    Records the loader marked with another fit than stretch are refused: there the box would not
    be the original's centre.
    """

    def __init__(self, size: int | Sequence[int], resize: int) -> None:
        self.size, self.resize = _size(size, "OriginalCenterCrop"), _short_side(resize, "OriginalCenterCrop")
        if max(self.size) > self.resize:  # the short side becomes `resize`: then every crop fits
            raise ValueError(f"OriginalCenterCrop size {self.size} must not exceed resize {self.resize}")
        self._describe = f"size={self.size}, resize={self.resize}"

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None, *,
                 sizes: torch.Tensor | None = None) -> torch.Tensor:
        batch = _check_batch(batch, "OriginalCenterCrop")
        fits.need_stretch("OriginalCenterCrop", fits.of(batch, sizes),
                          f"CenterCrop({_spelled(self.size)})(Resize({self.resize})(images))")
        sizes = _check_sizes(sizes, batch, "OriginalCenterCrop")
        work = torch.float64 if batch.dtype == torch.float64 else torch.float32
        rh, rw = resized_shape(sizes[:, 0], sizes[:, 1], self.resize)
        (ch, cw), (height, width) = self.size, batch.shape[2:]
        top, left = torch.round((rh - ch) / 2), torch.round((rw - cw) / 2)
        sy, sx = height / rh, width / rw  # resized-original pixels -> record pixels
        box = [(top * sy).to(work), (left * sx).to(work), (ch * sy).to(work), (cw * sx).to(work)]
        return _resample(batch, box, self.size)
