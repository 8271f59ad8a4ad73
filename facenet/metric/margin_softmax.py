"""The margin softmax of a cosine classifier: CosFace's or ArcFace's cross-entropy on (N, C)
cosines, the ``loss.ce`` that a run adds to the triplet loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from facenet.metric.checks import check_choice

# Margins of the papers and of insightface's arcface_torch: CosFace's on the cosine, ArcFace's
# on the angle (radians).
MARGINS = {"cosface": 0.35, "arcface": 0.5}
CROSS_ENTROPIES = ("softmax", *MARGINS)  # loss.ce: plain (a linear classifier's), or a margin


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
