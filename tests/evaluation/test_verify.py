"""facenet.evaluation.verify (one verification path) against the protocol applied by hand and the
classic loops; facenet.evaluation.report (one way of writing the figures)."""

import io
import json
import os
import warnings
import zipfile
from functools import partial

import numpy as np
import pytest
import torch

from benchmarks import reference_evaluation as ref
from facenet.checkpoint import load_checkpoint
from facenet.cli import evaluate as evaluate_script
from facenet.data.pairs import read_pairs
from facenet.errors import DataError
from facenet.evaluation.distances_file import read_distances
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.presets import VerifySettings as S
from facenet.evaluation.protocol import (
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
    threshold_grids,
)
from facenet.evaluation.report import (
    ThresholdRecord,
    figures,
    figures_line,
    result_table,
    sets_table,
)
from facenet.evaluation.verify import REVERSED_AUC_MARGIN, _checked, verify, verify_distances
from facenet.wings.after_training.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tiny_run):
    """The tiny run's trained model and its held-out pairs list."""
    return load_model(tiny_run["checkpoint"]), read_pairs(tiny_run["pairs"])


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("subtract_mean", [False, True])
def test_verify_is_the_protocol_on_the_embedded_pairs(tiny, flip, subtract_mean):
    trained, pairs = tiny
    settings = S(flip=flip, subtract_mean=subtract_mean, n_folds=pairs.n_folds)
    result, distances = verify(
        trained.model,
        pairs,
        trained.image_size,
        settings,
        normalize=trained.normalize,
        return_distances=True,
    )
    emb1, emb2 = embed_pair_list(
        trained.model, pairs, trained.image_size, S(flip=flip), normalize=trained.normalize
    )
    e1, e2, same = emb1.numpy(), emb2.numpy(), np.asarray(pairs.issame)
    assert np.array_equal(distances, pair_distances(e1, e2))
    # With flip the default grids run over the concatenation's whole range (squared up to 8).
    grid, fine = threshold_grids(S(flip=flip))
    by_hand_settings = S(subtract_mean=subtract_mean, n_folds=pairs.n_folds)
    grids = (grid, fine)
    if subtract_mean:
        by_hand = evaluate_embeddings(e1, e2, same, by_hand_settings, pairs.fold_ids, grids)
    else:
        by_hand = evaluate_verification(distances, same, by_hand_settings, pairs.fold_ids, grids)
    assert result.to_dict() == by_hand.to_dict()
    # The classic loops (contiguous folds: the file's folds are contiguous blocks here).
    options = {"nrof_folds": pairs.n_folds, "subtract_mean": subtract_mean}
    _, _, accuracy, best = ref.calculate_roc(grid, e1, e2, same, **options)
    val, _, far, *_ = ref.calculate_val(fine, e1, e2, same, 1e-3, **options)
    assert result.accuracy == pytest.approx(accuracy, abs=1e-12)
    assert result.best_thresholds == pytest.approx(best, abs=1e-12)
    assert (result.val, result.far) == pytest.approx((val, far), abs=1e-12)


def test_verify_takes_the_classic_grids_by_name(tiny):
    trained, pairs = tiny
    result = verify(trained.model, pairs, trained.image_size, S(grid="classic", n_folds=3))
    assert np.array_equal(result.thresholds, np.arange(0, 4, 0.01))
    assert np.array_equal(threshold_grids(S())[1], default_thresholds(fine=True))
    with pytest.raises(ValueError, match="grid='fine': valid options"):
        evaluate_verification(np.arange(4.0), [1, 0, 1, 0], S(grid="fine", n_folds=2))
    with pytest.raises(ValueError, match="grid='fine': valid options"):
        threshold_grids(S(grid="fine"))
    with pytest.raises(ValueError, match="distance='manhattan': valid options"):
        default_thresholds("manhattan")


