"""Decode: encoded bytes → an EXIF-oriented RGB uint8 array, at full size unless "fast".

JPEGs (greyscale and YCbCr) go through libjpeg-turbo: the system's libturbojpeg through jpeg4py
where it loads, else the copy that simplejpeg's wheels bundle, so a pip-only machine runs the same
decoder: the two give the same pixels at every scale, and raise on the same damage with the same
words (checked with the system's 2.1.5 against simplejpeg 1.9.0's 3.1.2, accurate IDCT, on 2,000
real photos and on cut scans, missing EOIs and flipped entropy bytes). JPEGs are scaled in the DCT
domain by the largest of 1/8, 1/4, 1/2 that the decode mode allows (other M/8 scales are slower
than a full decode).
The "fast" mode takes any scale that still covers the size the resize needs. The default,
"faithful", decodes in full: against a full decode (benchmarks/decode_fidelity.py),
fine-grained sources miss mean |diff| 2.5 at 1/2 scale whatever the margin (2.8 at 11x
the target), and 1/8 keeps only each block's DC coefficient: no margin holds for all.
Everything else — CMYK JPEGs, PNG, WebP, BMP, TIFF, GIF — goes through Pillow. Pillow cannot
stand in for libjpeg-turbo on JPEGs: its decoder is libjpeg-turbo too, but it drops libjpeg's
warnings, so damage inside a scan would go uncounted.

A JPEG without its final end-of-image marker (FF D9, common in scraped data) is judged the same
way whichever decoder runs, for libjpeg-turbo's "premature end" warning is the same for a cut-off
scan and for a complete one, and Pillow sees no warning at all: the file is decoded twice by
Pillow, with the marker appended and with SCAN_PROBE bytes before it. Bytes after a complete
scan are skipped (identical pixels): it is kept, with an `IncompleteJpegWarning`; a cut-off scan
decodes the probe as image data (other pixels): it is skipped.

Damage inside the scan (corrupt entropy-coded data) only makes libjpeg-turbo warn; both of its
bindings raise on a warning as on an error, and such a file is kept as Pillow decodes it (grey or
smeared blocks), with a `DecoderWarning` that the compiler counts per record: the same count, and
the same pixels, whichever binding runs.

Alpha is composited onto black (premultiplied; the default), onto white, or dropped (the stored
RGB, as Pillow's `convert("RGB")` keeps it); 16-bit samples keep their high byte.
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
# Per decode mode: denominator -> how many times the needed size the scaled decode must be.
# "faithful" never scales: every record within mean |diff| 2.5 of the reference (tests/test_fidelity.py).
DCT_MARGINS: dict[str, dict[int, float]] = {
    "faithful": {},
    "fast": {8: 1.0, 4: 1.0, 2: 1.0},
}
EXIF_ORIENTATION = 0x0112
TURBOJPEG_LIBRARY = "libturbojpeg.so.0"
EOI = b"\xff\xd9"  # JPEG's end-of-image marker
_BARE_MARKERS = frozenset({0x00, 0x01, 0xD8, *range(0xD0, 0xD8)})  # stuffing, TEM, SOI, RSTn: no length
SCAN_PROBE = bytes(range(1, 250, 3))  # no 0xFF: libjpeg skips it after a complete scan, decodes it in a cut one
# "pillow" hides the system library, as on a pip-only machine (tests, comparisons); the name is from when
# such a machine decoded JPEGs with Pillow: it now uses simplejpeg.
DECODER_ENV = "DSC_JPEG_DECODER"
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})

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


class DecoderWarning(UserWarning):
    """A source was decoded and kept despite damage the decoder warned about; counted per record."""


class IncompleteJpegWarning(DecoderWarning):
    """A JPEG lacked only its end-of-image marker: its complete scan was decoded and kept."""


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
    if lib:
        return f"jpeg4py ({lib})"
    import simplejpeg
    return f"simplejpeg {simplejpeg.__version__} (bundled libjpeg-turbo)"


def open_image(data: bytes) -> Image.Image:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            return Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as e:
            raise ImageError(f"decompression bomb refused by Pillow: {e}") from e
        except UnidentifiedImageError as e:  # its message holds an object address: keep reasons reproducible
            raise ImageError("not a recognised image file (no known format's signature)") from e
        except (OSError, ValueError, SyntaxError) as e:
            raise ImageError(f"not a recognised image file ({e})") from e


def _exif_orientation(tiff: bytes) -> int:
    """The Orientation tag of IFD0 of an EXIF (TIFF) block; 1 when absent or unreadable."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    count = int.from_bytes(tiff[ifd:ifd + 2], order) if ifd + 2 <= len(tiff) else 0
    for entry in range(ifd + 2, min(ifd + 2 + 12 * count, len(tiff) - 11), 12):
        if int.from_bytes(tiff[entry:entry + 2], order) == EXIF_ORIENTATION:
            value = int.from_bytes(tiff[entry + 8:entry + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1


def _probe_jpeg(data: bytes) -> Probe | None:
    """Size, mode and orientation of a plain (grey or YCbCr) JPEG from its markers, without
    Pillow (0.2 ms per image saved); None for anything else, which Pillow then examines."""
    pos, orientation, frame = 2, 1, None
    while data[:2] == b"\xff\xd8" and pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0xDA:  # start of scan: every header segment has been seen (EXIF may follow SOF)
            mode = {1: "L", 3: "RGB"}.get(frame[2]) if frame else None
            return Probe("JPEG", mode, frame[1], frame[0], orientation) if mode and all(frame[:2]) else None
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        segment = data[pos + 4:pos + 2 + length]
        if length < 2 or len(segment) != length - 2:
            return None
        if marker == 0xE1 and segment[:6] == b"Exif\0\0" and orientation == 1:
            orientation = _exif_orientation(segment[6:])
        elif marker in _SOF_MARKERS and len(segment) >= 6 and frame is None:
            frame = (int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big"), segment[5])
        pos += 2 + length
    return None


def _probe_pillow(data: bytes) -> Probe:
    img = open_image(data)
    try:
        orientation = int(img.getexif().get(EXIF_ORIENTATION, 1))
    except Exception:  # a broken EXIF block must not lose an otherwise good image
        orientation = 1
    width, height = img.size
    return Probe(img.format or "?", img.mode, width, height, orientation if 1 <= orientation <= 8 else 1)


def probe(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> Probe:
    """Read the header; refuse empty files, unknown formats and oversized images."""
    if not data:
        raise ImageError("empty file (0 bytes)")
    p = _probe_jpeg(data) or _probe_pillow(data)
    if p.width < 1 or p.height < 1:
        raise ImageError(f"invalid dimensions {p.width}x{p.height} in the header")
    if p.width * p.height > max_pixels:
        raise ImageError(f"decompression bomb refused: {p.width}x{p.height} = {p.width * p.height} pixels "
                         f"exceeds the limit of {max_pixels} (--max-pixels)")
    return p


def dct_scale(width: int, height: int, need_w: int, need_h: int, mode: str = "faithful") -> int:
    """The largest power-of-two denominator whose decoded size still covers `mode`'s margin
    times (need_w, need_h)."""
    for s, margin in DCT_MARGINS[mode].items():
        if width // s >= 1 and height // s >= 1 and -(-width // s) >= margin * need_w \
                and -(-height // s) >= margin * need_h:
            return s
    return 1


def _decode_jpeg4py(data: bytes, p: Probe, scale: int) -> np.ndarray:
    """The system's libjpeg-turbo at 1/scale; raises on libjpeg's warnings as on its errors."""
    import jpeg4py

    dst = np.empty((-(-p.height // scale), -(-p.width // scale), 3), np.uint8)
    jpeg4py.JPEG(np.frombuffer(data, np.uint8)).decode(dst=dst)  # the largest scale whose output fits dst
    return dst


def _decode_simplejpeg(data: bytes, p: Probe, scale: int) -> np.ndarray:
    """simplejpeg's bundled libjpeg-turbo at 1/scale, as jpeg4py decodes it: the accurate IDCT and smooth
    upsampling (jpeg4py passes no flags), and libjpeg's warnings raised (strict)."""
    import simplejpeg

    # It takes the smallest scale whose output is at least this size: 1/scale (for images of a few pixels,
    # where a smaller M/8 reaches the same size, it picks what jpeg4py picks: tests/test_decoder_parity.py).
    return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=False, fastupsample=False,
                                  min_height=-(-p.height // scale), min_width=-(-p.width // scale), strict=True)


def _decode_turbo(data: bytes, p: Probe, scale: int) -> np.ndarray:
    """libjpeg-turbo at 1/scale: the system's where it loads, else simplejpeg's (same pixels, same warnings)."""
    return (_decode_jpeg4py if turbojpeg_library() else _decode_simplejpeg)(data, p, scale)


def _to_rgb(img: Image.Image, alpha: str = "black") -> np.ndarray:
    """Any Pillow mode → RGB uint8, alpha composited onto black or white or dropped, 16-bit → high byte."""
    mode = img.mode
    if "transparency" in img.info and mode in ("P", "L", "RGB"):  # palette or colour-key transparency
        img = img.convert("RGBA")
    elif mode == "P":
        img = img.convert("RGB")
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
    return flatten_alpha(a, alpha) if a.shape[2] == 4 else a


def flatten_alpha(rgba: np.ndarray, alpha: str) -> np.ndarray:
    """RGBA uint8 → RGB: `rgb·a/255` onto black, `rgb·a/255 + 255·(255−a)/255` onto white (both
    rounded), or the stored RGB as it is ("drop")."""
    if alpha == "drop":
        return np.ascontiguousarray(rgba[..., :3])
    a = rgba[..., 3:4].astype(np.uint32)
    background = 0 if alpha == "black" else 255 * (255 - a)
    return ((rgba[..., :3] * a + background + 127) // 255).astype(np.uint8)


def _decode_pillow(data: bytes, p: Probe, scale: int, alpha: str = "black") -> np.ndarray:
    img = open_image(data)
    if scale > 1:  # asking for (w // s, h // s) makes Pillow pick exactly 1/s
        img.draft(img.mode, (p.width // scale, p.height // scale))
    try:
        img.load()
        return _to_rgb(img, alpha)
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types for corrupt data
        raise ImageError(f"corrupt or truncated {p.format} data ({e})") from e


def _turbo_message(error: Exception) -> str:
    """libjpeg-turbo's own words from jpeg4py's exception (simplejpeg's holds nothing else)."""
    text = str(error)
    return text.split("error string ", 1)[-1]


def _decode_jpeg(data: bytes, p: Probe, scale: int) -> np.ndarray:
    """libjpeg-turbo; what it refuses or warns about, Pillow judges: decoded there, the file is kept with
    a DecoderWarning carrying libjpeg-turbo's message (corrupt entropy-coded data), else skipped."""
    try:
        return _decode_turbo(data, p, scale)
    except Exception as turbo_error:
        try:
            rgb = _decode_pillow(data, p, scale)
        except ImageError as e:
            raise ImageError(f"{e}; libjpeg-turbo: {_turbo_message(turbo_error)}") from e
        warnings.warn(f"libjpeg-turbo: {_turbo_message(turbo_error)}; kept as Pillow decodes it",
                      DecoderWarning, stacklevel=2)
        return rgb


def lacks_eoi(data: bytes) -> bool:
    """Whether a JPEG's stream ends before its end-of-image marker. The markers are walked as a
    decoder walks them: header segments skipped by their lengths (an EXIF thumbnail's own markers
    inside them too), entropy-coded data up to the next marker; so bytes after the marker (a
    phone's trailer) are never taken for a scan, whatever they hold."""
    pos, end = 2, len(data)
    while pos + 1 < end:
        if data[pos] != 0xFF:  # entropy-coded data: on to the next marker
            pos = data.find(b"\xff", pos + 1)
            if pos < 0:
                return True
            continue
        marker = data[pos + 1]
        if marker == EOI[1]:
            return False
        if marker == 0xFF:  # a fill byte before a marker
            pos += 1
        elif marker in _BARE_MARKERS:  # stuffed 0x00, restart markers, SOI, TEM: no length follows
            pos += 2
        else:  # a segment (SOS too: its entropy-coded data follows its header)
            pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
    return True


def _scan_is_complete(data: bytes) -> bool:
    """Whether a JPEG without its end-of-image marker holds its whole last scan: Pillow decodes it with
    the marker appended and with SCAN_PROBE before the marker, at full size; the same pixels mean the
    probe came after the scan's end. Pillow, not the decoder of this process, so every machine agrees."""
    def pixels(encoded: bytes) -> np.ndarray:
        img = open_image(encoded)
        img.load()
        return np.asarray(img)
    try:
        return np.array_equal(pixels(data + EOI), pixels(data + SCAN_PROBE + EOI))
    except ImageError:
        raise
    except Exception:  # Pillow refuses it either way: nothing complete to keep
        return False


def decode(data: bytes, p: Probe, need_h: int, need_w: int, mode: str = "faithful",
           alpha: str = "black") -> np.ndarray:
    """Decode to an upright RGB array that covers (need_h, need_w) after orientation; `mode`
    ("faithful" or "fast", see DCT_MARGINS) picks how far JPEGs may be scaled down, `alpha`
    ("black", "white" or "drop") what becomes of transparency."""
    if p.swaps_axes:
        need_h, need_w = need_w, need_h
    jpeg = p.format == "JPEG"
    if jpeg and lacks_eoi(data):
        if not _scan_is_complete(data):
            raise ImageError("corrupt or truncated JPEG data (the scan is cut off: no end-of-image marker)")
        warnings.warn("no end-of-image marker (FF D9) after a complete scan; decoded and kept",
                      IncompleteJpegWarning, stacklevel=2)
        data += EOI
    scale = dct_scale(p.width, p.height, need_w, need_h, mode) if jpeg else 1
    if jpeg and p.mode in ("RGB", "L"):
        rgb = _decode_jpeg(data, p, scale)
    else:
        rgb = _decode_pillow(data, p, scale, alpha)
    orient = _ORIENT.get(p.orientation)
    return orient(rgb) if orient else rgb
