"""The embedding network: a backbone, an embedding head and an optional classifier head.

``EmbeddingNet(x)`` returns L2-normalised embeddings (B, D). ``EmbeddingNet(x,
return_logits=True)`` returns ``(embeddings, logits)`` from ONE pass through the backbone, so
a triplet loss and a cross-entropy term share one graph (the seed ran the network again for
the classifier, on images it had already embedded).

Backbones: ``tiny`` (a small CNN for CPU demos and tests), torchvision ``resnet18``,
``resnet34``, ``resnet50`` and ``mobilenet_v3_large`` (always built with ``weights=None``:
nothing is downloaded), ``inception_resnet_v1`` (the FaceNet ports' network, 160 x 160
input) and ``mobilefacenet`` (MobileFaceNet, 112 x 96 input). Initial backbone weights may
come from a local state-dict file. See docs/models.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from facenet.checkpoint import load_weights_only
from facenet.errors import WeightsError
from facenet.models.backbones import (
    FACENET_PYTORCH_HEAD_KEYS,
    MOBILEFACENET_HEAD_KEYS,
    MOBILEFACENET_MARKER,
    InceptionResnetV1,
    MobileFaceNet,
    TinyCNN,
    convert_facenet_pytorch_state_dict,
    convert_mobilefacenet_state_dict,
)
from facenet.sizes import ImageSize, image_hw

if TYPE_CHECKING:
    from facenet.config import ModelConfig

__all__ = [
    "BACKBONES",
    "EmbeddingHead",
    "EmbeddingNet",
    "build_backbone",
    "build_model",
    "convert_facenet_pytorch_state_dict",
    "count_parameters",
    "load_backbone_weights",
]

# The embedding BatchNorm uses FaceNet's epsilon, so heads converted from its ports match;
# a backbone whose published head used another one says so in its spec (_BackboneSpec).
HEAD_BN_EPS = 1e-3
# mobilefacenet without an input size: the published CASIA-WebFace weights' 112 x 96 (H x W).
MOBILEFACENET_DEFAULT_SIZE = (112, 96)


# --------------------------------------------------------------------------- backbones


def _conv_with_in_channels(conv: nn.Conv2d, in_channels: int) -> nn.Conv2d:
    """A fresh copy of ``conv``'s configuration that reads ``in_channels`` channels."""
    return nn.Conv2d(
        in_channels,
        conv.out_channels,
        conv.kernel_size,
        conv.stride,
        conv.padding,
        bias=conv.bias is not None,
    )


def _resnet(name: str, in_channels: int, input_size: ImageSize | None) -> tuple[nn.Module, int]:
    model = torchvision.models.get_model(name, weights=None)
    feature_dim = model.fc.in_features  # 512 (resnet18/34) or 2048 (resnet50)
    model.fc = nn.Identity()  # forward now ends at the pooled, flattened features
    if in_channels != 3:
        model.conv1 = _conv_with_in_channels(model.conv1, in_channels)
    return model, feature_dim


def _mobilenet_v3_large(in_channels: int, input_size: ImageSize | None) -> tuple[nn.Module, int]:
    model = torchvision.models.mobilenet_v3_large(weights=None)
    feature_dim = model.classifier[0].in_features  # 960
    model.classifier = nn.Identity()
    if in_channels != 3:
        model.features[0][0] = _conv_with_in_channels(model.features[0][0], in_channels)
    return model, feature_dim


def _tiny(in_channels: int, input_size: ImageSize | None) -> tuple[nn.Module, int]:
    model = TinyCNN(in_channels)
    return model, model.feature_dim


def _inception_resnet_v1(in_channels: int, input_size: ImageSize | None) -> tuple[nn.Module, int]:
    model = InceptionResnetV1(in_channels)
    return model, model.feature_dim


