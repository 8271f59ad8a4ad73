"""A trained model from a file, ready to embed: one call instead of six pieces.

``load_model(path)`` reads, with ``torch.load(weights_only=True)``:

- a training checkpoint (``last.pt``, ``best.pt``): the architecture and the preprocessing
  come from its saved configuration (``model`` and ``data`` sections);
- a weights export (``model.pt``, written by :func:`save_weights` / ``scripts/export.py
  --format weights``): the network's weights, its architecture and preprocessing, and the
  verification threshold when the run had one, without optimizer state or history;
- a facenet-pytorch state dict (``20180402-114759-vggface2.pt`` layout): Inception-ResNet-v1
  with its 512-D head, 160 px, the fixed standardisation.

The classifier head (training only) is left out: the model returns embeddings (B, D).
Everything here reads plain dicts; it does not import the configuration module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from facenet.checkpoint import load_checkpoint, save_checkpoint
from facenet.data.images import build_transform
from facenet.errors import CheckpointError
from facenet.models.backbones import convert_facenet_pytorch_state_dict
from facenet.models.embedding import EmbeddingNet

__all__ = ["WEIGHTS_FORMAT", "TrainedModel", "load_model", "save_weights"]

# The "format" value of a weights export; bump the version when its layout changes.
WEIGHTS_FORMAT = "facenet-weights"
WEIGHTS_VERSION = 1
# facenet-pytorch files: a key only that port's Inception-ResNet-v1 has, and its input.
_PORT_MARKER = "conv2d_1a.conv.weight"
_PORT_IMAGE_SIZE = 160


@dataclass
class TrainedModel:
    """An embedding network in eval mode and how its input must be prepared.

    Args:
        model: the :class:`EmbeddingNet` (no classifier head), in eval mode.
        image_size: the network's input side S.
        normalize: the pixel standardisation ("fixed" or "imagenet").
        kind: what the file was: "checkpoint", "weights" or "facenet-pytorch".
        path: the file it came from.
        architecture: ``{"backbone", "embedding_dim", "dropout"}``, to rebuild the network.
        verification: ``{"threshold", "threshold_distance"}`` when known, else empty.
    """

    model: EmbeddingNet
    image_size: int
    normalize: str
    kind: str
    path: str
    architecture: dict
    verification: dict = field(default_factory=dict)

    @property
    def embedding_dim(self) -> int:
        """D, the size of one embedding."""
        return self.model.embed_dim

    def transform(self):
        """The evaluation transform: uint8 (3, H, W) -> float (3, S, S)."""
        return build_transform(self.image_size, train=False, normalize=self.normalize)


def _build(architecture: dict, state: Mapping, path) -> EmbeddingNet:
    """An EmbeddingNet of ``architecture`` holding ``state`` (classifier keys dropped)."""
    try:
        model = EmbeddingNet(
            backbone=architecture["backbone"],
            embedding_dim=architecture["embedding_dim"],
            dropout=float(architecture.get("dropout", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: its saved architecture cannot be built: {err}") from None
    weights = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: its weights do not fit its saved architecture: "
            + " ".join(line.strip() for line in str(err).splitlines()[:2])
        ) from None
    return model.eval()


def _section(config: Mapping, name: str, path) -> Mapping:
    section = config.get(name)
    if not isinstance(section, Mapping):
        raise CheckpointError(f"{path}: its saved configuration has no '{name}' section")
    return section


def _from_training_checkpoint(state: dict, path) -> TrainedModel:
    model_cfg = _section(state["config"], "model", path)
    data_cfg = _section(state["config"], "data", path)
    architecture = {k: model_cfg.get(k) for k in ("backbone", "embedding_dim", "dropout")}
    return TrainedModel(
        model=_build(architecture, state["model"], path),
        image_size=int(data_cfg.get("image_size", 64)),
        normalize=str(data_cfg.get("normalize", "fixed")),
        kind="checkpoint",
        path=str(path),
        architecture=architecture,
    )


def _from_weights_export(state: dict, path) -> TrainedModel:
    if state.get("version") != WEIGHTS_VERSION:
        raise CheckpointError(
            f"{path}: weights export version {state.get('version')!r}; this package reads "
            f"version {WEIGHTS_VERSION}"
        )
    architecture = dict(state["architecture"])
    preprocess = state["preprocess"]
    return TrainedModel(
        model=_build(architecture, state["state_dict"], path),
        image_size=int(preprocess["image_size"]),
        normalize=str(preprocess["normalize"]),
        kind="weights",
        path=str(path),
        architecture=architecture,
        verification=dict(state.get("verification") or {}),
    )


def _from_facenet_pytorch(state: dict, path) -> TrainedModel:
    ours = convert_facenet_pytorch_state_dict(state)
    head = ours.get("embedding.linear.weight")
    if head is None:
        raise CheckpointError(f"{path}: a facenet-pytorch file without its last_linear layer")
    architecture = {
        "backbone": "inception_resnet_v1",
        "embedding_dim": int(head.shape[0]),  # 512 for the published files
        "dropout": 0.0,
    }
    return TrainedModel(
        model=_build(architecture, ours, path),
        image_size=_PORT_IMAGE_SIZE,
        normalize="fixed",  # the port's fixed_image_standardization: (x - 127.5) / 128
        kind="facenet-pytorch",
        path=str(path),
        architecture=architecture,
    )


def load_model(path: str | os.PathLike) -> TrainedModel:
    """Load a trained network from a file, on the CPU, in eval mode.

    Args:
        path: a training checkpoint, a weights export (``model.pt``) or a facenet-pytorch
            state dict; read with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: a missing, damaged or refused file, or one of none of these kinds.
    """
    state = load_checkpoint(path, map_location="cpu")
    if state.get("format") == WEIGHTS_FORMAT:
        return _from_weights_export(state, path)
    if isinstance(state.get("config"), Mapping) and isinstance(state.get("model"), Mapping):
        return _from_training_checkpoint(state, path)
    if _PORT_MARKER in state and all(torch.is_tensor(v) for v in state.values()):
        return _from_facenet_pytorch(state, path)
    raise CheckpointError(
        f"{path}: not a training checkpoint (no config and model dicts), a weights export "
        f"or a facenet-pytorch state dict"
    )


def save_weights(trained: TrainedModel, path: str | os.PathLike) -> Path:
    """Write a weights export: the weights, the architecture, the preprocessing, the threshold.

    A ``torch.save`` file of tensors, strings and numbers only: :func:`load_model` reads it
    with ``weights_only=True``, and ``torch.load(path, weights_only=True)["state_dict"]`` is a
    plain state dict for any other code. Written atomically.

    Args:
        trained: what :func:`load_model` returned.
        path: the target file (``model.pt``).
    """
    contents = {
        "format": WEIGHTS_FORMAT,
        "version": WEIGHTS_VERSION,
        "architecture": dict(trained.architecture),
        "preprocess": {"image_size": trained.image_size, "normalize": trained.normalize},
        "verification": dict(trained.verification),
        "state_dict": {k: v.detach().cpu() for k, v in trained.model.state_dict().items()},
    }
    return save_checkpoint(contents, path)
