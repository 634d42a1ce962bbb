"""Batch transforms that run where the batch is: uint8 NCHW batches on the CPU or the GPU.

The loader yields ``image`` uint8 [B, 3, H, W] in channels_last; copy that to the GPU (four
times fewer bytes than float32) and augment there. Every transform takes a whole batch, returns
a batch on the same device in the same memory format, and never loops over samples in Python.

Randomness. A random transform splits into ``draw(shape, generator)``, which makes all of a
batch's random numbers on the CPU from a seeded ``torch.Generator``, and ``apply(batch, params)``,
which is deterministic and runs on the batch's device. So a seed gives the same crops and flips
on CPU and CUDA, and tests check ``apply`` against a per-sample reference with the same params.
The generator is given at construction or at call time (the call's wins); with neither, a random
transform raises ValueError rather than use torch's global generator, which nobody seeded.
The drawn parameters reach a CUDA batch as one small pinned tensor per transform, copied
``non_blocking`` (`to_device`): a training step never waits for the GPU because of them.

Dtypes. Crops and flips keep the input dtype. `RandomResizedCrop` resamples in float32 and
returns the input dtype, rounding to nearest for uint8, so a pipeline stays uint8 (small, fast to
move) until `Normalize`, the step that leaves uint8: put it last.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsc import fits
from dsc.arguments import check_bool, is_int
from dsc.boxes import BoxDraws, BoxParams, boxes, draws, map_boxes

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTERPOLATIONS = ("bilinear", "bicubic")


class CropParams(NamedTuple):
    """Per-sample top-left corner of a fixed-size crop, in padded-image pixels (int64 [B], CPU)."""

    top: torch.Tensor
    left: torch.Tensor


class FlipParams(NamedTuple):
    """Which samples are flipped (bool [B], CPU)."""

    flip: torch.Tensor


def _check_batch(batch: object, who: str) -> torch.Tensor:
    if not isinstance(batch, torch.Tensor) or batch.dim() != 4:
        found = tuple(batch.shape) if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"{who} expects a batch tensor [B, C, H, W], got {found}")
    return batch


def _check_shape(shape: Sequence[int], who: str) -> tuple[int, int, int, int]:
    if len(shape) != 4 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in shape):
        raise ValueError(f"{who}.draw expects a batch shape (B, C, H, W), got {tuple(shape)!r}")
    return tuple(shape)


def _check_params(params: tuple, batch: torch.Tensor, who: str) -> None:
    if any(len(p) != batch.shape[0] for p in params):
        raise ValueError(f"{who}: params were drawn for {len(params[0])} samples, the batch has {batch.shape[0]}")


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout to give outputs: the input's, so a channels_last batch stays channels_last."""
    return torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format


def _size(value: int | Sequence[int], who: str) -> tuple[int, int]:
    """An output size: one positive int for a square, or (height, width)."""
    pair = (value, value) if is_int(value) else tuple(value) if isinstance(value, Sequence) else ()
    if len(pair) != 2 or not all(is_int(v) and v > 0 for v in pair):
        raise ValueError(f"{who} size must be a positive int or (height, width) of positive ints, got {value!r}")
    return pair


def _padding(value: int | Sequence[int] | None) -> tuple[int, int, int, int]:
    """torchvision's forms: all sides, (left/right, top/bottom) or (left, top, right, bottom)."""
    if value is None:
        return (0, 0, 0, 0)
    sides = (value,) * 4 if is_int(value) else tuple(value) if isinstance(value, Sequence) else ()
    sides = sides * 2 if len(sides) == 2 else sides
    if len(sides) != 4 or not all(is_int(v) and v >= 0 for v in sides):
        raise ValueError(f"RandomCrop padding must be a non-negative int or 2 or 4 of them, got {value!r}")
    return sides


def _range(value: Sequence[float], name: str) -> tuple[float, float]:
    """A (low, high) pair of finite positive numbers with low <= high."""
    pair = tuple(value) if isinstance(value, Sequence) else ()
    ok = len(pair) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair)
    if not ok or not all(math.isfinite(v) and v > 0 for v in pair) or pair[0] > pair[1]:
        raise ValueError(f"RandomResizedCrop {name} must be (low, high) with 0 < low <= high, got {value!r}")
    return float(pair[0]), float(pair[1])


