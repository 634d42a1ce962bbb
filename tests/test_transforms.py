"""dsc.transforms: each batched transform against a plain per-sample reference with the same params."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import dsc
from dsc.boxes import ATTEMPTS
from dsc.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomResizedCrop,
)

from conftest import ref_box

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch(b: int = 6, h: int = 20, w: int = 28, seed: int = 0, channels_last: bool = True) -> torch.Tensor:
    """A uint8 batch laid out like the loader's: NHWC storage seen as NCHW."""
    x = torch.randint(0, 256, (b, h, w, 3), dtype=torch.uint8, generator=seeded(seed)).permute(0, 3, 1, 2)
    return x if channels_last else x.contiguous()


# per-sample references: loops and the obvious code


def ref_crop(x, top, left, size, padding=(0, 0, 0, 0)):
    pl, pt, pr, pb = padding
    out = []
    for b in range(len(x)):
        padded = torch.zeros(x.shape[1], x.shape[2] + pt + pb, x.shape[3] + pl + pr, dtype=x.dtype)
        padded[:, pt:pt + x.shape[2], pl:pl + x.shape[3]] = x[b]
        t, s = int(top[b]), int(left[b])
        out.append(padded[:, t:t + size[0], s:s + size[1]])
    return torch.stack(out)


def ref_flip(x, flip):
    return torch.stack([x[b].flip(-1) if flip[b] else x[b] for b in range(len(x))])


def ref_resized_crop(x, params, size):
    """torchvision's resized_crop on tensors, sample by sample: slice the box, then F.interpolate."""
    out = []
    for b, (t, s, h, w) in enumerate(zip(*(p.tolist() for p in params))):
        crop = x[b:b + 1, :, t:t + h, s:s + w].double()
        y = F.interpolate(crop, size=size, mode="bilinear", align_corners=False, antialias=False)[0]
        out.append(y if x.is_floating_point() else y.round().clamp(0, 255).to(x.dtype))
    return torch.stack(out)


def ref_boxes(shape, scale, ratio, generator):
    """torchvision's get_params, one sample at a time, fed the same numbers `draw` takes from the generator."""
    b, _, height, width = shape
    area = torch.empty(b, ATTEMPTS, dtype=torch.float64).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(b, ATTEMPTS, dtype=torch.float64).uniform_(*map(math.log, ratio), generator=generator)
    u = torch.rand(b, 2, dtype=torch.float64, generator=generator)
    draws = torch.cat([area, log_ratio, u], dim=1)
    return [ref_box(draws[i], height, width, scale, ratio) for i in range(b)]


# Normalize


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_normalize_matches_formula(dtype):
    x = batch()
    out = Normalize(MEAN, STD, dtype=dtype)(x)
    ref = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert out.dtype == dtype and out.shape == x.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    else:  # float32 arithmetic, one rounding to the output dtype: within one unit in the last place
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=eps, atol=eps)


def test_normalize_keeps_contiguous_layout_and_rejects_float_input():
    x = batch(channels_last=False)
    assert Normalize(MEAN, STD)(x).is_contiguous()
    with pytest.raises(ValueError, match="uint8"):
        Normalize(MEAN, STD)(x.float())


def test_normalize_refuses_0_to_255_statistics_naming_the_unit():
    """FFCV and DALI take mean/std in 0..255; here they would give nearly constant output (issue 26)."""
    ffcv_mean, ffcv_std = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)
    with pytest.raises(ValueError, match=r"0\.\.1 units .*divide them by 255: mean=\(0\.485, 0\.456, 0\.406\), "
                                         r"std=\(0\.229, 0\.224, 0\.225\)"):
        Normalize(ffcv_mean, ffcv_std)
    for mean, std in [(ffcv_mean, STD), (MEAN, ffcv_std), ((-0.1, 0.5, 0.5), STD), (MEAN, (1.5, 0.2, 0.2))]:
        with pytest.raises(ValueError, match="0..1 units"):
            Normalize(mean, std)
    # one of the two in 0..255: only that one is to be divided (not the mean already in 0..1)
    with pytest.raises(ValueError, match=r"divide std by 255: mean=\(0\.485, 0\.456, 0\.406\), "
                                         r"std=\(0\.229, 0\.224, 0\.225\)"):
        Normalize(MEAN, ffcv_std)
    with pytest.raises(ValueError, match=r"divide mean by 255: mean=\(0\.485, 0\.456, 0\.406\), "
                                         r"std=\(0\.229, 0\.224, 0\.225\)"):
        Normalize(ffcv_mean, STD)
    out = Normalize((0.0, 0.5, 1.0), (1.0, 1.0, 1.0))(batch())  # the edges of the unit are fine
    assert torch.isfinite(out).all()