def _mobilefacenet(in_channels: int, input_size: ImageSize | None) -> tuple[nn.Module, int]:
    # The GDC kernel is the last map's size, so the network is built for one input size;
    # without one, 112 x 96 (H x W): the published weights' input (a 7 x 6 kernel).
    model = MobileFaceNet(in_channels, input_size=input_size or MOBILEFACENET_DEFAULT_SIZE)
    return model, model.feature_dim


@dataclass(frozen=True)
class _BackboneSpec:
    # (in_channels, input_size or None) -> (backbone, F); the pooled backbones ignore the size
    build: Callable[[int, ImageSize | None], tuple[nn.Module, int]]
    # Key prefixes of the source model's own head (ImageNet classifier, a port's embedding
    # layers): present in the usual weight files, dropped when loading backbone weights.
    source_head_keys: tuple[str, ...] = ()
    # The embedding BatchNorm's epsilon: the one the source model's own head used, so its
    # published head loads with the same outputs (MobileFaceNet's BatchNorm2d: 1e-5).
    head_bn_eps: float = HEAD_BN_EPS


_SPECS: dict[str, _BackboneSpec] = {
    "tiny": _BackboneSpec(_tiny),
    "resnet18": _BackboneSpec(lambda c, size: _resnet("resnet18", c, size), ("fc.",)),
    "resnet34": _BackboneSpec(lambda c, size: _resnet("resnet34", c, size), ("fc.",)),
    "resnet50": _BackboneSpec(lambda c, size: _resnet("resnet50", c, size), ("fc.",)),
    "mobilenet_v3_large": _BackboneSpec(_mobilenet_v3_large, ("classifier.",)),
    "inception_resnet_v1": _BackboneSpec(_inception_resnet_v1, FACENET_PYTORCH_HEAD_KEYS),
    "mobilefacenet": _BackboneSpec(_mobilefacenet, MOBILEFACENET_HEAD_KEYS, head_bn_eps=1e-5),
}

BACKBONES: tuple[str, ...] = tuple(_SPECS)


def _spec(name: str) -> _BackboneSpec:
    if name not in _SPECS:
        raise ValueError(f"unknown backbone {name!r}; valid backbones: {', '.join(BACKBONES)}")
    return _SPECS[name]


def build_backbone(
    name: str, in_channels: int = 3, input_size: ImageSize | None = None
) -> tuple[nn.Module, int]:
    """Build a backbone that maps images (B, C, H, W) to pooled features (B, F).

    Args:
        name: one of :data:`BACKBONES`.
        in_channels: image channels C.
        input_size: (H, W) or S, the input the network is built for: only backbones whose
            layers depend on it (mobilefacenet's global depthwise kernel) read it; None: their
            default (mobilefacenet: 112 x 96).

    Returns:
        ``(backbone, F)``, randomly initialised (never downloaded).
    """
    return _spec(name).build(in_channels, input_size)


# --------------------------------------------------------------------------- weights


def _read_weights_file(path: str | os.PathLike) -> object:
    """The contents of a weights file: the one ``weights_only`` loader of torch files."""
    return load_weights_only(path, what="weights file", error=WeightsError)


