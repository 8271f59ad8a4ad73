"""Template sets in insightface's IJB layout (IJB-B, IJB-C, or sets made the same way):

    ROOT/meta/<name>_face_tid_mid.txt          image template_id media_id
    ROOT/meta/<name>_name_5pts_score.txt       image x1 y1 ... x5 y5 detector_score
    ROOT/meta/<name>_template_pair_label.txt   template_id template_id label (1: same person)
    ROOT/loose_crop/<image>                    the photo or frame; landmarks count pixels from 0

Columns are split by white space, blank lines skipped. Images are matched by name (insightface
matches the two lists by row); a name is a relative path that stays inside ROOT. Every problem
is a DataError naming the file, its line and the value.
"""

from __future__ import annotations

import io
import math
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from facenet.data.images import CorruptImageError, read_image
from facenet.errors import DataError, shown
from facenet.files import open_regular

FACES, LANDMARKS, PAIRS = "_face_tid_mid.txt", "_name_5pts_score.txt", "_template_pair_label.txt"
MAX_META_BYTES = 2**28  # IJB-C's face and landmark lists: about 20 and 40 MB
# 4.5 x IJB-C's 469,375 faces; rows are held as Python strings: 2**21 short rows of 3 or 12
# columns peaked at 0.6 and 0.7 GB (tracemalloc); 2**28 bytes of them would take about 10 GB
MAX_META_ROWS = 2**21
MAX_PAIRS_BYTES = 2**30  # IJB-C's 15.7 million template pairs: about 250 MB
# bytes in a line: a name and 11 numbers take about 100; split into fields, one 240 MB line
# would take gigabytes of Python strings
MAX_LINE_BYTES = 4096


@dataclass(frozen=True)
class TemplateSet:
    """One set: ``images`` (N,) names under ``root/loose_crop`` in the face list's order, their
    ``templates`` and ``media`` (N,) int64, ``landmarks`` (N, 5, 2) float64 (x, y) and detector
    ``scores`` (N,) float64; ``pairs`` (P, 2) int64 template ids and ``labels`` (P,) int64."""

    root: Path
    name: str
    images: np.ndarray
    templates: np.ndarray
    media: np.ndarray
    landmarks: np.ndarray
    scores: np.ndarray
    pairs: np.ndarray
    labels: np.ndarray

    def meta(self, suffix: str) -> Path:
        """The meta file ``<name><suffix>``."""
        return self.root / "meta" / f"{self.name}{suffix}"


def set_name(root, name: str | None = None) -> str:
    """``name``, or the only ``<name>`` of a ``*_face_tid_mid.txt`` in ``root/meta``."""
    meta = Path(root) / "meta"
    if name is not None:
        if not name or "/" in name or name in (".", ".."):
            raise DataError(f"set name {shown(name)}: expected the <name> of {meta}/<name>{FACES}")
        return name
    names = sorted(p.name[: -len(FACES)] for p in meta.glob(f"*{FACES}")) if meta.is_dir() else []
    if len(names) != 1:
        found = f"sets {', '.join(names)}: choose one" if names else f"no <name>{FACES} in it"
        raise DataError(f"{meta}: {found}")
    return names[0]


def _read(path: Path, max_bytes: int) -> bytes:
    if not path.is_file():
        raise DataError(f"{path}: missing meta file")
    with open_regular(path, max_bytes) as fh:
        raw = fh.read()
    ends = np.flatnonzero(np.frombuffer(raw, np.uint8) == ord("\n"))
    lengths = np.diff(ends, prepend=-1, append=len(raw)) - 1  # (lines,) bytes before each end
    if lengths.max() > MAX_LINE_BYTES:
        line = int(lengths.argmax()) + 1
        raise DataError(
            f"{path}:{line}: a line of {lengths.max()} bytes, more than {MAX_LINE_BYTES}"
        )
    return raw


