"""Inception-ResNet-v1, the backbone of the FaceNet ports, for 160 x 160 face crops.

The architecture is the one of Szegedy et al. (2016), "Inception-v4, Inception-ResNet and the
Impact of Residual Connections on Learning", as used by FaceNet (Schroff et al., 2015) and its
PyTorch ports. Module names follow the layout of the widely used facenet-pytorch port
(``conv2d_1a`` ... ``block8``), so the backbone's state-dict keys are exactly that port's keys
without its head; :func:`convert_facenet_pytorch_state_dict` maps a whole state dict of that
layout (head included) onto :class:`facenet.models.embedding.EmbeddingNet`. See docs/models.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "FACENET_PYTORCH_HEAD_KEYS",
    "InceptionResnetV1",
    "convert_facenet_pytorch_state_dict",
]

# BatchNorm epsilon of the TensorFlow original; kept so that converted weights give the same
# outputs.
BN_EPS = 1e-3

# Prefixes of the port's own head: pooled features -> last_linear -> last_bn (-> logits).
FACENET_PYTORCH_HEAD_KEYS = ("last_linear.", "last_bn.", "logits.")

# Where each head prefix of the port lives in an EmbeddingNet.
_PORT_HEAD_TO_EMBEDDING_NET = {
    "last_linear.": "embedding.linear.",
    "last_bn.": "embedding.bn.",
    "logits.": "classifier.",
}


class BasicConv2d(nn.Module):
    """Conv (no bias) -> BatchNorm -> ReLU, with the submodule names ``conv`` and ``bn``.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: an int or (kh, kw).
        stride: the convolution stride.
        padding: an int or (ph, pw).
    """

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=BN_EPS)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H', W')."""
        return self.relu(self.bn(self.conv(x)))


class _Branches(nn.Module):
    """Parallel branches named ``branch0``, ``branch1``, ... whose outputs are concatenated."""

    def __init__(self, branches: Sequence[nn.Module]):
        super().__init__()
        self.num_branches = len(branches)
        for i, branch in enumerate(branches):
            self.add_module(f"branch{i}", branch)

    def concat_branches(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, sum of branch channels, H', W')."""
        return torch.cat([getattr(self, f"branch{i}")(x) for i in range(self.num_branches)], 1)


class ReductionBlock(_Branches):
    """A grid-size reduction (``mixed_6a``, ``mixed_7a``): stride-2 branches, concatenated.

    Args:
        branches: modules that each halve H and W.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C', (H - 3) // 2 + 1, (W - 3) // 2 + 1)."""
        return self.concat_branches(x)