@pytest.mark.parametrize("distance, top", [("squared", 8.0), ("euclidean", 2 * 2**0.5)])
def test_flipped_unit_embeddings_get_a_default_grid_over_their_whole_range(tiny, distance, top):
    trained, pairs = tiny
    unit = default_thresholds(distance)
    flipped = verify(trained.model, pairs, trained.image_size, S(flip=True, distance=distance))
    # The concatenation of two unit vectors: distances reach `top`; the unit grid comes first.
    assert flipped.thresholds[-1] >= top - 1e-9 > unit[-1]
    assert np.array_equal(flipped.thresholds[: len(unit)], unit)
    plain = verify(trained.model, pairs, trained.image_size, S(distance=distance))
    assert np.array_equal(plain.thresholds, unit)
    for grid in ("classic", "mobilefacenet"):  # the publishers' grids stay theirs
        flipped = S(grid=grid, distance=distance, flip=True)
        assert np.array_equal(threshold_grids(flipped)[0], threshold_grids(S(grid=grid))[0])
    cosine = threshold_grids(S(distance="cosine", flip=True))[0]  # scale-free
    assert np.array_equal(cosine, default_thresholds("cosine"))
    raw = threshold_grids(S(flip=True, features="raw"))[0]  # norm unknown: the unit grid
    assert np.array_equal(raw, default_thresholds())


def test_verify_distances_names_its_source_when_the_data_do_not_fit():
    issame = np.tile([True, False], 20)
    distances = np.where(issame, 0.5, 1.5) + np.linspace(0, 0.1, 40)
    result = verify_distances(distances, issame, S(n_folds=4))
    assert result.to_dict() == evaluate_verification(distances, issame, S(n_folds=4)).to_dict()
    with pytest.raises(DataError, match="^scores.csv: "):
        verify_distances(distances[:3], issame[:3], S(n_folds=4), source="scores.csv")


def test_one_formatting_of_the_figures():
    issame = np.tile([True, False], 20)
    distances = np.where(issame, 0.5, 1.5) + np.random.default_rng(0).uniform(-0.6, 0.6, 40)
    result = verify_distances(distances, issame, S(n_folds=4, far_target=0.1))
    r = result
    line = figures_line("lfw", figures(result))
    assert line == (
        f"lfw acc {r.accuracy_mean:.4f}±{r.accuracy_std:.4f} VAL {r.val:.4f} @ FAR 0.1 "
        f"(achieved {r.far:.4f}) AUC {r.auc:.4f} EER {r.eer:.4f}"
    )
    row = sets_table({"lfw": result}).splitlines()[1]
    assert row.split()[:2] == ["lfw", f"{r.accuracy_mean:.4f}±{r.accuracy_std:.4f}"]
    assert f"VAL {r.val:.4f} @ FAR 0.1 (achieved {r.far:.4f})  {r.auc:.4f}  {r.eer:.4f}" in row


@pytest.mark.parametrize("far_target, resolved", [(1 / 15, True), (0.06, False), (1e-3, False)])
def test_a_val_the_training_folds_cannot_resolve_is_written_as_not_resolved(far_target, resolved):
    # 20 impostor pairs in 4 folds: each threshold is chosen on 15, so FAR >= 1/15 only
    issame = np.tile([True, False], 20)
    distances = np.where(issame, 0.5, 1.5) + np.random.default_rng(0).uniform(-0.6, 0.6, 40)
    result = verify_distances(distances, issame, S(n_folds=4, far_target=far_target))
    values, record = figures(result), result.to_dict(curves=False)
    table = result_table("lfw", result)
    assert result.train_impostor_pairs == record["train_impostor_pairs"] == 15
    if resolved:
        assert values["val"] == record["val"] == result.val
        assert "not resolved" not in table
        return
    note = "not resolved (thresholds chosen on 15 impostor pairs resolve FAR >= 1/15)"
    assert values["val"] == values["val_std"] == record["val"] == record["val_std"] == note
    assert f"VAL @ FAR {far_target:g}: {note} AUC" in figures_line("lfw", values)
    assert f"VAL @ FAR {far_target:g}: {note}" in table and f"VAL {result.val:.4f}" not in table
    assert [row.split()[3] for row in table.splitlines()[1:5]] == ["-"] * 4
    assert json.loads(json.dumps(record))["val"] == note


