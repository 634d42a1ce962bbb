"""Whole-image augmentation of `--fit stretch` records, and the eval transforms, against
independent per-image Pillow references on real photos (tests/data/photos)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from dsc import MemmapDataset, compile_folder
from dsc.boxes import boxes
from dsc.eval_transforms import CenterCrop, OriginalCenterCrop, Resize
from dsc.transforms import RandomResizedCrop

from conftest import ref_box

PHOTOS = Path(__file__).parent / "data" / "photos"


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def original(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return ImageOps.exif_transpose(img).convert("RGB")


@pytest.fixture(scope="module")
def stretched(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The photos compiled with --fit stretch to 256x256, served as one CPU batch."""
    tmp = tmp_path_factory.mktemp("stretch")
    shutil.copytree(PHOTOS, tmp / "src", ignore=shutil.ignore_patterns("*.md"))
    compile_folder(tmp / "src", tmp / "out", size=256, fit="stretch", workers=1)
    ds = MemmapDataset(tmp / "out")
    batch = next(iter(ds.loader(len(ds), order="sequential")))
    return {"image": batch["image"], "size": batch["size"], "paths": [ds.source(i) for i in range(len(ds))],
            "fits": (ds.fit, batch.fit)}


def mean_diff(ours: torch.Tensor, reference: Image.Image) -> float:
    return float(np.abs(ours.permute(1, 2, 0).numpy().astype(np.int16) - np.asarray(reference)).mean())


# RandomResizedCrop(original_sizes=True)

WRONG_PLACE = 14  # mean |diff| of the same crops when the box is not mapped into the record (measured)
# A stretched 256x256 record of a 320x213 photo has been resampled once already, and the crop
# resamples it again without antialiasing (torchvision's antialias=False), while the reference is
# one antialiased resample of the original: measured up to 3.5 per crop. 6 allows for that and
# stays far below a crop of the wrong region.
CROP_LIMIT = 6.0


def test_aspect_aware_crops_equal_pillow_crops_of_the_original_boxes(stretched: dict) -> None:
    x, sizes = stretched["image"], stretched["size"]
    t = RandomResizedCrop(96, scale=(0.25, 1.0), original_sizes=True)
    worst = 0.0
    for seed in range(6):
        draws = t.draw(x.shape, seeded(seed))
        out = t.apply(x, draws, sizes)
        box = boxes(draws, sizes[:, 0], sizes[:, 1], t.ratio)
        for i, path in enumerate(stretched["paths"]):
            top, left, h, w = (int(v[i]) for v in box)
            ref = original(path).resize((96, 96), Image.BILINEAR, box=(left, top, left + w, top + h))
            worst = max(worst, mean_diff(out[i], ref))
    assert worst <= CROP_LIMIT < WRONG_PLACE


def test_aspect_aware_boxes_follow_torchvision_rules_on_original_sizes() -> None:
    sizes = torch.tensor([[213, 320], [1200, 300], [50, 900], [480, 480], [7, 5]] * 40)  # some fall back
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    t = RandomResizedCrop(32, scale, ratio, original_sizes=True)
    draws = t.draw((len(sizes), 3, 64, 64), seeded(11))
    got = list(zip(*(v.tolist() for v in boxes(draws, sizes[:, 0], sizes[:, 1], ratio))))
    want = [ref_box(draws.draws[i], int(h), int(w), scale, ratio) for i, (h, w) in enumerate(sizes.tolist())]
    assert got == want


