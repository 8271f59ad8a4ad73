"""Deployable thresholds against a brute-force loop over the grids and a hand-computed case."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_verification, threshold_grids
from facenet.evaluation.thresholds import deployable_thresholds, far_key


def brute_choice(d, same, grid, val_grid, rule, targets):
    """Thresholds chosen on the pairs ``d``, ``same`` by trying every grid value in turn."""

    def right(t):
        negative = d[~same] >= t if rule == "first" else d[~same] > t
        return int(np.sum(d[same] < t) + np.sum(negative))

    scores = [right(t) for t in grid]
    best = [t for t, s in zip(grid, scores) if s == max(scores)]
    out = {"accuracy": best[0] if rule == "first" else float(np.mean(best))}
    for target in targets:
        ok = [t for t in val_grid if np.mean(d[~same] < t) <= target]
        out[far_key(target)] = max(ok) if ok else val_grid[0]
    return out


def brute_rates(d, same, t, rule):
    right = [(x < t) if s else ((x >= t) if rule == "first" else (x > t)) for x, s in zip(d, same)]
    return {
        "accuracy": np.mean(right),
        "tar": np.mean([x < t for x in d[same]]),
        "far": np.mean([x < t for x in d[~same]]),
    }


def brute_force(d, same, settings, folds):
    """Every entry, fold by fold with plain loops."""
    grid, val_grid = threshold_grids(settings)
    targets = sorted({1e-3, 1e-4, settings.far_target}, reverse=True)
    on_all = brute_choice(d, same, grid, val_grid, settings.threshold_rule, targets)
    per_fold = [
        brute_choice(
            d[folds != f], same[folds != f], grid, val_grid, settings.threshold_rule, targets
        )
        for f in range(settings.n_folds)
    ]
    out = {}
    for key, threshold in on_all.items():
        entry = {"threshold": threshold, **brute_rates(d, same, threshold, settings.threshold_rule)}
        chosen = [p[key] for p in per_fold]
        tested = [
            brute_rates(d[folds == f], same[folds == f], chosen[f], settings.threshold_rule)
            for f in range(settings.n_folds)
        ]
        entry |= {
            "fold_threshold_mean": np.mean(chosen),
            "fold_threshold_std": np.std(chosen),
            "fold_threshold_min": min(chosen),
            "fold_threshold_max": max(chosen),
        }
        for what in ("accuracy", "tar", "far"):
            entry[f"fold_{what}_mean"] = np.mean([r[what] for r in tested])
            entry[f"fold_{what}_std"] = np.std([r[what] for r in tested])
        out[key] = entry
    return out


@pytest.mark.parametrize(
    "settings",
    [
        VerifySettings(n_folds=4),
        VerifySettings(n_folds=3, threshold_rule="mean", far_target=0.02),
        VerifySettings(distance="cosine", n_folds=5, far_target=1e-3),
    ],
)
def test_equals_brute_force_on_random_pairs_with_ties(settings):
    rng = np.random.default_rng(7)
    n = 600
    same = rng.random(n) < 0.5
    _, val_grid = threshold_grids(settings)
    top = val_grid[-1]
    d = np.clip(rng.normal(np.where(same, 0.35, 0.65) * top, 0.15 * top), 0, top)
    d[::5] = val_grid[rng.integers(0, len(val_grid), len(d[::5]))]  # ties with grid points
    folds = rng.permutation(np.arange(n) % settings.n_folds)
    got = deployable_thresholds(d, same, settings, folds)
    want = brute_force(d, same, settings, folds)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].keys() == want[key].keys()
        for name, value in want[key].items():
            assert got[key][name] == pytest.approx(value, abs=1e-12), (key, name)


def test_hand_case():
    # two folds of four pairs; every distance between grid points (x.xx55)
    same = np.array([1, 0, 1, 0, 1, 0, 1, 0])
    d = np.array([0.1055, 0.4055, 0.2055, 0.8055, 0.3055, 0.9055, 0.5055, 1.0055])
    got = deployable_thresholds(d, same, VerifySettings(n_folds=2))
    grid, val_grid = threshold_grids(VerifySettings())
    assert list(got) == ["accuracy", "far_1e-3", "far_1e-4"]
    # all pairs: from 0.31 on, 7 of 8 right (0.5055 rejected); no negative below 0.405
    entry = got["accuracy"]
    assert entry["threshold"] == grid[31]
    assert (entry["accuracy"], entry["tar"], entry["far"]) == (7 / 8, 3 / 4, 0.0)
    for key in ("far_1e-3", "far_1e-4"):
        assert got[key]["threshold"] == val_grid[405]
        assert (got[key]["tar"], got[key]["far"]) == (3 / 4, 0.0)
    # fold 0 chosen on fold 1's pairs: 0.51 (all right there); fold 1 on fold 0's: 0.21.
    # On their test folds: 0.51 accepts the negative 0.4055 (3 of 4), 0.21 rejects both
    # positives 0.3055 and 0.5055 (2 of 4).
    assert (entry["fold_threshold_min"], entry["fold_threshold_max"]) == (grid[21], grid[51])
    assert (entry["fold_accuracy_mean"], entry["fold_accuracy_std"]) == (0.625, 0.125)
    # FAR 0 on the training negatives: up to 0.905 (fold 0) and 0.405 (fold 1); tested, fold 0
    # accepts both positives and both negatives, fold 1 one positive (0.3055) and no negative
    far = got["far_1e-3"]
    assert (far["fold_threshold_min"], far["fold_threshold_max"]) == (val_grid[405], val_grid[905])
    assert (far["fold_tar_mean"], far["fold_far_mean"], far["fold_far_std"]) == (0.75, 0.5, 0.5)


def test_accuracy_folds_are_the_protocols():
    rng = np.random.default_rng(3)
    same = np.tile([True, False], 500)
    d = np.clip(rng.normal(np.where(same, 0.9, 1.6), 0.4), 0, None)
    result = evaluate_verification(d, same)
    entry = deployable_thresholds(torch.from_numpy(d), torch.from_numpy(same), VerifySettings())[
        "accuracy"
    ]
    assert entry["fold_threshold_mean"] == pytest.approx(result.threshold, abs=1e-12)
    assert entry["fold_accuracy_mean"] == pytest.approx(result.accuracy_mean, abs=1e-12)
    assert entry["fold_accuracy_std"] == pytest.approx(result.accuracy_std, abs=1e-12)


def test_far_never_above_target_on_the_pairs_chosen_on():
    rng = np.random.default_rng(5)
    same = np.tile([True, False], 3000)
    d = np.clip(rng.normal(np.where(same, 1.0, 1.6), 0.4), 0, None)
    got = deployable_thresholds(d, same, VerifySettings(far_target=0.01))
    for target in (1e-2, 1e-3, 1e-4):
        assert got[far_key(target)]["far"] <= target
    # fewer than 1 / 1e-4 negatives: that threshold accepts none of them
    assert got["far_1e-4"]["far"] == 0.0


def test_far_key_and_refusals():
    assert (far_key(1e-3), far_key(1e-4), far_key(2.5e-2), far_key(1.0)) == (
        "far_1e-3",
        "far_1e-4",
        "far_2.5e-2",
        "far_1e0",
    )
    with pytest.raises(ValueError, match="NaN or infinite"):
        deployable_thresholds([0.1, np.nan, 0.2, 0.3], [1, 0, 1, 0], VerifySettings(n_folds=2))
    with pytest.raises(ValueError, match="no positive"):
        deployable_thresholds([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], VerifySettings(n_folds=2))
