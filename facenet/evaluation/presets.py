"""Verification settings that check themselves, the publishers' conventions as data, and the
checks of the arrays the protocol is given.

``VerifySettings`` holds how pairs are embedded and measured, and refuses a value the protocol
cannot use when it is made (a :class:`SettingsError` naming the field, which a configuration or
a command renames to the key or flag the user typed). ``EVAL_PRESETS`` holds, per publisher,
the settings its published LFW figure was computed with (how its crops were made is the
alignment wing's: ``facenet.wings.align.presets``; docs/reproduce.md and docs/models.md cite the
publishers' code for each value). A publisher's variant of the protocol (a grid, a threshold
rule, a scoring) is a row of a table here, never a branch elsewhere. The input checks at the end
keep ``facenet.evaluation.protocol`` to the algorithm; each names what it refuses.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from facenet.data.images import EVAL_PREPROCESS
from facenet.errors import FacenetError, shown
from facenet.metric.distances import DISTANCE_NAMES, paired_distance

# "unit": the network's L2-normalised embedding; "raw": the embedding layer before it.
FEATURES = ("unit", "raw")


class SettingsError(FacenetError, ValueError):
    """A verification setting the protocol cannot use: ``field`` names it, ``value`` and
    ``problem`` say what is wrong, so that a caller can name what the user typed instead
    (:meth:`named`)."""

    def __init__(self, field: str, value: Any, problem: str):
        super().__init__(f"{field}={shown(value)}: {problem}")
        self.field, self.value, self.problem = field, value, problem

    def named(self, key: str) -> str:
        """The message with ``key`` (``eval.n_folds``, ``--folds``) in place of the field."""
        return f"{key}: {shown(self.value)}: {self.problem}"


# The flags of facenet-evaluate whose names are not their fields' in dashes.
_FLAGS = {"n_folds": "--folds"}


def flag_for(field: str) -> str:
    """The command-line flag of a ``VerifySettings`` field: ``--folds`` for n_folds, the field
    in dashes otherwise (``--far-target``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


# --------------------------------------------------------------------------- the publishers' rows


def classic_thresholds(fine: bool = False) -> np.ndarray:
    """Both publishers' grids whatever the distance: ``arange(0, 4, 0.01)``, or the VAL grid
    ``arange(0, 4, 0.001)`` with ``fine`` (angular distances use only their first quarter)."""
    return np.arange(0, 4, 0.001 if fine else 0.01)


def mobilefacenet_thresholds() -> np.ndarray:
    """Xiaoccer/MobileFaceNet_Pytorch's similarity grid ``arange(-10000, 10001) / 10000`` as
    increasing cosine distances ``1 - t``: its "similarity > t" is "distance < 1 - t"."""
    similarities = np.arange(-10000, 10001) / 10000  # its getThreshold's grid
    return 1.0 - similarities[::-1]


def float64_distances(a: np.ndarray, b: np.ndarray, distance: str) -> np.ndarray:
    """(N,) training's ``paired_distance`` of the (N, D) float64 rows of ``a`` and ``b``."""
    return paired_distance(torch.from_numpy(a), torch.from_numpy(b), distance).numpy()


def mobilefacenet_distances(a: np.ndarray, b: np.ndarray, distance: str = "cosine") -> np.ndarray:
    """(N,) 1 - lfw_eval.py's ``evaluation_10_fold`` score of (N, D) mean-subtracted features:
    its operations in its order, in the features' own dtype, so the scores are its scores bit
    for bit (1 - s is exact in float64 for a float32 s: "1 - s < 1 - t" decides as "s > t").
    ``distance``: always cosine (the settings check it)."""
    unit = lambda x: x / np.expand_dims(np.sqrt(np.sum(np.power(x, 2), 1)), 1)
    return 1.0 - np.sum(np.multiply(unit(a), unit(b)), 1).astype(np.float64)


def first_best(correct: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """(F,) the first grid threshold with the most of the (F, T) right training pairs (the
    classic ``np.argmax``)."""
    return grid[np.argmax(correct, axis=1)]


def mean_best(correct: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """(F,) the mean of every grid threshold with the most of the (F, T) right training pairs
    (Xiaoccer/MobileFaceNet_Pytorch's getThreshold)."""
    best = correct == correct.max(axis=1, keepdims=True)  # (F, T)
    return np.array([np.mean(grid[row]) for row in best])


@dataclass(frozen=True)
class ThresholdRule:
    """How each fold's threshold is chosen (``best``: (F, T) right training pairs per threshold
    and the (T,) grid -> (F,) thresholds) and whether a negative pair exactly at a threshold is
    accepted there (``inclusive``: then such a pair is wrong for either kind)."""

    best: Callable
    inclusive: bool = False


@dataclass(frozen=True)
class Scoring:
    """How pairs are measured: ``distances(a, b, distance)`` -> (N,) float64 of (N, D) rows;
    ``measures``: the only distance it measures (None: any); ``own_dtype``: the rows keep the
    features' float dtype (float64 otherwise)."""

    distances: Callable
    measures: str | None = None
    own_dtype: bool = False


# Grid name: () -> (accuracy grid, VAL grid); None: the distance's own grids (the protocol's
# threshold_grids). mobilefacenet has no VAL: its one grid serves both.
GRIDS = {
    "default": None,
    "classic": lambda: (classic_thresholds(), classic_thresholds(fine=True)),
    "mobilefacenet": lambda: (mobilefacenet_thresholds(), mobilefacenet_thresholds()),
}
THRESHOLD_RULES = {
    "first": ThresholdRule(first_best),  # the classic rule
    "mean": ThresholdRule(mean_best, inclusive=True),  # MobileFaceNet_Pytorch's lfw_eval.py
}
SCORINGS = {
    "float64": Scoring(float64_distances),
    # lfw_eval.py's float32 cosine, operation for operation
    "mobilefacenet": Scoring(mobilefacenet_distances, measures="cosine", own_dtype=True),
}


# --------------------------------------------------------------------------- settings


class FromAttributes:
    """``cls.of(source)``: a dataclass's settings read by attribute from ``source`` (a config
    section, parsed arguments); attributes it lacks keep their defaults."""

    @classmethod
    def of(cls, source):
        return cls(
            **{f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}
        )


# Each field with named options, and the options.
_CHOICES = {
    "distance": DISTANCE_NAMES,  # training's distances are the ones evaluation measures
    "preprocess": EVAL_PREPROCESS,
    "grid": tuple(GRIDS),
    "features": FEATURES,
    "threshold_rule": tuple(THRESHOLD_RULES),
    "scoring": tuple(SCORINGS),
}
# Each integer field and its least value: a fold's threshold is chosen on the other folds.
_LEAST = {"n_folds": 2, "batch_size": 1, "num_workers": 0}
# The most images per forward: the bound of every count of a run configuration (int32's).
MAX_BATCH_SIZE = 2**31 - 1


@dataclass(frozen=True)
class VerifySettings(FromAttributes):
    """How pairs are embedded and measured (the config's ``eval`` keys of the same names); every
    value is checked when the settings are made (:class:`SettingsError`).

    ``grid``: "default" (from the distance), "classic" ([0, 4) whatever the distance) or
    "mobilefacenet" (its similarity grid); ``features``: "unit" or "raw" (before L2
    normalisation); ``threshold_rule``: "first" (classic) or "mean"; ``scoring``: "float64" or
    "mobilefacenet" (lfw_eval.py's float32 cosine, operation for operation).
    """

    distance: str = "squared"
    flip: bool = False
    subtract_mean: bool = False
    preprocess: str = "resize"
    grid: str = "default"
    features: str = "unit"
    threshold_rule: str = "first"
    scoring: str = "float64"
    n_folds: int = 10
    far_target: float = 1e-3
    batch_size: int = 128
    num_workers: int = 0
    skip_missing: bool = False

    def __post_init__(self):
        for name, options in _CHOICES.items():
            value = getattr(self, name)
            if value not in options:
                raise SettingsError(name, value, "valid options: " + ", ".join(options))
        measured = SCORINGS[self.scoring].measures
        if measured not in (None, self.distance):
            raise SettingsError(
                "scoring", self.scoring, f"measures {measured} distances, not {self.distance!r}"
            )
        for name, least in _LEAST.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise SettingsError(name, value, f"expected an integer >= {least}")
        if self.batch_size > MAX_BATCH_SIZE:
            raise SettingsError("batch_size", self.batch_size, f"expected <= {MAX_BATCH_SIZE}")
        if not (isinstance(self.far_target, numbers.Real) and 0 < self.far_target <= 1):
            raise SettingsError("far_target", self.far_target, "must lie in (0, 1]")
        for name in ("flip", "subtract_mean", "skip_missing"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise SettingsError(name, value, "expected true or false")

    def provenance(self) -> dict:
        """What a threshold chosen under these settings applies to, besides the weights."""
        return {
            "flip": bool(self.flip),
            "subtract_mean": bool(self.subtract_mean),
            "preprocess": self.preprocess,
            "features": self.features,
        }


CLASSIC = VerifySettings()  # the classic protocol: squared L2 on unit embeddings, 10 folds

# The settings a publisher's preset fixes; the others (folds, FAR target, batch) stay the user's.
PUBLISHER_FIELDS = (
    "distance",
    "flip",
    "subtract_mean",
    "preprocess",
    "grid",
    "features",
    "threshold_rule",
    "scoring",
)

EVAL_PRESETS = {
    # facenet-pytorch's examples/lfw_evaluate.ipynb
    "facenet-pytorch": VerifySettings("squared", False, False, "crop", "classic"),
    # davidsandberg/facenet's validate_on_lfw.py with its published options (distance_metric=1)
    "sandberg": VerifySettings("angular", True, True, "crop", "classic"),
    # Xiaoccer/MobileFaceNet_Pytorch's lfw_eval.py
    "mobilefacenet": VerifySettings(
        "cosine", True, True, "crop", "mobilefacenet", "raw", "mean", "mobilefacenet"
    ),
}


# --------------------------------------------------------------------------- the protocol's inputs


def as_numpy(x: Any) -> np.ndarray:
    """A tensor (on any device, with or without grad) or an array-like as a numpy array."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def finite_array(x: Any, name: str, ndim: int, keep_float: bool = False) -> np.ndarray:
    """``x`` as float64 (or its own float dtype with ``keep_float``), ``ndim``-D and finite."""
    arr = as_numpy(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.dtype == bool or arr.dtype.kind not in "iuf":  # complex, strings, dates: refused
        raise ValueError(f"{name} must be real numbers, got dtype {arr.dtype}")
    if not (keep_float and np.issubdtype(arr.dtype, np.floating)):
        arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        first = np.argwhere(bad)[0].tolist()
        raise ValueError(
            f"{name} contains {int(bad.sum())} NaN or infinite value(s) (first at index {first})"
        )
    return arr


def pair_labels(issame: Any, n_pairs: int) -> np.ndarray:
    """(N,) bool from True/False or 0/1 only."""
    arr = as_numpy(issame)
    if arr.ndim != 1:
        raise ValueError(f"issame must be 1-D, got shape {arr.shape}")
    if len(arr) != n_pairs:
        raise ValueError(f"lengths differ: {n_pairs} distances but {len(arr)} issame labels")
    if arr.dtype == bool:
        return arr
    if not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"issame must be bool or 0/1, got dtype {arr.dtype}")
    bad = np.flatnonzero(~np.isin(arr, (0, 1)))
    if len(bad):
        raise ValueError(
            f"issame must hold only 0/1 or True/False; found {arr[bad[0]].item()!r} at index "
            f"{bad[0]}"
        )
    return arr == 1


def increasing_grid(thresholds: Any, name: str) -> np.ndarray:
    """(T,) finite, non-empty, strictly increasing thresholds."""
    grid = finite_array(thresholds, name, ndim=1)
    if len(grid) == 0:
        raise ValueError(f"{name} is empty")
    if np.any(np.diff(grid) <= 0):
        raise ValueError(f"{name} must be strictly increasing")
    return grid


def fold_indices(folds: Any, n_pairs: int, n_folds: int) -> np.ndarray:
    """(N,) int64 fold of every pair, each of 0..F-1 used (so no fewer pairs than folds)."""
    if n_pairs < n_folds:
        raise ValueError(f"fewer pairs ({n_pairs}) than folds ({n_folds})")
    ids = as_numpy(folds)
    if ids.shape != (n_pairs,) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"folds must be ({n_pairs},) integers, got {ids.dtype} {ids.shape}")
    if not np.array_equal(np.unique(ids), np.arange(n_folds)):
        raise ValueError(f"folds must use every fold index 0..{n_folds - 1} and no other")
    return ids.astype(np.int64)


def both_kinds(n: np.ndarray, fold_ids: np.ndarray) -> np.ndarray:
    """The (F, 2) [negative, positive] pairs of each fold, every fold holding both kinds
    (else its VAL or FAR is 0 / 0)."""
    for fold, kind in np.argwhere(n == 0)[:1]:
        members = np.flatnonzero(fold_ids == fold)
        raise ValueError(
            f"fold {fold} of {len(n)} (pairs {members[0]}-{members[-1]}) has no "
            f"{('negative (diff.)', 'positive (same)')[kind]} pair, so its VAL or FAR is "
            "undefined; the folds are contiguous in input order, so keep the pairs in pairs.txt "
            "order (same and different per fold)"
        )
    return n


def embedding_pairs(emb1: Any, emb2: Any, keep_float: bool = False):
    """(a, b): both (N, D) finite, of one shape and one dtype (see :func:`finite_array`)."""
    a = finite_array(emb1, "emb1", ndim=2, keep_float=keep_float)
    b = finite_array(emb2, "emb2", ndim=2, keep_float=keep_float)
    if a.shape != b.shape:
        raise ValueError(f"emb1 and emb2 shapes differ: {a.shape} vs {b.shape}")
    common = np.result_type(a, b)
    return a.astype(common, copy=False), b.astype(common, copy=False)


def measurable(a: np.ndarray, b: np.ndarray, distance: str):
    """(a, b), refused where ``distance`` is an angle and a row has zero length: its angle is
    undefined, rather than measured as 1 (or NaN)."""
    angle = distance in ("cosine", "angular")
    if angle and np.any(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) == 0):
        raise ValueError(f"{distance} distance of a zero-length embedding is undefined")
    return a, b