# RandomCrop


@pytest.mark.parametrize("padding", [None, 3, (2, 5), (1, 2, 3, 4)])
def test_random_crop_matches_reference(padding):
    x, t = batch(), RandomCrop((12, 17), padding=padding)
    params = t.draw(x.shape, seeded(1))
    out = t.apply(x, params)
    assert torch.equal(out, ref_crop(x, params.top, params.left, (12, 17), t.padding))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == torch.uint8


def test_random_crop_covers_every_offset_and_padding_is_zero():
    x = torch.full((400, 3, 4, 4), 7, dtype=torch.uint8)
    t = RandomCrop(4, padding=1)
    params = t.draw(x.shape, seeded(0))
    assert set(params.top.tolist()) == {0, 1, 2} and set(params.left.tolist()) == {0, 1, 2}
    out = t.apply(x, params)
    corner = (params.top == 0) & (params.left == 0)
    assert (out[corner, :, 0, :] == 0).all() and (out[corner, :, 1:, 1:] == 7).all()


def test_random_crop_larger_than_image_is_an_error():
    with pytest.raises(ValueError, match=r"larger than the padded image \(20, 28\)"):
        RandomCrop(21)(batch(), seeded())


# RandomHorizontalFlip


def test_flip_matches_reference():
    x, t = batch(b=32), RandomHorizontalFlip(0.5)
    params = t.draw(x.shape, seeded(2))
    assert 0 < int(params.flip.sum()) < 32
    out = t.apply(x, params)
    assert torch.equal(out, ref_flip(x, params.flip)) and out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("p, flipped", [(0.0, 0), (1.0, 16)])
def test_flip_extreme_probabilities(p, flipped):
    assert int(RandomHorizontalFlip(p).draw((16, 3, 2, 2), seeded()).flip.sum()) == flipped


# RandomResizedCrop


@pytest.mark.parametrize("shape, scale, ratio", [((64, 3, 30, 50), (0.08, 1.0), (3 / 4, 4 / 3)),
                                                  ((64, 3, 12, 40), (0.4, 0.9), (0.5, 2.0))])  # half fall back
def test_resized_crop_boxes_match_torchvision_rules(shape, scale, ratio):
    params = RandomResizedCrop(8, scale, ratio).draw(shape, seeded(3))
    assert list(zip(*(p.tolist() for p in params))) == ref_boxes(shape, scale, ratio, seeded(3))


def test_resized_crop_falls_back_to_centre_crop():
    params = RandomResizedCrop(8, scale=(2.0, 3.0)).draw((4, 3, 10, 40), seeded())  # no box fits
    assert [p.tolist() for p in params] == [[0] * 4, [13] * 4, [10] * 4, [13] * 4]  # w = round(10 * 4/3)


@pytest.mark.parametrize("size", [(16, 16), (9, 40), (40, 12)])  # down, mixed, up
def test_resized_crop_matches_interpolate_reference(size):
    x, t = batch(b=8), RandomResizedCrop(size, scale=(0.05, 1.0))
    params = t.draw(x.shape, seeded(4))
    out = t.apply(x.double(), params)
    torch.testing.assert_close(out, ref_resized_crop(x.double(), params, size), rtol=0, atol=1e-9)
    small = t.apply(x, params)  # uint8: float32 resampling, rounded; ties may land one apart
    diff = (small.int() - ref_resized_crop(x, params, size).int()).abs()
    assert small.dtype == torch.uint8 and small.is_contiguous(memory_format=torch.channels_last)
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01


