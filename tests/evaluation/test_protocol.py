"""The verification protocol against the classic loops, hand-computed cases and scikit-learn."""

from __future__ import annotations

import json
from dataclasses import replace

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from publisher_evaluation_reference import training_far_curves  # tests/ is on the path
from scipy import interpolate
from sklearn.metrics import roc_auc_score

from benchmarks import reference_evaluation as ref
from facenet.cli import evaluate as evaluate_script
from facenet.evaluation import protocol
from facenet.evaluation.plots import plot_roc
from facenet.evaluation.presets import VerifySettings as S
from facenet.evaluation.protocol import (
    VerificationResult,
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)

# --------------------------------------------------------------------------- helpers


def lfw_like_issame(n_folds: int, per_kind: int) -> np.ndarray:
    """(F * 2P,) per fold P same pairs then P different pairs, as in pairs.txt."""
    fold = np.r_[np.ones(per_kind, bool), np.zeros(per_kind, bool)]
    return np.tile(fold, n_folds)


def separated_distances(issame: np.ndarray, rng, gap: float = 0.8) -> np.ndarray:
    """Squared distances around 0.9 for same pairs and 0.9 + gap for different ones."""
    centre = np.where(issame, 0.9, 0.9 + gap)
    return np.clip(centre + rng.normal(0.0, 0.35, len(issame)), 0.0, None)


def reference_numbers(dist, issame, n_folds, far_target, grid, val_grid, emb=None, **kw):
    """The loop implementation's (tpr, fpr, accuracy, best, val stats, val/far per fold)."""
    e1, e2 = emb if emb is not None else (dist, None)
    tpr, fpr, acc, best = ref.calculate_roc(grid, e1, e2, issame, n_folds, **kw)
    val = ref.calculate_val(val_grid, e1, e2, issame, far_target, n_folds, **kw)
    return tpr, fpr, acc, best, val


def assert_same_as_reference(result: VerificationResult, reference) -> None:
    """Every protocol number is identical (bit for bit) to the loop implementation."""
    tpr, fpr, acc, best, (val_mean, val_std, far_mean, val, far, val_thr) = reference
    np.testing.assert_array_equal(result.accuracy, acc)
    np.testing.assert_array_equal(result.best_thresholds, best)
    np.testing.assert_array_equal(result.tpr, tpr)
    np.testing.assert_array_equal(result.fpr, fpr)
    np.testing.assert_array_equal(result.val_per_fold, val)
    np.testing.assert_array_equal(result.far_per_fold, far)
    np.testing.assert_array_equal(result.val_fold_thresholds, val_thr)
    assert (result.val, result.val_std, result.far) == (val_mean, val_std, far_mean)
    assert result.accuracy_mean == np.mean(acc) and result.accuracy_std == np.std(acc)


# --------------------------------------------------------------------------- hand-computed


def hand_case():
    """Two folds of four pairs; the expected numbers are worked out in the comments below."""
    distances = np.array([0.2, 0.8, 1.2, 0.9, 0.4, 1.6, 1.8, 0.6])
    issame = np.array([1, 1, 0, 0, 1, 1, 0, 0], dtype=bool)
    return distances, issame, np.array([0.5, 1.0, 1.5, 2.0])


def test_hand_computed_case():
    distances, issame, grid = hand_case()
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.25), None, (grid, grid)
    )
    # Fold 0 tested, trained on fold 1 (0.4 s, 1.6 s, 1.8 d, 0.6 d): accuracy 3/4 at 0.5, then
    # 2/4, 2/4, 2/4, so 0.5; on fold 0 at 0.5 only 0.2 is accepted: 3/4 correct.
    # Fold 1 tested, trained on fold 0: 3/4 at 0.5 and at 1.0 -> the first, 0.5; 3/4 correct.
    np.testing.assert_array_equal(result.accuracy, [0.75, 0.75])
    np.testing.assert_array_equal(result.best_thresholds, [0.5, 0.5])
    # test-fold tpr (fold 0: 1/2, 1, 1, 1; fold 1: 1/2, 1/2, 1/2, 1), fpr likewise
    np.testing.assert_array_equal(result.tpr, [0.5, 0.75, 0.75, 1.0])
    np.testing.assert_array_equal(result.fpr, [0.0, 0.5, 0.75, 1.0])
    # training FAR is 0 at 0.5 and 1/2 at 1.0 in both folds: the 0.25 crossing lies at 0.75.
    # Fold 0 at 0.75 accepts 0.2 (same): VAL 1/2, FAR 0; fold 1 accepts 0.4 (same), 0.6 (diff).
    np.testing.assert_array_equal(result.val_fold_thresholds, [0.75, 0.75])
    np.testing.assert_array_equal(result.val_per_fold, [0.5, 0.5])
    np.testing.assert_array_equal(result.far_per_fold, [0.0, 0.5])
    assert (result.val, result.val_std, result.far) == (0.5, 0.0, 0.25)
    # AUC: of the 16 (same, different) pairings, 12 have the same pair closer.
    assert result.auc == pytest.approx(12 / 16)
    # Sorted: 0.2s 0.4s 0.6d 0.8s 0.9d 1.2d 1.6s 1.8d -> the ROC passes (0.25, 0.75).
    assert result.eer == pytest.approx(0.25)


