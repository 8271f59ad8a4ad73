"""facenet.evaluation.verify (one verification path) against the protocol applied by hand and the
classic loops; facenet.evaluation.report (one way of writing the figures)."""

import numpy as np
import pytest

from benchmarks import reference_evaluation as ref
from facenet.data.pairs import read_pairs
from facenet.errors import DataError
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.protocol import (
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)
from facenet.evaluation.report import figures, figures_line, sets_table
from facenet.evaluation.verify import threshold_grids, verify, verify_distances
from facenet.inference.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tiny_run):
    """The tiny run's trained model and its held-out pairs list."""
    return load_model(tiny_run["checkpoint"]), read_pairs(tiny_run["pairs"])


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("subtract_mean", [False, True])
def test_verify_is_the_protocol_on_the_embedded_pairs(tiny, flip, subtract_mean):
    trained, pairs = tiny
    result, distances = verify(
        trained.model,
        pairs,
        trained.image_size,
        normalize=trained.normalize,
        flip=flip,
        subtract_mean=subtract_mean,
        n_folds=pairs.n_folds,
        return_distances=True,
    )
    emb1, emb2 = embed_pair_list(
        trained.model, pairs, trained.image_size, flip=flip, normalize=trained.normalize
    )
    e1, e2, same = emb1.numpy(), emb2.numpy(), np.asarray(pairs.issame)
    assert np.array_equal(distances, pair_distances(e1, e2))
    if subtract_mean:
        by_hand = evaluate_embeddings(
            e1, e2, same, subtract_mean=True, n_folds=pairs.n_folds, folds=pairs.fold_ids
        )
    else:
        by_hand = evaluate_verification(distances, same, pairs.n_folds, folds=pairs.fold_ids)
    assert result.to_dict() == by_hand.to_dict()
    # The classic loops (contiguous folds: the file's folds are contiguous blocks here).
    options = {"nrof_folds": pairs.n_folds, "subtract_mean": subtract_mean}
    _, _, accuracy, best = ref.calculate_roc(default_thresholds(), e1, e2, same, **options)
    fine = default_thresholds(fine=True)
    val, _, far, *_ = ref.calculate_val(fine, e1, e2, same, 1e-3, **options)
    assert result.accuracy == pytest.approx(accuracy, abs=1e-12)
    assert result.best_thresholds == pytest.approx(best, abs=1e-12)
    assert (result.val, result.far) == pytest.approx((val, far), abs=1e-12)


def test_verify_takes_the_classic_grids_by_name(tiny):
    trained, pairs = tiny
    result = verify(trained.model, pairs, trained.image_size, grid="classic", n_folds=3)
    assert np.array_equal(result.thresholds, np.arange(0, 4, 0.01))
    assert threshold_grids("default") == (None, None)
    with pytest.raises(ValueError, match="unknown threshold grid"):
        threshold_grids("fine")


def test_verify_distances_names_its_source_when_the_data_do_not_fit():
    issame = np.tile([True, False], 20)
    distances = np.where(issame, 0.5, 1.5) + np.linspace(0, 0.1, 40)
    result = verify_distances(distances, issame, n_folds=4)
    assert result.to_dict() == evaluate_verification(distances, issame, 4).to_dict()
    with pytest.raises(DataError, match="^scores.csv: "):
        verify_distances(distances[:3], issame[:3], n_folds=4, source="scores.csv")


def test_one_formatting_of_the_figures():
    issame = np.tile([True, False], 20)
    distances = np.where(issame, 0.5, 1.5) + np.random.default_rng(0).uniform(-0.6, 0.6, 40)
    result = verify_distances(distances, issame, n_folds=4)
    r = result
    line = figures_line("lfw", figures(result))
    assert line == (
        f"lfw acc {r.accuracy_mean:.4f}±{r.accuracy_std:.4f} VAL {r.val:.4f} @ FAR 0.001 "
        f"(achieved {r.far:.4f}) AUC {r.auc:.4f} EER {r.eer:.4f}"
    )
    assert result.summary() == f"{line[4:]} threshold {r.threshold:.4f} (squared)"
    row = sets_table({"lfw": result}).splitlines()[1]
    assert row.split()[:2] == ["lfw", f"{r.accuracy_mean:.4f}±{r.accuracy_std:.4f}"]
    assert f"VAL {r.val:.4f} @ FAR 0.001 (achieved {r.far:.4f})  {r.auc:.4f}  {r.eer:.4f}" in row
