"""Triplet losses that index the live graph, so the gradient reaches the model.

``TripletMarginLoss`` takes the embeddings of a forward pass with grad and the index triplets
of a miner (this package's :class:`facenet.metric.miners.Triplets` or any 3-tuple, such as a
pytorch-metric-learning miner's output), and computes

    loss_i = max(0, d(a_i, p_i) - d(a_i, n_i) + margin)         (soft: softplus of the same)

on the (B, B) distance matrix of those embeddings. Nothing is copied out of the graph. When
there are no triplets the loss is a zero that is still connected to the graph (its gradient is
zero), never NaN for finite embeddings, so ``loss.backward()`` always works.

``batch_all_triplet_loss`` averages over every valid triplet of a labelled batch without
listing them: anchor chunks, and a gradient assembled on the (B, B) distance matrix, so memory
stays O(B^2) where autograd through chunks would keep O(B^3 / identities) alive.

Input checks (:mod:`facenet.metric.checks`, which also gives their costs):

- Triplet indices outside ``[0, rows)`` (negative ones included, which indexing would wrap
  around to the last rows) are refused by a device-side assert: no host read; on the CPU an
  ``IndexError`` naming the argument and the values.
- Non-finite embeddings, ``on_nonfinite="defer"`` (the default): the loss is NaN when any
  embedding it is given holds NaN or inf, even one no triplet uses and even with no triplet,
  so a loop checking its loss (the Trainer's ``_finite``, once per step) refuses the step.
  ``on_nonfinite="raise"``: a ``ValueError`` naming the rows at once (one host read on an
  accelerator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from facenet.metric.checks import (
    all_finite,
    check_embeddings,
    check_finite,
    check_index_triplets,
    check_labels,
    check_on_nonfinite,
)
from facenet.metric.distances import Distance, DistanceLike, compute_dtype, get_distance

if TYPE_CHECKING:
    from facenet.config import LossConfig

__all__ = ["REDUCTIONS", "TripletMarginLoss", "batch_all_triplet_loss", "build_loss"]

REDUCTIONS = ("mean_active", "mean", "sum")


def _check_reduction(reduction: str, who: str) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{who}: unknown reduction {reduction!r}; valid: " + ", ".join(REDUCTIONS))
    return reduction


def _connected_zero(*tensors: torch.Tensor) -> torch.Tensor:
    """A scalar 0 in the graph of ``tensors`` with a zero gradient, even if they hold NaN.

    The sum of an empty slice is exactly 0; ``x.sum() * 0`` would be NaN for a non-finite x.
    """
    dtype = compute_dtype(*tensors)
    return sum(t[:0].to(dtype).sum() for t in tensors)


def _check_inputs(on_nonfinite: str, who: str, *tensors: torch.Tensor) -> torch.Tensor:
    """Apply ``on_nonfinite`` to the (B, D) inputs; the 0-dim "all finite" flag (no host read).

    Under "raise" a non-finite row raises here (one host read); the flag is then True.
    """
    if on_nonfinite == "raise":
        names = ("embeddings", "ref_embeddings")
        for name, t in zip(names, tensors):
            check_finite(t, who, name)
    return all_finite(*tensors)


def _nan_unless(finite: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``loss`` where ``finite``, else NaN: the deferred refusal, read by the caller's check.

    The gradient still flows to ``loss`` when ``finite`` (``torch.where`` masks the other
    branch); a NaN input then cannot hide behind a finite loss.
    """
    return torch.where(finite, loss, torch.full_like(loss, float("nan")))


def _reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    """Reduce per-triplet losses (T,) without reading anything back to the host.

    mean_active divides by the number of non-zero losses (pytorch-metric-learning's
    AvgNonZeroReducer); zero losses add nothing to the sum, so sum / count is that mean.
    """
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.sum() / max(losses.shape[0], 1)
    active = (losses > 0).sum()
    return losses.sum() / active.clamp_min(1)


