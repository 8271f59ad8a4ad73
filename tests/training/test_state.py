"""Resume: signals mid-epoch, kill -9 at seeded random moments, exact continuation.

A resumed run must end with the very parameters of an uninterrupted one (CPU, deterministic
mode, 0 or 2 workers): the checkpoint carries the model, optimizer, schedule, global RNG states,
the miner's generator (``mining.max_triplets`` draws from it here) and the sampler position.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from facenet.checkpoint import load_checkpoint, remove_stale_temporary_files, save_checkpoint
from facenet.config import load_config
from facenet.training.engine import Trainer
from facenet.training.run import run_training

ROOT = Path(__file__).resolve().parents[2]
EPOCHS, STEPS = 3, 3
TINY = [
    "data.synthetic_identities=8",
    "data.synthetic_images_per_identity=4",
    "data.synthetic_heldout_identities=10",
    "data.synthetic_pairs_per_fold=6",
    "data.image_size=16",
    "data.p=4",
    "data.k=2",
    f"train.steps_per_epoch={STEPS}",
    f"train.epochs={EPOCHS}",
    "train.device=cpu",
    "train.deterministic=true",
    "mining.max_triplets=5",
    "eval.every=0",
    "logging.tensorboard=false",
    "logging.progress=false",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    from facenet.wings.demo.synthetic import prepare_synthetic_data

    root = tmp_path_factory.mktemp("synthetic")
    prepare_synthetic_data(root, load_config(None, TINY).data)
    return root


# Each mode draws randomness somewhere else: augmentation and the semi-hard draws (all), the
# loader's seed from the global generator (seed triplets), the classifier head and a step
# schedule (one pass), the replayed dropout/BatchNorm state (gradient caching).
MODES = {
    "pk-two-pass": [],
    "seed-triplets": [
        "data.dataset=triplets",
        "data.triplets_per_epoch=40",
        "data.triplet_batch_size=4",
    ],
    "one-pass-ce-sgd-step": [
        "mining.passes=1",
        "loss.ce_weight=0.5",
        "optim.name=sgd",
        "optim.schedule=step",
        "optim.step_size=1",
    ],
    "gradient-caching": ["train.chunk_size=2"],
    # The schedule is stepped per batch: a stop mid-epoch falls inside the warm-up (4 steps),
    # then decays at every epoch boundary; the backbone's rate a thousandth of the head's.
    "per-step-warmup-step-decay": [
        "optim.schedule=step",
        "optim.step_size=1",
        "optim.gamma=0.5",
        "optim.warmup_steps=4",
        "optim.backbone_lr_scale=0.001",
    ],
    # Per-sample seeds: which worker loads a sample does not change its augmentation.
    "two-workers": ["data.num_workers=2"],
}


def tiny_config(out, data_root, mode="pk-two-pass", *extra):
    root = data_root / "train" if "data.dataset=triplets" in MODES[mode] else data_root
    cfg = load_config(None, [*TINY, f"data.root={root}", *MODES[mode], *extra])
    cfg.logging.out_dir = str(out)
    return cfg


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_root):
    """mode -> last.pt of an uninterrupted run, made once per mode."""
    runs = {}

    def last_checkpoint(mode):
        if mode not in runs:
            out = tmp_path_factory.mktemp(f"uninterrupted-{mode}")
            assert run_training(tiny_config(out, data_root, mode)) == 0
            runs[mode] = load_checkpoint(out / "last.pt")
        return runs[mode]

    return last_checkpoint


def assert_same_training_state(a: dict, b: dict):
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(
                torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][index][name])
            ), (index, name)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert a["scheduler"] == b["scheduler"]
    assert a["epoch"] == b["epoch"] and a["partial"] is None and b["partial"] is None


def signal_during_steps(monkeypatch, steps: set[int], times: int = 1):
    """SIGINT raised ``times`` times inside the given training steps (1-based, over the run)."""
    original = Trainer.train_step
    count = {"steps": 0}

    def train_step(self, *args, **kwargs):
        count["steps"] += 1
        if count["steps"] in steps:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", train_step)


MID_EPOCH = (STEPS + 2, {"epoch": 2, "steps_done": 2})
END_OF_EPOCH = (STEPS, None)


@pytest.mark.parametrize(
    "mode, stop",
    [
        ("pk-two-pass", MID_EPOCH),
        ("pk-two-pass", END_OF_EPOCH),
        ("seed-triplets", MID_EPOCH),
        ("one-pass-ce-sgd-step", MID_EPOCH),
        ("gradient-caching", MID_EPOCH),
        ("per-step-warmup-step-decay", MID_EPOCH),
        ("two-workers", MID_EPOCH),
    ],
    ids=[
        "mid-epoch",
        "end-of-epoch",
        "seed-triplets",
        "one-pass",
        "gradient-caching",
        "per-step-warmup",
        "two-workers",
    ],
)
def test_signal_then_resume_reaches_the_uninterrupted_parameters(
    tmp_path, data_root, uninterrupted, monkeypatch, capsys, mode, stop
):
    stop_step, partial = stop
    cfg = tiny_config(tmp_path, data_root, mode)
    with monkeypatch.context() as patch:
        signal_during_steps(patch, {stop_step})
        assert run_training(cfg) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "stopped by SIGINT" in err and "--resume continues with" in err
    stopped = load_checkpoint(tmp_path / "last.pt")
    assert stopped["partial"] == partial
    assert stopped["epoch"] == (1 if partial else stop_step // STEPS)
    assert isinstance(stopped["miner_rng"], torch.Tensor)
    # The schedule stands at the batches trained so far: every step, not every epoch.
    done = (partial["epoch"] - 1) * STEPS + partial["steps_done"] if partial else stop_step
    assert stopped["scheduler"]["position"] == done

    assert run_training(cfg, resume=True) == 0
    assert "resumed from" in capsys.readouterr().out
    resumed = load_checkpoint(tmp_path / "last.pt")
    assert_same_training_state(resumed, uninterrupted(mode))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == list(range(1, EPOCHS + 1))


def test_second_signal_stops_at_once_and_leaves_no_temporary_file(
    tmp_path, data_root, monkeypatch, capsys
):
    signal_during_steps(monkeypatch, {2}, times=2)
    assert run_training(tiny_config(tmp_path, data_root)) == 130
    assert "second signal" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*.tmp"))


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f".last.pt.{int(dead.stdout)}.tmp"
    own = tmp_path / f".last.pt.{os.getpid()}.tmp"
    unrelated = tmp_path / ".notes.tmp"
    for path in (stale, own, unrelated):
        path.write_bytes(b"partial")
    assert remove_stale_temporary_files(tmp_path) == [stale]
    assert not stale.exists() and own.exists() and unrelated.exists()


def _write_checkpoints(path: Path, weights: torch.Tensor, pause_pipe: int | None) -> None:
    """The child of a fork: rewrite ``path`` with a counter until killed.

    With ``pause_pipe``, the second write stops between writing its data and the rename and
    says so on the pipe: the parent's kill then lands mid-write for certain.
    """
    try:
        for counter in range(1, 10**9):
            if pause_pipe is not None and counter == 2:

                def fsync_then_wait(fd):
                    os.write(pause_pipe, b"x")
                    time.sleep(3600)

                os.fsync = fsync_then_wait  # this child's copy of the module only
            weights.fill_(counter)
            save_checkpoint({"counter": counter, "weights": weights}, path)
    finally:
        os._exit(0)


@pytest.mark.parametrize("seed", [None, 1, 2], ids=["mid-write", "seed-1", "seed-2"])
def test_kill_9_while_writing_checkpoints_leaves_a_loadable_last_pt(tmp_path, seed):
    moment = "mid-write" if seed is None else "random"
    path = tmp_path / "last.pt"
    weights = torch.zeros(1_000_000)  # 4 MB
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _write_checkpoints(path, weights, write_end if moment == "mid-write" else None)
    if moment == "mid-write":
        assert os.read(read_end, 1) == b"x"
    else:
        while not path.exists():
            time.sleep(0.001)
        time.sleep(random.Random(seed).uniform(0.0, 0.3))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read_end)
    os.close(write_end)
    temporary = list(tmp_path.glob(".last.pt.*.tmp"))
    if moment == "mid-write":
        assert len(temporary) == 1  # the kill did land mid-write
    state = load_checkpoint(path)  # never torn: the previous file or the new one
    assert torch.all(state["weights"] == state["counter"])
    assert state["counter"] == 1 or moment == "random"
    remove_stale_temporary_files(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def _train_command(out: Path, data_root: Path, epochs: int) -> list[str]:
    sets = [
        item
        for setting in [
            *TINY,
            f"train.epochs={epochs}",
            "train.steps_per_epoch=4",
            "data.image_size=32",
            f"data.root={data_root}",
        ]
        for item in ("--set", setting)
    ]
    return [
        sys.executable,
        "-u",
        str(ROOT / "scripts" / "train.py"),
        "--config",
        "configs/demo.yaml",
        "--out",
        str(out),
        "--resume",
        *sets,
    ]


def _start(command):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _kill_after_training_starts(proc, delay: float) -> int:
    """SIGKILL ``delay`` seconds into training; the exit status (-9 if it was still running)."""
    for line in proc.stdout:  # the first epoch line: imports and data are done
        if line.startswith(("epoch ", "resumed")):
            break
    time.sleep(delay)
    proc.kill()
    return proc.wait()


@pytest.mark.slow
def test_kill_9_at_seeded_random_moments_then_resume_matches_an_uninterrupted_run(
    tmp_path, data_root
):
    epochs = 30
    reference = _start(_train_command(tmp_path / "reference", data_root, epochs))
    assert reference.wait() == 0
    out = tmp_path / "killed"
    rng = random.Random(2024)
    for _ in range(3):
        status = _kill_after_training_starts(
            _start(_train_command(out, data_root, epochs)), rng.uniform(0.0, 0.8)
        )
        assert status == -signal.SIGKILL  # killed while training, not after it
        if (out / "last.pt").exists():
            state = load_checkpoint(out / "last.pt")
            assert 0 <= state["epoch"] <= epochs and state["partial"] is None
    final = _start(_train_command(out, data_root, epochs))
    output = final.communicate()[0]
    assert final.returncode == 0, output
    assert_same_training_state(
        load_checkpoint(out / "last.pt"), load_checkpoint(tmp_path / "reference" / "last.pt")
    )
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == list(range(1, epochs + 1))


def test_resume_with_another_epoch_length_is_refused_naming_it(tmp_path, data_root, capsys):
    cfg = tiny_config(tmp_path, data_root, "pk-two-pass", "optim.schedule=step", "train.epochs=1")
    assert run_training(cfg) == 0
    longer = tiny_config(
        tmp_path,
        data_root,
        "pk-two-pass",
        "optim.schedule=step",
        f"train.steps_per_epoch={STEPS + 1}",
    )
    assert run_training(longer, resume=True) == 2
    err = capsys.readouterr().err
    assert f"an epoch is now {STEPS + 1} steps" in err and f"epochs of {STEPS}" in err
    # The step schedule does not depend on the run's length: it may grow.
    assert (
        run_training(
            tiny_config(tmp_path, data_root, "pk-two-pass", "optim.schedule=step"), resume=True
        )
        == 0
    )
    assert load_checkpoint(tmp_path / "last.pt")["scheduler"]["position"] == EPOCHS * STEPS
