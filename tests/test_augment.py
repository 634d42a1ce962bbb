"""dsc.augment: the reference recipes' policies with per-sample randomness, seeded, on real batches."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dsc
from dsc import augment as A
from dsc.transforms import Normalize

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
ROOT = Path(__file__).resolve().parent.parent
POLICIES = [A.RandAugment, A.TrivialAugmentWide, A.AutoAugment]


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> torch.Tensor:
    """A real loader batch: the example photos compiled small, uint8 channels_last."""
    out = tmp_path_factory.mktemp("augment") / "out"
    dsc.compile_folder(ROOT / "examples" / "images", out, size=48, workers=1)
    return next(iter(dsc.MemmapDataset(out).loader(16, order="sequential")))["image"]


def same_image(photos: torch.Tensor, n: int = 32) -> torch.Tensor:
    """n copies of one photo in one batch, so any difference between rows is the augmentation's."""
    return photos[:1].expand(n, -1, -1, -1).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("policy", POLICIES)
def test_each_sample_draws_its_own_operations_and_gets_its_own_pixels(policy, photos):
    """torchvision's and kornia's policies on a batch tensor pick once per batch; these pick per sample."""
    x = same_image(photos)
    params = policy().draw(x.shape, seeded(1))
    assert len({tuple(row) for row in params.ops.tolist()}) > 4
    out = policy().apply(x, params)
    assert len({row.numpy().tobytes() for row in out}) > 4


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_apply_equals_each_sample_alone(policy, photos):
    """Grouping samples by operation changes nothing: row b is what sample b alone would get."""
    t = policy()
    params = t.draw(photos.shape, seeded(2))
    out = t.apply(photos, params)
    alone = torch.cat([t.apply(photos[b:b + 1], A.PolicyParams(params.ops[b:b + 1], params.magnitudes[b:b + 1]))
                       for b in range(len(photos))])
    assert (out.int() - alone.int()).abs().max() <= 1


@pytest.mark.parametrize("make", [*POLICIES, lambda: A.ColorJitter(0.4, 0.4, 0.4, 0.1)])
def test_same_seed_same_output_other_seed_other_output_global_rng_untouched(make, photos):
    state = torch.random.get_rng_state()
    first = make()(photos, seeded(7))
    assert torch.equal(first, make()(photos, seeded(7)))
    assert not torch.equal(first, make()(photos, seeded(8)))
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("make", [*POLICIES, lambda: A.ColorJitter(0.4, 0.4, 0.4, 0.1)])
def test_output_is_what_normalize_takes(make, photos):
    out = make()(photos, seeded(3))
    assert out.dtype == torch.uint8 and out.shape == photos.shape
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(out, photos)
    normalized = Normalize(MEAN, STD)(out)
    assert normalized.dtype == torch.float32 and torch.isfinite(normalized).all()


def test_random_erasing_after_normalize_erases_per_sample_to_the_mean(photos):
    x = Normalize(MEAN, STD)(same_image(photos))
    out = A.RandomErasing(p=0.5)(x, seeded(4))
    assert out.dtype == torch.float32 and out.shape == x.shape
    erased = (out == 0).flatten(1).any(1)
    assert 0 < int(erased.sum()) < len(x)  # some samples erased, not all: p applies per sample
    boxes = {(out[b] == 0).nonzero().min(0).values.tolist().__str__() for b in range(len(x)) if erased[b]}
    assert len(boxes) > 1  # and each where it drew
    assert torch.equal(out, A.RandomErasing(p=0.5)(x, seeded(4)))


def test_mixup_cutmix_targets_are_distributions_with_per_sample_partners(photos):
    x = Normalize(MEAN, STD)(photos)
    labels = torch.arange(len(x)) % 5
    for seed in range(4):  # both branches show up over a few seeds
        mixed, targets = A.MixUpCutMix(5)(x, labels, seeded(seed))
        assert mixed.shape == x.shape and targets.shape == (len(x), 5)
        torch.testing.assert_close(targets.sum(1), torch.ones(len(x)))
        assert (targets >= 0).all()
        again, same = A.MixUpCutMix(5)(x, labels, seeded(seed))
        assert torch.equal(mixed, again) and torch.equal(targets, same)


def test_policy_refuses_float_batches():
    with pytest.raises(ValueError, match="expects uint8"):
        A.RandAugment()(torch.rand(2, 3, 8, 8), seeded())
    with pytest.raises(ValueError, match="needs a seeded torch.Generator"):
        A.TrivialAugmentWide()(torch.zeros(2, 3, 8, 8, dtype=torch.uint8))


def test_missing_kornia_is_one_line_naming_the_extra():
    code = "import sys; sys.modules['kornia'] = None\nimport dsc.augment"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0
    assert "ImportError: dsc.augment needs kornia: pip install 'dsc-images[augment]'" in done.stderr


def test_the_imagenet_recipe_example_trains_a_few_steps(tmp_path):
    spec = importlib.util.spec_from_file_location("imagenet_recipe", ROOT / "examples" / "imagenet_recipe.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    dsc.compile_folder(ROOT / "examples" / "images", tmp_path / "out", size=40, workers=1)
    for policy in ("ra", "ta_wide", "imagenet"):
        losses = recipe.train(tmp_path / "out", steps=3, batch_size=8, crop=32, policy=policy, random_erase=0.5)
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
