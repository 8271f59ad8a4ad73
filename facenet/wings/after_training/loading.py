"""A trained model from a file, ready to embed, read with ``torch.load(weights_only=True)``.

:func:`load_model` reads a training checkpoint (architecture and preprocessing from its saved
``model`` and ``data`` sections), a weights export (:func:`save_weights`), a facenet-pytorch
state dict (Inception-ResNet-v1, 160 px) or a Xiaoccer/MobileFaceNet_Pytorch file (112 x 96).
Every number a file gives is checked before a network is allocated. The classifier head is
left out: the model returns embeddings (B, D).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from facenet.checkpoint import is_state_dict, load_checkpoint, save_checkpoint, weights_digest
from facenet.data.images import build_transform
from facenet.errors import CheckpointError, shown, some_names
from facenet.evaluation.report import ThresholdRecord
from facenet.models.backbones import BACKBONES
from facenet.models.embedding import EmbeddingNet
from facenet.sizes import plain_size
from facenet.wings.publishers.ports import Port, find_port

WEIGHTS_FORMAT = "facenet-weights"
WEIGHTS_VERSION = 1  # bumped when the layout changes
# The configuration's ranges (this layer does not import it): a crafted file asking for a
# 3e7-wide head or 20000 px inputs would otherwise take gigabytes before being refused.
_IMAGE_SIZE_RANGE = (8, 4096)
_EMBEDDING_DIM_RANGE = (1, 65536)
_NORMALIZE = ("fixed", "imagenet")
_HEAD_KEY = "embedding.linear.weight"
EMBED_PREPROCESS = "resize"  # how TrainedModel.transform prepares images


@dataclass
class TrainedModel:
    """An embedding network in eval mode and how its input must be prepared.

    ``image_size`` is S or (H, W); ``kind`` is "checkpoint", "weights", "facenet-pytorch" or
    "mobilefacenet"; ``architecture`` is ``{"backbone", "embedding_dim", "dropout"}``;
    ``verification`` is the saved threshold (:meth:`ThresholdRecord.to_dict`) or empty.
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
        return self.model.embed_dim

    def transform(self):
        """The evaluation transform: uint8 (3, h, w) -> float (3, S_h, S_w)."""
        return build_transform(self.image_size, train=False, normalize=self.normalize)

    def weights_sha256(self) -> str:
        """:func:`weights_digest`, computed once."""
        if getattr(self, "_digest", None) is None:
            self._digest = weights_digest(self.model)
        return self._digest

    def threshold_record(self) -> ThresholdRecord | None:
        return ThresholdRecord.from_dict(self.verification, source=self.path)

    def preparation(self, flip: bool = False, subtract_mean: bool = False) -> dict:
        """What a threshold must have been chosen for to apply to this model's embeddings
        prepared by :meth:`transform` (see :meth:`ThresholdRecord.differences`)."""
        return {
            "weights_sha256": self.weights_sha256(),
            "epoch": self.epoch,
            "flip": bool(flip),
            "subtract_mean": bool(subtract_mean),
            "preprocess": EMBED_PREPROCESS,
            "features": "unit",
        }


def _bad(path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}")


def _mapping(value, name: str, path) -> Mapping:
    if not isinstance(value, Mapping):
        raise _bad(path, f"{name} must be a dict, got {type(value).__name__}")
    return value


def _fields(section: Mapping, names: tuple[str, ...], path, prefix: str = "") -> list:
    """The values of ``names`` in a weights export's ``section``, each required."""
    for name in names:
        if name not in section:
            raise _bad(path, f"a weights export without its '{prefix}{name}' field")
    return [section[name] for name in names]


def _int_in(value, name: str, bounds: tuple[int, int], path) -> int:
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, f"{name} must be an integer in [{low}, {high}], got {shown(value)}")
    if not low <= value <= high:
        raise _bad(path, f"{name} {shown(value)} is out of range; allowed: [{low}, {high}]")
    return value


