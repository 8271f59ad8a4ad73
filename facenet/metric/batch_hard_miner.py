"""The batch-hard miner: each anchor's farthest positive and nearest negative (Hermans, Beyer,
Leibe 2017, "In Defense of the Triplet Loss"; pytorch-metric-learning's ``BatchHardMiner``)."""

from __future__ import annotations

import torch

from facenet.metric.miners import Miner, Triplets, candidate_distances, identity_masks


class BatchHardMiner(Miner):
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
        d_ap, d_an = candidate_distances(embeddings, candidates, self.distance)
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
        return candidates.subset(keep & ~violation.isnan() & finite)
