"""Triplet miners: which (anchor, positive, negative) triplets of a batch to train on.

A miner runs under ``torch.no_grad()`` and returns :class:`Triplets`, int64 indices into the
batch (pytorch-metric-learning's ``indices_tuple``), so the loss indexes the live graph. Memory
is O(B^2): each anchor's negatives are sorted once; a triplet condition is a contiguous range of
that order per anchor-positive pair, found by binary search. ``miner(embeddings, labels)`` mines
a P x K batch; ``miner(embeddings, candidates=(a, p, n))`` keeps the given triplets that pass
(``TripletMarginMiner(margin, "all", distance="seed_l2", strict_margin=True)``: the seed
script's selection, bit for bit). A NaN or inf embedding yields no triplet (``on_nonfinite``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from facenet.metric.checks import (
    ON_NONFINITE,
    check_choice,
    check_index_triplets,
    check_labels,
    finite_flag,
)
from facenet.metric.distances import Distance, DistanceLike, get_distance

if TYPE_CHECKING:
    from facenet.config import MiningConfig

TRIPLET_TYPES = ("all", "hard", "semihard", "easy")
FALLBACKS = ("hardest", "skip")
MINERS = ("semihard", "batch_hard", "triplet_margin")

# A step of _expand_ranges writes max(B, this // B) pairs, at most max(B^2, this) triplets: its
# temporaries stay O(B^2) while the number of operations stays small.
_MIN_EXPAND_TRIPLETS = 1 << 18
_CANDIDATE_CHUNK = 1 << 14  # candidate triplets per chunk of row-by-row distances


class Triplets(NamedTuple):
    """Indices into a batch, each an int64 tensor of shape (T,)."""

    anchor: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor

    @property
    def num_triplets(self) -> int:
        return self.anchor.shape[0]


def _draw(sample, size: int, generator: torch.Generator | None, device: torch.device):
    """``sample(size)`` (torch.rand, torch.randperm) from ``generator`` (on its device)."""
    if generator is None:
        return sample(size, device=device)
    return sample(size, generator=generator, device=generator.device).to(device)


def _cap(triplets: Triplets, max_triplets: int, generator: torch.Generator | None) -> Triplets:
    """A seeded random subset of at most ``max_triplets`` triplets, in their original order."""
    total = triplets.num_triplets
    if max_triplets == 0 or total <= max_triplets:
        return triplets
    order = _draw(torch.randperm, total, generator, triplets.anchor.device)
    return _filter(triplets, order[:max_triplets].sort().values)


def _filter(triplets: Triplets, keep: torch.Tensor) -> Triplets:
    return Triplets(*(t[keep] for t in triplets))


class _SortedNegatives(NamedTuple):
    """Each anchor's negatives by increasing distance: (B, B) ``distance`` (+inf past
    ``count``), (B, B) ``index`` (the batch column of each), (B,) ``count`` of comparable ones."""

    distance: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor


def identity_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, B) masks: same identity, and same identity off the diagonal."""
    same = labels[:, None] == labels[None, :]
    return same, same.clone().fill_diagonal_(False)


def _pairs_and_negatives(distance: Distance, embeddings: torch.Tensor, labels: torch.Tensor):
    """Every anchor-positive pair (sorted by anchor, positive), its d(a,p), sorted negatives,
    and their :func:`_searcher`."""
    same, positive = identity_masks(labels)
    pair_a, pair_p = positive.nonzero(as_tuple=True)  # (P,), (P,)
    dist = distance(embeddings)  # (B, B)
    # NaN sorts last: it marks the same-identity columns (and any NaN distance).
    values, index = dist.masked_fill(same, float("nan")).sort(dim=1, stable=True)
    missing = values.isnan()
    negatives = _SortedNegatives(
        values.masked_fill_(missing, float("inf")), index, (~missing).sum(1)
    )
    return pair_a, pair_p, dist[pair_a, pair_p], negatives, _searcher(negatives, pair_a)


def _searcher(negatives: _SortedNegatives, pair_a: torch.Tensor):
    """``search(threshold, right)``: (P,) how many of each pair's sorted negatives are < (or,
    right, <=) its threshold (P,); one batched search over a (B, most positives) table."""
    batch_size = negatives.distance.shape[0]
    per_anchor = torch.bincount(pair_a, minlength=batch_size)  # (B,)
    first = per_anchor.cumsum(0) - per_anchor  # (B,) each anchor's first pair
    slot = torch.arange(pair_a.shape[0], device=pair_a.device) - first[pair_a]  # (P,)
    width = int(per_anchor.max()) if pair_a.shape[0] else 0

    def search(threshold: torch.Tensor, right: bool) -> torch.Tensor:
        query = threshold.new_zeros(batch_size, width)  # (B, width)
        query[pair_a, slot] = threshold
        found = torch.searchsorted(negatives.distance, query, right=right)  # (B, width)
        return torch.minimum(found[pair_a, slot], negatives.count[pair_a])

    return search


