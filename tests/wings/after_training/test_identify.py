"""Identification: hand-computed matches, brute force, thresholds, identify.py end to end."""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from pathlib import Path

import numpy as np
import pytest

from facenet.cli import embed as embed_script
from facenet.cli import evaluate as evaluate_script
from facenet.cli import identify as identify_script
from facenet.errors import DataError
from facenet.metric.distances import DISTANCE_NAMES
from facenet.wings.after_training.identify import (
    Gallery,
    identification_rates,
    match,
    read_threshold,
)
from facenet.wings.publishers.insightface_bin import BIN_PREPROCESS

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
    summary = {"threshold": {"value": 0.9, "distance": "euclidean", "epoch": 3, "flip": True}}
    (tmp_path / "s.json").write_text(json.dumps(summary))
    (tmp_path / "n.json").write_text(json.dumps({"accuracy_mean": 0.9}))
    old = read_threshold(tmp_path / "m.json")  # written before provenance: None where unknown
    assert (old.value, old.distance, old.weights_sha256, old.flip) == (1.1, "cosine", None, None)
    new = read_threshold(tmp_path / "s.json")
    assert (new.value, new.distance, new.epoch, new.flip) == (0.9, "euclidean", 3, True)
    assert read_threshold(tmp_path / "n.json") is None


AT_HAND = {
    "weights_sha256": "a" * 64,
    "flip": False,
    "subtract_mean": False,
    "preprocess": "resize",
}


def embedded(path: Path, flip=False, weights="a" * 64, preprocess="resize", **extra) -> Path:
    """A facenet-embed file of two enrolled identities, saying how it was made."""
    arrays = {
        "embeddings": np.eye(2, dtype=np.float32),
        "labels": np.array(["ann", "bob"]),
        "paths": np.array(["ann/1.png", "bob/1.png"]),
        "flip": np.array(flip),
        "preprocess": np.array(preprocess),
        "weights_sha256": np.array(weights),
    }
    arrays.update(extra)
    if weights is None:  # an older facenet-embed's file, or one written by hand
        del arrays["weights_sha256"]
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("weights_sha256", "b" * 64, "weights: chosen for bbbbbbbb"),
        ("flip", True, "flip: chosen with flip, here without"),
        ("subtract_mean", True, "mean subtraction: chosen with mean subtraction, here without"),
        ("preprocess", "crop", "preprocessing: chosen with 'crop', here 'resize'"),
        ("weights_sha256", None, "does not say which weights"),
        ("flip", None, "does not say which flip setting"),
        ("subtract_mean", None, "does not say which mean subtraction"),
        ("preprocess", None, "does not say which preprocessing"),
    ],
)
@pytest.mark.parametrize("stored_in", ["metrics.json", "summary.json", "gallery"])
def test_a_stored_threshold_for_anything_else_is_refused(
    tmp_path, capsys, field, value, says, stored_in
):
    """Every field a threshold was chosen for, differing or missing, in every place it is
    stored: one error line saying what differs, exit 2."""
    chosen = {**AT_HAND, field: value}
    chosen = {k: v for k, v in chosen.items() if v is not None}
    gallery = embedded(tmp_path / "g.npz")
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    if stored_in == "metrics.json":
        record = {"threshold": 0.5, "threshold_distance": "squared", "threshold_for": chosen}
        (tmp_path / "m.json").write_text(json.dumps(record))
        argv += ["--metrics", str(tmp_path / "m.json")]
    elif stored_in == "summary.json":
        record = {"threshold": {"value": 0.5, "distance": "squared", "epoch": 2, **chosen}}
        (tmp_path / "m.json").write_text(json.dumps(record))
        argv += ["--metrics", str(tmp_path / "m.json")]
    else:
        record = json.dumps({"threshold": 0.5, "threshold_distance": "squared", **chosen})
        embedded(gallery, threshold=0.5, threshold_record=record)
    assert identify_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the stored threshold 0.5000") and len(err.splitlines()) == 1
    assert says in err and "give --threshold" in err
    if stored_in != "gallery":  # not with --metrics: they contradict each other
        argv = argv[:-2]
    assert identify_script.main([*argv, "--threshold", "0.5"]) == 0  # the user's own: used


