"""The torchvision reference recipes' augmentation policies on whole dsc batches, per sample.

torchvision's RandAugment, TrivialAugmentWide and AutoAugment pick an operation (and its
magnitude and sign) per *image*; applied to a batch tensor they pick once for the whole batch,
and so do kornia's own policy classes (`kornia.augmentation.auto` selects one sub-policy per
call; only magnitudes vary per row). Here the policies are torchvision's op tables, every
choice is drawn per sample, and kornia does the pixels: the samples that drew an operation are
gathered and transformed by kornia's batched functional op with their own magnitudes.

Randomness follows `dsc.transforms`: `draw(shape, generator)` makes every choice on the CPU from
a seeded `torch.Generator`, `apply(batch, params)` is deterministic on the batch's device. So a
seed gives the same operations, magnitudes and signs on CPU and CUDA; the pixels then agree up
to the devices' float rounding. `KorniaAugmentation` runs any kornia augmentation module
(`ColorJitter`, `RandomErasing`, MixUp/CutMix below) with kornia's own CPU-side draws seeded from
the same generator, inside `torch.random.fork_rng`, so torch's global generator is left as it was.

Dtypes: the policies take and return uint8 [B, 3, H, W] (the loader's batches; torchvision applies
them to uint8 images too) and keep the memory format, so `dsc.transforms.Normalize`, which takes
uint8 and mean/std in 0..1 units, comes after them. `RandomErasing` runs after `Normalize`, on
float batches, as in the reference recipe (value 0 there is the mean colour).

kornia is an optional dependency: ``pip install 'dsc-images[augment]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsc.transforms import RandomTransform, Transform, _check_batch, _check_generator, _memory_format, to_device

try:
    import kornia.augmentation as K
    import kornia.enhance as KE
    import kornia.geometry.transform as KG
except ImportError as error:  # one line that names the extra
    raise ImportError("dsc.augment needs kornia: pip install 'dsc-images[augment]' (or pip install kornia)") from error

# Operations, by index in PolicyParams.ops. Identity is 0 so an op skipped by its probability is 0.
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
       "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert")
SIGNED = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast", "Sharpness"}
INTERPOLATIONS = ("nearest", "bilinear")

# torchvision.transforms.AutoAugmentPolicy.IMAGENET: (op, probability, magnitude bin of 10)
IMAGENET_POLICY = (
    (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)), (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, None)), (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)), (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)), (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
    (("Equalize", 0.0, None), ("Equalize", 0.8, None)), (("Invert", 0.6, None), ("Equalize", 1.0, None)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)), (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)), (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, None)), (("Color", 0.4, 0), ("Equalize", 0.6, None)),
    (("Equalize", 0.4, None), ("Solarize", 0.2, 4)), (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
    (("Invert", 0.6, None), ("Equalize", 1.0, None)), (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
)


class PolicyParams(NamedTuple):
    """Per-sample operations of a policy (CPU): ops int64 [B, steps] (indices into OPS, applied in
    step order) and magnitudes float64 [B, steps], signed, in the op's units (pixels, degrees,
    factor - 1, bits, threshold in 0..1)."""

    ops: torch.Tensor
    magnitudes: torch.Tensor


def _magnitudes(bins: int, height: int, width: int, wide: bool) -> dict[str, torch.Tensor]:
    """torchvision's magnitude tables (`_augmentation_space` of RandAugment, AutoAugment and
    TrivialAugmentWide): one value per bin, float64; ops without a magnitude get zeros."""
    def span(top: float) -> torch.Tensor:
        return torch.linspace(0.0, top, bins, dtype=torch.float64)

    steps = torch.arange(bins, dtype=torch.float64)
    table = {
        "ShearX": span(0.99 if wide else 0.3), "ShearY": span(0.99 if wide else 0.3),
        "TranslateX": span(32.0 if wide else 150.0 / 331.0 * width),
        "TranslateY": span(32.0 if wide else 150.0 / 331.0 * height),
        "Rotate": span(135.0 if wide else 30.0),
        "Posterize": 8 - (steps / ((bins - 1) / (6 if wide else 4))).round(),
        "Solarize": torch.linspace(1.0, 0.0, bins, dtype=torch.float64),
    }
    for name in ("Brightness", "Color", "Contrast", "Sharpness"):
        table[name] = span(0.99 if wide else 0.9)
    return {name: table.get(name, torch.zeros(bins, dtype=torch.float64)) for name in OPS}


def _signed(ops: torch.Tensor, magnitudes: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """torchvision negates a signed op's magnitude with probability 1/2, per image and op."""
    flip = torch.randint(0, 2, ops.shape, generator=g).bool() & _is_signed(ops)
    return torch.where(flip, -magnitudes, magnitudes)


