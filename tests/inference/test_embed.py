"""Embedding folders: listing, unreadable files left out, facenet-embed end to end."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from facenet.cli import embed as embed_script
from facenet.data.folder import list_images
from facenet.data.images import read_image
from facenet.inference.embed import embed_folder
from facenet.inference.loading import load_model

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
    result = embed_folder(trained.model, root, 32, batch_size=4)
    assert [p for p, _ in result.unreadable] == [str(bad)]
    assert str(bad) not in result.paths and len(result.paths) == 18
    transform = trained.transform()
    with torch.no_grad():
        brute = torch.cat([trained.model(transform(read_image(p))[None]) for p in result.paths])
    assert torch.allclose(result.embeddings, brute, atol=1e-6)
    flipped = embed_folder(trained.model, root, 32, batch_size=5, flip=True)
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
