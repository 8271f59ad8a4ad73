"""The training augmentation done per batch: random crop and flip as one index on the batch
tensor, standardisation once per batch on the device, and a bounded cache of decoded images.

The per-sample transform of :func:`~facenet.data.images.build_transform` (resize the shorter
side to 1.125 S, a random S x S crop, a random horizontal flip, standardisation) called five
torchvision transforms on every image; on small images that Python dispatch, not decoding, was
most of the loader's time. Here a sample only draws its random numbers
(:class:`TrainCrops`, under the sample's seed from :class:`~facenet.data.loading.SeededSamples`,
in the order the torchvision transforms draw them: crop top, crop left, flip), and the batch
does the work: images of one size are resized in one call (or once per image, when
``IdentityFolder`` caches them prepared: :meth:`TrainCrops.prepare`), then cropped and
flipped by one ``gather`` (:func:`crop_and_flip`), and stay uint8 until :func:`standardize`
runs on the device. The result equals the per-sample transform under the same seeds, bit for bit
(tests/data/test_batches.py).
"""

from __future__ import annotations

import torch
from torch.utils.data import default_collate, get_worker_info
from torchvision.transforms.v2 import functional as TF

from facenet.data.images import (
    FIXED_MEAN,
    FIXED_STD,
    IMAGENET_MEAN,
    IMAGENET_STD,
    cover_size,
    resize_target,
)
from facenet.sizes import ImageSize, image_hw

__all__ = [
    "PendingCrop",
    "TrainCrops",
    "DecodedCache",
    "resized_size",
    "crop_and_flip",
    "collate_crops",
    "collate_batches",
    "standardize",
]


class PendingCrop:
    """A decoded image and the crop and flip drawn for it, applied when its batch is formed.

    Args:
        image: uint8 (3, H, W) as decoded (not resized).
        top, left: the crop's corner in the resized image.
        flip: flip the crop horizontally.
        size: (S_h, S_w), the crop's size.
        resize_to: (R_h, R_w) = 1.125 x (S_h, S_w), what the image is resized to cover.
    """

    __slots__ = ("image", "top", "left", "flip", "size", "resize_to")

    def __init__(
        self,
        image,
        top: int,
        left: int,
        flip: bool,
        size: tuple[int, int],
        resize_to: tuple[int, int],
    ):
        self.image, self.top, self.left, self.flip = image, top, left, flip
        self.size, self.resize_to = size, resize_to


def resized_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """(H', W') after resizing the shorter side to ``short_side``, as ``v2.Resize(int)`` does.

    Args:
        height, width: the image's size.
        short_side: the shorter side after resizing.
    """
    return cover_size(height, width, (short_side, short_side))


