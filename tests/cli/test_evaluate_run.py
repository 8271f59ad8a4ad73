"""facenet-evaluate on a run's checkpoint: the run's own evaluation settings unless the user
names others (one line says which), the folds of the pairs file, and the image folder a pairs
file records or the user gives (a missing image named in one line that points to --root)."""

import json
import shutil

import pytest
import torch

from facenet.cli import evaluate as evaluate_script
from facenet.cli import make_pairs as make_pairs_script
from facenet.cli import train as train_script
from tests.conftest import TINY_RUN_SETTINGS

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
# what the run evaluated with, none of them the command's defaults
RUN_EVAL = ["eval.distance=cosine", "eval.flip=true", "eval.grid=classic"]


@pytest.fixture(scope="module")
def cosine_run(tmp_path_factory):
    """A two-step run of configs/demo.yaml that evaluates with cosine distances, flipped
    images and the classic grids: its folder, best.pt, test pairs and summary."""
    base = tmp_path_factory.mktemp("cosine_run")
    argv = ["--config", str(ROOT / "configs" / "demo.yaml"), "--out", str(base / "run")]
    for setting in [*TINY_RUN_SETTINGS, *RUN_EVAL, f"data.root={base / 'data'}"]:
        argv += ["--set", setting]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_script.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    summary = json.loads((base / "run" / "summary.json").read_text())
    return {
        "checkpoint": base / "run" / "best.pt",
        "pairs": base / "data" / "heldout" / "test_pairs.txt",
        "heldout": base / "data" / "heldout",
        "summary": summary,
    }


def _evaluate(capsys, out, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``facenet-evaluate ARGV --out OUT``."""
    torch.set_num_threads(1)
    code = evaluate_script.main([*map(str, argv), "--out", str(out)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_runs_checkpoint_is_evaluated_as_the_run_evaluated(cosine_run, tmp_path, capsys):
    argv = ["--checkpoint", cosine_run["checkpoint"], "--pairs", cosine_run["pairs"]]
    code, out, _ = _evaluate(capsys, tmp_path / "eval", *argv)
    assert code == 0
    line = f"evaluation settings: the run's ({cosine_run['checkpoint']}: distance cosine, flip on"
    assert line in out and "grid classic" in out and "image size 32" in out
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["threshold_distance"] == "cosine" and metrics["threshold_for"]["flip"] is True
    test = cosine_run["summary"]["test"]["best"]  # best.pt's figures on the test pairs
    assert metrics["accuracy_mean"] == test["accuracy_mean"]
    assert metrics["auc"] == test["auc"]


def test_flags_still_override_the_runs_settings(cosine_run, tmp_path, capsys):
    argv = ["--checkpoint", cosine_run["checkpoint"], "--pairs", cosine_run["pairs"]]
    code, out, _ = _evaluate(capsys, tmp_path / "eval", *argv, "--distance", "squared")
    assert code == 0
    assert "distance squared, flip on" in out and "from the command line: --distance" in out
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["threshold_distance"] == "squared" and metrics["threshold_for"]["flip"] is True


def _settings(*argv) -> tuple:
    """(whose settings, distance, flip) of ``facenet-evaluate ARGV`` once a checkpoint is read."""
    args = evaluate_script._parse(list(map(str, argv)))
    evaluate_script._apply_run_settings(args)
    return args.settings_from, args.distance, args.flip


def test_a_config_or_a_preset_replaces_the_runs_settings(cosine_run, tmp_path):
    config = tmp_path / "eval.yaml"
    config.write_text("eval:\n  distance: euclidean\n", encoding="utf-8")
    line = ["--checkpoint", cosine_run["checkpoint"], "--pairs", "p.txt"]
    assert _settings(*line, "--config", config) == (f"--config {config}", "euclidean", False)
    preset = _settings(*line, "--preset", "facenet-pytorch")
    assert preset == ("--preset facenet-pytorch", "squared", False)
    assert _settings(*line, "--flip") == ("the run's", "cosine", True)


def test_a_file_without_a_run_gives_the_defaults(tmp_path):
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    line = ["--checkpoint", tmp_path / "plain.pt", "--pairs", "p.txt"]
    assert _settings(*line) == ("the defaults", "squared", False)


def _three_fold_pairs(tiny_run, tmp_path, capsys):
    """A pairs file of the tiny run's held-out identities in 3 folds, written beside them."""
    pairs = tmp_path / "three.txt"
    argv = [str(tiny_run["heldout"]), "--out", str(pairs), "--folds", "3"]
    assert make_pairs_script.main([*argv, "--pairs-per-fold", "4", "--shared-identities"]) == 0
    capsys.readouterr()
    return pairs


def test_a_pairs_file_is_evaluated_in_its_own_folds(tiny_run, tmp_path, capsys):
    pairs = _three_fold_pairs(tiny_run, tmp_path, capsys)
    argv = ["--checkpoint", tiny_run["checkpoint"], "--pairs", pairs]
    code, out, _ = _evaluate(capsys, tmp_path / "a", *argv)
    assert code == 0 and "n folds 3 (the pairs file's)" in out.splitlines()[0]
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["n_folds"] == 3
    assert _evaluate(capsys, tmp_path / "b", *argv, "--folds", "3")[0] == 0


def test_a_fold_count_that_contradicts_the_pairs_file_is_refused(tiny_run, tmp_path, capsys):
    pairs = _three_fold_pairs(tiny_run, tmp_path, capsys)
    argv = ["--checkpoint", tiny_run["checkpoint"], "--pairs", pairs]
    code, _, err = _evaluate(capsys, tmp_path / "a", *argv, "--folds", "10")
    assert code == 2 and len(err.splitlines()) == 1
    assert f"--folds 10: {pairs} holds 3 folds (its header); give 3" in err
    config = tmp_path / "eval.yaml"
    config.write_text("eval:\n  n_folds: 5\n", encoding="utf-8")
    code, _, err = _evaluate(capsys, tmp_path / "b", *argv, "--config", config)
    assert code == 2 and f"--config {config}: eval.n_folds 5: {pairs} holds 3 folds" in err


def test_pairs_made_outside_their_folder_find_their_images(tiny_run, tmp_path, capsys):
    pairs = _three_fold_pairs(tiny_run, tmp_path, capsys)
    argv = ["--checkpoint", tiny_run["checkpoint"], "--pairs", pairs]
    assert _evaluate(capsys, tmp_path / "a", *argv)[0] == 0  # no --root


def test_missing_images_are_one_short_line_that_points_to_root(tiny_run, tmp_path, capsys):
    pairs = tmp_path / "pairs" / "test.txt"
    pairs.parent.mkdir()
    shutil.copy(tiny_run["pairs"], pairs)  # LFW's header: the images beside the file
    argv = ["--checkpoint", tiny_run["checkpoint"], "--pairs", pairs]
    code, _, err = _evaluate(capsys, tmp_path / "a", *argv)
    assert code == 2 and len(err.splitlines()) == 1
    assert len(err.replace(str(tmp_path), "")) < 300  # its paths apart (was 2,000 characters)
    assert f"not found under {pairs.parent} (first: {pairs.parent}" in err
    assert "give --root, the folder of the identity folders, or --skip-missing" in err
    assert "skip_missing" not in err and "=" not in err
    assert _evaluate(capsys, tmp_path / "b", *argv, "--root", tiny_run["heldout"])[0] == 0
