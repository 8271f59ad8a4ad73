"""The checked image decoder and the train/eval transforms.

Every image the project decodes (folders, pairs, ``.bin`` sets, alignment, embedding) goes
through :func:`read_image` or :func:`decode_image_bytes`: uint8 RGB (3, H, W), the first frame
of an animation, 16-bit scaled to 8. Nothing is decoded before the declared size passed the
limits (:mod:`facenet.data.image_headers`); only regular files are opened. JPEGs go to
torchvision; PNG, GIF, WebP and BMP to Pillow, because torchvision's PNG decoder ends in a
segmentation fault on damaged image data. Failures are :class:`CorruptImageError`, one line
naming the image and the reason.
"""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import torch
from PIL import Image, ImageOps
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from facenet.data.image_headers import (
    ImageHeader,
    check_png_chunks,
    check_size,
    image_format,
    read_header,
)
from facenet.errors import DataError
from facenet.files import open_regular
from facenet.sizes import ImageSize, image_hw

# Lower case, compared case-insensitively; callers rank a name's candidates by this order.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif")

# normalize -> (scale to 0..1 first, mean, std); "fixed" is FaceNet's (x - 127.5) / 128.
NORMALIZATIONS = {
    "fixed": (False, (127.5, 127.5, 127.5), (128.0, 128.0, 128.0)),
    "imagenet": (True, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
# Resize to 1.125 S, then crop S (FaceNet's 182 -> 160; torchvision's 256 -> 224).
TRAIN_RESIZE_RATIO = 1.125
# Evaluation preprocessing: "resize" (1.125 S, centre S) or "crop" (no resize: crop_or_pad).
EVAL_PREPROCESS = ("resize", "crop")

# Some cameras append data after a JPEG's end marker: the marker is searched in this tail.
_TAIL_BYTES = 1024
# 64 MP is an 8000 x 8000 photograph; face crops are close to square.
DEFAULT_MAX_PIXELS = 64_000_000
DEFAULT_MAX_ASPECT_RATIO = 20.0
# No image within the pixel limit needs more than 8 bytes a pixel (16-bit RGBA) plus metadata.
_BYTES_PER_PIXEL = 8
_METADATA_BYTES = 16 * 2**20
# Header checks wait on the disk more than on the interpreter.
_INSPECT_THREADS = 8
_PIL_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)


class CorruptImageError(DataError):
    """An image that cannot be decoded; ``path`` is the file or where the bytes came from."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"corrupt or unreadable image {self.path}: {reason}")


def _open_regular(path, max_bytes):
    return open_regular(path, max_bytes, lambda reason: CorruptImageError(path, reason))


def _max_bytes(max_pixels):
    return _BYTES_PER_PIXEL * max_pixels + _METADATA_BYTES


def _read_at_most(fh, max_bytes):
    """The rest of ``fh``, up to ``max_bytes`` + 1 bytes (the extra byte shows a file that grew
    past the limit). A read of n bytes allocates n up front, so n follows the file's size."""
    start = fh.tell()
    size = fh.seek(0, os.SEEK_END) - start
    fh.seek(start)
    return fh.read(min(size, max_bytes) + 1)


def _checked_header(fh, max_pixels, max_aspect_ratio):
    """The header of the image ``fh`` holds, within the limits; a PNG's CRCs verified too."""
    header = read_header(fh)
    check_size(header, max_pixels, max_aspect_ratio)
    if header.format == "png":
        fh.seek(0)
        check_png_chunks(_read_at_most(fh, _max_bytes(max_pixels)))
    return header


def _decode_with_pillow(raw, max_pixels, max_aspect_ratio):
    """uint8 RGB (3, H, W) of the first frame (torchvision decodes every GIF frame).

    The opened size is checked again: a GIF frame may be larger than its declared screen.
    """
    with warnings.catch_warnings():
        # Pillow warns above its own limit; ours are checked on the size it opened instead.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(raw))
    with image:
        check_size(ImageHeader(image.format, *image.size), max_pixels, max_aspect_ratio)
        image.load()
        image = ImageOps.exif_transpose(image)
        if image.mode.startswith("I"):  # 16-bit grayscale: its high byte, as to_dtype scales
            gray = np.clip(np.asarray(image).astype(np.int64), 0, 65535) >> 8  # (H, W)
            array = np.repeat(gray.astype(np.uint8)[:, :, None], 3, axis=2)
        else:
            array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def decode_image_bytes(
    raw: bytes,
    source: str,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> torch.Tensor:
    """An encoded image held in memory as uint8 RGB (3, H, W); errors name ``source``.

    ``max_pixels`` bounds the declared width x height, ``max_aspect_ratio`` its long side /
    short side.
    """
    if not raw:
        raise CorruptImageError(source, "empty file")
    if len(raw) > _max_bytes(max_pixels):
        raise CorruptImageError(source, f"{len(raw)} bytes is larger than any image allowed")
    try:
        header = _checked_header(io.BytesIO(raw), max_pixels, max_aspect_ratio)
    except ValueError as err:
        raise CorruptImageError(source, str(err)) from None
    if header.format == "jpeg":
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # (n_bytes,)
        try:
            image = decode_image(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
        except RuntimeError as err:  # the message's last line, without the C++ source location
            reason = str(err).strip().split("\n")[-1].rsplit(", ", 1)[-1] or type(err).__name__
            raise CorruptImageError(source, reason) from None
        return TF.to_dtype(image, torch.uint8, scale=True)  # 12-bit JPEGs decode to uint16
    try:
        return _decode_with_pillow(raw, max_pixels, max_aspect_ratio)
    except _PIL_ERRORS + (Image.DecompressionBombError,) as err:
        raise CorruptImageError(source, str(err) or type(err).__name__) from None


def read_image(
    path: str | os.PathLike,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> torch.Tensor:
    """An image file as uint8 RGB (3, H, W), EXIF orientation applied (limits as in
    :func:`decode_image_bytes`)."""
    max_bytes = _max_bytes(max_pixels)
    try:
        with _open_regular(path, max_bytes) as fh:
            raw = _read_at_most(fh, max_bytes)
    except OSError as err:
        raise CorruptImageError(path, err.strerror or str(err)) from None
    return decode_image_bytes(raw, str(path), max_pixels, max_aspect_ratio)


def inspect_image(
    path: str | os.PathLike,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> str | None:
    """Why :func:`read_image` would refuse ``path`` short of decoding it; None when it would not.

    Reads the header and the last KiB (a PNG whole, for its CRCs).
    """
    try:
        with _open_regular(path, _max_bytes(max_pixels)) as fh:
            if not _complete(fh):
                return "not a complete JPEG, PNG, WebP, GIF or BMP file"
            fh.seek(0)
            _checked_header(fh, max_pixels, max_aspect_ratio)
    except ValueError as err:  # a CorruptImageError has its reason
        return getattr(err, "reason", str(err))
    except OSError as err:
        return err.strerror or str(err)
    return None


def looks_like_image(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts as an image file and is not cut short (an interrupted copy),
    from its first bytes and its last KiB."""
    try:
        with _open_regular(path, max_bytes=2**63) as fh:
            return _complete(fh)
    except (OSError, CorruptImageError):  # missing, unreadable, a FIFO or a device
        return False


def _complete(fh):
    """Whether the file starts with an image header and ends with its format's end marker."""
    size = os.fstat(fh.fileno()).st_size
    head = fh.read(16)
    fh.seek(max(0, size - _TAIL_BYTES))
    tail = fh.read(_TAIL_BYTES)
    kind = image_format(head)
    if kind == "jpeg":  # SOI marker ... EOI marker
        return head[2:3] == b"\xff" and b"\xff\xd9" in tail
    if kind == "png":  # signature ... IEND chunk
        return b"IEND" in tail[-64:]
    if kind == "gif":  # header ... trailer byte 0x3B
        return tail.rstrip(b"\x00").endswith(b"\x3b")
    if kind == "webp":  # RIFF size = file size - 8
        return int.from_bytes(head[4:8], "little") + 8 <= size
    return kind == "bmp" and int.from_bytes(head[2:6], "little") <= size  # the file's size


def normalize_steps(normalize: str) -> list:
    """uint8 (..., 3, H, W) -> float32 standardised as ``normalize`` ("fixed" or "imagenet")."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r}: expected 'fixed' or 'imagenet'")
    scale, mean, std = NORMALIZATIONS[normalize]
    return [v2.ToDtype(torch.float32, scale=scale), v2.Normalize(mean, std)]


def crop_or_pad(image: torch.Tensor, size: ImageSize) -> torch.Tensor:
    """The centre (C, S_h, S_w) of (C, H, W) without resizing, zero-padded where H or W is short.

    TensorFlow's ``resize_image_with_crop_or_pad`` (davidsandberg/facenet's evaluation): the
    offset ``(H - S) // 2`` rounds down where ``v2.CenterCrop`` rounds to nearest.
    """
    out_h, out_w = image_hw(size)
    d_h, d_w = out_h - image.shape[1], out_w - image.shape[2]  # > 0: padded, < 0: cropped
    # A negative pad crops; int() rounds towards 0: the smaller half first, as TensorFlow does.
    top, left = int(d_h / 2), int(d_w / 2)
    return torch.nn.functional.pad(image, (left, d_w - left, top, d_h - top))


def cover_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(H', W'): ``height`` x ``width`` scaled, aspect kept, to just cover ``target`` (R_h, R_w):
    the side needing the larger scale becomes its target, the other is rounded down (for a
    square target ``v2.Resize(R)``'s size, its float product truncated: equal below 2**26).
    """
    out_h, out_w = target
    if out_h * width >= out_w * height:  # the height needs the larger scale
        return out_h, out_h * width // height  # integer: >= out_w exactly, no float slack
    return out_w * height // width, out_w


def resize_target(size: ImageSize) -> tuple[int, int]:
    """(R_h, R_w) = 1.125 x (S_h, S_w), rounded: what an image is resized to cover."""
    height, width = image_hw(size)
    return round(height * TRAIN_RESIZE_RATIO), round(width * TRAIN_RESIZE_RATIO)


def resize_to_cover(images: torch.Tensor, target: tuple[int, int]) -> torch.Tensor:
    """(..., H, W) resized, aspect kept, to :func:`cover_size`; as it is when already that size."""
    size = cover_size(images.shape[-2], images.shape[-1], target)
    if tuple(images.shape[-2:]) == size:
        return images
    return TF.resize(images, list(size), antialias=True)


def build_transform(
    image_size: ImageSize,
    train: bool,
    normalize: str = "fixed",
    hflip: bool = True,
    random_crop: bool = True,
    preprocess: str = "resize",
) -> v2.Compose:
    """uint8 RGB (3, H, W) -> float (3, S_h, S_w): resized to cover 1.125 x (S_h, S_w), then
    cropped at random (training, ``random_crop``) or in the centre, and flipped at random
    (training, ``hflip``); faces have the same scale in training and evaluation.

    ``preprocess="crop"`` (evaluation only) skips the resize and takes the centre
    (:func:`crop_or_pad`), for crops aligned at that size as the publishers' models expect.
    """
    if preprocess not in EVAL_PREPROCESS:
        raise ValueError(f"preprocess={preprocess!r}: expected one of {EVAL_PREPROCESS}")
    size = image_hw(image_size)  # (S_h, S_w)
    if not train and preprocess == "crop":
        steps = [partial(crop_or_pad, size=size)]
    else:
        crop = v2.RandomCrop(size) if train and random_crop else v2.CenterCrop(size)
        steps = [partial(resize_to_cover, target=resize_target(size)), crop]
        if train and hflip:
            steps.append(v2.RandomHorizontalFlip(p=0.5))
    return v2.Compose(steps + normalize_steps(normalize))


def inspect_images(
    paths: Iterable[str | os.PathLike],
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
) -> Iterator[str | None]:
    """:func:`inspect_image` of each path, in order, checked in threads as they come.

    Where no thread can start (a tight ``ulimit -v`` or ``-u``) the calling thread checks
    them instead: the same reasons, only slower.
    """
    inspect = partial(inspect_image, max_pixels=max_pixels, max_aspect_ratio=max_aspect_ratio)
    pool = ThreadPoolExecutor(max_workers=_INSPECT_THREADS)
    try:
        return pool.map(inspect, paths)  # every check is queued, and threads started, here
    except RuntimeError:  # "can't start new thread"
        return map(inspect, paths)
    finally:
        pool.shutdown(wait=False)  # the started threads finish the queue, then end
