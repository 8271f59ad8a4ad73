"""The publishers' evaluation presets: the angular metric and the classic grids, held against
our own loop re-implementation of davidsandberg/facenet's lfw.evaluate
(benchmarks/reference_evaluation.py), and the evaluate.py preset options; the settings checking
their own values."""

import argparse
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import publisher_evaluation_reference as ref  # tests/ is on the path (pyproject.toml)
import pytest

from facenet.cli import evaluate as evaluate_script
from facenet.errors import DataError, FacenetError
from facenet.evaluation import protocol
from facenet.evaluation.presets import (
    CLASSIC,
    EVAL_PRESETS,
    MAX_BATCH_SIZE,
    PUBLISHER_FIELDS,
    SettingsError,
    classic_thresholds,
    flag_for,
    mobilefacenet_thresholds,
)
from facenet.evaluation.presets import VerifySettings as S
from facenet.evaluation.protocol import (
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)
from facenet.wings.after_training.identify import Gallery, match
from facenet.wings.align.presets import ALIGN_PRESETS, TEMPLATES

ROOT = Path(__file__).resolve().parents[2]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def synthetic_pairs(n_pairs=6000, dim=128, noise=0.18, seed=0):
    """(emb1, emb2, issame): LFW-like, ten folds of N/20 same then N/20 different pairs; each
    side is an identity centre plus noise of norm about noise x 8, on the unit sphere."""
    rng = np.random.default_rng(seed)
    issame = np.tile(np.repeat([True, False], n_pairs // 20), 10)
    c1 = _unit(rng.standard_normal((n_pairs, dim)))
    c2 = np.where(issame[:, None], c1, _unit(rng.standard_normal((n_pairs, dim))))
    scale = noise * 8 / np.sqrt(dim)
    e1 = _unit(c1 + scale * rng.standard_normal((n_pairs, dim)))
    e2 = _unit(c2 + scale * rng.standard_normal((n_pairs, dim)))
    return e1, e2, issame


def test_angular_distance_hand_computed():
    # 0, 60, 90 and 180 degrees apart: arccos(cos) / pi = 0, 1/3, 1/2, 1; scale does not matter.
    a = np.array([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    b = np.array([[3.0, 0.0], [1.0, np.sqrt(3.0)], [0.0, 5.0], [-1.0, 0.0]])
    got = pair_distances(a, b, metric="angular")
    assert np.allclose(got, [0.0, 1 / 3, 0.5, 1.0], atol=1e-12)


def test_angular_of_identical_embeddings_is_zero_not_nan():
    # The rounded similarity of x with itself can exceed 1; the publisher's arccos gives NaN.
    x = _unit(np.random.default_rng(3).standard_normal((200, 128)))
    assert np.all(np.isfinite(pair_distances(x, x, metric="angular")))
    assert np.allclose(pair_distances(x, x, metric="angular"), 0.0, atol=1e-6)


def test_angular_default_grid_spans_zero_to_one_with_the_classic_step_count():
    assert len(default_thresholds("angular")) == len(default_thresholds("squared")) == 400
    assert default_thresholds("angular")[-1] < 1.0 <= default_thresholds("angular")[-1] + 0.0025
    assert np.array_equal(classic_thresholds(), np.arange(0, 4, 0.01))
    assert np.array_equal(classic_thresholds(fine=True), np.arange(0, 4, 0.001))


@pytest.mark.parametrize("subtract_mean", [False, True])
@pytest.mark.parametrize("flip", [False, True])
def test_sandberg_preset_equals_the_publishers_computation(flip, subtract_mean):
    e1, e2, same = synthetic_pairs(n_pairs=1800, noise=0.18)
    if flip:  # a flip-concatenated (N, 2D) embedding, as validate_on_lfw builds it
        f1, f2, _ = synthetic_pairs(n_pairs=1800, noise=0.18, seed=1)
        e1, e2 = np.hstack([e1, f1]), np.hstack([e2, f2])
    interleaved = np.empty((2 * len(e1), e1.shape[1]))
    interleaved[0::2], interleaved[1::2] = e1, e2
    tpr, fpr, acc, val, val_std, far = ref.publisher_evaluate(
        interleaved, same, distance_metric="angular", subtract_mean=subtract_mean
    )
    preset = EVAL_PRESETS["sandberg"]
    settings = S(distance=preset.distance, subtract_mean=subtract_mean, grid=preset.grid)
    ours = evaluate_embeddings(e1, e2, same, settings)
    assert np.array_equal(ours.thresholds, classic_thresholds())
    assert np.array_equal(ours.accuracy, acc)
    assert np.allclose(ours.tpr, tpr, atol=1e-12) and np.allclose(ours.fpr, fpr, atol=1e-12)
    assert ours.val == pytest.approx(val, abs=1e-12)
    assert ours.val_std == pytest.approx(val_std, abs=1e-12)
    assert ours.far == pytest.approx(far, abs=1e-12)


def test_cosine_on_our_grid_differs_from_the_publishers_angular_figure():
    # The two cosine distances rank pairs alike; where the fixed grid's thresholds fall does not.
    e1, e2, same = synthetic_pairs()
    interleaved = np.empty((2 * len(e1), e1.shape[1]))
    interleaved[0::2], interleaved[1::2] = e1, e2
    _, _, acc, *_ = ref.publisher_evaluate(interleaved, same, distance_metric="angular")
    grids = (classic_thresholds(), classic_thresholds(True))
    angular = evaluate_embeddings(e1, e2, same, S(distance="angular"), None, grids)
    cosine = evaluate_embeddings(e1, e2, same, S(distance="cosine"))
    assert angular.accuracy_mean == pytest.approx(0.97200, abs=1e-9) == np.mean(acc)
    assert cosine.accuracy_mean == pytest.approx(0.97417, abs=1e-5)


def test_presets_hold_the_publishers_settings():
    assert EVAL_PRESETS["sandberg"].distance == "angular"
    assert EVAL_PRESETS["sandberg"].flip and EVAL_PRESETS["sandberg"].subtract_mean
    assert EVAL_PRESETS["facenet-pytorch"].distance == "squared"
    assert not EVAL_PRESETS["facenet-pytorch"].flip
    assert {p.preprocess for p in EVAL_PRESETS.values()} == {"crop"}
    assert EVAL_PRESETS["sandberg"].grid == EVAL_PRESETS["facenet-pytorch"].grid == "classic"
    mobilefacenet = EVAL_PRESETS["mobilefacenet"]
    assert (mobilefacenet.distance, mobilefacenet.flip, mobilefacenet.subtract_mean) == (
        "cosine",
        True,
        True,
    )
    assert (mobilefacenet.grid, mobilefacenet.features) == ("mobilefacenet", "raw")
    assert (mobilefacenet.threshold_rule, mobilefacenet.scoring) == ("mean", "mobilefacenet")
    for name in ("sandberg", "facenet-pytorch"):  # the classic rule, features and distances
        preset = EVAL_PRESETS[name]
        assert (preset.features, preset.threshold_rule, preset.scoring) == (
            "unit",
            "first",
            "float64",
        )
    # sandberg's LFW convention (his wiki's align_dataset_mtcnn.py call), not his training one
    assert (ALIGN_PRESETS["facenet-pytorch"].image_size, ALIGN_PRESETS["sandberg"].image_size) == (
        160,
        160,
    )
    assert (ALIGN_PRESETS["facenet-pytorch"].margin, ALIGN_PRESETS["sandberg"].margin) == (14, 32)


def test_evaluate_script_preset_sets_the_options_and_flags_still_win(tmp_path):
    args = evaluate_script._parse(["--distances", "x.npz", "--preset", "sandberg"])
    assert (args.distance, args.flip, args.subtract_mean) == ("angular", True, True)
    assert (args.preprocess, args.grid) == ("crop", "classic")
    args = evaluate_script._parse(
        ["--distances", "x.npz", "--preset", "sandberg", "--grid", "default"]
    )
    assert args.grid == "default"


def test_evaluate_script_distances_mode_with_the_classic_grid(tmp_path, capsys):
    e1, e2, same = synthetic_pairs(n_pairs=600)
    np.savez(tmp_path / "d.npz", distances=pair_distances(e1, e2, "angular"), issame=same)
    argv = ["--distances", str(tmp_path / "d.npz"), "--distance", "angular", "--out"]
    assert evaluate_script.main([*argv, str(tmp_path / "out"), "--grid", "classic"]) == 0
    interleaved = np.empty((2 * len(e1), e1.shape[1]))
    interleaved[0::2], interleaved[1::2] = e1, e2
    _, _, acc, *_ = ref.publisher_evaluate(interleaved, same, distance_metric="angular")
    assert f"d.npz acc {np.mean(acc):.4f}±{np.std(acc):.4f} VAL " in capsys.readouterr().out


def test_identify_matches_with_the_angular_threshold_a_sandberg_evaluation_writes():
    # Nearest by angle = nearest by cosine; the distance reported is arccos(cos) / pi.
    gallery = Gallery(np.array([[1.0, 0.0], [0.0, 1.0]]), ["a", "b"])
    probes = np.array([[1.0, np.sqrt(3.0)], [1.0, 0.1]])  # 60 deg from "a", 30 from "b"; ~6 deg
    got = match(gallery, probes, threshold=0.1, distance="angular")
    assert got.nearest == ["b", "a"] and got.identity == [None, "a"]
    assert np.allclose(got.distance, [1 / 6, np.arctan(0.1) / np.pi], atol=1e-6)


@pytest.mark.parametrize(
    "name, config",
    [
        ("facenet-pytorch", "lfw_facenet_pytorch.yaml"),
        ("sandberg", "lfw_sandberg.yaml"),
        ("mobilefacenet", "lfw_mobilefacenet.yaml"),
    ],
)
def test_lfw_configs_hold_the_publishers_presets(name, config):
    defaults = evaluate_script.config_defaults(str(ROOT / "configs" / config))
    preset = EVAL_PRESETS[name]
    assert {key: defaults[key] for key in PUBLISHER_FIELDS} == {
        key: getattr(preset, key) for key in PUBLISHER_FIELDS
    }


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("distance", "manhattan", "valid options: squared, euclidean, cosine, angular, seed_l2"),
        ("preprocess", "stretch", "valid options: resize, crop"),
        ("grid", "fine", "valid options: default, classic, mobilefacenet"),
        ("features", "logits", "valid options: unit, raw"),
        ("threshold_rule", "median", "valid options: first, mean"),
        ("scoring", "float32", "valid options: float64, mobilefacenet"),
        ("n_folds", 1, "expected an integer >= 2"),
        ("n_folds", 2.5, "expected an integer >= 2"),
        ("n_folds", True, "expected an integer >= 2"),
        ("batch_size", 0, "expected an integer >= 1"),
        ("batch_size", 10**12, "expected <= 2147483647"),
        ("num_workers", -1, "expected an integer >= 0"),
        ("far_target", 0.0, "must lie in (0, 1]"),
        ("far_target", 1.5, "must lie in (0, 1]"),
        ("far_target", float("nan"), "must lie in (0, 1]"),
        ("far_target", "0.1", "must lie in (0, 1]"),
        ("flip", "no", "expected true or false"),
        ("subtract_mean", 1, "expected true or false"),
        ("skip_missing", None, "expected true or false"),
    ],
)
def test_each_setting_is_refused_when_made_naming_its_field(field, value, problem):
    with pytest.raises(SettingsError) as caught:
        S(**{field: value})
    err = caught.value
    assert (err.field, err.problem) == (field, problem) and err.value is value
    assert str(err) == f"{field}={value!r}: {problem}"
    # a user's mistake: one line from a command, and still the ValueError callers caught
    assert isinstance(err, FacenetError) and isinstance(err, ValueError)
    with pytest.raises(SettingsError, match=f"^{field}="):  # replace() checks again
        replace(CLASSIC, **{field: value})


def test_a_scoring_is_refused_with_another_distance_than_the_one_it_measures():
    with pytest.raises(SettingsError, match="measures cosine distances, not 'squared'") as caught:
        S(scoring="mobilefacenet")
    assert caught.value.field == "scoring"
    assert S("cosine", scoring="mobilefacenet").scoring == "mobilefacenet"


def test_the_least_and_most_each_setting_takes_are_accepted():
    edges = S(n_folds=np.int64(2), far_target=1, batch_size=1, num_workers=0, flip=np.True_)
    assert (edges.n_folds, edges.far_target) == (2, 1)
    assert S(batch_size=MAX_BATCH_SIZE).batch_size == 2**31 - 1
    assert S(far_target=1e-12).far_target == 1e-12


def test_a_settings_error_names_the_flag_or_key_the_user_typed():
    with pytest.raises(SettingsError) as caught:
        S.of(argparse.Namespace(n_folds=1, distance="squared"))
    err = caught.value
    assert err.named(flag_for(err.field)) == "--folds: 1: expected an integer >= 2"
    assert err.named(f"eval.{err.field}") == "eval.n_folds: 1: expected an integer >= 2"
    line = ["--checkpoint", "m.pt", "--pairs", "p.txt", "--batch-size", str(10**12)]
    with pytest.raises(DataError, match="^--batch-size: 1000000000000: expected <= 2147483647$"):
        evaluate_script._parse(line)
    assert flag_for("far_target") == "--far-target" and flag_for("grid") == "--grid"
    # every field facenet-evaluate has a flag for: the flag flag_for names
    flags = {a.dest: a.option_strings for a in evaluate_script.get_args_parser()._actions}
    mapped = [f.name for f in fields(S) if f.name in flags]
    assert {"n_folds", "far_target", "threshold_rule", "batch_size"} <= set(mapped)
    for name in mapped:
        assert flag_for(name) in flags[name], name


# --------------------------------------------------------------------------- MobileFaceNet's


def raw_flip_features(n_pairs=1800, noise=0.22, seed=0):
    """(fl, fr, issame): flip-concatenated (N, 256) features whose halves have norms of 2-3,
    as the publisher's network outputs them (not normalised), LFW-like folds."""
    rng = np.random.default_rng(seed + 100)
    halves = [synthetic_pairs(n_pairs, noise=noise, seed=s) for s in (seed, seed + 1)]
    same = halves[0][2]
    sides = [
        np.hstack([h[side] * rng.uniform(2, 3, (n_pairs, 1)) for h in halves]) for side in (0, 1)
    ]
    return sides[0], sides[1], same


def test_mobilefacenet_grid_is_the_publishers_similarity_grid():
    grid = mobilefacenet_thresholds()
    assert len(grid) == 20001 and grid[0] == 0.0 and grid[-1] == 2.0
    assert np.all(np.diff(grid) > 0)
    assert np.allclose(1.0 - grid[::-1], np.arange(-10000, 10001) / 10000, atol=1e-15, rtol=0)


def test_mobilefacenet_preset_measures_the_publishers_scores():
    fl, fr, same = raw_flip_features()
    fold = np.arange(len(same)) // (len(same) // 10)  # its i // 600 for LFW's 6000 pairs
    preset = EVAL_PRESETS["mobilefacenet"]
    settings = S(preset.distance, subtract_mean=preset.subtract_mean)
    ours = protocol._distances(fl, fr, fold, settings)[fold, np.arange(len(fold))]
    for i in range(10):  # each pair under its own test fold's training mean
        scores = ref.mobilefacenet_fold_scores(fl, fr, fold, i)
        np.testing.assert_allclose(1.0 - ours[fold == i], scores[fold == i], atol=1e-12, rtol=0)


def mobilefacenet_preset_evaluation(fl, fr, same, folds=None):
    """``evaluate_embeddings`` with every option of the mobilefacenet preset."""
    return evaluate_embeddings(fl, fr, same, EVAL_PRESETS["mobilefacenet"], folds)


@pytest.mark.parametrize("seed", [0, 1])
def test_mobilefacenet_preset_equals_the_publishers_loop_fold_by_fold(seed):
    # float32 features, as its network and its .mat file give them to evaluation_10_fold
    fl, fr, same = raw_flip_features(seed=seed)
    fl, fr = fl.astype(np.float32), fr.astype(np.float32)
    fold = np.arange(len(same)) // (len(same) // 10)  # its i // 600 for LFW's 6000 pairs
    acc, thresholds = ref.mobilefacenet_evaluate(fl, fr, fold, np.where(same, 1, -1))
    ours = mobilefacenet_preset_evaluation(fl, fr, same)
    assert np.array_equal(ours.accuracy, acc)  # every fold, pair for pair
    # its similarity thresholds; ours the same grid points as cosine distances, then averaged
    np.testing.assert_allclose(ours.best_thresholds, 1.0 - thresholds, atol=1e-12, rtol=0)
    assert ours.accuracy_mean == np.mean(acc)


def test_the_first_rule_equals_the_loop_taking_the_first_best_threshold():
    # The classic rule on the publisher's grid and scores: the loop's "first" variant.
    fl, fr, same = raw_flip_features()
    fold = np.arange(len(same)) // (len(same) // 10)
    grid = mobilefacenet_thresholds()
    ours = evaluate_embeddings(fl, fr, same, S("cosine", subtract_mean=True), None, (grid, grid))
    acc, thresholds = ref.mobilefacenet_evaluate(fl, fr, fold, np.where(same, 1, -1), rule="first")
    assert np.array_equal(ours.accuracy, acc)
    np.testing.assert_allclose(ours.best_thresholds, 1.0 - thresholds, atol=1e-12, rtol=0)


def test_the_mean_rule_counts_a_pair_at_the_threshold_wrong_for_either_kind():
    # Similarities on grid points (0.25, 0.5, 0.75 are exact in both domains): per fold one
    # positive at 0.75, one negative at 0.25, and one pair of each kind exactly at 0.5.
    scores = np.tile([0.75, 0.5, 0.25, 0.5], 10)
    same = np.tile([True, True, False, False], 10)
    fold = np.repeat(np.arange(10), 4)
    grid = mobilefacenet_thresholds()
    ours = evaluate_verification(
        1.0 - scores, same, S("cosine", threshold_rule="mean"), None, (grid, grid)
    )
    flags = np.where(same, 1, -1)
    expected = [
        ref.mobilefacenet_get_threshold(scores[fold != i], flags[fold != i]) for i in range(10)
    ]
    np.testing.assert_allclose(ours.best_thresholds, 1.0 - np.array(expected), atol=1e-12)
    # its best thresholds: (0.25, 0.5) and (0.5, 0.75) open intervals tie (3 of 4 right), so
    # the mean lands on 0.5 exactly, where both pairs at 0.5 are wrong: 2 of 4 right.
    assert np.allclose(expected, 0.5) and np.array_equal(ours.accuracy, np.full(10, 0.5))
    classic = evaluate_verification(1.0 - scores, same, S("cosine"), None, (grid, grid))
    assert np.all(classic.accuracy == 0.75)  # the first best threshold: 0.5 counts "different"


def test_evaluate_script_mobilefacenet_preset():
    args = evaluate_script._parse(["--distances", "x.npz", "--preset", "mobilefacenet"])
    assert (args.distance, args.flip, args.subtract_mean) == ("cosine", True, True)
    assert (args.preprocess, args.grid) == ("crop", "mobilefacenet")
    assert (args.features, args.threshold_rule, args.scoring) == ("raw", "mean", "mobilefacenet")
    args = evaluate_script._parse(
        ["--distances", "x.npz", "--preset", "mobilefacenet", "--threshold-rule", "first"]
    )
    assert args.threshold_rule == "first"


# --------------------------------------------------------------------------- end to end


def fake_lfw(root: Path, per_fold: int = 2, seed: int = 0) -> Path:
    """An LFW-layout folder of random 112 x 96 RGB PNGs and its pairs.txt: ten folds of
    ``per_fold`` same then ``per_fold`` different pairs, 4 images of each of 8 identities."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    names = [f"Person_{k}" for k in range(8)]
    for name in names:
        (root / name).mkdir(parents=True)
        for idx in range(1, 5):
            pixels = rng.integers(0, 256, (112, 96, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{name}_{idx:04d}.png")
    lines = [f"10\t{per_fold}"]
    for _ in range(10):
        for _ in range(per_fold):
            name = names[rng.integers(8)]
            i, j = rng.choice(np.arange(1, 5), 2, replace=False)
            lines.append(f"{name}\t{i}\t{j}")
        for _ in range(per_fold):
            a, b = rng.choice(8, 2, replace=False)
            lines.append(f"{names[a]}\t{rng.integers(1, 5)}\t{names[b]}\t{rng.integers(1, 5)}")
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    return root / "pairs.txt"


def publisher_features(net, paths):
    """(N, 256) float32 features as lfw_eval.py's getFeatureFromTorch builds them: its LFW
    loader's (x - 127.5) / 128 in float64 on the RGB image and on its horizontal flip, each
    cast to float32, the network's raw outputs of both concatenated."""
    import torch
    from PIL import Image

    features = []
    for path in paths:
        image = np.asarray(Image.open(path).convert("RGB"))
        views = [image, image[:, ::-1, :]]
        views = [torch.from_numpy(((v - 127.5) / 128.0).transpose(2, 0, 1)).float() for v in views]
        with torch.no_grad():
            features.append(np.concatenate([net(v[None]).numpy() for v in views], 1))
    return np.concatenate(features, 0)


def publisher_lists(pairs_path: Path, root: Path, per_fold: int):
    """Its parseList on our folder: left and right image paths, folds and flags (1 / -1)."""
    lines = pairs_path.read_text().splitlines()[1:]
    left, right, flags = [], [], []
    for line in lines:
        p = line.split("\t")
        names = (p[0], p[0]) if len(p) == 3 else (p[0], p[2])
        idxs = (p[1], p[2]) if len(p) == 3 else (p[1], p[3])
        left.append(root / names[0] / f"{names[0]}_{int(idxs[0]):04d}.png")
        right.append(root / names[1] / f"{names[1]}_{int(idxs[1]):04d}.png")
        flags.append(1 if len(p) == 3 else -1)
    fold = np.arange(len(lines)) // (2 * per_fold)  # its i // 600 for LFW's 300 per fold
    return left, right, fold, np.array(flags)


@pytest.mark.usefixtures("one_thread")
def test_facenet_evaluate_with_the_mobilefacenet_config_equals_the_publishers_loop(tmp_path):
    import json

    import torch
    from mobilefacenet_reference import PublisherMobileFacenet, calibrate, randomize

    per_fold = 2
    pairs = fake_lfw(tmp_path / "lfw", per_fold)
    # measured BatchNorm statistics, so that the features differ from image to image by more
    # than the two float32 implementations of the network differ (about 1e-6)
    images = torch.randn(32, 3, 112, 96, generator=torch.Generator().manual_seed(0))
    net = calibrate(randomize(PublisherMobileFacenet(), seed=3), images)
    checkpoint = tmp_path / "068.ckpt"
    state = {"epoch": 68, "net_state_dict": net.state_dict()}
    torch.save(state, checkpoint, _use_new_zipfile_serialization=False)
    argv = ["--config", str(ROOT / "configs" / "lfw_mobilefacenet.yaml"), "--checkpoint"]
    argv += [str(checkpoint), "--pairs", str(pairs), "--root", str(tmp_path / "lfw")]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "out")]) == 0
    ours = json.loads((tmp_path / "out" / "metrics.json").read_text())

    left, right, fold, flags = publisher_lists(pairs, tmp_path / "lfw", per_fold)
    fl, fr = publisher_features(net, left), publisher_features(net, right)
    acc, thresholds = ref.mobilefacenet_evaluate(fl, fr, fold, flags)
    # The two networks' scores differ by about 6e-7 here: every figure is the loop's as long
    # as no score lies that close to a grid point or a chosen threshold (none does here).
    assert np.array_equal(ours["accuracy"], acc)
    np.testing.assert_allclose(ours["best_thresholds"], 1.0 - thresholds, atol=1e-12, rtol=0)


def test_arcface_template_is_insightfaces_arcface_src_digit_for_digit():
    published = (
        (38.2946, 51.6963),
        (73.5318, 51.5014),
        (56.0252, 71.7366),
        (41.5493, 92.3655),
        (70.7299, 92.2041),
    )
    assert TEMPLATES["arcface"].points == published
