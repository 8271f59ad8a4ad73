"""What an audit finds in unit embeddings (Euclidean distances in [0, 2]), each kind ranked.

- **overlap**: each evaluation image's nearest training image; closer than the threshold, the
  two are taken for the same person (same pixels: an exact duplicate);
- **label noise**: each training image's distance to its own identity's centre, the others'
  mean without it (a mislabelled image would pull its own centre towards itself), and to the
  nearest other identity's centre; the margin (own minus other) ranks them, and an image is a
  suspect when the margin is positive or its own centre lies as far as a stranger's;
- **split identities**: identities whose centres lie closer than the threshold.

A centre is the mean of an identity's unit embeddings, made unit length again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import normalize

from facenet.wings.audit.neighbours import nearest, nearest_other


@dataclass
class Identities:
    """N rows grouped by identity: ``names`` (K,), each row's identity ``index`` (N,), the
    ``sums`` (K, D) of each identity's unit rows and its ``counts`` (K,)."""

    names: list
    index: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, unit: torch.Tensor, labels: list) -> Identities:
        names, index = np.unique(np.asarray(labels, dtype=str), return_inverse=True)
        index = torch.as_tensor(index.reshape(-1))
        sums = torch.zeros(len(names), unit.shape[1]).index_add_(0, index, unit)  # (K, D)
        return cls(names.tolist(), index, sums, torch.bincount(index, minlength=len(names)))

    @property
    def centres(self) -> torch.Tensor:
        return normalize(self.sums, dim=1)  # (K, D)

    def typical(self, identity: int, unit: torch.Tensor, count: int) -> list[int]:
        """The rows of ``identity`` nearest its centre, at most ``count``."""
        members = torch.nonzero(self.index == identity).flatten()
        distances = (unit[members] - self.centres[identity]).norm(dim=1)
        return members[distances.argsort()[:count]].tolist()


def overlap(train: torch.Tensor, evaluation: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(M,) the nearest training row of each evaluation row and (M,) its distance."""
    found, distances = nearest(evaluation, train, 1)  # (M, 1)
    return found[:, 0].numpy(), distances[:, 0].numpy()


@dataclass
class LabelNoise:
    """Per training row (N,): ``own`` distance to its identity's centre without it (NaN for an
    identity of one image), the ``other`` nearest identity and its centre's ``distance``."""

    own: np.ndarray
    other: np.ndarray
    distance: np.ndarray

    @property
    def margin(self) -> np.ndarray:
        return self.own - self.distance  # > 0: closer to another identity than to its own

    def suspects(self, stranger: float) -> np.ndarray:
        """The rows closer to another identity or beyond ``stranger`` of their own, the
        largest margin first."""
        with np.errstate(invalid="ignore"):  # NaN (a lone image) is never a suspect
            flagged = np.flatnonzero((self.margin > 0) | (self.own > stranger))
        return flagged[np.argsort(-self.margin[flagged], kind="stable")]


def _own_distances(unit: torch.Tensor, ids: Identities, chunk: int = 2**16) -> torch.Tensor:
    """(N,) each row's distance to its identity's centre without it, ``chunk`` rows at a time
    (a million (N, D) temporaries would triple the embeddings' memory)."""
    parts = []
    for rows, index in zip(unit.split(chunk), ids.index.split(chunk)):
        rest = ids.sums[index] - rows  # (C, D): the others of its identity, summed
        parts.append((rows - normalize(rest, dim=1)).norm(dim=1))
    return torch.cat(parts) if parts else torch.zeros(0)


def label_noise(unit: torch.Tensor, ids: Identities) -> LabelNoise:
    """Each row of ``unit`` (N, D) against the centres of ``ids`` (two identities at least)."""
    own = _own_distances(unit, ids)  # (N,)
    own[ids.counts[ids.index] == 1] = float("nan")
    other, distance = nearest_other(unit, ids.centres, ids.index)
    return LabelNoise(own.numpy(), other.numpy(), distance.numpy())


def split_identities(ids: Identities, threshold: float) -> list[tuple[int, int, float]]:
    """``(a, b, distance)`` of the identities whose centres lie closer than ``threshold``, a
    below b, the closest first; each identity pairs with its nearest other only."""
    centres = ids.centres
    other, distance = nearest_other(centres, centres, torch.arange(len(centres)))
    pairs = {
        (min(a, b), max(a, b)): d
        for a, (b, d) in enumerate(zip(other.tolist(), distance.tolist()))
        if d < threshold
    }
    return sorted(((a, b, d) for (a, b), d in pairs.items()), key=lambda row: row[2])
