"""Embedding folders: listing, unreadable files left out, facenet-embed end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from facenet.checkpoint import load_checkpoint
from facenet.cli import embed as embed_script
from facenet.data.folder import list_images
from facenet.data.images import read_image
from facenet.errors import DataError
from facenet.evaluation.presets import VerifySettings as S
from facenet.wings.after_training.embed import embed_folder
from facenet.wings.after_training.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_list_images_labels_by_top_folder_and_skips_hidden(tmp_path):
    for name in ("b/x.png", "a/deeper/y.jpg", "a/z.PNG", "top.png", ".hidden/q.png", "a/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    paths, labels = list_images(tmp_path)
    names = [str(Path(p).relative_to(tmp_path)) for p in paths]
    assert names == ["a/deeper/y.jpg", "a/z.PNG", "b/x.png", "top.png"]
    assert labels == ["a", "a", "b", ""]


def identity_folder_with_a_corrupt_file(tiny_run, tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "faces"
    for identity in sorted(p for p in tiny_run["heldout"].iterdir() if p.is_dir())[:3]:
        shutil.copytree(identity, root / identity.name)
    bad = root / sorted(p.name for p in root.iterdir())[0] / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    return root, bad


def test_embed_folder_equals_one_image_at_a_time(tiny_run, tmp_path):
    root, bad = identity_folder_with_a_corrupt_file(tiny_run, tmp_path)
    trained = load_model(tiny_run["checkpoint"])
    result = embed_folder(trained.model, root, 32, S(batch_size=4))
    assert [p for p, _ in result.unreadable] == [str(bad)]
    assert str(bad) not in result.paths and len(result.paths) == 18
    transform = trained.transform()
    with torch.no_grad():
        brute = torch.cat([trained.model(transform(read_image(p))[None]) for p in result.paths])
    assert torch.allclose(result.embeddings, brute, atol=1e-6)
    flipped = embed_folder(trained.model, root, 32, S(flip=True, batch_size=5))
    assert flipped.embeddings.shape == (18, 256)
    assert torch.allclose(flipped.embeddings[:, :128], brute, atol=1e-6)


def test_embed_script_writes_the_npz_and_names_unreadable_files(tiny_run, tmp_path, capsys):
    root, bad = identity_folder_with_a_corrupt_file(tiny_run, tmp_path)
    out = tmp_path / "faces.npz"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--images", str(root), "--out", str(out)]
    assert embed_script.main([*argv, "--batch-size", "7"]) == 0
    captured = capsys.readouterr()
    assert "embedded 18 images (128-D)" in captured.out and "1 unreadable" in captured.out
    assert str(bad) in captured.err
    with np.load(out, allow_pickle=False) as data:
        assert data["embeddings"].dtype == np.float32 and data["embeddings"].shape == (18, 128)
        assert data["paths"].shape == (18,) and set(data["labels"]) == {
            p.name for p in root.iterdir()
        }
        assert np.allclose(np.linalg.norm(data["embeddings"], axis=1), 1.0, atol=1e-5)


def test_a_flat_folder_has_empty_labels(tiny_run, tmp_path, capsys):
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(tiny_run["heldout"].glob("*/*.png"))[:3]:
        shutil.copy(path, flat / path.name)
    out = tmp_path / "flat.npz"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--images", str(flat), "--out", str(out)]
    assert embed_script.main([*argv, "--no-progress"]) == 0
    with np.load(out) as data:
        assert data["embeddings"].shape == (3, 128) and data["labels"].shape == (0,)


def test_bad_input_is_one_line(tiny_run, tmp_path, capsys):
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--out", str(tmp_path / "o.npz")]
    assert embed_script.main([*argv, "--images", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: image folder not found")
    (tmp_path / "empty").mkdir()
    assert embed_script.main([*argv, "--images", str(tmp_path / "empty")]) == 2
    assert "no readable image" in capsys.readouterr().err


def test_list_images_follows_a_linked_identity_folder(tmp_path):
    (tmp_path / "data" / "ann").mkdir(parents=True)
    (tmp_path / "data" / "ann" / "1.png").write_bytes(b"")
    (tmp_path / "faces").mkdir()
    (tmp_path / "faces" / "ann").symlink_to(tmp_path / "data" / "ann")
    assert list_images(tmp_path / "faces") == ([str(tmp_path / "faces" / "ann" / "1.png")], ["ann"])


def small_folder(tiny_run, tmp_path) -> Path:
    root = tmp_path / "faces"
    for identity in sorted(p for p in tiny_run["heldout"].iterdir() if p.is_dir())[:2]:
        shutil.copytree(identity, root / identity.name)
    return root


def test_flip_never_records_a_threshold_chosen_without_flip(tiny_run, tmp_path, capsys):
    root = small_folder(tiny_run, tmp_path)
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--images", str(root), "--no-progress"]
    argv.append("--overwrite")  # each run replaces the last one's file
    out = tmp_path / "o.npz"
    assert embed_script.main([*argv, "--out", str(out), "--flip"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the stored threshold") and len(err.splitlines()) == 1
    assert "flip: chosen without flip, here with" in err and "--threshold" in err
    assert not out.exists()
    assert embed_script.main([*argv, "--out", str(out), "--flip", "--no-threshold"]) == 0
    assert "threshold: none recorded (--no-threshold)" in capsys.readouterr().out
    with np.load(out) as data:
        assert "threshold" not in data.files and bool(data["flip"])
    given = ["--flip", "--threshold", "1.5", "--distance", "euclidean"]
    assert embed_script.main([*argv, "--out", str(out), *given]) == 0
    with np.load(out) as data:
        record = json.loads(str(data["threshold_record"]))
        assert (float(data["threshold"]), str(data["threshold_distance"])) == (1.5, "euclidean")
        assert record["flip"] is True and record["weights_sha256"] == str(data["weights_sha256"])
    capsys.readouterr()
    assert embed_script.main([*argv, "--out", str(out)]) == 0  # no flip: the stored one fits
    printed = capsys.readouterr().out
    assert printed.count("threshold: ") == 1 and "chosen on validation pairs" in printed


def test_a_checkpoint_stamps_its_own_epochs_threshold_or_none(tiny_run, tmp_path, capsys):
    """last.pt never gets best.pt's threshold: each checkpoint reads its own epoch's."""
    root = small_folder(tiny_run, tmp_path)
    state = load_checkpoint(tiny_run["checkpoint"])
    state["model"]["embedding.bn.bias"] += 0.01  # other weights, the same epoch's record
    torch.save(state, tmp_path / "moved.pt")
    argv = ["--images", str(root), "--out", str(tmp_path / "o.npz"), "--no-progress"]
    assert embed_script.main([*argv, "--checkpoint", str(tmp_path / "moved.pt")]) == 2
    assert "weights: chosen for" in capsys.readouterr().err
    state["epoch"] += 1  # an epoch that was not validated: nothing saved for it
    torch.save(state, tmp_path / "unvalidated.pt")
    assert embed_script.main([*argv, "--checkpoint", str(tmp_path / "unvalidated.pt")]) == 0
    assert "threshold: none saved with" in capsys.readouterr().out
    with np.load(tmp_path / "o.npz") as data:
        assert "threshold" not in data.files


def test_non_finite_weights_and_embeddings_are_refused_by_name(tiny_run, tmp_path, capsys):
    root = small_folder(tiny_run, tmp_path)
    state = load_checkpoint(tiny_run["checkpoint"])
    state["model"]["embedding.bn.weight"][3] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    argv = ["--images", str(root), "--out", str(tmp_path / "o.npz")]
    assert embed_script.main([*argv, "--checkpoint", str(tmp_path / "nan.pt")]) == 2
    err = capsys.readouterr().err
    assert "nan.pt" in err and "embedding.bn.weight" in err and len(err.splitlines()) == 1

    class NanSecondRow(torch.nn.Module):  # a network whose second output row is NaN
        def __init__(self):
            super().__init__()
            self.inner = load_model(tiny_run["checkpoint"]).model

        def forward(self, images):
            out = self.inner(images).clone()
            out[1] = float("nan")
            return out

    with pytest.raises(DataError, match="1 embedding row") as caught:
        embed_folder(NanSecondRow(), root, 32, S(batch_size=100))
    paths, _ = list_images(root)
    assert f"rows 1 ({paths[1]})" in str(caught.value)


def test_batch_size_below_one_is_an_argparse_error(tiny_run, tmp_path, capsys):
    argv = ["--checkpoint", "x.pt", "--images", str(tmp_path), "--out", str(tmp_path / "o.npz")]
    for bad in ("0", "-3", "two"):
        with pytest.raises(SystemExit) as caught:
            embed_script.main([*argv, "--batch-size", bad])
        assert caught.value.code == 2 and "--batch-size" in capsys.readouterr().err
