"""Backbones written in this package; the torchvision ones are built in
:mod:`facenet.models.embedding`."""

from facenet.models.backbones.inception_resnet_v1 import (
    InceptionResnetV1,
    convert_facenet_pytorch_state_dict,
)
from facenet.models.backbones.mobilefacenet import (
    MobileFaceNet,
    convert_mobilefacenet_state_dict,
    mobilefacenet_input_size,
)
from facenet.models.backbones.tiny import TinyCNN

__all__ = [
    "InceptionResnetV1",
    "MobileFaceNet",
    "TinyCNN",
    "convert_facenet_pytorch_state_dict",
    "convert_mobilefacenet_state_dict",
    "mobilefacenet_input_size",
]
