"""The LFW verification protocol: 10-fold accuracy, VAL@FAR, AUC, EER and ROC on distances.

The numbers are those of the classic ``calculate_roc`` / ``calculate_val`` (davidsandberg/
facenet's lfw.py), reproduced exactly: contiguous folds (``KFold(shuffle=False)``), "same" when
``distance < threshold``, each fold's threshold the first best on the other folds. One change:
the VAL threshold is interpolated between the two grid points where the training FAR first
reaches the target (the classic ``interp1d`` raises on repeated FAR values). Counts come from
one ``searchsorted`` and ``bincount`` per fold instead of a loop over thresholds. A publisher's
variant (grid, threshold rule, scoring) is a row of ``facenet.evaluation.presets``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import numpy as np

from facenet.evaluation.presets import (
    CLASSIC,
    GRIDS,
    SCORINGS,
    THRESHOLD_RULES,
    ThresholdRule,
    VerifySettings,
    both_kinds,
    embedding_pairs,
    finite_array,
    fold_indices,
    increasing_grid,
    measurable,
    pair_labels,
)

# Each grid's upper end: the classic arange(0, 4, 0.01) / (0, 4, 0.001) for squared distances
# of unit vectors; the others span their own range in as many steps.
_GRID_TOPS = {"squared": 4.0, "euclidean": 2.0, "cosine": 2.0, "angular": 1.0, "seed_l2": 2.0}
# How a distance scales with the embeddings' norm: squared with r**2, euclidean with r.
_NORM_POWER = {"squared": 2, "euclidean": 1, "seed_l2": 1}


@dataclass
class VerificationResult:
    """The protocol's outcome. Per fold (F,): ``accuracy``, ``best_thresholds``,
    ``val_per_fold``, ``far_per_fold``, ``val_fold_thresholds``; per accuracy-grid threshold
    (T,): ``tpr``, ``fpr`` (test folds, mean over folds); ``roc_fpr``/``roc_tpr``: the full ROC
    of all pairs, whence ``auc`` and ``eer``. Standard deviations are population ones (as
    published). ``threshold``: the mean of ``best_thresholds`` ("same" below it), identify's
    default, in ``distance`` (``threshold_distance`` in :meth:`to_dict`, as records name it).
    ``train_impostor_pairs``: the fewest different-identity pairs any VAL threshold was chosen
    on; they resolve FARs from 1 / train_impostor_pairs up (one false accept)."""

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
    train_impostor_pairs: int

    def to_dict(self, curves: bool = True) -> dict[str, Any]:
        """JSON-safe values (the scalars are Python's already); without ``curves``, no
        per-threshold or ROC arrays. A FAR target below one false accept on the training folds
        is not resolved: ``val`` and ``val_std`` say so in words (the thresholds were read off
        the grid point where the training FAR is still zero)."""
        skipped = () if curves else ("tpr", "fpr", "thresholds", "roc_fpr", "roc_tpr")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skipped}
        lists = {
            k: v.astype(np.float64).tolist() for k, v in out.items() if isinstance(v, np.ndarray)
        }
        n = self.train_impostor_pairs
        if self.far_target * n < 1:
            note = f"not resolved (thresholds chosen on {n} impostor pairs resolve FAR >= 1/{n})"
            lists.update(val=note, val_std=note)
        return {**out, **lists, "threshold_distance": self.distance}


# --------------------------------------------------------------------------- folds


def _folds(issame, n_pairs: int, n_folds: int, folds=None):
    """(issame as (N,) bool, (N,) fold ids, (F, 2) pairs [negative, positive] of each fold),
    every fold holding both kinds; the folds contiguous unless ``folds`` gives them."""
    same = pair_labels(issame, n_pairs)
    if folds is None:  # as KFold(shuffle=False): the first N % F folds one pair larger
        sizes = n_pairs // n_folds + (np.arange(n_folds) < n_pairs % n_folds)  # (F,)
        folds = np.repeat(np.arange(n_folds), sizes)
    ids = fold_indices(folds, n_pairs, n_folds)
    n = np.stack([np.bincount(ids[same == k], minlength=n_folds) for k in (0, 1)], 1)
    return same, ids, both_kinds(n, ids)


# --------------------------------------------------------------------------- grids


def default_thresholds(distance: str = "squared", fine: bool = False) -> np.ndarray:
    """The distance's own grid (``fine``: the VAL grid, ten times finer); squared distances get
    the classic ``arange(0, 4, 0.01)``, the others their range in as many steps."""
    top = _GRID_TOPS[VerifySettings(distance=distance).distance]  # the name checked
    return np.arange(0, top, top / (4000 if fine else 400))


def threshold_grids(settings: VerifySettings) -> tuple[np.ndarray, np.ndarray]:
    """(accuracy grid, VAL grid) of ``settings.grid``.

    With ``flip`` on unit features the embeddings have norm sqrt 2: a "default" grid of a
    norm-dependent distance then runs on, in the same steps, over the doubled range (squared
    distances up to 8). The publishers' grids stay as their code had them.
    """
    publisher = GRIDS[settings.grid]
    if publisher:
        return publisher()
    unit = default_thresholds(settings.distance), default_thresholds(settings.distance, True)
    power = _NORM_POWER.get(settings.distance)
    if not (settings.flip and settings.features == "unit" and power):
        return unit
    stretch = 2.0 ** (power / 2)
    # (T',) through the doubled range's top; it starts with the unit grid, exactly
    return tuple(np.arange(int(np.ceil(len(g) * stretch)) + 1) * (g[1] - g[0]) for g in unit)


# --------------------------------------------------------------------------- counting


def _counts(distances, issame, fold_ids, n_folds, grid, inclusive=False):
    """(train, test): (F, 2, T) counts of [negative, positive] pairs below each threshold
    (at or below with ``inclusive``) while fold f is tested. ``distances``: (N,), or (F, N)
    with row f measured while fold f is tested (mean subtraction)."""
    n_grid = len(grid) + 1
    # d < t_j  <=>  j >= (grid values <= d); with inclusive, d <= t_j <=> j >= (values < d)
    first = np.searchsorted(grid, distances, side="left" if inclusive else "right")
    first = np.broadcast_to(first, (n_folds, len(issame)))  # (F, N), a view for (N,)
    rows = []
    for f in range(n_folds):  # groups 2 * (in fold f) + issame
        groups = 2 * (fold_ids == f) + issame
        hist = np.bincount(groups * n_grid + first[f], minlength=4 * n_grid)
        rows.append(np.cumsum(hist.reshape(2, 2, n_grid), axis=2)[..., :-1])
    both = np.stack(rows, axis=1)  # (2, F, 2, T)
    return both[0], both[1]


def _curves(count, n_train: np.ndarray, grids, rule: ThresholdRule):
    """((F, T) right training pairs at each accuracy-grid threshold, (F, T') training FAR at
    each VAL-grid threshold, the (F, 2, T) test counts); ``count(grid, inclusive)``: the
    (train, test) counts of :func:`_counts`, ``n_train``: (F, 2) training pairs."""
    grid, val_grid = grids
    train, test = count(grid)
    # an inclusive rule counts a negative pair at a threshold as accepted: at or below it
    negative = count(grid, True)[0] if rule.inclusive else train
    correct = train[:, 1] + n_train[:, :1] - negative[:, 0]
    return correct, count(val_grid)[0][:, 0] / n_train[:, :1], test


def _right(distances, issame, threshold, rule: ThresholdRule) -> np.ndarray:
    """(N,) bool: the pairs the threshold gets right (a negative pair exactly at it wrong
    under an inclusive rule, as getAccuracy's: wrong for either kind)."""
    accepted = distances <= threshold if rule.inclusive else distances < threshold
    return np.where(issame, distances < threshold, ~accepted)


def _far_thresholds(far_train: np.ndarray, grid: np.ndarray, far_target: float) -> np.ndarray:
    """(F,) threshold where the (F, T) non-decreasing training FAR first reaches the target,
    linear between the neighbouring grid points; the first grid point if FAR starts at or above
    it, 0.0 if it never reaches it."""
    reached = far_train >= far_target
    first = np.argmax(reached, axis=1)
    chosen = np.zeros(len(far_train))
    for f in np.flatnonzero(reached.any(axis=1)):
        lo, hi = max(first[f] - 1, 0), first[f] + 1  # one point, grid[0], when first[f] is 0
        chosen[f] = np.interp(far_target, far_train[f, lo:hi], grid[lo:hi])
    return chosen


def _roc_auc_eer(distances: np.ndarray, issame: np.ndarray):
    """Full ROC (smaller distance: more likely same), its AUC and its equal error rate."""
    # scikit-learn (the better part of a second to import) loads with the first ROC, not with
    # the protocol: a command that stops on a bad flag or file never waits for it
    from sklearn.metrics import auc as area_under_curve
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(issame, -distances)
    gap = fpr + tpr - 1.0  # FPR - FNR: non-decreasing along the curve, from -1 to 1
    i = int(np.argmax(gap >= 0))
    if gap[i] == 0 or i == 0:
        eer = float(fpr[i])
    else:  # where the segment crosses FPR = FNR
        w = -gap[i - 1] / (gap[i] - gap[i - 1])
        eer = float(fpr[i - 1] + w * (fpr[i] - fpr[i - 1]))
    return fpr, tpr, float(area_under_curve(fpr, tpr)), eer


def _protocol(distances, issame, fold_ids, n, s: VerifySettings, grids) -> VerificationResult:
    """The protocol on checked inputs (see :func:`_folds`); ``distances`` (N,) or (F, N) (see
    :func:`_counts`)."""
    names = ("thresholds", "val_thresholds")
    grid, val_grid = map(increasing_grid, grids or threshold_grids(s), names)
    rule, n_folds, pairs = THRESHOLD_RULES[s.threshold_rule], s.n_folds, np.arange(len(issame))
    count = partial(_counts, distances, issame, fold_ids, n_folds)  # (grid, inclusive)
    test_distances = distances if distances.ndim == 1 else distances[fold_ids, pairs]  # (N,)
    n_train = n.sum(axis=0) - n  # (F, 2) training pairs of each test fold
    correct, far_train, test = _curves(count, n_train, (grid, val_grid), rule)
    best = rule.best(correct, grid)
    right = _right(test_distances, issame, best[fold_ids], rule)
    accuracy = np.bincount(fold_ids[right], minlength=n_folds) / n.sum(axis=1)
    chosen = _far_thresholds(far_train, val_grid, s.far_target)
    accepted = test_distances < chosen[fold_ids]
    val = np.bincount(fold_ids[accepted & issame], minlength=n_folds) / n[:, 1]
    far = np.bincount(fold_ids[accepted & ~issame], minlength=n_folds) / n[:, 0]
    roc_fpr, roc_tpr, auc, eer = _roc_auc_eer(test_distances, issame)
    return VerificationResult(
        accuracy=accuracy,
        accuracy_mean=float(np.mean(accuracy)),
        accuracy_std=float(np.std(accuracy)),
        best_thresholds=best,
        val=float(np.mean(val)),
        val_std=float(np.std(val)),
        far=float(np.mean(far)),
        tpr=np.mean(test[:, 1] / n[:, 1:], 0),
        fpr=np.mean(test[:, 0] / n[:, :1], 0),
        thresholds=grid,
        auc=auc,
        eer=eer,
        val_per_fold=val,
        far_per_fold=far,
        val_fold_thresholds=chosen,
        roc_fpr=roc_fpr,
        roc_tpr=roc_tpr,
        far_target=float(s.far_target),
        n_pairs=len(issame),
        n_folds=int(n_folds),
        distance=s.distance,
        threshold=float(np.mean(best)),
        train_impostor_pairs=int(n_train[:, 0].min()),
    )


# --------------------------------------------------------------------------- distances


def _scores(a, b, s: VerifySettings) -> np.ndarray:
    """(N,) distances of the rows of ``a`` and ``b`` as ``s.scoring`` measures them."""
    return SCORINGS[s.scoring].distances(*measurable(a, b, s.distance), s.distance)


def _distances(a, b, fold_ids, s: VerifySettings) -> np.ndarray:
    """(N,) distances; with ``subtract_mean`` (F, N), row f measured after the classic
    ``subtract_mean``: the mean of both sides of fold f's training pairs subtracted."""
    if not s.subtract_mean:
        return _scores(a, b, s)
    train = [fold_ids != f for f in range(s.n_folds)]
    means = [np.mean(np.concatenate([a[t], b[t]]), axis=0) for t in train]
    return np.stack([_scores(a - mean, b - mean, s) for mean in means])


def pair_distances(emb1, emb2, metric="squared") -> np.ndarray:
    """(N,) distance of each pair of (N, D) embeddings (numpy or torch; (N, 2D) with flip),
    ``metric`` a name in ``DISTANCE_NAMES``; mean subtraction needs the folds: see
    :func:`evaluate_embeddings`."""
    return _scores(*embedding_pairs(emb1, emb2), VerifySettings(distance=metric))


# --------------------------------------------------------------------------- public API


def evaluate_verification(distances, issame, settings=CLASSIC, folds=None, grids=None):
    """The protocol on the (N,) finite distances of N pairs (numpy or torch).

    ``settings`` gives the distance, folds, FAR target and threshold rule; ``folds``: (N,) fold
    index per pair (e.g. ``PairList.fold_ids``), default contiguous; ``grids``: (accuracy grid,
    VAL grid), strictly increasing, default :func:`threshold_grids`.

    Raises:
        ValueError: non-finite distances, lengths that differ, fewer pairs than folds, a fold
            without a positive or a negative pair, a bad grid.
    """
    dist = finite_array(distances, "distances", ndim=1)
    return _protocol(dist, *_folds(issame, len(dist), settings.n_folds, folds), settings, grids)


def evaluate_embeddings(emb1, emb2, issame, settings=CLASSIC, folds=None, grids=None):
    """The protocol on the (N, D) embeddings of both sides of N pairs, as
    :func:`evaluate_verification`.

    With ``subtract_mean`` (the classic ``calculate_roc(..., subtract_mean=True)``) every pair
    is measured, while fold f is tested, after subtracting the mean embedding of fold f's
    training pairs; AUC and EER use each pair's distance under its own test fold's mean.
    """
    a, b = embedding_pairs(emb1, emb2, keep_float=SCORINGS[settings.scoring].own_dtype)
    same, fold_ids, n = _folds(issame, len(a), settings.n_folds, folds)
    return _protocol(_distances(a, b, fold_ids, settings), same, fold_ids, n, settings, grids)
