"""A trained model from a file, ready to embed: one call instead of six pieces.

``load_model(path)`` reads, with ``torch.load(weights_only=True)``:

- a training checkpoint (``last.pt``, ``best.pt``): the architecture and the preprocessing
  come from its saved configuration (``model`` and ``data`` sections);
- a weights export (``model.pt``, written by :func:`save_weights` / ``scripts/export.py
  --format weights``): the network's weights, its architecture and preprocessing, and the
  verification threshold when the run had one, without optimizer state or history;
- a facenet-pytorch state dict (``20180402-114759-vggface2.pt`` layout): Inception-ResNet-v1
  with its 512-D head, 160 px, the fixed standardisation;
- a Xiaoccer/MobileFaceNet_Pytorch file (``model/best/068.ckpt``: ``{"epoch",
  "net_state_dict"}``, or the bare state dict): MobileFaceNet with its 128-D head, 112 x 96
  (H x W) SphereFace crops, the fixed standardisation.

The classifier head (training only) is left out: the model returns embeddings (B, D).
Everything here reads plain dicts; it does not import the configuration module.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from facenet.checkpoint import load_checkpoint, save_checkpoint
from facenet.data.images import build_transform
from facenet.errors import CheckpointError
from facenet.evaluation.report import ThresholdRecord
from facenet.models.backbones import (
    MOBILEFACENET_MARKER,
    convert_facenet_pytorch_state_dict,
    convert_mobilefacenet_state_dict,
    mobilefacenet_input_size,
)
from facenet.models.embedding import BACKBONES, EmbeddingNet
from facenet.sizes import ImageSize, image_hw, plain_size

__all__ = [
    "EMBED_PREPROCESS",
    "WEIGHTS_FORMAT",
    "TrainedModel",
    "load_model",
    "save_weights",
    "weights_digest",
]

# The "format" value of a weights export; bump the version when its layout changes.
WEIGHTS_FORMAT = "facenet-weights"
WEIGHTS_VERSION = 1
# facenet-pytorch files: a key only that port's Inception-ResNet-v1 has, and its input.
_PORT_MARKER = "conv2d_1a.conv.weight"
_PORT_IMAGE_SIZE = 160
# Xiaoccer/MobileFaceNet_Pytorch files: the state dict's key in its .ckpt files (the input
# size comes from the file's GDC kernel: 7 x 6 means 112 x 96).
_MFN_STATE_KEY = "net_state_dict"
# The ranges the configuration allows (facenet.config: data.image_size, model.embedding_dim),
# repeated here because this layer does not import the configuration. A file's numbers are
# checked against them before anything is allocated: a crafted file asking for a 3e7-wide
# head or 20000 px inputs would otherwise take gigabytes first.
_IMAGE_SIZE_RANGE = (8, 4096)
_EMBEDDING_DIM_RANGE = (1, 65536)
_NORMALIZE = ("fixed", "imagenet")
_HEAD_KEY = "embedding.linear.weight"
# How TrainedModel.transform prepares images: the preparation embed and export stand for.
EMBED_PREPROCESS = "resize"
# Non-finite weights named in a message: the first few.
_NAMED_KEYS = 3


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the embedding network's weights: names, dtypes, shapes and bytes.

    The classifier head (training only) is left out, so a training model, the checkpoint it
    was saved to and a weights export of that checkpoint give the same digest.

    Args:
        model: an :class:`EmbeddingNet` (any device, any memory format).
    """
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        if key.startswith("classifier."):
            continue
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{key}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class TrainedModel:
    """An embedding network in eval mode and how its input must be prepared.

    Args:
        model: the :class:`EmbeddingNet` (no classifier head), in eval mode.
        image_size: the network's input side S, or (H, W) for a non-square input (a
            MobileFaceNet file: (112, 96)); :func:`facenet.sizes.image_hw` reads both.
        normalize: the pixel standardisation ("fixed" or "imagenet").
        kind: what the file was: "checkpoint", "weights", "facenet-pytorch" or
            "mobilefacenet".
        path: the file it came from.
        architecture: ``{"backbone", "embedding_dim", "dropout"}``, to rebuild the network.
        verification: the threshold saved with the model (:meth:`ThresholdRecord.to_dict`:
            ``threshold``, ``threshold_distance`` and what it was chosen for), else empty.
        epoch: the training epoch of these weights, when the file says (None otherwise).
    """

    model: EmbeddingNet
    image_size: int | tuple[int, int]
    normalize: str
    kind: str
    path: str
    architecture: dict
    verification: dict = field(default_factory=dict)
    epoch: int | None = None

    @property
    def embedding_dim(self) -> int:
        """D, the size of one embedding."""
        return self.model.embed_dim

    def transform(self):
        """The evaluation transform: uint8 (3, h, w) -> float (3, S_h, S_w)."""
        return build_transform(self.image_size, train=False, normalize=self.normalize)

    def weights_sha256(self) -> str:
        """The weights' content hash (:func:`weights_digest`), computed once."""
        if getattr(self, "_digest", None) is None:
            self._digest = weights_digest(self.model)
        return self._digest

    def threshold_record(self) -> ThresholdRecord | None:
        """The threshold saved with the model, or None."""
        return ThresholdRecord.from_dict(self.verification, source=self.path)

    def preparation(self, flip: bool = False, subtract_mean: bool = False) -> dict:
        """What a threshold must have been chosen for to apply to this model's embeddings
        prepared by :meth:`transform` (see :meth:`ThresholdRecord.differences`).

        Args:
            flip: whether flipped-image embeddings are concatenated.
            subtract_mean: whether a mean embedding is subtracted.
        """
        return {
            "weights_sha256": self.weights_sha256(),
            "epoch": self.epoch,
            "flip": bool(flip),
            "subtract_mean": bool(subtract_mean),
            "preprocess": EMBED_PREPROCESS,
            "features": "unit",  # the embeddings made here are the network's unit outputs
        }


