"""benchmarks.bench_published: the figures it holds are the docs' figures, a moved figure is
named and fails the run, and a model whose weights are not at hand is said to be left out."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import bench_published as bench

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", bench.PUBLISHED, ids=lambda model: model.preset)
def test_each_doc_states_the_figures_the_benchmark_holds(model):
    for doc in model.docs:
        text = (REPO / doc).read_text()
        assert re.search(rf"\b{model.accuracy:.4f} ± 0\.00\d\d", text), (doc, model.accuracy)
        if doc != "README.md":  # README quotes the accuracy only
            assert f"{model.auc:.4f}" in text, (doc, model.auc)


def test_figures_that_round_the_same_hold_and_others_are_named():
    model = bench.PUBLISHED[0]
    same = {"accuracy_mean": model.accuracy + 4e-5, "auc": model.auc - 4e-5}
    assert bench.moved(model, same) == []
    lower = {"accuracy_mean": model.accuracy - 0.0014, "auc": model.auc}
    assert bench.moved(model, lower) == [
        f"accuracy {model.accuracy - 0.0014:.4f} (docs: {model.accuracy:.4f})"
    ]


def test_a_moved_figure_fails_the_run_and_missing_weights_are_left_out(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()

    def fake_measure(model, args, weights):  # a figure 0.0014 below the docs'
        figures = {"accuracy_mean": model.accuracy - 0.0014, "auc": model.auc}
        return {"name": model.name, "weights": str(weights), "moved": bench.moved(model, figures)}

    monkeypatch.setattr(bench, "measure_model", fake_measure)
    report_path = tmp_path / "report.json"
    argv = ["--data", str(tmp_path / "data"), "--work", str(tmp_path / "work")]
    assert bench.main([*argv, "--json", str(report_path)]) == 1
    report = json.loads(report_path.read_text())
    assert [row["weights"] for row in report["models"]] == [
        str(tmp_path / "data" / bench.PUBLISHED[0].weights)
    ]
    assert report["left_out"] == [f"{bench.PUBLISHED[1].name}: no --sandberg-pb"]
