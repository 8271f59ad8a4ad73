#!/usr/bin/env python
"""Verification protocol: ``facenet.evaluation.protocol`` against the classic loops, same numbers.

Runs the LFW protocol (10 contiguous folds, the classic grids ``arange(0, 4, 0.01)`` for
accuracy and ``arange(0, 4, 0.001)`` for VAL at FAR = 1e-3) on LFW-like synthetic distances of
6,000 and 60,000 pairs, checks that every number (per-fold accuracy and thresholds, tpr, fpr,
VAL, FAR) is identical, and reports the median time of each and their ratio. Target: 100x.

    python -m benchmarks.bench_evaluation [--sizes 6000 60000] [--json results.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

from benchmarks import reference_evaluation as ref
from benchmarks.measure import write_report
from facenet.evaluation.protocol import evaluate_verification

TARGET_SPEEDUP = 100.0
N_FOLDS, FAR_TARGET = 10, 1e-3


def lfw_like_pairs(n_pairs: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(distances, issame): 10 folds of same-then-different pairs; float32-rounded distances.

    Args:
        n_pairs: a multiple of 20 (10 folds x 2 kinds).
        seed: numpy seed.
    """
    rng = np.random.default_rng(seed)
    per_kind = n_pairs // (2 * N_FOLDS)
    issame = np.tile(np.r_[np.ones(per_kind, bool), np.zeros(per_kind, bool)], N_FOLDS)
    centre = np.where(issame, 0.9, 1.7)  # squared L2 of unit embeddings lies in [0, 4]
    distances = np.clip(centre + rng.normal(0.0, 0.35, len(issame)), 0.0, 4.0)
    return distances.astype(np.float32).astype(np.float64), issame


def run_reference(distances: np.ndarray, issame: np.ndarray):
    """The classic ``lfw.evaluate``: ROC over the coarse grid, VAL over the fine one."""
    tpr, fpr, accuracy, best = ref.calculate_roc(
        np.arange(0, 4, 0.01), None, None, issame, N_FOLDS, dist=distances
    )
    val = ref.calculate_val(
        np.arange(0, 4, 0.001), None, None, issame, FAR_TARGET, N_FOLDS, dist=distances
    )
    return tpr, fpr, accuracy, best, val


def run_ours(distances: np.ndarray, issame: np.ndarray):
    """The whole protocol, AUC and EER included."""
    return evaluate_verification(distances, issame, N_FOLDS, FAR_TARGET)


def identical(result, reference) -> bool:
    """Every protocol number equal, bit for bit."""
    tpr, fpr, accuracy, best, (val_mean, val_std, far_mean, val, far, val_thr) = reference
    arrays = [
        (result.tpr, tpr),
        (result.fpr, fpr),
        (result.accuracy, accuracy),
        (result.best_thresholds, best),
        (result.val_per_fold, val),
        (result.far_per_fold, far),
        (result.val_fold_thresholds, val_thr),
    ]
    scalars = (result.val, result.val_std, result.far) == (val_mean, val_std, far_mean)
    return scalars and all(np.array_equal(a, b) for a, b in arrays)


def median_seconds(fn, repeats: int):
    """(median wall time over ``repeats`` calls, the last call's return value)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def bench_size(n_pairs: int, repeats: int, reference_repeats: int) -> dict:
    """Time both implementations on one size and compare their numbers."""
    distances, issame = lfw_like_pairs(n_pairs)
    run_ours(distances, issame)  # warm-up: imports, first-call allocations
    ours_s, result = median_seconds(lambda: run_ours(distances, issame), repeats)
    reference_s, reference = median_seconds(
        lambda: run_reference(distances, issame), reference_repeats
    )
    return {
        "n_pairs": n_pairs,
        "ours_median_s": ours_s,
        "reference_median_s": reference_s,
        "speedup": reference_s / ours_s,
        "identical": identical(result, reference),
        "accuracy_mean": result.accuracy_mean,
        "val": result.val,
        "far": result.far,
        "auc": result.auc,
        "repeats": repeats,
        "reference_repeats": reference_repeats,
    }


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[6000, 60000])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs of ours")
    parser.add_argument("--reference-repeats", type=int, default=3, help="timed loop runs")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 if any number differs or the target is missed."""
    args = get_args_parser().parse_args(argv)
    bad = [n for n in args.sizes if n % (2 * N_FOLDS) or n <= 0]
    if bad:
        print(f"--sizes must be positive multiples of {2 * N_FOLDS}: {bad}", file=sys.stderr)
        return 2
    cases = []
    print(f"{'pairs':>7}  {'ours':>9}  {'loops':>9}  {'speedup':>8}  identical")
    for n_pairs in args.sizes:
        case = bench_size(n_pairs, args.repeats, args.reference_repeats)
        cases.append(case)
        print(
            f"{n_pairs:>7}  {case['ours_median_s'] * 1e3:>7.2f}ms  "
            f"{case['reference_median_s']:>8.2f}s  {case['speedup']:>7.0f}x  {case['identical']}"
        )
    report = {
        "benchmark": "verification protocol: facenet.evaluation.protocol vs the classic loops",
        "grids": {"accuracy": "arange(0, 4, 0.01)", "val": "arange(0, 4, 0.001)"},
        "n_folds": N_FOLDS,
        "far_target": FAR_TARGET,
        "target_speedup": TARGET_SPEEDUP,
        "cases": cases,
        "machine": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
        },
    }
    if args.json:
        write_report(args.json, report)
    ok = all(c["identical"] and c["speedup"] >= TARGET_SPEEDUP for c in cases)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
