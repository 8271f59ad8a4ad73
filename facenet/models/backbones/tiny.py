"""A small CNN for CPU demos and tests."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torchvision.ops import Conv2dNormActivation

__all__ = ["TinyCNN"]


class TinyCNN(nn.Sequential):
    """Stride-2 conv-BN-ReLU stages, then global average pooling: (B, C, H, W) -> (B, F).

    With the default widths it has about 0.24 M parameters and runs a batch of 64 images of
    64 x 64 px in tens of milliseconds on a laptop CPU. Any input of 32 px or more works (each
    stage halves the size; pooling is global).

    Args:
        in_channels: image channels (3 for RGB).
        widths: output channels of each stage; the last one is the feature size F.
    """

    def __init__(self, in_channels: int = 3, widths: Sequence[int] = (32, 64, 128, 128)):
        if not widths:
            raise ValueError("TinyCNN: widths must name at least one stage")
        stages = []
        channels = in_channels
        for width in widths:
            stages.append(Conv2dNormActivation(channels, width, kernel_size=3, stride=2))
            channels = width
        super().__init__(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(1))
        self.feature_dim = channels
