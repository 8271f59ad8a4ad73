"""The triplet loss over every valid triplet of a labelled batch ("batch all"), without listing
the triplets: O(B^2) memory kept where autograd through chunks would keep O(B^3 / identities),
and no host sync (its blocks' shapes do not depend on the labels' values)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from facenet.metric.checks import ON_NONFINITE, check_choice, check_count, check_labels, finite_flag
from facenet.metric.distances import DistanceLike, get_distance
from facenet.metric.losses import REDUCTIONS
from facenet.metric.miners import identity_masks


class _BatchAllTripletHinge(torch.autograd.Function):
    """Reduced loss over every valid triplet of a (B, B) distance matrix D.

    Forward walks anchor chunks, each a dense (c, B, B) block of (anchor, positive, negative)
    (shapes known without reading the labels back: no host sync), and accumulates ``dL/dD``:
    a triplet (a, p, n) with loss derivative g adds g to D[a, p] and -g to D[a, n]; backward
    returns it, no graph kept.
    """

    @staticmethod
    def forward(ctx, dist, labels, margin, reduction, soft_margin, chunk_size):
        same, positive = identity_masks(labels)  # (B, B) each
        grad = torch.zeros_like(dist)  # (B, B) d(sum of losses)/dD
        total = dist.new_zeros(())
        num_active = dist.new_zeros((), dtype=torch.int64)
        num_valid = dist.new_zeros((), dtype=torch.int64)
        for start in range(0, dist.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            d = dist[rows]  # (c, B) the chunk's anchors' distances
            valid = positive[rows, :, None] & ~same[rows, None, :]  # (c, B, B): [a, p, n]
            # violation[a, p, n] = d(a, p) - d(a, n) + m, -inf off the valid triplets
            violation = (d[:, :, None] - d[:, None, :] + margin).masked_fill(~valid, float("-inf"))
            if soft_margin:
                losses = F.softplus(violation)
                slope = torch.sigmoid(violation)  # 0 at -inf
            else:
                losses = F.relu(violation)
                slope = (violation > 0).to(dist.dtype)
            total = total + losses.sum()
            num_active += (losses > 0).sum()
            num_valid += valid.sum()
            grad[rows] += slope.sum(2) - slope.sum(1)  # + on each d(a,p), - on each d(a,n)
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
    chunk_size: int = 32,
    soft_margin: bool = False,
    on_nonfinite: str = "defer",
) -> torch.Tensor:
    """``TripletMarginLoss`` over every valid triplet of a labelled (B, D) batch, with
    ``chunk_size`` anchors per chunk of working space (a few ``chunk_size`` x B x B blocks)."""
    who = "batch_all_triplet_loss"
    finite = finite_flag(on_nonfinite, who, embeddings)  # 0-dim bool
    check_choice(reduction, REDUCTIONS, who, "reduction")
    check_choice(on_nonfinite, ON_NONFINITE, who, "on_nonfinite")
    check_count(chunk_size, 1, who, "chunk_size")
    labels = check_labels(labels, embeddings, who)  # (B,)
    dist = get_distance(distance)(embeddings)  # (B, B)
    loss = _BatchAllTripletHinge.apply(
        dist, labels, float(margin), reduction, bool(soft_margin), chunk_size
    )
    return torch.where(finite, loss, float("nan"))
