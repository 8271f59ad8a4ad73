"""Triplet miners: which (anchor, positive, negative) triplets of a batch to train on.

Every miner runs under ``torch.no_grad()`` on the embeddings' device and never leaves it (no
numpy, no host round trip of embeddings). It returns :class:`Triplets` of int64 index tensors
into the batch, so the loss indexes the live graph and the gradient reaches the model.
A ``Triplets`` is a plain 3-tuple: pytorch-metric-learning losses accept it as
``indices_tuple``, and this package's losses accept that library's miner outputs.

Memory is O(B^2) working space plus the returned indices: no B x B x B tensor is built.
Each anchor's negatives are sorted by distance once (B x B); a triplet condition then selects
a contiguous range of that order for each anchor-positive pair, found by binary search. Listing
the triplets costs O(P log B) plus the size of the output (P: anchor-positive pairs), and the
output is allocated once, at its final size.

Two ways of calling every miner:

- ``miner(embeddings, labels)``: mine the batch (P identities x K images).
- ``miner(embeddings, labels, candidates=(a, p, n))``: only keep those of the given triplets
  that pass the miner's condition. This is the seed-compatible mode, where the dataset supplies
  triplets. The seed script keeps ``d(a,n) - d(a,p) < margin`` with its own distance;
  ``TripletMarginMiner(margin, "all", distance="seed_l2", strict_margin=True)`` reproduces that
  selection exactly (bit for bit in float32), without leaving the device.

Conditions, with ``tm = d(a,n) - d(a,p)`` and margin ``m`` (pytorch-metric-learning's):
``all`` tm <= m, ``hard`` tm <= 0 and tm <= m, ``semihard`` 0 < tm <= m, ``easy`` tm > m.
Mining a batch compares ``d(a,n)`` with ``d(a,p) + m``; filtering candidates computes
``d(a,n) - d(a,p)`` as the seed did. The two roundings can disagree only for a triplet whose
margin is within one rounding error of ``m``.

Input checks (:mod:`facenet.metric.checks`, which also gives their costs):

- ``candidates`` outside ``[0, B)`` (negative ones included, which indexing would wrap around
  to the last rows) are refused by a device-side assert: no host read; on the CPU an
  ``IndexError`` naming the argument and the values.
- Non-finite embeddings, ``on_nonfinite="defer"`` (the default): a batch holding NaN or inf
  in any embedding yields no triplet at all. The flag joins the selection mask whose size the
  miner reads anyway, so this adds no host read. A training step that selects nothing is
  where :class:`facenet.training.engine.Trainer` looks at its images (``_check_images``):
  the step is undone and the images named. ``on_nonfinite="raise"``: a ``ValueError``
  naming the rows at once (one host read on an accelerator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from facenet.metric.checks import (
    all_finite,
    check_embeddings,
    check_finite,
    check_index_triplets,
    check_labels,
    check_on_nonfinite,
)
from facenet.metric.distances import Distance, DistanceLike, get_distance

if TYPE_CHECKING:
    from facenet.config import MiningConfig

__all__ = [
    "Triplets",
    "TripletMarginMiner",
    "BatchHardMiner",
    "SemiHardNegativeMiner",
    "build_miner",
    "TRIPLET_TYPES",
    "FALLBACKS",
    "MINERS",
]

TRIPLET_TYPES = ("all", "hard", "semihard", "easy")
FALLBACKS = ("hardest", "skip")
MINERS = ("semihard", "batch_hard", "triplet_margin")  # mining.miner, see build_miner

# Output triplets written per step when ranges are expanded: max(B^2, this). The step's two
# int64 temporaries stay O(B^2) while the number of (thread-pool) operations stays small.
_MIN_EXPAND_STEP = 1 << 18
# Candidate triplets per chunk when their distances are computed row by row.
_CANDIDATE_CHUNK = 1 << 14


class Triplets(NamedTuple):
    """Indices of triplets into a batch, each an int64 tensor of shape (T,).

    Args:
        anchor: anchor indices.
        positive: positive indices (same identity as the anchor).
        negative: negative indices (another identity).
    """

    anchor: torch.Tensor
    positive: torch.Tensor
    negative: torch.Tensor

    @property
    def num_triplets(self) -> int:
        """Number of triplets T (shape information, no device sync)."""
        return self.anchor.shape[0]


# --------------------------------------------------------------------------- input checks


def _empty_triplets(device: torch.device) -> Triplets:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return Triplets(empty, empty.clone(), empty.clone())


def _check_max_triplets(max_triplets: int, who: str) -> int:
    if isinstance(max_triplets, bool) or not isinstance(max_triplets, int) or max_triplets < 0:
        raise ValueError(
            f"{who}: max_triplets must be an int >= 0 (0: no cap), got {max_triplets!r}"
        )
    return max_triplets


# --------------------------------------------------------------------------- shared pieces


def _random_uniform(n: int, generator: torch.Generator | None, device: torch.device):
    """(n,) uniform [0, 1) numbers, drawn from ``generator`` (on its device) if given."""
    if generator is None:
        return torch.rand(n, device=device)
    return torch.rand(n, generator=generator, device=generator.device).to(device)


def _cap(triplets: Triplets, max_triplets: int, generator: torch.Generator | None) -> Triplets:
    """A seeded random subset of at most ``max_triplets`` triplets, in their original order."""
    total = triplets.num_triplets
    if max_triplets == 0 or total <= max_triplets:
        return triplets
    device = triplets.anchor.device
    if generator is None:
        order = torch.randperm(total, device=device)
    else:
        order = torch.randperm(total, generator=generator, device=generator.device).to(device)
    keep = order[:max_triplets].sort().values
    return Triplets(*(t[keep] for t in triplets))


def _same_identity(labels: torch.Tensor) -> torch.Tensor:
    """(B, B) bool: labels[i] == labels[j]."""
    return labels[:, None] == labels[None, :]


def _positive_pairs(same: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All (anchor, positive) pairs, i != j with one identity, sorted by (anchor, positive)."""
    pos = same.clone()
    pos.fill_diagonal_(False)
    anchor, positive = pos.nonzero(as_tuple=True)
    return anchor, positive


