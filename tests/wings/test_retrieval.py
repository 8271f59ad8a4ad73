"""Retrieval figures against pytorch-metric-learning's AccuracyCalculator and hand-made cases."""

import math

import numpy as np
import pytest
import torch

from facenet.wings import retrieval
from facenet.wings.retrieval import retrieval_metrics

KEYS = ("precision_at_1", "r_precision", "mean_average_precision_at_r")


def _stable_knn(query, k, reference, ref_includes_query):
    """Brute-force neighbours for pytorch-metric-learning, ties broken by the lower index."""
    from pytorch_metric_learning.utils.inference import return_results

    k += int(ref_includes_query)
    distances = torch.cdist(query, reference)
    order = distances.sort(dim=1, stable=True).indices[:, :k]
    return return_results(distances.gather(1, order), order, ref_includes_query)


def _pml(embeddings, labels, knn_func=None):
    """pytorch-metric-learning's figures, by default with its own CustomKNN (Euclidean)."""
    accuracy = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    from pytorch_metric_learning.distances import LpDistance
    from pytorch_metric_learning.utils.inference import CustomKNN

    knn_func = knn_func or CustomKNN(LpDistance(normalize_embeddings=False))
    cpu = torch.device("cpu")
    calculator = accuracy.AccuracyCalculator(include=KEYS, knn_func=knn_func, device=cpu)
    return calculator.get_accuracy(torch.as_tensor(embeddings), torch.as_tensor(labels))


def test_hand_computed_case():
    # On a line; labels 0 0 0 1 1 2; row 5 is lone. Other rows by distance, (+) same label:
    # 0: 1+ 3- 2+ | 1: 0+ 3- 2+ | 2: 3- 1+ 0+ | 3: 2- ... | 4: 2- 3+ (R = 2, 2, 2, 1, 1)
    x = np.array([[0.0], [1.0], [2.5], [2.1], [10.0], [20.0]])
    got = retrieval_metrics(x, [0, 0, 0, 1, 1, 2])
    assert got["queries"] == 5 and got["lone_queries"] == 1
    assert got["precision_at_1"] == pytest.approx(2 / 5)
    assert got["r_precision"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 2) / 5)
    assert got["mean_average_precision_at_r"] == pytest.approx((1 / 2 + 1 / 2 + 1 / 4) / 5)
    assert got == pytest.approx(_pml(x, [0, 0, 0, 1, 1, 2]) | got)


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_to_pytorch_metric_learning_on_random_embeddings(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 40, (300,), generator=g)
    got, want = retrieval_metrics(x, y), _pml(x, y)
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-6)


def test_equal_to_pytorch_metric_learning_with_ties_and_lone_labels(monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (200, 2), generator=g).float()  # 9 distinct points: ties everywhere
    y = torch.randint(0, 30, (200,), generator=g)
    y[:5] = torch.arange(100, 105)  # five labels with one row each
    monkeypatch.setattr(retrieval, "CHUNK_BYTES", 4 * 200 * 7)  # chunks of 7 queries
    got, want = retrieval_metrics(x.numpy(), y.numpy()), _pml(x, y, _stable_knn)
    assert got["lone_queries"] == 5 and got["queries"] == 195
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-6)


def test_distances_are_torch_cdists_bit_for_bit():
    g = torch.Generator().manual_seed(4)
    for rows, dim in [(26, 3), (300, 16), (700, 128)]:
        x = torch.randn(rows, dim, generator=g) * 3
        left, right = retrieval.cdist_operands(x)
        squared = left[: rows // 2] @ right.T
        assert torch.equal(squared.clamp_min(0).sqrt(), torch.cdist(x[: rows // 2], x))


def test_screened_nearest_keep_ties_at_the_boundary_by_the_lower_index():
    # 64 distinct points among 2000 rows: ties cross the n-th place in most rows; for each n the
    # group screening runs and the last few columns (the queries' own rows among them) belong
    # to no group
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 4, (2000, 3), generator=g).float()
    for points in (x, torch.randn(2000, 3, generator=g)):
        left, right = retrieval.cdist_operands(points)
        squared = left[-300:] @ right.T
        want = torch.cdist(points[-300:], points).sort(dim=1, stable=True).indices
        for n in (1, 7, 40):
            assert torch.equal(retrieval.nearest_columns(squared, n), want[:, :n])
    y = torch.randint(0, 400, (2000,), generator=g)
    got, want = retrieval_metrics(x, y), _pml(x, y, _stable_knn)
    for key in KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-6)


def test_chunking_changes_nothing(monkeypatch):
    x, y = torch.randn(97, 8), torch.randint(0, 9, (97,))
    whole = retrieval_metrics(x, y)
    monkeypatch.setattr(retrieval, "CHUNK_BYTES", 4 * 97 * 5)
    assert retrieval_metrics(x, y) == pytest.approx(whole, rel=1e-12)


def test_only_lone_labels_give_nan_and_bad_input_is_refused():
    got = retrieval_metrics(torch.randn(4, 3), [0, 1, 2, 3])
    assert got["queries"] == 0 and all(math.isnan(got[k]) for k in KEYS)
    with pytest.raises(ValueError, match="finite"):
        retrieval_metrics(torch.tensor([[0.0], [float("nan")]]), [0, 0])
    with pytest.raises(ValueError, match=r"\(3,\) labels|labels"):
        retrieval_metrics(torch.randn(3, 2), [0, 0])


def test_evaluate_retrieval_embeds_an_identity_folder(tiny_run, tmp_path, capsys):
    import json

    from facenet.cli import evaluate as evaluate_script
    from facenet.evaluation.presets import CLASSIC
    from facenet.wings.after_training.embed import embed_folder
    from facenet.wings.after_training.loading import load_model

    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--retrieval", str(tiny_run["heldout"])]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "r")]) == 0
    written = json.loads((tmp_path / "r" / "metrics.json").read_text())
    trained = load_model(tiny_run["checkpoint"])
    found = embed_folder(trained.model, tiny_run["heldout"], trained.image_size, CLASSIC)
    labels = np.unique(found.labels, return_inverse=True)[1]
    assert written | retrieval_metrics(found.embeddings, labels) == written
    assert written["queries"] == len(found.paths) and "precision_at_1" in capsys.readouterr().out
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "r")]) == 2  # not replaced
    with pytest.raises(SystemExit):
        evaluate_script.main(["--retrieval", str(tiny_run["heldout"])])  # no --checkpoint


def test_evaluate_retrieval_refuses_a_folder_it_cannot_score(tiny_run, tmp_path, capsys):
    import shutil

    from facenet.cli import evaluate as evaluate_script

    identity = sorted(p for p in tiny_run["heldout"].iterdir() if p.is_dir())[0]
    images = sorted(identity.iterdir())[:2]
    flat, lone = tmp_path / "flat", tmp_path / "lone"
    for n, image in enumerate(images):
        flat.mkdir(exist_ok=True)
        shutil.copy(image, flat / f"{n}{image.suffix}")  # no identity folder: all 1.0 before
        (lone / f"id{n}").mkdir(parents=True)
        shutil.copy(image, lone / f"id{n}" / image.name)  # one image an identity: NaN before
    for root, says in ((flat, "outside identity folders"), (lone, "no identity has two")):
        argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--retrieval", str(root)]
        assert evaluate_script.main([*argv, "--out", str(tmp_path / "r")]) == 2, root
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "r").exists()