@pytest.mark.parametrize(
    "distance, grid", [("squared", "default"), ("angular", "default"), ("cosine", "classic")]
)
def test_distances_above_the_threshold_grid_are_warned_about(distance, grid):
    issame = np.tile([True, False], 20)
    settings = S(distance=distance, grid=grid, n_folds=4)
    top = threshold_grids(settings)[0][-1]
    distances = top + 1.0 + np.where(issame, 0.0, 1.0)  # every one above the grid
    with pytest.warns(
        UserWarning, match=f"100.0% of the same-identity .* {distance} threshold"
    ) as w:
        result = verify_distances(distances, issame, settings)
    message = str(w[0].message)  # the grid by name and setting, and where the distances lie
    assert f"grid {grid!r} [" in message and "(--grid, eval.grid or a --preset)" in message
    assert f"the distances span [{top + 1:.4g}, {top + 2:.4g}]" in message
    assert result.accuracy_mean == 0.5  # what the warning is there for
    inside = np.where(issame, 0.1, 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none inside the grid
        verify_distances(inside, issame, settings)


def test_evaluate_warns_in_one_line_and_writes_the_record(tmp_path, capsys):
    issame = np.tile([1, 0], 20)
    np.savez(tmp_path / "d.npz", distances=np.full(40, 9.0), issame=issame)
    argv = ["--distances", str(tmp_path / "d.npz"), "--out", str(tmp_path / "out"), "--folds", "4"]
    assert evaluate_script.main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "no threshold accepts them" in err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    # distances measured elsewhere: the weights are not known, so identify will not use it
    assert metrics["threshold_for"] == {"distances": str(tmp_path / "d.npz")}


def test_a_grid_that_misses_the_scores_is_warned_about_in_every_mode():
    issame = np.tile([True, False], 20)
    below = np.where(issame, -0.6, -0.4)  # all below the grid: every threshold accepts them
    with pytest.warns(UserWarning, match=r"0.0% of the same-identity .* 100.0% of the others"):
        assert verify_distances(below, issame, S(n_folds=4)).accuracy_mean == 0.5
    # raw features of norm 20: every distance above the unit grid (the 0.5 at AUC ~1)
    rng = np.random.default_rng(0)
    a = rng.normal(size=(40, 8))
    b = np.where(issame[:, None], a + 0.3 * rng.normal(size=a.shape), rng.normal(size=a.shape))
    a, b = (20 * x / np.linalg.norm(x, axis=1, keepdims=True) for x in (a, b))
    for subtract_mean in (False, True):
        settings = S(n_folds=4, features="raw", subtract_mean=subtract_mean)
        with pytest.warns(UserWarning, match=r"pairs: 100.0% .* --features unit"):
            evaluate = partial(evaluate_embeddings, a, b, issame, settings)
            result = _checked("pairs", pair_distances(a, b), settings, evaluate)
        assert result.auc == 1.0 and result.accuracy_mean == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a grid of the same scale: no warning
        unit = partial(evaluate_embeddings, a / 20, b / 20, issame, S(n_folds=4))
        _checked("pairs", pair_distances(a / 20, b / 20), S(n_folds=4), unit)
        verify_distances(1 - np.where(issame, 0.9, 0.1), issame, S("cosine", n_folds=4))


@pytest.mark.parametrize("distance", ["squared", "cosine", "angular"])
def test_scores_that_rank_the_wrong_way_are_warned_about(distance):
    issame = np.tile([True, False], 20)
    margin = REVERSED_AUC_MARGIN  # AUC below 0.5 - 0.1: warned about; at chance: not
    noise = np.random.default_rng(1).uniform(0, 0.05, 40)
    similarities = np.where(issame, 0.8, 0.3) + noise  # higher for the same identity
    with pytest.warns(UserWarning, match=r"AUC 0.0000.*--similarities"):
        verify_distances(similarities, issame, S(distance, n_folds=4), source="s.npz")
    assert verify_distances(1 - similarities, issame, S(distance, n_folds=4)).auc == 1.0
    chance = np.tile([0.2, 0.3, 0.3, 0.2], 10)  # AUC 0.5
    # AUC about 0.3: within three standard errors of chance for 40 pairs, not for 4,000
    rng = np.random.default_rng(2)
    many = np.tile([True, False], 2000)
    worse = 0.7 * (np.where(many, 0.2, 0.0) + rng.uniform(0, 1, len(many)))  # in every grid
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verify_distances(chance, issame, S(distance, n_folds=4)).auc > 0.5 - margin
        small = verify_distances(worse[:40], issame, S(distance, n_folds=4))
        assert small.auc < 0.5 - margin
    with pytest.warns(UserWarning, match=r"AUC 0.3"):
        verify_distances(worse, many, S(distance, n_folds=4))


def test_evaluate_scores_similarities_and_says_which_way_the_threshold_points(tmp_path, capsys):
    issame = np.tile([1, 0], 20)
    similarities = np.where(issame, 0.7, 0.1)
    np.savez(tmp_path / "s.npz", distances=similarities, issame=issame)
    argv = ["--distances", str(tmp_path / "s.npz"), "--folds", "4", "--distance", "cosine"]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--similarities" in err[0] and "AUC 0.0000" in err[0]
    assert evaluate_script.main([*argv, "--similarities", "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().err == ""
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert metrics["accuracy_mean"] == 1.0 and 0.1 < metrics["threshold"] < 0.9
    assert metrics["same_when"] == "1 - similarity < threshold"
    plain = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert plain["same_when"] == "distance < threshold"


def test_csv_fields_over_the_limit_are_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "d.csv"
    path.write_text("distance,issame\n0.5,1\n" + "9" * 200_000 + ",0\n")
    with pytest.raises(DataError, match=r"d.csv:3: field larger than field limit"):
        read_distances(path)
    assert evaluate_script.main(["--distances", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "d.csv:3" in err and len(err.splitlines()) == 1


def test_evaluate_records_what_its_threshold_was_chosen_for(tiny_run, tmp_path):
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--pairs", str(tiny_run["pairs"])]
    assert evaluate_script.main([*argv, "--flip", "--preprocess", "crop", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    trained = load_model(tiny_run["checkpoint"])
    assert metrics["threshold_for"] == {
        "checkpoint": str(tiny_run["checkpoint"]),
        "weights_sha256": trained.weights_sha256(),
        "epoch": trained.epoch,
        "flip": True,
        "subtract_mean": False,
        "preprocess": "crop",
        "features": "unit",
    }
    record = ThresholdRecord.from_dict(metrics)
    assert record.value == metrics["threshold"] and record.epoch == trained.epoch
    assert len(record.differences(trained.preparation(flip=True))) == 1  # the preprocessing


def test_a_threshold_chosen_on_raw_features_does_not_fit_unit_embeddings(
    tiny_run, tmp_path, capsys
):
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--pairs", str(tiny_run["pairs"])]
    argv += ["--features", "raw", "--preprocess", "resize", "--out", str(out)]
    assert evaluate_script.main(argv) == 0
    err = capsys.readouterr().err  # raw outputs reach past the unit grid: said, with the fix
    assert err.startswith(f"warning: {tiny_run['pairs']}: ") and len(err.splitlines()) == 1
    assert "of the same-identity pairs lie at or above the top" in err and "--features unit" in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["threshold_for"]["features"] == "raw"
    record = ThresholdRecord.from_dict(metrics)
    assert record.differences(load_model(tiny_run["checkpoint"]).preparation()) == [
        "features: chosen with 'raw', here 'unit'"
    ]
    older = {k: v for k, v in metrics["threshold_for"].items() if k != "features"}
    assert ThresholdRecord.from_dict({**metrics, "threshold_for": older}).features == "unit"


def test_evaluate_refuses_nan_weights_and_batch_size_zero(tiny_run, tmp_path, capsys):
    state = load_checkpoint(tiny_run["checkpoint"])
    state["model"]["embedding.linear.weight"][5] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    argv = ["--checkpoint", str(tmp_path / "nan.pt"), "--pairs", str(tiny_run["pairs"])]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "nan.pt" in err and "embedding.linear.weight" in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit) as caught:
        evaluate_script.main([*argv, "--batch-size", "0"])
    assert caught.value.code == 2 and "--batch-size" in capsys.readouterr().err


@pytest.mark.parametrize("preprocess", ["resize", "crop"])
def test_verify_embeds_height_by_width_inputs(tiny_run, preprocess):
    from facenet.models.embedding import EmbeddingNet

    class Shape(torch.nn.Module):  # refuses any input but (B, 3, 24, 20)
        def __init__(self):
            super().__init__()
            self.net = EmbeddingNet("tiny", embedding_dim=8).eval()

        def forward(self, x):
            assert tuple(x.shape[1:]) == (3, 24, 20)
            return self.net(x)

    pairs = read_pairs(tiny_run["pairs"], tiny_run["heldout"])
    result = verify(Shape(), pairs, [24, 20], S(preprocess=preprocess, batch_size=16))
    assert len(result.accuracy) == 10


def test_the_mobilefacenet_grid_is_the_publishers_similarity_grid():
    from facenet.config import load_config
    from facenet.evaluation.presets import mobilefacenet_thresholds

    accuracy_grid, val_grid = threshold_grids(S(grid="mobilefacenet"))
    assert np.array_equal(accuracy_grid, mobilefacenet_thresholds())
    assert np.array_equal(val_grid, mobilefacenet_thresholds())
    cfg = load_config("configs/lfw_mobilefacenet.yaml")
    assert cfg.data.image_size == [112, 96]


@pytest.mark.parametrize("name", ["d.csv", "d.npz"])
@pytest.mark.parametrize(
    "hostile", ["FIFO", "folder", "declared terabyte", "zero-size huge side", "missing"]
)
def test_hostile_distances_files_are_one_line_errors(tmp_path, capsys, name, hostile):
    """Checked before a byte is parsed: a FIFO would block on open, a header declaring a
    terabyte would be allocated."""
    path = tmp_path / name
    if hostile == "FIFO":
        os.mkfifo(path)
    elif hostile == "folder":
        path.mkdir()
    elif hostile == "declared terabyte":
        header = io.BytesIO()
        declared = {"descr": "<f8", "fortran_order": False, "shape": (2**40,)}
        np.lib.format.write_array_header_1_0(header, declared)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("distances.npy", header.getvalue() + b"\0" * 64)
    elif hostile == "zero-size huge side":  # 0 elements: numpy's shape overflows, not the size
        header = io.BytesIO()
        declared = {"descr": "<f8", "fortran_order": False, "shape": (2**70, 0)}
        np.lib.format.write_array_header_2_0(header, declared)
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("distances.npy", header.getvalue())
    assert evaluate_script.main(["--distances", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_complex_distances_are_refused(tmp_path, capsys):
    path = tmp_path / "d.npz"
    issame = np.arange(40) % 2 == 0
    np.savez(path, distances=np.linspace(0, 1, 40).astype(np.complex64), issame=issame)
    assert evaluate_script.main(["--distances", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and "real numbers" in err and "complex64" in err
