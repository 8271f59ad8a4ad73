"""pytorch-metric-learning's ``TripletMarginMiner``: every triplet of a batch whose
``d(a,n) - d(a,p)`` passes a margin test, found as ranges of each anchor's sorted negatives
(:func:`facenet.metric.miners.pairs_and_negatives`) and written out without an O(B^3) mask.
With ``"all"``, ``distance="seed_l2"`` and ``strict_margin=True`` its candidate filter is the
seed script's selection, bit for bit.
"""

from __future__ import annotations

import torch

from facenet.metric.checks import check_choice
from facenet.metric.distances import DistanceLike
from facenet.metric.miners import Miner, SortedNegatives, Triplets, pairs_and_negatives

TRIPLET_TYPES = ("all", "hard", "semihard", "easy")

# A step of _expand_ranges writes max(B, this // B) pairs, at most max(B^2, this) triplets: its
# temporaries stay O(B^2) while the number of operations stays small.
_MIN_EXPAND_TRIPLETS = 1 << 18


def _expand_step(batch_size: int) -> int:
    return max(_MIN_EXPAND_TRIPLETS // batch_size, batch_size)


def _expand_ranges(negatives: SortedNegatives, pair_a, pair_p, start, length) -> Triplets:
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


class TripletMarginMiner(Miner):
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
        pair_a, pair_p, d_ap, negatives, search = pairs_and_negatives(
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