class TrainCrops:
    """The per-sample half of the training transform: draws the crop and the flip only.

    Called on a uint8 (3, H, W) image it returns a :class:`PendingCrop`, drawing from torch's
    global generator what ``v2.RandomCrop`` and ``v2.RandomHorizontalFlip`` would draw after
    the resize of :func:`~facenet.data.images.build_transform`: a top offset (only when the
    resized height exceeds S_h), a left offset (same for the width), then one uniform number
    for the flip (flipped when below 0.5).

    Args:
        image_size: S (square) or (S_h, S_w), the output's size.
        random_crop: crop at a random place (else in the centre, as ``v2.CenterCrop``).
        hflip: flip with probability 0.5.
    """

    def __init__(self, image_size: ImageSize, random_crop: bool = True, hflip: bool = True):
        self.size = image_hw(image_size)  # (S_h, S_w)
        self.random_crop, self.hflip = random_crop, hflip
        self.resize_to = resize_target(self.size)  # (R_h, R_w)
        self._cover_sizes: dict[tuple[int, int], tuple[int, int]] = {}

    def _covered(self, height: int, width: int) -> tuple[int, int]:
        """(H', W') an image of ``height`` x ``width`` is resized to (memoised per size)."""
        size = self._cover_sizes.get((height, width))
        if size is None:
            size = self._cover_sizes[(height, width)] = cover_size(height, width, self.resize_to)
        return size

    def draw(self, height: int, width: int) -> tuple[int, int, bool]:
        """``(top, left, flip)`` for an image resized to ``height`` x ``width``, drawn from
        torch's global generator exactly as ``v2.RandomCrop`` then ``v2.RandomHorizontalFlip``
        draw them.

        ``RandomCrop`` draws ``torch.randint(0, extent - side + 1, size=(1,))`` per side whose
        extent exceeds the crop (top first) and ``RandomHorizontalFlip`` one ``torch.rand(1)``,
        flipping below 0.5. Drawing into fresh tensors with ``random_``/``uniform_`` takes the
        same numbers from the generator in the same order (two equal ranges in one call: the
        CPU kernel fills elements in order) at about a third of the cost (tests/data/
        test_batches.py compares them over thousands of seeds).

        Args:
            height, width: the resized image's size.
        """
        (side_h, side_w), top, left = self.size, 0, 0
        if not self.random_crop:  # v2.CenterCrop's rounding; nothing drawn
            top = int(round((height - side_h) / 2.0))
            left = int(round((width - side_w) / 2.0))
        else:
            span_h = height - side_h + 1 if height > side_h else 0  # 0: nothing drawn
            span_w = width - side_w + 1 if width > side_w else 0
            if span_h and span_h == span_w:
                top, left = torch.empty(2, dtype=torch.int64).random_(0, span_h).tolist()
            else:
                if span_h:
                    top = torch.empty((), dtype=torch.int64).random_(0, span_h).item()
                if span_w:
                    left = torch.empty((), dtype=torch.int64).random_(0, span_w).item()
        # torch.rand(1)'s dtype is the default dtype, as torch.empty's.
        flip = torch.empty(()).uniform_().item() < 0.5 if self.hflip else False
        return top, left, flip

    def prepare(self, image: torch.Tensor) -> torch.Tensor:
        """The deterministic part: resized to cover 1.125 x (S_h, S_w), as the transform does.

        ``IdentityFolder`` caches its result, so a cached image is resized once per run.

        Args:
            image: uint8 (3, H, W) as decoded.

        Returns:
            uint8 (3, H', W'): for a square size, min(H', W') = 1.125 S.
        """
        size = self._covered(image.shape[-2], image.shape[-1])
        if tuple(image.shape[-2:]) == size:  # already prepared (or already that size)
            return image
        return TF.resize(image, list(size), antialias=True)

    def __call__(self, image: torch.Tensor) -> PendingCrop:
        top, left, flip = self.draw(*self._covered(image.shape[-2], image.shape[-1]))
        return PendingCrop(image, top, left, flip, self.size, self.resize_to)


def crop_and_flip(
    images: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    flip: torch.Tensor,
    size: ImageSize,
) -> torch.Tensor:
    """Each image's S_h x S_w crop at (top, left), flipped where ``flip``: one ``gather``.

    Args:
        images: (B, C, H, W).
        top, left: (B,) int64 crop corners.
        flip: (B,) bool.
        size: S or (S_h, S_w).

    Returns:
        (B, C, S_h, S_w), contiguous.
    """
    out_h, out_w = image_hw(size)
    batch, channels, _, width = images.shape
    rows = top[:, None] + torch.arange(out_h)  # (B, S_h)
    steps = torch.arange(out_w)  # (S_w,)
    # A flipped crop reads its columns right to left: out[..., j] = crop[..., S_w - 1 - j].
    columns = left[:, None] + torch.where(flip[:, None], out_w - 1 - steps, steps)  # (B, S_w)
    # Flat pixel positions in each image; gather beats advanced indexing here by about 4x.
    where = (rows[:, :, None] * width + columns[:, None, :]).reshape(batch, 1, out_h * out_w)
    where = where.expand(batch, channels, out_h * out_w)  # (B, C, S_h*S_w)
    pixels = images.reshape(batch, channels, -1)  # (B, C, H*W)
    return torch.gather(pixels, 2, where).reshape(batch, channels, out_h, out_w)


