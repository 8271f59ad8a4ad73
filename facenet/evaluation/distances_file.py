"""Pair distances measured elsewhere, read from a file: ``(distances, issame)``.

An ``.npz`` with arrays ``distances`` and ``issame`` (read without pickles), or a ``.csv`` of
``distance,issame`` rows (issame 0/1, true/false, yes/no or same/different; an optional
header row).
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np

from facenet.errors import DataError
from facenet.files import open_regular, read_npz

MAX_CSV_BYTES = 2**26  # 4 million rows of "0.123456789,1"; larger sets: .npz
_TRUE, _FALSE = {"1", "true", "yes", "same"}, {"0", "false", "no", "different"}


def _parse_row(row: list[str], path: Path, line_no: int) -> tuple[float, bool]:
    if len(row) != 2:
        raise DataError(f"{path}:{line_no}: expected 'distance,issame', got {row}")
    label = row[1].strip().lower()
    if label not in _TRUE | _FALSE:
        raise DataError(f"{path}:{line_no}: issame must be 0/1 or true/false, got {row[1]!r}")
    try:
        return float(row[0]), label in _TRUE
    except ValueError:
        raise DataError(f"{path}:{line_no}: distance {row[0]!r} is not a number") from None


def _load_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a CSV file; ``csv.Error`` (a field over 128 KiB, a NUL byte) named with the
    file and the line."""
    try:
        with io.TextIOWrapper(open_regular(path, MAX_CSV_BYTES), "utf-8", newline="") as fh:
            reader = csv.reader(fh)
            try:
                rows = [(reader.line_num, row) for row in reader if any(row)]
            except csv.Error as err:
                raise DataError(f"{path}:{reader.line_num}: {err}") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: not a UTF-8 text file") from None
    if rows:
        try:
            float(rows[0][1][0])
        except ValueError:
            rows = rows[1:]  # a header row
    if not rows:
        raise DataError(f"{path}: no rows")
    distances, issame = zip(*(_parse_row(row, path, n) for n, row in rows))
    return np.array(distances), np.array(issame)


def read_distances(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(distances, issame) of an ``.npz`` or ``.csv`` file (``.txt``: CSV), by its suffix.

    Raises:
        DataError: no such regular file, an unknown suffix, a missing array, a malformed row
            or a size past the bounds, named.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        arrays = read_npz(path, "a readable .npz archive")
        for key in ("distances", "issame"):
            if key not in arrays:
                raise DataError(f"{path}: no array '{key}' (found: {', '.join(arrays)})")
        return arrays["distances"], arrays["issame"]
    if suffix in (".csv", ".txt"):
        return _load_csv(path)
    raise DataError(f"{path}: unknown format {suffix!r}; use .npz or .csv")
