"""Deployable thresholds against a brute-force loop over the grids and a hand-computed case."""

from __future__ import annotations

import json
import pickle
from argparse import Namespace

import numpy as np
import pytest
import torch
from torchvision.io import encode_png

from facenet.cli import embed, evaluate, identify
from facenet.cli.embed import model_threshold
from facenet.data.folder import list_images
from facenet.data.images import read_image
from facenet.data.pairs import read_pairs
from facenet.errors import DataError
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_verification, threshold_grids
from facenet.evaluation.verify import verify
from facenet.wings.after_training.identify import read_threshold
from facenet.wings.after_training.loading import load_model
from facenet.wings.after_training.thresholds import deployable_thresholds, far_key
from facenet.wings.publishers.insightface_bin import BIN_PREPROCESS, read_bin

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


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


# --------------------------------------------------------------------------- the commands


def test_evaluate_writes_them_beside_the_protocols_threshold(tmp_path, capsys):
    rng = np.random.default_rng(11)
    same = np.tile(np.r_[np.ones(20, bool), np.zeros(20, bool)], 4)
    d = np.clip(rng.normal(np.where(same, 1.0, 1.8), 0.4), 0, None)
    np.savez(tmp_path / "d.npz", distances=d, issame=same)
    argv = ["--distances", str(tmp_path / "d.npz"), "--folds", "4", "--out", str(tmp_path / "o")]
    assert evaluate.main(argv) == 0
    metrics = json.loads((tmp_path / "o" / "metrics.json").read_text())
    settings = VerifySettings(n_folds=4)
    assert metrics["deployable_thresholds"] == deployable_thresholds(d, same, settings)
    assert metrics["threshold"] == evaluate_verification(d, same, settings).threshold
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("deployable")]
    assert [x.split()[1] for x in lines] == ["accuracy", "far_1e-3", "far_1e-4"]