def _is_signed(ops: torch.Tensor) -> torch.Tensor:
    return torch.tensor([name in SIGNED for name in OPS])[ops]


def _apply_op(x: torch.Tensor, name: str, m: torch.Tensor, mode: str) -> torch.Tensor:
    """One torchvision operation on float 0..1 images [n, 3, H, W] with per-sample magnitudes m [n],
    by kornia's batched functional ops (torchvision's `_apply_op`, op by op)."""
    zero = torch.zeros_like(m)
    if name in ("ShearX", "ShearY"):  # torchvision shears about the top-left corner by tan(atan(m)) = m
        return KG.shear(x, torch.stack([m, zero] if name == "ShearX" else [zero, m], dim=1), mode=mode)
    if name in ("TranslateX", "TranslateY"):  # torchvision translates by int(magnitude) pixels
        shift = m.trunc()
        return KG.translate(x, torch.stack([shift, zero] if name == "TranslateX" else [zero, shift], dim=1),
                            mode=mode)
    if name == "Rotate":
        return KG.rotate(x, m, mode=mode)
    if name == "Brightness":  # torchvision blends with black: x * factor; kornia's adjust_contrast is exactly that
        return KE.adjust_contrast(x, 1.0 + m)
    if name == "Color":
        return KE.adjust_saturation_with_gray_subtraction(x, 1.0 + m)
    if name == "Contrast":
        return KE.adjust_contrast_with_mean_subtraction(x, 1.0 + m)
    if name == "Sharpness":
        return KE.sharpness(x, 1.0 + m)
    if name == "Posterize":
        return KE.posterize(x, m.to(torch.int64))
    if name == "Solarize":
        return KE.solarize(x, m)
    if name == "AutoContrast":
        return KE.normalize_min_max(x)
    if name == "Equalize":
        return KE.equalize(x)
    if name == "Invert":
        return KE.invert(x)
    raise ValueError(f"unknown operation {name!r}")


class _Policy(RandomTransform):
    """A per-sample policy: `draw` fills PolicyParams, `apply` runs each step's operations on the
    samples that drew them (one kornia call per operation present, no loop over samples)."""

    def __init__(self, interpolation: str, generator: torch.Generator | None) -> None:
        super().__init__(generator)
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"{type(self).__name__} interpolation must be one of {INTERPOLATIONS}, "
                             f"got {interpolation!r}")
        self.interpolation = interpolation

    def apply(self, batch: torch.Tensor, params: PolicyParams) -> torch.Tensor:
        batch = _check_batch(batch, type(self).__name__)
        if batch.dtype != torch.uint8 or batch.shape[1] != 3:
            raise ValueError(f"{type(self).__name__} expects uint8 [B, 3, H, W] (the loader's images), "
                             f"got {batch.dtype} {tuple(batch.shape)}")
        if params.ops.shape[0] != batch.shape[0]:
            raise ValueError(f"{type(self).__name__}: params were drawn for {params.ops.shape[0]} samples, "
                             f"the batch has {batch.shape[0]}")
        x = batch.float().div_(255)
        for step in range(params.ops.shape[1]):
            ops = params.ops[:, step]
            for op in ops.unique().tolist():
                if OPS[op] == "Identity":
                    continue
                rows = (ops == op).nonzero()[:, 0]  # on the CPU: no host sync
                where = to_device(rows, batch.device)
                m = to_device(params.magnitudes[rows, step].float(), batch.device)
                x.index_copy_(0, where, _apply_op(x.index_select(0, where), OPS[op], m, self.interpolation))
        out = torch.empty(batch.shape, dtype=torch.uint8, device=batch.device, memory_format=_memory_format(batch))
        return out.copy_(x.mul_(255).round_().clamp_(0, 255))


