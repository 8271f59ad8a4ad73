"""LFW-style pair lists: read and write ``pairs.txt``, and generate pairs for any image folder.

The format (LFW "View 2")::

    10<TAB>300                      header: number of folds, pairs of each kind per fold
    Abel_Pacheco<TAB>1<TAB>4        a "same" pair: name, index of image 1, index of image 2
    ...                             (pairs_per_fold same lines, then)
    Abdel_Madi_Shabneh<TAB>1<TAB>Dean_Barker<TAB>1   a "different" pair: name1 idx1 name2 idx2
    ...                             (pairs_per_fold different lines; then the next fold)

A one-number header (``1100``, as in ``pairsDevTrain.txt``) means one fold of that many pairs
of each kind. Fields may be separated by tabs or spaces; CRLF line ends, stray spaces and blank
lines are tolerated. A malformed line is a :class:`PairsFormatError` naming the file and line.

Image resolution rule: ``<name> <idx>`` refers to ``root/<name>/<name>_<idx:04d>.<ext>`` where
``ext`` is any of jpg, jpeg, png, bmp, webp in any letter case. When several files share the
stem, the first extension in that order wins (then the first name in sorted order).

Folds are the contiguous blocks of ``2 * pairs_per_fold`` lines, in file order, which is what
the evaluation's contiguous ``KFold`` reproduces. Skipping pairs whose images are missing
shifts those blocks; :attr:`PairList.fold_ids` keeps each remaining pair's fold from the file.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from facenet.errors import DataError
from facenet.files import write_text_atomic

__all__ = [
    "IMAGE_EXTENSIONS",
    "PairsFormatError",
    "MissingImagesError",
    "PairList",
    "PairFold",
    "read_pairs",
    "generate_pairs",
    "pairs_text",
    "write_pairs",
    "scan_identities",
    "lfw_image_index",
]

# In order of preference when one stem has several files.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")

_LISTED_MISSING = 20  # missing images quoted in an error message


class PairsFormatError(DataError):
    """A pairs file line that does not follow the format; the message names file and line.

    Args:
        path: the pairs file.
        line_no: 1-based line number (0 for the file as a whole).
        message: what is wrong.
    """

    def __init__(self, path: str | os.PathLike, line_no: int, message: str):
        self.path, self.line_no = str(path), line_no
        where = f"{path}:{line_no}" if line_no else str(path)
        super().__init__(f"{where}: {message}")


class MissingImagesError(DataError, FileNotFoundError):
    """Images named by a pairs file that do not exist.

    ``missing`` lists each missing image once (its path without extension, sorted) and
    ``lines`` maps it to the lines of the pairs file that name it.

    Args:
        pairs_path: the pairs file.
        root: the image folder searched.
        missing: (line number, expected path without extension) for every missing side.
    """

    def __init__(self, pairs_path, root, missing: list[tuple[int, str]]):
        self.lines: dict[str, list[int]] = {}
        for line_no, path in missing:
            self.lines.setdefault(path, []).append(line_no)
        self.missing = sorted(self.lines)
        shown = "\n".join(
            f"  {path} (line(s) {', '.join(map(str, self.lines[path]))})"
            for path in self.missing[:_LISTED_MISSING]
        )
        more = len(self.missing) - _LISTED_MISSING
        tail = f"\n  ... and {more} more" if more > 0 else ""
        n_lines = len({line_no for line_no, _ in missing})
        super().__init__(
            f"{pairs_path}: {len(self.missing)} image(s) named on {n_lines} line(s) not found "
            f"under {root} (looked for {'/'.join(e[1:] for e in IMAGE_EXTENSIONS)}):\n"
            f"{shown}{tail}\nPass skip_missing=True (eval.skip_missing) to skip those pairs."
        )


class PairFold(NamedTuple):
    """One fold: ``same`` as (name, idx1, idx2), ``different`` as (name1, idx1, name2, idx2)."""

    same: list[tuple[str, int, int]]
    different: list[tuple[str, int, str, int]]


@dataclass
class PairList:
    """Resolved pairs of a pairs file, in file order.

    Args:
        paths1: image path of the first side of each pair.
        paths2: image path of the second side.
        issame: (N,) bool, True for same-identity pairs.
        n_folds: folds announced by the header.
        pairs_per_fold: pairs of each kind per fold announced by the header.
        fold_ids: (N,) the fold of each kept pair in the file (differs from contiguous
            re-splitting only when pairs were skipped).
        line_numbers: (N,) the line of each kept pair.
        skipped: (line number, reason) of each skipped pair.
        skipped_folds: the fold (in the file) of each skipped pair.
        source: the pairs file.
    """

    paths1: list[str]
    paths2: list[str]
    issame: np.ndarray
    n_folds: int
    pairs_per_fold: int
    fold_ids: np.ndarray
    line_numbers: np.ndarray
    skipped: list[tuple[int, str]] = field(default_factory=list)
    skipped_folds: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    source: str = ""

    def __len__(self) -> int:
        return len(self.paths1)

    def unique_paths(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Sorted unique image paths and, for each side, the (N,) index of its image in them.

        Each unique image can then be embedded once: ``emb[index1]``, ``emb[index2]``.
        """
        both = np.asarray(self.paths1 + self.paths2, dtype=str)
        unique, inverse = np.unique(both, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int64)
        n = len(self.paths1)
        return [str(p) for p in unique], inverse[:n], inverse[n:]

    def folds_for(self, n_folds: int) -> np.ndarray | None:
        """(N,) the fold of each pair for an evaluation in ``n_folds`` folds.

        The file's own folds when it has ``n_folds``. Otherwise the same pairs, in file order,
        are cut into ``n_folds`` contiguous runs, and the different pairs likewise: every fold
        holds both kinds. (A one-fold file lists all its same pairs, then all its different
        ones, so contiguous folds would each hold one kind.) For files of balanced folds this
        equals contiguous folds whenever ``n_folds`` divides the file's folds. None when a kind
        has fewer pairs than folds (the protocol then says so).

        Args:
            n_folds: the folds of the evaluation.
        """
        if n_folds == self.n_folds:
            return self.fold_ids
        ids = np.empty(len(self), dtype=np.int64)
        for kind in (True, False):
            members = np.flatnonzero(np.asarray(self.issame, dtype=bool) == kind)
            if len(members) < n_folds:
                return None
            ids[members] = np.arange(len(members)) * n_folds // len(members)
        return ids

    def skipped_per_fold(self) -> np.ndarray:
        """(n_folds,) number of skipped pairs in each fold of the file."""
        return np.bincount(self.skipped_folds, minlength=self.n_folds)

    def skip_report(self) -> str:
        """What skipping did to the folds, in words (empty when nothing was skipped)."""
        if not self.skipped:
            return ""
        total = len(self) + len(self.skipped)
        return (
            f"{self.source}: skipped {len(self.skipped)} of {total} pairs with missing images "
            f"(per fold: {self.skipped_per_fold().tolist()}). Evaluated with contiguous folds, "
            f"the remaining {len(self)} pairs are re-split into {self.n_folds} folds, so pairs "
            "near fold boundaries move to a neighbouring fold; pass folds=pair_list.fold_ids "
            "to the evaluation to keep the file's folds instead."
        )