def _channel_values(value: Sequence[float], name: str) -> torch.Tensor:
    values = torch.as_tensor(value, dtype=torch.float64).flatten() if value is not None else torch.empty(0)
    if values.numel() != 3 or not torch.isfinite(values).all():
        raise ValueError(f"Normalize {name} must be 3 finite numbers (one per RGB channel, 0..1 units), got {value!r}")
    return values


def _check_generator(generator: torch.Generator | None) -> torch.Generator | None:
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError(f"generator must be a CPU torch.Generator (draws happen on the CPU so every device "
                         f"gets the same ones), got {generator!r}")
    return generator


class Transform:
    """A batch -> batch callable; all take `generator` so `Compose` can hand one on."""

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe})"

    _describe = ""


class RandomTransform(Transform):
    """``draw`` random params on the CPU, then ``apply`` them on the batch's device."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = _check_generator(generator)

    def _generator(self, generator: torch.Generator | None) -> torch.Generator:
        chosen = _check_generator(generator) if generator is not None else self.generator
        if chosen is None:
            raise ValueError(f"{type(self).__name__} needs a seeded torch.Generator, at construction or call "
                             f"(e.g. generator=torch.Generator().manual_seed(0)), so runs are reproducible")
        return chosen

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> tuple:
        raise NotImplementedError

    def apply(self, batch: torch.Tensor, params: tuple) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = _check_batch(batch, type(self).__name__)
        return self.apply(batch, self.draw(batch.shape, generator))


def to_device(params: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU-drawn parameters onto the batch's device without a host sync: one small tensor, pinned,
    copied non_blocking (a blocking copy from pageable memory would make the CPU wait for the GPU
    every step). Tensors already there pass through."""
    if device.type != "cuda" or params.device == device:
        return params.to(device)
    return params.pin_memory().to(device, non_blocking=True)


def _check_unit(mean: torch.Tensor, std: torch.Tensor) -> None:
    """Refuse 0..255 statistics (FFCV's and DALI's unit): on pixels scaled to 0..1 they give nearly
    constant output, and training goes on without a word."""
    mean_ok, std_ok = bool(((mean >= 0) & (mean <= 1)).all()), bool((std <= 1).all())
    if mean_ok and std_ok:
        return
    def scaled(values: torch.Tensor, ok: bool) -> tuple[float, ...]:  # only what is out of the unit is divided
        return tuple(v if ok else round(v / 255, 4) for v in values.tolist())

    raise ValueError(f"Normalize takes mean and std in 0..1 units (pixel / 255, torchvision's), got mean="
                     f"{tuple(mean.tolist())}, std={tuple(std.tolist())}; for 0..255 values (FFCV's, DALI's) divide "
                     f"{'them' if not (mean_ok or std_ok) else 'mean' if std_ok else 'std'} by 255: "
                     f"mean={scaled(mean, mean_ok)}, std={scaled(std, std_ok)}")


class Normalize(Transform):
    """uint8 [0, 255] -> ``(x / 255 - mean) / std`` in `dtype`, as one fused multiply-add.

    mean and std are in 0..1 units, like torchvision's; values outside 0..1 (the 0..255 units of
    FFCV and DALI) are refused, naming the divided values. The arithmetic is float32 whatever the
    output dtype, rounded once when written, and the output keeps the input's memory format.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], dtype: torch.dtype = torch.float32) -> None:
        mean, std = _channel_values(mean, "mean"), _channel_values(std, "std")
        if not (std > 0).all():
            raise ValueError(f"Normalize std must be > 0 for every channel, got {std.tolist()}")
        _check_unit(mean, std)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"Normalize dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        self.mean, self.std, self.dtype = tuple(mean.tolist()), tuple(std.tolist()), dtype
        # x * scale + shift == (x / 255 - mean) / std; folded in float64, used in float32
        self._scale = (1.0 / (255.0 * std)).float().view(1, 3, 1, 1)
        self._shift = (-mean / std).float().view(1, 3, 1, 1)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._describe = f"mean={self.mean}, std={self.std}, dtype={dtype}"

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        batch = _check_batch(batch, "Normalize")
        if batch.dtype != torch.uint8 or batch.shape[1] != 3:
            raise ValueError(f"Normalize expects uint8 [B, 3, H, W], got {batch.dtype} {tuple(batch.shape)}")
        if batch.device not in self._on:  # constants copied to each device once
            self._on[batch.device] = to_device(torch.stack([self._scale, self._shift]), batch.device).unbind(0)
        scale, shift = self._on[batch.device]
        out = torch.empty_like(batch, dtype=self.dtype)  # preserve_format: channels_last stays
        return torch.addcmul(shift, batch, scale, out=out)


def _crop(batch: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per-sample crops at (top[b], left[b]) of one size, by one advanced-indexing gather."""
    device = batch.device
    top, left = to_device(torch.stack([top, left]), device).unbind(0)
    rows = top[:, None] + torch.arange(height, device=device)
    cols = left[:, None] + torch.arange(width, device=device)
    samples = torch.arange(batch.shape[0], device=device)[:, None, None]
    picked = batch[samples, :, rows[:, :, None], cols[:, None, :]]  # [B, h, w, C]: channels last
    return picked.permute(0, 3, 1, 2)


