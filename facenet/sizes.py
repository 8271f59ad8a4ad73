"""Image sizes: a side S (an S x S input) or ``[H, W]`` (MobileFaceNet's 112 x 96 crops).
Everything that reads a size turns it into ``(H, W)`` with :func:`image_hw`.
"""

from __future__ import annotations

from collections.abc import Sequence

ImageSize = int | Sequence[int]


def _side(value, size) -> int:
    # bool is an int subclass: True must not stand for a 1-pixel side.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"image_size={size!r}: expected a positive integer or [height, width]")
    return value


def image_hw(size: ImageSize) -> tuple[int, int]:
    """``(H, W)`` of S (an S x S image) or ``(H, W)``; a ValueError for anything else."""
    if isinstance(size, int) and not isinstance(size, bool):
        side = _side(size, size)
        return side, side
    if isinstance(size, (str, bytes)) or not isinstance(size, Sequence) or len(size) != 2:
        raise ValueError(f"image_size={size!r}: expected a positive integer or [height, width]")
    return _side(size[0], size), _side(size[1], size)


def size_text(size: ImageSize) -> str:
    """``"64"`` for a square size, ``"112 x 96"`` (H x W) otherwise."""
    height, width = image_hw(size)
    return str(height) if height == width else f"{height} x {width}"


def plain_size(size: ImageSize) -> int | list[int]:
    """S when square, else ``[H, W]``: as a configuration or a file stores a size."""
    height, width = image_hw(size)
    return height if height == width else [height, width]
