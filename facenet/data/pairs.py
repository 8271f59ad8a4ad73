"""LFW-style pair lists (``pairs.txt``): read them, and draw them for any identity folder.

The format is LFW's "View 2": a header ``<n_folds> <pairs_per_fold>`` (one number: one fold;
a third field names the image folder, relative to the file's, as ``facenet-make-pairs`` records
it when the file lies outside that folder; readers of LFW's own skip the header), then per fold
``pairs_per_fold`` same pairs ``name idx1 idx2`` and as many different pairs
``name1 idx1 name2 idx2``. ``name idx`` is ``root/name/name_<idx:04d>.<ext>``, the first
extension of ``IMAGE_EXTENSIONS`` found; an image's file name may stand for ``idx``. Fields are
split by tabs (names may hold spaces), else by whitespace. Folds are contiguous blocks of lines,
as the evaluation's ``KFold`` cuts them; ``PairList.fold_ids`` keeps each pair's fold in the file
when pairs with missing images are skipped.
"""

from __future__ import annotations

import io
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from functools import partial
from itertools import combinations
from pathlib import Path
from typing import NamedTuple

import numpy as np

from facenet.data.folder import list_identities
from facenet.data.images import IMAGE_EXTENSIONS
from facenet.errors import DataError, some_names
from facenet.files import open_regular, write_text_atomic

_MAX_PAIRS_BYTES = 2**28  # 5 million lines of LFW's kind (its own file: 160 KB)
_ASSIGN_BUDGET = 200_000  # nodes the fold assignment's search visits before it gives up


class PairsFormatError(DataError):
    """A pairs file off the format; the message names the file and line (0: the whole file)."""

    def __init__(self, path: str | os.PathLike, line_no: int, message: str):
        self.path, self.line_no = str(path), line_no
        super().__init__(f"{path}:{line_no}: {message}" if line_no else f"{path}: {message}")


class MissingImagesError(DataError, FileNotFoundError):
    """Images a pairs file names that do not exist: ``missing`` (their expected paths, sorted),
    ``lines`` (the lines naming each) and ``root`` (the folder searched). The message's first
    line counts them; :meth:`named` is the whole of it in one line, naming the options to give."""

    def __init__(self, pairs_path, root, missing: list[tuple[int, list[str]]]):
        self.lines: dict[str, list[int]] = {}
        for line_no, paths in missing:
            for path in paths:
                self.lines.setdefault(path, []).append(line_no)
        self.missing, self.root = sorted(self.lines), root
        self.head = (
            f"{pairs_path}: {len(self.missing)} image(s) named on {len(missing)} line(s) not "
            f"found under {root}"
        )
        super().__init__(self.head + ":\n" + self.named("root=...", "skip_missing=True"))

    def named(self, root_option: str, skip_option: str) -> str:
        """One line: the count, the first missing image and its line, the folder searched, and
        the options (``--root``, ``root=...``) that point elsewhere or skip those pairs."""
        first = self.missing[0]
        return (
            f"{self.head} (first: {first}, line {self.lines[first][0]}); give {root_option}, "
            f"the folder of the identity folders, or {skip_option} to skip those pairs"
        )


class PairFold(NamedTuple):
    """One fold: ``same`` as (name, idx1, idx2), ``different`` as (name1, idx1, name2, idx2)."""

    same: list[tuple[str, int, int]]
    different: list[tuple[str, int, str, int]]


