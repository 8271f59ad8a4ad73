"""P x K batch sampling: every batch holds P identities with K images each.

With K >= 2 every anchor has positives, which online mining needs. Batches come in passes: a
random order of all identities cut into groups of P, so each identity is in one batch of a
pass (the last group completed from the others). An epoch holds about as many images as the
data, and at least one pass. The order is a function of ``(seed, epoch)`` alone, so every rank
computes the same list and takes its share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from facenet.errors import DataError


def as_label_array(labels: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Integer labels as int64 (N,); a negative label marks a sample never drawn."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


class PKSampler(Sampler[list[int]]):
    """Batches of P x K dataset indices, identity-major: the K of the first identity, then the
    K of the second, ...; the P identities distinct. Call ``set_epoch(e)`` before each epoch.

    An identity with fewer than K images gives them all plus repeats (``with_replacement``) or
    is left out. Each of ``world_size`` ranks takes every ``world_size``-th batch.
    ``batches_per_epoch`` (per rank) defaults to ``max(ceil(identities / P), ceil(images /
    (P x K)))`` over all ranks, rounded up to a multiple of ``world_size``.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        p: int,
        k: int,
        seed: int = 0,
        with_replacement: bool = True,
        rank: int = 0,
        world_size: int = 1,
        batches_per_epoch: int | None = None,
    ):
        check_positive(p=p, k=k, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        if batches_per_epoch is not None:
            check_positive(batches_per_epoch=batches_per_epoch)
        self.p, self.k, self.seed, self.epoch = p, k, seed, 0
        self.with_replacement = with_replacement
        self.rank, self.world_size = rank, world_size
        self.batches_per_epoch = batches_per_epoch
        self._group_images(as_label_array(labels))

    def _group_images(self, labels):
        drawable = np.flatnonzero(labels >= 0)  # (M,)
        if not self.with_replacement:
            _, inverse, counts = np.unique(
                labels[drawable], return_inverse=True, return_counts=True
            )
            drawable = drawable[(counts >= self.k)[inverse]]
        identities, inverse, counts = np.unique(
            labels[drawable], return_inverse=True, return_counts=True
        )
        if len(identities) < self.p:
            rule = (
                "with 2+ images"
                if self.with_replacement
                else f"with at least K = {self.k} images (sampling without replacement)"
            )
            raise DataError(
                f"P = {self.p} identities per batch, but only {len(identities)} identities "
                f"{rule} can be drawn"
            )
        self.num_identities = len(identities)
        self._inverse = inverse  # (M,) identity number of each drawable image
        self._drawable = drawable  # (M,) dataset indices
        self._counts = counts  # (C,)

    def _global_batch_count(self):
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch * self.world_size
        one_pass = math.ceil(self.num_identities / self.p)
        one_look = math.ceil(len(self._drawable) / (self.p * self.k))
        return math.ceil(max(one_pass, one_look) / self.world_size) * self.world_size

    def __len__(self):
        return self._global_batch_count() // self.world_size

    def set_epoch(self, epoch: int):
        self.epoch = int(epoch)

    def state_dict(self):
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict):
        missing = {"epoch", "seed"} - set(state)
        if missing:
            raise KeyError(f"PKSampler state is missing {sorted(missing)}")
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])

    def _identity_groups(self, rng, n_batches):
        """``n_batches`` groups of distinct identity numbers, pass after pass."""
        groups = []
        while len(groups) < n_batches:
            order = rng.permutation(self.num_identities)  # (C,)
            full = len(order) // self.p
            groups += list(order[: full * self.p].reshape(full, self.p))
            rest = order[full * self.p :]
            if len(rest):
                others = np.setdiff1d(np.arange(self.num_identities), rest)
                rest = np.concatenate([rest, rng.choice(others, self.p - len(rest), replace=False)])
                groups.append(rest)
        return groups[:n_batches]

    def _images_for(self, rng, groups):
        """K dataset indices per identity of each group, identity-major."""
        # A fresh random order of each identity's images: sort by (identity, random key).
        shuffled = np.lexsort((rng.random(len(self._inverse)), self._inverse))  # (M,)
        starts = np.cumsum(self._counts) - self._counts  # (C,) where each identity begins
        batches = []
        for group in groups:
            # An identity gives its first K shuffled images; with fewer than K, it cycles.
            offsets = np.arange(self.k)[None, :] % self._counts[group][:, None]  # (P, K)
            positions = starts[group][:, None] + offsets  # (P, K)
            batches.append(self._drawable[shuffled[positions]].reshape(-1).tolist())
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        groups = self._identity_groups(rng, self._global_batch_count())
        yield from self._images_for(rng, groups)[self.rank :: self.world_size]


def check_positive(**values: int) -> None:
    """Raise ValueError naming the first of ``values`` that is not a positive integer."""
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
