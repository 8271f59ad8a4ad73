"""benchmarks.bench_real_faces end to end on tiny synthetic identity folders at the real layout:
every method trains (its loss moves) once per seed, LFW-style and held-out figures come back with
their spread over seeds, and fine-tuning reports before and after."""

import json
import os

import numpy as np
import pytest
import torch

from benchmarks import bench_real_faces as bench
from facenet.data.pairs import generate_pairs, scan_identities, write_pairs
from facenet.models.embedding import EmbeddingNet
from facenet.wings.demo.synthetic import SyntheticIdentities

FIGURES = ("accuracy_mean", "accuracy_std", "val", "far", "auc", "eer")
# A tiny network at 32 px, half a second of CPU per method: fast, not meaningful.
SMALL = [
    "model.backbone=tiny",
    "model.embedding_dim=16",
    "data.image_size=32",
    "data.p=4",
    "data.k=4",
    "eval.n_folds=2",
    "eval.heldout_identities=4",
    "eval.heldout_pairs_per_fold=4",
    "eval.batch_size=64",
]
# The peers' batches sized for 8 training identities of 6 images.
PEERS = ["people_per_batch=3", "images_per_person=4", "sandberg_batch=12"]
PEERS += ["identities_per_batch=4", "triplets_per_batch=6"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A training folder (12 identities x 6 images) and an LFW-like folder with its pairs."""
    root = tmp_path_factory.mktemp("real_faces")
    SyntheticIdentities(12, 6, image_size=40, seed=3).write_to_disk(root / "train")
    lfw = root / "lfw"
    SyntheticIdentities(8, 4, image_size=40, seed=3, identity_offset=100).write_to_disk(lfw)
    write_pairs(root / "pairs.txt", generate_pairs(scan_identities(lfw), 2, 6, seed=0))
    return root


def run_bench(folders, tmp_path, *extra: str) -> dict:
    """The benchmark's main on the folders; its JSON report."""
    out = tmp_path / "report.json"
    args = ["--train-root", str(folders / "train"), "--lfw-root", str(folders / "lfw")]
    args += ["--pairs", str(folders / "pairs.txt"), "--json", str(out)]
    args += ["--out", str(tmp_path / "not" / "yet")]  # created, with its parents
    assert bench.main([*args, *extra]) == 0
    return json.loads(out.read_text())


def test_every_method_trains_and_is_evaluated_per_seed(folders, tmp_path, capsys):
    overrides = [f"--set={item}" for item in SMALL] + [f"--peer={item}" for item in PEERS]
    report = run_bench(folders, tmp_path, "--cpu-seconds", "0.3", "--seeds", "2", *overrides)
    scratch, printed = report["scratch"], capsys.readouterr().out
    assert scratch["data"]["train_identities"] == 8  # 12 less the 4 held out
    assert scratch["seeds"] == [0, 1] and scratch["peers"]["sandberg_batch"] == 12
    for method in bench.SETUPS:
        runs = scratch[method]["runs"]
        assert [run["seed"] for run in runs] == [0, 1], method
        for run in runs:
            assert run["steps"] > 1 and run["cpu_seconds"] >= 0.3
            assert run["images_per_cpu_second"] > 0
            assert run["loss_first"] != run["loss_last"], method  # it trained
            for split in ("lfw", "heldout"):
                # 6 impostor pairs a training fold cannot resolve FAR 1e-3: VAL in words
                assert run[split]["val"].startswith("not resolved"), (method, split)
                figures = [key for key in FIGURES if key != "val"]
                assert all(0.0 <= run[split][key] <= 1.0 for key in figures), (method, split)
        summary = scratch[method]["over_seeds"]
        for split in ("lfw", "heldout"):
            assert summary[split]["val"] == {"mean": None, "std": None}
            for key in set(bench.SEED_FIGURES) - {"val"}:
                values = [run[split][key] for run in runs]
                spread = summary[split][key]
                assert spread["mean"] == pytest.approx(np.mean(values)), (method, split, key)
                assert spread["std"] == pytest.approx(np.std(values, ddof=1)), (method, key)
        assert f"{method} lfw over 2 seeds: acc" in printed
        assert summary["runs"] == 2 and summary["images_per_cpu_second"]["mean"] > 0
    # Each seed starts from its own weights: the first losses differ.
    assert len({run["loss_first"] for run in scratch["ours"]["runs"]}) == 2
    assert scratch["ours"]["runs"][0]["step_path"] == "one-pass"
    assert scratch["data"]["lfw_pairs"] == 24  # 2 folds x (6 same + 6 different)
    assert report["machine"]["cpu_count"] >= 1
    assert (tmp_path / "not" / "yet" / "heldout.json").is_file()


def test_over_seeds_of_one_run_has_no_spread():
    figures = {key: 0.5 for key in bench.SEED_FIGURES}
    run = {"images_per_cpu_second": 100.0, "lfw": figures}
    summary = bench.over_seeds([run])
    assert summary["lfw"]["auc"] == {"mean": 0.5, "std": None} and "heldout" not in summary
    two = bench.over_seeds([run, run | {"images_per_cpu_second": 200.0}])
    assert two["images_per_cpu_second"]["std"] == pytest.approx(np.std([100, 200], ddof=1))


def test_over_seeds_leaves_a_figure_some_run_could_not_resolve_without_a_mean():
    resolved = {key: 0.5 for key in bench.SEED_FIGURES}
    unresolved = resolved | {"val": "not resolved (thresholds chosen on 450 impostor pairs)"}
    runs = [{"images_per_cpu_second": 1.0, "heldout": f} for f in (resolved, unresolved)]
    summary = bench.over_seeds(runs)["heldout"]
    assert summary["val"] == {"mean": None, "std": None}
    assert summary["auc"] == {"mean": 0.5, "std": 0.0}


def test_finetuning_reports_before_and_after(folders, tmp_path):
    weights = tmp_path / "published.pt"
    torch.manual_seed(0)
    torch.save(EmbeddingNet("tiny", embedding_dim=16).state_dict(), weights)
    small = [f"--finetune-set={item}" for item in SMALL if "embedding_dim" not in item]
    report = run_bench(
        folders,
        tmp_path,
        "--methods",
        "--weights",
        str(weights),
        "--cpu-seconds",
        "0.5",
        "--finetune-set=model.embedding_dim=16",
        "--publisher-set=eval.n_folds=2",
        *small,
    )
    assert "scratch" not in report
    part = report["finetune"]
    assert part["training"]["steps"] > 1
    for when in ("before", "after"):
        for key in ("publisher_lfw", "lfw", "heldout"):
            assert 0.0 <= part[when][key]["accuracy_mean"] <= 1.0, (when, key)
    # The weights moved: the figures on the same pairs differ, or at least the loss did.
    training = part["training"]
    assert training["loss_first"] != training["loss_last"]


def test_budget_schedule_follows_the_fraction_spent():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = bench.load_config(None, ["optim.schedule=cosine", "optim.min_lr_ratio=0.0"])
    spent = [0.0]  # nothing spent yet: the starting rate
    schedule = bench.budget_schedule(optimizer, cfg, lambda: spent[0])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    spent[0] = 0.5  # half the budget spent: half the cosine
    optimizer.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05, abs=1e-3)