# --------------------------------------------------------------------------- reading


def _parse_int(token: str, path, line_no: int, what: str) -> int:
    if not re.fullmatch(r"\d+", token):
        raise PairsFormatError(
            path, line_no, f"{what} must be a non-negative integer, got {token!r}"
        )
    try:
        return int(token)
    except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
        raise PairsFormatError(
            path, line_no, f"{what} has {len(token)} digits: not a plausible count or index"
        ) from None


def _parse_header(tokens: list[str], path, line_no: int) -> tuple[int, int]:
    """(n_folds, pairs_per_fold) from ``F P`` or a one-number ``P`` header."""
    if len(tokens) not in (1, 2):
        raise PairsFormatError(
            path, line_no, f"expected a header '<n_folds>\\t<pairs_per_fold>', got {tokens}"
        )
    values = [_parse_int(t, path, line_no, "header value") for t in tokens]
    n_folds, per_fold = (1, values[0]) if len(values) == 1 else values
    if n_folds < 1 or per_fold < 1:
        raise PairsFormatError(path, line_no, f"header values must be >= 1, got {tokens}")
    return n_folds, per_fold


def _parse_image_ref(token: str, path, line_no: int, what: str) -> int | str:
    """An LFW image index (``<name>_<NNNN>``), or the image's file name in its identity folder."""
    if os.path.splitext(token)[1].lower() in IMAGE_EXTENSIONS and not re.fullmatch(r"\d+", token):
        if "/" in token or "\\" in token or token in (".", ".."):
            raise PairsFormatError(
                path,
                line_no,
                f"{what} must be a file name inside its identity folder, got {token!r}",
            )
        return token
    return _parse_int(token, path, line_no, what)


