"""Files written so that a crash never leaves half of one; user files read within bounds.

Every file the package writes goes through :func:`write_atomic`: a temporary file in the same
folder (``.<name>.<pid>.tmp``), flushed to disk, then ``os.replace``d over the target, so a
crash, ``kill -9`` or full disk leaves the old file or the new one. Every file a user hands in is
opened with :func:`open_regular` (a FIFO, device or socket refused, the size bounded) before a
byte is parsed; JSON and ``.npz`` files are bounded in depth and declared array sizes too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from facenet.errors import DataError

# ".last.pt.<pid>.tmp": what write_atomic writes before the rename.
TEMPORARY_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.tmp$")


MAX_JSON_BYTES = 64 * 2**20
MAX_ARRAY_BYTES = 16 * 2**30  # the declared, uncompressed size of all arrays of one .npz


def open_regular(path, max_bytes: int, fail: Callable[[str], Exception] | None = None) -> IO[bytes]:
    """``path`` opened for binary reading if it is a regular file of at most ``max_bytes``;
    otherwise ``fail(reason)`` is raised (default: a DataError naming the file).

    ``O_NONBLOCK`` keeps a FIFO's open from waiting for a writer; the type is checked on the
    open descriptor, so a file swapped for a FIFO in between is refused too.
    """
    fail = fail or (lambda reason: DataError(f"{path}: {reason}"))
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise fail(err.strerror or str(err)) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise fail("not a regular file (a FIFO, device or folder)")
    if info.st_size > max_bytes:
        os.close(fd)
        raise fail(f"{info.st_size} bytes is larger than the {max_bytes} allowed")
    return os.fdopen(fd, "rb")


def read_json(path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in the regular file ``path``; a DataError naming the file for anything
    unreadable, larger than ``max_bytes`` or nested past the interpreter's recursion limit."""
    with open_regular(path, max_bytes) as fh:
        raw = fh.read()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # RecursionError: nesting a few thousand deep
        reason = "nested too deeply" if isinstance(err, RecursionError) else err
        raise DataError(f"{path}: not readable JSON ({reason})") from None


def _npy_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, budget: int) -> np.ndarray:
    """One array of an ``.npz``, its header checked against ``budget`` bytes before reading."""
    if info.file_size > 100 * info.compress_size + 2**20:  # no array of ours compresses 100x
        raise ValueError(f"'{info.filename}' inflates {info.compress_size} to {info.file_size} B")
    with archive.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        read_header = np.lib.format.read_array_header_1_0
        if version != (1, 0):
            read_header = np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(fh)
        if dtype.hasobject:
            raise ValueError(f"'{info.filename}' holds Python objects")
        size = math.prod(shape) * dtype.itemsize  # a zero side hides a huge one: bound each
        if max(shape, default=0) > budget or size > min(budget, info.file_size):
            raise ValueError(f"'{info.filename}' declares {shape} {dtype}, past its size")
        fh.seek(0)
        return np.lib.format.read_array(fh, allow_pickle=False)


def read_npz(path, what: str, max_bytes: int = MAX_ARRAY_BYTES) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` file, without pickles; the declared shapes and dtypes are
    checked against ``max_bytes`` (all arrays together) before anything is inflated. A
    DataError "``path``: not ``what``" for a damaged archive, a single ``.npy`` array or a size
    past the bound."""
    arrays = {}
    with open_regular(path, max_bytes) as fh:
        try:
            archive = zipfile.ZipFile(fh)
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise ValueError(f"'{info.filename}' is not an array")
                array = _npy_member(archive, info, max_bytes)
                max_bytes -= array.nbytes
                arrays[info.filename[: -len(".npy")]] = array
        except (zipfile.BadZipFile, EOFError, ValueError, OSError) as err:
            raise DataError(f"{path}: not {what} ({err})") from None
    return arrays


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` survive a power cut."""
    # Some platforms cannot open a folder; the rename itself is still atomic.
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """``write(fh)`` fills a temporary binary file that then replaces ``path``; on any error the
    temporary file is removed and ``path`` left untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a stale or planted one (a link): never written through
        with open(tmp, "xb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:  # OSError, KeyboardInterrupt or a bug mid-write: no temporary left
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 with :func:`write_atomic`."""
    return write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None, through dicts, lists and tuples."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ------------------------------------------------------------------- outputs apart from inputs
# The check every command makes before any work: no output is one of its inputs or lies inside
# a folder it reads. Paths are compared as the file system sees them, by ``(st_dev, st_ino)``, so
# a symbolic link anywhere on an output's path, a hard link to an input file and a second mount of
# an input folder are caught where comparing names would miss them (``--out`` naming the
# checkpoint, ``DST/loose_crop`` a link to SRC).

# an input flag (or argument name) -> its path, a list of paths (a repeatable flag) or None
Inputs = Mapping[str, "str | os.PathLike | list | None"]


def _identity(path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` names (links followed); None where nothing is."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    return info.st_dev, info.st_ino


def _identities(inputs: Inputs) -> dict[tuple[int, int], str]:
    """Each existing input's identity -> how to name it (``--checkpoint x.pt``)."""
    named = {}
    for flag, paths in inputs.items():
        for path in paths if isinstance(paths, list) else [paths]:
            if path is not None and (key := _identity(path)) is not None:
                named.setdefault(key, f"{flag} {path}")
    return named


def check_not_inputs(outputs: Iterable, files: Inputs, folders: Inputs | None = None) -> None:
    """Refuse any of ``outputs`` that is one of the ``files`` or ``folders`` (also through a
    link or a hard link), or lies inside one of the ``folders`` (also through a link on its
    path). An output that does not exist yet is placed by the folders above it that do."""
    folders = folders or {}
    is_input = _identities({**files, **folders})
    holds_input = _identities(folders)
    for output in outputs:
        real = Path(os.path.realpath(output))  # links on the path resolved
        if (name := is_input.get(_identity(output))) is not None:
            raise DataError(f"{output} is the input {name}: choose another output")
        for folder in real.parents:
            if (name := holds_input.get(_identity(folder))) is not None:
                raise DataError(
                    f"{output} lies inside the input folder {name}: choose an output outside it"
                )


def check_no_links_below(root, paths: Iterable | None = None) -> None:
    """Refuse a symbolic link among the folders from ``root`` down to each of ``paths`` (without
    ``paths``: among all folders below ``root``): a write below it would land where the link
    points (``DST/loose_crop`` or ``DST/anna`` a link into the user's photos). ``root`` itself
    may be a link: the user named it. Files are replaced, never written through
    (:func:`write_atomic`), so a link or hard link at a file's own name is not refused here."""
    root = Path(root)
    if paths is None:  # os.walk lists a link to a folder among the folders, and stays out of it
        folders = [Path(parent, name) for parent, names, _ in os.walk(root) for name in names]
    else:  # parents of root/a/b/c below root: root/a/b, root/a
        folders = [p for path in paths for p in Path(path).parents if root in p.parents]
    for folder in folders:
        if folder.is_symlink():
            raise DataError(
                f"{folder} is a symbolic link inside {root}, which this command writes into: "
                "remove the link or choose another output"
            )
