"""Reading face images from disk and the train/eval transforms.

Images are decoded with ``torchvision.io.decode_image`` into uint8 RGB tensors (3, H, W):
grayscale is replicated to three channels and the alpha channel of RGBA is dropped. Transforms
use ``torchvision.transforms.v2`` and take that uint8 tensor to a float tensor (3, S, S).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from facenet.errors import DataError

__all__ = [
    "IMAGE_EXTENSIONS",
    "CorruptImageError",
    "read_image",
    "looks_like_image",
    "build_transform",
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


class CorruptImageError(DataError):
    """An image file that cannot be decoded; the message and ``path`` name the file.

    Args:
        path: the file.
        reason: what went wrong, in a few words.
    """

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"corrupt or unreadable image {self.path}: {reason}")


def read_image(path: str | os.PathLike) -> torch.Tensor:
    """Decode an image file into a uint8 RGB tensor (3, H, W).

    Grayscale and RGBA images are converted to RGB; EXIF orientation is applied; 16-bit PNGs
    are scaled to 8 bits.

    Args:
        path: a JPEG, PNG, WebP or GIF file (the first frame of a GIF).

    Raises:
        CorruptImageError: the file is missing, unreadable or cannot be decoded.
    """
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise CorruptImageError(path, err.strerror or str(err)) from None
    if not raw:
        raise CorruptImageError(path, "empty file")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (n_bytes,)
    try:
        image = decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError as err:
        raise CorruptImageError(path, _short_reason(err)) from None
    if image.ndim == 4:  # an animated GIF: (frames, 3, H, W); keep the first frame
        image = image[0]
    if image.dtype != torch.uint8:
        image = TF.to_dtype(image, torch.uint8, scale=True)
    return image


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
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(16)
            fh.seek(max(0, size - _TAIL_BYTES))
            tail = fh.read(_TAIL_BYTES)
    except OSError:
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


def build_transform(
    image_size: int,
    train: bool,
    normalize: str = "fixed",
    hflip: bool = True,
    random_crop: bool = True,
) -> v2.Compose:
    """The transform from a uint8 RGB tensor (3, H, W) to a float tensor (3, S, S).

    The shorter side is resized to 1.125 x S, then an S x S crop is taken: at a random place in
    training (with ``random_crop``), in the centre otherwise. Faces thus have the same scale in
    training and evaluation (torchvision's 256 -> 224 convention); training then flips
    horizontally at random.

    Args:
        image_size: S, the side of the output.
        train: build the training transform (random crop and flip) or the evaluation one.
        normalize: "fixed" for FaceNet's (x - 127.5) / 128, "imagenet" for ImageNet mean/std.
        hflip: flip horizontally with probability 0.5 (training only).
        random_crop: crop at a random place from a slightly larger resize (training only).
    """
    if not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size={image_size!r}: expected a positive integer")
    crop = v2.RandomCrop(image_size) if train and random_crop else v2.CenterCrop(image_size)
    steps: list = [v2.Resize(round(image_size * TRAIN_RESIZE_RATIO), antialias=True), crop]
    if train and hflip:
        steps.append(v2.RandomHorizontalFlip(p=0.5))
    steps += _normalize_steps(normalize)
    return v2.Compose(steps)