def _rows(path: Path, columns: int, max_bytes: int, max_rows: int | None = None):
    """(line number, fields) of each non-blank line of ``path``, which must have ``columns``;
    lines end at ``\n`` (a ``\r`` before it is white space) and are read one at a time."""
    raw = _read(path, max_bytes)
    if max_rows is not None and raw.count(b"\n") > max_rows:
        raise DataError(f"{path}: more than {max_rows} lines")
    try:
        lines = io.StringIO(raw.decode("utf-8-sig"), newline="\n")  # a BOM: dropped
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start})") from None
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if fields and len(fields) != columns:
            raise DataError(f"{path}:{number}: {len(fields)} columns, expected {columns}")
        if fields:
            yield number, fields


def _number(path, number: int, value: str, kind=float):
    """``value`` as a finite ``kind`` (float or int), else a DataError naming the line."""
    try:
        parsed = kind(value) if "_" not in value else math.nan  # Python reads "1_0" as 10
    except ValueError:
        parsed = math.nan
    if kind is int and math.isfinite(parsed) and not -(2**63) <= parsed < 2**63:
        raise DataError(f"{path}:{number}: {shown(value)} is past int64's range")
    if not math.isfinite(parsed):
        what = "an integer" if kind is int else "a finite number"
        raise DataError(f"{path}:{number}: {shown(value)} is not {what}")
    return parsed


def _table(path: Path, columns: int, kind=float) -> tuple:
    """(fields (R, columns) str, line numbers, columns 1.. as ``kind``, {image name: row})."""
    rows = list(_rows(path, columns, MAX_META_BYTES, MAX_META_ROWS))
    fields = np.array([f for _, f in rows], dtype=str).reshape(-1, columns)
    lines = [n for n, _ in rows]
    numbers = _numbers(path, fields[:, 1:], lines, kind)
    return fields, lines, numbers, _image_names(path, fields[:, 0], lines)


def _numbers(path, fields: np.ndarray, lines: list[int], kind=float) -> np.ndarray:
    """``fields`` (R, K) as finite float64 (or int64); value by value only to name a bad one."""
    try:
        values = fields.astype(np.int64 if kind is int else np.float64)
        if np.isfinite(values).all() and not np.char.count(fields, "_").any():
            return values
    except (ValueError, OverflowError):
        pass
    for row, number in zip(fields.tolist(), lines):
        for value in row:
            _number(path, number, value, kind)
    raise DataError(f"{path}: a number NumPy cannot read")


def _image_names(path, names: np.ndarray, lines: list[int]) -> dict[str, int]:
    """{name: row}, names normalised ("./a//1.jpg" is "a/1.jpg"); names that leave ROOT or
    repeat are refused."""
    rows: dict[str, int] = {}
    for row, name in enumerate(names.tolist()):
        if name.startswith("/") or ".." in name.split("/"):
            raise DataError(f"{path}:{lines[row]}: image {shown(name)} is not a path inside ROOT")
        key = posixpath.normpath(name)
        if rows.setdefault(key, row) != row:
            raise DataError(
                f"{path}:{lines[row]}: image {shown(name)} again (line {lines[rows[key]]})"
            )
    return rows


def _bad_pair(path, known: set) -> DataError:
    """The first line of a pair list that does not parse or names an unknown template."""
    for number, fields in _rows(path, 3, MAX_PAIRS_BYTES):
        first, second, label = (_number(path, number, v, int) for v in fields)
        if label not in (0, 1):
            return DataError(f"{path}:{number}: label {label}, expected 0 or 1")
        if first == second:  # it would score a cosine of 1 whatever the model
            return DataError(f"{path}:{number}: template {first} paired with itself")
        for template in (first, second):
            if template not in known:
                return DataError(f"{path}:{number}: template {template} has no image")
    return DataError(f"{path}: not a list of 'template template label' lines")