def ref_pillow(x, params, size, resample):
    """Pillow, sample by sample: cut the box out, then resize it (what torchvision does on PIL images).
    uint8 batches go through Pillow's RGB path, float ones channel by channel through its float
    ("F") path, which has no 8-bit rounding between its horizontal and vertical passes."""
    out = []
    for b, (t, s, h, w) in enumerate(zip(*(p.tolist() for p in params))):
        box, wh = (s, t, s + w, t + h), (size[1], size[0])
        if x.dtype == torch.uint8:
            image = Image.fromarray(x[b].permute(1, 2, 0).contiguous().numpy()).crop(box).resize(wh, resample)
            out.append(torch.from_numpy(np.array(image)).permute(2, 0, 1))
        else:
            planes = [np.array(Image.fromarray(c.float().numpy(), mode="F").crop(box).resize(wh, resample))
                      for c in x[b]]
            out.append(torch.from_numpy(np.stack(planes)).to(x.dtype))
    return torch.stack(out)


@pytest.mark.parametrize("interpolation, resample", [("bicubic", Image.BICUBIC), ("bilinear", Image.BILINEAR)])
@pytest.mark.parametrize("size", [(16, 16), (9, 40), (40, 12)])  # down, mixed, up
def test_antialiased_resized_crop_matches_pillow_on_the_same_boxes(interpolation, resample, size):
    """antialias=True is Pillow's resampling (the reference recipe's bicubic, antialiased crop):
    equal to Pillow's float path; within Pillow's own 8-bit rounding of its uint8 path."""
    x = batch(b=8, h=40, w=56)
    t = RandomResizedCrop(size, scale=(0.05, 1.0), interpolation=interpolation, antialias=True)
    params = t.draw(x.shape, seeded(4))
    torch.testing.assert_close(t.apply(x.double(), params), ref_pillow(x.double(), params, size, resample),
                               rtol=0, atol=1e-3)
    out = t.apply(x, params)
    diff = (out.int() - ref_pillow(x, params, size, resample).int()).abs()
    assert out.dtype == torch.uint8 and out.is_contiguous(memory_format=torch.channels_last)
    assert diff.max() <= 3 and diff.float().mean() < 0.3  # Pillow rounds to 8 bits between its two passes
    reference = [F.interpolate(x[b:b + 1, :, p[0]:p[0] + p[2], p[1]:p[1] + p[3]].double(), size=size,
                               mode=interpolation, antialias=True, align_corners=False)[0]
                 for b, p in enumerate(zip(*(v.tolist() for v in params)))]
    torch.testing.assert_close(t.apply(x.double(), params), torch.stack(reference), rtol=0, atol=1e-9)


@pytest.mark.parametrize("size", [(16, 16), (9, 40), (40, 12)])
def test_bicubic_resized_crop_without_antialias_matches_interpolate(size):
    x, t = batch(b=8), RandomResizedCrop(size, scale=(0.05, 1.0), interpolation="bicubic")
    params = t.draw(x.shape, seeded(5))
    reference = [F.interpolate(x[b:b + 1, :, p[0]:p[0] + p[2], p[1]:p[1] + p[3]].double(), size=size,
                               mode="bicubic", antialias=False, align_corners=False)[0]
                 for b, p in enumerate(zip(*(v.tolist() for v in params)))]
    torch.testing.assert_close(t.apply(x.double(), params), torch.stack(reference), rtol=0, atol=1e-9)


def test_resized_crop_default_is_bilinear_without_antialias_and_others_differ():
    x = batch(b=8, h=40, w=56)
    default = RandomResizedCrop(12)(x, seeded(6))
    assert torch.equal(default, RandomResizedCrop(12, interpolation="bilinear", antialias=False)(x, seeded(6)))
    for options in ({"interpolation": "bicubic"}, {"antialias": True}):
        assert not torch.equal(default, RandomResizedCrop(12, **options)(x, seeded(6)))


def test_resized_crop_of_float_batch_keeps_dtype_and_layout():
    x = batch(channels_last=False).half()
    out = RandomResizedCrop(10)(x, seeded())
    assert out.dtype == torch.float16 and out.shape == (6, 3, 10, 10) and out.is_contiguous()


# generators, determinism, Compose


@pytest.mark.parametrize("make", [lambda: RandomCrop(10, padding=2), lambda: RandomHorizontalFlip(),
                                  lambda: RandomResizedCrop(10)])
def test_same_seed_same_batch_other_seed_other_batch(make):
    x = batch(b=16)
    assert torch.equal(make()(x, seeded(7)), make()(x, seeded(7)))
    assert not torch.equal(make()(x, seeded(7)), make()(x, seeded(8)))


