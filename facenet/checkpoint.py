"""Checkpoints: written atomically (:func:`facenet.files.write_atomic`: a crash at any moment
leaves the old file or the new one), loaded with ``weights_only=True``.

A checkpoint holds plain contents only (state dicts, the config as a dict, counters, RNG
states), so loading it unpickles no arbitrary object; a file whose pickle would run code, or
whose tensors declare more bytes than the file holds, is refused before anything runs or is
allocated.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from facenet.errors import CheckpointError, some_names
from facenet.files import TEMPORARY_NAME, open_regular, write_atomic


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
        if match and entry.is_file() and not _pid_alive(int(match["pid"])):  # this process too
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed


# The legacy format's pickles (magic number, protocol, system info, contents, storage keys)
# before the raw storage bytes; a plain pickle file has one.
_LEGACY_PICKLES = 5
_REFUSED_OPERATION = "its pickle uses operations that weights_only loading does not allow"
MAX_CHECKPOINT_BYTES = 16 * 2**30


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class _Inert:
    """What a scanned pickle's globals become: it takes any arguments, items and state."""

    def __init__(self, *args, **kwargs):
        pass

    __setstate__ = __setitem__ = append = extend = __init__


class _Scanner(pickle._Unpickler):
    """Builds one pickle from inert stand-ins, recording its globals and persistent ids (torch's
    storages); nothing the file names runs. Pure Python: a dict memo, not sized by the file."""

    def __init__(self, fh: BinaryIO, names: set[str], persistent_ids: list):
        super().__init__(fh)
        self.names, self.persistent_ids = names, persistent_ids

    def find_class(self, module: str, name: str) -> type:
        self.names.add(f"{module}.{name}")
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        self.persistent_ids.append(pid)


def _refusal(path: Path, what: str, detail: str) -> str:
    # Never torch's advice to retry with weights_only=False: that is the unsafe path.
    return (
        f"refused to load {what} {path}: it holds objects other than tensors and plain "
        f"containers (loaded with weights_only=True): {detail}"
    )


def is_state_dict(obj: Any) -> bool:
    """Whether ``obj`` maps parameter names (strings) to tensors."""
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()
    )


def _declared_bytes(fh: BinaryIO, zipped: bool, names: set[str]) -> int:
    """What a file's storages declare (the legacy format allocates it before reading them):
    zip members' sizes, or a non-zip file's storage elements (at least a byte each); its
    pickles' globals are added to ``names``."""
    if zipped:
        return sum(member.file_size for member in zipfile.ZipFile(fh).infolist())
    storages: list = []
    for index in range(_LEGACY_PICKLES):
        if index and not fh.peek(1):  # a plain pickle ends here, a legacy file not
            break
        _Scanner(fh, names, storages).load()
    # ("storage", storage type, key, location, elements, view): elements once per key
    declared = {pid[2]: pid[4] for pid in storages if isinstance(pid, tuple) and len(pid) > 4}
    return sum(n for n in declared.values() if isinstance(n, int))


def _check_tensors(obj: Any, file_bytes: int, fail) -> None:
    """Refuse tensors that are not dense, or larger than the file (expanded views, stride 0),
    before anything materialises them; nested containers are walked without recursion."""
    todo, seen = [obj], set()
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if torch.is_tensor(item):
            if item.layout != torch.strided or item.numel() * item.element_size() > file_bytes:
                raise fail(
                    f"a {item.layout} tensor of shape {tuple(item.shape)} is not dense "
                    f"within the file's {file_bytes} bytes (an expanded or crafted one)"
                )
        elif isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, (list, tuple)):
            todo += item


def _descriptor_path(fh: BinaryIO, path: Path) -> str | Path:
    """A name that opens the file ``fh`` holds open (Linux's ``/proc/self/fd``), else
    ``path``."""
    fd_path = f"/proc/self/fd/{fh.fileno()}"
    return fd_path if os.path.exists(fd_path) else path


def load_weights_only(
    path: str | os.PathLike,
    what: str = "checkpoint",
    error: type[Exception] = CheckpointError,
    map_location: Any = "cpu",
) -> Any:
    """``torch.load(path, weights_only=True)`` of a zip or legacy-format file, raising ``error``
    (one line naming ``what`` and the file) when it is missing, damaged, or refused; a file
    whose pickle would run code, or whose tensors declare more than the file holds, is refused
    before anything runs or is allocated (zip files are memory-mapped)."""
    path = Path(path)

    def fail(reason: str) -> Exception:
        return error(f"cannot read {what} {path}: {reason}")

    names: set[str] = set()
    with open_regular(path, MAX_CHECKPOINT_BYTES, fail) as fh:
        # Every read below goes through the descriptor checked here: a file put in the
        # name's place in between is never the one loaded.
        opened = _descriptor_path(fh, path)
        zipped, size = fh.peek(4)[:4] == b"PK\x03\x04", os.fstat(fh.fileno()).st_size
        try:  # any error of these readers: a torn archive, a TorchScript file, a damaged pickle
            unsafe = zipped and torch.serialization.get_unsafe_globals_in_checkpoint(opened)
            declared = _declared_bytes(fh, zipped, names)
        except Exception as err:
            detail = first_line(err) if zipped else "not a torch.save file, or a damaged one"
            raise fail(detail) from None
        if unsafe:
            raise error(_refusal(path, what, f"unsupported GLOBAL {some_names(sorted(unsafe))}"))
        if declared > size:
            raise fail(f"its tensors declare {declared} bytes, more than the file's {size}")
        try:
            fh.seek(0)
            source = opened if zipped else fh  # mmap needs a name
            obj = torch.load(source, map_location=map_location, weights_only=True, mmap=zipped)
        except pickle.UnpicklingError:
            # Refused without a named global (torch names them for zip files only): an
            # operation, or a class pushed at run time, that weights_only does not allow.
            detail = (
                f"unsupported GLOBAL among those its pickle references: {some_names(sorted(names))}"
            )
            raise error(_refusal(path, what, detail if names else _REFUSED_OPERATION)) from None
        except Exception as err:  # torch's reader on a damaged file: EOF, struct or index errors
            raise fail(first_line(err)) from None
    _check_tensors(obj, size, fail)
    return obj


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """A checkpoint's dict (:func:`load_weights_only`); CheckpointError otherwise."""
    state = load_weights_only(path, map_location=map_location)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of contents, got {type(state).__name__}")
    return state


def rng_state() -> dict:
    """The random generators' states (torch CPU, this process's CUDA device, numpy, random) as
    plain contents. Each rank saves its own device's generator (the checkpoint gathers the
    ranks'), so a run resumes on any number of visible GPUs."""
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
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's: set_device's
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
    saved = state.get("cuda") if torch.cuda.is_available() else None
    if isinstance(saved, (list, tuple)):  # older checkpoints: every visible device's state
        index = torch.cuda.current_device()
        saved = saved[index] if index < len(saved) else None  # fewer devices saved: fresh
    if saved is not None:
        torch.cuda.set_rng_state(saved)


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of an :class:`EmbeddingNet`'s weights (names, dtypes, shapes, bytes), the
    classifier left out: a training model, its checkpoint and their export give one digest."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        if key.startswith("classifier."):
            continue
        flat = tensor.detach().cpu().reshape(-1)
        digest.update(f"{key}:{flat.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(flat.view(torch.uint8).numpy())
    return digest.hexdigest()
