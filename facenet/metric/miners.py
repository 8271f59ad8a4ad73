"""Triplet miners: which (anchor, positive, negative) triplets of a batch to train on.

A miner runs under ``torch.no_grad()`` and returns :class:`Triplets`, int64 indices into the
batch (pytorch-metric-learning's ``indices_tuple``), so the loss indexes the live graph. Memory
is O(B^2): each anchor's negatives are sorted once; a triplet condition is a contiguous range of
that order per anchor-positive pair, found by binary search. ``miner(embeddings, labels)`` mines
a P x K batch; ``miner(embeddings, candidates=(a, p, n))`` keeps the given triplets that pass.
A NaN or inf embedding yields no triplet (``on_nonfinite``).

Here: the protocol every miner follows (:class:`Miner`) and FaceNet's semi-hard selection.
pytorch-metric-learning's miners are :mod:`facenet.metric.triplet_margin_miner` (with
``distance="seed_l2", strict_margin=True`` the seed script's selection, bit for bit) and
:mod:`facenet.metric.batch_hard_miner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from facenet.metric.checks import (
    ON_NONFINITE,
    check_choice,
    check_count,
    check_index_triplets,
    check_labels,
    finite_flag,
)
from facenet.metric.distances import Distance, DistanceLike, get_distance

FALLBACKS = ("hardest", "skip")

_CANDIDATE_CHUNK = 1 << 14  # candidate triplets per chunk of row-by-row distances


class Triplets(NamedTuple):
    """Indices into a batch, each an int64 tensor of shape (T,)."""

    anchor: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor

    @property
    def num_triplets(self) -> int:
        return self.anchor.shape[0]

    def subset(self, keep: torch.Tensor) -> Triplets:
        """The triplets ``keep`` (a (T,) mask or positions) selects; a mask becomes positions
        once (one host read on CUDA, not one per index tensor)."""
        if keep.dtype == torch.bool:
            keep = keep.nonzero().squeeze(1)  # (T',)
        return Triplets(*(t[keep] for t in self))


def _draw(sample, size: int, generator: torch.Generator | None, device: torch.device):
    """``sample(size)`` (torch.rand, torch.randperm) from ``generator`` (on its device), or
    from the default generator of ``device``."""
    source = device if generator is None else generator.device
    return sample(size, generator=generator, device=source).to(device)


def _cap(triplets: Triplets, max_triplets: int, generator: torch.Generator | None) -> Triplets:
    """A seeded random subset of at most ``max_triplets`` triplets, in their original order."""
    total = triplets.num_triplets
    if max_triplets == 0 or total <= max_triplets:
        return triplets
    order = _draw(torch.randperm, total, generator, triplets.anchor.device)
    return triplets.subset(order[:max_triplets].sort().values)


class SortedNegatives(NamedTuple):
    """Each anchor's negatives by increasing distance: (B, B) ``distance`` (+inf past
    ``count``), (B, B) ``index`` (the batch column of each), (B,) ``count`` of comparable ones."""

    distance: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor


def identity_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, B) masks: same identity, and same identity off the diagonal."""
    same = labels[:, None] == labels[None, :]
    return same, same.clone().fill_diagonal_(False)


def pairs_and_negatives(distance: Distance, embeddings: torch.Tensor, labels: torch.Tensor):
    """Every anchor-positive pair (sorted by anchor, positive), its d(a,p), sorted negatives,
    and their :func:`_searcher`."""
    same, positive = identity_masks(labels)
    pair_a, pair_p = positive.nonzero(as_tuple=True)  # (P,), (P,)
    dist = distance(embeddings)  # (B, B)
    # NaN sorts last: it marks the same-identity columns (and any NaN distance).
    values, index = dist.masked_fill(same, float("nan")).sort(dim=1, stable=True)
    missing = values.isnan()
    negatives = SortedNegatives(
        values.masked_fill_(missing, float("inf")), index, (~missing).sum(1)
    )
    return pair_a, pair_p, dist[pair_a, pair_p], negatives, _searcher(negatives, pair_a, pair_p)


def _searcher(negatives: SortedNegatives, pair_a: torch.Tensor, pair_p: torch.Tensor):
    """``search(threshold, right)``: (P,) how many of each pair's sorted negatives are < (or,
    right, <=) its threshold (P,); one batched search over a (B, B) table, each pair's query in
    its positive's column (a shape known without reading the labels back)."""

    def search(threshold: torch.Tensor, right: bool) -> torch.Tensor:
        query = torch.zeros_like(negatives.distance)  # (B, B)
        query[pair_a, pair_p] = threshold
        found = torch.searchsorted(negatives.distance, query, right=right)  # (B, B)
        return torch.minimum(found[pair_a, pair_p], negatives.count[pair_a])

    return search


