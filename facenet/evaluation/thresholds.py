"""Deployable thresholds: the distance threshold to deploy, chosen on all pairs, and how much it
moves between folds.

For the accuracy optimum (the protocol's threshold rule on its accuracy grid) and for FAR 1e-3,
1e-4 and the settings' ``far_target`` (the largest threshold of the VAL grid whose FAR is at most
the target: the protocol's VAL interpolates past it, which overshoots where negatives are few),
the threshold chosen on all pairs with the accuracy, TAR and FAR it gives on them; then the
choice made on each fold's training pairs: mean, std (population), min and max, and the accuracy
or TAR (and FAR) it gives on its test fold. "Same" when distance < threshold.
"""

from __future__ import annotations

import numpy as np

from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import (
    _check_settings,
    _counts,
    _finite,
    _fold_accuracy,
    _folds,
    threshold_grids,
)

FAR_TARGETS = (1e-3, 1e-4)


def far_key(target: float) -> str:
    """``far_1e-3`` for 0.001: the key of a FAR target's entry."""
    mantissa, exponent = f"{target:.6e}".split("e")
    return f"far_{float(mantissa):g}e{int(exponent)}"


def _at_most(far: np.ndarray, grid: np.ndarray, target: float) -> np.ndarray:
    """(F,) the last threshold of ``grid`` whose (F, T) non-decreasing FAR is at most
    ``target``; the first where even it accepts more."""
    last = np.sum(far <= target, axis=1) - 1
    return grid[np.maximum(last, 0)]


def _choices(d, same, ids, n_folds: int, settings: VerifySettings, targets) -> dict:
    """``{entry: (F,) threshold}`` chosen on each fold's training pairs; with ``n_folds`` 1
    (``ids`` all 0) on every pair."""
    grid, val_grid = threshold_grids(settings)
    part = 1 if n_folds == 1 else 0  # _counts gives (training, test); one fold: all are test
    count = lambda g, inclusive=False: _counts(d, same, ids, n_folds, g, inclusive)[part]
    n = np.stack([np.bincount(ids[same == k], minlength=n_folds) for k in (0, 1)], 1)
    n_train = n if n_folds == 1 else n.sum(axis=0) - n  # (F, 2) [negative, positive]
    below = count(grid)  # (F, 2, T) pairs below each threshold
    # the mean rule counts a negative pair at a threshold as wrong: those at or below it
    negative = count(grid, True) if settings.threshold_rule == "mean" else below
    correct = below[:, 1] + n_train[:, :1] - negative[:, 0]  # (F, T)
    best = _fold_accuracy(correct, grid, d, same, ids, n, settings.threshold_rule)[1]
    far = count(val_grid)[:, 0] / n_train[:, :1]  # (F, T')
    return {"accuracy": best, **{far_key(t): _at_most(far, val_grid, t) for t in targets}}


def _rates(d, same, threshold: float, rule: str) -> dict[str, float]:
    """Accuracy, TAR and FAR of the (N,) pairs at ``threshold``."""
    accepted = d < threshold
    rejected = d >= threshold if rule == "first" else d > threshold
    return {
        "accuracy": float(np.mean(np.where(same, accepted, rejected))),
        "tar": float(np.mean(accepted[same])),
        "far": float(np.mean(accepted[~same])),
    }


def _entry(d, same, ids, threshold: float, chosen: np.ndarray, settings) -> dict[str, float]:
    """One entry: ``threshold`` (chosen on all pairs) and its rates, and the (F,) ``chosen``
    per fold with the rates each gives on its test fold."""
    rule = settings.threshold_rule
    tested = [_rates(d[ids == f], same[ids == f], t, rule) for f, t in enumerate(chosen)]
    entry = {"threshold": float(threshold), **_rates(d, same, threshold, rule)}
    for name, f in (("mean", np.mean), ("std", np.std), ("min", np.min), ("max", np.max)):
        entry[f"fold_threshold_{name}"] = float(f(chosen))
    for what in ("accuracy", "tar", "far"):
        entry[f"fold_{what}_mean"] = float(np.mean([r[what] for r in tested]))
        entry[f"fold_{what}_std"] = float(np.std([r[what] for r in tested]))
    return entry


def deployable_thresholds(distances, issame, settings: VerifySettings, folds=None) -> dict:
    """``{"accuracy": {...}, "far_1e-3": {...}, "far_1e-4": {...}}`` (and the settings'
    ``far_target``'s entry): each ``threshold`` chosen on all pairs with its ``accuracy``,
    ``tar`` and ``far`` on them, and ``fold_threshold_{mean,std,min,max}`` and
    ``fold_{accuracy,tar,far}_{mean,std}`` of the folds; for (N,) distances and 0/1
    ``issame`` (numpy or torch), ``folds`` as
    :func:`facenet.evaluation.protocol.evaluate_verification` takes them.

    Raises:
        ValueError: what the protocol refuses (non-finite distances, a fold without both kinds).
    """
    _check_settings(settings)
    d = _finite(distances, "distances", ndim=1)
    same, ids = _folds(issame, len(d), settings, folds)
    targets = sorted({*FAR_TARGETS, float(settings.far_target)}, reverse=True)
    on_all = _choices(d, same, np.zeros_like(ids), 1, settings, targets)
    per_fold = _choices(d, same, ids, settings.n_folds, settings, targets)
    return {key: _entry(d, same, ids, on_all[key][0], per_fold[key], settings) for key in on_all}


def deployable_lines(entries: dict, name: str = "") -> list[str]:
    """One line per entry of :func:`deployable_thresholds` (other keys skipped), ``name`` (a
    set's) before each."""
    lines = []
    for key, e in entries.items():
        if not isinstance(e, dict):
            continue
        tested = "accuracy" if key == "accuracy" else "tar"
        lines.append(
            f"{name + ' ' if name else ''}deployable {key:<9} threshold {e['threshold']:.4f}: "
            f"acc {e['accuracy']:.4f} TAR {e['tar']:.4f} FAR {e['far']:.5f} on all pairs; "
            f"folds {e['fold_threshold_mean']:.4f}±{e['fold_threshold_std']:.4f} "
            f"[{e['fold_threshold_min']:.4f}, {e['fold_threshold_max']:.4f}], {tested} "
            f"{e[f'fold_{tested}_mean']:.4f}±{e[f'fold_{tested}_std']:.4f} on their test folds"
        )
    return lines