def _check_identity(name: str, path, line_no: int) -> str:
    """An identity is a folder directly under the root: no separators, not '.' or '..'."""
    if "/" in name or "\\" in name or name in (".", ".."):
        raise PairsFormatError(path, line_no, f"identity {name!r} must be a folder name")
    return name


def _parse_pair(
    tokens: list[str], path, line_no: int
) -> tuple[str, int | str, str, int | str, bool]:
    """(name1, ref1, name2, ref2, issame) from a 3-field or 4-field line; a ref is an LFW
    index or an image file name."""
    if len(tokens) == 3:
        name, a, b = tokens
        name = _check_identity(name, path, line_no)
        ref1 = _parse_image_ref(a, path, line_no, "idx1")
        return name, ref1, name, _parse_image_ref(b, path, line_no, "idx2"), True
    if len(tokens) == 4:
        name1, a, name2, b = tokens
        name1, name2 = _check_identity(name1, path, line_no), _check_identity(name2, path, line_no)
        ref1 = _parse_image_ref(a, path, line_no, "idx1")
        return name1, ref1, name2, _parse_image_ref(b, path, line_no, "idx2"), False
    raise PairsFormatError(
        path,
        line_no,
        "expected 'name idx1 idx2' (same) or 'name1 idx1 name2 idx2' (different), "
        f"got {len(tokens)} field(s): {' '.join(tokens)!r}",
    )


def _fields(line: str) -> list[str]:
    """Tab-separated fields when the line has a tab and that gives a header or a pair (names
    may hold spaces), else whitespace-separated words (LFW files mixing tabs and spaces)."""
    words = line.split()
    if "\t" in line:
        fields = [field.strip() for field in line.split("\t") if field.strip()]
        if len(fields) >= 3 or len(fields) == len(words):  # a pair by tabs, or no spaces
            return fields
    return words


def _read_lines(pairs_path: Path) -> list[tuple[int, list[str]]]:
    """(line number, whitespace-split fields) of every non-blank line."""
    if pairs_path.exists() and not pairs_path.is_file():  # a FIFO or device would block
        raise PairsFormatError(pairs_path, 0, "not a regular file (a FIFO, device or folder)")
    try:
        with open(pairs_path, encoding="utf-8", newline=None) as fh:  # universal newlines: CRLF ok
            rows = [(n, _fields(line)) for n, line in enumerate(fh, start=1)]
    except UnicodeDecodeError:
        raise PairsFormatError(pairs_path, 0, "not a UTF-8 text file") from None
    return [(n, tokens) for n, tokens in rows if tokens]


def lfw_image_index(identity: str, file_name: str) -> int | None:
    """The index in ``<identity>_<NNNN>.<ext>`` (an image extension), else None.

    Args:
        identity: the identity (folder) name.
        file_name: a file name or path; only its last component is read.
    """
    base = os.path.basename(file_name)
    stem, ext = os.path.splitext(base)
    if ext.lower() not in IMAGE_EXTENSIONS:
        return None
    match = re.fullmatch(re.escape(identity) + r"_(\d+)", stem)
    return int(match.group(1)) if match else None


class _ImageResolver:
    """Finds ``root/<name>/<name>_<idx:04d>.<ext>``, listing each identity folder once."""

    def __init__(self, root: Path):
        self.root = root
        self._folders: dict[str, dict[int, str]] = {}

    def _index_folder(self, name: str) -> dict[int, str]:
        folder = self.root / name
        found: dict[int, tuple[int, str]] = {}
        if folder.is_dir():
            for entry in sorted(os.listdir(folder)):
                idx = lfw_image_index(name, entry)
                if idx is None:
                    continue
                rank = IMAGE_EXTENSIONS.index(os.path.splitext(entry)[1].lower())
                if idx not in found or rank < found[idx][0]:
                    found[idx] = (rank, entry)
        return {idx: str(folder / entry) for idx, (_, entry) in found.items()}

    def find(self, name: str, idx: int | str) -> str | None:
        """The image path, or None when no such file exists."""
        if isinstance(idx, str):  # a file name in the identity folder
            path = self.root / name / idx
            return str(path) if path.is_file() else None
        if name not in self._folders:
            self._folders[name] = self._index_folder(name)
        return self._folders[name].get(idx)

    def expected(self, name: str, idx: int | str) -> str:
        """The path that was looked for (``.*``: any image extension)."""
        if isinstance(idx, str):
            return str(self.root / name / idx)
        return str(self.root / name / f"{name}_{idx:04d}") + ".*"


