"""train.py end to end on tiny settings: bad input, full disk, untrusted checkpoints, signals.

Every bad input ends with exit code 2 and one ``error:`` line naming the file or the key,
never a traceback; a run of non-finite losses ends with exit code 3.
"""

import ast
import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from facenet.checkpoint import load_checkpoint, save_checkpoint
from facenet.cli import train as train_script
from facenet.training.state import _changed_settings

ROOT = Path(__file__).resolve().parents[2]

TINY = [
    "data.image_size=16",
    "data.p=2",
    "data.k=2",
    "train.epochs=1",
    "train.steps_per_epoch=2",
    "train.device=cpu",
    "eval.every=0",
    "logging.tensorboard=false",
    "logging.progress=false",
]
SYNTHETIC = [
    "data.synthetic_identities=6",
    "data.synthetic_images_per_identity=3",
    "data.synthetic_heldout_identities=10",
    "data.synthetic_pairs_per_fold=6",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    return tmp_path_factory.mktemp("synthetic")


def write_face(path: Path, mode: str = "RGB", seed: int = 0) -> Path:
    """A small random image file in the given PIL mode (RGB, L, RGBA)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, size=(20, 20, channels), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode).save(path)
    return path


def make_folder(root: Path, counts: dict, mode: str = "RGB") -> Path:
    """``root/<id>/<id>_000N.png`` with ``counts[id]`` images each."""
    for number, (identity, count) in enumerate(counts.items()):
        (root / identity).mkdir(parents=True, exist_ok=True)
        for index in range(1, count + 1):
            write_face(root / identity / f"{identity}_{index:04d}.png", mode, 100 * number + index)
    return root


def train(capsys, out, *settings, flags=(), data=None):
    """Run ``train.py`` in this process; (exit code, stdout, stderr)."""
    data = data or []
    argv = ["--config", "configs/demo.yaml", "--out", str(out), *flags]
    for setting in [*TINY, *data, *settings]:
        argv += ["--set", setting]
    code = train_script.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def folder_data(root: Path) -> list:
    return ["data.dataset=folder", f"data.root={root}"]


def synthetic_data(root: Path) -> list:
    return [*SYNTHETIC, f"data.root={root}"]


def assert_one_error_line(err: str, *needles: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


# --------------------------------------------------------------------------- images


def test_grayscale_rgba_corrupt_and_empty_folders_train_with_one_line_warnings(tmp_path, capsys):
    root = make_folder(tmp_path / "faces", {"anna": 2, "bob": 2})
    make_folder(root, {"gray": 2}, mode="L")
    make_folder(root, {"alpha": 2}, mode="RGBA")
    truncated = root / "anna" / "anna_0003.jpg"
    truncated.write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 40)  # a download cut short
    (root / "empty").mkdir()
    code, out, err = train(capsys, tmp_path / "run", data=folder_data(root))
    assert code == 0, err
    assert "epoch 1/1" in out
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert any("skipped 1 corrupt" in w and str(truncated) in w for w in warnings), err
    assert any("ignored 1 identity folder" in w and "empty" in w for w in warnings), err
    assert "Traceback" not in err


def test_a_recordio_set_trains_with_one_config_line(tmp_path, capsys):
    from facenet.data.recordio import write_insightface

    faces = make_folder(tmp_path / "faces", {"anna": 3, "bob": 3, "carl": 3})
    identities = [sorted((faces / name).iterdir()) for name in ("anna", "bob", "carl")]
    write_insightface(tmp_path / "rec", identities, (20, 20))
    data = ["data.dataset=recordio", f"data.root={tmp_path / 'rec'}"]
    code, out, err = train(capsys, tmp_path / "run", data=data)
    assert code == 0, err
    assert "epoch 1/1" in out and "Traceback" not in err
    held = train(capsys, tmp_path / "held", "eval.heldout_identities=2", data=data)
    assert held[0] == 2
    assert_one_error_line(held[2], "eval.heldout_identities", "data.dataset: folder")


def test_corrupt_image_with_on_corrupt_error_stops_naming_file_and_option(tmp_path, capsys):
    root = make_folder(tmp_path / "faces", {"anna": 2, "bob": 2})
    truncated = root / "bob" / "bob_0003.png"
    truncated.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 30)
    code, _, err = train(capsys, tmp_path / "run", "data.on_corrupt=error", data=folder_data(root))
    assert code == 2
    assert_one_error_line(err, str(truncated), "data.on_corrupt")


def identities_of_last_batch(folder_root: Path, p: int, k: int) -> list[str]:
    """The identities the seeded sampler puts in the last batch of epoch 1 (one pass)."""
    from facenet.data import IdentityFolder, PKSampler

    dataset = IdentityFolder(folder_root)
    sampler = PKSampler(dataset.targets, p=p, k=k, seed=0)
    sampler.set_epoch(1)
    last = list(sampler)[-1]
    return sorted({dataset.classes[dataset.targets[i]] for i in last})


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "in-a-worker"])
def test_undecodable_image_mid_training_checkpoints_and_resume_continues(tmp_path, capsys, workers):
    names = [f"person{i}" for i in range(8)]
    root = make_folder(tmp_path / "faces", dict.fromkeys(names, 2))
    victim = identities_of_last_batch(root, p=2, k=2)[0]  # met at step 4 of 4
    # Passes the checks short of decoding (a valid 8 x 8 frame header, the end marker) but holds
    # no image.
    bad = root / victim / f"{victim}_0002.jpg"
    (root / victim / f"{victim}_0002.png").unlink()
    sof = b"\xff\xc0\x00\x11\x08\x00\x08\x00\x08\x03" + b"\x01\x11\x00" * 3
    bad.write_bytes(b"\xff\xd8" + sof + b"\x00" * 50 + b"\xff\xd9")
    run = tmp_path / "run"
    settings = (
        "train.epochs=2",
        "train.steps_per_epoch=0",
        "train.deterministic=true",
        f"data.num_workers={workers}",
    )
    code, _, err = train(capsys, run, *settings, data=folder_data(root))
    assert code == 2
    assert_one_error_line(
        err, str(bad), "checkpoint written to", "--resume continues with step 4 of epoch 1"
    )
    assert load_checkpoint(run / "last.pt")["partial"] == {"epoch": 1, "steps_done": 3}

    bad.unlink()
    write_face(root / victim / f"{victim}_0002.png", seed=7)
    code, out, err = train(capsys, run, *settings, flags=["--resume"], data=folder_data(root))
    assert code == 0, err
    assert "continuing with step 4 of epoch 1" in out
    assert load_checkpoint(run / "last.pt")["epoch"] == 2


# --------------------------------------------------------------------------- data shape


def test_fewer_than_two_usable_identities(tmp_path, capsys):
    root = make_folder(tmp_path / "faces", {"anna": 3})
    (root / "bob").mkdir()
    code, _, err = train(capsys, tmp_path / "run", data=folder_data(root))
    assert code == 2
    assert_one_error_line(err, "data.root", str(root), "need at least 2")


def test_more_identities_per_batch_than_the_data_holds(tmp_path, capsys, synthetic_root):
    code, _, err = train(
        capsys, tmp_path / "run", "data.p=8", "data.k=2", data=synthetic_data(synthetic_root)
    )
    assert code == 2
    assert_one_error_line(err, "data.p=8", "P = 8 identities per batch, but only 6 identities")


def test_missing_dataset_folder_names_the_key(tmp_path, capsys):
    code, _, err = train(capsys, tmp_path / "run", data=folder_data(tmp_path / "nowhere"))
    assert code == 2
    assert_one_error_line(err, "data.root", "nowhere")


@pytest.mark.parametrize(
    "lines, needles",
    [
        (
            ["1\t1", "anna\t1\t9", "anna\t1\tbob\t1"],
            ["not found", "anna_0009", "line 2", "give eval.root", "eval.skip_missing: true"],
        ),
        (["1\t1", "anna\t1\t2\textra\tfield", "anna\t1\tbob\t1"], [":2:", "field(s)"]),
        (["1\t1", "anna\tone\t2", "anna\t1\tbob\t1"], [":2:", "idx1", "'one'"]),
        (["2\t1", "anna\t1\t2", "anna\t1\tbob\t1"], [":1:", "header promises"]),
    ],
    ids=["missing-image", "too-many-fields", "not-a-number", "wrong-count"],
)
def test_pairs_file_problems_name_the_file_and_line(tmp_path, capsys, lines, needles):
    root = make_folder(tmp_path / "faces", {"anna": 2, "bob": 2})
    pairs = root / "pairs.txt"
    pairs.write_text("\n".join(lines) + "\n")
    code, _, err = train(
        capsys,
        tmp_path / "run",
        "eval.every=1",
        "eval.n_folds=2",
        f"eval.pairs={pairs}",
        data=folder_data(root),
    )
    assert code == 2
    assert_one_error_line(err, str(pairs), *needles)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "setting, needles",
    [
        ("train.epoch=3", ["unknown key 'train.epoch'", "epochs"]),
        ("train.epochs=three", ["train.epochs", "expected int", "'three'"]),
        ("model.backbone=resnet9", ["model.backbone", "'resnet9'", "valid options"]),
        ("data.on_corrupt=ignore", ["data.on_corrupt", "'skip'", "'error'"]),
        ("train.device=tpu", ["train.device", "'tpu'"]),
    ],
)
def test_configuration_mistakes_name_the_key(tmp_path, capsys, setting, needles):
    code, out, err = train(capsys, tmp_path / "run", setting)
    assert code == 2
    assert_one_error_line(err, *needles)
    assert not (tmp_path / "run").exists()  # nothing was started


# --------------------------------------------------------------------------- non-finite


def test_nan_in_the_inputs_stops_naming_the_images(tmp_path, capsys, monkeypatch, synthetic_root):
    from facenet.data.batches import collate_crops
    from facenet.data.folder import IdentityFolder

    original = IdentityFolder.__getitem__

    def nan_for_one_identity(self, index):
        """A custom dataset of float images (taken as standardised), NaN for one identity."""
        pending, label = original(self, index)
        image = collate_crops([pending])[0].float() / 255  # (3, S, S)
        if "/id00003/" in self.samples[index][0]:
            image = torch.full_like(image, float("nan"))
        return image, label

    monkeypatch.setattr(IdentityFolder, "__getitem__", nan_for_one_identity)
    code, _, err = train(
        capsys, tmp_path / "run", "train.steps_per_epoch=0", data=synthetic_data(synthetic_root)
    )
    assert code == 2, err
    line = assert_one_error_line(err, "NaN or infinite", "id00003", "checkpoint written")
    assert "of 4 input images" in line


def test_nan_loss_exits_3_and_keeps_the_last_good_checkpoint(
    tmp_path, capsys, monkeypatch, synthetic_root
):
    import facenet.training.build

    build_loss = facenet.training.build.build_loss

    class NanFromStep:
        """The real loss for ``good`` steps, then NaN."""

        def __init__(self, inner, good):
            self.inner, self.good, self.calls = inner, good, 0

        @property
        def last_stats(self):
            return self.inner.last_stats

        def __call__(self, embeddings, triplets):
            self.calls += 1
            loss = self.inner(embeddings, triplets)
            return loss if self.calls <= self.good else loss * float("nan")

    monkeypatch.setattr(
        facenet.training.build, "build_loss", lambda cfg: NanFromStep(build_loss(cfg), 2)
    )
    run = tmp_path / "run"
    code, _, err = train(
        capsys,
        run,
        "train.epochs=3",
        "train.max_nonfinite_steps=2",
        data=synthetic_data(synthetic_root),
    )
    assert code == 3
    assert_one_error_line(err, "non-finite loss", "nonfinite.pt", "still holds epoch 1")
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    nonfinite = load_checkpoint(run / "nonfinite.pt")
    assert all(torch.isfinite(t).all() for t in nonfinite["model"].values())


# --------------------------------------------------------------------------- output


def test_no_space_left_while_writing_a_checkpoint(tmp_path, capsys, monkeypatch, synthetic_root):
    real_save, calls = torch.save, []

    def save_until_the_disk_is_full(obj, fh, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: half written, then the disk is full
            fh.write(b"PK\x03\x04 half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, fh, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_until_the_disk_is_full)
    run = tmp_path / "run"
    code, _, err = train(capsys, run, "train.epochs=2", data=synthetic_data(synthetic_root))
    assert code == 2
    assert_one_error_line(err, str(run / "last.pt"), "No space left", "previous checkpoint")
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    assert not list(run.glob(".*.tmp"))


def test_output_folder_that_cannot_be_created(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, _, err = train(capsys, blocker / "run")
    assert code == 2
    assert_one_error_line(err, str(blocker / "run"), "cannot create the run directory")


def test_existing_run_needs_resume_or_overwrite(tmp_path, capsys, synthetic_root):
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    assert train(capsys, run, data=data)[0] == 0
    before = (run / "last.pt").read_bytes()
    code, _, err = train(capsys, run, data=data)
    assert code == 2
    assert_one_error_line(err, str(run / "last.pt"), "--resume", "--overwrite")
    assert (run / "last.pt").read_bytes() == before
    assert train(capsys, run, flags=["--overwrite"], data=data)[0] == 0


def test_resume_with_an_incompatible_configuration(tmp_path, capsys, synthetic_root):
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    assert train(capsys, run, data=data)[0] == 0
    code, _, err = train(capsys, run, "model.embedding_dim=32", flags=["--resume"], data=data)
    assert code == 2
    assert "model.embedding_dim: 128 -> 32" in err  # the warning names the change
    assert_one_error_line(err, str(run / "last.pt"), "does not fit this configuration")


# --------------------------------------------------------------------------- untrusted files


class Payload:
    """Unpickling calls open(marker, "w"): a file appears if the pickle is run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_last_pt_is_refused_on_resume_and_runs_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    marker = tmp_path / "created_by_payload"
    torch.save({"model": Payload(str(marker)), "epoch": 1}, run / "last.pt")
    code, out, err = train(capsys, run, flags=["--resume"])
    assert code == 2
    assert_one_error_line(err, str(run / "last.pt"), "refused", "weights_only")
    assert not marker.exists()
    assert "epoch" not in out


def test_a_safe_file_that_is_not_a_training_checkpoint_is_refused(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"weights": torch.ones(3)}, run / "last.pt")
    code, _, err = train(capsys, run, flags=["--resume"])
    assert code == 2
    assert_one_error_line(err, "not a training checkpoint", "model")


