"""The embedding network: a backbone, an embedding head and an optional classifier head.

``EmbeddingNet(x, return_logits=True)`` returns ``(embeddings, logits)`` from one backbone
pass, so a triplet loss and a cross-entropy term share one graph. Backbones are built with
random weights (nothing is downloaded); initial weights may come from a local state-dict file,
in our layout or a publisher's. See docs/models.md.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from facenet.models.backbones import build_backbone
from facenet.registry import load
from facenet.sizes import ImageSize

if TYPE_CHECKING:
    from facenet.config import ModelConfig


# Initial weights from a file (fine-tuning), in our layout or a publisher's: loaded when asked.
_LOAD_WEIGHTS = "facenet.models.weights:load_weights"
HEAD_BN_EPS = 1e-3  # FaceNet's, so heads converted from its ports give the same outputs


# --------------------------------------------------------------------------- the network


def _l2_normalize(z: torch.Tensor) -> torch.Tensor:
    # In at least float32: under bf16/fp16 autocast the norms would carry 3-digit precision.
    return F.normalize(z.to(torch.promote_types(z.dtype, torch.float32)), p=2, dim=1)


class EmbeddingHead(nn.Module):
    """Pooled features (B, F) -> dropout -> Linear(F, D, no bias) -> BatchNorm1d(D) -> L2 norm."""

    def __init__(
        self,
        in_features: int,
        embedding_dim: int,
        dropout: float = 0.0,
        bn_eps: float = HEAD_BN_EPS,
    ):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(in_features, embedding_dim, bias=False)
        self.bn = nn.BatchNorm1d(embedding_dim, eps=bn_eps)

    def prelogits(self, features: torch.Tensor) -> torch.Tensor:
        """(B, F) -> (B, D), before L2 normalisation (what the classifier reads)."""
        return self.bn(self.linear(self.dropout(features)))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(B, F) -> unit-norm embeddings (B, D), in at least float32."""
        return _l2_normalize(self.prelogits(features))


class CosineClassifier(nn.Linear):
    """(B, D) -> (B, C) cosines between the unit input and each unit weight row, read by the
    margin softmax it holds as ``loss`` ((B, C) cosines, (B,) labels -> (B,) losses): the
    layer and the loss that reads its cosines travel together, as in insightface's PartialFC."""

    def __init__(self, in_features: int, num_classes: int, loss: nn.Module):
        super().__init__(in_features, num_classes, bias=False)
        self.loss = loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_l2_normalize(x), F.normalize(self.weight, dim=1))


class EmbeddingNet(nn.Module):
    """Backbone (B, C, H, W) -> (B, F) -> embedding head (B, D) (-> classifier).

    The classifier reads the embedding before L2 normalisation (FaceNet's "prelogits"): unit
    vectors would bound every logit by its weight row's norm, which slows cross-entropy
    training; it is also the ports' ``logits`` layout. A :class:`CosineClassifier` put in its
    place (``build_model``'s ``margin_loss``) returns cosines instead.

    Args:
        weights: a local state-dict file (``torch.load(weights_only=True)``) for the backbone:
            its own state dict (its source's head keys, such as ``fc.*``, ignored), an
            EmbeddingNet's or a publisher's, or a checkpoint holding one under "model" or
            "state_dict".
        weights_head: also load the embedding head from ``weights`` (ours or a publisher's).
        input_size: S or (H, W), for backbones built for one size (mobilefacenet's global
            depthwise kernel depends on it; None: 112 x 96).
    """

    def __init__(
        self,
        backbone: str = "tiny",
        embedding_dim: int = 128,
        num_classes: int | None = None,
        dropout: float = 0.0,
        weights: str | os.PathLike | None = None,
        in_channels: int = 3,
        weights_head: bool = False,
        input_size: ImageSize | None = None,
    ):
        super().__init__()
        sizes = {"embedding_dim": embedding_dim, "in_channels": in_channels}
        sizes["num_classes"] = 1 if num_classes is None else num_classes
        for what, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EmbeddingNet: {what} must be a positive integer, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"EmbeddingNet: dropout must be in [0, 1), got {dropout!r}")
        self.backbone_name = backbone
        # images (B, C, H, W) -> pooled features (B, F), random weights
        self.backbone = build_backbone(backbone, in_channels, input_size)
        self.feature_dim, self.embed_dim = self.backbone.feature_dim, embedding_dim
        eps = getattr(self.backbone, "head_bn_eps", HEAD_BN_EPS)
        self.embedding = EmbeddingHead(self.feature_dim, embedding_dim, dropout, eps)
        self.classifier = nn.Linear(embedding_dim, num_classes) if num_classes else None
        if weights is not None or weights_head:
            load(_LOAD_WEIGHTS)(self, weights, weights_head)

    def forward(self, x: torch.Tensor, return_logits: bool = False):
        """Images (B, C, H, W) -> unit embeddings (B, D), or ``(embeddings, logits)`` with
        logits (B, num_classes) from the same backbone pass."""
        if return_logits and self.classifier is None:  # before the backbone's cost
            raise ValueError(
                "EmbeddingNet: return_logits=True needs a classifier head; build the model "
                "with num_classes=N (in a run: loss.ce_weight > 0)"
            )
        return self.from_features(self.backbone(x), return_logits)

    def from_features(self, features: torch.Tensor, return_logits: bool = False):
        """The backbone's (B, F) features -> what :meth:`forward` returns."""
        prelogits = self.embedding.prelogits(features)  # (B, D)
        embeddings = _l2_normalize(prelogits)  # (B, D), unit norm
        if not return_logits:
            return embeddings
        return embeddings, self.classifier(prelogits)  # (B, D), (B, num_classes)


def build_model(
    cfg: ModelConfig,
    num_classes: int | None = None,
    image_size: ImageSize | None = None,
    margin_loss: nn.Module | None = None,
) -> EmbeddingNet:
    """The :class:`EmbeddingNet` of a run's ``model`` section, built for ``data.image_size``
    (read by size-bound backbones); with ``margin_loss`` (``loss.ce``'s margin softmax) its
    classifier is a :class:`CosineClassifier` holding it."""
    model = EmbeddingNet(
        backbone=cfg.backbone,
        embedding_dim=cfg.embedding_dim,
        num_classes=num_classes,
        dropout=cfg.dropout,
        weights=cfg.weights,
        weights_head=cfg.weights_head,
        input_size=image_size,
    )
    if num_classes and margin_loss is not None:
        model.classifier = CosineClassifier(cfg.embedding_dim, num_classes, margin_loss)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameter elements in ``model`` (``trainable_only``: those with ``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