class RandAugment(_Policy):
    """torchvision's RandAugment(num_ops, magnitude, num_magnitude_bins): each sample draws its own
    `num_ops` operations (with replacement) out of 14 and a sign for each; the magnitude is fixed."""

    def __init__(self, num_ops: int = 2, magnitude: int = 9, num_magnitude_bins: int = 31,
                 interpolation: str = "bilinear", *, generator: torch.Generator | None = None) -> None:
        super().__init__(interpolation, generator)
        if not (isinstance(num_ops, int) and num_ops >= 1 and isinstance(num_magnitude_bins, int)
                and num_magnitude_bins >= 2 and isinstance(magnitude, int) and 0 <= magnitude < num_magnitude_bins):
            raise ValueError(f"RandAugment needs num_ops >= 1 and 0 <= magnitude < num_magnitude_bins, got "
                             f"num_ops={num_ops!r}, magnitude={magnitude!r}, num_magnitude_bins={num_magnitude_bins!r}")
        self.num_ops, self.magnitude, self.bins = num_ops, magnitude, num_magnitude_bins
        self._describe = f"num_ops={num_ops}, magnitude={magnitude}, num_magnitude_bins={num_magnitude_bins}"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> PolicyParams:
        b, _, h, w = shape
        g = self._generator(generator)
        space = _magnitudes(self.bins, h, w, wide=False)
        table = torch.stack([space[name][self.magnitude] for name in OPS[:-1]])  # no Invert in RandAugment
        ops = torch.randint(0, len(OPS) - 1, (b, self.num_ops), generator=g)
        return PolicyParams(ops, _signed(ops, table[ops], g))


class TrivialAugmentWide(_Policy):
    """torchvision's TrivialAugmentWide: each sample draws one operation out of 14, a magnitude bin
    out of `num_magnitude_bins` and a sign."""

    def __init__(self, num_magnitude_bins: int = 31, interpolation: str = "bilinear", *,
                 generator: torch.Generator | None = None) -> None:
        super().__init__(interpolation, generator)
        if not (isinstance(num_magnitude_bins, int) and num_magnitude_bins >= 2):
            raise ValueError(f"TrivialAugmentWide num_magnitude_bins must be an int >= 2, got {num_magnitude_bins!r}")
        self.bins = num_magnitude_bins
        self._describe = f"num_magnitude_bins={num_magnitude_bins}"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> PolicyParams:
        b, _, h, w = shape
        g = self._generator(generator)
        space = _magnitudes(self.bins, h, w, wide=True)
        table = torch.stack([space[name] for name in OPS[:-1]])  # [ops, bins]
        ops = torch.randint(0, len(OPS) - 1, (b, 1), generator=g)
        bins = torch.randint(0, self.bins, (b, 1), generator=g)
        return PolicyParams(ops, _signed(ops, table[ops, bins], g))


class AutoAugment(_Policy):
    """torchvision's AutoAugment with the ImageNet policy: each sample draws one of its 25
    sub-policies; each of the two operations applies with its own probability, signs per sample."""

    def __init__(self, interpolation: str = "bilinear", *, generator: torch.Generator | None = None) -> None:
        super().__init__(interpolation, generator)
        self._describe = "policy=IMAGENET"

    def draw(self, shape: Sequence[int], generator: torch.Generator | None = None) -> PolicyParams:
        b, _, h, w = shape
        g = self._generator(generator)
        space = _magnitudes(10, h, w, wide=False)
        names = torch.tensor([[OPS.index(op) for op, _, _ in sub] for sub in IMAGENET_POLICY])
        probs = torch.tensor([[p for _, p, _ in sub] for sub in IMAGENET_POLICY], dtype=torch.float64)
        mags = torch.tensor([[float(space[op][k]) if k is not None else 0.0 for op, _, k in sub]
                             for sub in IMAGENET_POLICY], dtype=torch.float64)
        pick = torch.randint(0, len(IMAGENET_POLICY), (b,), generator=g)
        applied = torch.rand(b, 2, dtype=torch.float64, generator=g) <= probs[pick]
        ops = torch.where(applied, names[pick], torch.zeros_like(names[pick]))
        return PolicyParams(ops, _signed(ops, mags[pick], g))