def _check_pair_count(path, header_line: int, n_folds: int, per_fold: int, n_pairs: int) -> None:
    expected = n_folds * 2 * per_fold
    if n_pairs != expected:
        raise PairsFormatError(
            path,
            header_line,
            f"the header promises {n_folds} fold(s) x 2 x {per_fold} = {expected} pairs, "
            f"but the file holds {n_pairs}",
        )


def read_pairs(
    pairs_path: str | os.PathLike, root: str | os.PathLike | None = None, skip_missing: bool = False
) -> PairList:
    """Read an LFW-format pairs file and resolve its images.

    Args:
        pairs_path: the pairs file (see the module docstring for the format).
        root: the image folder holding ``<name>/<name>_<idx:04d>.<ext>``; default the pairs
            file's folder. Paths in the result are absolute.
        skip_missing: skip pairs with a missing image (recorded in ``skipped``, reported by
            ``skip_report()`` and a warning) instead of raising.

    Raises:
        FileNotFoundError: the pairs file or the image root does not exist.
        PairsFormatError: a malformed header or pair line, a pair count that does not match
            the header, or a file that is not UTF-8 text.
        MissingImagesError: images are missing and ``skip_missing`` is False.
    """
    pairs_path = Path(pairs_path)
    root = Path(os.path.abspath(pairs_path.parent if root is None else root))
    if not root.is_dir():
        raise FileNotFoundError(f"image root {root} (for {pairs_path}) is not a folder")
    lines = _read_lines(pairs_path)
    if not lines:
        raise PairsFormatError(pairs_path, 0, "empty pairs file")
    header_line, header = lines[0]
    n_folds, per_fold = _parse_header(header, pairs_path, header_line)
    parsed = [(n, _parse_pair(tokens, pairs_path, n)) for n, tokens in lines[1:]]
    _check_pair_count(pairs_path, header_line, n_folds, per_fold, len(parsed))
    return _resolve_pairs(pairs_path, root, parsed, n_folds, per_fold, skip_missing)


def _resolve_pairs(pairs_path, root, parsed, n_folds, per_fold, skip_missing) -> PairList:
    """Turn parsed lines into paths; collect missing images."""
    resolver = _ImageResolver(root)
    kept, missing, skipped = [], [], []
    for position, (line_no, (name1, idx1, name2, idx2, same)) in enumerate(parsed):
        path1, path2 = resolver.find(name1, idx1), resolver.find(name2, idx2)
        sides = ((name1, idx1, path1), (name2, idx2, path2))
        absent = [resolver.expected(name, idx) for name, idx, path in sides if path is None]
        fold = position // (2 * per_fold)
        if absent:
            missing.extend((line_no, a) for a in absent)
            skipped.append((line_no, fold, "missing " + ", ".join(absent)))
            continue
        kept.append((line_no, fold, path1, path2, same))
    if missing and not skip_missing:
        raise MissingImagesError(pairs_path, root, missing)
    pair_list = PairList(
        paths1=[k[2] for k in kept],
        paths2=[k[3] for k in kept],
        issame=np.array([k[4] for k in kept], dtype=bool),
        n_folds=n_folds,
        pairs_per_fold=per_fold,
        fold_ids=np.array([k[1] for k in kept], dtype=np.int64),
        line_numbers=np.array([k[0] for k in kept], dtype=np.int64),
        skipped=[(line_no, reason) for line_no, _, reason in skipped],
        skipped_folds=np.array([fold for _, fold, _ in skipped], dtype=np.int64),
        source=str(pairs_path),
    )
    if skipped:
        warnings.warn(pair_list.skip_report(), stacklevel=3)
    return pair_list


# --------------------------------------------------------------------------- generating