@dataclass
class PairList:
    """The resolved pairs of a pairs file, in file order: N kept pairs.

    ``fold_ids`` and ``line_numbers`` are (N,) each kept pair's fold and line in the file;
    ``skipped`` holds (line, reason) of each skipped pair.
    """

    paths1: list[str]
    paths2: list[str]
    issame: np.ndarray
    n_folds: int
    pairs_per_fold: int
    fold_ids: np.ndarray
    line_numbers: np.ndarray
    skipped: list[tuple[int, str]] = field(default_factory=list)
    source: str = ""

    def __len__(self) -> int:
        return len(self.paths1)

    def unique_paths(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Sorted unique image paths and (N,) the index of each side's image in them, so each
        image is embedded once: ``emb[index1]``, ``emb[index2]``."""
        unique, inverse = np.unique(
            np.asarray(self.paths1 + self.paths2, dtype=str), return_inverse=True
        )
        inverse = inverse.astype(np.int64)
        return unique.tolist(), inverse[: len(self)], inverse[len(self) :]

    def folds_for(self, n_folds: int) -> np.ndarray | None:
        """(N,) the fold of each pair for an evaluation in ``n_folds`` folds.

        The file's own folds when it has ``n_folds``; otherwise the same pairs, in file order,
        are cut into ``n_folds`` contiguous runs, and the different pairs likewise, so every
        fold holds both kinds (a one-fold file lists all its same pairs first). None when a
        kind has fewer pairs than folds.
        """
        if n_folds == self.n_folds:
            return self.fold_ids
        ids = np.empty(len(self), dtype=np.int64)
        for kind in (True, False):
            members = np.flatnonzero(self.issame == kind)
            if len(members) < n_folds:
                return None
            ids[members] = np.arange(len(members)) * n_folds // len(members)
        return ids

    def skip_report(self) -> str:
        """What skipping did to the folds, in words (empty when nothing was skipped)."""
        if not self.skipped:
            return ""
        per_fold = 2 * self.pairs_per_fold - np.bincount(self.fold_ids, minlength=self.n_folds)
        return (
            f"{self.source}: skipped {len(self.skipped)} of {len(self) + len(self.skipped)} "
            f"pairs with missing images (per fold: {per_fold.tolist()}). "
            "verify and the commands keep each pair in its file's fold; an evaluation with "
            f"contiguous folds re-splits the remaining {len(self)} pairs into {self.n_folds}, "
            "moving pairs near fold boundaries (pass folds=pair_list.fold_ids to keep them)."
        )


class _BadLine(Exception):
    """What is wrong with a line; :func:`read_pairs` names the file and line."""


def _number(token: str, what: str) -> int:
    if not token.isdecimal():
        raise _BadLine(f"{what} must be a non-negative integer, got {token!r}")
    try:
        return int(token)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        raise _BadLine(f"{what} has {len(token)} digits: not a plausible count or index") from None


def _is_file_name(ref: str) -> bool:
    return os.path.splitext(ref)[1].lower() in IMAGE_EXTENSIONS


def _image_ref(token: str, what: str) -> int | str:
    if not _is_file_name(token):
        return _number(token, what)
    if re.search(r"[/\\]", token):
        raise _BadLine(f"{what} must be a file name inside its identity folder, got {token!r}")
    return token


def _identity(name: str) -> str:
    if re.search(r"[/\\]", name) or name in (".", ".."):
        raise _BadLine(f"identity {name!r} must be a folder name")
    return name


def _parse_pair(tokens: list[str]) -> tuple[bool, tuple, tuple]:
    """(issame, (name1, ref1), (name2, ref2)); a ref is an LFW index or a file name."""
    if len(tokens) not in (3, 4):
        raise _BadLine(
            "expected 'name idx1 idx2' (same) or 'name1 idx1 name2 idx2' (different), "
            f"got {len(tokens)} field(s): {' '.join(tokens)!r}"
        )
    name1, name2 = _identity(tokens[0]), _identity(tokens[0 if len(tokens) == 3 else 2])
    ref1, ref2 = _image_ref(tokens[1], "idx1"), _image_ref(tokens[-1], "idx2")
    return len(tokens) == 3, (name1, ref1), (name2, ref2)


def _fields(line: str) -> list[str]:
    """Tab-separated fields when that gives a header or a pair (names may hold spaces), else
    whitespace-separated words (LFW files mixing tabs and spaces)."""
    words = line.split()
    if "\t" in line:
        fields = [f.strip() for f in line.split("\t") if f.strip()]
        if len(fields) >= 3 or len(fields) == len(words):
            return fields
    return words


def lfw_image_index(identity: str, file_name: str) -> int | None:
    """The NNNN of ``<identity>_<NNNN>.<image extension>`` (a path's last part), else None."""
    stem, ext = os.path.splitext(os.path.basename(file_name))
    match = re.fullmatch(re.escape(identity) + r"_(\d+)", stem)
    return int(match.group(1)) if match and ext.lower() in IMAGE_EXTENSIONS else None


def _locate(root: Path, indexes: dict, name: str, ref: int | str) -> tuple[str, bool]:
    """(path, True) of the image ``(name, ref)``, else (the path looked for, False); ``indexes``
    caches each folder's {LFW index: path}, where the first extension of IMAGE_EXTENSIONS
    wins, then the first name."""
    if isinstance(ref, str):
        return str(root / name / ref), (root / name / ref).is_file()
    if name not in indexes:
        folder = root / name
        ranked = sorted(
            (IMAGE_EXTENSIONS.index(os.path.splitext(entry)[1].lower()), entry)
            for entry in (os.listdir(folder) if folder.is_dir() else [])
            if lfw_image_index(name, entry) is not None
        )
        indexes[name] = {lfw_image_index(name, e): str(folder / e) for _, e in reversed(ranked)}
    found = indexes[name].get(ref)
    return (found, True) if found else (f"{root / name / name}_{ref:04d}.*", False)


def _parse(pairs_path: Path) -> tuple[int, int, Path, list]:
    """(n_folds, pairs_per_fold, the image folder the header records (default: the file's
    own), [(line number, issame, side1, side2), ...])."""
    if not pairs_path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(pairs_path))
    fail = partial(PairsFormatError, pairs_path, 0)
    try:
        with open_regular(pairs_path, _MAX_PAIRS_BYTES, fail) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8")  # universal newlines: CRLF as LF
            lines = [(n, _fields(line)) for n, line in enumerate(text, start=1) if line.strip()]
    except UnicodeDecodeError:
        raise PairsFormatError(pairs_path, 0, "not a UTF-8 text file") from None
    if not lines:
        raise PairsFormatError(pairs_path, 0, "empty pairs file")
    (line_no, header), parsed = lines[0], []
    try:
        if len(header) not in (1, 2, 3):
            raise _BadLine(
                f"expected a header '<n_folds>\\t<pairs_per_fold>[\\t<image folder>]', got {header}"
            )
        n_folds, per_fold = (1, *[_number(t, "header value") for t in header[:2]])[-2:]
        if n_folds < 1 or per_fold < 1:
            raise _BadLine(f"header values must be >= 1, got {header}")
        root = pairs_path.parent / (header[2] if len(header) == 3 else "")
        if not root.is_dir():
            raise _BadLine(f"the image folder it records, {root}, is not a folder")
        for line_no, tokens in lines[1:]:
            parsed.append((line_no, *_parse_pair(tokens)))
    except _BadLine as err:
        raise PairsFormatError(pairs_path, line_no, str(err)) from None
    if len(parsed) != n_folds * 2 * per_fold:
        raise PairsFormatError(
            pairs_path,
            lines[0][0],
            f"the header promises {n_folds} fold(s) x 2 x {per_fold} = "
            f"{n_folds * 2 * per_fold} pairs, but the file holds {len(parsed)}",
        )
    return n_folds, per_fold, root, parsed


def read_pairs(
    pairs_path: str | os.PathLike, root: str | os.PathLike | None = None, skip_missing: bool = False
) -> PairList:
    """Read an LFW-format pairs file and resolve its images to absolute paths.

    Args:
        root: the folder of identity folders; default the one the header records (its third
            field, relative to the pairs file's folder), else the pairs file's folder.
        skip_missing: skip pairs with a missing image (``skipped``, ``skip_report()`` and a
            warning) instead of raising :class:`MissingImagesError`.

    Raises:
        FileNotFoundError: the pairs file or the image root does not exist.
        PairsFormatError: a malformed line, a pair count off the header, not UTF-8 text.
    """
    pairs_path = Path(pairs_path)
    n_folds, per_fold, recorded, parsed = _parse(pairs_path)
    root = Path(os.path.abspath(recorded if root is None else root))
    if not root.is_dir():
        raise FileNotFoundError(f"image root {root} (for {pairs_path}) is not a folder")
    indexes, kept, missing = {}, [], []
    for position, (line_no, same, *sides) in enumerate(parsed):
        fold = position // (2 * per_fold)
        located = [_locate(root, indexes, *side) for side in sides]
        absent = [path for path, found in located if not found]
        if absent:
            missing.append((line_no, absent))
        else:
            kept.append((line_no, fold, *[path for path, _ in located], same))
    if missing and not skip_missing:
        raise MissingImagesError(pairs_path, root, missing)
    lines, folds, paths1, paths2, same = list(zip(*kept)) or [()] * 5
    pair_list = PairList(
        list(paths1),
        list(paths2),
        np.array(same, dtype=bool),
        n_folds,
        per_fold,
        fold_ids=np.array(folds, dtype=np.int64),
        line_numbers=np.array(lines, dtype=np.int64),
        skipped=[(line_no, "missing " + ", ".join(absent)) for line_no, absent in missing],
        source=str(pairs_path),
    )
    if missing:
        warnings.warn(pair_list.skip_report(), stacklevel=2)
    return pair_list


# ``{identity: [image file name, ...]}`` of every ``root/<identity>/``, both sorted.
scan_identities = list_identities


def _image_keys(images_by_identity: dict[str, list[str]]) -> dict[str, list]:
    """How a pairs file names each identity's images, sorted and unique: the LFW indices when
    every image is named ``<identity>_<NNNN>.<ext>``, else the file names. Identities without
    images are left out with one warning, as IdentityFolder leaves them out."""
    keys = {}
    for identity in sorted(images_by_identity):
        if not identity or re.search(r"[\t\n\r/\\]", identity) or identity != identity.strip():
            raise DataError(
                f"identity name {identity!r} is empty or holds tabs, line breaks or slashes"
            )
        names = [os.path.basename(n) for n in images_by_identity[identity] if _is_file_name(n)]
        bad = [n for n in names if re.search(r"[\t\n\r\\]", n) or n != n.strip()]
        if bad:
            raise DataError(
                f"identity {identity!r}: image file name {bad[0]!r} holds tabs, line breaks, "
                "backslashes or surrounding spaces, which a pairs file cannot name"
            )
        indices = [lfw_image_index(identity, n) for n in names]
        keys[identity] = sorted(set(indices if None not in indices else names))
    empty = [name for name, found in keys.items() if not found]
    if empty:
        warnings.warn(
            f"ignored {len(empty)} identity folder(s) without images: {some_names(empty, 10)}",
            stacklevel=3,
        )
    return {name: found for name, found in keys.items() if found}


class _FoldLoad:
    """What a fold's identities can give: same pairs, images, different pairs."""

    def __init__(self) -> None:
        self.same = self.images = self.different = 0
        self.names: list[str] = []

    def add(self, name: str, count: int) -> None:
        self.different += count * self.images  # each new image pairs with every image there
        self.same += math.comb(count, 2)
        self.images += count
        self.names.append(name)

    def deficit(self, per_fold: int) -> tuple[int, int]:
        """(same, different) pairs still missing for ``per_fold`` of each."""
        return max(0, per_fold - self.same), max(0, per_fold - self.different)


class _Search:
    """Exact depth-first search for identity-disjoint folds that each hold ``per_fold`` pairs
    of each kind: identities largest first, each to the short fold it helps most first.

    It finds a dealing whenever one exists, unless it visits ``_ASSIGN_BUDGET`` nodes first
    (``gave_up``); its first descent is the greedy dealing. Cuts: an identity only goes to a
    fold still short (adding one never hurts a fold); of folds in the same state only the first
    is tried; a branch stops when the identities left cannot cover the missing same pairs
    (their C(n, 2) summed) or different pairs (their images with every image dealt or left).
    """

    def __init__(self, counts: list[tuple[str, int]], n_folds: int, per_fold: int) -> None:
        self.counts, self.per_fold = counts, per_fold
        self.folds = [_FoldLoad() for _ in range(n_folds)]
        sizes = np.array([c for _, c in counts] + [0], dtype=np.int64)

        def left(values) -> list[int]:  # len(counts) + 1 sums over the identities from k on
            return np.cumsum(values[::-1])[::-1].tolist()

        self.left_same = left(sizes * (sizes - 1) // 2)
        self.left_images = left(sizes)
        self.left_among = left(sizes * np.array(self.left_images[1:] + [0]))
        self.nodes, self.gave_up = 0, False

    def _choices(self, k: int, short: list[_FoldLoad]) -> list[_FoldLoad]:
        """The short folds in distinct states, those identity ``k`` helps most first; none
        when the identities from ``k`` on (none past the last) cannot cover what they miss."""
        same, different = map(sum, zip(*[f.deficit(self.per_fold) for f in short]))
        dealt = sum(f.images for f in self.folds)
        can_differ = self.left_images[k] * dealt + self.left_among[k]
        if same > self.left_same[k] or different > can_differ:
            return []
        count, states = self.counts[k][1], {}
        for fold in short:
            states.setdefault((fold.same, fold.images, fold.different), fold)

        def gain(fold: _FoldLoad) -> tuple:
            same, different = fold.deficit(self.per_fold)
            covered = min(same, math.comb(count, 2)) + min(different, count * fold.images)
            return (-covered, -(same + different), len(fold.names))

        return sorted(states.values(), key=gain)

    def run(self) -> int | None:
        """Deal identities until every fold holds enough; the number dealt, or None."""
        dealt, options = [], None  # dealt: (options left, fold, its state before) per identity
        while True:
            k = len(dealt)
            if options is None:  # first visit of identity k
                self.nodes += 1
                if self.nodes > _ASSIGN_BUDGET:
                    self.gave_up = True
                    return None
                short = [f for f in self.folds if f.deficit(self.per_fold) != (0, 0)]
                if not short:
                    return k
                options = iter(self._choices(k, short))
            fold = next(options, None)
            if fold is not None:
                dealt.append((options, fold, (fold.same, fold.images, fold.different)))
                fold.add(*self.counts[k])
                options = None
            elif not dealt:
                return None
            else:  # back to identity k - 1: take it back, try its next fold
                options, fold, (fold.same, fold.images, fold.different) = dealt.pop()
                fold.names.pop()


def _why_no_dealing(counts: list[tuple[str, int]], n_folds: int, per_fold: int, search=None):
    """Why ``counts`` (identity, images) cannot be dealt to ``n_folds`` identity-disjoint folds
    of ``per_fold`` same and different pairs, with the numbers that decide it.

    Without ``search``, only what the counts rule out (None when they allow a dealing): asked
    before any per-fold state is made, so that a billion folds of ten identities is refused at
    once. After a :class:`_Search` found none, why.
    """
    multi = sum(1 for _, c in counts if c >= 2)
    same = sum(math.comb(c, 2) for _, c in counts)
    if same < n_folds * per_fold:
        reason = f"{same} same pairs exist, {n_folds * per_fold} needed"
    elif multi < n_folds:
        reason = "every fold needs an identity with 2+ images"
    elif search is None:
        return None
    elif search.gave_up:
        reason = f"no dealing of identities to folds found within {_ASSIGN_BUDGET} steps"
    else:
        reason = "no dealing of identities to folds gives every fold enough pairs of both kinds"
    head = (
        f"{n_folds} identity-disjoint fold(s) of {per_fold} same + {per_fold} different pairs "
        f"from {len(counts)} identities ({multi} with 2+ images)"
    )
    return f"{head}: {reason}"


def _assign_folds(indices: dict[str, list], n_folds: int, per_fold: int, rng) -> list[list[str]]:
    """Deal identities to ``n_folds`` disjoint folds that can each hold ``per_fold`` same and
    ``per_fold`` different pairs, whenever such a dealing exists (:class:`_Search`).

    Identities are shuffled (ties in size keep that order), so the seed varies the folds; those
    the search did not need then go, largest first, to the fold with the fewest identities,
    then the fewest same pairs, as LFW's folds are balanced.
    """
    names = list(indices)
    counts = [(names[i], len(indices[names[i]])) for i in rng.permutation(len(names))]
    counts.sort(key=lambda nc: -nc[1])  # stable
    impossible = _why_no_dealing(counts, n_folds, per_fold)
    if impossible:
        raise DataError(impossible)
    search = _Search(counts, n_folds, per_fold)
    dealt = search.run()
    if dealt is None:
        raise DataError(_why_no_dealing(counts, n_folds, per_fold, search))
    for name, count in counts[dealt:]:
        min(search.folds, key=lambda f: (len(f.names), f.same)).add(name, count)
    return [fold.names for fold in search.folds]


def _pick(keys: list, rng):
    """One uniform key (the draw ``rng.choice`` makes, for indices and file names alike)."""
    return keys[int(rng.integers(len(keys)))]


def _sample_distinct(count: int, possible: int, draw, candidates, rng, what: str) -> list[tuple]:
    """``count`` distinct pairs out of ``possible``: by rejection sampling with ``draw()``, or
    from ``candidates()`` (every pair) when they are scarce."""
    if count > possible:
        raise DataError(f"{what}: {count} distinct pairs needed, only {possible} exist")
    chosen: set[tuple] = set()
    if 2 * count <= possible:
        for _ in range(50 * count + 1001):  # then the identities run out of unused pairs
            chosen.add(draw())
            if len(chosen) == count:
                break
    if len(chosen) < count:
        rest = sorted(set(candidates()) - chosen)
        chosen.update(
            rest[i] for i in rng.choice(len(rest), size=count - len(chosen), replace=False)
        )
    return sorted(chosen)


def _sample_group(indices, names, per_kind: int, rng, where: str):
    """(same pairs, different pairs), ``per_kind`` of each, among the identities ``names``:
    a same pair is a uniform identity with 2+ images and two distinct images of it, a
    different pair two distinct uniform identities and one image of each."""
    multi = [n for n in names if len(indices[n]) >= 2]
    same_possible = sum(math.comb(len(indices[n]), 2) for n in multi)

    def draw_same():
        name = _pick(multi, rng)
        keys = indices[name]
        return (name, *sorted(keys[i] for i in rng.choice(len(keys), size=2, replace=False)))

    def draw_different():
        n1, n2 = sorted(names[i] for i in rng.choice(len(names), size=2, replace=False).tolist())
        return (n1, _pick(indices[n1], rng), n2, _pick(indices[n2], rng))

    same = _sample_distinct(
        per_kind,
        same_possible,
        draw_same,
        lambda: [(n, a, b) for n in multi for a, b in combinations(indices[n], 2)],
        rng,
        f"{where}: same pairs from {len(multi)} identities with 2+ images",
    )
    different = _sample_distinct(
        per_kind,
        math.comb(sum(len(indices[n]) for n in names), 2) - same_possible,
        draw_different,
        lambda: [
            (n1, a, n2, b)
            for n1, n2 in combinations(sorted(names), 2)
            for a in indices[n1]
            for b in indices[n2]
        ],
        rng,
        f"{where}: different pairs from {len(names)} identities",
    )
    return same, different


def generate_pairs(
    images_by_identity: dict[str, list[str]],
    n_folds: int = 10,
    pairs_per_fold: int = 300,
    seed: int = 0,
    disjoint_folds: bool = True,
) -> list[PairFold]:
    """Draw LFW-style folds of distinct same and different pairs, reproducibly.

    Images named ``<identity>_<NNNN>.<ext>`` are referred to by NNNN, as in LFW; any other
    identity's images by file name. Within a fold both kinds are sorted, as in LFW's file.

    Args:
        images_by_identity: ``{identity: [file name or path, ...]}``; non-images ignored.
        pairs_per_fold: same pairs, and also different pairs, per fold.
        disjoint_folds: no identity in two folds, as in LFW (identities are dealt to folds by
            an exact search, seeded and balanced); False draws all pairs from all identities,
            then splits them.

    Raises:
        DataError: a name a pairs file cannot hold, or too few identities or images for the
            distinct pairs asked for (the message gives the counts).
    """
    if n_folds < 1 or pairs_per_fold < 1:
        raise ValueError(f"n_folds={n_folds} and pairs_per_fold={pairs_per_fold} must be >= 1")
    indices = _image_keys(images_by_identity)
    rng = np.random.default_rng(seed)
    if disjoint_folds:
        groups = _assign_folds(indices, n_folds, pairs_per_fold, rng)
        return [
            PairFold(
                *_sample_group(
                    indices, names, pairs_per_fold, rng, f"fold {f} ({len(names)} identities)"
                )
            )
            for f, names in enumerate(groups)
        ]
    total = n_folds * pairs_per_fold
    same, different = (
        [pairs[i] for i in rng.permutation(total)]
        for pairs in _sample_group(indices, list(indices), total, rng, "all")
    )
    blocks = [slice(f * pairs_per_fold, (f + 1) * pairs_per_fold) for f in range(n_folds)]
    return [PairFold(sorted(same[b]), sorted(different[b])) for b in blocks]


def draw_folds(
    images_by_identity: dict[str, list[str]], n_folds: int, pairs_per_fold: int, seed: int
):
    """:func:`generate_pairs`' identity-disjoint folds when there are enough identities, else
    folds that share them; a DataError when even those cannot be drawn."""
    try:
        return generate_pairs(images_by_identity, n_folds, pairs_per_fold, seed)
    except DataError:
        return generate_pairs(images_by_identity, n_folds, pairs_per_fold, seed, False)


def _line(pair, kind: str, fold: int) -> str:
    """``pair`` as a line of the file; ValueError when it would not read back as the same pair."""
    line = "\t".join(map(str, pair)) if isinstance(pair, (tuple, list)) else ""
    try:
        same, (name1, ref1), (name2, ref2) = _parse_pair(_fields(line))
        read_back = (name1, ref1, ref2) if same else (name1, ref1, name2, ref2)
        if same == (kind == "same") and read_back == tuple(pair) and not re.search("[\n\r]", line):
            return line
    except _BadLine:
        pass
    raise ValueError(f"fold {fold}: malformed {kind} pair {pair!r}")


def pairs_text(folds, root: str | None = None) -> str:
    """``(same, different)`` folds (as :class:`PairFold`) in the LFW format: a header line (with
    ``root``, the image folder relative to the file's, as a third field), then each fold's same
    and different pairs."""
    if not folds:
        raise ValueError("no folds to write")
    per_fold = len(folds[0][0])
    if root is not None and (not root or re.search("[\t\n\r]", root) or root != root.strip()):
        raise DataError(
            f"image folder {root!r} is empty or holds tabs, line breaks or edge spaces, which "
            "a pairs file's header cannot record: write the pairs file inside it"
        )
    lines = [f"{len(folds)}\t{per_fold}" + ("" if root is None else f"\t{root}")]
    for f, (same, different) in enumerate(folds):
        if len(same) != per_fold or len(different) != per_fold or per_fold == 0:
            raise ValueError(
                f"fold {f} holds {len(same)} same and {len(different)} different pairs; every "
                f"fold must hold the same positive number of each ({per_fold} in fold 0)"
            )
        for kind, pairs in (("same", same), ("different", different)):
            lines += [_line(pair, kind, f) for pair in pairs]
    return "\n".join(lines) + "\n"


def write_pairs(path: str | os.PathLike, folds, root: str | None = None) -> None:
    """Write folds in the LFW format (:func:`pairs_text`), atomically."""
    write_text_atomic(path, pairs_text(folds, root))