def test_yaml_python_tag_is_refused_on_one_line_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "created_by_yaml"
    config = tmp_path / "evil.yaml"
    config.write_text(f"train: !!python/object/apply:builtins.open ['{marker}', 'w']\n")
    code = train_script.main(["--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2
    assert_one_error_line(err, str(config), "python/object/apply:builtins.open")
    assert not marker.exists()


def test_no_subprocess_call_uses_a_shell():
    calls = []
    for folder in ("facenet", "scripts", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call):
                    for keyword in node.keywords:
                        if keyword.arg == "shell" and not (
                            isinstance(keyword.value, ast.Constant) and not keyword.value.value
                        ):
                            calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert calls == []


# --------------------------------------------------------------------------- signals


def start_train(out: Path, data_root: Path, *settings: str):
    """``train.py`` in a new process (and session, so a signal can reach its whole group)."""
    argv = [
        sys.executable,
        "-u",
        str(ROOT / "scripts" / "train.py"),
        "--config",
        "configs/demo.yaml",
        "--out",
        str(out),
    ]
    for setting in [*TINY, *synthetic_data(data_root), *settings]:
        argv += ["--set", setting]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.parametrize(
    "sig, workers, to_group",
    [
        (signal.SIGTERM, 0, False),
        pytest.param(signal.SIGINT, 1, True, marks=pytest.mark.slow),
    ],
    ids=["SIGTERM-to-the-process", "ctrl-c-to-the-group-with-a-worker"],
)
def test_signal_finishes_the_step_writes_a_checkpoint_and_resume_finishes(
    tmp_path, capsys, synthetic_root, sig, workers, to_group
):
    # No schedule: the run's length may change on resume (a cosine schedule refuses that).
    settings = ("train.steps_per_epoch=3", f"data.num_workers={workers}", "optim.schedule=none")
    proc = start_train(tmp_path, synthetic_root, "train.epochs=500", *settings)
    for line in proc.stdout:
        if line.startswith("epoch 1/"):
            break
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name}" in err and "--resume continues with" in err
    assert "Traceback" not in err
    state = load_checkpoint(tmp_path / "last.pt")
    assert 1 <= state["epoch"] < 500
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stopped_by"] == sig.name

    # Two more epochs (train.epochs may change on resume) keep the test short.
    epochs = state["epoch"] + 2
    code, out, err = train(
        capsys,
        tmp_path,
        f"train.epochs={epochs}",
        *settings,
        flags=["--resume"],
        data=synthetic_data(synthetic_root),
    )
    assert code == 0, err
    assert "resumed from" in out
    assert load_checkpoint(tmp_path / "last.pt")["epoch"] == epochs


def test_collapse_warning_needs_shrunk_distances_not_just_equal_ones():
    from facenet.training.console import collapse_warning as _collapse_warning

    random_start = {"epoch": 1, "mean_dap": 1.02, "mean_dan": 1.03, "triplet_loss": 0.2}
    collapsed = {"epoch": 7, "mean_dap": 0.011, "mean_dan": 0.012, "triplet_loss": 0.199}
    learning = {"epoch": 7, "mean_dap": 0.3, "mean_dan": 0.9, "triplet_loss": 0.05}
    assert _collapse_warning(random_start, margin=0.2) is None
    assert _collapse_warning(learning, margin=0.2) is None
    assert "possible collapse at epoch 7" in _collapse_warning(collapsed, margin=0.2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu_is_one_line_exit_2(capsys, tmp_path):
    code, _, err = train(capsys, tmp_path / "run", "train.device=cuda")
    assert code == 2
    assert err.strip().splitlines() == [
        "error: train.device: device 'cuda' was asked for but no CUDA device is available"
    ]


def test_a_bug_keeps_its_traceback(capsys, tmp_path, monkeypatch, synthetic_root):
    """Only the FacenetError family (and file-system errors) become one line: an internal
    ValueError is a bug and propagates."""
    import facenet.training.engine

    def broken(self, *args, **kwargs):
        raise ValueError("internal invariant broken")

    monkeypatch.setattr(facenet.training.engine.Trainer, "train_step", broken)
    with pytest.raises(ValueError, match="internal invariant broken"):
        train(capsys, tmp_path / "run", data=synthetic_data(synthetic_root))


def test_a_second_run_on_the_same_directory_is_refused(tmp_path, capsys, synthetic_root):
    run = tmp_path / "run"
    run.mkdir()
    hold = (
        "import time; "
        "from facenet.training.run_dir import RunDirLock; "
        f"RunDirLock({str(run)!r}).acquire(); print('held', flush=True); "
        "time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, _, err = train(capsys, run, data=synthetic_data(synthetic_root))
    finally:
        holder.kill()
        holder.wait()
    assert code == 2
    assert_one_error_line(err, str(run), f"process {holder.pid}")
    assert not (run / "metrics.jsonl").exists()


def test_overwrite_starts_clean(tmp_path, capsys, synthetic_root):
    run = tmp_path / "run"
    settings = ("train.epochs=2", "eval.every=1", "logging.tensorboard=true")
    code, _, err = train(capsys, run, *settings, data=synthetic_data(synthetic_root))
    assert code == 0, err
    (run / "roc_val_epoch_9.png").write_bytes(b"no run recorded writing it")
    events_before = list((run / "tensorboard").iterdir())
    code, _, err = train(
        capsys,
        run,
        "train.epochs=1",
        "logging.tensorboard=true",
        flags=["--overwrite"],
        data=synthetic_data(synthetic_root),
    )
    assert code == 0, err
    assert (run / "roc_val_epoch_9.png").exists() and not (run / "roc_val_epoch_2.png").exists()
    assert not any(p in events_before for p in (run / "tensorboard").iterdir())
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    assert not (run / ".lock").exists()


def _snapshot(folder: Path) -> dict:
    """Every file under ``folder`` and its bytes."""
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_overwrite_in_a_folder_that_never_held_a_run_removes_nothing(
    tmp_path, capsys, synthetic_root
):
    out = tmp_path / "mine"
    for name in ("best.pt", "nonfinite.pt", "val_pairs.txt", "test_pairs.txt", "roc_a.png"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("mine")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "notes.txt").write_text("mine")
    before = _snapshot(out)
    code, _, err = train(capsys, out, flags=["--overwrite"], data=synthetic_data(synthetic_root))
    assert code == 0, err
    after = _snapshot(out)
    assert all(after[name] == data for name, data in before.items())


def test_a_file_of_the_users_with_a_run_output_name_is_refused_not_replaced(
    tmp_path, capsys, synthetic_root
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "summary.json").write_text("mine")
    code, _, err = train(capsys, out, flags=["--overwrite"], data=synthetic_data(synthetic_root))
    assert code == 2
    assert_one_error_line(err, str(out / "summary.json"), "no run recorded writing it")
    assert (out / "summary.json").read_text() == "mine"


@pytest.mark.parametrize(
    "mistake",
    ["data.root", "eval.pairs", "model.weights"],
)
def test_overwrite_with_a_mistake_leaves_the_previous_run_as_it_was(
    tmp_path, capsys, synthetic_root, mistake
):
    run = tmp_path / "run"
    code, _, err = train(capsys, run, "eval.every=1", data=synthetic_data(synthetic_root))
    assert code == 0, err
    before = _snapshot(run)
    wrong = {
        "data.root": ["data.dataset=folder", f"data.root={tmp_path / 'typo'}"],
        "eval.pairs": [*synthetic_data(synthetic_root), f"eval.pairs={tmp_path / 'typo.txt'}"],
        "model.weights": [*synthetic_data(synthetic_root), f"model.weights={tmp_path / 'w.pt'}"],
    }[mistake]
    code, _, err = train(capsys, run, "eval.every=1", flags=["--overwrite"], data=wrong)
    assert code == 2
    assert_one_error_line(
        err, {"data.root": "data.root", "eval.pairs": "typo.txt"}.get(mistake, "w.pt")
    )
    assert _snapshot(run) == before


def test_overwrite_keeps_a_pairs_file_the_new_run_reads(tmp_path, capsys):
    root = make_folder(tmp_path / "faces", {f"id{i}": 3 for i in range(10)})
    run = tmp_path / "run"
    held = ["eval.every=1", "eval.heldout_identities=4", "eval.heldout_pairs_per_fold=1"]
    code, _, err = train(capsys, run, *held, "eval.n_folds=2", data=folder_data(root))
    assert code == 0, err
    pairs = (run / "test_pairs.txt").read_text()
    given = [f"eval.pairs={run / 'test_pairs.txt'}", f"eval.root={root}", "eval.n_folds=2"]
    code, _, err = train(capsys, run, *held, *given, flags=["--overwrite"], data=folder_data(root))
    assert code == 0, err
    assert (run / "test_pairs.txt").read_text() == pairs


def test_ctrl_c_before_training_says_no_checkpoint_was_written(
    tmp_path, capsys, synthetic_root, monkeypatch
):
    import facenet.training.loop

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    # during the first evaluation
    monkeypatch.setattr(facenet.training.loop, "validate", interrupted)
    code, _, err = train(
        capsys, tmp_path / "run", "eval.every=1", data=synthetic_data(synthetic_root)
    )
    assert code == 130
    assert_one_error_line(err, "interrupted; no checkpoint was written")


def test_resume_with_another_length_of_a_cosine_schedule_is_refused(
    tmp_path, capsys, synthetic_root
):
    run = tmp_path / "run"
    code, _, err = train(capsys, run, "train.epochs=1", data=synthetic_data(synthetic_root))
    assert code == 0, err
    code, _, err = train(
        capsys, run, "train.epochs=3", flags=["--resume"], data=synthetic_data(synthetic_root)
    )
    assert code == 2
    assert_one_error_line(err, "train.epochs: 3 differs from the checkpoint's 1", "cosine")
    code, _, err = train(
        capsys,
        run,
        "train.epochs=1",
        "optim.schedule=none",
        flags=["--overwrite"],
        data=synthetic_data(synthetic_root),
    )
    assert code == 0, err
    code, out, err = train(
        capsys,
        run,
        "train.epochs=2",
        "optim.schedule=none",
        flags=["--resume"],
        data=synthetic_data(synthetic_root),
    )
    assert code == 0, err  # no schedule: the run may grow


def test_a_validation_error_keeps_the_epochs_training(
    tmp_path, capsys, synthetic_root, monkeypatch
):
    import facenet.training.loop
    from facenet.data.images import CorruptImageError

    validate = facenet.training.loop.validate

    def failing(run, epoch):
        if epoch == 2:
            raise CorruptImageError("heldout/x.png", "damaged")
        return validate(run, epoch)

    monkeypatch.setattr(facenet.training.loop, "validate", failing)
    run = tmp_path / "run"
    settings = ("train.epochs=3", "eval.every=1", "optim.schedule=none")
    code, _, err = train(capsys, run, *settings, data=synthetic_data(synthetic_root))
    assert code == 2
    assert_one_error_line(err, "heldout/x.png", "epoch 2 trained, not validated")
    assert load_checkpoint(run / "last.pt")["epoch"] == 2  # not thrown away


def test_a_signal_during_the_final_test_lets_it_finish(
    tmp_path, capsys, synthetic_root, monkeypatch
):
    import facenet.training.loop

    test_selected = facenet.training.loop.test_selected

    def signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # the default handler would end the process here
        return test_selected(*args, **kwargs)

    monkeypatch.setattr(facenet.training.loop, "test_selected", signalled)
    run = tmp_path / "run"
    code, out, err = train(capsys, run, "eval.every=1", data=synthetic_data(synthetic_root))
    assert code == 0, err
    assert "SIGTERM received: finishing the test evaluation" in err
    assert json.loads((run / "summary.json").read_text())["test"] is not None


# --------------------------------------------------------------------------- non-square inputs


def test_a_non_square_run_trains_evaluates_embeds_and_exports(tmp_path, capsys):
    """data.image_size [24, 20] (H x W) through every command: train (validation included),
    evaluate, embed, export (onnx and pt2 with parity, weights) and load_model."""
    from facenet.cli import embed as embed_script
    from facenet.cli import evaluate as evaluate_script
    from facenet.cli import export as export_script
    from facenet.wings.after_training.loading import load_model

    out = tmp_path / "run"
    data = [*synthetic_data(tmp_path / "data"), "eval.every=1"]
    code, _, err = train(capsys, out, "data.image_size=[24,20]", data=data)
    assert code == 0, err
    assert "image_size:\n  - 24\n  - 20\n" in (out / "config.yaml").read_text()
    checkpoint = out / "best.pt"
    assert load_checkpoint(checkpoint)["config"]["data"]["image_size"] == [24, 20]
    trained = load_model(checkpoint)
    assert trained.image_size == (24, 20)

    pairs = tmp_path / "data" / "heldout" / "test_pairs.txt"
    argv = ["--checkpoint", str(checkpoint), "--pairs", str(pairs), "--out", str(tmp_path / "e")]
    argv.append("--overwrite")  # the second run replaces the first's metrics.json
    for preprocess in ("resize", "crop"):  # crop: the 24 x 24 faces cut to 24 x 20
        assert evaluate_script.main([*argv, "--preprocess", preprocess]) == 0
    assert len(json.loads((tmp_path / "e" / "metrics.json").read_text())["accuracy"]) == 10

    npz = tmp_path / "faces.npz"
    images = tmp_path / "data" / "heldout"
    assert embed_script.main(["--checkpoint", str(checkpoint), "--images", str(images),
                              "--out", str(npz), "--no-progress"]) == 0  # fmt: skip
    with np.load(npz) as found:
        assert found["embeddings"].shape[1] == trained.embedding_dim

    for fmt in ("onnx", "pt2", "weights"):
        target = tmp_path / f"model.{fmt if fmt != 'weights' else 'pt'}"
        code = export_script.main(
            ["--checkpoint", str(checkpoint), "--format", fmt, "--out", str(target)]
        )
        assert code == 0, capsys.readouterr().err
        assert "images (B, 3, 24, 20)" in capsys.readouterr().out
    exported = load_model(tmp_path / "model.pt")
    assert exported.image_size == (24, 20)
    x = torch.randn(3, 3, 24, 20)  # (B, 3, H, W)
    with torch.no_grad():
        assert torch.equal(exported.model(x), trained.model(x))


# --------------------------------------------------------------------------- refused before removed


@pytest.mark.parametrize("clash", ["tensorboard", "model.weights", "roc_test.png", "best.pt"])
def test_overwrite_refused_on_a_name_clash_removes_nothing(tmp_path, capsys, synthetic_root, clash):
    """Every check that can refuse the new run comes before the previous run's removal."""
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    evaluated = "eval.every=1" if clash == "model.weights" else "eval.every=0"
    code, _, err = train(capsys, run, evaluated, data=data)
    assert code == 0, err
    settings = ["eval.every=1"]
    if clash == "tensorboard":  # a user's folder, where the previous run wrote no TensorBoard
        (run / "tensorboard").mkdir()
        (run / "tensorboard" / "notes.txt").write_text("mine")
        settings.append("logging.tensorboard=true")
    elif clash == "model.weights":  # the new run reads the previous run's best.pt
        settings.append(f"model.weights={run / 'best.pt'}")
    else:  # names the previous run, without evaluation, did not write
        (run / clash).write_text("mine")
    before = _snapshot(run)
    code, _, err = train(capsys, run, *settings, flags=["--overwrite"], data=data)
    assert code == 2
    line = assert_one_error_line(err, str(run / ("best.pt" if clash == "model.weights" else clash)))
    assert ("configuration reads" if clash == "model.weights" else "no run recorded") in line
    assert _snapshot(run) == before


def test_a_first_run_refuses_a_users_roc_file_before_writing_anything(
    tmp_path, capsys, synthetic_root
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "roc_test.png").write_text("mine")
    code, _, err = train(capsys, out, "eval.every=1", data=synthetic_data(synthetic_root))
    assert code == 2
    assert_one_error_line(err, str(out / "roc_test.png"), "no run recorded writing it")
    assert sorted(p.name for p in out.iterdir()) == ["roc_test.png"]
    code, _, err = train(capsys, out, "eval.every=0", data=synthetic_data(synthetic_root))
    assert code == 0, err  # a run that writes no ROC figure leaves it alone
    assert (out / "roc_test.png").read_text() == "mine"
    assert "roc_test.png" not in json.loads((out / "outputs.json").read_text())["outputs"]


@pytest.mark.parametrize(
    "setting, old",
    [
        ("optim.name=adagrad", "'sgd'"),
        ("optim.warmup_steps=3", "0"),
        ("optim.min_lr_ratio=0.5", "0.01"),
        ("optim.schedule=step", "'cosine'"),
        ("optim.freeze_backbone_epochs=1", "0"),
        ("loss.ce_weight=0", "1.0"),
    ],
)
def test_resume_with_a_changed_state_shaping_setting_is_refused_by_name(
    tmp_path, capsys, synthetic_root, setting, old
):
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    code, _, err = train(capsys, run, "optim.name=sgd", data=data)
    assert code == 0, err
    before = _snapshot(run)
    key = setting.split("=")[0]
    code, _, err = train(capsys, run, "optim.name=sgd", setting, flags=["--resume"], data=data)
    assert code == 2
    line = assert_one_error_line(err, str(run / "last.pt"), f"{key}: {old} -> ")
    assert "does not fit this configuration" in line
    assert _snapshot(run) == before  # config.yaml not rewritten with the refused settings


def test_resume_applies_a_changed_learning_rate_and_momentum(tmp_path, capsys, synthetic_root):
    """Hyper-parameters that are not state shape take the configuration's value, with a warning."""
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    fixed = ["optim.name=sgd", "optim.schedule=none"]
    assert train(capsys, run, *fixed, data=data)[0] == 0
    changed = ["optim.lr=0.25", "optim.momentum=0.5", "train.epochs=2"]
    code, _, err = train(capsys, run, *fixed, *changed, flags=["--resume"], data=data)
    assert code == 0, err
    assert "optim.lr: 0.01 -> 0.25" in err and "optim.momentum: 0.9 -> 0.5" in err
    group = load_checkpoint(run / "last.pt")["optimizer"]["param_groups"][0]
    assert (group["lr"], group["momentum"]) == (0.25, 0.5)


@pytest.mark.parametrize("config", [{"optim": 5}, {"optim": ["name", "sgd"]}, {}])
def test_a_checkpoint_whose_config_sections_are_not_mappings_is_one_line(tmp_path, capsys, config):
    run = tmp_path / "run"
    run.mkdir()
    state = {"model": {}, "optimizer": {}, "epoch": 1, "rng": {}, "config": config}
    save_checkpoint({**state, "history": [], "best_accuracy": -1.0}, run / "last.pt")
    code, _, err = train(capsys, run, flags=["--resume"], data=synthetic_data(tmp_path / "d"))
    assert code == 2
    assert_one_error_line(err, str(run / "last.pt"), "does not fit this configuration")


def test_a_changed_setting_of_any_depth_or_size_is_warned_of_in_bounded_text():
    deep = []
    for _ in range(100_000):  # a crafted checkpoint's config: repr() would recurse past the limit
        deep = [deep]
    saved = {"optim": {"lr": deep, "momentum": "x" * 10**6}, "train": {"seed": {"a": deep}}}
    changes = dict(
        _changed_settings(saved, {"optim": {"lr": 0.1, "momentum": 0.9}, "train": {"seed": 0}})
    )
    assert set(changes) == {"optim.lr", "optim.momentum", "train.seed"}
    assert all(len(text) < 500 for text in changes.values())
    assert changes["optim.lr"].endswith("-> 0.1")


def test_a_non_finite_stop_before_any_checkpoint_says_none_was_written(
    tmp_path, capsys, synthetic_root
):
    run = tmp_path / "run"
    code, _, err = train(
        capsys,
        run,
        "train.max_nonfinite_steps=1",
        "optim.lr=1e30",
        data=synthetic_data(synthetic_root),
    )
    assert code == 3
    line = assert_one_error_line(
        err, "non-finite loss", "nonfinite.pt", "no checkpoint was written"
    )
    assert "still holds" not in line and not (run / "last.pt").exists()


@pytest.mark.parametrize("link", [False, True])
def test_a_lock_file_of_the_users_is_left_alone_by_a_refused_run(tmp_path, capsys, link):
    run, target = tmp_path / "run", tmp_path / "notes.txt"
    run.mkdir()
    target.write_text("mine\n")
    if link:
        (run / ".lock").symlink_to(target)
    else:
        (run / ".lock").write_text("mine\n")
    code, _, err = train(capsys, run, "data.dataset=folder", f"data.root={tmp_path / 'missing'}")
    assert code == 2
    assert_one_error_line(err, str(run / ".lock"), "is not a run's lock file")
    assert (run / ".lock").is_symlink() == link and (run / ".lock").read_text() == "mine\n"
    assert target.read_text() == "mine\n" and sorted(p.name for p in run.iterdir()) == [".lock"]


@pytest.mark.parametrize(
    "damage", ["a missing weight", "a misshapen weight", "no optimizer", "a longer cosine"]
)
def test_a_checkpoint_that_does_not_fit_on_resume_writes_nothing(
    tmp_path, capsys, synthetic_root, damage
):
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    schedule = "optim.schedule=" + ("cosine" if damage == "a longer cosine" else "step")
    assert train(capsys, run, schedule, data=data)[0] == 0
    state = load_checkpoint(run / "last.pt")
    key = next(iter(state["model"]))
    if damage == "a missing weight":
        del state["model"][key]
    elif damage == "a misshapen weight":
        state["model"][key] = torch.zeros(3, 1, 2)
    elif damage == "no optimizer":
        state["optimizer"] = {"state": {}, "param_groups": []}
    save_checkpoint(state, run / "last.pt")
    before = _snapshot(run)
    code, _, err = train(capsys, run, schedule, "train.epochs=2", flags=["--resume"], data=data)
    assert code == 2
    assert_one_error_line(err, str(run / "last.pt"))
    assert _snapshot(run) == before  # config.yaml, outputs.json and metrics.jsonl untouched


@pytest.mark.parametrize(
    "setting, old",
    [
        ("data.synthetic_identities=8", "6"),
        ("data.synthetic_seed=1", "0"),
        ("data.synthetic_pairs_per_fold=7", "6"),
        ("data.image_size=20", "16"),
    ],
)
def test_resume_refuses_a_changed_synthetic_set_before_touching_the_data(
    tmp_path, capsys, setting, old
):
    run, data = tmp_path / "run", synthetic_data(tmp_path / "data")
    assert train(capsys, run, data=data)[0] == 0
    assert (tmp_path / "data" / "manifest.json").is_file()
    before = _snapshot(tmp_path)
    code, _, err = train(capsys, run, setting, flags=["--resume"], data=data)
    assert code == 2
    key = setting.split("=")[0]
    assert_one_error_line(err, str(run / "last.pt"), f"{key}: {old} -> ")
    assert _snapshot(tmp_path) == before  # train/, heldout/ and manifest.json as they were


def test_overwrite_refuses_a_users_file_inside_the_recorded_tensorboard_folder(
    tmp_path, capsys, synthetic_root
):
    run, data = tmp_path / "run", synthetic_data(synthetic_root)
    assert train(capsys, run, "logging.tensorboard=true", data=data)[0] == 0
    assert any((run / "tensorboard").glob("events.out.tfevents.*"))
    (run / "tensorboard" / "my_notes.txt").write_text("mine\n")
    before = _snapshot(run)
    code, _, err = train(capsys, run, "logging.tensorboard=true", flags=["--overwrite"], data=data)
    assert code == 2
    assert_one_error_line(err, str(run / "tensorboard" / "my_notes.txt"), "--overwrite removes")
    assert _snapshot(run) == before
