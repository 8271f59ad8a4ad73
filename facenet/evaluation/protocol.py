"""Face verification: the classic LFW protocol, computed exactly and without threshold loops.

The protocol is the one the published FaceNet numbers were computed with (``calculate_roc`` and
``calculate_val`` of the classic implementation), with its numbers reproduced exactly:

- The N pairs are split into ``n_folds`` contiguous folds in input order (scikit-learn's
  ``KFold(shuffle=False)``), so a standard ``pairs.txt`` gives the official ten folds of 600.
- A pair is predicted "same" when ``distance < threshold``.
- Accuracy: for each test fold, the threshold is the FIRST maximum of the accuracy on the other
  folds over the grid ``thresholds``; the fold's accuracy is measured at it. ``tpr`` and ``fpr``
  are the test-fold rates at every grid threshold, averaged over folds (0 where a denominator is 0).
- VAL at FAR: on the training folds, FAR as a function of the grid threshold is non-decreasing.
  The threshold is interpolated linearly between the two neighbouring grid thresholds where FAR
  first reaches ``far_target`` (the first grid threshold itself if FAR is already at or above the
  target there, 0.0 if it never reaches it); VAL and FAR are then measured on the test fold.
  This replaces the classic ``interp1d(far_train, thresholds)``, which raises on current SciPy
  as soon as two training FAR values repeat (they almost always do).
- AUC and EER come from the full ROC of all pairs (scikit-learn ``roc_curve`` on negated
  distances); the EER is the point where FPR = 1 - TPR on the linearly interpolated curve.

Speed: each distance is placed once among the sorted grid thresholds (``searchsorted``) and the
counts "distance < threshold" for every fold and threshold follow from one ``bincount`` and a
cumulative sum, so the cost is O(N log T + F T) instead of the classic O(F T N) Python loop.

Flip-concatenation (the classic "use flipped images" option) happens when embedding: the caller
concatenates the embedding of each image with that of its horizontal flip and passes the (N, 2D)
result here. Note that the squared distance of such concatenations ranges over [0, 8] for unit
halves, while the default grid stays the classic [0, 4), as in the classic code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.metrics import auc as area_under_curve
from sklearn.metrics import roc_curve
from sklearn.model_selection import KFold

# How results are written lives in report (the one formatting); re-exported here.
from facenet.evaluation.report import figures, figures_line

# The one distance implementation, shared with training (float64 in, float64 out).
from facenet.metric.distances import DISTANCE_NAMES, paired_distance

__all__ = [
    "DISTANCES",
    "SCORINGS",
    "THRESHOLD_RULES",
    "VerificationResult",
    "default_thresholds",
    "evaluate_verification",
    "pair_distances",
    "evaluate_embeddings",
]

# The distances training uses are the ones evaluation measures: one name list.
DISTANCES = DISTANCE_NAMES

# How the accuracy threshold of a fold is chosen on its training folds: "first" (the classic
# code's np.argmax) or "mean" (Xiaoccer/MobileFaceNet_Pytorch's getThreshold and getAccuracy).
THRESHOLD_RULES = ("first", "mean")
# How embeddings become distances: "float64" (the metric, in float64) or "mobilefacenet"
# (lfw_eval.py's cosine, operation for operation in the features' own dtype).
SCORINGS = ("float64", "mobilefacenet")

# (upper end, accuracy-grid step, VAL-grid step). The squared row is the classic
# arange(0, 4, 0.01) / arange(0, 4, 0.001) for unit vectors; euclidean (|a - b|), seed_l2
# (|a - b| plus a 1e-4 / D under the root) and cosine (1 - cos) range over [0, 2] for unit
# vectors, angular (arccos(cos) / pi) over [0, 1], so they get the same number of steps.
# The publishers' presets (facenet.evaluation.presets) keep the classic [0, 4) grids for
# every metric instead, as their code did.
_GRIDS = {
    "squared": (4.0, 0.01, 0.001),
    "euclidean": (2.0, 0.005, 0.0005),
    "cosine": (2.0, 0.005, 0.0005),
    "angular": (1.0, 0.0025, 0.00025),
    "seed_l2": (2.0, 0.005, 0.0005),
}


# --------------------------------------------------------------------------- result


@dataclass
class VerificationResult:
    """The outcome of the verification protocol.

    Args:
        accuracy: (F,) test-fold accuracy at each fold's best threshold.
        accuracy_mean: mean of ``accuracy``.
        accuracy_std: population standard deviation of ``accuracy`` (as published).
        best_thresholds: (F,) the threshold chosen on the training folds of each fold.
        val: mean over folds of the test-fold VAL (true accept rate) at the FAR-target threshold.
        val_std: its population standard deviation.
        far: mean over folds of the test-fold FAR at the same thresholds.
        tpr: (T,) test-fold true positive rate at every grid threshold, mean over folds.
        fpr: (T,) test-fold false positive rate at every grid threshold, mean over folds.
        thresholds: (T,) the accuracy grid.
        auc: area under the full ROC of all pairs.
        eer: equal error rate (FPR = 1 - TPR) of the full ROC.
        val_per_fold: (F,) test-fold VAL.
        far_per_fold: (F,) test-fold FAR.
        val_fold_thresholds: (F,) the interpolated VAL threshold of each fold.
        roc_fpr: the full ROC's false positive rates (scikit-learn ``roc_curve``).
        roc_tpr: the full ROC's true positive rates.
        far_target: the FAR the VAL thresholds aim at.
        n_pairs: number of pairs evaluated.
        n_folds: number of folds.
        distance: the distance the grids were chosen for.
        threshold: the verification threshold: the mean over folds of ``best_thresholds``
            ("same" when ``distance < threshold``); the default of identification.
        threshold_distance: the distance ``threshold`` applies to (``distance``; on
            flip-concatenated or mean-subtracted embeddings when those options were used).
    """

    accuracy: np.ndarray
    accuracy_mean: float
    accuracy_std: float
    best_thresholds: np.ndarray
    val: float
    val_std: float
    far: float
    tpr: np.ndarray
    fpr: np.ndarray
    thresholds: np.ndarray
    auc: float
    eer: float
    val_per_fold: np.ndarray
    far_per_fold: np.ndarray
    val_fold_thresholds: np.ndarray
    roc_fpr: np.ndarray
    roc_tpr: np.ndarray
    far_target: float
    n_pairs: int
    n_folds: int
    distance: str
    threshold: float
    threshold_distance: str

    def to_dict(self, curves: bool = True) -> dict[str, Any]:
        """The result as JSON-safe Python floats, ints, strings and lists.

        Args:
            curves: include the per-threshold and full ROC curves (``tpr``, ``fpr``,
                ``thresholds``, ``roc_fpr``, ``roc_tpr``); False keeps only the summary numbers
                and per-fold values.
        """
        out: dict[str, Any] = {}
        curve_names = {"tpr", "fpr", "thresholds", "roc_fpr", "roc_tpr"}
        for name in self.__dataclass_fields__:
            if name in curve_names and not curves:
                continue
            value = getattr(self, name)
            if isinstance(value, np.ndarray):
                out[name] = [float(v) for v in value]
            elif isinstance(value, (str, int)) and not isinstance(value, bool):
                out[name] = value
            else:
                out[name] = float(value)
        return out

    def summary(self) -> str:
        """One line: the figures as every command prints them (``report.figures_line``), then
        the threshold."""
        line = figures_line("", figures(self))
        return f"{line} threshold {self.threshold:.4f} ({self.threshold_distance})"


# --------------------------------------------------------------------------- input checks


def _to_numpy(x: Any) -> np.ndarray:
    """A numpy view of a numpy array, a torch tensor (any device) or a sequence."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check_distance_name(distance: str) -> None:
    if distance not in DISTANCES:
        raise ValueError(f"distance={distance!r}: valid options: {', '.join(DISTANCES)}")