def scan_identities(root: str | os.PathLike) -> dict[str, list[str]]:
    """``{identity: [image file name, ...]}`` for every ``root/<identity>/`` folder, sorted.

    Args:
        root: the image folder; hidden entries and non-image files are left out.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image root {root} is not a folder")
    listing = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        listing[folder.name] = sorted(
            f.name
            for f in folder.iterdir()
            if f.suffix.lower() in IMAGE_EXTENSIONS and not f.name.startswith(".")
        )
    return listing


def _without_empty(indices: dict[str, list]) -> dict[str, list]:
    """The identities holding an image; the others are ignored with one warning, as
    :class:`facenet.data.folder.IdentityFolder` ignores an empty identity folder."""
    empty = [name for name, keys in indices.items() if not keys]
    if empty:
        shown = ", ".join(empty[:10]) + (f" and {len(empty) - 10} more" if len(empty) > 10 else "")
        warnings.warn(
            f"ignored {len(empty)} identity folder(s) without images: {shown}", stacklevel=3
        )
    return {name: keys for name, keys in indices.items() if keys}


def _image_keys(images_by_identity: dict[str, list[str]]) -> dict[str, list]:
    """How a pairs file names each identity's images, sorted and unique: the LFW indices when
    every image of the identity is named ``<identity>_<NNNN>.<ext>``, else the file names."""
    keys = {}
    for identity in sorted(images_by_identity):
        if not identity or re.search(r"[\t\n\r/\\]", identity) or identity != identity.strip():
            raise DataError(
                f"identity name {identity!r} is empty or holds tabs, line breaks or slashes"
            )
        names = [
            os.path.basename(name)
            for name in images_by_identity[identity]
            if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS  # others are ignored
        ]
        bad = [n for n in names if re.search(r"[\t\n\r\\]", n) or n != n.strip()]
        if bad:
            raise DataError(
                f"identity {identity!r}: image file name {bad[0]!r} holds tabs, line breaks, "
                "backslashes or surrounding spaces, which a pairs file cannot name"
            )
        indices = [lfw_image_index(identity, n) for n in names]
        keys[identity] = sorted(set(indices if None not in indices else names))
    return keys


# Nodes the fold assignment's search may visit before it gives up (see _assign_folds).
_ASSIGN_BUDGET = 200_000


class _FoldLoad:
    """What a fold's identities can give: same pairs, images, different pairs."""

    __slots__ = ("same", "images", "different", "names")

    def __init__(self) -> None:
        self.same = self.images = self.different = 0
        self.names: list[str] = []

    def add(self, name: str, count: int) -> None:
        self.different += count * self.images  # each new image pairs with every image there
        self.same += math.comb(count, 2)
        self.images += count
        self.names.append(name)

    def remove(self, count: int) -> None:
        self.names.pop()
        self.images -= count
        self.same -= math.comb(count, 2)
        self.different -= count * self.images

    def deficit(self, per_fold: int) -> tuple[int, int]:
        """(same, different) pairs still missing for ``per_fold`` of each."""
        return max(0, per_fold - self.same), max(0, per_fold - self.different)

    def state(self) -> tuple[int, int, int]:
        return self.same, self.images, self.different