def collate_crops(items: list[PendingCrop]) -> torch.Tensor:
    """A batch of pending crops as uint8 (B, 3, S_h, S_w): resized and cropped per group of
    sizes.

    Images of one size (all of them, for aligned crops) are resized in one call and cropped
    in one index; an image of a size of its own forms a group of one.

    Args:
        items: the batch's samples, all with the same ``size`` and ``resize_to``.
    """
    (out_h, out_w), target = items[0].size, items[0].resize_to
    out = torch.empty((len(items), items[0].image.shape[0], out_h, out_w), dtype=torch.uint8)
    groups: dict[tuple, list[int]] = {}
    for row, item in enumerate(items):
        groups.setdefault(tuple(item.image.shape), []).append(row)
    for rows in groups.values():
        images = torch.stack([items[r].image for r in rows])  # (G, 3, H, W)
        covered = cover_size(images.shape[-2], images.shape[-1], target)
        if tuple(images.shape[-2:]) != covered:  # not prepared (TrainCrops.prepare) per image
            images = TF.resize(images, list(covered), antialias=True)  # (G, 3, H', W')
        top = torch.tensor([items[r].top for r in rows])  # (G,)
        left = torch.tensor([items[r].left for r in rows])  # (G,)
        flip = torch.tensor([items[r].flip for r in rows])  # (G,)
        cropped = crop_and_flip(images, top, left, flip, (out_h, out_w))  # (G, 3, S_h, S_w)
        if len(groups) == 1:  # aligned crops: one size, no scatter needed
            return cropped
        out[rows] = cropped
    return out


def collate_batches(batch: list):
    """The loader's collate: columns of :class:`PendingCrop` become uint8 image batches,
    anything else goes to torch's ``default_collate``.

    Args:
        batch: the samples of one batch: ``(image, label)`` tuples, seed-style
            ``(a, p, n, label_p, label_n)`` tuples, or anything ``default_collate`` takes.
    """
    first = batch[0]
    if isinstance(first, PendingCrop):
        return collate_crops(batch)
    if not isinstance(first, (tuple, list)) or not any(isinstance(x, PendingCrop) for x in first):
        return default_collate(batch)
    columns = zip(*batch)
    return [
        collate_crops(list(c)) if isinstance(c[0], PendingCrop) else default_collate(list(c))
        for c in columns
    ]


def standardize(images: torch.Tensor, normalize: str = "fixed") -> torch.Tensor:
    """uint8 images as the float input of the network; any other dtype is returned as it is.

    The same operations as the per-sample ``ToDtype`` + ``Normalize`` steps, on the whole
    batch at once (and on its device), so the values are the same bit for bit.

    Args:
        images: uint8 (B, 3, S, S), or an already standardised float batch.
        normalize: "fixed" for FaceNet's (x - 127.5) / 128, "imagenet" for ImageNet mean/std.
    """
    if images.dtype != torch.uint8:
        return images
    if normalize == "fixed":
        floats = TF.to_dtype(images, torch.float32, scale=False)
        return TF.normalize(floats, FIXED_MEAN, FIXED_STD)
    if normalize == "imagenet":
        floats = TF.to_dtype(images, torch.float32, scale=True)
        return TF.normalize(floats, IMAGENET_MEAN, IMAGENET_STD)
    raise ValueError(f"normalize={normalize!r}: expected 'fixed' or 'imagenet'")


class DecodedCache:
    """Decoded uint8 images kept in memory by dataset index, up to a size limit.

    Each loading process fills its own cache as it decodes (DataLoader workers are separate
    processes), so the limit is shared out: a worker keeps at most ``max_bytes / workers``.
    Images that do not fit are decoded again each time they are drawn.

    Args:
        max_bytes: the limit over all loading processes (0: no cache).
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: expected >= 0")
        self.max_bytes = int(max_bytes)
        self.images: dict[int, torch.Tensor] = {}
        self.bytes = 0

    def budget(self) -> int:
        """This process's share of the limit."""
        worker = get_worker_info()
        return self.max_bytes // (worker.num_workers if worker is not None else 1)

    def get(self, index: int) -> torch.Tensor | None:
        """The cached image of ``index``, or None."""
        return self.images.get(index)

    def put(self, index: int, image: torch.Tensor) -> None:
        """Keep ``image`` if it fits in this process's share.

        Args:
            index: the dataset index.
            image: uint8 (3, H, W); never modified afterwards (batches copy it).
        """
        size = image.numel() * image.element_size()
        if self.bytes + size <= self.budget():
            self.images[index] = image
            self.bytes += size

    def __getstate__(self) -> dict:
        # A worker started with spawn gets an empty cache, not a copy of the parent's.
        return {"max_bytes": self.max_bytes, "images": {}, "bytes": 0}