def _finite_float_array(x: Any, name: str, ndim: int, keep_float: bool = False) -> np.ndarray:
    """``x`` as a float64 array of ``ndim`` dimensions, every value finite (with
    ``keep_float``, a floating array keeps its own dtype)."""
    arr = _to_numpy(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {arr.shape}")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    if not (keep_float and np.issubdtype(arr.dtype, np.floating)):
        arr = arr.astype(np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        first = np.argwhere(bad)[0].tolist()
        raise ValueError(
            f"{name} contains {int(bad.sum())} NaN or infinite value(s) (first at index {first})"
        )
    return arr


def _check_issame(issame: Any, n_pairs: int) -> np.ndarray:
    """``issame`` as a (N,) bool array; only True/False or 0/1 are accepted."""
    arr = _to_numpy(issame)
    if arr.ndim != 1:
        raise ValueError(f"issame must be 1-D, got shape {arr.shape}")
    if len(arr) != n_pairs:
        raise ValueError(f"lengths differ: {n_pairs} distances but {len(arr)} issame labels")
    if arr.dtype == bool:
        return arr
    if not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"issame must be bool or 0/1, got dtype {arr.dtype}")
    bad = (arr != 0) & (arr != 1)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"issame must hold only 0/1 or True/False; found {arr[index].item()!r} at index {index}"
        )
    return arr == 1