def test_val_threshold_rule_edges():
    distances, issame, grid = hand_case()
    # Fold 0's training negatives are 1.8 and 0.6: FAR is already 1/2 at the first grid value
    # 0.7, which is taken as is. Fold 1's (1.2, 0.9) reach 1/2 at 1.0: exactly that value.
    shifted = np.array([0.7, 1.0, 1.5, 2.0])
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.5), None, (grid, shifted)
    )
    np.testing.assert_array_equal(result.val_fold_thresholds, [0.7, 1.0])
    # never reached: threshold 0.0, nothing accepted
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.5), None, (grid, [0.1, 0.3, 0.5])
    )
    np.testing.assert_array_equal(result.val_fold_thresholds, [0.0, 0.0])
    assert result.val == 0.0 and result.far == 0.0
    # FAR exactly at the target at a grid point: that grid point, not an interpolation
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.5), None, (grid, grid)
    )
    np.testing.assert_array_equal(result.val_fold_thresholds, [1.0, 1.0])


# --------------------------------------------------------------------------- vs the loops


def test_classic_grids_match_the_loops():
    rng = np.random.default_rng(0)
    issame = lfw_like_issame(10, 30)
    distances = separated_distances(issame, rng)
    result = evaluate_verification(distances, issame)
    grid, val_grid = np.arange(0, 4, 0.01), np.arange(0, 4, 0.001)
    np.testing.assert_array_equal(result.thresholds, grid)
    reference = reference_numbers(distances, issame, 10, 1e-3, grid, val_grid)
    assert_same_as_reference(result, reference)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_inputs_match_the_loops(seed):
    rng = np.random.default_rng(seed)
    n_folds = int(rng.integers(2, 8))
    n_pairs = int(rng.integers(n_folds * 12, 400))  # uneven KFold sizes too
    issame = np.zeros(n_pairs, bool)
    for block in np.array_split(np.arange(n_pairs), n_folds):  # both kinds in every fold
        issame[block[: len(block) // 2]] = True
    distances = separated_distances(issame, rng, gap=float(rng.uniform(0.2, 1.2)))
    grid = np.sort(rng.uniform(0, 3, 150))
    val_grid = np.linspace(0, 3, 700)
    far_target = float(rng.choice([1e-3, 0.01, 0.05, 0.2]))
    result = evaluate_verification(
        distances, issame, S(n_folds=n_folds, far_target=far_target), None, (grid, val_grid)
    )
    reference = reference_numbers(distances, issame, n_folds, far_target, grid, val_grid)
    assert_same_as_reference(result, reference)


def test_repeating_training_far_matches_the_loops_where_interp1d_raises():
    rng = np.random.default_rng(4)
    issame = lfw_like_issame(10, 25)
    # distances on a 0.05 grid: plateaus of training FAR and distances equal to thresholds
    distances = np.round(separated_distances(issame, rng, gap=0.5) * 20) / 20
    grid, val_grid = np.arange(0, 4, 0.05), np.arange(0, 4, 0.01)
    far_target = 0.02
    far_train = training_far_curves(val_grid, distances, issame, 10)
    assert np.all(np.diff(far_train, axis=1) >= 0)  # non-decreasing, as the rule assumes
    assert all(len(np.unique(row)) < len(row) for row in far_train)  # and repeating
    with pytest.raises(ValueError):  # what the classic code ran into
        interpolate.interp1d(far_train[0], val_grid, kind="slinear")(far_target)
    result = evaluate_verification(
        distances, issame, S(far_target=far_target), None, (grid, val_grid)
    )
    assert_same_as_reference(
        result, reference_numbers(distances, issame, 10, far_target, grid, val_grid)
    )
    assert 0 < result.val < 1


def test_far_exactly_at_target_matches_the_loops():
    rng = np.random.default_rng(5)
    issame = lfw_like_issame(10, 50)
    distances = separated_distances(issame, rng, gap=0.3)
    grid = np.linspace(0, 3, 120)
    far_target = 20 / (9 * 50)  # an attainable training FAR: 20 false accepts of 450
    result = evaluate_verification(distances, issame, S(far_target=far_target), None, (grid, grid))
    far_train = training_far_curves(grid, distances, issame, 10)
    assert np.any(far_train == far_target)
    assert_same_as_reference(
        result, reference_numbers(distances, issame, 10, far_target, grid, grid)
    )


def unit_embeddings(issame: np.ndarray, rng, dim: int = 16):
    """(N, D) unit embeddings; same pairs are noisy copies, different ones loosely related."""
    e1 = rng.normal(size=(len(issame), dim))
    noise = np.where(issame, 0.6, 1.6)[:, None] * rng.normal(size=e1.shape)
    e2 = e1 + noise + 0.3  # a shared offset gives mean subtraction something to remove
    return (
        e1 / np.linalg.norm(e1, axis=1, keepdims=True),
        e2 / np.linalg.norm(e2, axis=1, keepdims=True),
    )


@pytest.mark.parametrize("metric", ["squared", "euclidean", "cosine"])
@pytest.mark.parametrize("subtract_mean", [False, True])
def test_embeddings_match_the_loops(metric, subtract_mean):
    rng = np.random.default_rng(6)
    issame = lfw_like_issame(5, 20)
    emb = unit_embeddings(issame, rng)
    grid = default_thresholds(metric)[::4]
    val_grid = default_thresholds(metric, fine=True)[::8]
    settings = S(distance=metric, subtract_mean=subtract_mean, n_folds=5, far_target=0.05)
    result = evaluate_embeddings(*emb, issame, settings, None, (grid, val_grid))
    reference = reference_numbers(
        None,
        issame,
        5,
        0.05,
        grid,
        val_grid,
        emb,
        distance_metric=metric,
        subtract_mean=subtract_mean,
    )
    assert_same_as_reference(result, reference)


def test_default_grids_are_the_classic_ones_scaled_to_the_metric():
    np.testing.assert_array_equal(default_thresholds("squared"), np.arange(0, 4, 0.01))
    np.testing.assert_array_equal(default_thresholds("squared", fine=True), np.arange(0, 4, 0.001))
    for metric in ("euclidean", "cosine"):
        assert len(default_thresholds(metric)) == 400
        assert default_thresholds(metric, fine=True)[-1] == pytest.approx(2 - 0.0005)


# --------------------------------------------------------------------------- distances


def test_pair_distances_by_brute_force():
    rng = np.random.default_rng(7)
    e1, e2 = rng.normal(size=(12, 5)), rng.normal(size=(12, 5))
    for metric, expect in (
        ("squared", lambda a, b: float(np.dot(a - b, a - b))),
        ("euclidean", lambda a, b: float(np.linalg.norm(a - b))),
        ("cosine", lambda a, b: 1 - float(a @ b) / np.linalg.norm(a) / np.linalg.norm(b)),
    ):
        got = pair_distances(e1, e2, metric)
        want = [expect(a, b) for a, b in zip(e1, e2)]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_subtracted_mean_is_that_of_the_other_folds():
    rng = np.random.default_rng(8)
    e1, e2 = rng.normal(size=(9, 4)) + 2.0, rng.normal(size=(9, 4)) - 1.0
    fold_ids = np.arange(9) // 3
    by_fold = protocol._distances(e1, e2, fold_ids, S("cosine", subtract_mean=True, n_folds=3))
    got = by_fold[fold_ids, np.arange(9)]  # each pair under its own test fold's mean
    for fold in range(3):
        test = np.arange(9) // 3 == fold
        mean = np.vstack([e1[~test], e2[~test]]).mean(axis=0)
        a, b = e1[test] - mean, e2[test] - mean
        want = 1 - np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        np.testing.assert_allclose(got[test], want, rtol=1e-12)
    assert not np.allclose(got, pair_distances(e1, e2, "cosine"))


def test_torch_tensors_give_the_same_result():
    rng = np.random.default_rng(9)
    issame = lfw_like_issame(4, 10)
    distances = separated_distances(issame, rng)
    from_numpy = evaluate_verification(distances, issame, S(n_folds=4))
    from_torch = evaluate_verification(torch.tensor(distances), torch.tensor(issame), S(n_folds=4))
    assert from_numpy.to_dict() == from_torch.to_dict()
    e1, e2 = unit_embeddings(issame, rng)
    a = evaluate_embeddings(torch.tensor(e1), torch.tensor(e2), torch.tensor(issame), S(n_folds=4))
    b = evaluate_embeddings(e1, e2, issame, S(n_folds=4))
    assert a.to_dict() == b.to_dict()


def test_given_folds_reproduce_contiguous_folds_in_any_order():
    rng = np.random.default_rng(10)
    issame = lfw_like_issame(5, 12)
    distances = separated_distances(issame, rng)
    contiguous = evaluate_verification(distances, issame, S(n_folds=5, far_target=0.05))
    order = rng.permutation(len(issame))
    folds = (np.arange(len(issame)) // 24)[order]
    shuffled = evaluate_verification(
        distances[order], issame[order], S(n_folds=5, far_target=0.05), folds
    )
    assert contiguous.to_dict() == shuffled.to_dict()


# --------------------------------------------------------------------------- AUC, EER


@pytest.mark.parametrize("seed", [11, 12])
def test_auc_equals_roc_auc_score(seed):
    rng = np.random.default_rng(seed)
    issame = lfw_like_issame(10, 40)
    distances = np.round(separated_distances(issame, rng, gap=0.4), 2)  # ties included
    result = evaluate_verification(distances, issame)
    assert result.auc == pytest.approx(roc_auc_score(issame, -distances), abs=1e-12)


def brute_force_eer(distances: np.ndarray, issame: np.ndarray) -> tuple[float, float]:
    """Bounds on the EER: FPR and FNR at the two thresholds around their crossing."""
    cuts = np.r_[-np.inf, np.unique(distances), np.inf]
    fpr = np.array([np.mean(distances[~issame] <= c) for c in cuts])
    fnr = np.array([np.mean(distances[issame] > c) for c in cuts])
    k = int(np.argmax(fpr >= fnr))  # first cut where FPR has caught up with FNR
    return min(fpr[k - 1], fnr[k]), max(fpr[k], fnr[k - 1])


@pytest.mark.parametrize("seed", [13, 14, 15])
def test_eer_lies_where_fpr_meets_fnr(seed):
    rng = np.random.default_rng(seed)
    issame = lfw_like_issame(10, 30)
    distances = separated_distances(issame, rng, gap=0.5)
    low, high = brute_force_eer(distances, issame)
    result = evaluate_verification(distances, issame)
    assert low - 1e-12 <= result.eer <= high + 1e-12


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("distances", "issame", "n_folds", "message"),
    [
        ([0.1, np.nan, 0.3, 0.4], [1, 0, 1, 0], 2, "NaN or infinite"),
        ([0.1, np.inf, 0.3, 0.4], [1, 0, 1, 0], 2, "NaN or infinite"),
        ([0.1, 0.2, 0.3, 0.4], [1, 0, 1], 2, "lengths differ"),
        ([0.1, 0.2, 0.3], [1, 0, 1], 10, "fewer pairs"),
        ([0.1, 0.2, 0.3, 0.4], [1, 0, 0, 0], 2, "fold 1 of 2 .pairs 2-3. has no positive"),
        ([0.1, 0.2, 0.3, 0.4], [1, 0, 1, 1], 2, "fold 1 of 2 .pairs 2-3. has no negative"),
        ([0.1, 0.2, 0.3, 0.4], [1, 0, 2, 0], 2, "found 2 at index 2"),
        ([0.1, 0.2, 0.3, 0.4], [1, 0, 1, 0], 1, "n_folds=1"),
        ([[0.1, 0.2], [0.3, 0.4]], [1, 0], 2, "1 dimension"),
    ],
)
def test_bad_input_is_a_clear_error(distances, issame, n_folds, message):
    with pytest.raises(ValueError, match=message):
        evaluate_verification(np.array(distances), np.array(issame), S(n_folds=n_folds))


def test_bad_options_are_clear_errors():
    distances, issame, grid = hand_case()
    with pytest.raises(ValueError, match="strictly increasing"):
        evaluate_verification(distances, issame, S(n_folds=2), None, ([0.5, 0.4], [0.5]))
    with pytest.raises(ValueError, match="far_target"):
        evaluate_verification(distances, issame, S(n_folds=2, far_target=0.0))
    with pytest.raises(ValueError, match="distance='hamming'"):
        evaluate_verification(distances, issame, S(n_folds=2, distance="hamming"))
    with pytest.raises(ValueError, match="shapes differ"):
        evaluate_embeddings(np.ones((8, 3)), np.ones((8, 4)), issame, S(n_folds=2))
    with pytest.raises(ValueError, match="folds must use every fold"):
        evaluate_verification(distances, issame, S(n_folds=2), np.zeros(8, dtype=int))
    with pytest.raises(ValueError, match="distance='hamming'"):
        pair_distances(np.ones((2, 3)), np.ones((2, 3)), "hamming")


def test_each_input_check_names_what_it_refuses():
    distances, issame, grid = hand_case()
    two = S(n_folds=2)
    with pytest.raises(ValueError, match="^val_thresholds is empty$"):
        evaluate_verification(distances, issame, two, None, (grid, []))
    with pytest.raises(ValueError, match=r"^issame must be 1-D, got shape \(2, 4\)$"):
        evaluate_verification(distances, issame.reshape(2, 4), two)
    with pytest.raises(ValueError, match="^issame must be bool or 0/1, got dtype <U1$"):
        evaluate_verification(distances, np.array(list("abababab")), two)
    with pytest.raises(ValueError, match=r"^folds must be \(8,\) integers, got float64 \(8,\)$"):
        evaluate_verification(distances, issame, two, np.zeros(8))
    with pytest.raises(ValueError, match="^distances must be real numbers, got dtype complex128$"):
        evaluate_verification(distances.astype(complex), issame, two)
    with pytest.raises(ValueError, match="^cosine distance of a zero-length embedding"):
        pair_distances(np.zeros((2, 3)), np.ones((2, 3)), "cosine")


# --------------------------------------------------------------------------- output


def test_to_dict_is_json_safe_and_complete():
    distances, issame, grid = hand_case()
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.25), None, (grid, grid)
    )
    as_dict = json.loads(json.dumps(result.to_dict()))
    assert as_dict["accuracy"] == [0.75, 0.75] and as_dict["n_folds"] == 2
    assert as_dict["tpr"] == result.tpr.tolist()
    summary_only = result.to_dict(curves=False)
    assert "tpr" not in summary_only and summary_only["auc"] == result.auc