class TripletMarginLoss(nn.Module):
    """The triplet loss on given index triplets (FaceNet's, with pytorch-metric-learning's API).

    Args:
        margin: the margin m in ``max(0, d(a,p) - d(a,n) + m)``.
        distance: a name ("squared", "euclidean", "cosine", "seed_l2") or a callable
            ``f(x, y) -> (B, M)``.
        reduction: "mean_active" (mean over non-zero losses), "mean" or "sum".
        soft_margin: use ``softplus(d(a,p) - d(a,n) + m)`` instead of the hinge (set margin 0
            for the soft margin of Hermans et al. 2017).
        swap: use ``min(d(a,n), d(p,n))`` as the negative distance (Balntas et al. 2016).
        on_nonfinite: "defer" (a NaN loss when an embedding holds NaN or inf; no host read)
            or "raise" (a ``ValueError`` naming the rows); see the module docstring.

    After each call ``last_stats`` holds detached device tensors (no host sync):
    ``num_triplets``, ``active_fraction`` (share of non-zero losses), ``mean_dap``,
    ``mean_dan`` (mean d(a,p) and d(a,n), before any swap; 0 without triplets).
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
        self.reduction = _check_reduction(reduction, "TripletMarginLoss")
        self.soft_margin = bool(soft_margin)
        self.swap = bool(swap)
        self.on_nonfinite = check_on_nonfinite(on_nonfinite, "TripletMarginLoss")
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
        """The reduced loss, a scalar tensor connected to ``embeddings``.

        Args:
            embeddings: (B, D) embeddings from a forward with grad.
            triplets: (a, p, n) int index tensors, each (T,). ``a`` indexes ``embeddings``;
                ``p`` and ``n`` index ``ref_embeddings`` when given, else ``embeddings``. An
                index outside those rows is refused (a device-side assert).
            ref_embeddings: optional (M, D) embeddings holding positives and negatives.
        """
        who = type(self).__name__
        check_embeddings(embeddings, who)
        if ref_embeddings is not None:
            check_embeddings(ref_embeddings, who, "ref_embeddings")
        inputs = (embeddings,) if ref_embeddings is None else (embeddings, ref_embeddings)
        rows = (embeddings.shape[0], inputs[-1].shape[0])
        of = ("embeddings", "ref_embeddings" if ref_embeddings is not None else "embeddings")
        a, p, n = check_index_triplets(triplets, embeddings.device, who, rows=rows, of=of)
        finite = _check_inputs(self.on_nonfinite, who, *inputs)  # 0-dim bool
        if a.shape[0] == 0:
            loss = _nan_unless(finite, _connected_zero(*inputs))
            self._record(loss, None, None, None)
            return loss
        dist = self.distance(embeddings, ref_embeddings)  # (B, M)
        d_ap, d_an = dist[a, p], dist[a, n]  # (T,), (T,)
        d_neg = d_an
        if self.swap:
            ref_dist = dist if ref_embeddings is None else self.distance(ref_embeddings)  # (M, M)
            d_neg = torch.minimum(d_an, ref_dist[p, n])
        violation = d_ap - d_neg + self.margin  # (T,)
        losses = F.softplus(violation) if self.soft_margin else F.relu(violation)
        loss = _nan_unless(finite, _reduce(losses, self.reduction))
        self._record(loss, losses, d_ap, d_an)
        return loss

    def _record(self, loss, losses, d_ap, d_an) -> None:
        """Keep detached statistics of this call on the device."""
        device = loss.device
        if losses is None:
            zero = torch.zeros((), dtype=loss.dtype, device=device)
            self.last_stats = {
                "num_triplets": torch.zeros((), dtype=torch.int64, device=device),
                "active_fraction": zero,
                "mean_dap": zero.clone(),
                "mean_dan": zero.clone(),
            }
            return
        losses = losses.detach()
        self.last_stats = {
            "num_triplets": torch.full((), losses.shape[0], dtype=torch.int64, device=device),
            "active_fraction": (losses > 0).to(losses.dtype).mean(),
            "mean_dap": d_ap.detach().mean(),
            "mean_dan": d_an.detach().mean(),
        }


# --------------------------------------------------------------------------- batch-all


class _BatchAllTripletHinge(torch.autograd.Function):
    """Reduced loss over every valid triplet, from the (B, B) distance matrix.

    Forward walks anchor chunks and accumulates, besides the loss, ``dL/dD`` as a (B, B)
    matrix: a triplet (a, p, n) with loss derivative g adds g to D[a, p] and -g to D[a, n].
    Backward returns that matrix, so no per-chunk graph is kept.
    """

    @staticmethod
    def forward(ctx, dist, same, margin, reduction, soft_margin, chunk_size):
        batch_size = dist.shape[0]
        positive = same.clone()
        positive.fill_diagonal_(False)
        grad = torch.zeros_like(dist)  # (B, B) d(sum of losses)/dD
        total = dist.new_zeros(())
        num_active = torch.zeros((), dtype=torch.int64, device=dist.device)
        num_valid = torch.zeros((), dtype=torch.int64, device=dist.device)
        for start in range(0, batch_size, chunk_size):
            rows = slice(start, min(start + chunk_size, batch_size))
            pair_a, pair_p = positive[rows].nonzero(as_tuple=True)  # (c,), anchors chunk-local
            if pair_a.shape[0] == 0:
                continue
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
        if reduction == "mean_active":
            scale = 1.0 / num_active.clamp_min(1).to(dist.dtype)
        elif reduction == "mean":
            scale = 1.0 / num_valid.clamp_min(1).to(dist.dtype)
        else:
            scale = torch.ones((), dtype=dist.dtype, device=dist.device)
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
    """The triplet loss over every valid triplet of a labelled batch ("batch all").

    Equal to ``TripletMarginLoss`` on all (a, p, n) with label[a] == label[p], a != p,
    label[n] != label[a], without listing them. Memory is O(B^2): the distance matrix, its
    gradient, and per chunk (positives of ``chunk_size`` anchors) x B working space.

    Args:
        embeddings: (B, D) embeddings from a forward with grad.
        labels: (B,) identity labels.
        margin: the margin m.
        distance: a name ("squared", "euclidean", "cosine", "seed_l2") or a callable.
        reduction: "mean_active", "mean" or "sum".
        chunk_size: anchors per chunk.
        soft_margin: softplus instead of the hinge.
        on_nonfinite: "defer" (NaN when an embedding holds NaN or inf; no host read) or
            "raise" (a ``ValueError`` naming the rows); see the module docstring.

    Returns:
        A scalar tensor connected to ``embeddings`` (zero with a zero gradient when the batch
        has no valid triplet; NaN when an embedding is not finite, under "defer").
    """
    who = "batch_all_triplet_loss"
    check_embeddings(embeddings, who)
    _check_reduction(reduction, who)
    check_on_nonfinite(on_nonfinite, who)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{who}: chunk_size must be an int >= 1, got {chunk_size!r}")
    labels = check_labels(labels, embeddings, who)  # (B,)
    if embeddings.shape[0] == 0:
        return _connected_zero(embeddings)
    finite = _check_inputs(on_nonfinite, who, embeddings)  # 0-dim bool
    dist = get_distance(distance)(embeddings)  # (B, B)
    same = labels[:, None] == labels[None, :]  # (B, B)
    loss = _BatchAllTripletHinge.apply(
        dist, same, float(margin), reduction, bool(soft_margin), chunk_size
    )
    return _nan_unless(finite, loss)


def build_loss(cfg: LossConfig) -> TripletMarginLoss:
    """The triplet loss a :class:`facenet.config.LossConfig` describes.

    Args:
        cfg: ``margin``, ``distance``, ``reduction``, ``soft_margin``, ``swap``
            (``ce_weight`` belongs to the model's classifier head, not to this loss).

    Non-finite embeddings are deferred to the Trainer's check of the loss (a NaN loss).
    """
    return TripletMarginLoss(
        margin=cfg.margin,
        distance=cfg.distance,
        reduction=cfg.reduction,
        soft_margin=cfg.soft_margin,
        swap=cfg.swap,
        on_nonfinite="defer",
    )
