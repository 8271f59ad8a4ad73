"""Xiaoccer/MobileFaceNet_Pytorch's network, re-implemented from reading its ``core/model.py``.

Written independently of ``facenet.wings.publishers.mobilefacenet``: the publisher's module
names (``conv1``, ``dw_conv1``, ``blocks.i.conv.j``, ``conv2``, ``linear7``, ``linear1``,
``prelu``), its layer order and PyTorch's default BatchNorm epsilon, so that its
``state_dict()`` has exactly the keys and shapes of the published ``068.ckpt`` and its forward
is the publisher's: the raw 128-D output of ``linear1``, not normalised.
"""

import torch
from torch import nn

# The publisher's Mobilefacenet_bottleneck_setting: t, c, n, s.
SETTING = [[2, 64, 5, 2], [4, 128, 1, 2], [2, 128, 6, 1], [4, 128, 1, 2], [2, 128, 2, 1]]


class PublisherBottleneck(nn.Module):
    """``Bottleneck``: one nn.Sequential (pw, BN, PReLU, dw, BN, PReLU, pw-linear, BN)."""

    def __init__(self, inp, oup, stride, expansion):
        super().__init__()
        self.connect = stride == 1 and inp == oup
        hidden = inp * expansion
        self.conv = nn.Sequential(
            nn.Conv2d(inp, hidden, 1, 1, 0, bias=False),
            nn.BatchNorm2d(hidden),
            nn.PReLU(hidden),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.PReLU(hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        )

    def forward(self, x):
        return x + self.conv(x) if self.connect else self.conv(x)


class PublisherConvBlock(nn.Module):
    """``ConvBlock``: conv (depthwise with ``dw``) -> BN -> PReLU unless ``linear``."""

    def __init__(self, inp, oup, k, s, p, dw=False, linear=False):
        super().__init__()
        self.linear = linear
        self.conv = nn.Conv2d(inp, oup, k, s, p, groups=inp if dw else 1, bias=False)
        self.bn = nn.BatchNorm2d(oup)
        if not linear:
            self.prelu = nn.PReLU(oup)

    def forward(self, x):
        x = self.bn(self.conv(x))
        return x if self.linear else self.prelu(x)


class PublisherMobileFacenet(nn.Module):
    """``MobileFacenet``: (B, 3, 112, 96) -> (B, 128), the raw output of ``linear1``."""

    def __init__(self, gdc_kernel=(7, 6)):
        super().__init__()
        self.conv1 = PublisherConvBlock(3, 64, 3, 2, 1)
        self.dw_conv1 = PublisherConvBlock(64, 64, 3, 1, 1, dw=True)
        layers, inplanes = [], 64
        for t, c, n, s in SETTING:
            for i in range(n):
                layers.append(PublisherBottleneck(inplanes, c, s if i == 0 else 1, t))
                inplanes = c
        self.blocks = nn.Sequential(*layers)
        self.conv2 = PublisherConvBlock(128, 512, 1, 1, 0)
        self.linear7 = PublisherConvBlock(512, 512, gdc_kernel, 1, 0, dw=True, linear=True)
        self.linear1 = PublisherConvBlock(512, 128, 1, 1, 0, linear=True)

    def forward(self, x):
        x = self.conv1(x)
        x = self.dw_conv1(x)
        x = self.blocks(x)
        x = self.conv2(x)
        x = self.linear7(x)
        x = self.linear1(x)
        return x.view(x.size(0), -1)


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights everywhere, BatchNorm statistics and PReLU slopes included (each channel
    its own), so that a wrong mapping of any tensor shows in the outputs; returned in eval mode."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(tensor, low, high):
        tensor.copy_(low + (high - low) * torch.rand(tensor.shape, generator=generator))

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):  # He-normal over fan-out, as the publisher's
                fan_out = module.weight.shape[0] * module.weight[0, 0].numel()
                scale = (2.0 / fan_out) ** 0.5
                module.weight.copy_(scale * torch.randn(module.weight.shape, generator=generator))
            elif isinstance(module, nn.BatchNorm2d):
                uniform(module.weight, 0.5, 1.5)
                uniform(module.bias, -0.2, 0.2)
                uniform(module.running_mean, -0.2, 0.2)
                uniform(module.running_var, 0.5, 1.5)
            elif isinstance(module, nn.PReLU):
                uniform(module.weight, 0.0, 0.5)
    return model.eval()


def calibrate(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """Every BatchNorm's running statistics set to those of ``images`` (B, 3, H, W) at its
    input, returned in eval mode.

    With :func:`randomize`'s statistics the activations are not normalised: the output is
    almost one constant vector (what varies with the image is about 1e-5 of its norm), so
    after the evaluation's mean subtraction two float32 implementations of the network
    disagree on every score. Measured statistics keep the features apart.
    """
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.reset_running_stats()
            module.momentum = None  # a cumulative average: one batch gives its own statistics
    model.train()
    with torch.no_grad():
        model(images)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = 0.1
    return model.eval()
