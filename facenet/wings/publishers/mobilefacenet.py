"""MobileFaceNet (Chen et al., 2018): inverted-residual bottlenecks with PReLU, then a global
depthwise convolution (GDC) as large as the last feature map instead of average pooling.

The layer plan is the paper's Table 1 and Xiaoccer/MobileFaceNet_Pytorch's ``core/model.py``,
whose CASIA-WebFace weights load into it (:func:`convert_mobilefacenet_state_dict`). The
backbone ends at the GDC's 512 features; the paper's last linear 1x1 convolution with BatchNorm
is :class:`facenet.models.embedding.EmbeddingHead`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from facenet.sizes import image_hw

# (expansion t, output channels c, repeats n, first stride s) of each stage: 112 x 96 -> 7 x 6.
MOBILEFACENET_BLOCKS = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)
_STRIDE = 16  # of the stem and the bottlenecks together
_GDC_KEY = "linear7.conv.weight"


class ConvUnit(nn.Module):
    """Convolution (no bias) -> BatchNorm -> PReLU, one slope per channel (none if ``linear``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int] = 1,
        stride: int = 1,
        padding: int = 0,
        depthwise: bool = False,
        linear: bool = False,
    ):
        super().__init__()
        groups = in_channels if depthwise else 1
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, stride, padding, groups=groups, bias=False
        )
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.Identity() if linear else nn.PReLU(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    """Inverted residual: 1x1 expand (x t) -> 3x3 depthwise (stride) -> 1x1 linear project,
    plus the input when the shape is kept."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int):
        super().__init__()
        hidden = in_channels * expansion
        self.residual = stride == 1 and in_channels == out_channels
        self.expand = ConvUnit(in_channels, hidden)
        self.depthwise = ConvUnit(hidden, hidden, 3, stride, 1, depthwise=True)
        self.project = ConvUnit(hidden, out_channels, linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """MobileFaceNet's body: images (B, C, H, W) -> GDC features (B, 512), built for one
    input size: 112 x 96 (SphereFace's crops, the published weights) gives a 7 x 6 kernel,
    112 x 112 (insightface's) a 7 x 7 one."""

    feature_dim = 512
    head_bn_eps = 1e-5  # the publisher's BatchNorm default, for its embedding layer

    def __init__(self, in_channels: int = 3, input_size: int | Sequence[int] | None = None):
        super().__init__()
        height, width = self.input_size = image_hw(input_size or (112, 96))
        if min(height, width) < _STRIDE or height % _STRIDE or width % _STRIDE:
            raise ValueError(
                f"MobileFaceNet: input size {height} x {width}: each side must be a positive "
                f"multiple of {_STRIDE} (112 x 96 or 112 x 112)"
            )
        self.gdc_size = (height // _STRIDE, width // _STRIDE)
        self.stem = ConvUnit(in_channels, 64, 3, 2, 1)
        self.stem_dw = ConvUnit(64, 64, 3, 1, 1, depthwise=True)
        blocks, channels = [], 64  # flat: blocks.0 ... blocks.14
        for expansion, out, repeats, stride in MOBILEFACENET_BLOCKS:
            for i in range(repeats):
                blocks.append(Bottleneck(channels, out, stride if i == 0 else 1, expansion))
                channels = out
        self.blocks = nn.Sequential(*blocks)
        self.conv_1x1 = ConvUnit(128, 512)
        self.gdc = ConvUnit(512, 512, self.gdc_size, depthwise=True, linear=True)
        for m in self.modules():  # the publisher's initialisation (its BatchNorm's is torch's)
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_hw = tuple(x.shape[-2:])
        x = self.conv_1x1(self.blocks(self.stem_dw(self.stem(x))))  # (B, 512, H/16, W/16)
        if tuple(x.shape[-2:]) != self.gdc_size:
            height, width = self.input_size
            raise ValueError(
                f"MobileFaceNet was built for {height} x {width} (H x W) inputs, a "
                f"{self.gdc_size[0]} x {self.gdc_size[1]} global depthwise kernel; got "
                f"{input_hw[0]} x {input_hw[1]}"
            )
        return self.gdc(x).flatten(1)  # (B, 512)


# --------------------------------------------------------------------------- the published layout


# Our units for the eight layers of the publisher's bottleneck (``blocks.i.conv.j``).
_BLOCK_LAYERS = (
    "expand.conv",
    "expand.bn",
    "expand.act",
    "depthwise.conv",
    "depthwise.bn",
    "depthwise.act",
    "project.conv",
    "project.bn",
)


_TOP_LEVEL = {"conv1": "stem", "dw_conv1": "stem_dw", "conv2": "conv_1x1", "linear7": "gdc"}


def _map_key(key: str) -> str:
    """One publisher key -> our EmbeddingNet key (unknown keys unchanged)."""
    top, _, rest = key.partition(".")
    if top == "blocks":  # blocks.<i>.conv.<j>.<param>
        block, _, inner = rest.partition(".")
        layer, param = inner.removeprefix("conv.").split(".", 1)
        return f"backbone.blocks.{block}.{_BLOCK_LAYERS[int(layer)]}.{param}"
    if top in _TOP_LEVEL:
        return f"backbone.{_TOP_LEVEL[top]}.{rest.replace('prelu.', 'act.', 1)}"
    if top == "linear1":  # the 1x1 linear conv + BN to the embedding: our head
        return "embedding." + rest.replace("conv.", "linear.", 1)
    return key


def convert_mobilefacenet_state_dict(state: Mapping[str, torch.Tensor]) -> dict:
    """A Xiaoccer/MobileFaceNet_Pytorch ``net_state_dict`` on the keys of
    ``EmbeddingNet("mobilefacenet", embedding_dim=D)``, tensors shared; its embedding layer
    ``linear1`` becomes the head (the (D, 512, 1, 1) convolution a (D, 512) linear)."""
    out = {_map_key(k): v for k, v in state.items()}
    weight = out.get("embedding.linear.weight")
    if weight is not None and weight.ndim == 4:  # (D, 512, 1, 1) -> (D, 512)
        out["embedding.linear.weight"] = weight.flatten(1)
    return out


def mobilefacenet_input_size(state: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(H, W) a publisher's state dict was trained for, from its GDC kernel (7 x 6 -> 112 x 96)."""
    gdc = state.get(_GDC_KEY)
    if gdc is None or gdc.ndim != 4:
        raise ValueError("a MobileFaceNet file without its linear7 global depthwise layer")
    return gdc.shape[2] * _STRIDE, gdc.shape[3] * _STRIDE
