"""facenet-export end to end: ONNX through onnxruntime, torch.export programs, weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import facenet.wings.after_training.export as export_module
from facenet.cli import export as export_script
from facenet.data.folder import list_images
from facenet.data.images import read_image
from facenet.wings.after_training.loading import load_model, save_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[3]


def real_images(tiny_run, trained, count: int) -> torch.Tensor:
    """(count, 3, S, S) held-out faces prepared as the evaluation does."""
    paths, _ = list_images(tiny_run["heldout"])
    transform = trained.transform()
    return torch.stack([transform(read_image(p)) for p in paths[:count]])


def eager(trained, images: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return trained.model(images).numpy()


def test_onnx_runs_in_onnxruntime_at_any_batch_size(tiny_run, tmp_path, capsys):
    """The graph's input and output carry the names the command prints, and onnxruntime fed
    by those names gives the eager model's embeddings."""
    out = tmp_path / "model.onnx"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--format", "onnx", "--out", str(out)]
    assert export_script.main(argv) == 0
    printed = capsys.readouterr().out
    assert "parity: max |exported - eager| = " in printed and "limit 0.0001" in printed
    shapes = re.search(r"onnx: (\w+) \(B, 3, 32, 32\) -> (\w+) \(B, 128\)", printed)
    assert shapes, printed
    images_name, embeddings_name = shapes.groups()
    graph = onnx.load(str(out)).graph
    assert [i.name for i in graph.input] == [images_name] == ["images"]
    assert [o.name for o in graph.output] == [embeddings_name] == ["embeddings"]
    trained = load_model(tiny_run["checkpoint"])
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == ["batch", 3, 32, 32]
    for batch in (1, 5):  # traced at 2: the batch dimension is dynamic
        images = real_images(tiny_run, trained, batch)
        got = session.run([embeddings_name], {images_name: images.numpy()})[0]
        assert got.shape == (batch, 128)
        assert np.abs(got - eager(trained, images)).max() <= 1e-4
    meta = {p.key: p.value for p in onnx.load(str(out)).metadata_props}
    assert meta["image_size"] == "32" and meta["normalize"] == "fixed"


