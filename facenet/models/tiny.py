"""A small CNN for CPU demos and tests."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torchvision.ops import Conv2dNormActivation


class TinyCNN(nn.Sequential):
    """Stride-2 conv-BN-ReLU stages of ``widths`` channels, then global average pooling:
    (B, C, H, W) -> (B, widths[-1]); about 0.24 M parameters. For CPU demos and tests."""

    def __init__(self, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128, 128)):
        stages = [
            Conv2dNormActivation(c_in, c_out, kernel_size=3, stride=2)
            for c_in, c_out in zip((in_channels, *widths), widths)
        ]
        super().__init__(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.feature_dim = widths[-1]
