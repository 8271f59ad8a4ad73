"""Template verification: pooling and TAR reading on hand-computed cases, and the command on a
synthetic set in insightface's layout, its figures recomputed from features.npz alone by
tools/ijb_from_features.py."""

import importlib.util
import json
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as skdata
from skimage import transform as sktf
from torchvision.transforms.v2 import functional as TF

from facenet.cli import evaluate as evaluate_script
from facenet.data.images import normalize_steps, read_image
from facenet.errors import ConfigError, DataError
from facenet.wings.after_training.loading import load_model
from facenet.wings.align.aligner import align_face
from facenet.wings.templates.ijb import read_template_set
from facenet.wings.templates.protocol import (
    FARS,
    TemplateResult,
    TemplateSettings,
    WarpedFaces,
    check_weights,
    choose_template,
    embed_faces,
    read_tar,
    template_features,
)

ROOT = Path(__file__).resolve().parents[3]
# MTCNN's five points on scikit-image's astronaut (facenet-pytorch 2.6.0, counted from 0)
ASTRONAUT_POINTS = np.array(
    [[204.01, 100.73], [245.76, 102.71], [223.67, 127.96], [200.72, 138.25], [244.27, 140.86]]
)
OFF = TemplateSettings(detector_score=False)


def _script():
    spec = importlib.util.spec_from_file_location("ijb_script", ROOT / "tools/ijb_from_features.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_media_are_averaged_templates_summed_then_unit_length():
    features = [[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, -5.0], [7.0, 7.0]]
    templates, media = [1, 1, 1, 2, 3], [10, 11, 10, 10, 10]  # media 10 of t1 is not t2's
    ids, pooled = template_features(features, np.ones(5), templates, media, OFF)
    # t1: mean([1, 0], [3, 0]) + [0, 2] = [2, 2]
    want = [[0.5**0.5, 0.5**0.5], [0.0, -1.0], [0.5**0.5, 0.5**0.5]]
    assert ids.tolist() == [1, 2, 3] and np.allclose(pooled, want, atol=1e-15)
    order = [4, 2, 0, 3, 1]  # the images' order changes nothing
    again = template_features(np.take(features, order, 0), np.ones(5),
                              np.take(templates, order), np.take(media, order), OFF)  # fmt: skip
    assert np.array_equal(again[1], pooled)


def test_detector_scores_weight_and_unit_features_drop_the_norm():
    features, scores = [[1.0, 0.0], [3.0, 0.0], [0.0, 2.0]], [1.0, 0.5, 2.0]
    _, weighted = template_features(features, scores, [1, 1, 1], [1, 1, 2], TemplateSettings())
    # mean([1, 0], [1.5, 0]) + [0, 4] = [1.25, 4]
    assert np.allclose(weighted, [[1.25 / 17.5625**0.5, 4 / 17.5625**0.5]], atol=1e-15)
    unit = TemplateSettings(detector_score=False, norm_score=False)
    _, pooled = template_features(features, scores, [1, 1, 1], [1, 1, 2], unit)
    assert np.allclose(pooled, [[0.5**0.5, 0.5**0.5]], atol=1e-15)  # [1, 0] + [0, 1]


@pytest.mark.parametrize("scale", [2.0**600, 2.0**-700, 1e155])
def test_huge_or_tiny_detector_scores_pool_as_their_ratios(scale):
    """A template is unit length: scaling every score by one factor changes nothing (squares
    of 1e155-weighted features overflow, of 1e-211-weighted ones underflow)."""
    rng = np.random.default_rng(0)
    x, scores = rng.standard_normal((40, 8)), rng.uniform(0.1, 1, 40)
    templates, media = rng.integers(0, 6, 40), rng.integers(0, 3, 40)
    want = template_features(x, scores, templates, media, TemplateSettings())[1]
    got = template_features(x, scores * scale, templates, media, TemplateSettings())[1]
    assert np.allclose(got, want, rtol=0, atol=1e-15)
    if np.log2(scale).is_integer():  # a power of two: bit for bit
        assert np.array_equal(got, want)


def test_a_template_weighed_zero_by_every_score_is_refused_naming_file_and_column(astronauts):
    faces = read_template_set(astronauts)
    zero = replace(faces, scores=np.where(faces.templates == 3, 0.0, faces.scores))
    with pytest.raises(DataError) as caught:
        check_weights(zero, TemplateSettings())
    message = str(caught.value)
    assert message.startswith(str(zero.meta("_name_5pts_score.txt")))
    assert "column 12) of template 3 is 0" in message and "--no-detector-score" in message
    check_weights(zero, OFF)  # unweighted: the scores are not used
    check_weights(faces, TemplateSettings())
    # before any embedding: the model is never called
    warped = WarpedFaces(zero, partial(align_face, template="arcface"), 32, "fixed")
    with pytest.raises(DataError, match="template 3 is 0"):
        embed_faces(None, warped, "cpu", TemplateSettings())


def test_tar_is_read_at_the_nearest_far_ties_to_the_larger_tar():
    impostors = np.arange(20) / 20  # FPR moves in steps of 0.05
    scores = np.r_[0.97, 0.93, 0.88, 0.5, impostors]
    labels = np.r_[1, 1, 1, 1, np.zeros(20, int)]
    _, _, auc, tar = read_tar(labels, scores)
    # FPR 0 holds TPR 0 and 0.25, FPR 0.1 holds 0.5 and 0.75: the larger of each
    assert tar == {**dict.fromkeys(FARS, 0.25), 0.1: 0.75}
    # genuine above impostors, counted pair by pair; 0.5 ties the impostor 0.5: half a pair
    assert auc == pytest.approx((20 + 19 + 18 + 10.5) / 80, abs=1e-15)


def test_an_equidistant_tie_reads_the_later_point_as_eval_ijbc_does():
    """eval_ijbc.py flips sklearn's curve (``np.flipud``) and takes the first minimum of
    |FPR - FAR| there: of two points equally far from the FAR, the later one of sklearn's order
    (the larger FPR and TAR), not numpy's argmin on the unflipped curve."""
    scores = np.r_[0.9, 0.8, 0.7, 0.6, 0.75, 0.4, 0.3, 0.2, 0.1]  # one impostor amid them
    labels = np.r_[1, 1, 1, 1, np.zeros(5, int)]
    fpr, tpr, _, tar = read_tar(labels, scores)
    near = np.flatnonzero(np.abs(fpr - 0.1) == np.abs(fpr - 0.1).min())  # 0.1 from FAR 0.1
    assert set(fpr[near].tolist()) == {0.0, 0.2} and tpr[near].tolist() == [0, 0.25, 0.5, 0.5, 1]
    assert tar[0.1] == 1.0 and tpr[np.argmin(np.abs(fpr - 0.1))] == 0.0


def _result(tar: dict, impostors: int) -> TemplateResult:
    empty = np.zeros(0)
    return TemplateResult(empty, empty, empty, empty, empty, 0.9, tar, impostors)


def test_a_far_below_one_false_accept_is_not_resolved():
    result = _result(dict(zip(FARS, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])), impostors=10_000)
    assert result.resolved() == {1e-4: 0.3, 1e-3: 0.4, 1e-2: 0.5, 1e-1: 0.6}
    note = "not resolved (10000 impostor pairs resolve FAR >= 1/10000)"
    resolved = {"0.0001": 0.3, "0.001": 0.4, "0.01": 0.5, "0.1": 0.6}
    assert result.tar_at_far() == {"1e-06": note, "1e-05": note, **resolved}
    line = result.tar_line()
    assert line.startswith(f"TAR@FAR=1e-06: {note}  TAR@FAR=1e-05: {note}  TAR@FAR=0.0001 0.3000")
    assert line.endswith("TAR@FAR=0.1 0.6000")
    few = _result(dict(zip(FARS, [0.1] * 6)), impostors=9)  # 1/9 > 0.1: nothing resolved
    assert few.resolved() == {} and set(few.tar_at_far().values()) == {
        "not resolved (9 impostor pairs resolve FAR >= 1/9)"
    }