def _check_grid(thresholds: Any, name: str) -> np.ndarray:
    """A (T,) strictly increasing, finite threshold grid."""
    grid = _finite_float_array(thresholds, name, ndim=1)
    if len(grid) == 0:
        raise ValueError(f"{name} is empty")
    if np.any(np.diff(grid) <= 0):
        raise ValueError(f"{name} must be strictly increasing")
    return grid


def _check_threshold_rule(rule: str) -> None:
    if rule not in THRESHOLD_RULES:
        raise ValueError(f"threshold_rule={rule!r}: valid options: {', '.join(THRESHOLD_RULES)}")


def _check_scoring(scoring: str, metric: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r}: valid options: {', '.join(SCORINGS)}")
    if scoring == "mobilefacenet" and metric != "cosine":
        raise ValueError(f"scoring='mobilefacenet' measures cosine distances, not {metric!r}")


def _check_far_target(far_target: float) -> float:
    if not 0.0 < far_target <= 1.0:
        raise ValueError(f"far_target={far_target!r} must lie in (0, 1]")
    return float(far_target)


def _fold_ids(n_pairs: int, n_folds: int, folds: Any = None) -> np.ndarray:
    """(N,) fold index of every pair: contiguous ``KFold(shuffle=False)`` unless given.

    Args:
        n_pairs: N.
        n_folds: F, at least 2 and at most N.
        folds: optional (N,) integer fold index per pair, each of 0..F-1 used at least once.
    """
    if isinstance(n_folds, bool) or not isinstance(n_folds, (int, np.integer)) or n_folds < 2:
        raise ValueError(f"n_folds={n_folds!r} must be an integer >= 2")
    if n_pairs < n_folds:
        raise ValueError(f"fewer pairs ({n_pairs}) than folds ({n_folds})")
    if folds is None:
        ids = np.empty(n_pairs, dtype=np.int64)
        splits = KFold(n_splits=int(n_folds), shuffle=False).split(np.empty((n_pairs, 1)))
        for fold, (_, test) in enumerate(splits):
            ids[test] = fold
        return ids
    ids = _to_numpy(folds)
    if ids.shape != (n_pairs,) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"folds must be ({n_pairs},) integers, got {ids.dtype} {ids.shape}")
    used = np.bincount(ids.clip(0, n_folds), minlength=n_folds + 1)
    if ids.min() < 0 or ids.max() >= n_folds or (used[:n_folds] == 0).any():
        raise ValueError(f"folds must use every fold index 0..{n_folds - 1} and no other")
    return ids.astype(np.int64)


def _fold_span(fold_ids: np.ndarray, fold: int) -> str:
    members = np.flatnonzero(fold_ids == fold)
    return f"pairs {members[0]}-{members[-1]}" if len(members) else "no pairs"


def _check_fold_classes(issame: np.ndarray, fold_ids: np.ndarray, n_folds: int) -> None:
    """Every fold needs a positive and a negative pair, or VAL / FAR would be 0 / 0."""
    n_pos = np.bincount(fold_ids[issame], minlength=n_folds)
    n_neg = np.bincount(fold_ids[~issame], minlength=n_folds)
    for fold in range(n_folds):
        for count, kind in ((n_pos[fold], "positive (same)"), (n_neg[fold], "negative (diff.)")):
            if count == 0:
                raise ValueError(
                    f"fold {fold} of {n_folds} ({_fold_span(fold_ids, fold)}) has no {kind} "
                    "pair, so its VAL or FAR is undefined; the folds are contiguous in input "
                    "order, so keep the pairs in pairs.txt order (same and different per fold)"
                )


# --------------------------------------------------------------------------- counting


def default_thresholds(distance: str = "squared", fine: bool = False) -> np.ndarray:
    """The default threshold grid for a distance.

    Args:
        distance: ``"squared"`` (classic ``arange(0, 4, 0.01)``), ``"euclidean"``,
            ``"cosine"`` (``1 - cos``; both over [0, 2) with the same number of steps) or
            ``"angular"`` (``arccos(cos) / pi``; over [0, 1) with the same number of steps).
        fine: the VAL grid (ten times finer: classic ``arange(0, 4, 0.001)``).
    """
    _check_distance_name(distance)
    top, coarse_step, fine_step = _GRIDS[distance]
    return np.arange(0, top, fine_step if fine else coarse_step)


