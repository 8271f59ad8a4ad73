"""Encoded images of every kind the checked decoder meets, for the tests of each of its callers
(files and bytes, folders, pairs, ``.bin`` sets, embedding, alignment).

``GOOD`` cases decode to a known uint8 RGB image (24 x 24, so a resize to 24 leaves it as it
is); ``BAD`` cases are refused with a reason containing a known phrase, never a crash.
"""

from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torchvision.io import decode_image, encode_jpeg

SIDE = 24
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class GoodCase:
    """An image that decodes: its bytes, file suffix and the image expected (a JPEG: as
    torchvision decodes it, the decoder the checked one hands JPEGs to).

    Args:
        data: the encoded image.
        suffix: its file extension.
        expected: uint8 (3, 24, 24).
    """

    data: bytes
    suffix: str
    expected: torch.Tensor


@dataclass(frozen=True)
class BadCase:
    """An image refused by the decoder: its bytes, file suffix and a phrase of the reason."""

    data: bytes
    suffix: str
    reason: str


def pixels(seed: int = 0) -> np.ndarray:
    """A smooth random RGB image (24, 24, 3) uint8: JPEG keeps it close."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return np.kron(coarse, np.ones((6, 6, 1), dtype=np.uint8))


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W)."""
    return torch.from_numpy(np.array(array)).permute(2, 0, 1).contiguous()


