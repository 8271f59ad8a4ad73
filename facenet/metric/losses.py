"""FaceNet's triplet loss on index triplets that index the live graph.

``TripletMarginLoss`` takes a forward pass's (B, D) embeddings and index triplets (this
package's :class:`~facenet.metric.miners.Triplets` or any 3-tuple, such as a
pytorch-metric-learning miner's output) and reduces ``max(0, d(a,p) - d(a,n) + margin)`` over
them. With no triplets the loss is a zero still connected to the graph, so ``backward()``
always works. A NaN or inf embedding makes the loss NaN (``on_nonfinite="defer"``), so the
caller's check of its loss refuses the step (:mod:`facenet.metric.checks`). The same loss over
every triplet of a labelled batch is :mod:`facenet.metric.batch_all_loss`; CosFace's and
ArcFace's cross-entropy is :mod:`facenet.metric.margin_softmax`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from facenet.metric.checks import ON_NONFINITE, check_choice, check_index_triplets, finite_flag
from facenet.metric.distances import Distance, DistanceLike, get_distance

REDUCTIONS = ("mean_active", "mean", "sum")


def _reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    """(T,) losses reduced on the device; mean_active: over the non-zero ones
    (pytorch-metric-learning's AvgNonZeroReducer)."""
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / max(losses.shape[0], 1)
    return losses.sum() / (losses > 0).sum().clamp_min(1)


class TripletMarginLoss(nn.Module):
    """FaceNet's triplet loss on given index triplets, with pytorch-metric-learning's API.

    ``soft_margin``: softplus instead of the hinge (margin 0: Hermans et al. 2017's soft
    margin); ``swap``: ``min(d(a,n), d(p,n))`` as the negative distance (Balntas et al. 2016).
    After each call ``last_stats`` holds detached device tensors: ``num_triplets``,
    ``active_fraction`` (of non-zero losses), ``mean_dap``, ``mean_dan`` (before any swap; 0
    without triplets).
    """

    def __init__(
        self,
        margin: float = 0.2,
        distance: DistanceLike = "squared",
        reduction: str = "mean_active",
        soft_margin: bool = False,
        swap: bool = False,
        on_nonfinite: str = "defer",
    ) -> None:
        super().__init__()
        self.margin = float(margin)
        self.distance: Distance = get_distance(distance)
        self.reduction = check_choice(reduction, REDUCTIONS, "TripletMarginLoss", "reduction")
        self.soft_margin = bool(soft_margin)
        self.swap = bool(swap)
        self.on_nonfinite = check_choice(
            on_nonfinite, ON_NONFINITE, "TripletMarginLoss", "on_nonfinite"
        )
        self.last_stats: dict[str, torch.Tensor] = {}

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, distance={self.distance.name!r}, "
            f"reduction={self.reduction!r}, soft_margin={self.soft_margin}, swap={self.swap}, "
            f"on_nonfinite={self.on_nonfinite!r}"
        )

    def forward(
        self,
        embeddings: torch.Tensor,
        triplets: Sequence[torch.Tensor],
        ref_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The reduced loss. ``a`` indexes the (B, D) ``embeddings``; ``p`` and ``n`` index
        ``ref_embeddings`` (M, D) when given; an index outside its rows is refused."""
        who = type(self).__name__
        inputs = (embeddings,) if ref_embeddings is None else (embeddings, ref_embeddings)
        finite = finite_flag(self.on_nonfinite, who, *inputs)  # 0-dim bool
        a, p, n = check_index_triplets(triplets, who, *inputs)
        # With no triplets the sums below are zeros still connected to the graph.
        dist = self.distance(embeddings, ref_embeddings)  # (B, M)
        d_ap, d_an = dist[a, p], dist[a, n]  # (T,), (T,)
        d_neg = d_an
        if self.swap:
            ref_dist = dist if ref_embeddings is None else self.distance(ref_embeddings)  # (M, M)
            d_neg = torch.minimum(d_an, ref_dist[p, n])
        violation = d_ap - d_neg + self.margin  # (T,)
        losses = F.softplus(violation) if self.soft_margin else F.relu(violation)
        # NaN for a non-finite batch: the deferred refusal, read by the caller's check
        loss = torch.where(finite, _reduce(losses, self.reduction), float("nan"))
        count = losses.shape[0]  # detached statistics of this call, left on the device
        mean = lambda t: t.detach().mean() if count else loss.new_zeros(())  # noqa: E731
        self.last_stats = {
            "num_triplets": torch.full((), count, dtype=torch.int64, device=loss.device),
            "active_fraction": mean((losses > 0).to(losses.dtype)),
            "mean_dap": mean(d_ap),
            "mean_dan": mean(d_an),
        }
        return loss
