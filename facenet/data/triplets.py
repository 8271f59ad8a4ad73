"""Seed-compatible triplets: a pre-generated list of (anchor, positive, negative) per epoch.

The original generator drew classes with ``randint(0, n_classes - 1)`` and images with
``randint(0, len(images) - 1)`` (an exclusive upper bound), so the last class and the last image
of every class were never drawn. Here every identity with at least two images can be the anchor
identity, every identity can be the negative one and every image can be drawn in each role.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from facenet.data.images import read_image
from facenet.data.samplers import as_label_array
from facenet.errors import DataError

__all__ = ["TripletListDataset", "generate_triplets"]


def _grouped_images(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drawable indices grouped by identity, and each identity's start and count.

    Returns:
        ``(order (M,), starts (C,), counts (C,))``: ``order[starts[c] : starts[c] + counts[c]]``
        are the dataset indices of identity number ``c``.
    """
    drawable = np.flatnonzero(labels >= 0)  # (M,)
    order = drawable[np.argsort(labels[drawable], kind="stable")]  # (M,)
    _, counts = np.unique(labels[order], return_counts=True)  # (C,)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return order, starts, counts


def generate_triplets(
    labels: np.ndarray, num_triplets: int, rng: np.random.Generator
) -> np.ndarray:
    """Draw ``num_triplets`` (anchor, positive, negative) dataset-index triplets, vectorised.

    The anchor identity is uniform over the identities with at least two images; anchor and
    positive are two distinct images of it, uniform; the negative identity is uniform over the
    other identities and the negative image uniform within it.

    Args:
        labels: int64 (N,); negative labels are never drawn.
        num_triplets: how many triplets.
        rng: the random stream.

    Returns:
        int64 array (num_triplets, 3).
    """
    order, starts, counts = _grouped_images(labels)
    n_ids = len(counts)
    anchor_ids = np.flatnonzero(counts >= 2)  # identity numbers that can hold an anchor
    if len(anchor_ids) == 0 or n_ids < 2:
        raise DataError(
            f"triplets need an identity with at least 2 images and a second identity; "
            f"got {n_ids} identities, {len(anchor_ids)} with 2 or more images"
        )
    pos_id = anchor_ids[rng.integers(0, len(anchor_ids), num_triplets)]  # (T,)
    # A different identity: uniform over the other n_ids - 1, skipping the anchor's number.
    neg_id = rng.integers(0, n_ids - 1, num_triplets)  # (T,)
    neg_id += neg_id >= pos_id
    n_pos = counts[pos_id]  # (T,)
    anchor = rng.integers(0, n_pos)  # (T,) in [0, n)
    positive = rng.integers(0, n_pos - 1)  # (T,) in [0, n - 1), shifted past the anchor
    positive += positive >= anchor
    negative = rng.integers(0, counts[neg_id])  # (T,)
    return np.stack(
        [
            order[starts[pos_id] + anchor],
            order[starts[pos_id] + positive],
            order[starts[neg_id] + negative],
        ],
        axis=1,
    )


class TripletListDataset(Dataset):
    """A fixed list of (anchor, positive, negative) triplets per epoch, as the seed trained on.

    Items over images (``paths_or_dataset`` given) are ``(img_a, img_p, img_n, label_p,
    label_n)``; without it they are the dataset indices ``(a, p, n, label_p, label_n)``.

    Attributes:
        triplets: int64 tensor (N, 3) of dataset indices (anchor, positive, negative).

    Args:
        labels: one label per dataset index; negative labels are never drawn.
        num_triplets: triplets per epoch.
        seed: the base seed; the list is a function of ``(seed, epoch)``.
        paths_or_dataset: image file paths (read with ``read_image`` and ``transform``), or a
            dataset whose item ``i`` is ``(image, label)``; None for index items.
        transform: applied to images read from paths.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        num_triplets: int,
        seed: int = 0,
        paths_or_dataset: Sequence[str | os.PathLike] | Dataset | None = None,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if not isinstance(num_triplets, (int, np.integer)) or num_triplets < 1:
            raise ValueError(f"num_triplets={num_triplets!r}: expected a positive integer")
        self.labels = as_label_array(labels)  # (N,)
        if paths_or_dataset is not None and len(paths_or_dataset) != len(self.labels):
            raise ValueError(
                f"paths_or_dataset has {len(paths_or_dataset)} items but labels has "
                f"{len(self.labels)}"
            )
        self.num_triplets = int(num_triplets)
        self.seed = seed
        self.source = paths_or_dataset
        self.transform = transform
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the triplet list of ``epoch``.

        Args:
            epoch: the epoch number; with the seed it fixes the list.
        """
        self.epoch = int(epoch)
        rng = np.random.default_rng([self.seed, self.epoch])
        self.triplets = torch.from_numpy(generate_triplets(self.labels, self.num_triplets, rng))

    def _image(self, index: int) -> torch.Tensor:
        if isinstance(self.source, Dataset):
            return self.source[index][0]
        image = read_image(self.source[index])  # uint8 (3, H, W)
        return self.transform(image) if self.transform is not None else image

    def __len__(self) -> int:
        return self.num_triplets

    def __getitem__(self, i: int) -> tuple:
        """``(img_a, img_p, img_n, label_p, label_n)``, or indices in place of images."""
        a, p, n = self.triplets[i].tolist()
        label_p, label_n = int(self.labels[p]), int(self.labels[n])
        if self.source is None:
            return a, p, n, label_p, label_n
        return self._image(a), self._image(p), self._image(n), label_p, label_n