class _SortedNegatives(NamedTuple):
    """Each anchor's negatives in order of increasing distance.

    Args:
        distance: (B, B) the sorted distances, +inf past ``count``.
        index: (B, B) int64 the column (batch index) of each sorted distance.
        count: (B,) int64 number of negatives with a comparable (non-NaN) distance.
    """

    distance: torch.Tensor
    index: torch.Tensor
    count: torch.Tensor


def _sort_negatives(dist: torch.Tensor, same: torch.Tensor) -> _SortedNegatives:
    """Sort every row's negatives by distance; same-identity columns go past the end."""
    # NaN sorts last: it marks the same-identity columns (and any NaN distance).
    key = dist.masked_fill(same, float("nan"))  # (B, B)
    values, index = key.sort(dim=1, stable=True)  # stable: ties in a fixed order
    missing = values.isnan()
    count = (~missing).sum(1)  # (B,)
    return _SortedNegatives(values.masked_fill_(missing, float("inf")), index, count)


class _PairSlots(NamedTuple):
    """Where each anchor-positive pair sits in a (B, max positives) table.

    Args:
        slot: (P,) the pair's column in its anchor's row.
        width: the table's width (most positives of any anchor).
    """

    slot: torch.Tensor
    width: int


def _pair_slots(pair_a: torch.Tensor, batch_size: int) -> _PairSlots:
    """Slots of pairs sorted by anchor: pair i is the j-th positive of its anchor."""
    per_anchor = torch.bincount(pair_a, minlength=batch_size)  # (B,)
    first = per_anchor.cumsum(0) - per_anchor  # (B,) index of each anchor's first pair
    slot = torch.arange(pair_a.shape[0], device=pair_a.device) - first[pair_a]
    width = int(per_anchor.max()) if pair_a.shape[0] else 0
    return _PairSlots(slot, width)