class _Search:
    """Depth-first search for identity-disjoint folds that each hold ``per_fold`` pairs of each
    kind; identities largest first, each fold tried in order of how much it gains.

    Exact: only branches that cannot lead to an assignment are cut, so it finds one whenever
    one exists, unless it visits ``_ASSIGN_BUDGET`` nodes first (``gave_up``). The first
    descent is the greedy assignment; the search backtracks only where that one fails.
    Cuts: (1) an identity only goes to a fold still short of pairs (adding one never hurts a
    fold, so any assignment can be rewritten that way); (2) of folds in the same state only
    the first is tried; (3) a branch stops when the identities left cannot cover the missing
    same pairs (their C(n, 2) summed) or different pairs (each of their images pairs at most
    with every image dealt so far and every other image left).
    """

    def __init__(self, counts: list[tuple[str, int]], n_folds: int, per_fold: int) -> None:
        self.counts, self.per_fold = counts, per_fold
        self.folds = [_FoldLoad() for _ in range(n_folds)]
        sizes = [c for _, c in counts]
        # Suffix sums over the identities still to deal: same pairs, images, pairs among them.
        self.left_same = list(itertools.accumulate(reversed([math.comb(c, 2) for c in sizes])))
        self.left_same = self.left_same[::-1] + [0]
        self.left_images = list(itertools.accumulate(reversed(sizes)))[::-1] + [0]
        self.left_among = [0] * (len(sizes) + 1)
        for k in range(len(sizes) - 1, -1, -1):
            self.left_among[k] = self.left_among[k + 1] + sizes[k] * self.left_images[k + 1]
        self.nodes, self.gave_up = 0, False

    def _short(self) -> list[_FoldLoad]:
        return [f for f in self.folds if f.deficit(self.per_fold) != (0, 0)]

    def _hopeless(self, k: int, short: list[_FoldLoad]) -> bool:
        """The identities from ``k`` on cannot cover what the short folds miss."""
        missing = [f.deficit(self.per_fold) for f in short]
        dealt = sum(f.images for f in self.folds)
        can_differ = self.left_images[k] * dealt + self.left_among[k]
        return (
            sum(m[0] for m in missing) > self.left_same[k]
            or sum(m[1] for m in missing) > can_differ
        )

    def _choices(self, count: int, short: list[_FoldLoad]) -> list[_FoldLoad]:
        """The short folds in distinct states, the one this identity helps most first."""
        seen, choices = set(), []
        for fold in short:
            if fold.state() not in seen:
                seen.add(fold.state())
                choices.append(fold)

        def gain(fold: _FoldLoad) -> tuple:
            same, different = fold.deficit(self.per_fold)
            covered = min(same, math.comb(count, 2)) + min(different, count * fold.images)
            return (-covered, -(same + different), len(fold.names))

        return sorted(choices, key=gain)

    def run(self) -> int | None:
        """Deal identities until every fold holds enough; the number dealt, or None."""
        stack = [(0, None)]  # (identity position, iterator over its folds or None)
        while stack:
            k, options = stack.pop()
            if options is None:  # first visit of position k
                self.nodes += 1
                if self.nodes > _ASSIGN_BUDGET:
                    self.gave_up = True
                    return None
                short = self._short()
                if not short:
                    return k
                if k == len(self.counts) or self._hopeless(k, short):
                    self._undo(stack)
                    continue
                options = iter(self._choices(self.counts[k][1], short))
            fold = next(options, None)
            if fold is None:
                self._undo(stack)
                continue
            fold.add(*self.counts[k])
            stack += [(k, options), (k + 1, None)]
        return None

    def _undo(self, stack: list) -> None:
        """Back to the parent: take back the identity it dealt."""
        if stack:
            k = stack[-1][0]
            owner = next(f for f in self.folds if f.names and f.names[-1] == self.counts[k][0])
            owner.remove(self.counts[k][1])


def _assign_folds(indices: dict[str, list], n_folds: int, per_fold: int, rng) -> list[list[str]]:
    """Deal identities to ``n_folds`` disjoint folds that can each hold ``per_fold`` same and
    ``per_fold`` different pairs, whenever such a dealing exists (:class:`_Search`).

    Identities are shuffled (ties in size keep that order), so the seed varies the folds; the
    ones the search did not need then go, largest first, to the fold with the fewest
    identities, then the fewest possible same pairs, as LFW's folds are balanced.

    Raises:
        DataError: no such dealing exists (with the counts that decide it), or the search
            gave up (``_ASSIGN_BUDGET`` nodes; the message says so).
    """
    shuffled = [list(indices)[i] for i in rng.permutation(len(indices))]
    counts = sorted(((n, len(indices[n])) for n in shuffled), key=lambda nc: -nc[1])  # stable
    search = _Search(counts, n_folds, per_fold)
    dealt = search.run()
    if dealt is None:
        raise DataError(_no_assignment(counts, n_folds, per_fold, search.gave_up))
    folds = search.folds
    for name, count in counts[dealt:]:
        fold = min(folds, key=lambda f: (len(f.names), f.same))
        fold.add(name, count)
    return [fold.names for fold in folds]


def _no_assignment(counts: list[tuple[str, int]], n_folds: int, per_fold: int, gave_up) -> str:
    """Why identity-disjoint folds cannot be drawn, with the numbers that decide it."""
    multi = sum(1 for _, c in counts if c >= 2)
    same = sum(math.comb(c, 2) for _, c in counts)
    head = (
        f"{n_folds} identity-disjoint fold(s) of {per_fold} same + {per_fold} different pairs "
        f"from {len(counts)} identities ({multi} with 2+ images)"
    )
    if gave_up:
        return f"{head}: no dealing of identities to folds found within {_ASSIGN_BUDGET} steps"
    if same < n_folds * per_fold:
        return f"{head}: {same} same pairs exist, {n_folds * per_fold} needed"
    if multi < n_folds:
        return f"{head}: every fold needs an identity with 2+ images"
    return f"{head}: no dealing of identities to folds gives every fold enough pairs of both kinds"


def _same_candidates(indices: dict[str, list[int]], names: list[str]) -> list[tuple]:
    return [
        (name, a, b)
        for name in names
        for i, a in enumerate(indices[name])
        for b in indices[name][i + 1 :]
    ]


