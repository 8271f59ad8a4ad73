"""Triplet losses that index the live graph, and the margin softmax of a cosine classifier.

``TripletMarginLoss`` takes a forward pass's (B, D) embeddings and index triplets (this
package's :class:`~facenet.metric.miners.Triplets` or any 3-tuple, such as a
pytorch-metric-learning miner's output) and reduces ``max(0, d(a,p) - d(a,n) + margin)`` over
them. With no triplets the loss is a zero still connected to the graph, so ``backward()``
always works. A NaN or inf embedding makes the loss NaN (``on_nonfinite="defer"``), so the
caller's check of its loss refuses the step (:mod:`facenet.metric.checks`).
``MarginSoftmaxLoss``: CosFace's or ArcFace's cross-entropy on (N, C) cosines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from facenet.metric.checks import (
    ON_NONFINITE,
    check_choice,
    check_index_triplets,
    check_labels,
    finite_flag,
)
from facenet.metric.distances import Distance, DistanceLike, get_distance
from facenet.metric.miners import identity_masks

if TYPE_CHECKING:
    from facenet.config import LossConfig

REDUCTIONS = ("mean_active", "mean", "sum")
# Margins of the papers and of insightface's arcface_torch: CosFace's on the cosine, ArcFace's
# on the angle (radians).
MARGINS = {"cosface": 0.35, "arcface": 0.5}
CROSS_ENTROPIES = ("softmax", *MARGINS)  # loss.ce: plain (a linear classifier's), or a margin


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


class _BatchAllTripletHinge(torch.autograd.Function):
    """Reduced loss over every valid triplet of a (B, B) distance matrix D.

    Forward walks anchor chunks and accumulates ``dL/dD``: a triplet (a, p, n) with loss
    derivative g adds g to D[a, p] and -g to D[a, n]; backward returns it, no graph kept.
    """

    @staticmethod
    def forward(ctx, dist, labels, margin, reduction, soft_margin, chunk_size):
        same, positive = identity_masks(labels)  # (B, B) each
        grad = torch.zeros_like(dist)  # (B, B) d(sum of losses)/dD
        total = dist.new_zeros(())
        num_active = dist.new_zeros((), dtype=torch.int64)
        num_valid = dist.new_zeros((), dtype=torch.int64)
        for start in range(0, dist.shape[0], chunk_size):
            # (c,) each, anchors chunk-local; a chunk without pairs adds zeros
            pair_a, pair_p = positive[start : start + chunk_size].nonzero(as_tuple=True)
            pair_a = pair_a + start
            negative = ~same[pair_a]  # (c, B)
            d_ap = dist[pair_a, pair_p]  # (c,)
            # violation[i, n] = d(a_i, p_i) - d(a_i, n) + m, -inf off the negatives. (c, B)
            violation = (d_ap[:, None] - dist[pair_a] + margin).masked_fill(
                ~negative, float("-inf")
            )
            if soft_margin:
                losses = F.softplus(violation)
                slope = torch.sigmoid(violation)  # 0 at -inf
            else:
                losses = F.relu(violation)
                slope = (violation > 0).to(dist.dtype)
            total = total + losses.sum()
            num_active += (losses > 0).sum()
            num_valid += negative.sum()
            grad.index_put_((pair_a, pair_p), slope.sum(1), accumulate=True)
            grad.index_add_(0, pair_a, -slope)
        count = {"mean_active": num_active, "mean": num_valid, "sum": torch.ones_like(num_valid)}
        scale = 1.0 / count[reduction].clamp_min(1).to(dist.dtype)
        ctx.save_for_backward(grad * scale)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None, None, None, None


def batch_all_triplet_loss(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    margin: float = 0.2,
    distance: DistanceLike = "squared",
    reduction: str = "mean_active",
    chunk_size: int = 256,
    soft_margin: bool = False,
    on_nonfinite: str = "defer",
) -> torch.Tensor:
    """``TripletMarginLoss`` over every valid triplet of a labelled (B, D) batch ("batch
    all"), without listing them: O(B^2) memory (autograd through chunks would keep
    O(B^3 / identities)), with ``chunk_size`` anchors per chunk of working space."""
    who = "batch_all_triplet_loss"
    finite = finite_flag(on_nonfinite, who, embeddings)  # 0-dim bool
    check_choice(reduction, REDUCTIONS, who, "reduction")
    check_choice(on_nonfinite, ON_NONFINITE, who, "on_nonfinite")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{who}: chunk_size must be an int >= 1, got {chunk_size!r}")
    labels = check_labels(labels, embeddings, who)  # (B,)
    dist = get_distance(distance)(embeddings)  # (B, B)
    loss = _BatchAllTripletHinge.apply(
        dist, labels, float(margin), reduction, bool(soft_margin), chunk_size
    )
    return torch.where(finite, loss, float("nan"))


class MarginSoftmaxLoss(nn.Module):
    """Per-row cross-entropy of ``scale x`` (N, C) cosines with a margin on each row's target:
    ``cos - margin`` (CosFace, Wang et al. 2018) or ``cos(theta + margin)`` (ArcFace, Deng et
    al. 2019). Past ``theta + margin = pi``, where ``cos(theta + margin)`` would rise again,
    ArcFace's target is ``cos - margin sin(margin)`` (insightface's arcface_torch/losses.py at
    2e2e8c9 and pytorch-metric-learning 2.9.0's ArcFaceLoss; not their "easy margin").
    Returns (N,) losses: the caller reduces."""

    def __init__(self, kind: str = "cosface", scale: float = 64.0, margin: float | None = None):
        super().__init__()
        self.kind = check_choice(kind, tuple(MARGINS), "MarginSoftmaxLoss", "kind")
        self.scale = float(scale)
        self.margin = MARGINS[kind] if margin is None else float(margin)
        if not 0.0 <= self.margin < math.pi or not self.scale > 0:
            raise ValueError(
                f"MarginSoftmaxLoss: margin must be in [0, pi) and scale > 0, got "
                f"margin={self.margin!r}, scale={self.scale!r}"
            )

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, scale={self.scale}, margin={self.margin}"

    def forward(self, cosines: torch.Tensor, labels: torch.Tensor, reduction="none"):
        """(N, C) cosines (a cosine classifier's output) and (N,) labels -> (N,) losses
        (``reduction`` as ``F.cross_entropy``'s)."""
        rows = labels[:, None]  # (N, 1)
        target = cosines.gather(1, rows)  # (N, 1)
        m = self.margin
        if self.kind == "cosface":
            target_logit = target - m
        else:  # cos(theta + m); the floor keeps sqrt's gradient finite at cos = 1
            sine = (1 - target.square()).clamp_min(1e-12).sqrt()
            past_pi = target <= math.cos(math.pi - m)  # theta + m >= pi
            target_logit = torch.where(
                past_pi, target - m * math.sin(m), target * math.cos(m) - sine * math.sin(m)
            )
        logits = self.scale * cosines.scatter(1, rows, target_logit)  # (N, C)
        return F.cross_entropy(logits, labels, reduction=reduction)


def build_loss(cfg: LossConfig) -> TripletMarginLoss:
    """The triplet loss ``cfg`` describes (its ``ce_weight`` is the model's classifier's)."""
    return TripletMarginLoss(cfg.margin, cfg.distance, cfg.reduction, cfg.soft_margin, cfg.swap)


def build_margin_loss(cfg: LossConfig) -> MarginSoftmaxLoss | None:
    """The margin softmax of ``loss.ce`` (for a cosine classifier), or None for plain
    cross-entropy on a linear classifier's logits."""
    if cfg.ce == "softmax":
        return None
    return MarginSoftmaxLoss(cfg.ce, cfg.ce_scale, cfg.ce_margin)
