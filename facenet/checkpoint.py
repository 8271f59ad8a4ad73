"""Checkpoints: written atomically, loaded with ``weights_only=True``.

A checkpoint holds plain contents only (state dicts, the config as a dict, counters, RNG states),
so it loads without unpickling arbitrary objects. Writing goes through
:func:`facenet.files.write_atomic`: a temporary file in the same folder, flushed to disk, then
``os.replace``d over the target, and the folder entry is flushed too: a crash, a ``kill -9``
or a full disk at any moment leaves either the old file or the new one, never a torn one. A
temporary file left by a killed writer is removed by
:func:`remove_stale_temporary_files`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from facenet.errors import CheckpointError
from facenet.files import TEMPORARY_NAME, write_atomic

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "remove_stale_temporary_files",
    "rng_state",
    "set_rng_state",
]


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` atomically (:func:`facenet.files.write_atomic`).

    Args:
        state: plain contents: tensors, numbers, strings, lists, tuples and dicts of them.
        path: the target file; its folder must exist.

    Raises:
        CheckpointError: the folder cannot be written or the disk is full; the temporary file
            is removed and an existing checkpoint at ``path`` is left untouched.
    """
    path = Path(path)
    try:
        return write_atomic(path, lambda fh: torch.save(state, fh))
    except OSError as err:  # write_atomic has removed its temporary file
        raise CheckpointError(
            f"cannot write checkpoint {path}: {err.strerror or err}; "
            f"{'the previous checkpoint is intact' if path.exists() else 'nothing was written'}"
        ) from err


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_temporary_files(folder: str | os.PathLike) -> list[Path]:
    """Remove the temporary files of :func:`save_checkpoint` writers that no longer run.

    A writer killed mid-write (``kill -9``, power loss) leaves ``.<name>.<pid>.tmp`` behind;
    the checkpoint itself is intact. Files of this process and of live processes are kept.

    Args:
        folder: the run directory.

    Returns:
        The removed paths.
    """
    removed = []
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = TEMPORARY_NAME.match(entry.name)
        if not match or not entry.is_file():
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry)
    return removed


def _unpickler_detail(err: pickle.UnpicklingError) -> str:
    """The one informative line of torch's weights_only error (its advice runs to a page)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for line in lines:
        if "unsupported global" in line.lower() or line.startswith("Unsupported operand"):
            return line.split(" Please use")[0]
    return lines[-1] if lines else type(err).__name__


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
        detail = _unpickler_detail(err)
        if "unsupported global" in detail.lower():
            raise CheckpointError(
                f"refused to load {path}: it holds objects other than tensors and plain "
                f"containers (loaded with weights_only=True): {detail}"
            ) from None
        raise CheckpointError(
            f"refused to load {path}: not a torch.save file of plain contents, or a damaged one "
            f"(loaded with weights_only=True): {detail}"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
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
    """Restore the generators saved by :func:`rng_state`.

    Args:
        state: the dict :func:`rng_state` returned (possibly through a checkpoint).
    """
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