def _search_pairs(
    negatives: _SortedNegatives,
    pair_a: torch.Tensor,
    slots: _PairSlots,
    threshold: torch.Tensor,
    right: bool,
) -> torch.Tensor:
    """For each pair, how many of its anchor's sorted negatives are < (or <=) a threshold.

    Args:
        negatives: the sorted negatives.
        pair_a: (P,) the pair's anchor.
        slots: the pairs' slots in a (B, width) table, so one batched search serves all.
        threshold: (P,) one threshold per pair.
        right: count distances <= threshold (True) or < threshold (False).

    Returns:
        (P,) int64 positions in the sorted row, at most the anchor's negative count.
    """
    batch_size = negatives.distance.shape[0]
    query = threshold.new_zeros(batch_size, slots.width)  # (B, width)
    query[pair_a, slots.slot] = threshold
    found = torch.searchsorted(negatives.distance, query, right=right)  # (B, width)
    return torch.minimum(found[pair_a, slots.slot], negatives.count[pair_a])


def _expand_step(batch_size: int) -> int:
    """Triplets written per step of :func:`_expand_ranges`."""
    return max(batch_size**2, _MIN_EXPAND_STEP)


def _expand_ranges(
    negatives: _SortedNegatives,
    pair_a: torch.Tensor,
    pair_p: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
) -> Triplets:
    """Triplets (a, p, n) for n in each pair's range [start, start + length) of sorted negatives.

    The output is allocated once at its final size and filled in steps of max(B^2,
    _MIN_EXPAND_STEP) triplets, so the working memory beside it stays O(B^2).
    """
    device = pair_a.device
    end = length.cumsum(0)  # (P,) where each pair's triplets end in the output
    total = int(end[-1]) if end.shape[0] else 0
    out = Triplets(*(torch.empty(total, dtype=torch.int64, device=device) for _ in range(3)))
    if total == 0:
        return out
    batch_size = negatives.index.shape[0]
    step = _expand_step(batch_size)
    # Output position t of pair i maps to flat sorted index a*B + start + (t - first_t(i)).
    flat_base = pair_a * batch_size + start - (end - length)  # (P,)
    flat_index = negatives.index.reshape(-1)  # (B * B,)
    steps = torch.arange(step, max(total, step), step, device=device)
    # Cut between pairs: each step's pairs are those whose triplets end within the step.
    cut = torch.searchsorted(end, steps, right=True)  # (S,) pair counts
    end_from_zero = torch.cat([end.new_zeros(1), end])  # (P + 1,)
    pair_bounds = [0, *cut.tolist(), end.shape[0]]
    out_bounds = [0, *end_from_zero[cut].tolist(), total]
    for s, e, os_, oe in zip(pair_bounds, pair_bounds[1:], out_bounds, out_bounds[1:]):
        if oe == os_:
            continue
        # row[t]: the pair (index into pair_a[s:e]) that output t belongs to. (k,)
        row = torch.repeat_interleave(length[s:e], output_size=oe - os_)
        torch.index_select(pair_a[s:e], 0, row, out=out.anchor[os_:oe])
        torch.index_select(pair_p[s:e], 0, row, out=out.positive[os_:oe])
        position = flat_base[s:e].index_select(0, row)  # (k,)
        position += torch.arange(os_, oe, device=device)
        torch.index_select(flat_index, 0, position, out=out.negative[os_:oe])
    return out


