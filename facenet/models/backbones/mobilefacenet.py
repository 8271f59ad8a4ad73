"""MobileFaceNet (Chen et al., 2018): a face-embedding network small enough for CPUs and phones.

Inverted-residual bottlenecks (1x1 expansion, 3x3 depthwise, 1x1 linear projection) with PReLU,
and a global depthwise convolution (GDC) instead of global average pooling: a depthwise kernel
as large as the last feature map, so every position of the face keeps its own weight.

The layer plan is the one of the paper's Table 1 and of Xiaoccer/MobileFaceNet_Pytorch
(``core/model.py``), whose published CASIA-WebFace weights load into it
(:func:`convert_mobilefacenet_state_dict`). For a 112 x 96 (H x W) input, as SphereFace aligns
faces:

```
stem        conv 3x3 s2, 64, BN, PReLU          (B, 64, 56, 48)
stem_dw     depthwise 3x3, 64, BN, PReLU        (B, 64, 56, 48)
blocks      bottlenecks (t, c, n, s):           (B, 128, 7, 6)
              (2, 64, 5, 2) (4, 128, 1, 2) (2, 128, 6, 1) (4, 128, 1, 2) (2, 128, 2, 1)
conv_1x1    conv 1x1, 512, BN, PReLU            (B, 512, 7, 6)
gdc         depthwise 7x6, 512, BN (linear)     (B, 512, 1, 1) -> (B, 512)
```

The paper's last layer, a linear 1x1 convolution to the 128-D embedding with BatchNorm, is the
embedding head of :class:`facenet.models.embedding.EmbeddingNet` (``embedding.linear`` and
``embedding.bn``): the backbone ends at the GDC's 512 features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from facenet.sizes import image_hw

__all__ = [
    "MOBILEFACENET_BLOCKS",
    "MOBILEFACENET_HEAD_KEYS",
    "MOBILEFACENET_MARKER",
    "MobileFaceNet",
    "convert_mobilefacenet_state_dict",
    "mobilefacenet_input_size",
]

# (expansion t, output channels c, repeats n, first stride s) of each bottleneck stage.
MOBILEFACENET_BLOCKS: tuple[tuple[int, int, int, int], ...] = (
    (2, 64, 5, 2),
    (4, 128, 1, 2),
    (2, 128, 6, 1),
    (4, 128, 1, 2),
    (2, 128, 2, 1),
)
# The stem and the bottlenecks divide each side by 16: 112 x 96 -> 7 x 6.
_STRIDE = 16
# A key only the publisher's layout has (its depthwise stem), and its embedding layer's keys.
MOBILEFACENET_MARKER = "dw_conv1.conv.weight"
MOBILEFACENET_HEAD_KEYS = ("linear1.",)
_GDC_KEY = "linear7.conv.weight"


class ConvUnit(nn.Module):
    """Convolution (no bias) -> BatchNorm -> PReLU (or no activation when ``linear``).

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: int or (kh, kw).
        stride: stride.
        padding: zero padding.
        depthwise: one filter per channel (``groups = in_channels``; needs equal channels).
        linear: leave out the PReLU.
    """

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
        # One PReLU slope per channel, as the paper and the published weights have.
        self.act = None if linear else nn.PReLU(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H', W')."""
        x = self.bn(self.conv(x))
        return x if self.act is None else self.act(x)


class Bottleneck(nn.Module):
    """Inverted residual: 1x1 expand (x t) -> 3x3 depthwise (stride) -> 1x1 linear project.

    The input is added back when the shape is kept (stride 1, same channels).

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: the depthwise convolution's stride (1 or 2).
        expansion: t, the width of the hidden layers in multiples of ``in_channels``.
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int):
        super().__init__()
        hidden = in_channels * expansion
        self.residual = stride == 1 and in_channels == out_channels
        self.expand = ConvUnit(in_channels, hidden)
        self.depthwise = ConvUnit(hidden, hidden, 3, stride, 1, depthwise=True)
        self.project = ConvUnit(hidden, out_channels, linear=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, H, W) -> (B, C_out, H / stride, W / stride)."""
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out


def _stages(in_channels: int, plan: Sequence[tuple[int, int, int, int]]) -> nn.Sequential:
    """The bottlenecks of ``plan``, flat (``blocks.0`` ... ``blocks.14`` for the paper's)."""
    layers = []
    for expansion, channels, repeats, stride in plan:
        for i in range(repeats):
            layers.append(Bottleneck(in_channels, channels, stride if i == 0 else 1, expansion))
            in_channels = channels
    return nn.Sequential(*layers)


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    """(H, W) of an int (square) or a pair; every side a positive multiple of 16."""
    height, width = image_hw(size)
    if height < _STRIDE or width < _STRIDE or height % _STRIDE or width % _STRIDE:
        raise ValueError(
            f"MobileFaceNet: input size {height} x {width}: each side must be a positive "
            f"multiple of {_STRIDE} (112 x 96 or 112 x 112)"
        )
    return height, width


