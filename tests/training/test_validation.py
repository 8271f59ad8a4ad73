"""A run's evaluation: validation pairs choose best.pt and the threshold, test pairs report once
at the end; run outputs a person can read (summary, ROC files, TensorBoard, console lines)."""

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import facenet.training.validation as run_eval
from facenet.checkpoint import load_checkpoint
from facenet.cli import train as train_script
from facenet.config import load_config
from facenet.errors import ConfigError
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_embeddings
from facenet.evaluation.report import ThresholdRecord, val_at_far_label
from facenet.models.embedding import build_model
from facenet.training.build import build_data
from facenet.wings.after_training.loading import load_model

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = [
    "data.synthetic_identities=12",
    "data.synthetic_images_per_identity=4",
    "data.synthetic_heldout_identities=20",
    "data.synthetic_heldout_images_per_identity=4",
    "data.synthetic_pairs_per_fold=6",
    "data.image_size=16",
    "data.p=3",
    "data.k=2",
    "train.epochs=3",
    "train.steps_per_epoch=3",
    "train.device=cpu",
    "train.log_interval=1",
    "eval.every=1",
    "logging.progress=true",  # not a terminal here: one line per interval, no bar
    "logging.tensorboard=true",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-epoch run that records which pairs file every evaluation embedded, in order."""
    base = tmp_path_factory.mktemp("run_eval")
    argv = ["--config", str(ROOT / "configs" / "demo.yaml"), "--out", str(base / "run")]
    for setting in [*SETTINGS, f"data.root={base / 'data'}"]:
        argv += ["--set", setting]
    calls = []
    verify = run_eval._verify

    def recording(run, model, pairs):
        calls.append(Path(pairs.source).name)
        return verify(run, model, pairs)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_eval, "_verify", recording)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = train_script.main(argv)
    torch.set_num_threads(before)
    assert code == 0, err.getvalue()
    run_dir = base / "run"
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "dir": run_dir,
        "data": base / "data",
        "calls": calls,
        "summary": summary,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
    }


def test_validation_chooses_and_test_pairs_are_evaluated_once_at_the_end(run):
    calls, summary = run["calls"], run["summary"]
    validations = [c for c in calls if c == "val_pairs.txt"]
    assert len(validations) == 4  # before training and after each of 3 epochs
    tests = [i for i, c in enumerate(calls) if c == "test_pairs.txt"]
    assert tests and min(tests) > max(i for i, c in enumerate(calls) if c == "val_pairs.txt")
    assert len(tests) == (1 if summary["best_epoch"] == 3 else 2)  # the last model, best.pt
    history = [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    accuracies = [r["validation"]["accuracy_mean"] for r in history]
    assert summary["best_epoch"] == 1 + int(np.argmax(accuracies))  # first maximum
    assert load_checkpoint(run["dir"] / "best.pt")["epoch"] == summary["best_epoch"]
    assert (
        summary["threshold"]["value"]
        == history[summary["best_epoch"] - 1]["validation"]["threshold"]
    )
    assert summary["threshold"]["chosen_on"] == "validation pairs"


def test_the_reported_test_figure_is_best_pt_on_the_test_pairs(run):
    """An independent evaluation of best.pt's weights on the test pairs gives the summary's."""
    cfg = load_config(run["dir"] / "config.yaml")
    state = load_checkpoint(run["dir"] / "best.pt")
    model = build_model(cfg.model, num_classes=state["model"]["classifier.weight"].shape[0])
    model.load_state_dict(state["model"])
    from facenet.data.pairs import read_pairs

    pairs = read_pairs(run["data"] / "heldout" / "test_pairs.txt")
    emb1, emb2 = embed_pair_list(model, pairs, 16, VerifySettings(batch_size=64))
    result = evaluate_embeddings(emb1.numpy(), emb2.numpy(), pairs.issame, folds=pairs.fold_ids)
    best = run["summary"]["test"]["best"]
    assert best["accuracy_mean"] == pytest.approx(result.accuracy_mean, abs=1e-12)
    assert best["auc"] == pytest.approx(result.auc, abs=1e-12)
    distances = ((emb1 - emb2) ** 2).sum(1).numpy()
    threshold = run["summary"]["threshold"]["value"]
    at_threshold = np.mean((distances < threshold) == pairs.issame)
    assert best["accuracy_at_validation_threshold"] == pytest.approx(at_threshold, abs=1e-12)
    assert "threshold" not in best  # the test pairs choose nothing


def test_validation_and_test_identities_are_disjoint(run):
    from facenet.data.pairs import read_pairs

    heldout = run["data"] / "heldout"
    names = {}
    for split in ("val_pairs", "test_pairs"):
        pairs = read_pairs(heldout / f"{split}.txt")
        names[split] = {Path(p).parent.name for p in pairs.paths1 + pairs.paths2}
    assert names["val_pairs"] and names["test_pairs"]
    assert not names["val_pairs"] & names["test_pairs"]


def test_summary_says_what_a_person_asks(run):
    summary = run["summary"]
    for key in (
        "best_epoch",
        "best_validation",
        "threshold",
        "test",
        "wall_seconds",
        "images_per_second",
        "data_wait_seconds",
        "peak_rss_bytes",
        "before_training",
    ):
        assert summary[key] is not None, key
    assert summary["wall_seconds"] >= summary["train_seconds"] > 0
    assert set(summary["test"]) == {"best", "last"}
    assert summary["test"]["last"]["epoch"] == 3


def test_roc_files_and_one_labelling_of_val_at_far(run):
    names = sorted(p.name for p in run["dir"].glob("roc_*.png"))
    assert names == ["roc_test.png"] + [f"roc_val_epoch_{e}.png" for e in range(4)]
    assert val_at_far_label(0.468, 0.001, 0.003) == "VAL 0.4680 @ FAR 0.001 (achieved 0.0030)"


def test_tensorboard_groups_steps_hparams(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run["dir"] / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train_epoch/loss", "memory/peak_rss_bytes"} <= tags
    assert {"eval/val/accuracy_mean", "eval/test/best/accuracy_mean"} <= tags
    assert not [t for t in tags if "/" not in t]  # no flat tags
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(1, 10))  # every log interval (1 step), by global step
    assert [e.step for e in events.Scalars("eval/val/accuracy_mean")] == [0, 1, 2, 3]
    assert events.PluginTagToContent("hparams")  # the settings with the final figures


def test_heldout_identities_of_a_folder_never_train(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    SyntheticIdentities(12, 3, image_size=16, seed=0).write_to_disk(tmp_path / "faces")
    cfg = load_config(
        None,
        [
            "data.dataset=folder",
            f"data.root={tmp_path / 'faces'}",
            "data.p=2",
            "data.k=2",
            "eval.heldout_identities=6",
            "eval.heldout_pairs_per_fold=1",
            "eval.n_folds=3",
        ],
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = build_data(cfg, run_dir)
    held = {
        Path(p).parent.name for s in (data.val_pairs, data.test_pairs) for p in s.paths1 + s.paths2
    }
    assert len(held) >= 4 and not held & set(data.loader.dataset.dataset.classes)
    assert data.num_classes == 6
    assert (run_dir / "val_pairs.txt").is_file() and (run_dir / "test_pairs.txt").is_file()
    assert any("held out 6 identities" in note for note in data.notes)


def test_a_folder_without_pairs_says_nothing_will_be_evaluated(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    SyntheticIdentities(4, 3, image_size=16, seed=0).write_to_disk(tmp_path / "faces")
    cfg = load_config(
        None, ["data.dataset=folder", f"data.root={tmp_path / 'faces'}", "data.p=2", "data.k=2"]
    )
    data = build_data(cfg, tmp_path)
    assert data.val_pairs is None and data.test_pairs is None
    assert any(note.startswith("nothing will be evaluated") for note in data.notes)


def test_no_terminal_no_bar_one_line_per_interval(run):
    lines = run["stdout"].splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("epoch 1 step ")] == [
        "epoch 1 step 1/3",
        "epoch 1 step 2/3",
        "epoch 1 step 3/3",
    ]
    assert "it/s" not in run["stdout"] + run["stderr"]  # no tqdm bar in a log
    assert any(line.startswith("test (best.pt") for line in lines)
    assert any(line.startswith("validation: accuracy ") for line in lines)


def test_the_run_evaluates_with_the_publishers_preprocessing_and_grids(run, monkeypatch):
    """eval.preprocess and eval.grid reach a run's evaluation (as evaluate.py's presets)."""
    from types import SimpleNamespace

    import facenet.evaluation.verify as verify_module
    from facenet.evaluation.presets import classic_thresholds
    from facenet.evaluation.protocol import threshold_grids

    seen = {}

    def embed(model, pairs, image_size, settings, *args):
        seen["preprocess"] = settings.preprocess
        return torch.zeros(2, 1), torch.zeros(2, 1)

    def protocol(emb1, emb2, issame, settings, *args):
        seen["thresholds"], seen["val_thresholds"] = threshold_grids(settings)
        raise StopIteration

    cfg = load_config(run["dir"] / "config.yaml", ["eval.preprocess=crop", "eval.grid=classic"])
    monkeypatch.setattr(verify_module, "embed_pair_list", embed)
    monkeypatch.setattr(verify_module, "evaluate_embeddings", protocol)
    a_run = SimpleNamespace(cfg=cfg, trainer=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(StopIteration):
        run_eval._verify(a_run, None, SimpleNamespace(issame=[True, False]))
    assert seen["preprocess"] == "crop"
    assert np.array_equal(seen["thresholds"], classic_thresholds())
    assert np.array_equal(seen["val_thresholds"], classic_thresholds(True))


def test_the_run_and_the_evaluate_command_print_the_same_figures_line(run, tmp_path, capsys):
    """best.pt on the test pairs: the run's console line and evaluate's read the same."""
    from facenet.cli import evaluate as evaluate_script

    line = next(x for x in run["stdout"].splitlines() if x.startswith("test (best.pt"))
    figures = line.split("): ", 1)[1].split(";")[0]  # without the name and the threshold part
    pairs = run["data"] / "heldout" / "test_pairs.txt"
    argv = ["--checkpoint", str(run["dir"] / "best.pt"), "--pairs", str(pairs)]
    argv += ["--config", str(run["dir"] / "config.yaml"), "--out", str(tmp_path)]
    capsys.readouterr()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert evaluate_script.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    assert f"test_pairs.txt {figures}" in capsys.readouterr().out.splitlines()


def folder_config(root, *extra):
    return load_config(
        None,
        [
            "data.dataset=folder",
            f"data.root={root}",
            "data.p=2",
            "data.k=2",
            "eval.heldout_pairs_per_fold=1",
            "eval.n_folds=3",
            *extra,
        ],
    )


def write_test_identities(root: Path) -> Path:
    """Six other identities of 3 images with an LFW-style pairs.txt (3 folds x 1 + 1)."""
    from facenet.data.pairs import generate_pairs, write_pairs
    from facenet.wings.demo.synthetic import SyntheticIdentities

    written = SyntheticIdentities(6, 3, image_size=16, seed=2, identity_offset=90).write_to_disk(
        root
    )
    write_pairs(root / "pairs.txt", generate_pairs(written, 3, 1, seed=0))
    return root


def test_the_held_out_identities_stay_held_out_when_the_folder_changes(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    faces = tmp_path / "faces"
    SyntheticIdentities(12, 3, image_size=16, seed=0).write_to_disk(faces)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = folder_config(faces, "eval.heldout_identities=6")
    first = build_data(cfg, run_dir)
    SyntheticIdentities(3, 3, image_size=16, seed=1, identity_offset=50).write_to_disk(faces)
    again = build_data(cfg, run_dir)  # a resume: the folder has new identities now
    assert sorted(again.loader.dataset.dataset.classes) == sorted(
        first.loader.dataset.dataset.classes + ["id00050", "id00051", "id00052"]
    )
    assert again.val_pairs.paths1 == first.val_pairs.paths1
    assert again.test_pairs.paths2 == first.test_pairs.paths2


def test_holdout_with_given_test_pairs_holds_out_for_validation_only(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    faces, lfw = tmp_path / "faces", write_test_identities(tmp_path / "lfw")
    SyntheticIdentities(12, 3, image_size=16, seed=0).write_to_disk(faces)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = folder_config(faces, "eval.heldout_identities=4", f"eval.pairs={lfw / 'pairs.txt'}")
    data = build_data(cfg, run_dir)
    assert data.test_pairs.source == str(lfw / "pairs.txt")
    assert data.num_classes == 8 and (run_dir / "val_pairs.txt").is_file()
    assert not (run_dir / "test_pairs.txt").exists()
    both = folder_config(
        faces,
        "eval.heldout_identities=4",
        f"eval.pairs={lfw / 'pairs.txt'}",
        f"eval.val_pairs={lfw / 'pairs.txt'}",
    )
    with pytest.raises(ConfigError, match="nothing to hold out"):
        build_data(both, tmp_path / "run2")


def test_the_same_pairs_for_validation_and_test_are_refused(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    faces, lfw = tmp_path / "faces", write_test_identities(tmp_path / "lfw")
    SyntheticIdentities(4, 3, image_size=16, seed=0).write_to_disk(faces)
    pairs = str(lfw / "pairs.txt")
    cfg = folder_config(faces, f"eval.pairs={pairs}", f"eval.val_pairs={pairs}")
    with pytest.raises(ConfigError, match="the same file"):
        build_data(cfg, tmp_path)
    trained = folder_config(lfw, f"eval.pairs={pairs}")
    with pytest.warns(UserWarning, match="of the test pairs are trained on"):
        build_data(trained, tmp_path)


def test_a_corrupt_held_out_image_is_left_out_of_the_pairs(tmp_path):
    from facenet.wings.demo.synthetic import SyntheticIdentities

    faces = tmp_path / "faces"
    written = SyntheticIdentities(12, 4, image_size=16, seed=0).write_to_disk(faces)
    for identity, files in written.items():  # one damaged image in every identity
        (faces / identity / files[0]).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.warns(UserWarning, match="corrupt"):
        data = build_data(folder_config(faces, "eval.heldout_identities=6"), run_dir)
    used = set(data.val_pairs.paths1 + data.val_pairs.paths2 + data.test_pairs.paths1)
    assert used and not any(Path(p).name == written[Path(p).parent.name][0] for p in used)


def test_the_threshold_travels_with_what_it_was_chosen_for(run):
    """summary.json's threshold names the weights of best.pt (content hash), the epoch, flip,
    mean subtraction and preprocessing; every checkpoint carries its own epoch's threshold,
    so last.pt never takes best.pt's."""
    threshold = run["summary"]["threshold"]
    best, last = (load_model(run["dir"] / name) for name in ("best.pt", "last.pt"))
    assert threshold["weights_sha256"] == best.weights_sha256()
    assert threshold["epoch"] == best.epoch == run["summary"]["best_epoch"]
    cfg = load_config(run["dir"] / "config.yaml")
    assert (threshold["flip"], threshold["subtract_mean"], threshold["preprocess"]) == (
        cfg.eval.flip,
        cfg.eval.subtract_mean,
        cfg.eval.preprocess,
    )
    history = [json.loads(line) for line in (run["dir"] / "metrics.jsonl").read_text().splitlines()]
    for trained in (best, last):
        record = trained.threshold_record()
        assert record.value == history[trained.epoch - 1]["validation"]["threshold"]
        assert record.weights_sha256 == trained.weights_sha256()
        assert record.differences(trained.preparation(flip=cfg.eval.flip)) == []
    summary_record = ThresholdRecord.from_dict(threshold)
    differences = summary_record.differences(last.preparation(flip=cfg.eval.flip))
    assert bool(differences) == (last.epoch != best.epoch)  # another epoch: other weights