def _different_candidates(indices: dict[str, list[int]], names: list[str]) -> list[tuple]:
    ordered = sorted(names)
    return [
        (n1, a, n2, b)
        for i, n1 in enumerate(ordered)
        for n2 in ordered[i + 1 :]
        for a in indices[n1]
        for b in indices[n2]
    ]


def _draw_same(indices, names, rng) -> tuple:
    """One random same pair: a uniform identity with 2+ images, two distinct images."""
    name = names[rng.integers(len(names))]
    first, second = rng.choice(len(indices[name]), size=2, replace=False).tolist()
    a, b = sorted((indices[name][first], indices[name][second]))
    return (name, a, b)


def _draw_different(indices, names, rng) -> tuple:
    """One random different pair: two distinct uniform identities, one image of each."""
    i, j = sorted(rng.choice(len(names), size=2, replace=False).tolist())
    n1, n2 = sorted((names[i], names[j]))
    return (n1, _pick(indices[n1], rng), n2, _pick(indices[n2], rng))


def _pick(keys: list, rng):
    """One uniform key (the draw ``rng.choice`` makes, for indices and file names alike)."""
    return keys[int(rng.integers(len(keys)))]


def _sample_distinct(count: int, possible: int, draw, candidates, rng, what: str) -> list[tuple]:
    """``count`` distinct pairs: rejection sampling, or enumeration when pairs are scarce.

    Args:
        count: pairs wanted.
        possible: number of distinct pairs that exist.
        draw: () -> one random pair.
        candidates: () -> every possible pair (used when ``count`` is near ``possible``).
        rng: the numpy Generator.
        what: the kind of pair, for the error message.
    """
    if count > possible:
        raise DataError(f"{what}: {count} distinct pairs needed, only {possible} exist")
    chosen: set[tuple] = set()
    attempts = 0 if 2 * count <= possible else None  # None: enumerate straight away
    while attempts is not None and len(chosen) < count:
        chosen.add(draw())
        attempts += 1
        if attempts > 50 * count + 1000:  # identities running out of unused pairs
            attempts = None
    if len(chosen) < count:
        rest = sorted(set(candidates()) - chosen)
        picks = rng.choice(len(rest), size=count - len(chosen), replace=False)
        chosen.update(rest[i] for i in picks)
    return sorted(chosen)