def test_box_statistics_match_the_documented_distributions() -> None:
    """Where every draw fits (a square original, areas up to half), torchvision's rules make the
    area fraction uniform on `scale` and log(w / h) uniform on log(`ratio`): Kolmogorov-Smirnov
    distance below 0.02 on 20000 boxes (the 0.1% critical value is 0.014; side rounding adds
    ~0.003 at 2000 px)."""
    n, scale, ratio = 20000, (0.08, 0.5), (3 / 4, 4 / 3)
    sizes = torch.tensor([[2000, 2000]]).repeat(n, 1)
    t = RandomResizedCrop(32, scale, ratio, original_sizes=True)
    box = boxes(t.draw((n, 3, 8, 8), seeded(5)), sizes[:, 0], sizes[:, 1], ratio)
    area = (box.height * box.width).double().numpy() / 2000 ** 2
    log_ratio = torch.log(box.width.double() / box.height.double()).numpy()

    def ks_uniform(values: np.ndarray, low: float, high: float) -> float:
        cdf = (np.sort(values) - low) / (high - low)
        return float(np.abs(cdf - np.arange(1, len(values) + 1) / len(values)).max())

    assert ks_uniform(area, *scale) < 0.02
    assert ks_uniform(log_ratio, math.log(ratio[0]), math.log(ratio[1])) < 0.02
    assert ks_uniform(area, 0.08, 1.0) > 0.3  # the check can fail: a wrong range is caught


def test_aspect_aware_mode_needs_the_sizes(stretched: dict) -> None:
    t = RandomResizedCrop(32, original_sizes=True, generator=seeded())
    with pytest.raises(ValueError, match=r"sizes=batch\['size'\]"):
        t(stretched["image"])
    with pytest.raises(ValueError, match=r"integer tensor \[4, 2\]"):
        t(stretched["image"], sizes=stretched["size"][:2])


# eval transforms

def pillow_eval(img: Image.Image, resize: int = 256, crop: int = 224) -> Image.Image:
    """torchvision's Resize(int) + CenterCrop geometry, with Pillow's BILINEAR, on one image."""
    w, h = img.size
    nh, nw = (resize, int(resize * w / h)) if h <= w else (int(resize * h / w), resize)
    top, left = int(round((nh - crop) / 2)), int(round((nw - crop) / 2))
    return img.resize((nw, nh), Image.BILINEAR).crop((left, top, left + crop, top + crop))


# Resize+CenterCrop of the same pixels: both are antialiased bilinear (triangle) filters, Pillow's
# in fixed point, ours in float32, so pixels differ by rounding (at most a level or two).
ROUNDING_MEAN, ROUNDING_MAX = 0.5, 3


def test_resize_and_center_crop_equal_pillow_per_image() -> None:
    photos = [original(PHOTOS / n).crop((0, 0, 320, 213)) for n in ("chelsea.jpg", "rocket.jpg", "coffee.jpg")]
    x = torch.stack([torch.from_numpy(np.array(p)).permute(2, 0, 1) for p in photos])
    x = x.contiguous(memory_format=torch.channels_last)
    out = CenterCrop(224)(Resize(256)(x))
    assert out.shape == (3, 3, 224, 224) and out.dtype == torch.uint8
    assert out.is_contiguous(memory_format=torch.channels_last)
    for ours, photo in zip(out, photos):
        diff = np.abs(ours.permute(1, 2, 0).numpy().astype(np.int16) - np.asarray(pillow_eval(photo)))
        assert diff.mean() <= ROUNDING_MEAN and diff.max() <= ROUNDING_MAX


def test_original_center_crop_of_stretched_records_equals_pillow_on_the_originals(stretched: dict) -> None:
    x, sizes = stretched["image"], stretched["size"]
    ours = OriginalCenterCrop(224, 256)(x, sizes=sizes)
    distorted = CenterCrop(224)(Resize(256, allow_stretched=True)(x))  # the plain recipe on a stretched record
    for i, path in enumerate(stretched["paths"]):
        ref = pillow_eval(original(path))
        assert mean_diff(ours[i], ref) <= CROP_LIMIT
    assert max(mean_diff(distorted[i], pillow_eval(original(p))) for i, p in enumerate(stretched["paths"])) \
        > WRONG_PLACE


@pytest.fixture(scope="module")
def cropped(tmp_path_factory: pytest.TempPathFactory) -> MemmapDataset:
    """The photos compiled with the default --fit center-crop, 256x256."""
    tmp = tmp_path_factory.mktemp("crop")
    shutil.copytree(PHOTOS, tmp / "src", ignore=shutil.ignore_patterns("*.md"))
    compile_folder(tmp / "src", tmp / "out", size=256, workers=1)
    return MemmapDataset(tmp / "out")