def docs_snippet() -> str:
    """The onnxruntime snippet of docs/models.md."""
    text = (ROOT / "docs" / "models.md").read_text()
    section = text.split("## Running an ONNX export without this package", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_onnxruntime_snippet_gives_the_embeddings(tiny_run, tmp_path):
    """docs/models.md's snippet, run on a held-out face against the exported file, gives the
    eager model's embedding of facenet-embed's preparation (up to Pillow's 8-bit resize)."""
    out = tmp_path / "model.onnx"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--format", "onnx", "--out", str(out)]
    assert export_script.main(argv) == 0
    trained = load_model(tiny_run["checkpoint"])
    face = list_images(tiny_run["heldout"])[0][0]
    code = docs_snippet().replace('"model.onnx"', repr(str(out))).replace('"face.png"', repr(face))
    namespace = {}
    exec(code, namespace)
    want = eager(trained, trained.transform()(read_image(face))[None])[0]  # (D,)
    got = namespace["embedding"]
    assert got.shape == want.shape and abs(np.linalg.norm(got) - 1) < 1e-5
    # measured 0.9999998; BGR order instead of RGB gives 0.989 on these faces
    assert float(got @ want) > 0.9999, float(got @ want)


def test_pt2_loads_with_torch_export_at_any_batch_size(tiny_run, tmp_path, capsys):
    out = tmp_path / "model.pt2"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--format", "pt2", "--out", str(out)]
    assert export_script.main(argv) == 0
    assert "parity" in capsys.readouterr().out
    trained = load_model(tiny_run["checkpoint"])
    extra = {export_module.EXTRA_FILE: ""}
    program = torch.export.load(str(out), extra_files=extra)
    assert json.loads(extra[export_module.EXTRA_FILE])["embedding_dim"] == "128"
    for batch in (1, 4):
        images = real_images(tiny_run, trained, batch)
        with torch.no_grad():
            got = program.module()(images).numpy()
        assert np.abs(got - eager(trained, images)).max() <= 1e-4


def test_a_parity_failure_exits_2_and_writes_nothing(tiny_run, tmp_path, capsys, monkeypatch):
    run_pt2 = export_module._run_pt2
    monkeypatch.setattr(export_module, "_run_pt2", lambda data, x: run_pt2(data, x) + 1e-3)
    out = tmp_path / "model.pt2"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--format", "pt2", "--out", str(out)]
    assert export_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: pt2 export differs from the eager model by 0.001")
    assert "not written" in err and not out.exists()


def test_weights_export_carries_the_run_threshold(tiny_run, tmp_path, capsys):
    out = tmp_path / "model.pt"
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--format", "weights", "--out", str(out)]
    assert export_script.main(argv) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and printed.count("threshold: ") == 1
    trained, again = load_model(tiny_run["checkpoint"]), load_model(out)
    saved = json.loads((tiny_run["run"] / "summary.json").read_text())["threshold"]
    assert again.verification == {
        "threshold": saved["value"],
        "threshold_distance": saved["distance"],
        "weights_sha256": trained.weights_sha256(),
        "epoch": saved["epoch"],
        "flip": False,
        "subtract_mean": False,
        "preprocess": "resize",
        "features": "unit",
        "chosen_on": "validation pairs",
    }
    assert again.weights_sha256() == saved["weights_sha256"] == trained.weights_sha256()
    images = real_images(tiny_run, trained, 2)
    assert np.array_equal(eager(again, images), eager(trained, images))


def test_an_unreadable_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    argv = ["--checkpoint", str(tmp_path / "bad.pt"), "--format", "onnx", "--out", "x.onnx"]
    assert export_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "bad.pt" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("tolerance", ["nan", "-1", "inf", "x"])
def test_a_tolerance_no_difference_can_meet_is_refused_before_any_work(tmp_path, capsys, tolerance):
    """Refused while parsing: no checkpoint is read (this one does not exist), nothing written."""
    out = tmp_path / "m.onnx"
    argv = ["--checkpoint", str(tmp_path / "absent.pt"), "--format", "onnx", "--out", str(out)]
    with pytest.raises(SystemExit):
        export_script.main([*argv, "--tolerance", tolerance])
    err = capsys.readouterr().err.splitlines()
    assert "--tolerance" in err[-1] and "absent.pt" not in err[-1] and not out.exists()


def test_a_tolerance_for_a_weights_export_is_refused_not_ignored(tmp_path, capsys):
    """A weights file is not re-run: no parity check for --tolerance to bound."""
    out = tmp_path / "m.pt"
    argv = ["--checkpoint", str(tmp_path / "absent.pt"), "--format", "weights", "--out", str(out)]
    assert export_script.main([*argv, "--tolerance", "0.5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: --tolerance goes with --format onnx or pt2: weights are not re-run"]
    assert not out.exists()


def test_a_threshold_for_other_weights_is_not_exported(tiny_run, tmp_path, capsys):
    """A weights export whose threshold was chosen for other weights (e.g. best.pt's, carried
    onto last.pt): exporting it again asks for --threshold, saying what differs."""
    trained = load_model(tiny_run["checkpoint"])
    trained.verification = {**trained.verification, "weights_sha256": "0" * 64, "epoch": 9}
    save_weights(trained, tmp_path / "model.pt")
    argv = ["--checkpoint", str(tmp_path / "model.pt"), "--format", "weights"]
    assert export_script.main([*argv, "--out", str(tmp_path / "again.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the stored threshold") and len(err.splitlines()) == 1
    assert "weights: chosen for 00000000, epoch 9" in err and "--threshold" in err
    assert not (tmp_path / "again.pt").exists()
    given = [*argv, "--threshold", "0.7", "--distance", "cosine"]
    assert export_script.main([*given, "--out", str(tmp_path / "given.pt")]) == 0
    record = load_model(tmp_path / "given.pt").threshold_record()
    assert (record.value, record.distance, record.chosen_on) == (0.7, "cosine", "--threshold")
    assert record.weights_sha256 == trained.weights_sha256()
    assert export_script.main([*argv, "--no-threshold", "--out", str(tmp_path / "none.pt")]) == 0
    assert load_model(tmp_path / "none.pt").verification == {}
    # An export written before thresholds carried provenance: not matching, and said so.
    trained.verification = {"threshold": 0.75, "threshold_distance": "squared"}
    save_weights(trained, tmp_path / "old.pt")
    argv[1] = str(tmp_path / "old.pt")
    assert export_script.main([*argv, "--out", str(tmp_path / "x.pt")]) == 2
    assert "does not say which weights it was chosen for" in capsys.readouterr().err
