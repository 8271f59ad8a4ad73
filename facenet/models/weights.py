"""Initial weights of an :class:`~facenet.models.embedding.EmbeddingNet` from a local
state-dict file, in our layout or a publisher's (whose layouts are a wing, read only here).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from facenet.checkpoint import is_state_dict, load_weights_only
from facenet.errors import WeightsError, some_names
from facenet.registry import load

_PORTS = "facenet.wings.publishers.ports:PORTS"
_FIND_PORT = "facenet.wings.publishers.ports:find_port"


def _read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict a weights file holds, itself or under "model"/"state_dict"."""
    obj = load_weights_only(path, what="weights file", error=WeightsError)
    if isinstance(obj, Mapping) and not is_state_dict(obj):
        for key in (
            "model",
            "state_dict",
            *(port.file_key for port in load(_PORTS) if port.file_key),
        ):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not is_state_dict(obj):
        raise WeightsError(
            f"weights file {path}: expected a state dict (a mapping of parameter names to "
            f"tensors), or a checkpoint holding one under 'model' or 'state_dict'"
        )
    return dict(obj)


def _check_fits(module: nn.Module, state: dict[str, torch.Tensor], path, what: str) -> None:
    expected = module.state_dict()
    found = {
        "missing keys": [k for k in expected if k not in state],
        "unexpected keys": [k for k in state if k not in expected],
        "shape mismatches": [
            f"{k}: file {tuple(state[k].shape)}, model {tuple(v.shape)}"
            for k, v in expected.items()
            if k in state and state[k].shape != v.shape
        ],
    }
    problems = [f"{len(keys)} {kind}: {some_names(keys)}" for kind, keys in found.items() if keys]
    if problems:
        raise WeightsError(f"weights file {path} does not fit {what}: " + "; ".join(problems))


def load_weights(net: nn.Module, path: str | os.PathLike | None, head: bool) -> None:
    """The backbone (and with ``head`` the embedding head) of ``net`` from a weights file in our
    layout or a publisher's; a backbone's own state dict is read as it is."""
    if path is None:
        raise ValueError("EmbeddingNet: weights_head=True needs a weights file")
    state = _read_state_dict(path)
    port = load(_FIND_PORT)(state)
    state = state if port is None else port[0].convert(state)
    prefix = "backbone." if any(k.startswith("backbone.") for k in state) else ""
    drop = getattr(net.backbone, "source_head_keys", ())
    parts = [(net.backbone, prefix, drop, f"backbone {net.backbone_name!r}")]
    if head:
        parts.append((net.embedding, "embedding.", (), "the embedding head (model.embedding_dim)"))
    for module, prefix, drop, what in parts:
        part = {
            k.removeprefix(prefix): v
            for k, v in state.items()
            if k.startswith(prefix) and not k.removeprefix(prefix).startswith(drop)
        }
        if not part and prefix == "embedding.":
            raise WeightsError(
                f"weights file {path} holds no embedding head (last_linear.*/last_bn.* or "
                "embedding.*); set model.weights_head: false to start the head afresh"
            )
        _check_fits(module, part, path, what)
        module.load_state_dict(part)