class ResidualBlock(_Branches):
    """An Inception-ResNet block: ``relu(x + scale * conv2d(concat(branches(x))))``.

    Args:
        channels: input and output channels.
        branches: same-size branches.
        branch_channels: their total output channels (input of the 1 x 1 projection ``conv2d``).
        scale: the residual scaling that keeps the sum stable (0.17, 0.10, 0.20 by stage).
        activate: apply the final ReLU (the very last block, ``block8``, does not).
    """

    def __init__(self, channels, branches, branch_channels, scale, activate=True):
        super().__init__(branches)
        self.scale = scale
        self.conv2d = nn.Conv2d(branch_channels, channels, kernel_size=1)
        self.relu = nn.ReLU() if activate else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, C, H, W)."""
        return self.relu(x + self.scale * self.conv2d(self.concat_branches(x)))


def _chain(*convs: nn.Module) -> nn.Sequential:
    return nn.Sequential(*convs)


def block35(scale: float = 0.17) -> ResidualBlock:
    """Inception-ResNet-A on 256 channels (35 x 35 grid in the paper, 17 x 17 at 160 px).

    Args:
        scale: residual scaling.
    """
    return ResidualBlock(
        256,
        [
            BasicConv2d(256, 32, 1),
            _chain(BasicConv2d(256, 32, 1), BasicConv2d(32, 32, 3, padding=1)),
            _chain(
                BasicConv2d(256, 32, 1),
                BasicConv2d(32, 32, 3, padding=1),
                BasicConv2d(32, 32, 3, padding=1),
            ),
        ],
        branch_channels=96,
        scale=scale,
    )


def block17(scale: float = 0.10) -> ResidualBlock:
    """Inception-ResNet-B on 896 channels, with factorised 1 x 7 and 7 x 1 convolutions.

    Args:
        scale: residual scaling.
    """
    return ResidualBlock(
        896,
        [
            BasicConv2d(896, 128, 1),
            _chain(
                BasicConv2d(896, 128, 1),
                BasicConv2d(128, 128, (1, 7), padding=(0, 3)),
                BasicConv2d(128, 128, (7, 1), padding=(3, 0)),
            ),
        ],
        branch_channels=256,
        scale=scale,
    )


def block8(scale: float = 0.20, activate: bool = True) -> ResidualBlock:
    """Inception-ResNet-C on 1792 channels, with factorised 1 x 3 and 3 x 1 convolutions.

    Args:
        scale: residual scaling.
        activate: apply the final ReLU.
    """
    return ResidualBlock(
        1792,
        [
            BasicConv2d(1792, 192, 1),
            _chain(
                BasicConv2d(1792, 192, 1),
                BasicConv2d(192, 192, (1, 3), padding=(0, 1)),
                BasicConv2d(192, 192, (3, 1), padding=(1, 0)),
            ),
        ],
        branch_channels=384,
        scale=scale,
        activate=activate,
    )


def mixed_6a() -> ReductionBlock:
    """Reduction-A: 256 -> 384 + 256 + 256 = 896 channels, H and W halved."""
    return ReductionBlock(
        [
            BasicConv2d(256, 384, 3, stride=2),
            _chain(
                BasicConv2d(256, 192, 1),
                BasicConv2d(192, 192, 3, padding=1),
                BasicConv2d(192, 256, 3, stride=2),
            ),
            nn.MaxPool2d(3, stride=2),
        ]
    )


def mixed_7a() -> ReductionBlock:
    """Reduction-B: 896 -> 384 + 256 + 256 + 896 = 1792 channels, H and W halved."""
    return ReductionBlock(
        [
            _chain(BasicConv2d(896, 256, 1), BasicConv2d(256, 384, 3, stride=2)),
            _chain(BasicConv2d(896, 256, 1), BasicConv2d(256, 256, 3, stride=2)),
            _chain(
                BasicConv2d(896, 256, 1),
                BasicConv2d(256, 256, 3, padding=1),
                BasicConv2d(256, 256, 3, stride=2),
            ),
            nn.MaxPool2d(3, stride=2),
        ]
    )


class InceptionResnetV1(nn.Sequential):
    """Inception-ResNet-v1 up to global average pooling: (B, C, H, W) -> (B, 1792).

    Made for 160 x 160 crops (the grid is 3 x 3 before pooling); inputs down to
    ``MIN_INPUT_SIZE`` px work. About 22.6 M parameters.

    Args:
        in_channels: image channels (3 for RGB).
    """

    MIN_INPUT_SIZE = 75  # smaller inputs leave mixed_7a a grid under its 3 x 3 kernels
    feature_dim = 1792

    def __init__(self, in_channels: int = 3):
        layers = OrderedDict(
            conv2d_1a=BasicConv2d(in_channels, 32, 3, stride=2),
            conv2d_2a=BasicConv2d(32, 32, 3),
            conv2d_2b=BasicConv2d(32, 64, 3, padding=1),
            maxpool_3a=nn.MaxPool2d(3, stride=2),
            conv2d_3b=BasicConv2d(64, 80, 1),
            conv2d_4a=BasicConv2d(80, 192, 3),
            conv2d_4b=BasicConv2d(192, 256, 3, stride=2),
            repeat_1=nn.Sequential(*[block35(0.17) for _ in range(5)]),
            mixed_6a=mixed_6a(),
            repeat_2=nn.Sequential(*[block17(0.10) for _ in range(10)]),
            mixed_7a=mixed_7a(),
            repeat_3=nn.Sequential(*[block8(0.20) for _ in range(5)]),
            block8=block8(1.0, activate=False),
            avgpool_1a=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(1),
        )
        super().__init__(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1792); a clear error for inputs under ``MIN_INPUT_SIZE``."""
        if min(x.shape[-2:]) < self.MIN_INPUT_SIZE:
            raise ValueError(
                f"inception_resnet_v1 needs inputs of at least {self.MIN_INPUT_SIZE} x "
                f"{self.MIN_INPUT_SIZE} px (160 x 160 is its usual size), got "
                f"{tuple(x.shape[-2:])}"
            )
        return super().forward(x)


def convert_facenet_pytorch_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict:
    """Map a state dict in the facenet-pytorch layout onto ``EmbeddingNet``.

    ``conv2d_1a.*`` ... ``block8.*`` -> ``backbone.*`` (same names below the prefix),
    ``last_linear.*`` -> ``embedding.linear.*``, ``last_bn.*`` -> ``embedding.bn.*``,
    ``logits.*`` -> ``classifier.*``. Load the result into
    ``EmbeddingNet("inception_resnet_v1", embedding_dim=512, num_classes=N)`` with N the
    number of classes of the ``logits`` layer (or without ``logits.*`` keys and no classifier).

    Args:
        state_dict: the port's ``model.state_dict()`` (tensors are shared, not copied).
    """
    converted = {}
    for key, value in state_dict.items():
        converted[_embedding_net_key(key)] = value
    return converted


def _embedding_net_key(key: str) -> str:
    for port_prefix, ours in _PORT_HEAD_TO_EMBEDDING_NET.items():
        if key.startswith(port_prefix):
            return ours + key[len(port_prefix) :]
    return "backbone." + key