class RandomCrop(RandomTransform):
    """Crop each sample at its own random place to `size`, after zero `padding` (torchvision's forms).

    The offsets are drawn uniformly over every position where the crop fits in the padded image.
    """

    def __init__(self, size: int | Sequence[int], padding: int | Sequence[int] | None = None, *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        self.size, self.padding = _size(size, "RandomCrop"), _padding(padding)
        self._describe = f"size={self.size}, padding={self.padding}"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> CropParams:
        b, _, h, w = _check_shape(shape, "RandomCrop")
        left, top, right, bottom = self.padding
        room_h, room_w = h + top + bottom - self.size[0], w + left + right - self.size[1]
        if room_h < 0 or room_w < 0:
            raise ValueError(f"RandomCrop size {self.size} is larger than the padded image "
                             f"({h + top + bottom}, {w + left + right})")
        g = self._generator(generator)
        return CropParams(torch.randint(0, room_h + 1, (b,), generator=g),
                          torch.randint(0, room_w + 1, (b,), generator=g))

    def apply(self, batch: torch.Tensor, params: CropParams) -> torch.Tensor:
        _check_params(params, batch, "RandomCrop")
        layout = _memory_format(batch)
        left, top, right, bottom = self.padding
        padded = F.pad(batch, (left, right, top, bottom)) if any(self.padding) else batch
        return _crop(padded, params.top, params.left, *self.size).contiguous(memory_format=layout)


class RandomHorizontalFlip(RandomTransform):
    """Mirror each sample left-right with probability `p`, independently."""

    def __init__(self, p: float = 0.5, *, generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        ok = isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p <= 1.0
        if not ok:
            raise ValueError(f"RandomHorizontalFlip p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)
        self._describe = f"p={self.p}"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> FlipParams:
        b = _check_shape(shape, "RandomHorizontalFlip")[0]
        return FlipParams(torch.rand(b, generator=self._generator(generator)) < self.p)

    def apply(self, batch: torch.Tensor, params: FlipParams) -> torch.Tensor:
        _check_params(params, batch, "RandomHorizontalFlip")
        flip = to_device(params.flip, batch.device).view(-1, 1, 1, 1)
        return torch.where(flip, batch.flip(-1), batch)  # no host sync: no boolean-mask indexing


def _grid_axis(start: torch.Tensor, length: torch.Tensor, out: int, size: int) -> torch.Tensor:
    """Normalised grid_sample coordinates [B, out] that resample [start, start + length) to `out`
    pixels the way F.interpolate(bilinear, align_corners=False) resizes a crop: pixel centres, and
    positions clamped to the box so no pixel from outside it leaks in at the edges."""
    centres = torch.arange(out, device=start.device, dtype=start.dtype) + 0.5
    src = start[:, None] + centres * (length / out)[:, None] - 0.5
    src = src.clamp(min=start[:, None], max=(start + length - 1)[:, None])
    return (2 * src + 1) / size - 1


class RandomResizedCrop(RandomTransform):
    """Crop each sample to its own random box and resize all boxes to `size` in one grid_sample.

    Boxes are drawn like torchvision's (area fraction in `scale`, aspect ratio log-uniform in
    `ratio`, ten tries, then a centre crop) and are whole pixels. Resampling is in float32 (float64
    input stays float64); the output has the input's dtype, uint8 rounded to nearest.

    `interpolation` ("bilinear", the default, or "bicubic") and `antialias` follow torch's
    ``F.interpolate`` on each cropped box, which is what torchvision's tensor ``resized_crop`` does:
    the default (bilinear, ``antialias=False``) is one ``grid_sample``; ``antialias=True`` widens the
    filter by the downscale factor the way Pillow does (bicubic then matches Pillow's BICUBIC, the
    reference recipe's ``RandomResizedCrop(..., interpolation=BICUBIC, antialias=True)``), and bicubic
    without it is torch's a=-0.75 kernel. Those three resample through a per-sample weight matrix per
    axis (two batched matmuls), costlier than the default on the CPU; the boxes are the same.

    ``original_sizes=True`` is for records compiled with ``--fit stretch``: call it with
    ``sizes=batch["size"]`` and each box is drawn by the same rules over the *original* image
    ((height, width) of the source), then mapped into the stretched record. The crop then has
    the area and aspect ratio torchvision would give on the original, over its whole field of view.
    Records marked with another fit (`dsc.fits`: the loader marks each batch's image and size) are
    refused, and so are `sizes` without ``original_sizes=True``, which would be ignored.
    Boxes are made on the batch's device from draws copied there pinned and ``non_blocking``, so
    a CUDA batch with CUDA sizes costs no host sync.
    """

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, original_sizes: bool = False,
                 interpolation: str = "bilinear", antialias: bool = False,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(generator)
        self.size = _size(size, "RandomResizedCrop")
        self.scale, self.ratio = _range(scale, "scale"), _range(ratio, "ratio")
        for name, value in (("original_sizes", original_sizes), ("antialias", antialias)):
            check_bool(f"RandomResizedCrop {name}", value)
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"RandomResizedCrop interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.original_sizes, self.interpolation, self.antialias = original_sizes, interpolation, antialias
        self._describe = (f"size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                          f"original_sizes={original_sizes}")
        if (interpolation, antialias) != ("bilinear", False):
            self._describe += f", interpolation={interpolation!r}, antialias={antialias}"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> BoxParams | BoxDraws:
        """Boxes in the batch's pixels; with `original_sizes`, the raw draws (`apply` makes the boxes)."""
        b, _, height, width = _check_shape(shape, "RandomResizedCrop")
        if height == 0 or width == 0:
            raise ValueError(f"RandomResizedCrop needs images of at least 1x1 pixels, got {height}x{width}")
        drawn = draws(b, self.scale, self.ratio, self._generator(generator))
        if self.original_sizes:
            return drawn
        return boxes(drawn, torch.full((b,), height), torch.full((b,), width), self.ratio)

    def apply(self, batch: torch.Tensor, params: BoxParams | BoxDraws,
              sizes: torch.Tensor | None = None) -> torch.Tensor:
        _check_params(params, batch, "RandomResizedCrop")
        work = torch.float64 if batch.dtype == torch.float64 else torch.float32
        if not self.original_sizes:
            if sizes is not None:
                raise ValueError("RandomResizedCrop got sizes= but was made without original_sizes=True: it draws its "
                                 "boxes over the records and would ignore them. For records compiled with --fit "
                                 f"stretch make it RandomResizedCrop({self.size}, original_sizes=True); else leave "
                                 "sizes out")
            box = to_device(torch.stack(params).to(work), batch.device).unbind(0)
            return _resample(batch, box, self.size, self.interpolation, self.antialias)
        fits.need_stretch("RandomResizedCrop(original_sizes=True)", fits.of(batch, sizes),
                          f"RandomResizedCrop({self.size}), whose boxes are drawn over the records themselves")
        sizes = _check_sizes(sizes, batch, "RandomResizedCrop")
        box = boxes(BoxDraws(to_device(params.draws, batch.device)), sizes[:, 0], sizes[:, 1], self.ratio)
        box = map_boxes(box, sizes, batch.shape[2:], work)
        return _resample(batch, box, self.size, self.interpolation, self.antialias)

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None, *,
                 sizes: torch.Tensor | None = None) -> torch.Tensor:
        batch = _check_batch(batch, "RandomResizedCrop")
        return self.apply(batch, self.draw(batch.shape, generator), sizes)


def _check_sizes(sizes: object, batch: torch.Tensor, who: str) -> torch.Tensor:
    """The batch's original (height, width) per sample, as the loader serves batch["size"]."""
    if not isinstance(sizes, torch.Tensor) or sizes.shape != (batch.shape[0], 2) or sizes.is_floating_point():
        found = tuple(sizes.shape) if isinstance(sizes, torch.Tensor) else type(sizes).__name__
        raise ValueError(f"{who} with original sizes needs sizes=batch['size'], an integer tensor "
                         f"[{batch.shape[0]}, 2] of (height, width), got {found}")
    return to_device(sizes, batch.device)


def _cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel (support 2): a=-0.5 is Pillow's BICUBIC, a=-0.75 torch's."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _weights(start: torch.Tensor, length: torch.Tensor, out: int, size: int, interpolation: str,
             antialias: bool) -> torch.Tensor:
    """Per-sample resampling matrices [B, out, size] along one axis: row i holds the weights of
    the source pixels for output pixel i of the box [start, start + length), which is resized to
    `out` pixels. Source pixels outside the box get no weight, as when the box is cut out first.

    antialias: Pillow's (and torch's antialiased) filter: the kernel is stretched by the downscale
    factor and each row renormalised over the box. Without it, torch's F.interpolate: taps around
    the source position, indices clamped to the box (replicated edge)."""
    dtype, device = start.dtype, start.device
    scale = (length / out)[:, None, None]                                        # [B, 1, 1]
    centre = start[:, None, None] + (torch.arange(out, device=device, dtype=dtype)[None, :, None] + 0.5) * scale
    first = start.floor()[:, None, None]
    last = ((start + length).ceil() - 1).clamp(max=size - 1)[:, None, None]
    pixels = torch.arange(size, device=device, dtype=dtype)[None, None, :]      # [1, 1, size]
    inside = (pixels >= first) & (pixels <= last)
    if antialias:
        stretch = scale.clamp(min=1.0)
        x = (pixels + 0.5 - centre) / stretch
        w = (1 - x.abs()).clamp(min=0) if interpolation == "bilinear" else _cubic(x, -0.5)
        w = w * inside
        return w / w.sum(dim=2, keepdim=True)
    # torch's bicubic (a=-0.75): four taps at floor(real) - 1 .. + 2, indices clamped to the box
    real = centre - 0.5
    base = real.floor()
    w = torch.zeros(start.shape[0], out, size, device=device, dtype=dtype)
    for k in (-1, 0, 1, 2):
        index = (base + k).clamp(min=first, max=last).long().expand(-1, out, 1)
        w.scatter_add_(2, index, _cubic(real - (base + k), -0.75).expand(-1, out, 1))
    return w


def _resample(batch: torch.Tensor, box: Sequence[torch.Tensor], size: tuple[int, int],
              interpolation: str = "bilinear", antialias: bool = False) -> torch.Tensor:
    """Resample each sample's (top, left, height, width) box (device tensors, float) to `size`,
    the input's dtype (uint8 rounded). Bilinear without antialiasing is one grid_sample; the other
    modes apply per-sample separable weight matrices (`_weights`) as two batched matmuls."""
    top, left, h, w = box
    work = top.dtype
    if interpolation == "bilinear" and not antialias:
        ys = _grid_axis(top, h, size[0], batch.shape[2])
        xs = _grid_axis(left, w, size[1], batch.shape[3])
        grid = torch.empty(*ys.shape, xs.shape[1], 2, device=batch.device, dtype=work)  # [B, h, w, (x, y)]
        grid[..., 0], grid[..., 1] = xs[:, None, :], ys[:, :, None]
        out = F.grid_sample(batch.to(work), grid, mode="bilinear", padding_mode="border", align_corners=False)
    else:
        rows = _weights(top, h, size[0], batch.shape[2], interpolation, antialias)    # [B, out_h, H]
        cols = _weights(left, w, size[1], batch.shape[3], interpolation, antialias)   # [B, out_w, W]
        out = rows[:, None] @ (batch.to(work) @ cols.transpose(1, 2)[:, None])       # [B, C, out_h, out_w]
    if not batch.is_floating_point():
        info = torch.iinfo(batch.dtype)
        out = out.round_().clamp_(info.min, info.max)
    result = torch.empty(out.shape, dtype=batch.dtype, device=batch.device, memory_format=_memory_format(batch))
    return result.copy_(out)  # cast and layout change in one pass


class Compose(Transform):
    """Run transforms in order; a `generator` given here or at call time is handed to each one."""

    def __init__(self, transforms: Sequence[Callable], *, generator: torch.Generator | None = None) -> None:
        self.transforms = list(transforms)
        if not all(callable(t) for t in self.transforms):
            raise ValueError(f"Compose expects callables, got {[type(t).__name__ for t in self.transforms]}")
        self.generator = _check_generator(generator)
        self._describe = ", ".join(map(repr, self.transforms))

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        g = _check_generator(generator) if generator is not None else self.generator
        for t in self.transforms:
            batch = t(batch, generator=g) if isinstance(t, Transform) else t(batch)
        return batch
