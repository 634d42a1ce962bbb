"""Decode: encoded bytes → an EXIF-oriented RGB uint8 array, as small as the resize allows.

JPEGs go through libjpeg-turbo (jpeg4py), scaled in the DCT domain by the largest of
1/8, 1/4, 1/2 that still covers the size the resize needs (other M/8 scales are slower
than a full decode). Everything else — CMYK JPEGs, PNG, WebP, BMP, TIFF, GIF — goes
through Pillow, as do JPEGs where the system's libturbojpeg is missing; Pillow's JPEG
decoder is libjpeg-turbo too, and at the same scale gives the same pixels.

Alpha is composited onto black (premultiplied); 16-bit samples keep their high byte.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
from PIL import Image, UnidentifiedImageError

from dsc.errors import ImageError

DEFAULT_MAX_PIXELS = 100_000_000  # ~300 MB as RGB: refuse larger headers before allocating
DCT_SCALES = (8, 4, 2)  # the power-of-two denominators that make decoding faster
EXIF_ORIENTATION = 0x0112
TURBOJPEG_LIBRARY = "libturbojpeg.so.0"
DECODER_ENV = "DSC_JPEG_DECODER"  # "pillow" forces the fallback (tests, comparisons)

# Each EXIF orientation (1-8) as the numpy view that shows the image upright.
_ORIENT: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
    8: lambda a: np.rot90(a, 1),
}


@dataclass(frozen=True)
class Probe:
    """What an image's header says, read before any pixel is decoded."""

    format: str
    mode: str
    width: int  # as stored in the file, before orientation
    height: int
    orientation: int

    @property
    def swaps_axes(self) -> bool:
        return self.orientation in (5, 6, 7, 8)

    @property
    def oriented_size(self) -> tuple[int, int]:
        """(height, width) as the image is meant to be seen."""
        return (self.width, self.height) if self.swaps_axes else (self.height, self.width)


@cache
def turbojpeg_library() -> str | None:
    """The libjpeg-turbo library jpeg4py uses, or None when it cannot be loaded here."""
    if os.environ.get(DECODER_ENV, "").lower() == "pillow":
        return None
    try:
        import jpeg4py
        jpeg4py.initialize(backends=(TURBOJPEG_LIBRARY,))
    except (ImportError, OSError):
        return None
    return TURBOJPEG_LIBRARY


def decoder_name() -> str:
    """How JPEGs are decoded in this process, for the manifest and for users."""
    lib = turbojpeg_library()
    return f"jpeg4py ({lib})" if lib else f"Pillow {Image.__version__} (bundled libjpeg-turbo)"


def open_image(data: bytes) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ImageError(f"decompression bomb refused by Pillow: {e}") from e
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"not a recognised image file ({e})") from e


def probe(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Probe:
    """Read the header; refuse empty files, unknown formats and oversized images."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    img = open_image(data)
    width, height = img.size
    if width < 1 or height < 1:
        raise ImageError(f"invalid dimensions {width}x{height} in the header")
    if width * height > max_pixels:
        raise ImageError(f"decompression bomb refused: {width}x{height} = {width * height} pixels "
                         f"exceeds the limit of {max_pixels} (--max-pixels)")
    try:
        orientation = int(img.getexif().get(EXIF_ORIENTATION, 1))
    except Exception:  # a broken EXIF block must not lose an otherwise good image
        orientation = 1
    return Probe(img.format or "?", img.mode, width, height, orientation if 1 <= orientation <= 8 else 1)


def dct_scale(width: int, height: int, need_w: int, need_h: int) -> int:
    """The largest power-of-two denominator whose decoded size still covers (need_w, need_h)."""
    for s in DCT_SCALES:
        if width // s >= 1 and height // s >= 1 and -(-width // s) >= need_w and -(-height // s) >= need_h:
            return s
    return 1


def _decode_turbo(data: bytes, p: Probe, scale: int) -> np.ndarray:
    import jpeg4py

    dst = np.empty((-(-p.height // scale), -(-p.width // scale), 3), np.uint8)
    jpeg4py.JPEG(np.frombuffer(data, np.uint8)).decode(dst=dst)  # dst's size selects the DCT scale
    return dst


def _to_rgb(img: Image.Image) -> np.ndarray:
    """Any Pillow mode → RGB uint8, alpha composited onto black, 16-bit → high byte."""
    mode = img.mode
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    elif mode.startswith("I;16") or mode == "I":
        a = np.asarray(img).astype(np.uint32)
        a = (a >> 8) if mode.startswith("I;16") or a.max(initial=0) > 255 else a
        return np.repeat(np.clip(a, 0, 255).astype(np.uint8)[..., None], 3, axis=2)
    elif mode == "F":
        raise ImageError("unsupported pixel mode F (floating point)")
    elif mode in ("LA", "PA", "La", "RGBa"):
        img = img.convert("RGBA")
    elif mode not in ("RGB", "RGBA"):
        img = img.convert("RGB")
    a = np.asarray(img)
    if a.shape[2] == 4:
        alpha = a[..., 3:4].astype(np.uint16)
        a = ((a[..., :3] * alpha + 127) // 255).astype(np.uint8)
    return a


def _decode_pillow(data: bytes, p: Probe, scale: int) -> np.ndarray:
    img = open_image(data)
    if scale > 1:  # asking for (w // s, h // s) makes Pillow pick exactly 1/s
        img.draft(img.mode, (p.width // scale, p.height // scale))
    try:
        img.load()
        return _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types for corrupt data
        raise ImageError(f"corrupt or truncated {p.format} data ({e})") from e


def decode(data: bytes, p: Probe, need_h: int, need_w: int) -> np.ndarray:
    """Decode to an upright RGB array that covers (need_h, need_w) after orientation."""
    if p.swaps_axes:
        need_h, need_w = need_w, need_h
    jpeg = p.format == "JPEG"
    scale = dct_scale(p.width, p.height, need_w, need_h) if jpeg else 1
    if jpeg and p.mode in ("RGB", "L") and turbojpeg_library():
        try:
            rgb = _decode_turbo(data, p, scale)
        except Exception as turbo_error:  # warnings count as errors: let Pillow judge
            try:
                rgb = _decode_pillow(data, p, scale)
            except ImageError as e:
                raise ImageError(f"{e}; libjpeg-turbo: {turbo_error}") from e
    else:
        rgb = _decode_pillow(data, p, scale)
    orient = _ORIENT.get(p.orientation)
    return orient(rgb) if orient else rgb