def _check_architecture(architecture, path) -> dict:
    architecture = _mapping(architecture, "architecture", path)
    backbone = architecture.get("backbone")
    if backbone not in BACKBONES:
        raise _bad(path, f"architecture.backbone {shown(backbone)}: valid backbones: {BACKBONES}")
    dim = _int_in(
        architecture.get("embedding_dim"), "architecture.embedding_dim", _EMBEDDING_DIM_RANGE, path
    )
    dropout = architecture.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise _bad(path, f"architecture.dropout must be a number in [0, 1), got {shown(dropout)}")
    if not 0.0 <= dropout < 1.0:
        raise _bad(path, f"architecture.dropout {shown(dropout)} is out of range; allowed: [0, 1)")
    return {"backbone": backbone, "embedding_dim": dim, "dropout": float(dropout)}


def _size_in(value, name: str, path) -> int | tuple[int, int]:
    """S or [H, W] (list or tuple) checked, returned as S or (H, W)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise _bad(path, f"{name} must be an integer or [height, width], got {shown(value)}")
        return tuple(_int_in(v, f"{name} side", _IMAGE_SIZE_RANGE, path) for v in value)
    return _int_in(value, name, _IMAGE_SIZE_RANGE, path)


def _check_state(state, architecture: dict, path, name: str) -> dict:
    """Named tensors whose head has ``embedding_dim`` rows."""
    if not is_state_dict(state):
        raise _bad(path, f"{name} must be a dict of named tensors")
    head = state.get(_HEAD_KEY)
    if head is None or head.ndim != 2 or head.shape[0] != architecture["embedding_dim"]:
        shape = None if head is None else tuple(head.shape)
        raise _bad(
            path,
            f"{name}[{_HEAD_KEY!r}] has shape {shape}; the architecture's embedding_dim is "
            f"{architecture['embedding_dim']}",
        )
    return state


def _trained(architecture: dict, state: Mapping, path, preprocess: tuple, kind: str, *fields):
    """A TrainedModel whose EmbeddingNet of ``architecture`` holds ``state`` less its classifier,
    ``preprocess`` its (image size, normalize), ``fields`` its verification and epoch; NaN or
    infinite weights are refused (they make every embedding NaN)."""
    weights = {k: v for k, v in state.items() if not k.startswith("classifier.")}
    bad = [k for k, v in weights.items() if not v.isfinite().all()]  # complex NaN included
    if bad:
        raise _bad(
            path, f"{len(bad)} weight tensor(s) hold NaN or infinite values: {some_names(bad)}"
        )
    model = EmbeddingNet(**architecture, input_size=preprocess[0])
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(
            f"{path}: its weights do not fit its saved architecture: "
            + " ".join(line.strip() for line in str(err).splitlines()[:2])
        ) from None
    return TrainedModel(model.eval(), *preprocess, kind, str(path), architecture, *fields)


def _section(config: Mapping, name: str, path) -> Mapping:
    section = config.get(name)
    if not isinstance(section, Mapping):
        raise CheckpointError(f"{path}: its saved configuration has no '{name}' section")
    return section


def _epoch_threshold(state: dict, digest, path) -> dict:
    """The threshold validation chose for this checkpoint's own weights, or ``{}``: the history
    record of its epoch, unless it was written part-way through the next one (its weights have
    moved since). Older records take their provenance from the saved ``eval`` section."""
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
    record = {**validation, "weights_sha256": digest(), **saved, "epoch": epoch}
    record = ThresholdRecord.from_dict({**record, "chosen_on": "validation pairs"}, str(path))
    return {} if record is None else record.to_dict()


def _from_saved(state: dict, path) -> TrainedModel:
    """A training checkpoint or a weights export, every field checked before the network is
    allocated."""
    export = state.get("format") == WEIGHTS_FORMAT
    if export:
        if state.get("version") != WEIGHTS_VERSION:
            raise CheckpointError(
                f"{path}: weights export version {shown(state.get('version'))}; this package reads "
                f"version {WEIGHTS_VERSION}"
            )
        names = ("architecture", "preprocess", "state_dict")
        architecture, preprocess, weights = _fields(state, names, path)
        preprocess = _mapping(preprocess, "preprocess", path)
        preprocess = _fields(preprocess, ("image_size", "normalize"), path, "preprocess.")
        verification = dict(_mapping(state.get("verification") or {}, "verification", path))
    else:
        names = ("model", "data", "model")
        architecture = _section(state["config"], "model", path)
        data_cfg = _section(state["config"], "data", path)
        weights = state["model"]
        preprocess = data_cfg.get("image_size", 64), data_cfg.get("normalize", "fixed")
        verification = {}
    architecture = _check_architecture(architecture, path)
    size, normalize = _size_in(preprocess[0], f"{names[1]}.image_size", path), preprocess[1]
    if normalize not in _NORMALIZE:
        raise _bad(path, f"{names[1]}.normalize {shown(normalize)}: expected one of {_NORMALIZE}")
    weights = _check_state(weights, architecture, path, names[2])
    record = ThresholdRecord.from_dict(verification, str(path))
    if verification and record is None:
        raise _bad(path, f"verification holds no numeric threshold: {shown(verification)}")
    epoch = getattr(record, "epoch", None) if export else state.get("epoch")
    kind = "weights" if export else "checkpoint"
    epoch = epoch if isinstance(epoch, int) else None
    trained = _trained(architecture, weights, path, (size, normalize), kind, verification, epoch)
    if not export:
        trained.verification = _epoch_threshold(state, trained.weights_sha256, path)
    return trained


def _from_port(port: Port, weights: dict, contents: dict, path) -> TrainedModel:
    """A publisher's weights on EmbeddingNet keys; its head gives D."""
    if not is_state_dict(weights):
        raise _bad(path, f"a {port.publisher} state dict must hold only tensors")
    try:
        size = _size_in(port.input_size(weights), "its input size", path)
    except ValueError as err:
        raise _bad(path, str(err)) from None
    ours = port.convert(weights)
    head = ours.get(_HEAD_KEY)
    if head is None or head.ndim != 2:
        raise _bad(path, f"a {port.publisher} file without its {port.head_layer} layer (D, F)")
    architecture = _check_architecture(
        {"backbone": port.backbone, "embedding_dim": head.shape[0]}, path
    )
    epoch = contents.get("epoch")
    epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None
    return _trained(architecture, ours, path, (size, "fixed"), port.kind, {}, epoch)


