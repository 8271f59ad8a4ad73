"""The check every command makes before any work: no output is one of its inputs or lies inside
a folder it reads. Paths are compared as the file system sees them, by ``(st_dev, st_ino)``, so
a symbolic link anywhere on an output's path, a hard link to an input file and a second mount of
an input folder are caught where comparing names would miss them (``--out`` naming the
checkpoint, ``DST/loose_crop`` a link to SRC).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from facenet.errors import DataError

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
