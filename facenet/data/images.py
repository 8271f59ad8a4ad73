"""Reading face images and the train/eval transforms.

Every image the project decodes (folders, pairs files, insightface ``.bin`` sets, alignment,
embedding) goes through one checked decoder: :func:`read_image` for a file,
:func:`decode_image_bytes` for an image held in memory. Images are decoded into uint8 RGB
tensors (3, H, W): grayscale is replicated to three channels, the alpha channel of RGBA is
dropped, 16-bit images are scaled to 8 bits and an animated image (GIF, APNG, animated WebP)
gives its first frame. Decoding never takes the process down and never allocates more than
the limits allow:

- only regular files are opened (a FIFO or a device would block or never end), and a file
  (or a byte string) larger than any image within the pixel limit is refused unread;
- the declared size is read from the header and checked against ``max_pixels`` and
  ``max_aspect_ratio`` before anything is decoded (:mod:`facenet.data.image_headers`);
- PNGs have every chunk's CRC verified and are decoded by Pillow, which raises on bad data:
  torchvision's PNG decoder (libpng with ``setjmp``/``longjmp`` error handling in the function
  that also holds the output tensor) ends in a segmentation fault when libpng reports an error
  in the image data, e.g. a "bad adaptive filter value" after a few damaged bytes. GIFs and
  WebPs are decoded by Pillow too, first frame only (torchvision decodes every GIF frame and
  refuses animated WebP);
- JPEGs go to ``torchvision.io.decode_image``, which raises on damaged data.

Errors are :class:`CorruptImageError`, naming the file (or the set and index of a ``.bin``
image) and the reason.

Transforms use ``torchvision.transforms.v2`` and take the uint8 tensor to a float tensor
(3, S, S).
"""

from __future__ import annotations

import io
import os
import stat
import struct
import warnings
import zlib

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from facenet.data.image_headers import ImageHeader, check_png_chunks, check_size, read_header
from facenet.errors import DataError
from facenet.sizes import ImageSize, image_hw

__all__ = [
    "IMAGE_EXTENSIONS",
    "DEFAULT_MAX_PIXELS",
    "DEFAULT_MAX_ASPECT_RATIO",
    "CorruptImageError",
    "read_image",
    "decode_image_bytes",
    "looks_like_image",
    "inspect_image",
    "EVAL_PREPROCESS",
    "build_transform",
    "crop_or_pad",
    "cover_size",
    "resize_target",
    "ResizeToCover",
]

# The formats decode_image reads (lower case; compared case-insensitively).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif")

# FaceNet's fixed standardisation (x - 127.5) / 128, written as a mean/std on the 0..255 scale.
FIXED_MEAN = (127.5, 127.5, 127.5)
FIXED_STD = (128.0, 128.0, 128.0)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Crop margin of the training transform: resize to 1.125 x S, then a random S x S crop
# (FaceNet crops 160 from 182; 1.125 keeps the same ratio for any size).
TRAIN_RESIZE_RATIO = 1.125

# How many bytes at the end of a file are searched for the format's end marker. Some cameras
# append data after a JPEG's end-of-image marker, so the marker need not be the last two bytes.
_TAIL_BYTES = 1024

# Limits on the declared size (data.max_image_pixels, data.max_aspect_ratio): 64 MP is a
# 8000 x 8000 photograph; face crops are close to square.
DEFAULT_MAX_PIXELS = 64_000_000
DEFAULT_MAX_ASPECT_RATIO = 20.0
# No image within the pixel limit needs more than 8 bytes per pixel (16-bit RGBA, stored)
# plus metadata: larger files are refused before they are read.
_BYTES_PER_PIXEL = 8
_METADATA_BYTES = 16 * 2**20
# What Pillow raises on damaged data.
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)


