"""Checkpoints: written atomically, loaded with ``weights_only=True``.

A checkpoint holds plain contents only (state dicts, the config as a dict, counters, RNG states),
so it loads without unpickling arbitrary objects. Writing goes to a temporary file in the same
folder, is flushed to disk, then ``os.replace``d over the target: a crash or a full disk at any
moment leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "rng_state", "set_rng_state"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or was refused on loading."""


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, ``os.replace``).

    Args:
        state: plain contents: tensors, numbers, strings, lists, tuples and dicts of them.
        path: the target file; its folder must exist.

    Raises:
        CheckpointError: the folder cannot be written or the disk is full; the temporary file
            is removed and an existing checkpoint at ``path`` is left untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"cannot write checkpoint {path}: {err.strerror or err}; "
            f"{'the previous checkpoint is intact' if path.exists() else 'nothing was written'}"
        ) from err
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with ``torch.load(weights_only=True)``.

    Args:
        path: the checkpoint file.
        map_location: where tensors go (default: the CPU).

    Raises:
        CheckpointError: the file is missing, truncated, or holds objects other than plain
            contents (a pickle that would run code is refused before anything runs).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refused to load {path}: it holds objects other than tensors and plain containers "
            f"(loaded with weights_only=True): {str(err).splitlines()[0]}"
        ) from None
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"cannot read checkpoint {path}: {err}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of contents, got {type(state).__name__}")
    return state


def rng_state() -> dict:
    """The random generators' states (torch CPU and CUDA, numpy, random) as plain contents."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore the generators saved by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
