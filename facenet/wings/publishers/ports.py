"""The publishers' weight files this package reads, as data: how each layout is recognised,
where its files hold the state dict, how its keys map onto EmbeddingNet's, and its input.

Both publishers standardise pixels as (x - 127.5) / 128, our "fixed" standardisation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from facenet.sizes import ImageSize
from facenet.wings.publishers.inception_resnet_v1 import convert_facenet_pytorch_state_dict
from facenet.wings.publishers.mobilefacenet import (
    convert_mobilefacenet_state_dict,
    mobilefacenet_input_size,
)


@dataclass(frozen=True)
class Port:
    kind: str  # TrainedModel.kind
    publisher: str  # as messages name it
    backbone: str
    marker: str  # a key only this layout has
    head_layer: str  # the layer EmbeddingNet's head comes from
    convert: Callable[[Mapping], dict]  # onto EmbeddingNet keys, tensors shared
    input_size: Callable[[Mapping], ImageSize]  # ValueError when the weights do not say
    file_key: str | None = None  # where its files hold the state dict, if not at the top


PORTS = (
    Port(
        "facenet-pytorch",
        "facenet-pytorch",
        "inception_resnet_v1",
        "conv2d_1a.conv.weight",
        "last_linear",
        convert_facenet_pytorch_state_dict,
        lambda state: 160,
    ),
    Port(
        "mobilefacenet",
        "MobileFaceNet",
        "mobilefacenet",
        "dw_conv1.conv.weight",  # its depthwise stem
        "linear1 embedding",
        convert_mobilefacenet_state_dict,
        mobilefacenet_input_size,
        file_key="net_state_dict",  # Xiaoccer/MobileFaceNet_Pytorch's .ckpt files
    ),
)


def find_port(contents: Mapping) -> tuple[Port, dict] | None:
    """The port whose layout a file's ``contents`` have, and its state dict; None for ours."""
    for port in PORTS:
        state = contents.get(port.file_key, contents) if port.file_key else contents
        if isinstance(state, Mapping) and port.marker in state:
            return port, dict(state)
    return None