def _counts_below(
    distances: np.ndarray,
    groups: np.ndarray,
    n_groups: int,
    thresholds: np.ndarray,
    inclusive: bool = False,
) -> np.ndarray:
    """(G, T) number of distances of each group strictly below each threshold.

    Args:
        distances: (N,) float64.
        groups: (N,) group index in 0..G-1.
        n_groups: G.
        thresholds: (T,) strictly increasing.
        inclusive: count the distances at or below each threshold instead.
    """
    n_thresholds = len(thresholds)
    # d < t_j  <=>  j >= (number of grid values <= d): the first threshold index counting d;
    # d <= t_j <=>  j >= (number of grid values < d).
    side = "left" if inclusive else "right"
    first = np.searchsorted(thresholds, distances, side=side)  # (N,) in 0..T
    hist = np.bincount(groups * (n_thresholds + 1) + first, minlength=n_groups * (n_thresholds + 1))
    return np.cumsum(hist.reshape(n_groups, n_thresholds + 1), axis=1)[:, :n_thresholds]


@dataclass
class _FoldCounts:
    """Per-fold counts of "distance < threshold" on the training and the test pairs.

    All (F, T) arrays: ``pos_train[f, j]`` is the number of positive pairs outside fold f whose
    distance (as seen when fold f is tested) is below threshold j. ``n_*`` are (F,) totals.
    """

    pos_train: np.ndarray
    neg_train: np.ndarray
    pos_test: np.ndarray
    neg_test: np.ndarray
    n_pos_train: np.ndarray
    n_neg_train: np.ndarray
    n_pos_test: np.ndarray
    n_neg_test: np.ndarray


def _fold_counts(
    distances: np.ndarray,
    issame: np.ndarray,
    fold_ids: np.ndarray,
    n_folds: int,
    thresholds: np.ndarray,
    inclusive: bool = False,
) -> _FoldCounts:
    """Counts for every fold and threshold ("distance <= threshold" with ``inclusive``).

    Args:
        distances: (N,) the same distances for every fold, or (F, N) where row f holds the
            distances used while fold f is the test fold (mean subtraction).
        issame: (N,) bool.
        fold_ids: (N,) fold of each pair.
        n_folds: F.
        thresholds: (T,) strictly increasing grid.
        inclusive: count "distance <= threshold" instead of "distance < threshold".
    """
    positive = issame.astype(np.int64)
    n_pos_test = np.bincount(fold_ids[issame], minlength=n_folds)
    n_test = np.bincount(fold_ids, minlength=n_folds)
    n_neg_test = n_test - n_pos_test
    if distances.ndim == 1:
        # one pass: group = 2 * fold + issame -> (F, 2, T); training = all folds - test fold
        groups = 2 * fold_ids + positive
        per_fold = _counts_below(distances, groups, 2 * n_folds, thresholds, inclusive)
        per_fold = per_fold.reshape(n_folds, 2, -1)
        neg_test, pos_test = per_fold[:, 0], per_fold[:, 1]
        neg_train = neg_test.sum(axis=0) - neg_test
        pos_train = pos_test.sum(axis=0) - pos_test
    else:
        # one pass per fold: group = 2 * (in test fold) + issame -> (4, T)
        rows = [
            _counts_below(distances[f], 2 * (fold_ids == f) + positive, 4, thresholds, inclusive)
            for f in range(n_folds)
        ]
        neg_train, pos_train, neg_test, pos_test = np.stack(rows, axis=1)
    return _FoldCounts(
        pos_train=pos_train,
        neg_train=neg_train,
        pos_test=pos_test,
        neg_test=neg_test,
        n_pos_train=n_pos_test.sum() - n_pos_test,
        n_neg_train=n_neg_test.sum() - n_neg_test,
        n_pos_test=n_pos_test,
        n_neg_test=n_neg_test,
    )


def _rate(count: np.ndarray, total: np.ndarray) -> np.ndarray:
    """count / total per fold row, 0 where the total is 0 (the classic convention)."""
    total = np.broadcast_to(total.reshape(-1, *([1] * (count.ndim - 1))), count.shape)
    out = np.zeros(count.shape, dtype=np.float64)
    np.divide(count, total, out=out, where=total > 0)
    return out


# --------------------------------------------------------------------------- protocol parts


def _accuracy_protocol(c: _FoldCounts, thresholds: np.ndarray) -> dict[str, np.ndarray]:
    """Best training-fold threshold per fold, test accuracy there, mean test tpr/fpr."""
    n_train = (c.n_pos_train + c.n_neg_train)[:, None]
    acc_train = (c.pos_train + (c.n_neg_train[:, None] - c.neg_train)) / n_train  # (F, T)
    best = np.argmax(acc_train, axis=1)  # (F,) first maximum, as np.argmax in the classic loop
    rows = np.arange(len(best))
    correct = c.pos_test[rows, best] + (c.n_neg_test - c.neg_test[rows, best])
    return {
        "accuracy": correct / (c.n_pos_test + c.n_neg_test),
        "best_thresholds": thresholds[best],
        "tpr": np.mean(_rate(c.pos_test, c.n_pos_test), 0),
        "fpr": np.mean(_rate(c.neg_test, c.n_neg_test), 0),
    }