def test_plot_roc_returns_a_figure(tmp_path):
    distances, issame, grid = hand_case()
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.25), None, (grid, grid)
    )
    result = replace(result, train_impostor_pairs=4)  # as if each training fold had 4 impostors
    fig = plot_roc(result, log_scale=True, title="t")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_title() == "t"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("AUC = 0.7500" in text for text in legend)
    # the VAL point is no point of the all-pairs ROC: its entry says what it is
    val = "VAL 0.5000 @ FAR 0.25 (achieved 0.2500):\nmean of 2 test folds at their own thresholds"
    assert val in legend, legend
    fig.savefig(tmp_path / "roc.png", format="png")
    assert (tmp_path / "roc.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []  # nothing left open in pyplot


def test_plot_roc_marks_no_val_point_at_a_far_the_folds_cannot_resolve():
    distances, issame, grid = hand_case()  # 2 impostor pairs a training fold: FAR >= 0.5
    result = evaluate_verification(
        distances, issame, S(n_folds=2, far_target=0.25), None, (grid, grid)
    )
    ax = plot_roc(result).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(text.startswith("VAL @ FAR 0.25: not resolved") for text in legend), legend
    assert not any(line.get_marker() == "s" for line in ax.get_lines())  # no VAL point drawn


# --------------------------------------------------------------------------- evaluate.py


def test_evaluate_script_npz_and_csv_agree(tmp_path, capsys):
    rng = np.random.default_rng(16)
    issame = lfw_like_issame(10, 20)
    distances = separated_distances(issame, rng)
    np.savez(tmp_path / "d.npz", distances=distances, issame=issame)
    rows = "\n".join(
        f"{d!r},{'true' if s else 'false'}" for d, s in zip(distances.tolist(), issame)
    )
    (tmp_path / "d.csv").write_text("distance,issame\r\n" + rows + "\n")
    for name in ("d.npz", "d.csv"):
        assert (
            evaluate_script.main(
                ["--distances", str(tmp_path / name), "--out", str(tmp_path / name[2:])]
            )
            == 0
        )
    assert "accuracy" in capsys.readouterr().out
    npz = json.loads((tmp_path / "npz" / "metrics.json").read_text())
    csv = json.loads((tmp_path / "csv" / "metrics.json").read_text())
    expected = evaluate_verification(distances, issame).to_dict()
    # where from, what it is for, which way, and the thresholds to deploy (tested on their own)
    provenance = ("source", "threshold_for", "same_when", "deployable_thresholds")
    assert {k: v for k, v in npz.items() if k not in provenance} == expected
    assert {k: v for k, v in csv.items() if k not in provenance} == expected
    assert npz["deployable_thresholds"] == csv["deployable_thresholds"]
    assert (tmp_path / "csv" / "roc.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("0.1,1\n0.2,maybe\n", "d.csv:2: issame"),
        ("0.1,1\nabc,0\n", "d.csv:2: distance 'abc'"),
        ("0.1,1,3\n", "d.csv:1: expected"),
        ("0.1,1\n0.2,0\n", "fewer pairs"),
    ],
)
def test_evaluate_script_bad_csv(tmp_path, capsys, content, message):
    (tmp_path / "d.csv").write_text(content)
    assert (
        evaluate_script.main(["--distances", str(tmp_path / "d.csv"), "--out", str(tmp_path)]) == 2
    )
    assert message in capsys.readouterr().err


