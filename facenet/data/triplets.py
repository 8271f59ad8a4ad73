"""Seed-style triplets: a list of (anchor, positive, negative) drawn afresh each epoch.

The original generator drew with ``randint(0, n - 1)`` as an exclusive bound, so the last class
and the last image of every class were never drawn; here every image can be drawn in each role.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from facenet.data.samplers import as_label_array, check_positive
from facenet.errors import DataError


def generate_triplets(
    labels: np.ndarray, num_triplets: int, rng: np.random.Generator
) -> np.ndarray:
    """int64 (num_triplets, 3) dataset indices (anchor, positive, negative); labels < 0 are
    never drawn.

    The anchor identity is uniform over those with two images or more, anchor and positive two
    distinct images of it; the negative identity is uniform over the others, its image within it.
    """
    drawable = np.flatnonzero(labels >= 0)  # (M,)
    order = drawable[np.argsort(labels[drawable], kind="stable")]  # (M,) grouped by identity
    _, counts = np.unique(labels[order], return_counts=True)  # (C,)
    starts = np.cumsum(counts) - counts  # (C,) where each identity begins in order
    n_ids = len(counts)
    anchor_ids = np.flatnonzero(counts >= 2)
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
    first = starts[pos_id]
    return np.stack(
        [order[first + anchor], order[first + positive], order[starts[neg_id] + negative]], axis=1
    )


class TripletListDataset(Dataset):
    """The triplets of an epoch, a function of ``(seed, epoch)``; ``triplets`` is int64 (N, 3).

    Items are ``(img_a, img_p, img_n, label_p, label_n)``, the images taken from ``dataset``'s
    ``(image, label)`` items; without a dataset, the dataset indices in their place.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        num_triplets: int,
        seed: int = 0,
        dataset: Dataset | None = None,
    ):
        check_positive(num_triplets=num_triplets)
        self.labels = as_label_array(labels)  # (N,)
        if dataset is not None and len(dataset) != len(self.labels):
            raise ValueError(f"dataset has {len(dataset)} items but labels has {len(self.labels)}")
        self.num_triplets = int(num_triplets)
        self.seed = seed
        self.dataset = dataset
        self.set_epoch(0)

    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)
        rng = np.random.default_rng([self.seed, self.epoch])
        self.triplets = torch.from_numpy(generate_triplets(self.labels, self.num_triplets, rng))

    def __len__(self):
        return self.num_triplets

    def __getitem__(self, i: int) -> tuple:
        a, p, n = self.triplets[i].tolist()
        items = (a, p, n) if self.dataset is None else [self.dataset[j][0] for j in (a, p, n)]
        return *items, int(self.labels[p]), int(self.labels[n])
