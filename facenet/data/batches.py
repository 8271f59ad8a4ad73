"""The training augmentation done per batch, bit-identical to :func:`build_transform`'s.

Calling five torchvision transforms per small image cost more than decoding it. Here a sample
only draws its crop and flip (:class:`TrainCrops`, from torch's generator, in the order the
torchvision transforms draw them); its batch is resized per group of sizes, cropped and flipped
by one ``gather`` (:func:`crop_and_flip`), and stays uint8 until :func:`standardize` runs on
the device. tests/data/test_batches.py holds the equality.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map
from torchvision.transforms import v2

from facenet.data.images import cover_size, normalize_steps, resize_target, resize_to_cover
from facenet.sizes import ImageSize, image_hw


@dataclass
class PendingCrop:
    """A decoded uint8 (3, H, W) image and the (S_h, S_w) crop and flip drawn for it; ``top``
    and ``left`` are in the image resized to cover 1.125 x ``size``."""

    image: torch.Tensor
    top: int
    left: int
    flip: bool
    size: tuple[int, int]


class TrainCrops:
    """The per-sample half of the training transform: a :class:`PendingCrop` of the image."""

    def __init__(self, image_size: ImageSize, random_crop: bool = True, hflip: bool = True):
        self.size = image_hw(image_size)  # (S_h, S_w)
        self.random_crop, self.hflip = random_crop, hflip
        self.resize_to = resize_target(self.size)  # (R_h, R_w)

    def draw(self, height: int, width: int) -> tuple[int, int, bool]:
        """``(top, left, flip)`` for an image resized to ``height`` x ``width``: the numbers
        ``v2.RandomCrop`` then ``v2.RandomHorizontalFlip`` draw from torch's generator.

        RandomCrop draws ``torch.randint(0, extent - side + 1, (1,))`` per side longer than the
        crop, top first, and the flip one ``torch.rand(1)``; ``random_``/``uniform_`` on fresh
        tensors take the same numbers in the same order (both sides in one call when their
        ranges are equal) at a third of the cost.
        """
        side_h, side_w = self.size
        if not self.random_crop:  # v2.CenterCrop's rounding; nothing drawn
            top, left = round((height - side_h) / 2.0), round((width - side_w) / 2.0)
        else:
            span_h = height - side_h + 1 if height > side_h else 0  # 0: nothing drawn
            span_w = width - side_w + 1 if width > side_w else 0
            if span_h and span_h == span_w:
                top, left = torch.empty(2, dtype=torch.int64).random_(0, span_h).tolist()
            else:
                top, left = [
                    torch.empty((), dtype=torch.int64).random_(0, span).item() if span else 0
                    for span in (span_h, span_w)
                ]
        # torch.rand(1)'s dtype is the default dtype, as torch.empty's.
        flip = torch.empty(()).uniform_().item() < 0.5 if self.hflip else False
        return top, left, flip

    def prepare(self, image: torch.Tensor) -> torch.Tensor:
        """The deterministic part, the resize; ``IdentityFolder`` caches its result."""
        return resize_to_cover(image, self.resize_to)

    def __call__(self, image: torch.Tensor) -> PendingCrop:
        top, left, flip = self.draw(*cover_size(*image.shape[-2:], self.resize_to))
        return PendingCrop(image, top, left, flip, self.size)


def crop_and_flip(
    images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, size
) -> torch.Tensor:
    """(B, C, S_h, S_w): each of (B, C, H, W) cropped at its (top, left), mirrored where
    ``flip`` ((B,) each)."""
    out_h, out_w = image_hw(size)
    batch, channels, _, width = images.shape
    rows = top[:, None] + torch.arange(out_h)  # (B, S_h)
    steps = torch.arange(out_w)  # (S_w,)
    columns = left[:, None] + torch.where(flip[:, None], out_w - 1 - steps, steps)  # (B, S_w)
    # Flat pixel positions in each image; gather beats advanced indexing here by about 4x.
    where = (rows[:, :, None] * width + columns[:, None, :]).reshape(batch, 1, out_h * out_w)
    where = where.expand(batch, channels, out_h * out_w)  # (B, C, S_h*S_w)
    pixels = images.reshape(batch, channels, -1)  # (B, C, H*W)
    return torch.gather(pixels, 2, where).reshape(batch, channels, out_h, out_w)


def collate_crops(items: list[PendingCrop], *, collate_fn_map=None) -> torch.Tensor:
    """uint8 (B, 3, S_h, S_w); images of one size are resized in one call (``collate_fn_map``:
    torch's collate protocol, unused)."""
    size, target = items[0].size, resize_target(items[0].size)
    out = torch.empty((len(items), items[0].image.shape[0], *size), dtype=torch.uint8)
    top, left, flip = (torch.tensor(c) for c in zip(*((i.top, i.left, i.flip) for i in items)))
    groups = {}
    for row, item in enumerate(items):
        groups.setdefault(tuple(item.image.shape), []).append(row)
    for rows in groups.values():
        images = resize_to_cover(torch.stack([items[r].image for r in rows]), target)
        cropped = crop_and_flip(images, top[rows], left[rows], flip[rows], size)  # (G, 3, S_h, S_w)
        if len(groups) == 1:  # aligned crops: one size, no scatter needed
            return cropped
        out[rows] = cropped
    return out


def collate_batches(batch: list):
    """The loader's collate: ``default_collate`` with :class:`PendingCrop` columns collated by
    :func:`collate_crops` into uint8 batches."""
    return collate(batch, collate_fn_map={PendingCrop: collate_crops, **default_collate_fn_map})


def standardize(images: torch.Tensor, normalize: str = "fixed") -> torch.Tensor:
    """uint8 (B, 3, S, S) as the network's float input, bit for bit as the per-sample
    ``ToDtype`` + ``Normalize``; any other dtype is returned as it is."""
    if images.dtype != torch.uint8:
        return images
    return v2.Compose(normalize_steps(normalize))(images)


class DecodedCache:
    """Decoded images by dataset index, up to ``max_bytes`` over all loading processes.

    Each DataLoader worker fills its own cache, so each keeps ``max_bytes / workers``.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: expected >= 0")
        self.max_bytes = int(max_bytes)
        self.images = {}  # dataset index -> uint8 (3, H, W)
        self.bytes = 0

    def put(self, index: int, image: torch.Tensor):
        """Keep ``image`` (never modified afterwards) if it fits in this process's share."""
        worker = get_worker_info()
        share = self.max_bytes // (worker.num_workers if worker is not None else 1)
        size = image.numel() * image.element_size()
        if self.bytes + size <= share:
            self.images[index] = image
            self.bytes += size

    def item(self, index: int, decode, transform):
        """``(transform(image), ...)``'s image for dataset ``index``: decoded by ``decode()``
        and put through the transform's deterministic part (``TrainCrops.prepare``) once, then
        kept if it fits; ``transform`` (None: none) applied on every call."""
        image = self.images.get(index)  # uint8 (3, H, W), or None
        if image is None:
            prepare = getattr(transform, "prepare", None)
            image = decode()
            image = prepare(image) if prepare is not None else image
            self.put(index, image)
        return transform(image) if transform is not None else image

    def __getstate__(self):
        # A worker started with spawn gets an empty cache, not a copy of the parent's.
        return {"max_bytes": self.max_bytes, "images": {}, "bytes": 0}