def candidate_distances(embeddings, candidates: Triplets, distance: Distance):
    """d(a,p) and d(a,n) of each candidate, each (T,): row by row for a named distance (the
    seed's own arithmetic), through the (B, B) matrix for a custom one."""
    a, p, n = candidates
    if distance.paired_fn is None:
        dist = distance(embeddings)  # (B, B)
        return dist[a, p], dist[a, n]
    d_ap, d_an = [], []
    for start in range(0, max(a.shape[0], 1), _CANDIDATE_CHUNK):  # one chunk when empty
        part = slice(start, start + _CANDIDATE_CHUNK)
        anchors = embeddings[a[part]]  # (c, D)
        d_ap.append(distance.paired(anchors, embeddings[p[part]]))
        d_an.append(distance.paired(anchors, embeddings[n[part]]))
    return torch.cat(d_ap), torch.cat(d_an)


class Miner:
    """The call protocol: checks, no_grad, candidates or mining, the max_triplets cap. Every
    miner also takes the keywords ``max_triplets``, ``generator`` and ``on_nonfinite``. A
    subclass mines with ``_mine`` and filters candidates with ``_passes`` (a test on
    ``d(a,n) - d(a,p)``) or its own ``_filter_candidates``."""

    def __init__(
        self,
        distance: DistanceLike = "squared",
        *,
        max_triplets: int = 0,
        generator: torch.Generator | None = None,
        on_nonfinite: str = "defer",
    ) -> None:
        who = type(self).__name__
        self.distance = get_distance(distance)
        self.max_triplets = check_count(max_triplets, 0, who, "max_triplets")  # 0: no cap
        self.generator = generator
        self.on_nonfinite = check_choice(on_nonfinite, ON_NONFINITE, who, "on_nonfinite")

    def __call__(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor | None = None,
        candidates: Sequence[torch.Tensor] | None = None,
    ) -> Triplets:
        """Triplets of the (B, D) batch, or those of the (T,) ``candidates`` that pass (then
        ``labels`` are not needed); none when an embedding holds NaN or inf."""
        who = type(self).__name__
        with torch.no_grad():
            finite = finite_flag(self.on_nonfinite, who, embeddings)  # 0-dim bool
            if candidates is not None:
                checked = check_index_triplets(candidates, who, embeddings, what="candidate")
                triplets = self._filter_candidates(embeddings, Triplets(*checked), finite)
            else:
                labels = check_labels(labels, embeddings, who)
                if embeddings.shape[0] == 0:
                    return Triplets(*labels.new_zeros(3, 0, dtype=torch.int64))
                triplets = self._mine(embeddings, labels, finite)
        return _cap(triplets, self.max_triplets, self.generator)

    # Whether every image of a P x K batch (K >= 2) lands in some triplet (then the training
    # step needs no separate mining pass).
    selects_every_image = False

    def _filter_candidates(self, embeddings, candidates: Triplets, finite) -> Triplets:
        d_ap, d_an = candidate_distances(embeddings, candidates, self.distance)
        return candidates.subset(self._passes(d_an - d_ap) & finite)


class SemiHardNegativeMiner(Miner):
    """FaceNet's online selection (Schroff, Kalenichenko, Philbin 2015, section 3.2).

    Every anchor-positive pair, with one negative drawn uniformly from the band
    ``d(a,p) < d(a,n) < d(a,p) + margin`` by ``generator``; with an empty band, the anchor's
    nearest negative (``fallback="hardest"``) or no triplet (``"skip"``). Triplets come sorted
    by (anchor, positive). With ``candidates``, those inside the band (no fallback).
    """

    def __init__(
        self,
        margin: float = 0.2,
        distance: DistanceLike = "squared",
        fallback: str = "hardest",
        generator: torch.Generator | None = None,
        **common,
    ) -> None:
        super().__init__(distance, generator=generator, **common)
        self.margin = float(margin)
        self.fallback = check_choice(fallback, FALLBACKS, "SemiHardNegativeMiner", "fallback")

    def __repr__(self) -> str:
        return (
            f"SemiHardNegativeMiner(margin={self.margin}, distance={self.distance.name!r}, "
            f"fallback={self.fallback!r})"
        )

    def _passes(self, tm: torch.Tensor) -> torch.Tensor:
        return (tm > 0) & (tm < self.margin)

    @property
    def selects_every_image(self) -> bool:
        return self.fallback == "hardest" and self.max_triplets == 0

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        pair_a, pair_p, d_ap, negatives, search = pairs_and_negatives(
            self.distance, embeddings, labels
        )
        first = search(d_ap, True)  # the band is the sorted range [first, stop)
        stop = search(d_ap + self.margin, False)
        band = (stop - first).clamp_min(0).masked_fill(d_ap.isnan(), 0)  # (P,)
        uniform = _draw(torch.rand, pair_a.shape[0], self.generator, embeddings.device)
        # floor(u * band) is uniform over 0..band-1; the clamp guards u * band rounding up. An
        # empty band draws sorted position 0: the hardest negative.
        offset = (uniform * band).long().clamp_max(band - 1)  # (P,)
        drawn = (first + offset).masked_fill(band == 0, 0)
        keep = negatives.count[pair_a] > 0 if self.fallback == "hardest" else band > 0
        negative = negatives.index[pair_a, drawn]  # (P,)
        return Triplets(pair_a, pair_p, negative).subset(keep & finite)
