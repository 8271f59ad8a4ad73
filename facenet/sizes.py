"""Image sizes: one int (square) or ``[H, W]``, normalised in one place.

``data.image_size`` is a side S (an S x S input, as the square backbones are trained) or a
pair ``[H, W]`` (MobileFaceNet's 112 x 96 SphereFace crops). Everything that reads a size
turns it into ``(H, W)`` with :func:`image_hw` rather than handling the two spellings itself.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ImageSize", "image_hw", "size_text", "plain_size"]

# What a configuration or a file may hold: a side, or (height, width).
ImageSize = int | Sequence[int]


def _side(value, size) -> int:
    # bool is an int subclass: True must not stand for a 1-pixel side.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"image_size={size!r}: expected a positive integer or [height, width]")
    return value


def image_hw(size: ImageSize) -> tuple[int, int]:
    """``(H, W)`` of an image size.

    Args:
        size: S (an S x S image) or a pair ``(H, W)`` / ``[H, W]`` of positive ints.

    Raises:
        ValueError: anything else (a bool, a float, a non-positive side, not two sides).
    """
    if isinstance(size, int) and not isinstance(size, bool):
        side = _side(size, size)
        return side, side
    if isinstance(size, (str, bytes)) or not isinstance(size, Sequence) or len(size) != 2:
        raise ValueError(f"image_size={size!r}: expected a positive integer or [height, width]")
    return _side(size[0], size), _side(size[1], size)


def size_text(size: ImageSize) -> str:
    """``"64"`` for a square size, ``"112 x 96"`` (H x W) otherwise: how messages name it.

    Args:
        size: an image size (see :func:`image_hw`).
    """
    height, width = image_hw(size)
    return str(height) if height == width else f"{height} x {width}"


def plain_size(size: ImageSize) -> int | list[int]:
    """The size as a configuration or a file stores it: S when square, else ``[H, W]``.

    Args:
        size: an image size (see :func:`image_hw`).
    """
    height, width = image_hw(size)
    return height if height == width else [height, width]