class MobileFaceNet(nn.Module):
    """MobileFaceNet's body: images (B, C, H, W) -> GDC features (B, 512).

    The GDC kernel is the last feature map's size, so the network is built for one input size:
    112 x 96 (the default, SphereFace's crops and the published CASIA-WebFace weights) gives a
    7 x 6 kernel, 112 x 112 (insightface's crops) a 7 x 7 one.

    Args:
        in_channels: image channels C.
        input_size: (H, W) of the input, or one int for square inputs; multiples of 16.
    """

    feature_dim = 512

    def __init__(self, in_channels: int = 3, input_size: int | Sequence[int] = (112, 96)):
        super().__init__()
        self.input_size = _pair(input_size)
        self.gdc_size = (self.input_size[0] // _STRIDE, self.input_size[1] // _STRIDE)
        self.stem = ConvUnit(in_channels, 64, 3, 2, 1)
        self.stem_dw = ConvUnit(64, 64, 3, 1, 1, depthwise=True)
        self.blocks = _stages(64, MOBILEFACENET_BLOCKS)
        self.conv_1x1 = ConvUnit(128, 512)
        self.gdc = ConvUnit(512, 512, self.gdc_size, depthwise=True, linear=True)
        self._init_weights()

    def _init_weights(self) -> None:
        # The publisher's initialisation: He-normal convolutions over fan-out, BN at (1, 0).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) at ``input_size`` -> features (B, 512)."""
        input_hw = tuple(x.shape[-2:])
        x = self.conv_1x1(self.blocks(self.stem_dw(self.stem(x))))  # (B, 512, H/16, W/16)
        if tuple(x.shape[-2:]) != self.gdc_size:
            # Another size would leave the GDC a map, not a vector: refuse it by name.
            height, width = self.input_size
            raise ValueError(
                f"MobileFaceNet was built for {height} x {width} (H x W) inputs, a "
                f"{self.gdc_size[0]} x {self.gdc_size[1]} global depthwise kernel; got "
                f"{input_hw[0]} x {input_hw[1]}"
            )
        return self.gdc(x).flatten(1)  # (B, 512)


# --------------------------------------------------------------------------- the published layout


# The publisher's bottleneck is one nn.Sequential of eight layers (``blocks.i.conv.j``): our
# units, in order.
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


def _map_block_key(rest: str) -> str:
    """``<j>.<param>`` of the publisher's ``blocks.i.conv`` -> ``<unit>.<layer>.<param>``."""
    index, param = rest.split(".", 1)
    return f"{_BLOCK_LAYERS[int(index)]}.{param}"


_TOP_LEVEL = {"conv1": "stem", "dw_conv1": "stem_dw", "conv2": "conv_1x1", "linear7": "gdc"}


def _map_key(key: str) -> str:
    """One publisher key -> our EmbeddingNet key (unknown keys are returned unchanged)."""
    top, _, rest = key.partition(".")
    if top == "blocks":  # blocks.<i>.conv.<j>.<param>
        block, _, inner = rest.partition(".")
        return f"backbone.blocks.{block}.{_map_block_key(inner.removeprefix('conv.'))}"
    if top in _TOP_LEVEL:
        return f"backbone.{_TOP_LEVEL[top]}.{rest.replace('prelu.', 'act.', 1)}"
    if top == "linear1":  # the 1x1 linear conv + BN to the embedding: our head
        return "embedding." + rest.replace("conv.", "linear.", 1)
    return key


def convert_mobilefacenet_state_dict(state: Mapping[str, torch.Tensor]) -> dict:
    """Map a Xiaoccer/MobileFaceNet_Pytorch ``net_state_dict`` onto EmbeddingNet keys.

    ``conv1`` -> ``backbone.stem``, ``dw_conv1`` -> ``backbone.stem_dw``, ``blocks.i.conv.j``
    -> ``backbone.blocks.i.{expand,depthwise,project}.{conv,bn,act}``, ``conv2`` ->
    ``backbone.conv_1x1``, ``linear7`` -> ``backbone.gdc``, ``prelu`` -> ``act``; the
    embedding layer ``linear1.conv.weight`` (D, 512, 1, 1) -> ``embedding.linear.weight``
    (D, 512) and ``linear1.bn.*`` -> ``embedding.bn.*``. Values are not copied.

    Args:
        state: the publisher's state dict (the ``net_state_dict`` of its ``.ckpt`` files).

    Returns:
        A state dict for ``EmbeddingNet("mobilefacenet", embedding_dim=D)``.
    """
    out = {_map_key(k): v for k, v in state.items()}
    weight = out.get("embedding.linear.weight")
    if weight is not None and weight.ndim == 4:  # (D, 512, 1, 1) -> (D, 512)
        out["embedding.linear.weight"] = weight.flatten(1)
    return out


def mobilefacenet_input_size(state: Mapping[str, torch.Tensor]) -> tuple[int, int] | None:
    """(H, W) a publisher-layout state dict was trained for, from its GDC kernel (7 x 6 ->
    112 x 96); None when the file has no GDC layer.

    Args:
        state: the publisher's state dict.
    """
    gdc = state.get(_GDC_KEY)
    if gdc is None or gdc.ndim != 4:
        return None
    return gdc.shape[2] * _STRIDE, gdc.shape[3] * _STRIDE
