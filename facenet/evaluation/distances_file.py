"""Pair distances measured elsewhere, read from a file: ``(distances, issame)``.

Two formats: an ``.npz`` with arrays ``distances`` and ``issame`` (read without pickles), or a
``.csv`` with rows ``distance,issame`` (issame 0/1, true/false, yes/no or same/different; an
optional header row). :func:`facenet.evaluation.verify.verify_distances` evaluates them.
"""

from __future__ import annotations

import csv
import os
import zipfile
from pathlib import Path

import numpy as np

from facenet.errors import DataError

__all__ = ["DistancesFileError", "read_distances"]


class DistancesFileError(DataError):
    """A distances file that cannot be used; the message names it (and the line)."""


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # ValueError here is numpy's refusal of a pickle or of a damaged array header.
    damaged = (zipfile.BadZipFile, EOFError, ValueError)
    try:
        data = np.load(path, allow_pickle=False)
    except damaged as err:
        raise DistancesFileError(f"{path}: not a readable .npz archive ({err})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise DistancesFileError(f"{path}: a single .npy array, not an .npz archive")
    with data:
        for key in ("distances", "issame"):
            if key not in data.files:
                found = ", ".join(data.files)
                raise DistancesFileError(f"{path}: no array '{key}' (found: {found})")
        try:
            return data["distances"], data["issame"]
        except damaged as err:
            raise DistancesFileError(f"{path}: not a readable .npz archive ({err})") from None


_TRUE, _FALSE = {"1", "true", "yes", "same"}, {"0", "false", "no", "different"}


def _parse_csv_row(row: list[str], path: Path, line_no: int) -> tuple[float, bool]:
    if len(row) != 2:
        raise DistancesFileError(f"{path}:{line_no}: expected 'distance,issame', got {row}")
    label = row[1].strip().lower()
    if label not in _TRUE | _FALSE:
        raise DistancesFileError(
            f"{path}:{line_no}: issame must be 0/1 or true/false, got {row[1]!r}"
        )
    try:
        return float(row[0]), label in _TRUE
    except ValueError:
        raise DistancesFileError(f"{path}:{line_no}: distance {row[0]!r} is not a number") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _csv_rows(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, fields) of every non-empty row.

    The csv module refuses a field over its limit (128 KiB), a NUL byte and the like with
    ``csv.Error``: reported naming the file and the line, as a malformed row is.
    """
    rows = []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            try:
                for row in reader:
                    if any(row):
                        rows.append((reader.line_num, row))
            except csv.Error as err:
                raise DistancesFileError(f"{path}:{reader.line_num}: {err}") from None
    except UnicodeDecodeError:
        raise DistancesFileError(f"{path}: not a UTF-8 text file") from None
    return rows


def _load_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = _csv_rows(path)
    if rows and rows[0][1] and not _is_number(rows[0][1][0]):
        rows = rows[1:]  # a header row
    if not rows:
        raise DistancesFileError(f"{path}: no rows")
    values = [_parse_csv_row(row, path, n) for n, row in rows]
    return np.array([v[0] for v in values]), np.array([v[1] for v in values])


def read_distances(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(distances, issame) from an ``.npz`` or a ``.csv`` file.

    Args:
        path: the file; the suffix decides the format (``.txt`` is read as CSV).

    Raises:
        DistancesFileError: an unknown suffix, a missing array, a malformed row.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"distances file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return _load_npz(path)
    if suffix in (".csv", ".txt"):
        return _load_csv(path)
    raise DistancesFileError(f"{path}: unknown format {suffix!r}; use .npz or .csv")
