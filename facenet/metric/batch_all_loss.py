"""The triplet loss over every valid triplet of a labelled batch ("batch all"), without listing
the triplets: O(B^2) memory where autograd through chunks would keep O(B^3 / identities)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from facenet.metric.checks import ON_NONFINITE, check_choice, check_count, check_labels, finite_flag
from facenet.metric.distances import DistanceLike, get_distance
from facenet.metric.losses import REDUCTIONS
from facenet.metric.miners import identity_masks


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
    """``TripletMarginLoss`` over every valid triplet of a labelled (B, D) batch, with
    ``chunk_size`` anchors per chunk of working space."""
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
