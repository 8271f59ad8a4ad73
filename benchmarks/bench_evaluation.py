#!/usr/bin/env python
"""Verification protocol: ``facenet.evaluation.protocol`` against the classic loops, same numbers.

Runs the LFW protocol (10 contiguous folds, the classic grids ``arange(0, 4, 0.01)`` for
accuracy and ``arange(0, 4, 0.001)`` for VAL at FAR = 1e-3) on LFW-like synthetic distances of
6,000 and 60,000 pairs, checks that every number (per-fold accuracy and thresholds, tpr, fpr,
VAL, FAR) is identical, and reports the median time of each and their ratio. Target: 100x;
exit status 1 when it is missed or a number differs.

    python -m benchmarks.bench_evaluation [--quick] [--json evaluation.json]
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import numpy as np

from benchmarks import reference_evaluation as ref
from benchmarks.measure import benchmark_parser, run_benchmark, show, timed
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_verification

TARGET_SPEEDUP = 100.0
N_FOLDS, FAR_TARGET = 10, 1e-3


def lfw_like_pairs(n_pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(distances, issame): 10 folds of same-then-different pairs; float32-rounded distances."""
    rng = np.random.default_rng(seed)
    per_kind = n_pairs // (2 * N_FOLDS)
    issame = np.tile(np.r_[np.ones(per_kind, bool), np.zeros(per_kind, bool)], N_FOLDS)
    centre = np.where(issame, 0.9, 1.7)  # squared L2 of unit embeddings lies in [0, 4]
    distances = np.clip(centre + rng.normal(0.0, 0.35, len(issame)), 0.0, 4.0)
    return distances.astype(np.float32).astype(np.float64), issame


def run_reference(distances: np.ndarray, issame: np.ndarray) -> tuple:
    """The classic ``lfw.evaluate``: ROC over the coarse grid, VAL over the fine one."""
    roc = ref.calculate_roc(np.arange(0, 4, 0.01), distances, None, issame, N_FOLDS)
    grid = np.arange(0, 4, 0.001)
    return roc, ref.calculate_val(grid, distances, None, issame, FAR_TARGET, N_FOLDS)


def identical(result, reference: tuple) -> bool:
    """Every protocol number equal, bit for bit."""
    (tpr, fpr, accuracy, best), (val_mean, val_std, far_mean, val, far, val_thr) = reference
    ours = (result.tpr, result.fpr, result.accuracy, result.best_thresholds)
    ours += (result.val_per_fold, result.far_per_fold, result.val_fold_thresholds)
    theirs = (tpr, fpr, accuracy, best, val, far, val_thr)
    scalars = (result.val, result.val_std, result.far) == (val_mean, val_std, far_mean)
    return scalars and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    """(median wall time over ``repeats`` calls, the last call's return value)."""
    times, outs = zip(*(timed("cpu", fn) for _ in range(repeats)))
    return statistics.median(times), outs[-1]


def bench_size(n_pairs: int, repeats: int, reference_repeats: int) -> dict:
    """Time both implementations on one size and compare their numbers."""
    distances, issame = lfw_like_pairs(n_pairs)
    settings = VerifySettings(n_folds=N_FOLDS, far_target=FAR_TARGET)
    ours = partial(evaluate_verification, distances, issame, settings)
    ours()  # warm-up: imports, first-call allocations
    ours_s, result = median_seconds(ours, repeats)
    reference_s, expected = median_seconds(
        partial(run_reference, distances, issame), reference_repeats
    )
    return {
        "n_pairs": n_pairs,
        "ours_median_s": ours_s,
        "reference_median_s": reference_s,
        "speedup": reference_s / ours_s,
        "identical": identical(result, expected),
        "accuracy_mean": result.accuracy_mean,
        "val": result.val,
        "far": result.far,
        "auc": result.auc,
        "repeats": repeats,
        "reference_repeats": reference_repeats,
    }


def measure(args) -> dict:
    """Every size; ``exit_status`` 1 when a number differs or the target is missed."""
    # pair counts (multiples of 20: 10 folds x 2 kinds), timed runs of ours, of the loops
    sizes, repeats, reference_repeats = ([2000], 3, 1) if args.quick else ([6000, 60000], 20, 3)
    cases = []
    for n_pairs in sizes:
        cases.append(bench_size(n_pairs, repeats, reference_repeats))
        show(cases[-1])
    ok = all(c["identical"] and c["speedup"] >= TARGET_SPEEDUP for c in cases)
    return {
        "n_folds": N_FOLDS,
        "far_target": FAR_TARGET,
        "cases": cases,
        "exit_status": 0 if ok else 1,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--quick``: 2,000 pairs, few repeats)."""
    return run_benchmark(benchmark_parser(__doc__), argv, measure)


if __name__ == "__main__":
    sys.exit(main())