def test_evaluate_script_npz_without_issame(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", distances=np.zeros(4))
    # its own --out: a metrics.json left in the default runs/evaluate would be refused first
    argv = ["--distances", str(tmp_path / "d.npz"), "--out", str(tmp_path / "out")]
    assert evaluate_script.main(argv) == 2
    assert "no array 'issame'" in capsys.readouterr().err


def test_evaluate_script_takes_defaults_from_a_run_configuration(tmp_path):
    rng = np.random.default_rng(0)
    issame = np.tile([True, False], 50)
    distances = np.where(issame, rng.uniform(0, 2, 100), rng.uniform(1, 4, 100))
    np.savez(tmp_path / "scores.npz", distances=distances, issame=issame)
    config = tmp_path / "eval.yaml"
    config.write_text(f"eval:\n  n_folds: 5\nlogging:\n  out_dir: {tmp_path / 'from_config'}\n")
    argv = ["--config", str(config), "--distances", str(tmp_path / "scores.npz")]
    assert evaluate_script.main(argv) == 0
    metrics = json.loads((tmp_path / "from_config" / "metrics.json").read_text())
    assert len(metrics["accuracy"]) == 5
    assert evaluate_script.main([*argv, "--folds", "4", "--out", str(tmp_path / "cli")]) == 0
    assert len(json.loads((tmp_path / "cli" / "metrics.json").read_text())["accuracy"]) == 4
    config.write_text("eval:\n  n_fold: 5\n")
    assert evaluate_script.main(argv) == 2


@pytest.mark.parametrize(
    ("name", "content", "argv", "message"),
    [
        ("d.npz", b"PK\x03\x04torn", [], "not a readable .npz archive"),
        ("d.csv", b"\xff\xfe\x00\x01", [], "not a UTF-8 text file"),
        ("d.csv", b"0.1,1\n0.2,0\n0.3,1\n0.4,0\n", ["--folds", "1"], "--folds: 1"),
        ("d.csv", b"0.1,1\n0.2,0\n0.3,1\n0.4,0\n", ["--far-target", "2"], "--far-target"),
    ],
)
def test_evaluate_script_reports_bad_input_on_one_line(
    tmp_path, capsys, name, content, argv, message
):
    (tmp_path / name).write_bytes(content)
    argv = ["--distances", str(tmp_path / name), "--out", str(tmp_path / "out"), *argv]
    assert evaluate_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert len(err.splitlines()) == 1  # a FacenetError: a user error, not a traceback


@pytest.mark.parametrize("where", ["a_file", "a_file/below"])
def test_evaluate_script_refuses_an_unusable_out_before_evaluating(tmp_path, capsys, where):
    issame = lfw_like_issame(10, 20)
    np.savez(tmp_path / "d.npz", distances=np.where(issame, 0.1, 0.9), issame=issame)
    (tmp_path / "a_file").write_text("in the way")
    argv = ["--distances", str(tmp_path / "d.npz"), "--out", str(tmp_path / where)]
    assert evaluate_script.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: --out {tmp_path / where}: ")
    assert "accuracy" not in captured.out  # refused before the evaluation, not after