def test_a_matching_stored_threshold_is_used_and_named(tmp_path, capsys):
    gallery = embedded(tmp_path / "g.npz")
    record = {"threshold": 0.5, "threshold_distance": "squared", "threshold_for": AT_HAND}
    (tmp_path / "m.json").write_text(json.dumps(record))
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    argv.append("--overwrite")  # the second run replaces the first's results
    assert identify_script.main([*argv, "--metrics", str(tmp_path / "m.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("threshold: 0.5000 (squared distance; weights aaaaaaaa; no flip")
    # an older gallery file: a threshold without provenance is not used
    embedded(gallery, threshold=np.array(0.5), threshold_distance=np.array("squared"))
    assert identify_script.main(argv) == 2
    assert "does not say which weights" in capsys.readouterr().err


def test_the_sandberg_threshold_is_not_applied_to_raw_distances(tiny_run, tmp_path, capsys):
    """A threshold chosen on flipped, mean-subtracted distances (--preset sandberg's options)
    is refused for embeddings made without either."""
    checkpoint = str(tiny_run["checkpoint"])
    argv = ["--checkpoint", checkpoint, "--pairs", str(tiny_run["pairs"]), "--flip"]
    argv += ["--subtract-mean", "--distance", "angular", "--out", str(tmp_path / "eval")]
    assert evaluate_script.main(argv) == 0
    argv = ["--checkpoint", checkpoint, "--images", str(tiny_run["heldout"]), "--no-progress"]
    assert embed_script.main([*argv, "--out", str(tmp_path / "g.npz")]) == 0
    capsys.readouterr()
    argv = ["--gallery", str(tmp_path / "g.npz"), "--probes", str(tmp_path / "g.npz")]
    argv += ["--metrics", str(tmp_path / "eval" / "metrics.json"), "--out", str(tmp_path / "o")]
    assert identify_script.main(argv) == 2
    err = capsys.readouterr().err
    assert "flip: chosen with flip, here without" in err
    assert "mean subtraction: chosen with mean subtraction, here without" in err


@pytest.mark.parametrize("which", ["gallery", "probes"])
def test_non_finite_embeddings_are_refused_by_row_and_file(tmp_path, capsys, which):
    files = {"gallery": embedded(tmp_path / "g.npz"), "probes": embedded(tmp_path / "p.npz")}
    emb = np.eye(2, dtype=np.float32)
    emb[1, 0] = np.nan if which == "gallery" else np.inf
    embedded(files[which], embeddings=emb)
    argv = ["--gallery", str(files["gallery"]), "--probes", str(files["probes"])]
    assert identify_script.main([*argv, "--threshold", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert str(files[which]) in err and "rows 1 (bob/1.png)" in err and len(err.splitlines()) == 1
    with pytest.raises(DataError, match="NaN"):  # the library refuses them too
        Gallery(emb, ["a", "b"]) if which == "gallery" else match(
            Gallery(np.eye(2), ["a", "b"]), emb, 1.0
        )


@pytest.mark.parametrize(
    "arrays, says",
    [
        ({"labels": np.array(["a"])}, "no 'embeddings' array"),
        ({"embeddings": np.zeros(3, dtype=np.float32)}, "must be a (N, D) array"),
        ({"embeddings": np.array([["a", "b"]])}, "must be a (N, D) array"),
        ({"embeddings": np.zeros((2, 0), dtype=np.float32)}, "must be a (N, D) array"),
        ({"embeddings": np.eye(2), "paths": np.array(["x"])}, "1 paths for 2 embeddings"),
        ({"embeddings": np.eye(2), "paths": np.array([1, 2])}, "'paths' must be a (N,) array"),
        ({"embeddings": np.eye(2), "labels": np.array([["a", "b"]])}, "'labels' must be"),
        ({"embeddings": np.eye(2), "labels": np.array(["a"] * 3)}, "3 labels for 2 embeddings"),
        ({"embeddings": np.eye(2), "threshold": np.array([0.5, 1])}, "'threshold' must be"),
        ({"embeddings": np.eye(2), "flip": np.array("yes")}, "'flip' must be"),
        (
            {
                "embeddings": np.eye(2),
                "labels": np.array(["a", "b"]),
                "threshold_record": np.array("{"),
            },
            "not JSON",
        ),
    ],
)
def test_odd_npz_files_are_one_error_line(tmp_path, capsys, arrays, says):
    np.savez(tmp_path / "odd.npz", weights_sha256="a" * 64, **arrays)
    good = embedded(tmp_path / "good.npz")
    for gallery, probes in ((tmp_path / "odd.npz", good), (good, tmp_path / "odd.npz")):
        argv = ["--gallery", str(gallery), "--probes", str(probes), "--out", str(tmp_path / "o")]
        argv += [] if "threshold_record" in arrays and gallery != good else ["--threshold", "1"]
        if "threshold_record" in arrays and gallery == good:
            continue  # a probe file's threshold is not read
        assert identify_script.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1
        assert says in err and "odd.npz" in err


def test_a_npy_file_and_a_text_file_are_one_error_line(tmp_path, capsys):
    np.save(tmp_path / "plain.npy", np.eye(2))
    (tmp_path / "text.npz").write_text("hello")
    for name in ("plain.npy", "text.npz"):
        argv = ["--gallery", str(tmp_path / name), "--probes", str(tmp_path / name)]
        assert identify_script.main([*argv, "--threshold", "1", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"error: {tmp_path / name}: not an .npz") and len(err.splitlines()) == 1
        )


def test_gallery_and_probes_of_different_weights_or_flip_are_refused(tmp_path, capsys):
    gallery = embedded(tmp_path / "g.npz")
    for other in (
        embedded(tmp_path / "p.npz", weights="c" * 64),
        embedded(tmp_path / "f.npz", flip=True),
    ):
        argv = ["--gallery", str(gallery), "--probes", str(other), "--threshold", "1"]
        assert identify_script.main([*argv, "--out", str(tmp_path / "o")]) == 2
        assert "embed both the same way" in capsys.readouterr().err


@pytest.mark.parametrize("missing", [None, ""])  # no weights_sha256, or an empty one
@pytest.mark.parametrize("unverified", ["gallery", "probes", "both"])
def test_a_file_without_a_weights_hash_is_refused_unless_allowed(
    tmp_path, capsys, unverified, missing
):
    """A file that does not say which weights embedded it would match any gallery: refused in
    one line naming it, unless --allow-unverified."""
    files = {
        name: embedded(
            tmp_path / f"{name}.npz", weights=missing if unverified in (name, "both") else "a" * 64
        )
        for name in ("gallery", "probes")
    }
    argv = ["--gallery", str(files["gallery"]), "--probes", str(files["probes"])]
    argv += ["--threshold", "1", "--out", str(tmp_path / "o")]
    assert identify_script.main(argv) == 2
    err = capsys.readouterr().err
    named = "gallery" if unverified == "both" else unverified
    assert err.startswith(f"error: --{named} {files[named]} does not say which weights")
    assert "--allow-unverified" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()
    assert identify_script.main([*argv, "--allow-unverified"]) == 0
    assert "2 probes: 2 matched" in capsys.readouterr().out


def test_a_threshold_with_metrics_is_refused_as_a_contradiction(tmp_path, capsys):
    gallery = embedded(tmp_path / "g.npz")
    record = {"threshold": 0.5, "threshold_distance": "squared", "threshold_for": AT_HAND}
    (tmp_path / "m.json").write_text(json.dumps(record))
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    argv += ["--threshold", "1", "--metrics", str(tmp_path / "m.json")]
    assert identify_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err == "error: --threshold and --metrics contradict each other\n"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag", [["--threshold-at", "accuracy"], ["--set", "lfw"]])
def test_a_choice_among_stored_thresholds_beside_threshold_is_refused(tmp_path, capsys, flag):
    gallery = embedded(tmp_path / "g.npz")
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    assert identify_script.main([*argv, "--threshold", "1", *flag]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag[0]} goes with --metrics (the file whose threshold to take)\n"
    assert not (tmp_path / "o").exists()


def split_gallery_and_probes(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Half the identities enrolled with one image each; probes: their other images (known)
    and every image of the other half (not enrolled)."""
    with np.load(source) as data:
        emb, labels, paths = data["embeddings"], data["labels"], data["paths"]
        made = {key: data[key] for key in ("flip", "preprocess", "weights_sha256")}
    identities = sorted(set(labels.tolist()))
    enrolled = set(identities[: len(identities) // 2])
    first = {name: int(np.flatnonzero(labels == name)[0]) for name in enrolled}
    in_gallery = np.isin(np.arange(len(labels)), list(first.values()))
    files = {}
    for name, rows in (("gallery", in_gallery), ("probes", ~in_gallery)):
        files[name] = tmp_path / f"{name}.npz"
        np.savez(files[name], embeddings=emb[rows], labels=labels[rows], paths=paths[rows], **made)
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
    gallery = dict(embeddings=np.eye(2, dtype=np.float32), labels=["a", "b"])
    np.savez(tmp_path / "g.npz", **gallery, weights_sha256="a" * 64)
    argv = ["--gallery", str(tmp_path / "g.npz"), "--probes", str(tmp_path / "g.npz")]
    assert identify_script.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: no threshold: give --threshold")
    assert identify_script.main([*argv, "--threshold", "0.5", "--out", str(tmp_path)]) == 0
    assert "2 probes: 2 matched, 0 unknown at threshold 0.5000" in capsys.readouterr().out


def test_identify_takes_a_set_threshold_of_evaluate_bin(tmp_path, capsys):
    """A set's threshold, named with --set, for embeddings prepared as the set's images were
    (resized whole); a file written before records said "resize" for them: refused all the
    same for facenet-embed's resize-and-crop, naming both."""
    gallery = embedded(tmp_path / "g.npz", preprocess=BIN_PREPROCESS)
    sets = {
        name: {"threshold": t, "distance": "squared"} for name, t in (("lfw", 0.5), ("cfp", 0.7))
    }
    record = {"source": "m.pt", "threshold_for": AT_HAND, "sets": sets}
    (tmp_path / "m.json").write_text(json.dumps(record))
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    argv += ["--metrics", str(tmp_path / "m.json"), "--overwrite"]  # each run replaces the last
    assert identify_script.main([*argv, "--set", "cfp"]) == 0
    assert capsys.readouterr().out.startswith("threshold: 0.7000 (squared distance; weights aaaa")
    resized = embedded(tmp_path / "r.npz")
    both = ["--gallery", str(resized), "--probes", str(resized)]
    assert identify_script.main([*argv, "--set", "cfp", *both]) == 2
    err = capsys.readouterr().err
    assert "preprocessing: chosen with 'resize-whole', here 'resize'" in err
    assert len(err.splitlines()) == 1
    for wrong in ([], ["--set", "agedb"]):  # two sets: one must be named, and be one of them
        assert identify_script.main([*argv, *wrong]) == 2
        assert "name one of its sets (lfw, cfp) with --set" in capsys.readouterr().err
    (tmp_path / "m.json").write_text(json.dumps({**record, "sets": {"lfw": sets["lfw"]}}))
    assert read_threshold(tmp_path / "m.json").value == 0.5  # a lone set needs no name
    (tmp_path / "m.json").write_text(json.dumps({"threshold": 0.5, "threshold_for": AT_HAND}))
    with pytest.raises(DataError, match="holds no sets"):
        read_threshold(tmp_path / "m.json", "lfw")
    assert identify_script.main([*argv[:6], "--overwrite", "--threshold", "1"]) == 0  # own
    # a set to choose among stored thresholds beside one's own: refused, not ignored
    assert identify_script.main([*argv[:6], "--overwrite", "--set", "lfw", "--threshold", "1"]) == 2


def declaring(path: Path, shape: tuple) -> Path:
    """An .npz of a few bytes whose 'embeddings' header declares ``shape`` float32."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": shape}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("embeddings.npy", header.getvalue() + b"\0" * 64)
    return path


@pytest.mark.parametrize("where", ["--metrics", "--gallery", "--probes"])
@pytest.mark.parametrize("hostile", ["FIFO", "deep JSON", "declared terabyte", "folder"])
def test_hostile_files_given_to_identify_are_one_line_errors(tmp_path, capsys, where, hostile):
    """A FIFO (it would block on open), JSON nested past the recursion limit, an .npz whose
    header declares a terabyte, a folder: refused in one line naming the file, exit 2."""
    files = {"--gallery": tmp_path / "g.npz", "--probes": tmp_path / "p.npz"}
    files = {key: embedded(path) for key, path in files.items()}
    files["--metrics"] = tmp_path / "m.json"
    files[where].unlink(missing_ok=True)
    if hostile == "FIFO":
        os.mkfifo(files[where])
    elif hostile == "deep JSON":
        files[where].write_text("[" * 100_000 + "]" * 100_000)
    elif hostile == "folder":
        files[where].mkdir()
    else:
        declaring(files[where], (2**40, 512))
    if where != "--metrics":
        files["--metrics"].write_text(json.dumps({"threshold": 0.5, "threshold_for": AT_HAND}))
    argv = [text for key, path in files.items() for text in (key, str(path))]
    assert identify_script.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {files[where]}: ") and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_gallery_threshold_record_nested_past_the_recursion_limit_is_refused(tmp_path, capsys):
    gallery = embedded(tmp_path / "g.npz", threshold_record=np.array("[" * 10**5 + "]" * 10**5))
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    assert identify_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {gallery}: 'threshold_record' is not JSON")


@pytest.mark.parametrize(
    "record",
    [
        {"threshold": 0.5, "threshold_for": [1, 2]},  # provenance not a mapping
        {"threshold": 0.5, "threshold_for": "aaaa"},
        {"threshold": float("nan"), "threshold_for": AT_HAND},  # json.dumps writes NaN
        {"threshold": float("inf"), "threshold_for": AT_HAND},
        {"threshold": "0.5", "threshold_for": AT_HAND},
        {"threshold": True, "threshold_for": AT_HAND},
        {"threshold": 10**400, "threshold_for": AT_HAND},  # float() would overflow
        {"sets": {"lfw": [0.5]}, "threshold_for": AT_HAND},
        [0.5],
    ],
)
def test_malformed_threshold_records_are_one_line_errors(tmp_path, capsys, record):
    gallery = embedded(tmp_path / "g.npz")
    (tmp_path / "m.json").write_text(json.dumps(record))
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    assert identify_script.main([*argv, "--metrics", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{tmp_path / 'm.json'}" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("distance", DISTANCE_NAMES)
def test_a_threshold_outside_the_distance_range_on_unit_embeddings_is_refused(distance):
    """The range ends are reached (antipodal unit embeddings); past them, or NaN, a threshold
    would accept every probe or none: one line naming it."""
    unit = np.array([[1.0, 0.0]])  # (1, 2)
    gallery = Gallery(-unit, ["ann"])
    largest = float(match(gallery, unit, 1.0, distance).distance[0])  # the antipode's distance
    assert match(gallery, unit, largest, distance).identity == [None]
    for outside in (-0.5, largest + 1e-3, float("nan"), float("inf")):
        with pytest.raises(DataError, match=f"threshold {outside!r} is not a number in \\[0, "):
            match(gallery, unit, outside, distance)


@pytest.mark.parametrize(
    "given, says",
    [
        (["--threshold", "-1"], "-1.0 is not a number in [0, 4], the squared distance's range"),
        (["--threshold", "5", "--distance", "cosine"], "5.0 is not a number in [0, 2], the cosine"),
        (["--threshold", "nan"], "nan is not a number in [0, 4]"),
    ],
)
def test_identify_and_embed_refuse_a_threshold_no_distance_reaches(tmp_path, capsys, given, says):
    gallery = embedded(tmp_path / "g.npz")
    argv = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "o")]
    assert identify_script.main([*argv, *given]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --threshold {says}") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "o").exists()
    parsed = embed_script.get_args_parser().parse_args(
        ["--checkpoint", "c", "--images", "i", "--out", "o.npz", *given]
    )
    with pytest.raises(DataError, match=re.escape(f"--threshold {says}")):
        embed_script.flag_threshold(parsed)
