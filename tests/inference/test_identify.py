"""Identification: hand-computed matches, brute force, thresholds, identify.py end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from facenet.cli import embed as embed_script
from facenet.cli import evaluate as evaluate_script
from facenet.cli import identify as identify_script
from facenet.errors import DataError
from facenet.inference.identify import Gallery, identification_rates, match, read_threshold

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_hand_computed_matches_and_unknown():
    gallery = Gallery(np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]]), ["ann", "bob", "bob"])
    probes = np.array([[0.8, 0.6], [-1.0, 0.0], [0.0, 1.0]])
    # squared distances: probe 0 -> (0.4, 1.6, 0.08): bob at 0.08; probe 1 -> (4, 2, 3.2): bob
    # at 2 (not below 1.0: unknown); probe 2 -> (2, 0, 0.4): bob at 0 (row 1)
    m = match(gallery, probes, threshold=1.0)
    assert m.identity == ["bob", None, "bob"] and m.nearest == ["bob", "bob", "bob"]
    assert np.allclose(m.distance, [0.08, 2.0, 0.0]) and m.index.tolist() == [2, 1, 1]
    rates = identification_rates(m, ["bob", "eve", "ann"], gallery)
    assert rates == {
        "rank1": 0.5,
        "detection_identification": 0.5,
        "n_known": 2,
        "open_set_rejection": 1.0,
        "n_unknown": 1,
    }
    # the rule is distance < threshold, as in the verification protocol
    assert match(gallery, probes[2:], threshold=0.0).identity == [None]


@pytest.mark.parametrize("distance", ["squared", "euclidean", "cosine"])
def test_match_equals_brute_force(distance):
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    gallery = Gallery(emb[:25], [f"id{i % 7}" for i in range(25)])
    m = match(gallery, emb[25:], threshold=0.9, distance=distance)
    for p, probe in enumerate(emb[25:]):
        if distance == "cosine":
            d = [1 - g @ probe / np.linalg.norm(g) / np.linalg.norm(probe) for g in emb[:25]]
        else:
            d = [np.sum((g - probe) ** 2) for g in emb[:25]]
            d = np.sqrt(d) if distance == "euclidean" else d
        best = int(np.argmin(d))
        assert m.index[p] == best and abs(m.distance[p] - d[best]) < 1e-6  # float32 gallery
        assert m.identity[p] == (gallery.labels[best] if d[best] < 0.9 else None)


def test_bad_galleries_and_probes_are_data_errors():
    with pytest.raises(DataError, match="labels"):
        Gallery(np.zeros((2, 3)), [])
    gallery = Gallery(np.zeros((2, 3)), ["a", "b"])
    with pytest.raises(DataError, match="do not fit"):
        match(gallery, np.zeros((1, 4)), 1.0)
    with pytest.raises(DataError, match="valid options"):
        match(gallery, np.zeros((1, 3)), 1.0, distance="manhattan")


def test_read_threshold_from_metrics_or_a_run_summary(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"threshold": 1.1, "threshold_distance": "cosine"}))
    summary = {"threshold": {"value": 0.9, "distance": "euclidean", "epoch": 3}}
    (tmp_path / "s.json").write_text(json.dumps(summary))
    (tmp_path / "n.json").write_text(json.dumps({"accuracy_mean": 0.9}))
    assert read_threshold(tmp_path / "m.json") == (1.1, "cosine")
    assert read_threshold(tmp_path / "s.json") == (0.9, "euclidean")
    assert read_threshold(tmp_path / "n.json") is None


def split_gallery_and_probes(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Half the identities enrolled with one image each; probes: their other images (known)
    and every image of the other half (not enrolled)."""
    with np.load(source) as data:
        emb, labels, paths = data["embeddings"], data["labels"], data["paths"]
    identities = sorted(set(labels.tolist()))
    enrolled = set(identities[: len(identities) // 2])
    first = {name: int(np.flatnonzero(labels == name)[0]) for name in enrolled}
    in_gallery = np.isin(np.arange(len(labels)), list(first.values()))
    files = {}
    for name, rows in (("gallery", in_gallery), ("probes", ~in_gallery)):
        files[name] = tmp_path / f"{name}.npz"
        np.savez(files[name], embeddings=emb[rows], labels=labels[rows], paths=paths[rows])
    return files["gallery"], files["probes"]


def test_identify_end_to_end_on_the_synthetic_identities(tiny_run, tmp_path, capsys):
    checkpoint = str(tiny_run["checkpoint"])
    argv = ["--checkpoint", checkpoint, "--images", str(tiny_run["heldout"])]
    assert embed_script.main([*argv, "--out", str(tmp_path / "heldout.npz")]) == 0
    argv = ["--checkpoint", checkpoint, "--pairs", str(tiny_run["pairs"])]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "eval")]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    saved = json.loads((tiny_run["run"] / "summary.json").read_text())["threshold"]
    with np.load(tmp_path / "heldout.npz") as data:  # embed.py recorded the run's threshold
        assert (float(data["threshold"]), str(data["threshold_distance"])) == (
            saved["value"],
            saved["distance"],
        )
    gallery, probes = split_gallery_and_probes(tmp_path / "heldout.npz", tmp_path)
    capsys.readouterr()
    argv = ["--gallery", str(gallery), "--probes", str(probes), "--out", str(tmp_path / "id")]
    assert identify_script.main([*argv, "--metrics", str(tmp_path / "eval" / "metrics.json")]) == 0
    printed = capsys.readouterr().out
    assert "rank-1 accuracy" in printed and "open-set rejection rate" in printed
    result = json.loads((tmp_path / "id" / "identification.json").read_text())
    assert result["threshold"] == metrics["threshold"] == np.mean(metrics["best_thresholds"])
    # Brute force from the two files: nearest gallery row by squared distance.
    g, p = np.load(gallery), np.load(probes)
    d = ((p["embeddings"][:, None] - g["embeddings"][None]) ** 2).sum(-1)
    nearest, best = g["labels"][d.argmin(1)], d.min(1)
    known = np.isin(p["labels"], g["labels"])
    assert result["n_known"] == 25 and result["n_unknown"] == 30
    assert result["rank1"] == pytest.approx(np.mean(nearest[known] == p["labels"][known]))
    rejected = best[~known] >= metrics["threshold"]
    assert result["open_set_rejection"] == pytest.approx(np.mean(rejected))
    rows = (tmp_path / "id" / "matches.csv").read_text().splitlines()
    assert len(rows) == 1 + 55 and rows[0] == "path,label,identity,nearest,distance"


def test_identify_without_a_threshold_is_one_line(tmp_path, capsys):
    np.savez(tmp_path / "g.npz", embeddings=np.eye(2, dtype=np.float32), labels=["a", "b"])
    argv = ["--gallery", str(tmp_path / "g.npz"), "--probes", str(tmp_path / "g.npz")]
    assert identify_script.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: no threshold: give --threshold")
    assert identify_script.main([*argv, "--threshold", "0.5", "--out", str(tmp_path)]) == 0
    assert "2 probes: 2 matched, 0 unknown at threshold 0.5000" in capsys.readouterr().out