def _expand_step(batch_size: int) -> int:
    return max(_MIN_EXPAND_TRIPLETS // batch_size, batch_size)


def _expand_ranges(negatives, pair_a, pair_p, start, length) -> Triplets:
    """Triplets (a, p, n), n in each pair's range [start, start + length) of sorted negatives,
    written ``_expand_step`` pairs at a time into an output allocated once."""
    device = pair_a.device
    end = length.cumsum(0)  # (P,) where each pair's triplets end in the output
    total = int(end[-1]) if end.shape[0] else 0
    out = Triplets(*(torch.empty(total, dtype=torch.int64, device=device) for _ in range(3)))
    batch_size = negatives.index.shape[0]
    begin = end - length  # (P,) where each pair's triplets begin in the output
    # Output position t of pair i maps to flat sorted index a*B + start + (t - begin(i)).
    flat_base = pair_a * batch_size + start - begin  # (P,)
    flat_index = negatives.index.reshape(-1)  # (B * B,)
    step = _expand_step(batch_size)
    firsts = list(range(0, end.shape[0], step))
    bounds = [*begin[firsts].tolist(), total]
    for first, os_, oe in zip(firsts, bounds, bounds[1:]):
        pairs = slice(first, first + step)
        row = torch.repeat_interleave(length[pairs], output_size=oe - os_)  # (k,) pair of each
        torch.index_select(pair_a[pairs], 0, row, out=out.anchor[os_:oe])
        torch.index_select(pair_p[pairs], 0, row, out=out.positive[os_:oe])
        position = flat_base[pairs].index_select(0, row)  # (k,)
        position += torch.arange(os_, oe, device=device)
        torch.index_select(flat_index, 0, position, out=out.negative[os_:oe])
    return out


def _candidate_distances(embeddings, candidates: Triplets, distance: Distance):
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


class _Miner:
    """The call protocol: checks, no_grad, candidates or mining, the max_triplets cap. Every
    miner also takes the keywords ``max_triplets``, ``generator`` and ``on_nonfinite``."""

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
        if isinstance(max_triplets, bool) or not isinstance(max_triplets, int) or max_triplets < 0:
            raise ValueError(
                f"{who}: max_triplets must be an int >= 0 (0: no cap), got {max_triplets!r}"
            )
        self.max_triplets = max_triplets
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
        d_ap, d_an = _candidate_distances(embeddings, candidates, self.distance)
        return _filter(candidates, self._passes(d_an - d_ap) & finite)


class TripletMarginMiner(_Miner):
    """Every triplet whose ``tm = d(a,n) - d(a,p)`` passes pytorch-metric-learning's test:
    ``all`` tm <= m, ``hard`` tm <= 0 (and <= m), ``semihard`` 0 < tm <= m, ``easy`` tm > m.

    ``strict_margin`` compares strictly (< m; easy: >= m): with "all" and "seed_l2", the seed
    script's ``d_n - d_p < margin``. Triplets come grouped by (anchor, positive), each pair's
    negatives nearest first. ``max_triplets`` > 0 keeps a random subset drawn from
    ``generator``. Mining compares d(a,n) with d(a,p) + m, filtering candidates computes tm as
    the seed did: the two disagree only within one rounding error of m.
    """

    def __init__(
        self,
        margin: float = 0.2,
        type_of_triplets: str = "all",
        distance: DistanceLike = "squared",
        *,
        strict_margin: bool = False,
        **common,
    ) -> None:
        super().__init__(distance, **common)
        self.margin = float(margin)
        self.type_of_triplets = check_choice(
            type_of_triplets, TRIPLET_TYPES, "TripletMarginMiner", "type_of_triplets"
        )
        self.strict_margin = bool(strict_margin)

    def __repr__(self) -> str:
        return (
            f"TripletMarginMiner(margin={self.margin}, type_of_triplets="
            f"{self.type_of_triplets!r}, distance={self.distance.name!r})"
        )

    def _passes(self, tm: torch.Tensor) -> torch.Tensor:
        if self.type_of_triplets == "easy":
            return tm >= self.margin if self.strict_margin else tm > self.margin
        within = tm < self.margin if self.strict_margin else tm <= self.margin
        if self.type_of_triplets == "hard":
            return within & (tm <= 0)
        return within & (tm > 0) if self.type_of_triplets == "semihard" else within

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        pair_a, pair_p, d_ap, negatives, search = _pairs_and_negatives(
            self.distance, embeddings, labels
        )
        # tm <= m (strict: <)  <=>  d(a,n) <= d(a,p) + m: the first `within` sorted negatives.
        within = search(d_ap + self.margin, not self.strict_margin)
        start, stop = torch.zeros_like(within), within
        if self.type_of_triplets == "hard":  # also d(a,n) <= d(a,p)
            stop = torch.minimum(within, search(d_ap, True))
        elif self.type_of_triplets == "semihard":  # also d(a,n) > d(a,p)
            start = search(d_ap, True)
        elif self.type_of_triplets == "easy":
            start, stop = within, negatives.count[pair_a]
        # A NaN d(a,p) passes no test (as in a direct comparison); a non-finite batch none.
        length = (stop - start).clamp_min(0).masked_fill(d_ap.isnan() | ~finite, 0)  # (P,)
        return _expand_ranges(negatives, pair_a, pair_p, start, length)


class BatchHardMiner(_Miner):
    """Each anchor's farthest positive and nearest negative (Hermans, Beyer, Leibe 2017, "In
    Defense of the Triplet Loss"); anchors lacking either are left out. With ``candidates``,
    each anchor keeps its candidate of largest d(a,p) - d(a,n), the first one on ties."""

    def __repr__(self) -> str:
        return f"BatchHardMiner(distance={self.distance.name!r})"

    @property
    def selects_every_image(self) -> bool:
        return self.max_triplets == 0

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        same, positive = identity_masks(labels)
        dist = self.distance(embeddings)  # (B, B)
        hardest_positive = dist.masked_fill(~positive, float("-inf")).max(1).indices  # (B,)
        hardest_negative = dist.masked_fill(same, float("inf")).min(1).indices  # (B,)
        has_both = positive.any(1) & ~same.all(1) & finite  # (B,)
        anchor = has_both.nonzero().squeeze(1)
        return Triplets(anchor, hardest_positive[anchor], hardest_negative[anchor])

    def _filter_candidates(self, embeddings, candidates: Triplets, finite) -> Triplets:
        d_ap, d_an = _candidate_distances(embeddings, candidates, self.distance)
        violation = d_ap - d_an  # (T,)
        # Stable sorts: by anchor, then largest violation first (NaN sorts first), then the
        # candidates' order; each anchor keeps its first, unless that is NaN.
        order = violation.argsort(descending=True, stable=True)
        order = order[candidates.anchor[order].argsort(stable=True)]
        anchor = candidates.anchor[order]
        first = torch.ones_like(anchor, dtype=torch.bool)
        first[1:] = anchor[1:] != anchor[:-1]
        keep = torch.zeros_like(first)
        keep[order[first]] = True
        return _filter(candidates, keep & ~violation.isnan() & finite)


class SemiHardNegativeMiner(_Miner):
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
        pair_a, pair_p, d_ap, negatives, search = _pairs_and_negatives(
            self.distance, embeddings, labels
        )
        first = search(d_ap, True)  # the band is the sorted range [first, stop)
        stop = search(d_ap + self.margin, False)
        band = (stop - first).clamp_min(0).masked_fill(d_ap.isnan(), 0)  # (P,)
        uniform = _draw(torch.rand, pair_a.shape[0], self.generator, embeddings.device)
        # floor(u * band) is uniform over 0..band-1; the clamp guards u * band rounding up.
        drawn = first + torch.minimum((uniform * band).long(), (band - 1).clamp_min(0))
        drawn = drawn.masked_fill(band == 0, 0)  # sorted position 0: the hardest negative
        keep = negatives.count[pair_a] > 0 if self.fallback == "hardest" else band > 0
        negative = negatives.index[pair_a, drawn]  # (P,)
        return _filter(Triplets(pair_a, pair_p, negative), keep & finite)


def build_miner(cfg: MiningConfig, generator: torch.Generator | None = None) -> _Miner:
    """The miner ``cfg`` describes (non-finite embeddings deferred to the Trainer)."""
    common = dict(distance=cfg.distance, max_triplets=cfg.max_triplets, generator=generator)
    if cfg.miner == "semihard":
        return SemiHardNegativeMiner(cfg.margin, fallback=cfg.fallback, **common)
    if cfg.miner == "triplet_margin":
        return TripletMarginMiner(
            cfg.margin, cfg.type_of_triplets, strict_margin=cfg.strict_margin, **common
        )
    check_choice(cfg.miner, MINERS, "mining.miner", "miner")
    return BatchHardMiner(**common)