class CorruptImageError(DataError):
    """An image that cannot be decoded; the message and ``path`` name it.

    Args:
        path: the file, or where an image in memory comes from ("lfw.bin image 12 (pair 6)").
        reason: what went wrong, in a few words.
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"corrupt or unreadable image {self.path}: {reason}")


def _open_regular(path: str | os.PathLike, max_bytes: int):
    """Open ``path`` for reading if it is a regular file of at most ``max_bytes``.

    ``O_NONBLOCK`` keeps the open of a FIFO from waiting for a writer; the type is then checked
    on the open descriptor, so a file swapped for a FIFO in between is refused too.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise CorruptImageError(path, err.strerror or str(err)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise CorruptImageError(path, "not a regular file (a FIFO, device or folder)")
    if info.st_size > max_bytes:
        os.close(fd)
        raise CorruptImageError(path, f"{info.st_size} bytes is larger than any image allowed")
    return os.fdopen(fd, "rb")


def _read_file(path: str | os.PathLike, max_bytes: int) -> bytes:
    """The bytes of a regular file of at most ``max_bytes``."""
    try:
        with _open_regular(path, max_bytes) as fh:
            return fh.read(max_bytes + 1)
    except OSError as err:
        raise CorruptImageError(path, err.strerror or str(err)) from None


def _max_bytes(max_pixels: int) -> int:
    """The largest encoded image accepted for ``max_pixels``."""
    return _BYTES_PER_PIXEL * max_pixels + _METADATA_BYTES


def _check_bytes(raw: bytes, source: str, max_pixels: int, max_aspect_ratio: float):
    """The header of an encoded image, after the length, header, size and PNG checksum checks."""
    if not raw:
        raise CorruptImageError(source, "empty file")
    if len(raw) > _max_bytes(max_pixels):
        raise CorruptImageError(source, f"{len(raw)} bytes is larger than any image allowed")
    try:
        header = read_header(io.BytesIO(raw))
        check_size(header, max_pixels, max_aspect_ratio)
        if header.format == "png":
            check_png_chunks(raw)
    except ValueError as err:
        raise CorruptImageError(source, str(err)) from None
    return header


def _sixteen_to_eight(array: np.ndarray) -> np.ndarray:
    """16-bit samples (Pillow's "I;16*" and "I" modes of a 16-bit PNG) scaled to 8 bits.

    The high byte, as torchvision's ``to_dtype(uint8, scale=True)`` does: 65535 -> 255, where a
    plain cast would clip every value above 255 to white.
    """
    return (np.clip(array.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)


def _decode_with_pillow(
    raw: bytes, header: ImageHeader, max_pixels: int, max_aspect_ratio: float
) -> torch.Tensor:
    """Decode a PNG, GIF or WebP with Pillow: uint8 RGB (3, H, W), the first frame only.

    Pillow opens an animated file (GIF, APNG, animated WebP) at its first frame and decodes
    that frame alone (torchvision decodes every GIF frame and refuses animated WebP). The
    opened size is checked again before decoding: a GIF frame may be larger than the screen
    size its header declares. 16-bit RGB(A) is read by Pillow as its high bytes; 16-bit
    grayscale stays 16-bit in Pillow and is scaled here.
    """
    with warnings.catch_warnings():
        # Pillow warns above its own limit; ours are checked on the size it opened instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(raw))
    with image:
        check_size(ImageHeader(header.format, *image.size), max_pixels, max_aspect_ratio)
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode.startswith("I"):  # 16-bit grayscale
            gray = _sixteen_to_eight(np.asarray(image))
            array = np.repeat(gray[:, :, None], 3, axis=2)
        else:
            array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _decode_jpeg(raw: bytes, source: str) -> torch.Tensor:
    """Decode a JPEG with torchvision (libjpeg-turbo, EXIF orientation applied)."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (n_bytes,)
    try:
        image = decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as err:
        raise CorruptImageError(source, _short_reason(err)) from None
    if image.dtype != torch.uint8:  # 12-bit JPEG
        image = TF.to_dtype(image, torch.uint8, scale=True)
    return image


def decode_image_bytes(
    raw: bytes,
    source: str,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> torch.Tensor:
    """Decode an encoded image held in memory into a uint8 RGB tensor (3, H, W).

    The checked decoder :func:`read_image` uses once it has read a file, for images that are
    not files of their own (an insightface ``.bin`` set). The checks of the module docstring
    all apply; nothing is decoded before they pass.

    Args:
        raw: a JPEG, PNG, WebP or GIF file's bytes.
        source: how errors name the image ("lfw.bin image 12 (pair 6)", a path).
        max_pixels: the largest declared width x height accepted.
        max_aspect_ratio: the largest declared long side / short side accepted.

    Raises:
        CorruptImageError: the bytes are over a limit, damaged or cannot be decoded; the message
            names ``source`` and the reason.
    """
    header = _check_bytes(bytes(raw), str(source), max_pixels, max_aspect_ratio)
    if header.format == "jpeg":
        return _decode_jpeg(raw, str(source))
    try:
        return _decode_with_pillow(raw, header, max_pixels, max_aspect_ratio)
    except _PIL_ERRORS + (Image.DecompressionBombError,) as err:
        raise CorruptImageError(source, str(err) or type(err).__name__) from None


def read_image(
    path: str | os.PathLike,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> torch.Tensor:
    """Decode an image file into a uint8 RGB tensor (3, H, W).

    Grayscale and RGBA images are converted to RGB; EXIF orientation is applied; 16-bit PNGs
    are scaled to 8 bits; an animated image gives its first frame. Nothing is decoded before
    the checks in the module docstring pass.

    Args:
        path: a JPEG, PNG, WebP or GIF file.
        max_pixels: the largest declared width x height accepted.
        max_aspect_ratio: the largest declared long side / short side accepted.

    Raises:
        CorruptImageError: the file is missing, not a regular file, over a limit, damaged or
            cannot be decoded; the message names the file and the reason.
    """
    raw = _read_file(path, _max_bytes(max_pixels))
    return decode_image_bytes(raw, str(path), max_pixels, max_aspect_ratio)


def inspect_image(
    path: str | os.PathLike,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> str | None:
    """Why ``path`` cannot be used as an image, without decoding it; None when it can.

    The checks of :func:`read_image` short of decoding: a regular file, a complete file
    (:func:`looks_like_image`), a header within the limits and, for a PNG, every chunk's CRC
    (which reads the whole PNG; other formats cost about 1 KiB and the header).

    Args:
        path: the file.
        max_pixels: see :func:`read_image`.
        max_aspect_ratio: see :func:`read_image`.
    """
    if not looks_like_image(path):
        return "not a complete JPEG, PNG, WebP or GIF file"
    max_bytes = _max_bytes(max_pixels)
    try:
        with _open_regular(path, max_bytes) as fh:
            header = read_header(fh)
            check_size(header, max_pixels, max_aspect_ratio)
            if header.format == "png":
                fh.seek(0)
                check_png_chunks(fh.read(max_bytes + 1))
    except CorruptImageError as err:
        return err.reason
    except ValueError as err:
        return str(err)
    except OSError as err:
        return err.strerror or str(err)
    return None


def _short_reason(err: Exception) -> str:
    """The last line of a torchvision decoder message, without the C++ source location."""
    text = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return text.rsplit(", ", 1)[-1]


def looks_like_image(path: str | os.PathLike) -> bool:
    """A cheap check of a file's header and end marker, without decoding it.

    Catches empty files, files that are not images and truncated JPEG, PNG, GIF and WebP files
    (the usual corruption of an interrupted download or copy). Reads at most about 1 KiB.

    Args:
        path: the file.
    """
    try:
        with _open_regular(path, max_bytes=2**63) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(16)
            fh.seek(max(0, size - _TAIL_BYTES))
            tail = fh.read(_TAIL_BYTES)
    except (OSError, CorruptImageError):  # missing, unreadable, a FIFO or a device
        return False
    if head.startswith(b"\xff\xd8\xff"):  # JPEG: SOI marker ... EOI marker
        return b"\xff\xd9" in tail
    if head.startswith(b"\x89PNG\r\n\x1a\n"):  # PNG: signature ... IEND chunk
        return b"IEND" in tail[-64:]
    if head[:6] in (b"GIF87a", b"GIF89a"):  # GIF: header ... trailer byte 0x3B
        return tail.rstrip(b"\x00").endswith(b"\x3b")
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":  # WebP: RIFF size = file size - 8
        return int.from_bytes(head[4:8], "little") + 8 <= size
    return False


def _normalize_steps(normalize: str) -> list:
    """The dtype conversion and standardisation for ``normalize`` ("fixed" or "imagenet")."""
    if normalize == "fixed":
        # (x - 127.5) / 128 on the unscaled 0..255 values
        return [v2.ToDtype(torch.float32, scale=False), v2.Normalize(FIXED_MEAN, FIXED_STD)]
    if normalize == "imagenet":
        return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    raise ValueError(f"normalize={normalize!r}: expected 'fixed' or 'imagenet'")


# Evaluation preprocessing: "resize" (1.125 S, centre S) or "crop" (no resize: crop_or_pad).
EVAL_PREPROCESS = ("resize", "crop")


def crop_or_pad(image: torch.Tensor, size: ImageSize) -> torch.Tensor:
    """Centre-crop (3, H, W) to (3, S_h, S_w) without resizing; zero-pad where H or W is short.

    TensorFlow's ``resize_image_with_crop_or_pad``, which davidsandberg/facenet's evaluation
    applies (182 -> 160 drops 11 px on each side): offsets are ``(H - S) // 2`` rounded down,
    unlike ``v2.CenterCrop``, which rounds (163 -> 160 keeps rows 1..160 here, 2..161 there).

    Args:
        image: (C, H, W) tensor.
        size: S (square) or (S_h, S_w), the output's height and width.
    """
    out_h, out_w = image_hw(size)
    _, height, width = image.shape
    top, left = max(height - out_h, 0) // 2, max(width - out_w, 0) // 2
    image = image[:, top : top + out_h, left : left + out_w]  # (C, min(H, S_h), min(W, S_w))
    pad_h, pad_w = out_h - image.shape[1], out_w - image.shape[2]
    if pad_h or pad_w:  # (left, right, top, bottom), the smaller half first as TensorFlow does
        pad = (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
        image = torch.nn.functional.pad(image, pad)
    return image


class _CropOrPad(torch.nn.Module):
    """:func:`crop_or_pad` as a transform step (a class, so DataLoader workers can pickle it)."""

    def __init__(self, size: tuple[int, int]):
        super().__init__()
        self.size = size

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return crop_or_pad(image, self.size)


def cover_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(H', W'): ``height`` x ``width`` scaled, aspect kept, to just cover ``target``.

    For a square target (R, R) this is ``v2.Resize(R)``'s size (the shorter side to R, the
    longer rounded down), so square sizes resize exactly as before; for (R_h, R_w) the side
    that needs the larger scale becomes its target and the other is rounded down, never below
    its own target.

    Args:
        height, width: the image's size.
        target: (R_h, R_w), the least size wanted.
    """
    out_h, out_w = target
    if out_h == out_w:  # torchvision's own rounding: the longer side's float product, truncated
        if width <= height:
            return int(out_w * height / width), out_w
        return out_h, int(out_h * width / height)
    if out_h * width >= out_w * height:  # the height needs the larger scale
        return out_h, out_h * width // height  # integer: >= out_w exactly, no float slack
    return out_w * height // width, out_w


def resize_target(size: ImageSize) -> tuple[int, int]:
    """(R_h, R_w) = 1.125 x (S_h, S_w), rounded: what the image is resized to cover before the
    crop (the torchvision 256 -> 224 convention, per side).

    Args:
        size: S or (S_h, S_w), the crop.
    """
    height, width = image_hw(size)
    return round(height * TRAIN_RESIZE_RATIO), round(width * TRAIN_RESIZE_RATIO)


class ResizeToCover(torch.nn.Module):
    """Resize (C, H, W) with its aspect kept until it covers ``target`` (:func:`cover_size`).

    Args:
        target: (R_h, R_w).
    """

    def __init__(self, target: tuple[int, int]):
        super().__init__()
        self.target = target

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        size = cover_size(image.shape[-2], image.shape[-1], self.target)
        if tuple(image.shape[-2:]) == size:
            return image
        return TF.resize(image, list(size), antialias=True)


def build_transform(
    image_size: ImageSize,
    train: bool,
    normalize: str = "fixed",
    hflip: bool = True,
    random_crop: bool = True,
    preprocess: str = "resize",
) -> v2.Compose:
    """The transform from a uint8 RGB tensor (3, H, W) to a float tensor (3, S_h, S_w).

    The image is resized, its aspect kept, to cover 1.125 x (S_h, S_w) (for a square size: the
    shorter side to 1.125 S), then an S_h x S_w crop is taken: at a random place in training
    (with ``random_crop``), in the centre otherwise. Faces thus have the same scale in training
    and evaluation (torchvision's 256 -> 224 convention); training then flips horizontally at
    random.

    Args:
        image_size: S (square) or (S_h, S_w), the output's size (see
            :func:`facenet.sizes.image_hw`).
        train: build the training transform (random crop and flip) or the evaluation one.
        normalize: "fixed" for FaceNet's (x - 127.5) / 128, "imagenet" for ImageNet mean/std.
        hflip: flip horizontally with probability 0.5 (training only).
        random_crop: crop at a random place from a slightly larger resize (training only).
        preprocess: evaluation only: "resize" as above, or "crop": no resize, the centre
            S_h x S_w (:func:`crop_or_pad`), for crops aligned at that size (or at 182 for
            S = 160) as the publishers' models expect.
    """
    size = image_hw(image_size)  # (S_h, S_w)
    if preprocess not in EVAL_PREPROCESS:
        raise ValueError(f"preprocess={preprocess!r}: expected one of {EVAL_PREPROCESS}")
    if not train and preprocess == "crop":
        return v2.Compose([_CropOrPad(size), *_normalize_steps(normalize)])
    crop = v2.RandomCrop(size) if train and random_crop else v2.CenterCrop(size)
    if size[0] == size[1]:  # v2.Resize(int): the square sizes' transform, unchanged
        resize = v2.Resize(resize_target(size)[0], antialias=True)
    else:
        resize = ResizeToCover(resize_target(size))
    steps: list = [resize, crop]
    if train and hflip:
        steps.append(v2.RandomHorizontalFlip(p=0.5))
    steps += _normalize_steps(normalize)
    return v2.Compose(steps)