def refusal(argv: list[str], capsys) -> str:
    """The one line ``main(argv)`` exits 2 with, before anything runs."""
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--cpu-seconds", "nan"),
        ("--cpu-seconds", "inf"),
        ("--cpu-seconds", "0"),
        ("--cpu-seconds", "-1"),
        ("--finetune-cpu-seconds", "nan"),
        ("--threads", "0"),
        ("--threads", "-2"),
        ("--json", "{file}/report.json"),  # a folder that cannot be made
        ("--json", "{tmp}"),  # a folder, not a file
        ("--out", "{file}"),  # a file, not a folder
        ("--train-root", "{tmp}/missing"),
        ("--lfw-root", "{file}"),  # a file, not a folder
        ("--pairs", "{fifo}"),  # would block on reading
        ("--weights", "{tmp}/missing.pt"),
        ("--seeds", "0"),
        ("--peer", "nope=1"),
        ("--peer", "margin=nan"),
    ],
)
def test_a_bad_argument_is_one_line_before_anything_runs(folders, tmp_path, capsys, flag, value):
    (tmp_path / "file").write_text("")
    os.mkfifo(tmp_path / "fifo")
    value = value.format(tmp=tmp_path, file=tmp_path / "file", fifo=tmp_path / "fifo")
    argv = ["--train-root", str(folders / "train"), "--lfw-root", str(folders / "lfw")]
    argv += ["--pairs", str(folders / "pairs.txt"), "--json", str(tmp_path / "r.json"), flag, value]
    assert flag in refusal(argv, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "file"]  # nothing written


@pytest.mark.parametrize("problem", ["setting", "empty root"])
def test_a_bad_setting_or_root_is_one_line_exit_2(folders, tmp_path, capsys, monkeypatch, problem):
    monkeypatch.chdir(tmp_path)  # the configurations are found from anywhere
    train = folders / "train" if problem == "setting" else tmp_path
    argv = ["--train-root", str(train), "--lfw-root", str(folders / "lfw")]
    argv += ["--pairs", str(folders / "pairs.txt")]
    argv += ["--set", "train.epochs=many"] if problem == "setting" else []
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("train.epochs" in err or "identities" in err), err


@pytest.mark.parametrize("output", ["--json", "--out"])
def test_an_output_that_is_an_input_is_refused(folders, capsys, output):
    """A report or run folder written over the data: refused before anything is replaced."""
    target = folders / ("pairs.txt" if output == "--json" else "train")
    before = target.stat().st_mtime_ns
    argv = ["--train-root", str(folders / "train"), "--lfw-root", str(folders / "lfw")]
    argv += ["--pairs", str(folders / "pairs.txt"), output, str(target)]
    assert "also given as" in refusal(argv, capsys)
    assert target.stat().st_mtime_ns == before