def _mean_rule_accuracy(
    c: _FoldCounts,
    at_or_below: _FoldCounts,
    thresholds: np.ndarray,
    test_distances: np.ndarray,
    issame: np.ndarray,
    fold_ids: np.ndarray,
) -> dict[str, np.ndarray]:
    """Xiaoccer/MobileFaceNet_Pytorch's rule: the mean of EVERY grid threshold of best training
    accuracy, and accuracy counted as its ``getAccuracy`` does.

    Its getAccuracy counts a positive right when its score is above the threshold and a
    negative right when below it, so a pair exactly at the threshold is wrong either way (the
    classic count calls it "different"). As distances: right when ``d < t`` (positive) or
    ``d > t`` (negative).

    Args:
        c: strict counts ("distance < threshold") on the grid.
        at_or_below: the same counts with "distance <= threshold".
        thresholds: (T,) the grid.
        test_distances: (N,) each pair's distance as seen when its own fold is tested.
        issame: (N,) bool.
        fold_ids: (N,) fold of each pair.
    """
    # integer counts: equal accuracies are equal counts over the same training pairs
    correct_train = c.pos_train + (c.n_neg_train[:, None] - at_or_below.neg_train)  # (F, T)
    best = correct_train == correct_train.max(axis=1, keepdims=True)  # (F, T) every maximum
    chosen = np.array([np.mean(thresholds[row]) for row in best])  # (F,), its np.mean
    threshold = chosen[fold_ids]  # (N,) each pair against its own fold's threshold
    right = np.where(issame, test_distances < threshold, test_distances > threshold)
    n_folds = len(chosen)
    n_test = np.bincount(fold_ids, minlength=n_folds)
    return {
        "accuracy": np.bincount(fold_ids[right], minlength=n_folds) / n_test,
        "best_thresholds": chosen,
        "tpr": np.mean(_rate(c.pos_test, c.n_pos_test), 0),
        "fpr": np.mean(_rate(c.neg_test, c.n_neg_test), 0),
    }


def _accuracy_part(
    distances: np.ndarray,
    test_distances: np.ndarray,
    issame: np.ndarray,
    fold_ids: np.ndarray,
    n_folds: int,
    thresholds: np.ndarray,
    threshold_rule: str,
) -> dict[str, np.ndarray]:
    """The accuracy protocol under ``threshold_rule`` (see :data:`THRESHOLD_RULES`)."""
    counts = _fold_counts(distances, issame, fold_ids, n_folds, thresholds)
    if threshold_rule == "first":
        return _accuracy_protocol(counts, thresholds)
    # only the negatives' inclusive counts are read: a tie at the threshold is wrong for them
    at_or_below = _fold_counts(distances, issame, fold_ids, n_folds, thresholds, inclusive=True)
    return _mean_rule_accuracy(counts, at_or_below, thresholds, test_distances, issame, fold_ids)


def _far_thresholds(far_train: np.ndarray, thresholds: np.ndarray, far_target: float):
    """(F,) threshold per fold where the training FAR first reaches ``far_target``.

    Args:
        far_train: (F, T) training-fold FAR at each grid threshold (non-decreasing in T).
        thresholds: (T,) the grid.
        far_target: the FAR aimed at.
    """
    reached = far_train >= far_target  # (F, T)
    first = np.argmax(reached, axis=1)  # (F,) first grid index at or above the target
    chosen = np.zeros(len(far_train), dtype=np.float64)  # 0.0 where FAR never reaches it
    for f in np.flatnonzero(reached.any(axis=1)):  # a loop over folds, not thresholds
        j = first[f]
        if j == 0:
            chosen[f] = thresholds[0]
        else:
            # linear between the two neighbouring grid points around the crossing
            neighbours = slice(j - 1, j + 1)
            chosen[f] = np.interp(far_target, far_train[f, neighbours], thresholds[neighbours])
    return chosen


def _val_protocol(
    c: _FoldCounts,
    val_grid: np.ndarray,
    test_distances: np.ndarray,
    issame: np.ndarray,
    fold_ids: np.ndarray,
    far_target: float,
) -> dict[str, np.ndarray]:
    """VAL and FAR on each test fold at the threshold chosen for ``far_target``."""
    n_folds = len(c.n_pos_test)
    chosen = _far_thresholds(c.neg_train / c.n_neg_train[:, None], val_grid, far_target)
    accepted = test_distances < chosen[fold_ids]  # (N,) each pair against its own fold's threshold
    true_accepts = np.bincount(fold_ids[accepted & issame], minlength=n_folds)
    false_accepts = np.bincount(fold_ids[accepted & ~issame], minlength=n_folds)
    return {
        "val_per_fold": true_accepts / c.n_pos_test,
        "far_per_fold": false_accepts / c.n_neg_test,
        "val_fold_thresholds": chosen,
    }