def _margin_condition(
    type_of_triplets: str, margin: float, strict_margin: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The boolean test on ``tm = d(a,n) - d(a,p)`` for one triplet type."""
    if strict_margin:
        within = lambda tm: tm < margin  # noqa: E731
        beyond = lambda tm: tm >= margin  # noqa: E731
    else:
        within = lambda tm: tm <= margin  # noqa: E731
        beyond = lambda tm: tm > margin  # noqa: E731
    if type_of_triplets == "all":
        return within
    if type_of_triplets == "hard":
        return lambda tm: within(tm) & (tm <= 0)
    if type_of_triplets == "semihard":
        return lambda tm: within(tm) & (tm > 0)
    return beyond  # easy


def _candidate_distances(
    embeddings: torch.Tensor, candidates: Triplets, distance: Distance
) -> tuple[torch.Tensor, torch.Tensor]:
    """d(a,p) and d(a,n) of each candidate triplet, each (T,).

    A named distance is evaluated row by row (O(T) memory, the seed's own arithmetic); a
    custom matrix distance through the (B, B) matrix.
    """
    a, p, n = candidates
    if not distance.has_paired:
        dist = distance(embeddings)  # (B, B)
        return dist[a, p], dist[a, n]
    d_ap, d_an = [], []
    for start in range(0, a.shape[0], _CANDIDATE_CHUNK):
        part = slice(start, start + _CANDIDATE_CHUNK)
        anchors = embeddings[a[part]]  # (c, D)
        d_ap.append(distance.paired(anchors, embeddings[p[part]]))
        d_an.append(distance.paired(anchors, embeddings[n[part]]))
    if not d_ap:
        empty = embeddings.new_zeros(0, dtype=torch.promote_types(embeddings.dtype, torch.float32))
        return empty, empty
    return torch.cat(d_ap), torch.cat(d_an)


def _filter(candidates: Triplets, keep: torch.Tensor) -> Triplets:
    return Triplets(*(t[keep] for t in candidates))


class _Miner:
    """Shared call protocol: checks, no_grad, candidates dispatch, the max_triplets cap."""

    def __init__(
        self,
        distance: DistanceLike,
        max_triplets: int,
        generator: torch.Generator | None,
        on_nonfinite: str = "defer",
    ) -> None:
        who = type(self).__name__
        self.distance = get_distance(distance)
        self.max_triplets = _check_max_triplets(max_triplets, who)
        self.generator = generator
        self.on_nonfinite = check_on_nonfinite(on_nonfinite, who)

    def __call__(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor | None = None,
        candidates: Sequence[torch.Tensor] | None = None,
    ) -> Triplets:
        """Mine triplets of a batch, or filter given candidate triplets.

        Args:
            embeddings: (B, D) embeddings, any float dtype (distances use float32 or wider).
            labels: (B,) identity labels; optional when ``candidates`` are given (unused then).
            candidates: optional (a, p, n) index tensors, each (T,): only filter these. An
                index outside ``[0, B)`` is refused (a device-side assert).

        Returns:
            Triplets of int64 tensors on the embeddings' device; none when an embedding holds
            NaN or inf (``on_nonfinite="defer"``).
        """
        who = type(self).__name__
        check_embeddings(embeddings, who)
        with torch.no_grad():
            if candidates is not None:
                rows = (embeddings.shape[0],) * 2
                checked = check_index_triplets(
                    candidates, embeddings.device, who, "candidate", rows=rows
                )
                finite = self._finite(embeddings, who)
                triplets = self._filter_candidates(embeddings, Triplets(*checked), finite)
            else:
                labels = check_labels(labels, embeddings, who, " unless candidates are given")
                if embeddings.shape[0] == 0:
                    return _empty_triplets(embeddings.device)
                finite = self._finite(embeddings, who)
                triplets = self._mine(embeddings, labels, finite)
        return _cap(triplets, self.max_triplets, self.generator)

    def _finite(self, embeddings: torch.Tensor, who: str) -> torch.Tensor:
        """The 0-dim "all finite" flag the selection masks with; "raise" raises here instead."""
        if self.on_nonfinite == "raise":
            check_finite(embeddings, who)  # one host read (free on the CPU)
        return all_finite(embeddings)

    @property
    def selects_every_image(self) -> bool:
        """True when every image of a P x K batch (K >= 2) lands in some triplet.

        The training step uses it to choose its path: with dense selection a second,
        selection-only forward pass buys nothing.
        """
        return False

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        """Triplets of the batch; none unless the 0-dim bool ``finite`` holds."""
        raise NotImplementedError

    def _filter_candidates(
        self, embeddings: torch.Tensor, candidates: Triplets, finite: torch.Tensor
    ) -> Triplets:
        """The candidates passing the miner's test; none unless ``finite`` holds."""
        raise NotImplementedError


# --------------------------------------------------------------------------- TripletMarginMiner


class TripletMarginMiner(_Miner):
    """Every triplet of the batch whose margin ``tm = d(a,n) - d(a,p)`` passes a test.

    The types are pytorch-metric-learning's, so mined sets can be compared with it:
    ``all`` tm <= m, ``hard`` tm <= 0 (and <= m), ``semihard`` 0 < tm <= m, ``easy`` tm > m.
    Triplets come grouped by (anchor, positive) in increasing order, each pair's negatives
    nearest first (that library lists negatives by index: compare the two as sets).

    Args:
        margin: m.
        type_of_triplets: "all", "hard", "semihard" or "easy".
        distance: a name ("squared", "euclidean", "cosine", "seed_l2") or a callable.
        strict_margin: compare with the margin strictly (tm < m for all/hard/semihard,
            tm >= m for easy). With type "all" and distance "seed_l2" this is the seed
            script's selection ``d_n - d_p < margin``.
        max_triplets: keep a seeded random subset of at most this many; 0 keeps all.
        generator: the torch.Generator for that subset.
        on_nonfinite: "defer" (no triplet from a batch with a NaN or inf embedding; no host
            read) or "raise" (a ``ValueError`` naming the rows); see the module docstring.
    """

    def __init__(
        self,
        margin: float = 0.2,
        type_of_triplets: str = "all",
        distance: DistanceLike = "squared",
        *,
        strict_margin: bool = False,
        max_triplets: int = 0,
        generator: torch.Generator | None = None,
        on_nonfinite: str = "defer",
    ) -> None:
        super().__init__(distance, max_triplets, generator, on_nonfinite)
        if type_of_triplets not in TRIPLET_TYPES:
            raise ValueError(
                f"TripletMarginMiner: unknown type_of_triplets {type_of_triplets!r}; valid: "
                + ", ".join(TRIPLET_TYPES)
            )
        self.margin = float(margin)
        self.type_of_triplets = type_of_triplets
        self.strict_margin = bool(strict_margin)

    def __repr__(self) -> str:
        return (
            f"TripletMarginMiner(margin={self.margin}, type_of_triplets="
            f"{self.type_of_triplets!r}, distance={self.distance.name!r})"
        )

    def _filter_candidates(
        self, embeddings: torch.Tensor, candidates: Triplets, finite: torch.Tensor
    ) -> Triplets:
        d_ap, d_an = _candidate_distances(embeddings, candidates, self.distance)
        condition = _margin_condition(self.type_of_triplets, self.margin, self.strict_margin)
        return _filter(candidates, condition(d_an - d_ap) & finite)

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        same = _same_identity(labels)  # (B, B)
        pair_a, pair_p = _positive_pairs(same)  # (P,), (P,)
        dist = self.distance(embeddings)  # (B, B)
        d_ap = dist[pair_a, pair_p]  # (P,)
        negatives = _sort_negatives(dist, same)
        del dist, same
        start, stop = self._negative_range(negatives, pair_a, d_ap)
        # A NaN d(a,p) passes no test (as in a direct comparison); a non-finite batch none.
        length = (stop - start).clamp_min(0).masked_fill(d_ap.isnan() | ~finite, 0)  # (P,)
        return _expand_ranges(negatives, pair_a, pair_p, start, length)

    def _negative_range(
        self, negatives: _SortedNegatives, pair_a: torch.Tensor, d_ap: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's passing negatives as a range [start, stop) of its sorted negatives."""
        slots = _pair_slots(pair_a, negatives.distance.shape[0])
        search = lambda threshold, right: _search_pairs(  # noqa: E731
            negatives, pair_a, slots, threshold, right
        )
        # tm <= m (strict: tm < m)  <=>  d(a,n) <= d(a,p) + m: the first `within` negatives.
        within = search(d_ap + self.margin, not self.strict_margin)
        nothing = torch.zeros_like(within)
        if self.type_of_triplets == "all":
            return nothing, within
        if self.type_of_triplets == "hard":  # also tm <= 0  <=>  d(a,n) <= d(a,p)
            return nothing, torch.minimum(within, search(d_ap, True))
        if self.type_of_triplets == "semihard":  # also tm > 0  <=>  d(a,n) > d(a,p)
            return search(d_ap, True), within
        return within, negatives.count[pair_a]  # easy: the rest


# --------------------------------------------------------------------------- BatchHardMiner


class BatchHardMiner(_Miner):
    """For each anchor, its farthest positive and its nearest negative.

    Hermans, Beyer, Leibe 2017, "In Defense of the Triplet Loss". Anchors with no positive or
    no negative in the batch are left out. With ``candidates``, each anchor keeps its hardest
    candidate triplet (largest d(a,p) - d(a,n); the first one on ties).

    Args:
        distance: a name ("squared", "euclidean", "cosine", "seed_l2") or a callable.
        max_triplets: keep a seeded random subset of at most this many; 0 keeps all.
        generator: the torch.Generator for that subset.
        on_nonfinite: "defer" (no triplet from a batch with a NaN or inf embedding; no host
            read) or "raise" (a ``ValueError`` naming the rows); see the module docstring.
    """

    def __init__(
        self,
        distance: DistanceLike = "squared",
        *,
        max_triplets: int = 0,
        generator: torch.Generator | None = None,
        on_nonfinite: str = "defer",
    ) -> None:
        super().__init__(distance, max_triplets, generator, on_nonfinite)

    def __repr__(self) -> str:
        return f"BatchHardMiner(distance={self.distance.name!r})"

    @property
    def selects_every_image(self) -> bool:
        """Every anchor with a positive and a negative gets a triplet (no cap: all images)."""
        return self.max_triplets == 0

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        same = _same_identity(labels)  # (B, B)
        positive = same.clone()
        positive.fill_diagonal_(False)
        dist = self.distance(embeddings)  # (B, B)
        hardest_positive = dist.masked_fill(~positive, float("-inf")).max(1).indices  # (B,)
        hardest_negative = dist.masked_fill(same, float("inf")).min(1).indices  # (B,)
        has_both = positive.any(1) & ~same.all(1) & finite  # (B,)
        anchor = has_both.nonzero().squeeze(1)
        return Triplets(anchor, hardest_positive[anchor], hardest_negative[anchor])

    def _filter_candidates(
        self, embeddings: torch.Tensor, candidates: Triplets, finite: torch.Tensor
    ) -> Triplets:
        d_ap, d_an = _candidate_distances(embeddings, candidates, self.distance)
        violation = d_ap - d_an  # (T,)
        anchors, group = torch.unique(candidates.anchor, return_inverse=True)
        num_groups, num = anchors.shape[0], violation.shape[0]
        worst = violation.new_full((num_groups,), float("-inf"))
        worst = worst.scatter_reduce(0, group, violation, "amax")
        position = torch.arange(num, device=violation.device)
        at_worst = torch.where(violation == worst[group], position, num)
        first = position.new_full((num_groups,), num).scatter_reduce(0, group, at_worst, "amin")
        return _filter(candidates, (position == first[group]) & finite)


# --------------------------------------------------------------------------- SemiHardNegativeMiner


class SemiHardNegativeMiner(_Miner):
    """FaceNet's online selection (Schroff, Kalenichenko, Philbin 2015, section 3.2).

    Every anchor-positive pair of the batch, each with one negative drawn uniformly at random
    from the semi-hard band ``d(a,p) < d(a,n) < d(a,p) + margin``. When the band is empty the
    pair takes its anchor's hardest (nearest) negative (``fallback="hardest"``) or is dropped
    (``"skip"``). Pairs whose anchor has no negative are dropped. Draws come from
    ``generator``, so a seeded generator reproduces them. Triplets come sorted by
    (anchor, positive).

    With ``candidates`` the miner only keeps the candidates inside the band (no fallback: a
    filter cannot pick another negative).

    Args:
        margin: width of the band.
        distance: a name ("squared", "euclidean", "cosine", "seed_l2") or a callable.
        fallback: "hardest" or "skip", for pairs with an empty band.
        generator: the torch.Generator for the draws and the subset.
        max_triplets: keep a seeded random subset of at most this many; 0 keeps all.
        on_nonfinite: "defer" (no triplet from a batch with a NaN or inf embedding; no host
            read) or "raise" (a ``ValueError`` naming the rows); see the module docstring.
    """

    def __init__(
        self,
        margin: float = 0.2,
        distance: DistanceLike = "squared",
        fallback: str = "hardest",
        generator: torch.Generator | None = None,
        *,
        max_triplets: int = 0,
        on_nonfinite: str = "defer",
    ) -> None:
        super().__init__(distance, max_triplets, generator, on_nonfinite)
        if fallback not in FALLBACKS:
            raise ValueError(
                f"SemiHardNegativeMiner: unknown fallback {fallback!r}; valid: "
                + ", ".join(FALLBACKS)
            )
        self.margin = float(margin)
        self.fallback = fallback

    def __repr__(self) -> str:
        return (
            f"SemiHardNegativeMiner(margin={self.margin}, distance={self.distance.name!r}, "
            f"fallback={self.fallback!r})"
        )

    def _in_band(self, tm: torch.Tensor) -> torch.Tensor:
        return (tm > 0) & (tm < self.margin)

    def _filter_candidates(
        self, embeddings: torch.Tensor, candidates: Triplets, finite: torch.Tensor
    ) -> Triplets:
        d_ap, d_an = _candidate_distances(embeddings, candidates, self.distance)
        return _filter(candidates, self._in_band(d_an - d_ap) & finite)

    @property
    def selects_every_image(self) -> bool:
        """With the hardest fallback every anchor-positive pair keeps a triplet (no cap)."""
        return self.fallback == "hardest" and self.max_triplets == 0

    def _mine(self, embeddings: torch.Tensor, labels: torch.Tensor, finite) -> Triplets:
        same = _same_identity(labels)  # (B, B)
        pair_a, pair_p = _positive_pairs(same)  # (P,), (P,)
        dist = self.distance(embeddings)  # (B, B)
        d_ap = dist[pair_a, pair_p]  # (P,)
        negatives = _sort_negatives(dist, same)
        del dist, same
        slots = _pair_slots(pair_a, embeddings.shape[0])
        # The band d(a,p) < d(a,n) < d(a,p) + m is a range [first, stop) of sorted negatives.
        first = _search_pairs(negatives, pair_a, slots, d_ap, right=True)
        stop = _search_pairs(negatives, pair_a, slots, d_ap + self.margin, right=False)
        band = (stop - first).clamp_min(0).masked_fill(d_ap.isnan(), 0)  # (P,)
        uniform = _random_uniform(pair_a.shape[0], self.generator, embeddings.device)
        # floor(u * band) is uniform over 0..band-1; the clamp guards u * band rounding up.
        drawn = first + torch.minimum((uniform * band).long(), (band - 1).clamp_min(0))
        in_band = band > 0
        # Sorted position 0 is the anchor's nearest negative: the "hardest" fallback.
        drawn = drawn.masked_fill(~in_band, 0)
        keep = negatives.count[pair_a] > 0 if self.fallback == "hardest" else in_band
        keep = keep & finite  # (P,): a batch with a non-finite embedding keeps nothing
        batch_size = embeddings.shape[0]
        negative = negatives.index.reshape(-1)[pair_a * batch_size + drawn]  # (P,)
        return Triplets(pair_a[keep], pair_p[keep], negative[keep])


# --------------------------------------------------------------------------- factory


def build_miner(cfg: MiningConfig, generator: torch.Generator | None = None) -> _Miner:
    """The miner a :class:`facenet.config.MiningConfig` describes.

    Args:
        cfg: ``miner`` ("semihard", "batch_hard", "triplet_margin"), ``type_of_triplets``,
            ``margin``, ``distance``, ``fallback``, ``max_triplets`` (0: no cap).
        generator: the torch.Generator for random draws and the cap.

    Non-finite embeddings are deferred to the Trainer (``on_nonfinite="defer"``: the step
    selects nothing and the Trainer looks at the images).

    Raises:
        ValueError: an unknown ``mining.miner``.
    """
    if cfg.miner == "semihard":
        return SemiHardNegativeMiner(
            margin=cfg.margin,
            distance=cfg.distance,
            fallback=cfg.fallback,
            max_triplets=cfg.max_triplets,
            generator=generator,
        )
    if cfg.miner == "batch_hard":
        return BatchHardMiner(
            distance=cfg.distance, max_triplets=cfg.max_triplets, generator=generator
        )
    if cfg.miner == "triplet_margin":
        return TripletMarginMiner(
            margin=cfg.margin,
            type_of_triplets=cfg.type_of_triplets,
            distance=cfg.distance,
            strict_margin=cfg.strict_margin,
            max_triplets=cfg.max_triplets,
            generator=generator,
        )
    raise ValueError(f"mining.miner: unknown miner {cfg.miner!r}; valid: " + ", ".join(MINERS))
