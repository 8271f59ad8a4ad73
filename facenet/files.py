"""Writing files so that a crash never leaves half of one, and JSON that is strict.

Every file the package writes (checkpoints, configurations, pairs files, metrics, summaries,
caches) goes through :func:`write_atomic`: the contents go to a temporary file in the same
folder (``.<name>.<pid>.tmp``), are flushed to disk, and the temporary file is ``os.replace``d
over the target. A crash, ``kill -9`` or full disk at any moment leaves the old file or the new
one. :func:`json_safe` turns non-finite floats into ``null`` so the JSON stays standard.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["TEMPORARY_NAME", "write_atomic", "write_text_atomic", "json_safe"]

# ".last.pt.<pid>.tmp": the temporary name write_atomic writes to before the rename.
TEMPORARY_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.tmp$")


def _temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a power cut after it keeps the new entry)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open a folder; the rename itself is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Write a file atomically: ``write(fh)`` fills a temporary file that replaces ``path``.

    Args:
        path: the target file; its folder must exist.
        write: called with the temporary file opened for binary writing.

    Raises:
        OSError: the folder cannot be written or the disk is full; the temporary file is
            removed and an existing file at ``path`` is left untouched.
    """
    path = Path(path)
    tmp = _temporary_path(path)
    try:
        with open(tmp, "wb") as fh:
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
    """Write ``text`` (UTF-8) to ``path`` atomically; see :func:`write_atomic`.

    Args:
        path: the target file.
        text: its contents.
    """
    return write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats replaced by None, through dicts, lists and tuples.

    Args:
        value: a float, dict, list, tuple or any other JSON-serialisable value.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