def _roc_auc_eer(distances: np.ndarray, issame: np.ndarray):
    """Full ROC (smaller distance = more likely same), its AUC and its equal error rate."""
    fpr, tpr, _ = roc_curve(issame, -distances)
    gap = fpr + tpr - 1.0  # FPR - FNR: non-decreasing along the curve, -1 at the start, 1 at end
    i = int(np.argmax(gap >= 0))
    if gap[i] == 0 or i == 0:
        eer = float(fpr[i])
    else:
        w = -gap[i - 1] / (gap[i] - gap[i - 1])  # where the segment crosses FPR = FNR
        eer = float(fpr[i - 1] + w * (fpr[i] - fpr[i - 1]))
    return fpr, tpr, float(area_under_curve(fpr, tpr)), eer


def _run_protocol(
    distances: np.ndarray,
    issame: np.ndarray,
    fold_ids: np.ndarray,
    n_folds: int,
    far_target: float,
    thresholds: np.ndarray,
    val_thresholds: np.ndarray,
    distance: str,
    threshold_rule: str = "first",
) -> VerificationResult:
    """The whole protocol on checked inputs; ``distances`` is (N,) or (F, N) (see _fold_counts)."""
    if distances.ndim == 1:
        test_distances = distances
    else:
        test_distances = distances[fold_ids, np.arange(len(fold_ids))]  # (N,) own test fold's
    acc = _accuracy_part(
        distances, test_distances, issame, fold_ids, n_folds, thresholds, threshold_rule
    )
    val_counts = _fold_counts(distances, issame, fold_ids, n_folds, val_thresholds)
    val = _val_protocol(val_counts, val_thresholds, test_distances, issame, fold_ids, far_target)
    roc_fpr, roc_tpr, auc, eer = _roc_auc_eer(test_distances, issame)
    return VerificationResult(
        accuracy=acc["accuracy"],
        accuracy_mean=float(np.mean(acc["accuracy"])),
        accuracy_std=float(np.std(acc["accuracy"])),
        best_thresholds=acc["best_thresholds"],
        val=float(np.mean(val["val_per_fold"])),
        val_std=float(np.std(val["val_per_fold"])),
        far=float(np.mean(val["far_per_fold"])),
        tpr=acc["tpr"],
        fpr=acc["fpr"],
        thresholds=thresholds,
        auc=auc,
        eer=eer,
        val_per_fold=val["val_per_fold"],
        far_per_fold=val["far_per_fold"],
        val_fold_thresholds=val["val_fold_thresholds"],
        roc_fpr=roc_fpr,
        roc_tpr=roc_tpr,
        far_target=far_target,
        n_pairs=len(issame),
        n_folds=int(n_folds),
        distance=distance,
        threshold=float(np.mean(acc["best_thresholds"])),
        threshold_distance=distance,
    )


def _grids(thresholds: Any, val_thresholds: Any, distance: str):
    _check_distance_name(distance)
    grid = default_thresholds(distance) if thresholds is None else thresholds
    val_grid = default_thresholds(distance, fine=True) if val_thresholds is None else val_thresholds
    return _check_grid(grid, "thresholds"), _check_grid(val_grid, "val_thresholds")


# --------------------------------------------------------------------------- public API


def evaluate_verification(
    distances: Any,
    issame: Any,
    n_folds: int = 10,
    far_target: float = 1e-3,
    thresholds: Any = None,
    val_thresholds: Any = None,
    distance: str = "squared",
    folds: Any = None,
    threshold_rule: str = "first",
) -> VerificationResult:
    """Run the LFW verification protocol on the distances of N pairs.

    Args:
        distances: (N,) distance of each pair (numpy array or torch tensor), finite.
        issame: (N,) True/1 where both images show the same identity.
        n_folds: number of contiguous folds (10 for LFW).
        far_target: the FAR at which VAL is reported.
        thresholds: accuracy grid, strictly increasing; default from ``distance``.
        val_thresholds: VAL grid, strictly increasing; default from ``distance`` (10x finer).
        distance: which metric the distances are in (one of ``DISTANCES``); it only
            chooses the default grids.
        folds: optional (N,) fold index per pair, e.g. ``PairList.fold_ids`` to keep the file's
            folds after skipping pairs; default contiguous folds in input order.
        threshold_rule: "first" (the classic: the first grid threshold of best training
            accuracy; a distance equal to the threshold counts as "different") or "mean"
            (Xiaoccer/MobileFaceNet_Pytorch's: the mean of every grid threshold of best
            training accuracy; a distance equal to the threshold is wrong for either kind).

    Raises:
        ValueError: NaN or infinite distances, lengths that differ, fewer pairs than folds, a
            fold without a positive or a negative pair, a bad grid or option.
    """
    _check_threshold_rule(threshold_rule)
    dist = _finite_float_array(distances, "distances", ndim=1)
    same = _check_issame(issame, len(dist))
    fold_ids = _fold_ids(len(dist), n_folds, folds)
    _check_fold_classes(same, fold_ids, n_folds)
    grid, val_grid = _grids(thresholds, val_thresholds, distance)
    far_target = _check_far_target(far_target)
    return _run_protocol(
        dist, same, fold_ids, n_folds, far_target, grid, val_grid, distance, threshold_rule
    )


