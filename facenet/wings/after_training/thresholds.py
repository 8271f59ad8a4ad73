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

from facenet.evaluation.presets import THRESHOLD_RULES, ThresholdRule, VerifySettings, finite_array
from facenet.evaluation.protocol import _counts, _curves, _folds, _right, threshold_grids

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


def _rates(d, same, threshold: float, rule: ThresholdRule) -> dict[str, float]:
    """Accuracy, TAR and FAR of the (N,) pairs at ``threshold``."""
    accepted = d < threshold
    return {
        "accuracy": float(np.mean(_right(d, same, threshold, rule))),
        "tar": float(np.mean(accepted[same])),
        "far": float(np.mean(accepted[~same])),
    }


def _entry(d, same, ids, threshold: float, chosen: np.ndarray, rule) -> dict[str, float]:
    """One entry: ``threshold`` (chosen on all pairs) and its rates, and the (F,) ``chosen``
    per fold with the rates each gives on its test fold, under the threshold ``rule``."""
    tested = [_rates(d[ids == f], same[ids == f], t, rule) for f, t in enumerate(chosen)]
    entry = {"threshold": float(threshold), **_rates(d, same, threshold, rule)}
    for name in ("mean", "std", "min", "max"):
        entry[f"fold_threshold_{name}"] = float(getattr(np, name)(chosen))
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
    d = finite_array(distances, "distances", ndim=1)
    same, ids, n = _folds(issame, len(d), settings.n_folds, folds)
    targets = sorted({*FAR_TARGETS, float(settings.far_target)}, reverse=True)
    # fold F holds no pair: its training pairs are all the pairs
    n_train = n.sum(axis=0) - np.vstack([n, [0, 0]])  # (F + 1, 2)
    count = lambda grid, inclusive=False: _counts(d, same, ids, len(n_train), grid, inclusive)
    grid, val_grid = threshold_grids(settings)
    rule = THRESHOLD_RULES[settings.threshold_rule]
    correct, far, _ = _curves(count, n_train, (grid, val_grid), rule)
    chosen = {  # (F + 1,): on each fold's training pairs, then on all
        "accuracy": rule.best(correct, grid),
        **{far_key(t): _at_most(far, val_grid, t) for t in targets},
    }
    return {key: _entry(d, same, ids, c[-1], c[:-1], rule) for key, c in chosen.items()}


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