def pil_bytes(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk with its CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_from_rows(width: int, height: int, depth: int, color: int, rows: bytes) -> bytes:
    """A PNG written by hand: IHDR, one IDAT of ``rows`` (filter bytes included), IEND."""
    header = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (
        PNG_SIGNATURE
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )


def png16(samples: np.ndarray) -> bytes:
    """A 16-bit PNG of (H, W) grayscale or (H, W, 3) RGB uint16 samples (Pillow writes no
    16-bit RGB)."""
    height, width = samples.shape[:2]
    color = 0 if samples.ndim == 2 else 2
    big_endian = samples.astype(">u2").reshape(height, -1)
    rows = b"".join(b"\x00" + row.tobytes() for row in big_endian)
    return png_from_rows(width, height, 16, color, rows)


def sixteen_bit(high: np.ndarray, seed: int) -> np.ndarray:
    """16-bit samples whose high byte is ``high`` and whose low byte is random: scaling to 8
    bits gives ``high`` back, clipping would give 255 almost everywhere."""
    low = np.random.default_rng(seed).integers(0, 256, high.shape)
    return high.astype(np.uint16) * 256 + low.astype(np.uint16)


def animated(fmt: str, **options) -> tuple[bytes, torch.Tensor]:
    """Three flat frames of different colours; the first frame's image."""
    colours = [(200, 30, 40), (10, 220, 30), (0, 0, 250)]
    frames = [Image.new("RGB", (SIDE, SIDE), c) for c in colours]
    data = pil_bytes(
        frames[0], fmt, save_all=True, append_images=frames[1:], duration=100, **options
    )
    return data, as_tensor(np.asarray(frames[0]))


def damaged_png() -> bytes:
    """A PNG with two bytes of its IDAT data flipped (its CRC then fails)."""
    data = bytearray(pil_bytes(Image.fromarray(pixels(3)), "PNG"))
    start = data.index(b"IDAT") + 4
    data[start + 10] ^= 0xFF
    data[start + 11] ^= 0xFF
    return bytes(data)


def bad_filter_png() -> bytes:
    """A PNG whose rows name filter type 7 (there are 5), every CRC valid."""
    rows = b"".join(b"\x07" + bytes(SIDE * 3) for _ in range(SIDE))
    return png_from_rows(SIDE, SIDE, 8, 2, rows)


def jpeg_declaring(width: int, height: int) -> bytes:
    """SOI, a baseline frame header declaring ``width`` x ``height``, EOI."""
    frame = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"
    return b"\xff\xd8\xff\xc0" + struct.pack(">H", len(frame) + 2) + frame + b"\xff\xd9"


def png_declaring(width: int, height: int) -> bytes:
    """A valid PNG structure (CRCs right) declaring ``width`` x ``height``."""
    rows = b"\x00" * 16
    return png_from_rows(width, height, 8, 2, rows)


def gif_frame_declaring(side: int) -> bytes:
    """A GIF whose screen is 10 x 10 but whose first frame declares ``side`` x ``side``."""
    screen = b"GIF89a" + struct.pack("<HHBBB", 10, 10, 0, 0, 0)
    frame = b"\x2c" + struct.pack("<HHHHB", 0, 0, side, side, 0x80) + b"\x00" * 3 + b"\xff" * 3
    return screen + frame + b"\x02\x02\x44\x01\x00\x3b"


def bmp_declaring(width: int, height: int) -> bytes:
    """A 24-bit BMP file header and info header declaring ``width`` x ``height``, then 16
    bytes of pixels: the size a decoder would allocate is only in the header."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    size = 14 + len(info) + 16
    return b"BM" + struct.pack("<IHHI", size, 0, 0, 14 + len(info)) + info + bytes(16)


def good_cases() -> dict[str, GoodCase]:
    """Every kind of decodable image, by name."""
    rgb = pixels(0)
    gray = pixels(1)[:, :, 0]
    jpeg = (
        encode_jpeg(as_tensor(rgb), quality=95).numpy().tobytes()
    )  # lossy: as torchvision reads it
    cases = {
        "png": GoodCase(pil_bytes(Image.fromarray(rgb), "PNG"), ".png", as_tensor(rgb)),
        "png_gray": GoodCase(
            pil_bytes(Image.fromarray(gray), "PNG"), ".png", as_tensor(np.dstack([gray] * 3))
        ),
        "jpeg": GoodCase(
            jpeg, ".jpg", decode_image(torch.frombuffer(bytearray(jpeg), dtype=torch.uint8))
        ),
        "png16_gray": GoodCase(
            png16(sixteen_bit(gray, 2)), ".png", as_tensor(np.dstack([gray] * 3))
        ),
        "png16_rgb": GoodCase(png16(sixteen_bit(rgb, 3)), ".png", as_tensor(rgb)),
        "bmp": GoodCase(pil_bytes(Image.fromarray(rgb), "BMP"), ".bmp", as_tensor(rgb)),
        "webp_lossless": GoodCase(
            pil_bytes(Image.fromarray(rgb), "WEBP", lossless=True), ".webp", as_tensor(rgb)
        ),
    }
    for name, fmt, suffix, options in (
        ("gif_animated", "GIF", ".gif", {}),
        ("png_animated", "PNG", ".png", {}),
        ("webp_animated", "WEBP", ".webp", {"lossless": True}),
    ):
        data, first = animated(fmt, **options)
        cases[name] = GoodCase(data, suffix, first)
    return cases


def bad_cases() -> dict[str, BadCase]:
    """Every kind of refused image, by name: damaged data and sizes over the default limits
    (``reason`` is a regular expression)."""
    return {
        "png_crc_damaged": BadCase(damaged_png(), ".png", "fails its CRC check"),
        "png_bad_filter": BadCase(bad_filter_png(), ".png", "unrecognized data stream"),
        "jpeg_huge": BadCase(jpeg_declaring(60000, 60000), ".jpg", "more than the limit"),
        "png_huge": BadCase(png_declaring(60000, 60000), ".png", "more than the limit"),
        "png_strip": BadCase(png_declaring(20000, 10), ".png", "aspect ratio"),
        "bmp_huge": BadCase(bmp_declaring(60000, 60000), ".bmp", "more than the limit"),
        "bmp_strip": BadCase(bmp_declaring(20000, -10), ".bmp", "aspect ratio"),
        "gif_huge_frame": BadCase(gif_frame_declaring(60000), ".gif", "exceeds limit"),
        "gif_large_frame": BadCase(gif_frame_declaring(12000), ".gif", "more than the limit"),
        "not_an_image": BadCase(b"hello, world" * 4, ".jpg", "not a (complete )?JPEG, PNG"),
    }


GOOD = good_cases()
BAD = bad_cases()
