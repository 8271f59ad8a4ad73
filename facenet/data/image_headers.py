"""What an image file declares before it is decoded: its format and size, a PNG's checksums.

Decoders allocate what the header asks for (a 400 KB PNG can declare 20000 x 20000 pixels), so
the size is checked against limits first. Every function raises ``ValueError`` with a short
reason; :mod:`facenet.data.images` names the file.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers, which hold the size: C0..CF but DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = set(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field: TEM, RST0..7 (and SOI, handled before the loop).
_JPEG_STANDALONE = {0x01, *range(0xD0, 0xD8)}


@dataclass(frozen=True)
class ImageHeader:
    format: str  # "jpeg", "png", "gif", "webp" or "bmp"
    width: int
    height: int


def _read_exact(fh, n):
    """``n`` bytes of the header; EOFError when the file ends first (read_header names it)."""
    data = fh.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _jpeg_size(fh):
    """(width, height) from the first start-of-frame segment, walking the segments."""
    while True:
        if _read_exact(fh, 1) != b"\xff":
            raise ValueError("JPEG header: expected a marker")
        marker = _read_exact(fh, 1)[0]
        while marker == 0xFF:  # fill bytes before a marker
            marker = _read_exact(fh, 1)[0]
        if marker in _JPEG_STANDALONE:
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            raise ValueError("JPEG header: no frame header before the image data")
        (length,) = struct.unpack(">H", _read_exact(fh, 2))
        if length < 2:
            raise ValueError("JPEG header: segment length below 2")
        if marker in _JPEG_SOF:
            segment = _read_exact(fh, length - 2)
            if len(segment) < 5:
                raise ValueError("JPEG frame header too short")
            height, width = struct.unpack(">HH", segment[1:5])
            return width, height
        fh.seek(length - 2, 1)


def _png_size(fh):
    length, kind = struct.unpack(">I4s", _read_exact(fh, 8))
    if kind != b"IHDR" or length != 13:
        raise ValueError("PNG header: the first chunk is not a 13-byte IHDR")
    return struct.unpack(">II", _read_exact(fh, 8))


def _webp_size(fh):
    """(width, height) from the first chunk after ``RIFF....WEBP``: VP8, VP8L or VP8X."""
    kind = _read_exact(fh, 8)[:4]
    body = _read_exact(fh, 10)
    if kind == b"VP8 ":  # frame tag (3 bytes), start code 9d 01 2a, 14-bit sizes
        if body[3:6] != b"\x9d\x01\x2a":
            raise ValueError("WebP header: bad VP8 start code")
        width, height = struct.unpack("<HH", body[6:10])
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L":  # signature 0x2f, then 14 bits width - 1, 14 bits height - 1
        if body[0] != 0x2F:
            raise ValueError("WebP header: bad VP8L signature")
        bits = int.from_bytes(body[1:5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":  # flags (4 bytes), canvas width - 1 and height - 1 (24 bits each)
        return int.from_bytes(body[4:7], "little") + 1, int.from_bytes(body[7:10], "little") + 1
    raise ValueError(f"WebP header: unknown chunk {kind!r}")


def _bmp_size(fh):
    """(width, height) from the DIB header after the 14-byte file header."""
    (dib_size,) = struct.unpack("<I", _read_exact(fh, 4))
    if dib_size == 12:  # BITMAPCOREHEADER: 16-bit sizes
        return struct.unpack("<HH", _read_exact(fh, 4))
    if dib_size < 40:
        raise ValueError(f"BMP header: unknown {dib_size}-byte info header")
    width, height = struct.unpack("<ii", _read_exact(fh, 8))
    return width, abs(height)  # a negative height: rows stored top-down


def image_format(head: bytes) -> str | None:
    """The format of a file that starts with ``head``, or None when it is none of ours."""
    if head.startswith(b"\xff\xd8"):
        return "jpeg"
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "bmp" if head[:2] == b"BM" else None


# format -> (where its size reader starts, the reader)
_SIZE_READERS = {
    "jpeg": (2, _jpeg_size),
    "png": (8, _png_size),
    "gif": (6, lambda fh: struct.unpack("<HH", _read_exact(fh, 4))),
    "webp": (12, _webp_size),
    "bmp": (14, _bmp_size),
}


def read_header(fh: BinaryIO) -> ImageHeader:
    """The format and declared size, read from the header alone of the seekable ``fh``."""
    kind = image_format(fh.read(14))
    if kind is None:
        raise ValueError("not a JPEG, PNG, GIF, WebP or BMP file")
    start, size_reader = _SIZE_READERS[kind]
    fh.seek(start)
    try:
        width, height = size_reader(fh)
    except EOFError:
        raise ValueError(f"truncated {kind.upper()} header") from None
    if width < 1 or height < 1:
        raise ValueError(f"{kind.upper()} header declares {width} x {height} pixels")
    return ImageHeader(kind, width, height)


def check_size(header: ImageHeader, max_pixels: int, max_aspect_ratio: float) -> None:
    """Refuse a declared width x height over ``max_pixels`` or a long / short side over
    ``max_aspect_ratio``."""
    w, h = header.width, header.height
    if w * h > max_pixels:
        raise ValueError(
            f"{w} x {h} = {w * h} pixels is more than the limit of {max_pixels} "
            "(data.max_image_pixels)"
        )
    ratio = max(w, h) / min(w, h)
    if ratio > max_aspect_ratio:
        raise ValueError(
            f"{w} x {h} has an aspect ratio of {ratio:.1f}, more than the limit of "
            f"{max_aspect_ratio:g} (data.max_aspect_ratio)"
        )


def check_png_chunks(data: bytes) -> None:
    """Verify the CRC-32 of every chunk of the whole PNG ``data`` up to IEND, and an IDAT."""
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG file")
    pos, seen_idat = len(PNG_SIGNATURE), False
    while True:
        if pos + 12 > len(data):
            raise ValueError("PNG cut short: no IEND chunk")
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        end = pos + 8 + length
        if end + 4 > len(data):
            raise ValueError(f"PNG chunk {kind!r} at byte {pos} runs past the end of the file")
        (crc,) = struct.unpack(">I", data[end : end + 4])
        if zlib.crc32(data[pos + 4 : end]) != crc:
            name = kind.decode("latin-1")
            raise ValueError(f"PNG chunk {name!r} at byte {pos} fails its CRC check (damaged)")
        seen_idat = seen_idat or kind == b"IDAT"
        if kind == b"IEND":
            break
        pos = end + 4
    if not seen_idat:
        raise ValueError("PNG has no image data (IDAT)")
