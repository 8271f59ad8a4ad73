"""Metric learning for any training loop: distances, triplet miners and losses.

``triplets = miner(embeddings.detach(), labels); loss = loss_fn(embeddings, triplets)``. The
core is FaceNet's: :mod:`~facenet.metric.distances`, the semi-hard miner in
:mod:`~facenet.metric.miners`, the triplet loss in :mod:`~facenet.metric.losses` and the input
checks in :mod:`~facenet.metric.checks`; the other miners and losses have a module each.

Here: the objects a run's configuration names (``mining`` and ``loss`` sections). A miner or
loss that a default run does not use is imported when a configuration names it, so a run loads
only the modules it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from facenet.metric.checks import check_choice
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import Miner, SemiHardNegativeMiner
from facenet.registry import load

if TYPE_CHECKING:
    from facenet.config import LossConfig, MiningConfig
    from facenet.metric.margin_softmax import MarginSoftmaxLoss

MINERS = ("semihard", "batch_hard", "triplet_margin")  # mining.miner


def build_miner(cfg: MiningConfig, generator: torch.Generator | None = None) -> Miner:
    """The miner ``cfg`` describes (non-finite embeddings deferred to the Trainer)."""
    common = dict(distance=cfg.distance, max_triplets=cfg.max_triplets, generator=generator)
    miner = check_choice(cfg.miner, MINERS, "mining.miner", "miner")
    if miner == "semihard":
        return SemiHardNegativeMiner(cfg.margin, fallback=cfg.fallback, **common)
    if miner == "triplet_margin":
        return load("facenet.metric.triplet_margin_miner:TripletMarginMiner")(
            cfg.margin, cfg.type_of_triplets, strict_margin=cfg.strict_margin, **common
        )
    return load("facenet.metric.batch_hard_miner:BatchHardMiner")(**common)


def build_loss(cfg: LossConfig) -> TripletMarginLoss:
    """The triplet loss ``cfg`` describes (its ``ce_weight`` is the model's classifier's)."""
    return TripletMarginLoss(cfg.margin, cfg.distance, cfg.reduction, cfg.soft_margin, cfg.swap)


def build_margin_loss(cfg: LossConfig) -> MarginSoftmaxLoss | None:
    """The margin softmax of ``loss.ce`` (for a cosine classifier), or None for plain
    cross-entropy on a linear classifier's logits."""
    if cfg.ce == "softmax":
        return None
    return load("facenet.metric.margin_softmax:MarginSoftmaxLoss")(
        cfg.ce, cfg.ce_scale, cfg.ce_margin
    )