def test_best_pt_is_read_on_the_cpu_for_its_weights_only(tmp_path, monkeypatch):
    """Wherever the run trains, best.pt is mapped to the CPU; only the model's weights are
    copied into a copy of the run's model (the optimizer state stays in the file)."""
    source, model = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.save({"epoch": 4, "model": source.state_dict(), "optimizer": {}}, tmp_path / "best.pt")
    locations = []

    def recording(path, map_location):
        locations.append(map_location)
        return load_checkpoint(path, map_location=map_location)

    monkeypatch.setattr(run_eval, "load_checkpoint", recording)
    trainer = SimpleNamespace(core_model=model, device=torch.device("cuda", 1))
    selected = run_eval._selected_model(SimpleNamespace(run_dir=tmp_path, trainer=trainer), 4)
    assert locations == ["cpu"]
    assert selected is not model
    torch.testing.assert_close(selected.state_dict(), source.state_dict())


def test_validation_records_its_cuda_peaks_over_the_ranks(monkeypatch):
    peaks, calls = {"cuda_max_allocated": 5, "cuda_max_reserved": 9}, []
    monkeypatch.setattr(run_eval, "memory_figures", lambda device, rss: dict(peaks))
    monkeypatch.setattr(run_eval, "max_over_ranks", lambda f: {k: 2 * v for k, v in f.items()})
    monkeypatch.setattr(run_eval, "reset_cuda_peaks", lambda device: calls.append("reset"))
    monkeypatch.setattr(run_eval, "_verify", lambda *args: calls.append("verify") or (0, 0))
    monkeypatch.setattr(run_eval, "_plot", lambda *args: None)
    monkeypatch.setattr(run_eval, "figures", lambda result: {"accuracy_mean": 0.5})
    monkeypatch.setattr(run_eval, "weights_digest", lambda model: "digest")
    logged = []
    run = SimpleNamespace(
        trainer=SimpleNamespace(core_model=None, device=torch.device("cpu")),
        data=SimpleNamespace(val_pairs=None),
        cfg=load_config(None),
        logger=SimpleNamespace(log_scalars=lambda *args: logged.append(args)),
    )
    values = run_eval.validate(run, 1)
    assert calls == ["reset", "verify"]  # the peaks are validation's own
    assert values["cuda_max_allocated"] == 10 and values["cuda_max_reserved"] == 18
    assert values["accuracy_mean"] == 0.5
