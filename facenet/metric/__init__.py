"""Metric learning: distances, triplet miners and losses, for any training loop.

``triplets = miner(embeddings.detach(), labels); loss = loss_fn(embeddings, triplets)``.
"""

from facenet.metric.distances import (
    DISTANCE_NAMES,
    Distance,
    get_distance,
    paired_distance,
    pairwise_distance,
)
from facenet.metric.losses import (
    MarginSoftmaxLoss,
    TripletMarginLoss,
    batch_all_triplet_loss,
    build_loss,
    build_margin_loss,
)
from facenet.metric.miners import (
    BatchHardMiner,
    SemiHardNegativeMiner,
    TripletMarginMiner,
    Triplets,
    build_miner,
)

__all__ = [
    "DISTANCE_NAMES",
    "BatchHardMiner",
    "Distance",
    "MarginSoftmaxLoss",
    "SemiHardNegativeMiner",
    "TripletMarginLoss",
    "TripletMarginMiner",
    "Triplets",
    "batch_all_triplet_loss",
    "build_loss",
    "build_margin_loss",
    "build_miner",
    "get_distance",
    "paired_distance",
    "pairwise_distance",
]