def _check_nonzero(emb1: np.ndarray, emb2: np.ndarray, metric: str) -> None:
    """The angle of a zero-length embedding is undefined: refuse it rather than measure 1."""
    norms = np.linalg.norm(emb1, axis=1) * np.linalg.norm(emb2, axis=1)  # (N,)
    if np.any(norms == 0):
        raise ValueError(f"{metric} distance of a zero-length embedding is undefined")


def _metric_distance(emb1: np.ndarray, emb2: np.ndarray, metric: str) -> np.ndarray:
    """(N,) float64 distance between matching rows of two (N, D) float64 arrays.

    The training distance (:func:`facenet.metric.distances.paired_distance`), which keeps
    float64 inputs in float64; numpy in, numpy out.
    """
    if metric in ("cosine", "angular"):
        _check_nonzero(emb1, emb2, metric)
    a, b = torch.from_numpy(emb1), torch.from_numpy(emb2)  # (N, D) float64, shared memory
    return paired_distance(a, b, metric).numpy()  # (N,)


def _check_embeddings(
    emb1: Any, emb2: Any, keep_float: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    a = _finite_float_array(emb1, "emb1", ndim=2, keep_float=keep_float)
    b = _finite_float_array(emb2, "emb2", ndim=2, keep_float=keep_float)
    if a.shape != b.shape:
        raise ValueError(f"emb1 and emb2 shapes differ: {a.shape} vs {b.shape}")
    common = np.result_type(a, b)  # both sides in one dtype (float64 unless both are narrower)
    return a.astype(common, copy=False), b.astype(common, copy=False)


def _training_mean(emb1: np.ndarray, emb2: np.ndarray, train: np.ndarray) -> np.ndarray:
    """(D,) mean embedding of both sides of the training pairs (classic ``subtract_mean``)."""
    return np.mean(np.concatenate([emb1[train], emb2[train]]), axis=0)


def _mobilefacenet_distance(emb1: np.ndarray, emb2: np.ndarray, mean) -> np.ndarray:
    """(N,) float64 1 - the score of lfw_eval.py's ``evaluation_10_fold``.

    Its operations in its order, in the features' own dtype (float32 as its network and its
    .mat file give them), so the scores are its scores bit for bit: subtract the mean,
    divide each row by its norm, sum the products. 1 - s is exact in float64 for a float32
    s (of magnitude above 2^-29), so "1 - s < 1 - t" decides as its "s > t" does.

    Args:
        emb1: (N, D) features of the first images.
        emb2: (N, D) features of the second images.
        mean: (D,) the training folds' mean, or 0.0.
    """
    a, b = emb1 - mean, emb2 - mean
    _check_nonzero(a, b, "cosine")  # its division would give NaN scores
    a = a / np.expand_dims(np.sqrt(np.sum(np.power(a, 2), 1)), 1)
    b = b / np.expand_dims(np.sqrt(np.sum(np.power(b, 2), 1)), 1)
    return 1.0 - np.sum(np.multiply(a, b), 1).astype(np.float64)


def _fold_distances(
    emb1: np.ndarray,
    emb2: np.ndarray,
    train: np.ndarray,
    metric: str,
    subtract_mean: bool,
    scoring: str,
) -> np.ndarray:
    """(N,) distance of every pair while the fold whose training pairs are ``train`` is tested."""
    mean = _training_mean(emb1, emb2, train) if subtract_mean else 0.0
    if scoring == "mobilefacenet":  # every pair at once, as its loop scores them
        return _mobilefacenet_distance(emb1, emb2, mean)
    return _metric_distance(emb1 - mean, emb2 - mean, metric)


def pair_distances(
    emb1: Any,
    emb2: Any,
    metric: str = "squared",
    subtract_mean: bool = False,
    n_folds: int = 10,
    folds: Any = None,
) -> np.ndarray:
    """(N,) distance of each pair from the embeddings of its two sides.

    With ``subtract_mean`` each pair's distance uses the mean embedding of the training folds
    of the fold it belongs to. The protocol also needs the training pairs' distances under each
    test fold's mean, so evaluate such embeddings with :func:`evaluate_embeddings`.

    Args:
        emb1: (N, D) embeddings of the first images (numpy or torch); with flip-concatenation
            already applied by the caller, (N, 2D).
        emb2: (N, D) embeddings of the second images.
        metric: a name in ``DISTANCES`` (``facenet.metric.DISTANCE_NAMES``): "squared"
            (|a-b|^2), "euclidean" (|a-b|), "cosine" (1 - cos(a, b)), "angular"
            (arccos(cos(a, b)) / pi, davidsandberg/facenet's distance_metric=1) or "seed_l2".
        subtract_mean: subtract the training folds' mean embedding before measuring.
        n_folds: folds for the mean (contiguous in input order).
        folds: optional (N,) fold index per pair instead of contiguous folds.
    """
    _check_distance_name(metric)
    a, b = _check_embeddings(emb1, emb2)
    if not subtract_mean:
        return _metric_distance(a, b, metric)
    fold_ids = _fold_ids(len(a), n_folds, folds)
    out = np.empty(len(a), dtype=np.float64)
    for fold in range(n_folds):
        test = fold_ids == fold
        mean = _training_mean(a, b, ~test)
        out[test] = _metric_distance(a[test] - mean, b[test] - mean, metric)
    return out


def evaluate_embeddings(
    emb1: Any,
    emb2: Any,
    issame: Any,
    metric: str = "squared",
    subtract_mean: bool = False,
    n_folds: int = 10,
    far_target: float = 1e-3,
    thresholds: Any = None,
    val_thresholds: Any = None,
    folds: Any = None,
    threshold_rule: str = "first",
    scoring: str = "float64",
) -> VerificationResult:
    """Run the verification protocol on the embeddings of both sides of N pairs.

    With ``subtract_mean`` this is the classic ``calculate_roc(..., subtract_mean=True)``: while
    fold f is tested, every pair (training ones included, for choosing the thresholds) is
    measured after subtracting the mean embedding of fold f's training pairs. AUC and EER then
    use each pair's distance under its own test fold's mean.

    Args:
        emb1: (N, D) embeddings of the first images (numpy or torch); flip-concatenation, if
            wanted, is done by the caller when embedding ((N, 2D) then).
        emb2: (N, D) embeddings of the second images.
        issame: (N,) True/1 for same-identity pairs.
        metric: a name in ``DISTANCES``: "squared", "euclidean", "cosine" (1 - cos),
            "angular" (arccos(cos) / pi) or "seed_l2"; also picks the default grids.
        subtract_mean: the classic mean subtraction (off by default).
        n_folds: number of contiguous folds.
        far_target: the FAR at which VAL is reported.
        thresholds: accuracy grid; default from ``metric``.
        val_thresholds: VAL grid; default from ``metric``.
        folds: optional (N,) fold index per pair instead of contiguous folds.
        threshold_rule: "first" or "mean" (see :func:`evaluate_verification`).
        scoring: "float64" (``metric`` in float64, the default) or "mobilefacenet"
            (Xiaoccer/MobileFaceNet_Pytorch's lfw_eval.py: 1 - its cosine score, computed with
            its numpy operations in the features' own dtype; ``metric`` must be "cosine").

    Raises:
        ValueError: as :func:`evaluate_verification`, plus embedding shapes that differ.
    """
    _check_distance_name(metric)
    _check_scoring(scoring, metric)
    if not subtract_mean and scoring == "float64":
        dist = pair_distances(emb1, emb2, metric=metric)
        return evaluate_verification(
            dist,
            issame,
            n_folds,
            far_target,
            thresholds,
            val_thresholds,
            metric,
            folds,
            threshold_rule,
        )
    _check_threshold_rule(threshold_rule)
    a, b = _check_embeddings(emb1, emb2, keep_float=scoring == "mobilefacenet")
    same = _check_issame(issame, len(a))
    fold_ids = _fold_ids(len(a), n_folds, folds)
    _check_fold_classes(same, fold_ids, n_folds)
    grid, val_grid = _grids(thresholds, val_thresholds, metric)
    by_fold = np.empty((n_folds, len(a)), dtype=np.float64)  # (F, N)
    for fold in range(n_folds):
        train = fold_ids != fold
        by_fold[fold] = _fold_distances(a, b, train, metric, subtract_mean, scoring)
    far_target = _check_far_target(far_target)
    return _run_protocol(
        by_fold, same, fold_ids, n_folds, far_target, grid, val_grid, metric, threshold_rule
    )
