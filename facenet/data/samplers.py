"""P x K batch sampling: every batch holds P identities with K images each.

With K >= 2 every anchor in a batch has positives, which online triplet mining needs. Batches
are drawn in passes over the identities: a pass is a random order of all identities cut into
groups of P, so each identity appears in exactly one batch of the pass (the last group is
completed with identities drawn from the others). An epoch holds about as many images as the
data (at least one pass), so it covers every identity and epochs mean what they mean with any
other sampler. The order depends only on ``(seed, epoch)``, so every rank of a distributed run
computes the same list and takes its own share of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from facenet.errors import DataError

__all__ = ["PKSampler", "as_label_array"]


def as_label_array(labels: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Labels as an int64 numpy array (N,); a negative label marks a sample never drawn.

    Args:
        labels: one integer label per dataset index.
    """
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {array.dtype}")
    return array.astype(np.int64, copy=False)


class PKSampler(Sampler[list[int]]):
    """A batch sampler yielding lists of P x K dataset indices, identity-major.

    A batch is ``[i(1,1), ..., i(1,K), i(2,1), ..., i(P,K)]``: the K images of the first
    identity, then the K images of the second, and so on. The P identities of a batch are
    distinct. An identity with at least K images gives K distinct images; one with fewer gives
    all of its images plus repeats (``with_replacement=True``) or is left out
    (``with_replacement=False``).

    Use it as ``DataLoader(dataset, batch_sampler=PKSampler(...))`` and call ``set_epoch(e)``
    before each epoch.

    Args:
        labels: one label per dataset index; indices with a negative label are never drawn
            (``IdentityFolder.triplet_labels`` marks identities too small for triplets so).
        p: identities per batch.
        k: images per identity.
        seed: the base seed; the order is a function of ``(seed, epoch)``.
        with_replacement: sample identities with fewer than K images with repeats, or leave
            them out.
        rank: this process's rank in ``[0, world_size)``.
        world_size: the number of processes sharing the epoch; each takes every
            ``world_size``-th batch, so the ranks' batches are disjoint.
        drop_last: yield only full P x K batches: the last group of identities of a pass is
            completed with identities from the other groups. False leaves that group short
            (single-process runs only; ranks always get full batches, to stay in step).
        batches_per_epoch: batches per epoch for this rank; None draws
            ``max(ceil(identities / P), ceil(images / (P x K)))`` batches over all ranks
            (rounded up to a multiple of ``world_size``): about one look at every image, and
            at least one pass over the identities.
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
        drop_last: bool = True,
        batches_per_epoch: int | None = None,
    ):
        _check_positive(p=p, k=k, world_size=world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
        if batches_per_epoch is not None and batches_per_epoch < 1:
            raise ValueError(f"batches_per_epoch={batches_per_epoch}: expected >= 1 or None")
        self.p, self.k, self.seed, self.epoch = p, k, seed, 0
        self.with_replacement = with_replacement
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.batches_per_epoch = batches_per_epoch
        self._group_images(as_label_array(labels))

    def _group_images(self, labels: np.ndarray) -> None:
        """Index the drawable images by identity: ``order`` grouped, ``starts``/``counts``."""
        drawable = np.flatnonzero(labels >= 0)  # (M,)
        identities, inverse, counts = np.unique(
            labels[drawable], return_inverse=True, return_counts=True
        )
        if not self.with_replacement:
            keep = counts >= self.k
            drawable = drawable[keep[inverse]]
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
        self.identities = identities  # (C,) the label of each identity
        self._inverse = inverse  # (M,) identity number of each drawable image
        self._drawable = drawable  # (M,) dataset indices
        self._counts = counts  # (C,)

    @property
    def num_identities(self) -> int:
        """How many identities the sampler draws from."""
        return len(self.identities)

    def _global_batch_count(self) -> int:
        """Batches per epoch over all ranks (a multiple of ``world_size``)."""
        if self.batches_per_epoch is not None:
            return self.batches_per_epoch * self.world_size
        one_pass = math.ceil(self.num_identities / self.p)
        one_look = math.ceil(len(self._drawable) / (self.p * self.k))
        return math.ceil(max(one_pass, one_look) / self.world_size) * self.world_size

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return self._global_batch_count() // self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration yields.

        Args:
            epoch: the epoch number; with the seed it fixes the order.
        """
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        """What resuming needs: ``{"epoch", "seed"}``."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        """Restore the epoch and seed saved by :meth:`state_dict`.

        Args:
            state: a dict with the keys "epoch" and "seed".
        """
        missing = {"epoch", "seed"} - set(state)
        if missing:
            raise KeyError(f"PKSampler state is missing {sorted(missing)}")
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])

    def _identity_groups(self, rng: np.random.Generator, n_batches: int) -> list[np.ndarray]:
        """``n_batches`` groups of distinct identity numbers, pass after pass."""
        groups: list[np.ndarray] = []
        while len(groups) < n_batches:
            order = rng.permutation(self.num_identities)  # (C,)
            full = len(order) // self.p
            groups += list(order[: full * self.p].reshape(full, self.p))
            rest = order[full * self.p :]
            if len(rest):
                groups.append(self._complete_group(rng, rest) if self._pad_last() else rest)
        return groups[:n_batches]

    def _pad_last(self) -> bool:
        # Shorter batches only in single-process runs: ranks must stay in step.
        return self.drop_last or self.world_size > 1

    def _complete_group(self, rng: np.random.Generator, rest: np.ndarray) -> np.ndarray:
        """Fill a short group up to P with other identities, drawn without repeats."""
        others = np.setdiff1d(np.arange(self.num_identities), rest)
        fill = rng.choice(others, size=self.p - len(rest), replace=False)
        return np.concatenate([rest, fill])

    def _images_for(self, rng: np.random.Generator, groups: list[np.ndarray]) -> list[list[int]]:
        """K dataset indices per identity of each group, identity-major."""
        # A fresh random order of each identity's images: sort by (identity, random key).
        shuffled = np.lexsort((rng.random(len(self._inverse)), self._inverse))  # (M,)
        starts = np.concatenate([[0], np.cumsum(self._counts)[:-1]])  # (C,)
        batches = []
        for group in groups:
            # Identity g gives its first K shuffled images; with fewer than K, it cycles.
            offsets = np.arange(self.k)[None, :] % self._counts[group][:, None]  # (P, K)
            positions = starts[group][:, None] + offsets  # (P, K)
            batches.append(self._drawable[shuffled[positions]].reshape(-1).tolist())
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        groups = self._identity_groups(rng, self._global_batch_count())
        batches = self._images_for(rng, groups)
        yield from batches[self.rank :: self.world_size]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
