"""Decode stage: every supported format to upright RGB, DCT scaling, and clear refusals."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from dsc.compiler import decode as dec
from dsc.errors import ImageError

from conftest import pattern, save


def encode(array: np.ndarray, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kw)
    return buf.getvalue()


def decode_bytes(data: bytes, need: tuple[int, int] = (1, 1)) -> np.ndarray:
    """Decode without DCT scaling unless `need` is small (need=(1,1) would allow 1/8: ask for full)."""
    p = dec.probe(data)
    h, w = p.oriented_size if need == (1, 1) else need
    return dec.decode(data, p, h, w)


@pytest.mark.skipif(dec.turbojpeg_library() is None, reason="libturbojpeg.so.0 is not installed here")
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
@pytest.mark.parametrize("subsampling", [0, 2])  # 4:4:4 and 4:2:0
def test_jpeg4py_and_pillow_give_identical_pixels(scale: int, subsampling: int) -> None:
    data = encode(pattern(203, 317, seed=scale), quality=90, subsampling=subsampling)
    p = dec.probe(data)
    turbo = dec._decode_turbo(data, p, scale)
    pillow = dec._decode_pillow(data, p, scale)
    assert turbo.shape == (-(-203 // scale), -(-317 // scale), 3)
    assert pillow.shape == turbo.shape
    assert np.array_equal(turbo, pillow)


@pytest.mark.parametrize(("size", "need", "scale"), [
    ((3000, 2000), (224, 224), 8),   # 375 x 250 still covers 224
    ((2000, 1500), (224, 224), 4),   # 1/8 would give 188 rows
    ((600, 400), (224, 224), 1),     # 1/2 would give 200 rows
    ((900, 460), (224, 224), 2),
    ((500, 500), (500, 500), 1),
    ((17, 9), (1, 1), 8),
])
def test_fast_dct_scale_is_the_largest_power_of_two_that_covers_the_need(size, need, scale) -> None:
    assert dec.dct_scale(size[0], size[1], need[1], need[0], "fast") == scale
    assert dec.dct_scale(size[0], size[1], need[1], need[0]) == 1  # faithful: always a full decode


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow_exif_transpose(tmp_path: Path, orientation: int) -> None:
    path = save(tmp_path / "o.jpg", pattern(48, 80), orientation=orientation, quality=95)
    got = decode_bytes(path.read_bytes())
    want = np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    assert dec.probe(path.read_bytes()).oriented_size == want.shape[:2]


def test_grayscale_jpeg_becomes_rgb_with_equal_channels() -> None:
    gray = pattern(40, 60)[..., 0]
    got = decode_bytes(encode(gray))
    assert got.shape == (40, 60, 3)
    assert np.array_equal(got[..., 0], got[..., 1]) and np.array_equal(got[..., 1], got[..., 2])


def test_cmyk_jpeg_decodes_like_pillow() -> None:
    buf = io.BytesIO()
    Image.fromarray(pattern(40, 60)).convert("CMYK").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    got = decode_bytes(data)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert dec.probe(data).mode == "CMYK"
    assert np.array_equal(got, want)


def test_rgba_png_is_composited_onto_black() -> None:
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., :3] = (200, 100, 50)
    rgba[..., 3] = [[0], [255], [128], [51]]
    got = decode_bytes(encode(rgba, "PNG"))
    assert got[0].tolist() == [[0, 0, 0]] * 4
    assert got[1].tolist() == [[200, 100, 50]] * 4
    assert got[2, 0].tolist() == [100, 50, 25]  # 200*128/255 = 100.4
    assert got[3, 0].tolist() == [40, 20, 10]


def test_palette_png_with_transparency_and_plain_palette() -> None:
    img = Image.fromarray(pattern(20, 30)).quantize(16)
    plain = io.BytesIO()
    img.save(plain, "PNG")
    assert np.array_equal(decode_bytes(plain.getvalue()), np.asarray(img.convert("RGB")))
    transparent = io.BytesIO()
    img.save(transparent, "PNG", transparency=0)
    got = decode_bytes(transparent.getvalue())
    mask = np.asarray(img) == 0
    assert mask.any() and (got[mask] == 0).all()


def test_16_bit_grayscale_png_keeps_the_high_byte() -> None:
    values = (np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, "PNG")
    got = decode_bytes(buf.getvalue())
    assert np.array_equal(got[..., 0], (values >> 8).astype(np.uint8))


@pytest.mark.parametrize("fmt", ["WEBP", "BMP", "TIFF", "GIF", "PNG"])
def test_other_formats_decode_to_their_rgb(fmt: str) -> None:
    arr = pattern(24, 36)
    kw = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(arr, fmt, **kw)
    got = decode_bytes(data)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert got.shape == (24, 36, 3)
    assert np.array_equal(got, want)


def test_gif_uses_the_first_frame() -> None:
    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (10, 240)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    assert decode_bytes(buf.getvalue()).mean() < 50


@pytest.mark.parametrize(("data", "reason"), [
    (b"", "empty file"),
    (b"this is a text file, not a JPEG", "not a recognised image"),
])
def test_unreadable_bytes_are_refused_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(ImageError, match=reason):
        dec.probe(data)


def test_truncated_jpeg_is_refused() -> None:
    data = encode(pattern(120, 160), quality=90)
    cut = data[: len(data) // 2]
    with pytest.raises(ImageError, match="corrupt or truncated"):
        dec.decode(cut, dec.probe(cut), 120, 160)


def test_decompression_bomb_is_refused_from_the_header() -> None:
    data = encode(np.zeros((300, 400, 3), np.uint8), "PNG")
    with pytest.raises(ImageError, match=r"decompression bomb refused: 400x300 = 120000 pixels .*--max-pixels"):
        dec.probe(data, max_pixels=100_000)
    assert dec.probe(data, max_pixels=120_000).width == 400


def test_float_tiff_is_refused_not_garbled() -> None:
    buf = io.BytesIO()
    Image.fromarray(np.ones((4, 4), np.float32)).save(buf, "TIFF")
    with pytest.raises(ImageError, match="unsupported pixel mode F"):
        decode_bytes(buf.getvalue())


def _jpegs(tmp_path: Path) -> list[bytes]:
    out = []
    for i, (h, w, kw) in enumerate([(33, 47, {}), (64, 64, {"progressive": True}), (20, 90, {"subsampling": 0}),
                                    (50, 30, {"restart_marker_blocks": 1})]):
        for orientation in (1, 6, 8):
            out.append(save(tmp_path / f"{i}_{orientation}.jpg", pattern(h, w), orientation=orientation,
                            **kw).read_bytes())
    out.append(encode(pattern(20, 20)[..., 0]))
    return out


def test_the_jpeg_marker_probe_agrees_with_pillow(tmp_path: Path) -> None:
    for data in _jpegs(tmp_path):
        assert dec._probe_jpeg(data) == dec._probe_pillow(data)
    cmyk = io.BytesIO()
    Image.fromarray(pattern(8, 8)).convert("CMYK").save(cmyk, "JPEG")
    assert dec._probe_jpeg(cmyk.getvalue()) is None  # left to Pillow
    assert dec._probe_jpeg(b"\xff\xd8\xff\xe1\x00") is None
    assert dec._probe_jpeg(encode(pattern(8, 8), "PNG")) is None


def test_colour_key_transparency_is_composited_onto_black() -> None:
    rgb = np.full((4, 4, 3), (10, 20, 30), np.uint8)
    rgb[0, 0] = (200, 100, 50)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG", transparency=(10, 20, 30))
    got = decode_bytes(buf.getvalue())
    assert got[0, 0].tolist() == [200, 100, 50] and (got[1:] == 0).all()


def test_exif_after_the_frame_header_is_still_found(tmp_path: Path) -> None:
    data = save(tmp_path / "o.jpg", pattern(30, 50), orientation=6).read_bytes()
    app1_at = data.index(b"\xff\xe1")
    app1 = data[app1_at:app1_at + 2 + int.from_bytes(data[app1_at + 2:app1_at + 4], "big")]
    without = data.replace(app1, b"")
    sof_at = without.index(b"\xff\xc0")
    sof_end = sof_at + 2 + int.from_bytes(without[sof_at + 2:sof_at + 4], "big")
    moved = without[:sof_end] + app1 + without[sof_end:]
    assert dec._probe_pillow(moved).orientation == 6
    assert dec._probe_jpeg(moved) == dec._probe_pillow(moved)


@pytest.mark.skipif(dec.turbojpeg_library() is None, reason="only libjpeg-turbo's warnings tell the two apart")
@pytest.mark.parametrize("progressive", [False, True])
def test_a_complete_scan_without_eoi_is_kept_with_a_warning_and_a_cut_one_refused(progressive: bool) -> None:
    data = encode(pattern(120, 160), quality=90, progressive=progressive)
    assert data.endswith(dec.EOI)
    whole = decode_bytes(data)
    with pytest.warns(dec.IncompleteJpegWarning, match=r"no end-of-image marker \(FF D9\)"):
        assert np.array_equal(decode_bytes(data[:-2]), whole)
    cut = data[: len(data) * 3 // 4]
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_bytes(cut)


@pytest.mark.parametrize("progressive", [False, True])
def test_only_the_stream_itself_decides_whether_its_end_marker_is_missing(progressive: bool) -> None:
    """Bytes after the end-of-image marker (a phone's trailer) are not a scan, whatever they hold; an
    EXIF thumbnail's own markers, inside its segment, are not the image's."""
    data = encode(pattern(120, 160), quality=90, progressive=progressive)
    trailer = b"SEFT\x00\xff\xda\x00\x0c" + bytes(range(1, 200))  # holds FF DA and no later FF D9
    assert not dec.lacks_eoi(data) and not dec.lacks_eoi(data + trailer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dec.DecoderWarning)  # no warning: nothing is missing
        assert np.array_equal(decode_bytes(data + trailer), decode_bytes(data))
    thumbnail = encode(pattern(8, 8), quality=50)
    app1 = b"\xff\xe1" + (len(thumbnail) + 8).to_bytes(2, "big") + b"Exif\0\0" + thumbnail
    with_thumbnail = data[:2] + app1 + data[2:]
    assert not dec.lacks_eoi(with_thumbnail)
    assert dec.lacks_eoi(with_thumbnail[:-2]) and dec.lacks_eoi(with_thumbnail[: len(with_thumbnail) * 3 // 4])
