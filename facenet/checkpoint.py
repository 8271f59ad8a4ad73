"""Checkpoints: written atomically (:func:`facenet.files.write_atomic`: a crash at any moment
leaves the old file or the new one), loaded with ``weights_only=True``.

A checkpoint holds plain contents only (state dicts, the config as a dict, counters, RNG
states), so loading it unpickles no arbitrary object; a file whose pickle would run code is
refused before anything runs.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import pickletools
import random
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from facenet.errors import CheckpointError
from facenet.files import TEMPORARY_NAME, write_atomic


def save_checkpoint(state: dict, path: str | os.PathLike) -> Path:
    """Write ``state`` (tensors, numbers, strings and containers of them) to ``path``
    atomically; its folder must exist.

    Raises:
        CheckpointError: the folder cannot be written or the disk is full; an existing
            checkpoint at ``path`` is left untouched.
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
        pass
    return True


def remove_stale_temporary_files(folder: str | os.PathLike) -> list[Path]:
    """Remove (and return) the ``.<name>.<pid>.tmp`` files that writers killed mid-write left
    in ``folder``; those of this process and of live processes are kept."""
    removed = []
    for entry in Path(folder).iterdir() if Path(folder).is_dir() else ():
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


# The legacy format's pickles (magic number, protocol, system info, contents, storage keys)
# before the raw storage bytes; a plain pickle file has one.
_LEGACY_PICKLES = 5
_REFUSED_OPERATION = "its pickle uses operations that weights_only loading does not allow"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _pickle_globals(fh: BinaryIO, names: set[str]) -> None:
    """Add the globals (``module.name``: GLOBAL, protocol 4's STACK_GLOBAL) of the pickle at
    ``fh``'s position to ``names``, read statically (nothing runs); ValueError for no pickle."""
    last_two: list[str | None] = [None, None]  # the two latest stack pushes, strings or None
    memo: dict[int, str | None] = {}
    for opcode, arg, _ in pickletools.genops(fh):
        name = opcode.name
        if name == "GLOBAL":  # protocols 0-3: "module name" in the argument
            names.add(arg.replace(" ", "."))
        elif name == "STACK_GLOBAL" and all(isinstance(s, str) for s in last_two):
            names.add(".".join(last_two))  # protocol 4+: module and name pushed just before
        if name == "MEMOIZE":
            memo[len(memo)] = last_two[-1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = last_two[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            last_two = [last_two[-1], memo.get(int(arg))]
        else:
            last_two = [last_two[-1], arg if "UNICODE" in name else None]


def _refusal(path: Path, what: str, detail: str) -> str:
    # Never torch's advice to retry with weights_only=False: that is the unsafe path.
    return (
        f"refused to load {what} {path}: it holds objects other than tensors and plain "
        f"containers (loaded with weights_only=True): {detail}"
    )


def some_names(names: list[str], shown: int = 8) -> str:
    """The first ``shown`` names and how many more: enough to recognise, one line at most."""
    more = f", ... ({len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _legacy_refusal(path: Path, what: str, error: type[Exception]) -> Exception:
    """The error for a non-zip file that weights_only refused (torch names unsafe globals for
    zip files only): the globals its pickles reference, or a damaged or foreign file."""
    names: set[str] = set()
    with path.open("rb") as fh:  # buffered: peek() tells where the pickles end
        try:
            for index in range(_LEGACY_PICKLES):
                if index and not fh.peek(1):  # a plain pickle ends here, a legacy file not
                    break
                _pickle_globals(fh, names)
        except ValueError:
            return error(f"cannot read {what} {path}: not a torch.save file, or a damaged one")
    # Which of them torch refused is only in its error text: name all the file references.
    detail = f"unsupported GLOBAL among those its pickle references: {some_names(sorted(names))}"
    return error(_refusal(path, what, detail if names else _REFUSED_OPERATION))


def load_weights_only(
    path: str | os.PathLike,
    what: str = "checkpoint",
    error: type[Exception] = CheckpointError,
    map_location: Any = "cpu",
) -> Any:
    """``torch.load(path, weights_only=True)`` of a zip or legacy-format file, raising ``error``
    (one line naming ``what`` and the file) when it is missing, damaged, or refused; a file
    whose pickle would run code is refused before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    with path.open("rb") as fh:
        zipped = fh.read(4) == b"PK\x03\x04"
    try:
        unsafe = zipped and torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (RuntimeError, ValueError, OSError) as err:  # a torn archive, a TorchScript file
        raise error(f"cannot read {what} {path}: {_first_line(err)}") from None
    if unsafe:
        raise error(_refusal(path, what, f"unsupported GLOBAL {some_names(sorted(unsafe))}"))
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        if not zipped:
            raise _legacy_refusal(path, what, error) from None
        # No unsafe global, yet refused: an operation (or a class pushed at run time) that
        # weights_only does not allow.
        raise error(_refusal(path, what, _REFUSED_OPERATION)) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as err:
        raise error(f"cannot read {what} {path}: {_first_line(err)}") from None


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """A checkpoint's dict (:func:`load_weights_only`); CheckpointError otherwise."""
    state = load_weights_only(path, map_location=map_location)
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