@pytest.mark.parametrize("seed", range(3))
def test_pooling_and_tar_equal_the_loop_reference_on_random_data(seed):
    rng = np.random.default_rng(seed)
    x, scores = rng.standard_normal((300, 8)), rng.uniform(0.1, 1, 300)
    templates, media = rng.integers(0, 40, 300), rng.integers(0, 4, 300)  # media ids repeat
    reference = _script()
    for settings, weighted in ((OFF, x), (TemplateSettings(), x * scores[:, None])):
        ids, pooled = template_features(x, scores, templates, media, settings)
        want, want_ids = reference.image2template_feature(weighted, templates, media)
        assert np.array_equal(ids, want_ids) and np.allclose(pooled, want, rtol=0, atol=1e-12)
    labels, tied = rng.integers(0, 2, 500), rng.integers(0, 30, 500) / 30  # many ties
    _, _, auc, tar = read_tar(labels, tied)
    row, want_auc = reference.tpr_fpr_row(labels, tied)
    assert list(tar.values()) == list(row.values()) and auc == want_auc


def test_the_template_follows_the_model_input_size():
    assert choose_template(112) == "arcface" and choose_template((112, 96)) == "sphereface"
    assert choose_template(32, "sphereface") == "sphereface"
    with pytest.raises(ConfigError, match="takes 32 x 32 images .* give --template"):
        choose_template(32)
    with pytest.raises(ConfigError, match="template 'nope': expected one of"):
        choose_template(112, "nope")


