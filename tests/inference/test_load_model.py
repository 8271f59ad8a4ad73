"""load_model: a trained network from a checkpoint, a weights export or a facenet-pytorch file."""

from __future__ import annotations

import pickle

import pytest
import torch
from port_weights import port_state_dict

from facenet.checkpoint import load_checkpoint
from facenet.errors import CheckpointError
from facenet.inference.loading import WEIGHTS_FORMAT, load_model, save_weights
from facenet.models.embedding import EmbeddingNet

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_training_checkpoint_rebuilds_its_network(tiny_run):
    trained = load_model(tiny_run["checkpoint"])
    state = load_checkpoint(tiny_run["checkpoint"])
    # Brute force: the six pieces a user needed before, put together by hand.
    model = EmbeddingNet(state["config"]["model"]["backbone"], 128, num_classes=8)
    model.load_state_dict(state["model"])
    model.eval()
    images = torch.randn(3, 3, 32, 32)
    assert trained.kind == "checkpoint" and not trained.model.training
    assert trained.model.classifier is None
    assert (trained.image_size, trained.normalize, trained.embedding_dim) == (32, "fixed", 128)
    with torch.no_grad():
        assert torch.equal(trained.model(images), model(images))


def test_a_weights_export_round_trips(tiny_run, tmp_path):
    trained = load_model(tiny_run["checkpoint"])
    trained.verification = {"threshold": 0.75, "threshold_distance": "squared"}
    save_weights(trained, tmp_path / "model.pt")
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert plain["format"] == WEIGHTS_FORMAT and "optimizer" not in plain
    assert not any(k.startswith("classifier.") for k in plain["state_dict"])
    again = load_model(tmp_path / "model.pt")
    assert again.kind == "weights" and again.verification == trained.verification
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(again.model(images), trained.model(images))


def test_a_facenet_pytorch_file_loads_with_its_512d_head(tmp_path):
    torch.manual_seed(0)
    source = EmbeddingNet("inception_resnet_v1", embedding_dim=512, num_classes=5).eval()
    torch.save(port_state_dict(source), tmp_path / "20180402-114759-vggface2.pt")
    trained = load_model(tmp_path / "20180402-114759-vggface2.pt")
    assert trained.kind == "facenet-pytorch"
    assert (trained.image_size, trained.normalize, trained.embedding_dim) == (160, "fixed", 512)
    images = torch.randn(1, 3, 160, 160)
    with torch.no_grad():
        assert torch.equal(trained.model(images), source(images))


def test_a_file_that_would_run_code_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"model": Evil()}, protocol=2))
    with pytest.raises(CheckpointError, match="refused"):
        load_model(tmp_path / "evil.pt")
    assert not marker.exists()


def test_a_file_of_another_kind_is_named(tmp_path):
    torch.save({"weights": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a training checkpoint"):
        load_model(tmp_path / "other.pt")