def _pairs(path, known: np.ndarray) -> np.ndarray:
    """(P, 3) template, template, label; NumPy's parser first, lines read one by one only to
    name the first bad one (IJB-C's 15.7 million pairs in seconds)."""
    raw = _read(path, MAX_PAIRS_BYTES).removeprefix(b"\xef\xbb\xbf")  # a BOM, as _rows drops it
    table = np.zeros((0, 3), dtype=np.int64)
    if raw.strip():
        try:
            table = np.loadtxt(io.BytesIO(raw), dtype=np.int64, comments=None, ndmin=2)
        except (ValueError, OverflowError):
            table = None
        if (
            table is None
            or table.shape[1:] != (3,)
            or not np.isin(table[:, 2], (0, 1)).all()
            or not np.isin(table[:, :2], known).all()
            or (table[:, 0] == table[:, 1]).any()
        ):
            raise _bad_pair(path, set(known.tolist()))
    for label, kind in ((1, "genuine"), (0, "impostor")):
        if not (table[:, 2] == label).any():
            raise DataError(f"{path}: no {kind} pair (label {label})")
    return table


def _check_images(root: Path, path, names: np.ndarray, lines: list[int]) -> None:
    """Refuse an image that is missing or reached through a link leaving ``root``."""
    inside = os.path.realpath(root) + os.sep
    for name, number in zip(names.tolist(), lines):
        real = os.path.realpath(root / "loose_crop" / name)
        if not real.startswith(inside):
            raise DataError(f"{path}:{number}: image {shown(name)} leaves {root} (a link)")
        if not os.path.isfile(real):
            why = "is not a regular file" if os.path.exists(real) else "not found"
            raise DataError(f"{path}:{number}: image {root / 'loose_crop' / name} {why}")


def read_template_set(root, name: str | None = None) -> TemplateSet:
    """The set ``name`` (by default the only one) of ``root``, every image checked to exist."""
    root = Path(root)
    name = set_name(root, name)
    meta = root / "meta"
    faces_path, marks_path = meta / f"{name}{FACES}", meta / f"{name}{LANDMARKS}"
    faces, face_lines, ids, face_rows = _table(faces_path, 3, int)  # ids (N, 2)
    marks, mark_lines, values, mark_rows = _table(marks_path, 12)  # values (N, 11)
    one_point = np.flatnonzero(np.ptp(values[:, :10].reshape(-1, 5, 2), axis=1).max(axis=1) == 0)
    if len(one_point):  # no face can be warped from them ("0 0 ... 0" for an undetected one)
        where = f"{marks_path}:{mark_lines[one_point[0]]}"
        raise DataError(
            f"{where}: the five landmarks are one point ({' '.join(marks[one_point[0], 1:3])})"
        )
    negative = np.flatnonzero(values[:, 10] < 0)  # a weight that would flip a feature's sign
    if len(negative):
        score = marks[negative[0], 11]
        raise DataError(f"{marks_path}:{mark_lines[negative[0]]}: detector score {score} < 0")
    for path, rows, lines, other, others in (
        (faces_path, face_rows, face_lines, marks_path, mark_rows),
        (marks_path, mark_rows, mark_lines, faces_path, face_rows),
    ):
        missing = next((n for n in rows if n not in others), None)
        if missing is not None:
            raise DataError(
                f"{path}:{lines[rows[missing]]}: image {shown(missing)} is not in {other}"
            )
    values = values[[mark_rows[n] for n in face_rows]]  # in the face list's order
    _check_images(root, faces_path, faces[:, 0], face_lines)
    table = _pairs(meta / f"{name}{PAIRS}", np.unique(ids[:, 0]))
    landmarks, scores = values[:, :10].reshape(-1, 5, 2), values[:, 10]  # (M, 5, 2), (M,)
    images, templates, media = faces[:, 0], ids[:, 0], ids[:, 1]
    return TemplateSet(
        root, name, images, templates, media, landmarks, scores, table[:, :2], table[:, 2]
    )


def read_face(faces: TemplateSet, index: int) -> torch.Tensor:
    """Image ``index`` as uint8 RGB (3, H, W), decoded with the project's limits."""
    try:
        return read_image(faces.root / "loose_crop" / faces.images[index])
    except CorruptImageError as err:
        raise DataError(f"{faces.meta(FACES)}: {err}") from None