def _sample_group(indices, names, n_same, n_different, rng, where: str):
    """(same pairs, different pairs) drawn from the identities ``names``."""
    multi = [n for n in names if len(indices[n]) >= 2]
    sizes = np.array([len(indices[n]) for n in names], dtype=np.int64)
    possible_same = sum(math.comb(len(indices[n]), 2) for n in multi)
    possible_different = int((sizes.sum() ** 2 - (sizes**2).sum()) // 2)
    same = _sample_distinct(
        n_same,
        possible_same,
        lambda: _draw_same(indices, multi, rng),
        lambda: _same_candidates(indices, multi),
        rng,
        f"{where}: same pairs from {len(multi)} identities with 2+ images",
    )
    different = _sample_distinct(
        n_different,
        possible_different,
        lambda: _draw_different(indices, names, rng),
        lambda: _different_candidates(indices, names),
        rng,
        f"{where}: different pairs from {len(names)} identities",
    )
    return same, different


def _shuffled(pairs: list[tuple], rng) -> list[tuple]:
    return [pairs[i] for i in rng.permutation(len(pairs))]


def generate_pairs(
    images_by_identity: dict[str, list[str]],
    n_folds: int = 10,
    pairs_per_fold: int = 300,
    seed: int = 0,
    disjoint_folds: bool = True,
) -> list[PairFold]:
    """Draw LFW-style folds of same and different pairs, reproducibly.

    An identity whose images are all named ``<identity>_<NNNN>.<ext>`` is referred to by that
    NNNN, as in LFW (1-based in LFW and the synthetic data); any other identity by its images'
    file names (the reader accepts both). Pairs are distinct, same pairs join two different
    images, and within each fold both kinds are sorted by name as in LFW's file.

    Args:
        images_by_identity: ``{identity: [file name or path, ...]}``; non-image files ignored.
        n_folds: number of folds.
        pairs_per_fold: same pairs, and also different pairs, per fold.
        seed: seed of the numpy random generator.
        disjoint_folds: as in LFW, no identity appears in two folds: identities are dealt to
            folds so that each can hold its pairs whenever such a dealing exists
            (:func:`_assign_folds`; seeded, balanced); False draws all pairs from all
            identities, then splits them. Identities without images are ignored with a
            warning.

    Raises:
        DataError: a name a pairs file cannot hold (tabs, line breaks), or too few identities
            or images to draw the distinct pairs asked for (the message gives the counts: no
            dealing of identities to disjoint folds exists, or which kind falls short).
        ValueError: ``n_folds`` or ``pairs_per_fold`` below 1.
    """
    if n_folds < 1 or pairs_per_fold < 1:
        raise ValueError(f"n_folds={n_folds} and pairs_per_fold={pairs_per_fold} must be >= 1")
    indices = _without_empty(_image_keys(images_by_identity))
    rng = np.random.default_rng(seed)
    if not disjoint_folds:
        same, different = _sample_group(
            indices, list(indices), n_folds * pairs_per_fold, n_folds * pairs_per_fold, rng, "all"
        )
        same, different = _shuffled(same, rng), _shuffled(different, rng)
        blocks = [slice(f * pairs_per_fold, (f + 1) * pairs_per_fold) for f in range(n_folds)]
        return [PairFold(sorted(same[b]), sorted(different[b])) for b in blocks]
    folds = []
    for f, names in enumerate(_assign_folds(indices, n_folds, pairs_per_fold, rng)):
        where = f"fold {f} ({len(names)} identities)"
        same, different = _sample_group(indices, names, pairs_per_fold, pairs_per_fold, rng, where)
        folds.append(PairFold(same, different))
    return folds


# --------------------------------------------------------------------------- writing


def _valid_ref(ref) -> bool:
    """An LFW index (int >= 0) or an image file name without separators, tabs or breaks."""
    if isinstance(ref, str):
        return (
            os.path.splitext(ref)[1].lower() in IMAGE_EXTENSIONS
            and not re.search(r"[\t\n\r/\\]", ref)
            and not re.fullmatch(r"\d+", ref)
        )
    return isinstance(ref, (int, np.integer)) and not isinstance(ref, bool) and ref >= 0


def _valid_pair(pair, kind: str) -> bool:
    """A same pair is (name, idx1, idx2), a different one (name1, idx1, name2, idx2)."""
    if not isinstance(pair, (tuple, list)) or len(pair) != (3 if kind == "same" else 4):
        return False
    names = pair[:1] if kind == "same" else pair[0::2]
    idxs = pair[1:] if kind == "same" else pair[1::2]
    good_names = all(isinstance(n, str) and n and not re.search(r"[\t\n\r]", n) for n in names)
    good_idxs = all(_valid_ref(i) for i in idxs)
    return good_names and good_idxs


def _check_folds(folds) -> int:
    """pairs_per_fold of ``folds``, after checking the LFW layout and every field."""
    if not folds:
        raise ValueError("no folds to write")
    per_fold = len(folds[0][0])
    for f, (same, different) in enumerate(folds):
        if len(same) != per_fold or len(different) != per_fold or per_fold == 0:
            raise ValueError(
                f"fold {f} holds {len(same)} same and {len(different)} different pairs; every "
                f"fold must hold the same positive number of each ({per_fold} in fold 0)"
            )
        for kind, pairs in (("same", same), ("different", different)):
            bad = [pair for pair in pairs if not _valid_pair(pair, kind)]
            if bad:
                raise ValueError(f"fold {f}: malformed {kind} pair {bad[0]!r}")
    return per_fold


def pairs_text(folds) -> str:
    """Folds in the LFW format: a header line, then each fold's same and different pairs.

    Args:
        folds: a sequence of ``(same, different)`` (e.g. :class:`PairFold`), same pairs as
            (name, idx1, idx2), different pairs as (name1, idx1, name2, idx2).
    """
    per_fold = _check_folds(folds)
    lines = [f"{len(folds)}\t{per_fold}"]
    for same, different in folds:
        lines += ["\t".join(str(v) for v in pair) for pair in same]
        lines += ["\t".join(str(v) for v in pair) for pair in different]
    return "\n".join(lines) + "\n"


def write_pairs(path: str | os.PathLike, folds) -> None:
    """Write folds in the LFW format (:func:`pairs_text`), atomically
    (:func:`facenet.files.write_text_atomic`).

    Args:
        path: the pairs file to write.
        folds: as for :func:`pairs_text`.
    """
    write_text_atomic(path, pairs_text(folds))