def test_generator_at_call_wins_over_construction_and_one_is_required():
    x = batch(b=16)
    t = RandomResizedCrop(10, generator=seeded(1))
    assert torch.equal(t(x, seeded(2)), RandomResizedCrop(10)(x, seeded(2)))
    assert torch.equal(t(x), RandomResizedCrop(10)(x, seeded(1)))
    with pytest.raises(ValueError, match="needs a seeded torch.Generator"):
        RandomHorizontalFlip()(x)
    with pytest.raises(ValueError, match="CPU torch.Generator"):
        RandomHorizontalFlip(generator=np.random.default_rng(0))


def test_compose_hands_its_generator_to_each_transform_in_order():
    x = batch(b=16)
    steps = [RandomCrop(16, padding=2), RandomHorizontalFlip(), Normalize(MEAN, STD, torch.bfloat16)]
    out = Compose(steps, generator=seeded(5))(x)
    g, expected = seeded(5), x
    for step in steps:
        expected = step(expected, g)
    assert torch.equal(out, expected) and out.dtype == torch.bfloat16


def test_params_must_fit_the_batch():
    t = RandomHorizontalFlip()
    with pytest.raises(ValueError, match="drawn for 4 samples, the batch has 6"):
        t.apply(batch(), t.draw((4, 3, 20, 28), seeded()))


@pytest.mark.parametrize("make, match", [
    (lambda: RandomCrop(-1), "positive int"),
    (lambda: RandomCrop((4, 0)), "positive int"),
    (lambda: RandomCrop(4, padding=-1), "non-negative"),
    (lambda: RandomCrop(4, padding=(1, 2, 3)), "2 or 4"),
    (lambda: RandomResizedCrop(True), "positive int"),
    (lambda: RandomHorizontalFlip(1.5), r"in \[0, 1\]"),
    (lambda: RandomHorizontalFlip(-0.1), r"in \[0, 1\]"),
    (lambda: RandomHorizontalFlip(float("nan")), r"in \[0, 1\]"),
    (lambda: Normalize((0.5, 0.5), STD), "mean must be 3"),
    (lambda: Normalize(MEAN, (0.2, 0.2, 0.2, 0.2)), "std must be 3"),
    (lambda: Normalize(MEAN, (0.2, 0.0, 0.2)), "std must be > 0"),
    (lambda: Normalize(MEAN, STD, dtype=torch.uint8), "dtype must be one of"),
    (lambda: RandomResizedCrop(8, scale=(0.5, 0.1)), "scale must be"),
    (lambda: RandomResizedCrop(8, scale=(0.0, 1.0)), "scale must be"),
    (lambda: RandomResizedCrop(8, ratio=(1.0,)), "ratio must be"),
    (lambda: RandomResizedCrop(8, ratio=(-1.0, 2.0)), "ratio must be"),
    (lambda: RandomResizedCrop(8, interpolation="nearest"), "interpolation must be one of"),
    (lambda: RandomResizedCrop(8, antialias=1), "antialias must be True or False"),
    (lambda: Compose([RandomCrop(4), "flip"]), "callables"),
])
def test_bad_arguments_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_non_batch_input_is_rejected():
    with pytest.raises(ValueError, match=r"\[B, C, H, W\], got \(3, 20, 28\)"):
        RandomHorizontalFlip()(batch()[0], seeded())


def test_compose_on_a_batch_from_a_real_loader(tmp_path):
    for c in range(2):
        for i in range(3):
            pixels = np.random.default_rng(c * 10 + i).integers(0, 256, (30 + 7 * i, 44, 3), dtype=np.uint8)
            (tmp_path / "src" / f"class_{c}").mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(tmp_path / "src" / f"class_{c}" / f"{i}.jpg", quality=90)
    dsc.compile_folder(tmp_path / "src", tmp_path / "out", size=32, workers=1)
    image = next(iter(dsc.MemmapDataset(tmp_path / "out").loader(4)))["image"]
    aug = Compose([RandomResizedCrop(24), RandomHorizontalFlip(), Normalize(MEAN, STD, torch.float16)])
    out = aug(image, generator=seeded())
    assert image.dtype == torch.uint8 and image.shape == (4, 3, 32, 32)
    assert out.dtype == torch.float16 and out.shape == (4, 3, 24, 24)
    assert out.is_contiguous(memory_format=torch.channels_last) and torch.isfinite(out).all()
    assert torch.equal(out, aug(image.clone(), generator=seeded()))
