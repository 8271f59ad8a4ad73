"""Files written so that a crash never leaves half of one, and strict JSON.

Every file the package writes goes through :func:`write_atomic`: a temporary file in the same
folder (``.<name>.<pid>.tmp``), flushed to disk, then ``os.replace``d over the target, so a
crash, ``kill -9`` or full disk leaves the old file or the new one.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# ".last.pt.<pid>.tmp": what write_atomic writes before the rename.
TEMPORARY_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.tmp$")


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