class KorniaAugmentation(Transform):
    """A kornia augmentation module on dsc batches, its random draws seeded from a torch.Generator.

    kornia draws its parameters per sample from torch's global CPU generator; here each call takes
    one seed from `generator` and runs the module inside ``torch.random.fork_rng`` with that seed,
    so a seed gives the same parameters on any device and the global generator is untouched.
    uint8 batches are run as float 0..1 and rounded back to uint8; float batches (after
    `Normalize`) are passed as they are. Layout and dtype are kept."""

    def __init__(self, module: torch.nn.Module, *, generator: torch.Generator | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ValueError(f"KorniaAugmentation expects a kornia augmentation module, got {type(module).__name__}")
        self.module, self.generator = module, _check_generator(generator)
        self._describe = repr(module)

    def seed(self, generator: torch.Generator | None = None) -> int:
        """The seed kornia's draws get for one call: the next number of the generator."""
        g = _check_generator(generator) if generator is not None else self.generator
        if g is None:
            raise ValueError("KorniaAugmentation needs a seeded torch.Generator, at construction or call "
                             "(e.g. generator=torch.Generator().manual_seed(0)), so runs are reproducible")
        return int(torch.randint(0, 2**62, (1,), generator=g))

    def __call__(self, batch: torch.Tensor, generator: torch.Generator | None = None, *args: torch.Tensor):
        """Run the module on `batch` (and any extra inputs kornia takes with it, e.g. labels)."""
        batch = _check_batch(batch, "KorniaAugmentation")
        seed = self.seed(generator)
        x = batch.float().div_(255) if batch.dtype == torch.uint8 else batch
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(seed)
            result = self.module(x, *args)
        out = result[0] if isinstance(result, (tuple, list)) else result
        if batch.dtype == torch.uint8:
            out = out.mul(255).round_().clamp_(0, 255)
        shaped = torch.empty(out.shape, dtype=batch.dtype, device=out.device, memory_format=_memory_format(batch))
        shaped.copy_(out)
        return (shaped, *result[1:]) if isinstance(result, (tuple, list)) else shaped


def ColorJitter(brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0, hue: float = 0.0,
                p: float = 1.0, *, generator: torch.Generator | None = None) -> KorniaAugmentation:
    """kornia's ColorJitter (torchvision's factor ranges; factors per sample, the order of the four
    adjustments drawn once per call by kornia) on uint8 batches."""
    return KorniaAugmentation(K.ColorJitter(brightness, contrast, saturation, hue, p=p), generator=generator)


def RandomErasing(p: float = 0.5, scale: tuple[float, float] = (0.02, 0.33), ratio: tuple[float, float] = (0.3, 3.3),
                  value: float = 0.0, *, generator: torch.Generator | None = None) -> KorniaAugmentation:
    """kornia's RandomErasing (torchvision's defaults): per sample, whether and where a rectangle is
    erased to `value`. Put it after `Normalize`, as the reference recipe does: 0 is the mean colour."""
    return KorniaAugmentation(K.RandomErasing(scale=scale, ratio=ratio, value=value, p=p), generator=generator)


class MixUpCutMix:
    """MixUp or CutMix (kornia's RandomMixUpV2 / RandomCutMixV2, one of the two per batch with
    probability 1/2, as torchvision's RandomChoice) returning images and soft targets [B, classes].

    Per sample: the partner (kornia draws a random permutation, not torchvision's roll by one, so
    partners do not follow batch positions), MixUp's weight (uniform in `mixup_lambda`: kornia's
    law, not torchvision's Beta(alpha, alpha)) and CutMix's box (side from Beta(`cutmix_beta`))."""

    def __init__(self, num_classes: int, mixup_lambda: tuple[float, float] = (0.0, 1.0), cutmix_beta: float = 1.0,
                 *, generator: torch.Generator | None = None) -> None:
        if not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"MixUpCutMix num_classes must be a positive int, got {num_classes!r}")
        self.num_classes, self.generator = num_classes, _check_generator(generator)
        self.mixup = KorniaAugmentation(K.RandomMixUpV2(lambda_val=mixup_lambda, data_keys=["input", "class"]))
        self.cutmix = KorniaAugmentation(K.RandomCutMixV2(beta=cutmix_beta, data_keys=["input", "class"],
                                                        use_correct_lambda=True))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = _check_generator(generator) if generator is not None else self.generator
        if g is None:
            raise ValueError("MixUpCutMix needs a seeded torch.Generator, at construction or call")
        if not images.is_floating_point():
            raise ValueError(f"MixUpCutMix mixes float batches (after Normalize), got {images.dtype}")
        labels = labels.to(images.device).long()
        use_cutmix = bool(torch.rand(1, generator=g) < 0.5)
        mixed, mix = (self.cutmix if use_cutmix else self.mixup)(images, g, labels)
        onehot = F.one_hot(labels, self.num_classes).float()
        mix = mix.view(-1, labels.shape[0], 3)  # [mixes, B, (label, partner label, weight)]; MixUp: one mix
        targets = onehot * (1 - mix[..., 2].sum(0))[:, None]
        for k in range(mix.shape[0]):
            targets += mix[k, :, 2, None] * F.one_hot(mix[k, :, 1].long(), self.num_classes).float()
        return mixed, targets


def epoch_generator(seed: int, epoch: int, rank: int = 0) -> torch.Generator:
    """A CPU generator for one epoch's augmentation draws, from the loader's seed, the epoch and the
    rank: an epoch's draws do not depend on how many batches earlier epochs took."""
    mixed = (int(seed) * 1_000_003 + int(epoch)) * 1_000_033 + int(rank)
    return torch.Generator().manual_seed(mixed % 2**63)