def _moved(image, points, rng, flip):
    """``image`` under a random similarity (and mirrored) into 150 x 130 px, and its points."""
    face = sktf.SimilarityTransform(
        scale=rng.uniform(0.35, 0.6), rotation=rng.uniform(-0.3, 0.3),
        translation=rng.uniform([-60, -20], [-20, 10]),
    )  # fmt: skip
    out = sktf.warp(image, face.inverse, output_shape=(150, 130), preserve_range=True)
    moved = face(points)
    if flip:  # the mirror's left eye is the right one: a detector lists it first
        out, moved = out[:, ::-1], np.c_[129 - moved[:, 0], moved[:, 1]][[1, 0, 2, 4, 3]]
    return out.astype(np.uint8), moved


def write_astronaut_set(root, rng, templates=6):
    """A set in insightface's layout: each template 1-2 media of 1-2 moved astronauts."""
    face_lines, mark_lines = [], []
    for t in range(templates):
        for m in range(rng.integers(1, 3)):
            for i in range(rng.integers(1, 3)):
                name = f"id{t}/{m}_{i}." + ("png" if t == 0 else "jpg")
                image, points = _moved(skdata.astronaut(), ASTRONAUT_POINTS, rng, (t + i) % 2)
                (root / "loose_crop" / name).parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image).save(root / "loose_crop" / name)
                face_lines.append(f"{name} {t + 1} {100 * t + m}")
                marks = " ".join(f"{v:.3f}" for v in points.ravel())
                mark_lines.append(f"{name} {marks} {rng.uniform(0.5, 1):.4f}")
    pairs = [
        f"{a} {b} {int(rng.random() < 0.4)}"
        for a in range(1, templates + 1)
        for b in range(a + 1, templates + 1)
    ]
    (root / "meta").mkdir()
    for suffix, lines in (("face_tid_mid", face_lines), ("name_5pts_score", mark_lines),
                          ("template_pair_label", pairs)):  # fmt: skip
        (root / "meta" / f"syn_{suffix}.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def astronauts(tmp_path_factory):
    return write_astronaut_set(tmp_path_factory.mktemp("ijb"), np.random.default_rng(0))


def _raw_feature(trained, image, points):
    """The checkpoint's raw feature of one face plus its mirror's, computed step by step."""
    crop = torch.from_numpy(align_face(image, points, "arcface")).permute(2, 0, 1)
    x = torch.nn.Sequential(*normalize_steps(trained.normalize))(
        TF.resize(crop, list(trained.image_size) if not isinstance(trained.image_size, int)
                  else [trained.image_size] * 2, antialias=True)
    )[None]  # fmt: skip
    model = trained.model.eval()
    with torch.no_grad():
        both = torch.cat([x, x.flip(-1)])
        return model.embedding.prelogits(model.backbone(both)).sum(0).numpy()


def _assert_same_tar(recomputed: dict, written: dict) -> None:
    """metrics.json's TAR figures equal the script's to 1e-9; a FAR the pairs do not resolve
    is written as a text saying so."""
    assert recomputed.keys() == written.keys()
    for far, tar in recomputed.items():
        if isinstance(written[far], str):
            assert written[far].startswith("not resolved")
        else:
            assert abs(tar - written[far]) <= 1e-9


def test_evaluate_ijb_figures_recompute_from_the_features_file(tiny_run, astronauts, tmp_path,
                                                               capsys, one_thread):  # fmt: skip
    out = tmp_path / "out"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--ijb", str(astronauts)]
    assert evaluate_script.main([*argv, "--out", str(out)]) == 2  # 32 px: no template has it
    assert "give --template" in capsys.readouterr().err
    argv += ["--template", "arcface", "--batch-size", "5"]
    assert evaluate_script.main([*argv, "--out", str(out)]) == 0
    assert "TAR@FAR=1e-06" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    again = _script().recompute(out / "features.npz")
    from_pairs = _script().recompute(
        out / "features.npz", astronauts / "meta/syn_template_pair_label.txt"
    )
    for figures in (again, from_pairs):
        assert figures["tar_at_far"].keys() == metrics["tar_at_far"].keys()
        _assert_same_tar(figures["tar_at_far"], metrics["tar_at_far"])
        assert abs(figures["auc"] - metrics["auc"]) <= 1e-9
    saved = np.load(out / "features.npz")
    assert np.allclose(again["scores"], saved["scores"], rtol=0, atol=1e-12)
    trained = load_model(tiny_run["checkpoint"])
    image = read_image(astronauts / "loose_crop" / saved["image_names"][0]).permute(1, 2, 0).numpy()
    points = np.array(
        (astronauts / "meta/syn_name_5pts_score.txt").read_text().split()[1:11], float
    ).reshape(5, 2)
    want = _raw_feature(trained, image, points)
    assert np.allclose(saved["image_features"][0], want, rtol=1e-4, atol=1e-5)
    assert metrics["settings"]["template"] == "arcface" and metrics["settings"]["flip_test"]
    assert metrics["counts"]["templates"] == 6 and (out / "roc.png").stat().st_size > 0
    # deployable thresholds on 1 - cosine of the written pair scores, with their provenance
    deployable = metrics["deployable_thresholds"]
    if min(metrics["counts"]["genuine_pairs"], metrics["counts"]["impostor_pairs"]) >= 2:
        accepted = (1 - saved["scores"]) < deployable["accuracy"]["threshold"]
        want = np.mean(accepted == (saved["labels"] == 1))
        assert deployable["accuracy"]["accuracy"] == pytest.approx(want, abs=1e-12)
    else:
        assert deployable == {}
    assert metrics["threshold_for"]["preprocess"] == "template arcface"
    assert metrics["threshold_distance"] == "cosine"  # what identify's --threshold-at reads
    assert metrics["threshold_for"]["weights_sha256"] == trained.weights_sha256()
    assert evaluate_script.main([*argv, "--out", str(out)]) == 2  # outputs not replaced


def test_each_flag_changes_what_it_says(tiny_run, astronauts, tmp_path, one_thread):
    base = ["--checkpoint", str(tiny_run["checkpoint"]), "--ijb", str(astronauts),
            "--template", "arcface"]  # fmt: skip
    runs = {}
    for flags in ([], ["--no-detector-score", "--no-norm-score"], ["--no-flip-test"]):
        out = tmp_path / "-".join(flags or ["default"])
        assert evaluate_script.main([*base, *flags, "--out", str(out)]) == 0
        runs[tuple(flags)] = np.load(out / "features.npz")
        figures = _script().recompute(out / "features.npz")
        written = json.loads((out / "metrics.json").read_text())
        _assert_same_tar(figures["tar_at_far"], written["tar_at_far"])
    default, pooled_off, unflipped = runs.values()
    assert np.array_equal(default["image_features"], pooled_off["image_features"])
    assert not np.allclose(default["template_features"], pooled_off["template_features"])
    assert not np.allclose(default["image_features"], unflipped["image_features"])


@pytest.mark.parametrize("flip", [False, True])
def test_the_synthetic_landmarks_follow_the_face(flip):
    """The moved astronaut's points warp it onto the crop of the original (mirrored with flip)."""
    original = align_face(skdata.astronaut(), ASTRONAUT_POINTS).astype(float)
    image, points = _moved(skdata.astronaut(), ASTRONAUT_POINTS, np.random.default_rng(1), flip)
    crop = align_face(image, points).astype(float)
    wrong = align_face(image, points[[1, 0, 2, 4, 3]]).astype(float)
    want = original[:, ::-1] if flip else original
    assert np.abs(crop - want).mean() < 15 < np.abs(wrong - want).mean()


def test_bad_input_stops_the_command_before_any_output(tiny_run, tmp_path, capsys):
    root = write_astronaut_set(tmp_path / "set", np.random.default_rng(2), templates=2)
    (root / "meta/syn_template_pair_label.txt").write_text("1 2 0\n1 9 1\n")
    argv = [
        "--checkpoint",
        str(tiny_run["checkpoint"]),
        "--ijb",
        str(root),
        "--template",
        "arcface",
    ]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().endswith("label.txt:2: template 9 has no image")
    assert not (tmp_path / "out").exists()


def test_landmarks_no_similarity_fits_are_one_line_naming_the_image(astronauts):
    faces = read_template_set(astronauts)
    on_one_point = np.broadcast_to(faces.landmarks[:1, :1], faces.landmarks.shape)  # all equal
    faces = replace(faces, landmarks=on_one_point)
    warped = WarpedFaces(faces, partial(align_face, template="arcface"), 32, "fixed")
    with pytest.raises(DataError) as caught:
        warped[1]
    message = str(caught.value)
    assert "syn_name_5pts_score.txt: image " + repr(faces.images[1]) in message
    assert "no similarity transform fits landmarks" in message and "\n" not in message


def test_workers_give_the_same_features_and_a_one_line_error(tiny_run, astronauts, tmp_path):
    faces = read_template_set(astronauts)
    trained = load_model(tiny_run["checkpoint"])
    warped = WarpedFaces(faces, partial(align_face, template="arcface"), 32, trained.normalize)
    alone = embed_faces(trained.model, warped, "cpu", TemplateSettings(batch_size=4))
    two = embed_faces(trained.model, warped, "cpu", TemplateSettings(batch_size=4, workers=2))
    assert np.array_equal(alone, two)
    shutil.copytree(astronauts, tmp_path / "set")
    (tmp_path / "set/loose_crop" / faces.images[3]).write_bytes(b"\xff\xd8\xff broken")
    broken = WarpedFaces(read_template_set(tmp_path / "set"), warped.warp, 32, "fixed")
    for workers in (0, 2):
        with pytest.raises(DataError) as caught:
            embed_faces(trained.model, broken, "cpu", TemplateSettings(workers=workers))
        message = str(caught.value)
        assert message.startswith(str(tmp_path)) and "face_tid_mid.txt: corrupt" in message
        assert "\n" not in message and faces.images[3] in message