def test_a_checkpoints_thresholds_go_to_embed_and_identify(tiny_run, tmp_path, capsys):
    checkpoint, pairs = str(tiny_run["checkpoint"]), tiny_run["pairs"]
    out = tmp_path / "eval"
    argv = ["--checkpoint", checkpoint, "--pairs", str(pairs)]  # in the file's own folds
    # with mean subtraction: the protocol's threshold applies to no plain embedding, the
    # deployable ones (measured without it) do
    assert evaluate.main([*argv, "--subtract-mean", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    trained, pair_list = load_model(checkpoint), read_pairs(pairs)
    settings = VerifySettings(n_folds=pair_list.n_folds, subtract_mean=True)
    _, d = verify(trained.model, pair_list, trained.image_size, settings, return_distances=True)
    want = deployable_thresholds(d, pair_list.issame, settings, pair_list.fold_ids)
    assert metrics["deployable_thresholds"] == {**want, "subtract_mean": False}
    gallery = tmp_path / "gallery.npz"
    embed_argv = ["--checkpoint", checkpoint, "--images", str(tiny_run["heldout"]), "--no-progress"]
    metrics_at = ["--metrics", str(out / "metrics.json"), "--threshold-at", "far_1e-3"]
    assert embed.main([*embed_argv, *metrics_at, "--out", str(gallery)]) == 0
    recorded = json.loads(str(np.load(gallery)["threshold_record"]))
    assert recorded["threshold"] == want["far_1e-3"]["threshold"]
    assert recorded["chosen_on"] == "far_1e-3 over all pairs"
    ident = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "id")]
    assert identify.main([*ident, *metrics_at[:2], "--threshold-at", "accuracy"]) == 0
    written = json.loads((tmp_path / "id" / "identification.json").read_text())
    assert written["threshold"] == want["accuracy"]["threshold"]
    capsys.readouterr()
    # the protocol's own threshold was chosen with mean subtraction: refused, in one line
    assert identify.main([*ident, *metrics_at[:2], "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "mean subtraction" in err and len(err.splitlines()) == 1


def write_metrics(path, threshold_for) -> str:
    record = {
        "threshold": 0.5,
        "threshold_distance": "squared",
        "threshold_for": threshold_for,
        "deployable_thresholds": {"subtract_mean": False, "far_1e-3": {"threshold": 0.7}},
    }
    path.write_text(json.dumps(record))
    return str(path)


def test_identify_refuses_what_does_not_fit_in_one_line(tmp_path, capsys):
    digest = "ab" * 32
    made = {"weights_sha256": digest, "flip": False, "preprocess": "resize"}
    np.savez(tmp_path / "g.npz", embeddings=np.eye(2, dtype=np.float32), labels=["a", "b"], **made)
    ident = ["--gallery", str(tmp_path / "g.npz"), "--probes", str(tmp_path / "g.npz")]
    ident += ["--out", str(tmp_path / "id"), "--overwrite"]
    fits = write_metrics(tmp_path / "m.json", {**made, "subtract_mean": True})
    assert identify.main([*ident, "--metrics", fits, "--threshold-at", "far_1e-3"]) == 0
    assert json.loads((tmp_path / "id" / "identification.json").read_text())["threshold"] == 0.7
    other = write_metrics(tmp_path / "o.json", {**made, "weights_sha256": "cd" * 32})
    cases = [
        (["--threshold-at", "far_1e-3"], "--threshold-at goes with --metrics"),
        (
            ["--metrics", fits, "--threshold-at", "far_1e-4"],
            "no deployable threshold 'far_1e-4'; it holds far_1e-3",
        ),
        (["--metrics", other, "--threshold-at", "far_1e-3"], "weights: chosen for cdcdcdcd"),
        (["--metrics", fits], "mean subtraction"),
    ]
    capsys.readouterr()
    for extra, message in cases:
        assert identify.main([*ident, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err


def test_embed_takes_a_metrics_threshold_only_alone():
    at_hand = {"weights_sha256": "ab" * 32, "epoch": 1, "flip": False, "subtract_mean": False}
    at_hand |= {"preprocess": "resize", "features": "unit"}
    none = dict(threshold=None, no_threshold=False, distance=None, set_name=None)
    with pytest.raises(DataError, match="--threshold and --metrics contradict"):
        model_threshold(
            None,
            at_hand,
            Namespace(**{**none, "threshold": 0.5}, metrics="m.json", threshold_at=None),
        )
    with pytest.raises(DataError, match="--threshold-at goes with --metrics"):
        model_threshold(None, at_hand, Namespace(**none, metrics=None, threshold_at="far_1e-3"))


def write_mini_bin(heldout, path) -> None:
    """A .bin of held-out faces: (encoded images, issame), pair i is images 2i and 2i + 1."""
    paths, labels = list_images(heldout)
    by_id = [[p for p, lab in zip(paths, labels) if lab == name] for name in sorted(set(labels))]
    images, issame = [], []
    for i in range(20):  # alternating: same (two images of one identity), different
        a, b = by_id[i % len(by_id)], by_id[(i + 1) % len(by_id)]
        pair = (a[0], a[1]) if i % 2 == 0 else (a[0], b[0])
        images += [encode_png(read_image(path)).numpy().tobytes() for path in pair]
        issame.append(i % 2 == 0)
    path.write_bytes(pickle.dumps((images, issame)))


def test_each_bin_set_gets_its_own(tiny_run, tmp_path):
    write_mini_bin(tiny_run["heldout"], tmp_path / "mini.bin")
    out = tmp_path / "out"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--bin", str(tmp_path / "mini.bin")]
    assert evaluate.main([*argv, "--folds", "2", "--out", str(out)]) == 0
    got = json.loads((out / "metrics.json").read_text())["sets"]["mini"]["deployable_thresholds"]
    trained, settings = load_model(tiny_run["checkpoint"]), VerifySettings(n_folds=2)
    pairs = read_bin(tmp_path / "mini.bin", 2)
    _, d = verify(trained.model, pairs, trained.image_size, settings, return_distances=True)
    assert got == {**deployable_thresholds(d, pairs.issame, settings), "subtract_mean": False}
    record = read_threshold(out / "metrics.json", "mini", "far_1e-4")
    assert record.value == got["far_1e-4"]["threshold"] and record.subtract_mean is False


def test_a_bin_sets_threshold_names_its_own_preparation(tiny_run, tmp_path, capsys):
    """A .bin set's faces are resized whole, not resized and cropped as facenet-embed prepares
    a folder: its thresholds say so (whatever --preprocess), and facenet-embed and
    facenet-identify refuse them for a folder's embeddings in one line naming both."""
    write_mini_bin(tiny_run["heldout"], tmp_path / "mini.bin")
    checkpoint = str(tiny_run["checkpoint"])
    argv = ["--checkpoint", checkpoint, "--bin", str(tmp_path / "mini.bin"), "--folds", "2"]
    for preprocess in ("resize", "crop"):
        out = tmp_path / preprocess
        assert evaluate.main([*argv, "--preprocess", preprocess, "--out", str(out)]) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["threshold_for"]["preprocess"] == BIN_PREPROCESS == "resize-whole"
    metrics_at = ["--metrics", str(tmp_path / "resize" / "metrics.json"), "--threshold-at"]
    embed_argv = ["--checkpoint", checkpoint, "--images", str(tiny_run["heldout"]), "--no-progress"]
    gallery = tmp_path / "gallery.npz"
    capsys.readouterr()
    assert embed.main([*embed_argv, *metrics_at, "far_1e-3", "--out", str(tmp_path / "x")]) == 2
    assert "preprocessing: chosen with 'resize-whole', here 'resize'" in capsys.readouterr().err
    assert embed.main([*embed_argv, "--no-threshold", "--out", str(gallery)]) == 0
    ident = ["--gallery", str(gallery), "--probes", str(gallery), "--out", str(tmp_path / "id")]
    for at in ([], [*metrics_at, "accuracy"]):
        capsys.readouterr()
        assert identify.main([*ident, *(at or metrics_at[:2])]) == 2
        err = capsys.readouterr().err
        assert "preprocessing: chosen with 'resize-whole', here 'resize'" in err
        assert err.startswith("error: the stored threshold") and len(err.splitlines()) == 1