def _unwrap_state_dict(obj: object, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict in ``obj``: the object itself, or a checkpoint's "model"/"state_dict"."""
    if isinstance(obj, Mapping) and not all(torch.is_tensor(v) for v in obj.values()):
        # "net_state_dict": Xiaoccer/MobileFaceNet_Pytorch's .ckpt files (with their "epoch").
        for key in ("model", "state_dict", "net_state_dict"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()
    ):
        raise WeightsError(
            f"weights file {path}: expected a state dict (a mapping of parameter names to "
            f"tensors), or a checkpoint holding one under 'model' or 'state_dict'"
        )
    return dict(obj)


def _backbone_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys of a whole EmbeddingNet state dict ("backbone." prefix) reduced to the backbone's."""
    prefix = "backbone."
    if not any(k.startswith(prefix) for k in state):
        return state
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _list_keys(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _check_fits(module: nn.Module, state: dict[str, torch.Tensor], path, what: str) -> None:
    """Raise a WeightsError naming missing/unexpected keys and shape mismatches, if any."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k}: file {tuple(state[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {_list_keys(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_list_keys(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_list_keys(mismatched)}")
    if problems:
        raise WeightsError(f"weights file {path} does not fit {what}: " + "; ".join(problems))


def load_backbone_weights(backbone: nn.Module, path: str | os.PathLike, name: str) -> None:
    """Load a local state-dict file into ``backbone`` (``torch.load(weights_only=True)``).

    The file may hold the backbone's own state dict (e.g. a torchvision or facenet-pytorch
    file: keys of the source model's head, such as ``fc.*``, are ignored), a whole
    EmbeddingNet state dict (its ``backbone.*`` keys are used), or a checkpoint holding either
    under ``"model"`` or ``"state_dict"``. Every backbone key must be present, with its shape.

    Args:
        backbone: the module built by :func:`build_backbone` for ``name``.
        path: the weights file.
        name: the backbone's name, for the source-head keys and error messages.

    Raises:
        WeightsError: the file is missing, unreadable, not a state dict, or its keys or
            shapes do not fit (missing and unexpected keys are named).
    """
    _load_backbone_state(backbone, _unwrap_state_dict(_read_weights_file(path), path), path, name)


def _ours(state: dict) -> dict:
    """A published layout that names its modules otherwise, mapped onto EmbeddingNet keys."""
    if MOBILEFACENET_MARKER in state:  # Xiaoccer/MobileFaceNet_Pytorch's net_state_dict
        return convert_mobilefacenet_state_dict(state)
    return state


def _load_backbone_state(backbone: nn.Module, state: dict, path, name: str) -> None:
    state = _backbone_keys(_ours(state))
    head_keys = _spec(name).source_head_keys
    state = {k: v for k, v in state.items() if not k.startswith(head_keys)}
    _check_fits(backbone, state, path, f"backbone {name!r}")
    backbone.load_state_dict(state)


def _load_head_state(head: nn.Module, state: dict, path) -> None:
    """The embedding head's weights: a facenet-pytorch file's last_linear/last_bn, or ours."""
    if "last_linear.weight" in state:  # the port's layout: map it onto EmbeddingNet keys
        state = convert_facenet_pytorch_state_dict(state)
    state = _ours(state)
    prefix = "embedding."
    head_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    if not head_state:
        raise WeightsError(
            f"weights file {path} holds no embedding head (last_linear.*/last_bn.* or "
            "embedding.*); set model.weights_head: false to start the head afresh"
        )
    _check_fits(head, head_state, path, "the embedding head (model.embedding_dim)")
    head.load_state_dict(head_state)


# --------------------------------------------------------------------------- the network


def _l2_normalize(z: torch.Tensor) -> torch.Tensor:
    # In at least float32: under bf16/fp16 autocast the norms and the distances computed from
    # them would otherwise carry 3-digit precision.
    return F.normalize(z.to(torch.promote_types(z.dtype, torch.float32)), p=2, dim=1)


class EmbeddingHead(nn.Module):
    """Pooled features (B, F) -> dropout -> Linear(F, D, no bias) -> BatchNorm1d(D) -> L2 norm.

    Args:
        in_features: F, the backbone's feature size.
        embedding_dim: D.
        dropout: dropout probability on the features (0 turns it off).
        bn_eps: the BatchNorm's epsilon (FaceNet's 1e-3 unless the backbone's source used
            another).
    """

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


def _check_positive_int(value, what: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EmbeddingNet: {what} must be a positive integer, got {value!r}")


class EmbeddingNet(nn.Module):
    """Backbone -> embedding head (-> classifier): images (B, C, H, W) to embeddings (B, D).

    Attributes: ``backbone`` (images -> pooled features (B, F)), ``embedding``
    (:class:`EmbeddingHead`), ``classifier`` (``nn.Linear(D, num_classes)`` or None),
    ``feature_dim`` (F), ``embed_dim`` (D), ``backbone_name``.

    The classifier reads the embedding before L2 normalisation (FaceNet's "prelogits"): unit
    vectors would bound every logit by the norm of its weight row, which slows cross-entropy
    training; and it is the layout of the ports' ``logits`` layer.

    Args:
        backbone: one of :data:`BACKBONES`.
        embedding_dim: D.
        num_classes: adds a classifier head with this many classes; None for none.
        dropout: dropout probability on the pooled features, before the embedding layer.
        weights: a local state-dict file for the backbone (see :func:`load_backbone_weights`).
        in_channels: image channels.
        weights_head: also load the embedding head from ``weights`` (a facenet-pytorch file's
            ``last_linear``/``last_bn``, or an EmbeddingNet's ``embedding.*``); its size must
            be ``embedding_dim``.
        input_size: the input (H, W) or S, for backbones built for one size (mobilefacenet);
            None: the backbone's default.
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
        _check_positive_int(embedding_dim, "embedding_dim")
        _check_positive_int(num_classes, "num_classes", allow_none=True)
        _check_positive_int(in_channels, "in_channels")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"EmbeddingNet: dropout must be in [0, 1), got {dropout!r}")
        self.backbone_name = backbone
        if weights_head and weights is None:
            raise ValueError("EmbeddingNet: weights_head=True needs a weights file")
        self.backbone, self.feature_dim = build_backbone(backbone, in_channels, input_size)
        self.embed_dim = embedding_dim
        self.embedding = EmbeddingHead(
            self.feature_dim, embedding_dim, dropout, bn_eps=_spec(backbone).head_bn_eps
        )
        self.classifier = nn.Linear(embedding_dim, num_classes) if num_classes else None
        if weights is not None:  # the file is read once for the backbone and the head
            state = _unwrap_state_dict(_read_weights_file(weights), weights)
            _load_backbone_state(self.backbone, state, weights, backbone)
            if weights_head:
                _load_head_state(self.embedding, state, weights)

    def forward(self, x: torch.Tensor, return_logits: bool = False):
        """Embed a batch of images.

        Args:
            x: images (B, C, H, W).
            return_logits: also return class logits (B, num_classes), from the same backbone
                pass; needs a model built with ``num_classes``.

        Returns:
            embeddings (B, D) with unit L2 norm, or ``(embeddings, logits)``.
        """
        if return_logits and self.classifier is None:
            raise ValueError(
                "EmbeddingNet: return_logits=True needs a classifier head; build the model "
                "with num_classes=N (in a run: loss.ce_weight > 0)"
            )
        features = self.backbone(x)  # (B, F)
        prelogits = self.embedding.prelogits(features)  # (B, D)
        embeddings = _l2_normalize(prelogits)  # (B, D), unit norm
        if not return_logits:
            return embeddings
        return embeddings, self.classifier(prelogits)  # (B, D), (B, num_classes)


def build_model(
    cfg: ModelConfig, num_classes: int | None = None, image_size: ImageSize | None = None
) -> EmbeddingNet:
    """Build the :class:`EmbeddingNet` a run configuration describes.

    Args:
        cfg: the ``model`` section (backbone, embedding_dim, dropout, weights, weights_head,
            channels_last).
        num_classes: adds a classifier head (for a cross-entropy term); None for none.
        image_size: ``data.image_size`` (S or [H, W]): the input a size-bound backbone
            (mobilefacenet) is built for; None: its default.
    """
    model = EmbeddingNet(
        backbone=cfg.backbone,
        embedding_dim=cfg.embedding_dim,
        num_classes=num_classes,
        dropout=cfg.dropout,
        weights=cfg.weights,
        weights_head=cfg.weights_head,
        input_size=None if image_size is None else image_hw(image_size),
    )
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """The number of parameter elements in ``model``.

    Args:
        model: any module.
        trainable_only: count only parameters with ``requires_grad``.
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
