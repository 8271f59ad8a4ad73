"""The backbones an :class:`~facenet.models.embedding.EmbeddingNet` is built on, by name: the
tiny CNN, torchvision's classifiers (random weights, nothing downloaded) and, as entries of a
wing loaded only when a run names them, the publishers' networks.
"""

from __future__ import annotations

from functools import partial

import torchvision
from torch import nn

from facenet.models.tiny import TinyCNN
from facenet.registry import load
from facenet.sizes import ImageSize

# torchvision backbones: their classifier (replaced by nn.Identity; its keys are dropped from
# weight files) and their first convolution (replaced to read other than 3 channels).
_TORCHVISION = {
    **dict.fromkeys(("resnet18", "resnet34", "resnet50"), ("fc", "conv1")),
    "mobilenet_v3_large": ("classifier", "features.0.0"),
}


def _torchvision(name: str, in_channels: int, input_size: ImageSize | None) -> nn.Module:
    """A torchvision classifier with random weights, ending at its pooled features."""
    model = torchvision.models.get_model(name, weights=None)
    head, stem = _TORCHVISION[name]
    linear = next(m for m in getattr(model, head).modules() if isinstance(m, nn.Linear))
    model.feature_dim = linear.in_features  # 512 (resnet18/34), 2048 (resnet50), 960
    setattr(model, head, nn.Identity())
    model.source_head_keys = (f"{head}.",)
    if in_channels != 3:
        conv = model.get_submodule(stem)
        parent, _, leaf = stem.rpartition(".")
        new = nn.Conv2d(
            in_channels,
            conv.out_channels,
            conv.kernel_size,
            conv.stride,
            conv.padding,
            bias=conv.bias is not None,
        )
        setattr(model.get_submodule(parent), leaf, new)
    return model


# (C, input size or None) -> a module with its feature size F as ``feature_dim``; a backbone
# may also name ``source_head_keys`` (dropped when loading its weights) and ``head_bn_eps`` (its
# source's, so a published head loads with the same outputs).
_PUBLISHED = "facenet.wings.publishers."
_BUILDERS = {
    "tiny": lambda c, size: TinyCNN(c),
    **{name: partial(_torchvision, name) for name in _TORCHVISION},
    # the publishers' networks: a wing, loaded when a run names one
    "inception_resnet_v1": lambda c, size: load(
        _PUBLISHED + "inception_resnet_v1:InceptionResnetV1"
    )(c),
    "mobilefacenet": lambda c, size: load(_PUBLISHED + "mobilefacenet:MobileFaceNet")(c, size),
}
BACKBONES = tuple(_BUILDERS)


def build_backbone(name: str, in_channels: int, input_size: ImageSize | None) -> nn.Module:
    """The backbone ``name`` (one of :data:`BACKBONES`) with random weights."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown backbone {name!r}; valid backbones: {', '.join(BACKBONES)}")
    return _BUILDERS[name](in_channels, input_size)