def test_batches_carry_the_fit_they_were_compiled_with(stretched: dict, cropped: MemmapDataset) -> None:
    batch = next(iter(cropped.loader(2)))
    assert (cropped.fit, batch.fit, batch.to("cpu", non_blocking=True).fit) == ("center-crop",) * 3
    assert stretched["fits"] == ("stretch", "stretch")


def test_stretch_transforms_refuse_center_crop_records_naming_both_fits(cropped: MemmapDataset) -> None:
    batch = next(iter(cropped.loader(len(cropped), order="sequential")))
    both = r"--fit stretch.*--fit center-crop"
    with pytest.raises(ValueError, match=both + r".*CenterCrop\(224\)\(Resize\(256\)"):
        OriginalCenterCrop(224, 256)(batch["image"], sizes=batch["size"])
    with pytest.raises(ValueError, match=both):
        RandomResizedCrop(96, original_sizes=True)(batch["image"], seeded(), sizes=batch["size"])
    image, size = next(iter(cropped.loader(2, as_tuple=("image", "size"))))  # tuples carry it too
    with pytest.raises(ValueError, match=both):
        OriginalCenterCrop(224, 256)(image.clone(), sizes=size)  # the sizes alone say it
    out = CenterCrop(224)(Resize(256)(batch["image"]))  # the right pairing for these records
    assert out.shape == (len(cropped), 3, 224, 224)


def test_resize_and_center_crop_refuse_stretched_records_unless_told(stretched: dict) -> None:
    x = stretched["image"]
    for transform in (Resize(256), CenterCrop(224)):
        with pytest.raises(ValueError, match=r"--fit stretch, not --fit center-crop.*OriginalCenterCrop\(.*"
                                             r"allow_stretched=True"):
            transform(x)
    assert CenterCrop(224, allow_stretched=True)(Resize(256, allow_stretched=True)(x)).shape == (4, 3, 224, 224)
    assert OriginalCenterCrop(224, 256)(x, sizes=stretched["size"]).shape == (4, 3, 224, 224)


def test_random_resized_crop_refuses_sizes_it_would_ignore(stretched: dict) -> None:
    with pytest.raises(ValueError, match=r"without original_sizes=True.*ignore"):
        RandomResizedCrop(96)(stretched["image"], seeded(), sizes=stretched["size"])


@pytest.mark.parametrize(("make", "match"), [(lambda: Resize(0), "positive int"),
                                             (lambda: CenterCrop((0, 3)), "positive int"),
                                             (lambda: OriginalCenterCrop(300, 256), "must not exceed")])
def test_bad_eval_arguments_raise_value_error(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_center_crop_larger_than_the_batch_is_an_error() -> None:
    with pytest.raises(ValueError, match="larger than the images"):
        CenterCrop(30)(torch.zeros(2, 3, 20, 40, dtype=torch.uint8))


def _torchvision_v2():
    try:  # torchvision from PyPI fails to import with some torch builds (not only ImportError)
        from torchvision.transforms import v2
    except Exception as e:  # any import failure means: not usable here
        pytest.skip(f"torchvision does not import here ({type(e).__name__}: {e})")
    return v2


def test_torchvision_mixup_and_cutmix_take_dsc_batches(stretched: dict) -> None:
    """The README's recipe: v2.MixUp/CutMix on a whole normalised dsc batch and its labels."""
    v2 = _torchvision_v2()
    from dsc.transforms import Normalize

    x = Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))(stretched["image"])
    labels = torch.tensor([0, 1, 2, 3])
    for mix in (v2.MixUp(num_classes=4), v2.CutMix(num_classes=4)):
        images, soft = mix(x, labels)
        assert images.shape == x.shape and soft.shape == (4, 4)
        torch.testing.assert_close(soft.sum(dim=1), torch.ones(4))
        assert not torch.equal(images, x)  # pixels of another sample were mixed in