def load_model(path: str | os.PathLike) -> TrainedModel:
    """Load a trained network from a file (any kind the module names, old-format pickles too),
    on the CPU, in eval mode.

    Raises:
        CheckpointError: a missing, damaged or refused file, or one of none of these kinds.
    """
    state = load_checkpoint(path, map_location="cpu")
    if state.get("format") == WEIGHTS_FORMAT or (
        isinstance(state.get("config"), Mapping) and isinstance(state.get("model"), Mapping)
    ):
        return _from_saved(state, path)
    port = find_port(state)
    if port is not None:
        return _from_port(*port, state, path)
    raise CheckpointError(
        f"{path}: not a training checkpoint (no config and model dicts), a weights export, "
        f"a facenet-pytorch state dict or a MobileFaceNet (net_state_dict) file"
    )


def save_weights(trained: TrainedModel, path: str | os.PathLike) -> Path:
    """Write a weights export atomically: the weights, architecture, preprocessing and
    threshold, as tensors, strings and numbers only (``torch.load(path, weights_only=True)
    ["state_dict"]`` is a plain state dict)."""
    contents = {
        "format": WEIGHTS_FORMAT,
        "version": WEIGHTS_VERSION,
        "architecture": dict(trained.architecture),
        "preprocess": {
            "image_size": plain_size(trained.image_size),
            "normalize": trained.normalize,
        },
        "verification": dict(trained.verification),
        "state_dict": {k: v.detach().cpu() for k, v in trained.model.state_dict().items()},
    }
    return save_checkpoint(contents, path)
