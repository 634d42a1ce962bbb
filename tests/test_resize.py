"""Resize stage: size parsing, geometry, and the fast resize against torch's public path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsc.compiler.resize import resample_into, resize_into
from dsc.compiler.target import Target, crop_box, pad_content_size, parse_size
from dsc.errors import CompileError

from conftest import pattern


@pytest.mark.parametrize(("text", "size"), [("224", (224, 224)), ("192x256", (192, 256)), (" 7 X 9 ", (7, 9)),
                                            (32, (32, 32)), ((3, 4), (3, 4))])
def test_parse_size(text, size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "x", "-3", "3x", "1.5", "224x224x3"])
def test_parse_size_refuses(text) -> None:
    with pytest.raises(CompileError, match="is not N or HxW"):
        parse_size(text)


@pytest.mark.parametrize("size", [(0, 5), (9000, 10), (5, 8193)])
def test_target_refuses_sizes_out_of_range(size) -> None:
    with pytest.raises(CompileError, match="must be between 1 and 8192 per side"):
        Target(*size)


@pytest.mark.parametrize(("src", "dst"), [((375, 500), (224, 224)), ((40, 30), (64, 80)), ((64, 80), (64, 80)),
                                          ((1, 1), (5, 7)), ((300, 17), (20, 3))])
def test_fast_resample_equals_torch_interpolate(src, dst) -> None:
    rgb = pattern(*src)
    out = np.zeros((*dst, 3), np.uint8)
    resample_into(rgb, out)
    ref = F.interpolate(torch.from_numpy(rgb).permute(2, 0, 1)[None], size=dst, mode="bilinear", antialias=True)
    assert np.array_equal(out, ref[0].permute(1, 2, 0).numpy())


def test_resample_into_a_sub_view_writes_only_that_view() -> None:
    canvas = np.full((64, 80, 3), 7, np.uint8)
    resample_into(pattern(100, 60), canvas[0:64, 15:65])
    ref = F.interpolate(torch.from_numpy(pattern(100, 60)).permute(2, 0, 1)[None], size=(64, 50),
                        mode="bilinear", antialias=True)[0].permute(1, 2, 0).numpy()
    assert np.array_equal(canvas[:, 15:65], ref)
    assert (canvas[:, :15] == 7).all() and (canvas[:, 65:] == 7).all()


def test_geometry() -> None:
    assert crop_box(375, 500, Target(224, 224)) == (0, 62, 375, 375)
    assert crop_box(500, 375, Target(224, 224)) == (62, 0, 375, 375)
    assert crop_box(100, 100, Target(50, 100)) == (25, 0, 50, 100)
    assert pad_content_size(375, 500, Target(224, 224)) == (168, 224)
    assert pad_content_size(1, 1000, Target(224, 224)) == (1, 224)


def test_pad_centres_the_image_on_black() -> None:
    out = np.full((20, 20, 3), 99, np.uint8)
    resize_into(np.full((10, 40, 3), 200, np.uint8), Target(20, 20, "pad"), out)
    assert (out[:7] == 0).all() and (out[13:] == 0).all() and (out[8:12] == 200).all()