def _bad(path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def _int_in(value, name: str, bounds: tuple[int, int], path) -> int:
    """``value`` as an int within ``bounds``; else one error naming the field."""
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, f"{name} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise _bad(path, f"{name} {value} is out of range; allowed: [{low}, {high}]")
    return value


def _check_architecture(architecture, path) -> dict:
    """``{"backbone", "embedding_dim", "dropout"}`` checked for type and range."""
    if not isinstance(architecture, Mapping):
        raise _bad(path, f"architecture must be a dict, got {type(architecture).__name__}")
    backbone = architecture.get("backbone")
    if backbone not in BACKBONES:
        raise _bad(path, f"architecture.backbone {backbone!r}: valid backbones: {BACKBONES}")
    dim = _int_in(
        architecture.get("embedding_dim"), "architecture.embedding_dim", _EMBEDDING_DIM_RANGE, path
    )
    dropout = architecture.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise _bad(path, f"architecture.dropout must be a number in [0, 1), got {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise _bad(path, f"architecture.dropout {dropout} is out of range; allowed: [0, 1)")
    return {"backbone": backbone, "embedding_dim": dim, "dropout": float(dropout)}


def _size_in(value, name: str, path) -> int | tuple[int, int]:
    """An image size, S or [H, W] (a list, or a tuple), each side an int in range; returned as
    S or (H, W)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise _bad(path, f"{name} must be an integer or [height, width], got {value!r}")
        return tuple(_int_in(v, f"{name} side", _IMAGE_SIZE_RANGE, path) for v in value)
    return _int_in(value, name, _IMAGE_SIZE_RANGE, path)


def _check_preprocess(image_size, normalize, path, where: str) -> tuple[ImageSize, str]:
    """(image_size, normalize) checked for type and range."""
    size = _size_in(image_size, f"{where}.image_size", path)
    if normalize not in _NORMALIZE:
        raise _bad(path, f"{where}.normalize {normalize!r}: expected one of {_NORMALIZE}")
    return size, normalize


def _check_state(state, architecture: dict, path, name: str) -> dict:
    """The weights: a dict of finite tensors whose head has ``embedding_dim`` rows."""
    if not isinstance(state, Mapping) or not all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in state.items()
    ):
        raise _bad(path, f"{name} must be a dict of named tensors")
    head = state.get(_HEAD_KEY)
    if head is None or head.ndim != 2 or head.shape[0] != architecture["embedding_dim"]:
        shape = None if head is None else tuple(head.shape)
        raise _bad(
            path,
            f"{name}[{_HEAD_KEY!r}] has shape {shape}; the architecture's embedding_dim is "
            f"{architecture['embedding_dim']}",
        )
    _check_finite(state, path)
    return dict(state)


def _check_finite(state: Mapping, path) -> None:
    """Refuse NaN or infinite weights, naming the tensors: they make every embedding NaN."""
    bad = [
        k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]
    if bad:
        named = ", ".join(bad[:_NAMED_KEYS]) + (" ..." if len(bad) > _NAMED_KEYS else "")
        raise _bad(path, f"{len(bad)} weight tensor(s) hold NaN or infinite values: {named}")


def _build(architecture: dict, state: Mapping, path, image_size: ImageSize) -> EmbeddingNet:
    """An EmbeddingNet of ``architecture`` (checked) for ``image_size`` inputs, holding
    ``state`` (classifier keys dropped)."""
    weights = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    model = EmbeddingNet(
        backbone=architecture["backbone"],
        embedding_dim=architecture["embedding_dim"],
        dropout=architecture["dropout"],
        input_size=image_hw(image_size),  # mobilefacenet's GDC kernel depends on it
    )
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


def _epoch_threshold(state: dict, digest, path) -> dict:
    """The threshold validation chose for this checkpoint's own weights, or ``{}``.

    The checkpoint's history holds each validated epoch's figures; the record of the
    checkpoint's epoch is its own, unless the checkpoint was written part-way through the
    next epoch (a signal, an error): then its weights have moved since. Records written before
    thresholds carried their provenance take it from the saved ``eval`` section, which is
    what that validation used.
    """
    epoch, history = state.get("epoch"), state.get("history")
    if state.get("partial") or not isinstance(epoch, int) or not isinstance(history, list):
        return {}
    found = [r for r in history if isinstance(r, Mapping) and r.get("epoch") == epoch]
    validation = found[-1].get("validation") if found else None
    if not isinstance(validation, Mapping):
        return {}
    eval_cfg = state["config"].get("eval")
    saved = (
        {k: eval_cfg.get(k) for k in ("flip", "subtract_mean", "preprocess", "features")}
        if isinstance(eval_cfg, Mapping)
        else {}
    )
    provenance = {"weights_sha256": digest(), **saved, **(validation.get("threshold_for") or {})}
    record = ThresholdRecord.from_dict(
        {**validation, **provenance, "epoch": epoch, "chosen_on": "validation pairs"}, str(path)
    )
    return {} if record is None else record.to_dict()


def _from_training_checkpoint(state: dict, path) -> TrainedModel:
    model_cfg = _section(state["config"], "model", path)
    data_cfg = _section(state["config"], "data", path)
    architecture = _check_architecture(
        {
            k: model_cfg.get(k, 0.0 if k == "dropout" else None)
            for k in ("backbone", "embedding_dim", "dropout")
        },
        path,
    )
    image_size, normalize = _check_preprocess(
        data_cfg.get("image_size", 64), data_cfg.get("normalize", "fixed"), path, "data"
    )
    weights = {
        k: v
        for k, v in _check_mapping(state["model"], path).items()
        if not k.startswith("classifier.")
    }
    trained = TrainedModel(
        model=_build(
            architecture, _check_state(weights, architecture, path, "model"), path, image_size
        ),
        image_size=image_size,
        normalize=normalize,
        kind="checkpoint",
        path=str(path),
        architecture=architecture,
        epoch=state.get("epoch") if isinstance(state.get("epoch"), int) else None,
    )
    trained.verification = _epoch_threshold(state, trained.weights_sha256, path)
    return trained


def _check_mapping(value, path) -> Mapping:
    if not isinstance(value, Mapping):
        raise _bad(path, f"model must be a dict of named tensors, got {type(value).__name__}")
    return value


_WEIGHTS_FIELDS = ("architecture", "preprocess", "state_dict")


def _from_weights_export(state: dict, path) -> TrainedModel:
    """A weights export, every field checked before the network is allocated."""
    if state.get("version") != WEIGHTS_VERSION:
        raise CheckpointError(
            f"{path}: weights export version {state.get('version')!r}; this package reads "
            f"version {WEIGHTS_VERSION}"
        )
    for name in _WEIGHTS_FIELDS:
        if name not in state:
            raise _bad(path, f"a weights export without its '{name}' field")
    architecture = _check_architecture(state["architecture"], path)
    preprocess = state["preprocess"]
    if not isinstance(preprocess, Mapping):
        raise _bad(path, f"preprocess must be a dict, got {type(preprocess).__name__}")
    for name in ("image_size", "normalize"):
        if name not in preprocess:
            raise _bad(path, f"a weights export without its 'preprocess.{name}' field")
    image_size, normalize = _check_preprocess(
        preprocess["image_size"], preprocess["normalize"], path, "preprocess"
    )
    weights = _check_state(state["state_dict"], architecture, path, "state_dict")
    verification = state.get("verification") or {}
    if not isinstance(verification, Mapping):
        raise _bad(path, f"verification must be a dict, got {type(verification).__name__}")
    record = ThresholdRecord.from_dict(verification, str(path))
    if verification and record is None:
        raise _bad(path, f"verification holds no numeric threshold: {dict(verification)!r}")
    if record is not None and not math.isfinite(record.value):
        raise _bad(path, f"verification threshold {record.value!r} is not a finite number")
    return TrainedModel(
        model=_build(architecture, weights, path, image_size),
        image_size=image_size,
        normalize=normalize,
        kind="weights",
        path=str(path),
        architecture=architecture,
        verification=dict(verification),
        epoch=record.epoch if record is not None else None,
    )


def _from_facenet_pytorch(state: dict, path) -> TrainedModel:
    ours = convert_facenet_pytorch_state_dict(state)
    head = ours.get(_HEAD_KEY)
    if head is None:
        raise CheckpointError(f"{path}: a facenet-pytorch file without its last_linear layer")
    architecture = _check_architecture(
        {
            "backbone": "inception_resnet_v1",
            "embedding_dim": int(head.shape[0]),  # 512 for the published files
            "dropout": 0.0,
        },
        path,
    )
    _check_finite(ours, path)
    return TrainedModel(
        model=_build(architecture, ours, path, _PORT_IMAGE_SIZE),
        image_size=_PORT_IMAGE_SIZE,
        normalize="fixed",  # the port's fixed_image_standardization: (x - 127.5) / 128
        kind="facenet-pytorch",
        path=str(path),
        architecture=architecture,
    )


def _mobilefacenet_state(state: dict) -> dict | None:
    """The publisher's state dict in a loaded file (under ``net_state_dict`` or the file
    itself), recognised by a key only its layout has; None for any other file."""
    inner = state.get(_MFN_STATE_KEY, state)
    if not isinstance(inner, Mapping) or MOBILEFACENET_MARKER not in inner:
        return None
    return dict(inner)


def _from_mobilefacenet(state: dict, publisher: dict, path) -> TrainedModel:
    """A Xiaoccer/MobileFaceNet_Pytorch file: its network, input size and standardisation."""
    if not all(torch.is_tensor(v) for v in publisher.values()):
        raise _bad(path, "a MobileFaceNet state dict must hold only tensors")
    # The GDC kernel fixes the input: 7 x 6 -> 112 x 96 (the published file), 7 x 7 -> 112.
    size = mobilefacenet_input_size(publisher)
    if size is None:
        raise _bad(path, "a MobileFaceNet file without its linear7 global depthwise layer")
    size = _size_in(size, "its input size (linear7's kernel x 16)", path)
    ours = convert_mobilefacenet_state_dict(publisher)
    head = ours.get(_HEAD_KEY)
    if head is None:
        raise _bad(path, "a MobileFaceNet file without its linear1 embedding layer")
    architecture = _check_architecture(
        {"backbone": "mobilefacenet", "embedding_dim": int(head.shape[0]), "dropout": 0.0},
        path,
    )
    _check_finite(ours, path)
    epoch = state.get("epoch")
    return TrainedModel(
        model=_build(architecture, ours, path, size),
        image_size=size,
        # The publisher's LFW loader: (x - 127.5) / 128 on RGB, our "fixed" standardisation.
        normalize="fixed",
        kind="mobilefacenet",
        path=str(path),
        architecture=architecture,
        epoch=epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None,
    )


def load_model(path: str | os.PathLike) -> TrainedModel:
    """Load a trained network from a file, on the CPU, in eval mode.

    Args:
        path: a training checkpoint, a weights export (``model.pt``), a facenet-pytorch
            state dict or a Xiaoccer/MobileFaceNet_Pytorch ``.ckpt`` (old-format pickles
            too); read with ``torch.load(weights_only=True)``.

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
    publisher = _mobilefacenet_state(state)
    if publisher is not None:
        return _from_mobilefacenet(state, publisher, path)
    raise CheckpointError(
        f"{path}: not a training checkpoint (no config and model dicts), a weights export, "
        f"a facenet-pytorch state dict or a MobileFaceNet (net_state_dict) file"
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
        # S, or [H, W]: a list, as a checkpoint's configuration stores it
        "preprocess": {
            "image_size": plain_size(trained.image_size),
            "normalize": trained.normalize,
        },
        "verification": dict(trained.verification),  # ThresholdRecord.to_dict() or {}
        "state_dict": {k: v.detach().cpu() for k, v in trained.model.state_dict().items()},
    }
    return save_checkpoint(contents, path)
