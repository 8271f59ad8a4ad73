"""Image sizes: a side S (an S x S input) or ``[H, W]`` (MobileFaceNet's 112 x 96 crops).
Everything that reads a size turns it into ``(H, W)`` with :func:`image_hw`.
"""

from __future__ import annotations

from collections.abc import Sequence

ImageSize = int | Sequence[int]


def image_hw(size: ImageSize) -> tuple[int, int]:
    """``(H, W)`` of S (an S x S image) or ``(H, W)``; a ValueError for anything else."""
    sides = (size, size) if isinstance(size, int) else size
    # bool is an int subclass: True must not stand for a 1-pixel side.
    if (
        isinstance(size, (str, bytes))
        or not isinstance(sides, Sequence)
        or len(sides) != 2
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sides)
    ):
        raise ValueError(f"image_size={size!r}: expected a positive integer or [height, width]")
    return tuple(sides)


def plain_size(size: ImageSize) -> int | list[int]:
    """S when square, else ``[H, W]``: as a configuration or a file stores a size."""
    height, width = image_hw(size)
    return height if height == width else [height, width]
