"""Embedding networks: ``EmbeddingNet`` (a backbone, an L2-normalised embedding head and an
optional classifier), the backbones (torchvision's and ours in ``backbones/``) and loading
published backbone weights from local files.
"""

from facenet.models.embedding import (
    BACKBONES,
    EmbeddingHead,
    EmbeddingNet,
    build_model,
    count_parameters,
)

__all__ = [
    "BACKBONES",
    "EmbeddingHead",
    "EmbeddingNet",
    "build_model",
    "count_parameters",
]
