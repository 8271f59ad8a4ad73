"""Inception-ResNet-v1 (Szegedy et al., 2016), the backbone of FaceNet's ports, for 160 x 160 crops.

Module names follow the facenet-pytorch port (``conv2d_1a`` ... ``block8``), so the backbone's
state-dict keys are that port's keys without its head; :func:`convert_facenet_pytorch_state_dict`
maps a whole port state dict (head included) onto :class:`facenet.models.embedding.EmbeddingNet`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from functools import partial

import torch
from torch import nn

BN_EPS = 1e-3  # the TensorFlow original's, so converted weights give the same outputs
_PORT_HEAD_TO_EMBEDDING_NET = {
    "last_linear": "embedding.linear",
    "last_bn": "embedding.bn",
    "logits": "classifier",
}


class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm -> ReLU, named ``conv`` and ``bn`` as in the port."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=BN_EPS)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class Branches(nn.Module):
    """Parallel branches ``branch0``, ``branch1``, ... concatenated on channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.num_branches = len(branches)
        for i, branch in enumerate(branches):
            self.add_module(f"branch{i}", branch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, f"branch{i}")(x) for i in range(self.num_branches)], 1)


class ResidualBlock(Branches):
    """An Inception-ResNet block: ``relu(x + scale * conv2d(concat(branches(x))))``; the last
    block (``block8``) has no ReLU."""

    def __init__(self, channels, branches, branch_channels, scale, activate=True):
        super().__init__(*branches)
        self.scale = scale
        self.conv2d = nn.Conv2d(branch_channels, channels, kernel_size=1)
        self.relu = nn.ReLU() if activate else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(x + self.scale * self.conv2d(super().forward(x)))


def _residual_block(channels, width, branches, scale, activate=True) -> ResidualBlock:
    """An Inception-ResNet block whose branches each start with a 1x1 convolution to ``width``
    channels, followed by same-size convolutions of the kernels (kh, kw) ``branches`` lists."""

    def branch(kernels):
        layers = [BasicConv2d(channels, width, 1)]
        layers += [BasicConv2d(width, width, k, padding=(k[0] // 2, k[1] // 2)) for k in kernels]
        return layers[0] if len(layers) == 1 else nn.Sequential(*layers)

    return ResidualBlock(
        channels, [branch(k) for k in branches], width * len(branches), scale, activate
    )


def _reduction_branch(*channels: int) -> nn.Sequential:
    """A 1x1 convolution, same-size 3x3 ones, then a 3x3 of stride 2, through ``channels``."""
    first, *middle, last = zip(channels, channels[1:])
    return nn.Sequential(
        BasicConv2d(*first, 1),
        *(BasicConv2d(*pair, 3, padding=1) for pair in middle),
        BasicConv2d(*last, 3, stride=2),
    )


class InceptionResnetV1(nn.Sequential):
    """Inception-ResNet-v1 up to global average pooling: (B, C, H, W) -> (B, 1792); 160 x 160
    crops leave a 3 x 3 grid before pooling."""

    MIN_INPUT_SIZE = 75  # smaller inputs leave mixed_7a a grid under its 3 x 3 kernels
    feature_dim = 1792

    def __init__(self, in_channels: int = 3):
        block8 = partial(_residual_block, 1792, 192, [(), [(1, 3), (3, 1)]])
        layers = OrderedDict(
            conv2d_1a=BasicConv2d(in_channels, 32, 3, stride=2),
            conv2d_2a=BasicConv2d(32, 32, 3),
            conv2d_2b=BasicConv2d(32, 64, 3, padding=1),
            maxpool_3a=nn.MaxPool2d(3, stride=2),
            conv2d_3b=BasicConv2d(64, 80, 1),
            conv2d_4a=BasicConv2d(80, 192, 3),
            conv2d_4b=BasicConv2d(192, 256, 3, stride=2),
            # block35: Inception-ResNet-A on 256 channels (17 x 17 at 160 px)
            repeat_1=nn.Sequential(
                *[
                    _residual_block(256, 32, [(), [(3, 3)], [(3, 3), (3, 3)]], 0.17)
                    for _ in range(5)
                ]
            ),
            # Reduction-A: 256 -> 384 + 256 + 256 = 896 channels, H and W halved
            mixed_6a=Branches(
                BasicConv2d(256, 384, 3, stride=2),
                _reduction_branch(256, 192, 192, 256),
                nn.MaxPool2d(3, stride=2),
            ),
            # block17: Inception-ResNet-B on 896 channels, factorised 1 x 7 and 7 x 1
            repeat_2=nn.Sequential(
                *[_residual_block(896, 128, [(), [(1, 7), (7, 1)]], 0.10) for _ in range(10)]
            ),
            # Reduction-B: 896 -> 384 + 256 + 256 + 896 = 1792 channels, H and W halved
            mixed_7a=Branches(
                _reduction_branch(896, 256, 384),
                _reduction_branch(896, 256, 256),
                _reduction_branch(896, 256, 256, 256),
                nn.MaxPool2d(3, stride=2),
            ),
            # block8: Inception-ResNet-C on 1792 channels, factorised 1 x 3 and 3 x 1
            repeat_3=nn.Sequential(*[block8(0.20) for _ in range(5)]),
            block8=block8(1.0, activate=False),
            avgpool_1a=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(1),
        )
        super().__init__(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[-2:]) < self.MIN_INPUT_SIZE:
            raise ValueError(
                f"inception_resnet_v1 needs inputs of at least {self.MIN_INPUT_SIZE} x "
                f"{self.MIN_INPUT_SIZE} px (160 x 160 is its usual size), got "
                f"{tuple(x.shape[-2:])}"
            )
        return super().forward(x)


def convert_facenet_pytorch_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """A facenet-pytorch state dict on the keys of ``EmbeddingNet("inception_resnet_v1", 512,
    num_classes=N)`` (N: its ``logits`` rows; no classifier without them), tensors shared."""
    converted = {}
    for key, value in state_dict.items():
        layer, _, param = key.partition(".")
        ours = _PORT_HEAD_TO_EMBEDDING_NET.get(layer)
        converted[f"{ours}.{param}" if ours else f"backbone.{key}"] = value
    return converted
