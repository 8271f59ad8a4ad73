"""Every command picks its torch CPU threads itself: ``--threads`` (for training, a shorthand
for ``train.threads``), default 1, set before the command's first torch work; no environment
variable."""

from __future__ import annotations

import argparse
from importlib import import_module
from pathlib import Path

import pytest
import torch

from facenet.cli.common import add_threads_argument
from facenet.cli.train import main as train_main
from facenet.config import load_config, max_threads
from facenet.distributed import set_threads
from facenet.errors import ConfigError
from facenet.training.run import run_training

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_threads_argument(parser)
    return parser.parse_args(argv)


def test_threads_default_to_one_and_zero_keeps_torch_s_default():
    assert _parse([]).threads == 1
    assert _parse(["--threads", "0"]).threads == 0
    torch.set_num_threads(3)
    set_threads(0)
    assert torch.get_num_threads() == 3
    set_threads(2)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize(
    "value, message",
    [
        ("-1", "-1 is out of range; allowed: [0, 8]"),
        ("9", "9 is out of range; allowed: [0, 8]"),  # 4 per core
        ("1024", "1024 is out of range; allowed: [0, 8]"),  # std::bad_alloc under a memory limit
        ("10" * 3000, "is not an integer"),  # past Python's 4,300 digits: refused, not parsed
        ("2.5", "'2.5' is not an integer"),
        ("nan", "'nan' is not an integer"),
        ("", "'' is not an integer"),
    ],
)
def test_a_bad_thread_count_is_one_argparse_line_and_exit_2(value, message, capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(SystemExit) as exit_info:
        _parse(["--threads", value])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert "error: argument --threads: " in last and message in last


# Each command with arguments that fail on a missing file, after the threads are set.
COMMANDS = {
    "embed": ["--checkpoint", "{x}", "--images", "{x}", "--out", "{out}/e.npz"],
    "evaluate": ["--distances", "{x}", "--out", "{out}"],
    "identify": ["--gallery", "{x}", "--probes", "{x}", "--out", "{out}"],
    "export": ["--checkpoint", "{x}", "--format", "weights", "--out", "{out}/m.pt"],
    "align": ["{x}", "{out}/aligned"],
    "make_synthetic": ["{out}/data", "--config", "{x}"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_sets_its_threads_before_its_work(command, tmp_path, capsys):
    main = import_module(f"facenet.cli.{command}").main
    argv = [a.format(x=tmp_path / "missing", out=tmp_path) for a in COMMANDS[command]]
    torch.set_num_threads(2)
    assert main(argv) == 2  # the missing file, reported on one line
    assert str(tmp_path / "missing") in capsys.readouterr().err
    assert torch.get_num_threads() == 1  # the default
    assert main([*argv, "--threads", "3"]) == 2
    assert torch.get_num_threads() == 3


def test_make_pairs_runs_no_torch_and_has_no_threads_option():
    parser = import_module("facenet.cli.make_pairs").get_args_parser()
    assert "--threads" not in parser.format_help()


def test_train_threads_is_a_checked_config_key(tmp_path):
    demo = str(ROOT / "configs" / "demo.yaml")
    assert load_config(demo).train.threads == 1
    assert load_config(demo, ["train.threads=0"]).train.threads == 0
    for bad in ("-1", "1025", "two", "1.5", "true"):
        with pytest.raises(ConfigError, match=r"train\.threads") as err:
            load_config(demo, [f"train.threads={bad}"])
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["9", "1024"])
def test_train_s_threads_flag_has_the_commands_bound(value, capsys, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    demo = str(ROOT / "configs" / "demo.yaml")
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--config", demo, "--threads", value, "--print-config"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert f"error: argument --threads: {value} is out of range; allowed: [0, 8]" in last


def test_train_threads_key_has_the_commands_bound(capsys):
    demo, bound = str(ROOT / "configs" / "demo.yaml"), max_threads()
    assert load_config(demo, [f"train.threads={bound}"]).train.threads == bound
    # 1024: std::bad_alloc under a memory limit (this machine has fewer than 256 cores)
    for bad in (bound + 1, 1024):
        argv = ["--config", demo, "--set", f"train.threads={bad}", "--print-config"]
        assert train_main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "train.threads: " in err and f"[0, {bound}]" in err


def test_run_training_sets_the_threads_first(tmp_path, capsys):
    cfg = load_config(str(ROOT / "configs" / "demo.yaml"), ["train.threads=3"])
    cfg.logging.out_dir = str(tmp_path / "a_file")
    (tmp_path / "a_file").write_text("not a run directory")
    torch.set_num_threads(2)
    assert run_training(cfg) == 2  # refused before any data or model work
    assert "a_file" in capsys.readouterr().err
    assert torch.get_num_threads() == 3
    cfg.train.threads = 0  # torch's default: the count it gives is what config.yaml records
    torch.set_num_threads(2)
    assert run_training(cfg) == 2
    assert torch.get_num_threads() == cfg.train.threads == 2


def test_the_makefile_and_readme_commands_need_no_thread_variable():
    for doc in ("Makefile", "README.md", "docs/usage.md", "docs/configuration.md"):
        assert "OMP_NUM_THREADS" not in (ROOT / doc).read_text(), doc


def test_the_run_records_its_threads(tiny_run):
    assert load_config(str(tiny_run["run"] / "config.yaml")).train.threads == 1


def test_train_threads_option_is_train_threads(tmp_path, capsys):
    demo = str(ROOT / "configs" / "demo.yaml")
    assert train_main(["--config", demo, "--threads", "4", "--print-config"]) == 0
    assert "threads: 4" in capsys.readouterr().out
    # The option wins over --set, as a later --set would.
    assert (
        train_main(
            ["--config", demo, "--set", "train.threads=2", "--threads", "0", "--print-config"]
        )
        == 0
    )
    assert "threads: 0" in capsys.readouterr().out
    for bad in ("-1", "1025", "x"):
        with pytest.raises(SystemExit) as exit_info:
            train_main(["--config", demo, "--threads", bad])
        assert exit_info.value.code == 2
        assert "argument --threads" in capsys.readouterr().err
