"""load_model: a trained network from a checkpoint, a weights export or a facenet-pytorch file."""

from __future__ import annotations

import pickle

import pytest
import torch
from port_weights import port_state_dict

from facenet.checkpoint import load_checkpoint
from facenet.errors import CheckpointError
from facenet.models.embedding import EmbeddingNet
from facenet.wings.after_training.loading import WEIGHTS_FORMAT, load_model, save_weights

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


def weights_export(tiny_run) -> dict:
    """A valid weights export's contents (what save_weights writes), to be damaged."""
    trained = load_model(tiny_run["checkpoint"])
    return {
        "format": WEIGHTS_FORMAT,
        "version": 1,
        "architecture": dict(trained.architecture),
        "preprocess": {"image_size": trained.image_size, "normalize": trained.normalize},
        "verification": {},
        "state_dict": dict(trained.model.state_dict()),
    }


def refused(path, match: str, monkeypatch) -> str:
    """load_model's one-line refusal of ``path``, with no network ever allocated."""

    def never(*args, **kwargs):
        raise AssertionError("the network was allocated before the fields were checked")

    monkeypatch.setattr("facenet.wings.after_training.loading.EmbeddingNet", never)
    with pytest.raises(CheckpointError, match=match) as caught:
        load_model(path)
    assert len(str(caught.value).splitlines()) == 1 and str(path) in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize(
    "where, field",
    [
        (None, "architecture"),
        (None, "preprocess"),
        (None, "state_dict"),
        ("preprocess", "image_size"),
        ("preprocess", "normalize"),
        ("architecture", "backbone"),
        ("architecture", "embedding_dim"),
    ],
)
def test_every_missing_field_of_a_weights_export_is_named(
    tiny_run, tmp_path, monkeypatch, where, field
):
    contents = weights_export(tiny_run)
    del (contents if where is None else contents[where])[field]
    torch.save(contents, tmp_path / "model.pt")
    refused(tmp_path / "model.pt", field, monkeypatch)


@pytest.mark.parametrize(
    "where, field, value, match",
    [
        ("architecture", "embedding_dim", 30_000_000, "out of range"),
        ("architecture", "embedding_dim", 3e7, "must be an integer"),
        ("architecture", "embedding_dim", 0, "out of range"),
        ("architecture", "embedding_dim", True, "must be an integer"),
        ("architecture", "embedding_dim", 64, "embedding_dim is 64"),  # the head has 128 rows
        ("architecture", "backbone", "resnet9000", "valid backbones"),
        ("architecture", "backbone", 7, "valid backbones"),
        ("architecture", "dropout", 1.5, "out of range"),
        ("architecture", "dropout", "0.1", "must be a number"),
        ("preprocess", "image_size", 20000, "out of range"),
        ("preprocess", "image_size", 0, "out of range"),
        ("preprocess", "image_size", "32", "must be an integer"),
        ("preprocess", "normalize", "none", "expected one of"),
        (None, "architecture", "tiny", "must be a dict"),
        (None, "preprocess", [32], "must be a dict"),
        (None, "state_dict", {"w": 1}, "dict of named tensors"),
        (None, "verification", {"threshold": "low"}, "no numeric threshold"),
        (
            None,
            "verification",
            {"threshold": float("nan")},
            "no numeric threshold: {'threshold': nan}",
        ),
        (None, "verification", [1.0], "must be a dict"),
    ],
)
def test_every_field_of_a_weights_export_is_checked_before_allocating(
    tiny_run, tmp_path, monkeypatch, where, field, value, match
):
    contents = weights_export(tiny_run)
    (contents if where is None else contents[where])[field] = value
    torch.save(contents, tmp_path / "model.pt")
    refused(tmp_path / "model.pt", match, monkeypatch)


def test_non_finite_weights_are_refused_naming_the_tensors(tiny_run, tmp_path, monkeypatch):
    contents = weights_export(tiny_run)
    contents["state_dict"]["embedding.bn.weight"] = torch.full((128,), float("nan"))
    torch.save(contents, tmp_path / "model.pt")
    message = refused(tmp_path / "model.pt", "NaN or infinite", monkeypatch)
    assert "embedding.bn.weight" in message
    state = load_checkpoint(tiny_run["checkpoint"])  # a training checkpoint
    state["model"]["embedding.linear.weight"][0, 0] = float("inf")
    torch.save(state, tmp_path / "nan.pt")
    assert "embedding.linear.weight" in refused(tmp_path / "nan.pt", "NaN", monkeypatch)
    torch.manual_seed(0)  # a facenet-pytorch file
    port = port_state_dict(EmbeddingNet("inception_resnet_v1", 512).eval())
    port["last_linear.weight"][0, 0] = float("nan")
    torch.save(port, tmp_path / "port.pt")
    assert "embedding.linear.weight" in refused(tmp_path / "port.pt", "NaN", monkeypatch)
    weight = state["model"]["embedding.linear.weight"]
    complex_nan = torch.full_like(weight, complex("nan"), dtype=torch.complex64)
    state["model"]["embedding.linear.weight"] = complex_nan
    torch.save(state, tmp_path / "complex.pt")  # a complex NaN is non-finite too
    assert "embedding.linear.weight" in refused(tmp_path / "complex.pt", "NaN", monkeypatch)


def test_a_malformed_threshold_in_a_checkpoints_history_is_no_threshold(tiny_run, tmp_path):
    state = load_checkpoint(tiny_run["checkpoint"])
    record = [r for r in state["history"] if r["epoch"] == state["epoch"]][0]["validation"]
    for threshold_for, threshold in (([1, 2], 0.5), ("abc", 0.5), ({}, 10**400)):
        record.update(threshold_for=threshold_for, threshold=threshold)
        torch.save(state, tmp_path / "odd.pt")
        trained = load_model(tmp_path / "odd.pt")  # no TypeError or OverflowError
        assert (trained.threshold_record() is None) == (threshold == 10**400)


def test_a_checkpoint_carries_its_own_epochs_threshold(tiny_run, tmp_path):
    trained = load_model(tiny_run["checkpoint"])
    state = load_checkpoint(tiny_run["checkpoint"])
    record = trained.threshold_record()
    validation = [r for r in state["history"] if r["epoch"] == state["epoch"]][0]["validation"]
    assert record.value == validation["threshold"] and record.epoch == state["epoch"]
    assert record.weights_sha256 == trained.weights_sha256()  # validation's = the file's
    assert record.differences(trained.preparation()) == []
    assert "flip" in record.differences(trained.preparation(flip=True))[0]
    # Written part-way through the next epoch: the weights moved since; no threshold.
    state["partial"] = {"epoch": state["epoch"] + 1, "steps_done": 1}
    torch.save(state, tmp_path / "partial.pt")
    assert load_model(tmp_path / "partial.pt").verification == {}
    # A record written before thresholds carried provenance: the saved eval section says how
    # it was chosen, and the checkpoint's own unpartial epoch says for which weights.
    del state["partial"], validation["threshold_for"]
    torch.save(state, tmp_path / "old.pt")
    old = load_model(tmp_path / "old.pt")
    assert old.threshold_record().differences(old.preparation()) == []


def _publisher_file(tmp_path, gdc_kernel=(7, 6), wrap=True, name="068.ckpt"):
    """A file in Xiaoccer/MobileFaceNet_Pytorch's layout with random weights, in the old
    (non-zip) torch format its 068.ckpt has; and the network that wrote it."""
    from mobilefacenet_reference import PublisherMobileFacenet, randomize

    publisher = randomize(PublisherMobileFacenet(gdc_kernel), seed=3)
    state = publisher.state_dict()
    contents = {"epoch": 68, "net_state_dict": state} if wrap else state
    torch.save(contents, tmp_path / name, _use_new_zipfile_serialization=False)
    return tmp_path / name, publisher


@pytest.mark.parametrize("wrap", [True, False], ids=["ckpt", "bare-state-dict"])
def test_a_mobilefacenet_file_loads_with_its_input_size(tmp_path, wrap):
    path, publisher = _publisher_file(tmp_path, wrap=wrap)
    trained = load_model(path)
    assert trained.kind == "mobilefacenet" and trained.architecture["backbone"] == "mobilefacenet"
    # SphereFace's crops, H x W; the publisher's loader standardises as (x - 127.5) / 128.
    assert trained.image_size == (112, 96)
    assert (trained.normalize, trained.embedding_dim) == ("fixed", 128)
    assert trained.epoch == (68 if wrap else None)
    images = torch.randn(2, 3, 112, 96)
    with torch.no_grad():
        raw = publisher(images)  # the publisher's unnormalised 128-D features
        unit = raw / raw.norm(dim=1, keepdim=True)
        torch.testing.assert_close(trained.model(images), unit, rtol=0, atol=1e-5)
        prelogits = trained.model.embedding.prelogits(trained.model.backbone(images))
        torch.testing.assert_close(prelogits, raw, rtol=0, atol=1e-5)


def test_a_mobilefacenet_file_for_square_inputs_loads_at_its_size(tmp_path):
    # A 7 x 7 global depthwise kernel: a network for insightface's 112 x 112 crops.
    path, publisher = _publisher_file(tmp_path, gdc_kernel=(7, 7))
    trained = load_model(path)
    assert trained.image_size == (112, 112)
    images = torch.randn(2, 3, 112, 112)  # (B, 3, H, W)
    with torch.no_grad():
        raw = publisher(images)
        torch.testing.assert_close(trained.model(images), raw / raw.norm(dim=1, keepdim=True))
    save_weights(trained, tmp_path / "model.pt")
    again = load_model(tmp_path / "model.pt")
    assert again.image_size == 112  # a square size is stored as one side


def test_a_mobilefacenet_weights_export_keeps_its_non_square_size(tmp_path):
    path, _ = _publisher_file(tmp_path)
    trained = load_model(path)
    save_weights(trained, tmp_path / "model.pt")
    stored = torch.load(tmp_path / "model.pt", weights_only=True)["preprocess"]
    assert stored["image_size"] == [112, 96]  # [H, W], as a configuration writes it
    again = load_model(tmp_path / "model.pt")
    assert again.image_size == (112, 96) and again.transform() is not None
    image = torch.randint(0, 256, (3, 130, 100), dtype=torch.uint8)  # (3, h, w)
    assert again.transform()(image).shape == (3, 112, 96)
    x = torch.randn(2, 3, 112, 96)
    with torch.no_grad():
        torch.testing.assert_close(again.model(x), trained.model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "size, message",
    [([112, 96, 3], "integer or \\[height, width\\]"), ([112, 5000], "side 5000 is out of range")],
)
def test_a_weights_export_with_a_bad_size_pair_is_refused(tmp_path, size, message):
    path, _ = _publisher_file(tmp_path)
    save_weights(load_model(path), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    state["preprocess"]["image_size"] = size
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / "bad.pt")


def test_a_mobilefacenet_file_with_nan_weights_is_refused(tmp_path):
    path, _ = _publisher_file(tmp_path)
    state = torch.load(path, weights_only=True)
    state["net_state_dict"]["conv2.prelu.weight"][0] = float("nan")
    torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="backbone.conv_1x1.act.weight"):
        load_model(path)


def test_a_mobilefacenet_file_with_a_0d_head_is_refused(tmp_path):
    path, _ = _publisher_file(tmp_path)
    state = torch.load(path, weights_only=True)
    state["net_state_dict"]["linear1.conv.weight"] = torch.tensor(1.0)
    torch.save(state, path, _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match=r"068.ckpt: .* without its linear1 .*\(D, F\)"):
        load_model(path)


@pytest.mark.parametrize(
    "key, tensor",
    [
        # A kernel for 4096 px inputs: a 134 MB layer and a network that needs gigabytes.
        ("net_state_dict.linear7.conv.weight", torch.zeros(1, 1, 1, 1).expand(512, 1, 256, 256)),
        ("net_state_dict.linear1.conv.weight", torch.zeros(1, 1, 1, 1).expand(2**30, 512, 1, 1)),
        ("net_state_dict.extra", torch.zeros(1).expand(2**31)),  # the finiteness check's 8 GB
    ],
    ids=["4096 px kernel", "huge head", "unused"],
)
def test_an_expanded_tensor_is_refused_before_anything_is_allocated(tmp_path, key, tensor):
    path, _ = _publisher_file(tmp_path)
    state = torch.load(path, weights_only=True)
    outer, inner = key.split(".", 1)
    state[outer][inner] = tensor
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"068.ckpt: a torch.strided tensor of shape"):
        load_model(path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("embedding_dim", 2**2000, "embedding_dim <a huge integer> is out of range"),
        ("embedding_dim", [[1] * 10**5] * 10**3, r"got \[\[1, 1, 1, 1, 1, 1, \.\.\.\]"),
        ("backbone", "x" * 10**6, "backbone 'xxxx.*xxx': valid backbones"),
    ],
    ids=["600-digit integer", "repeated list", "long string"],
)
def test_a_crafted_field_is_refused_in_a_short_message(tmp_path, field, value, message):
    path, _ = _publisher_file(tmp_path)
    save_weights(load_model(path), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    state["architecture"][field] = value
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(tmp_path / "bad.pt")
    assert len(str(err.value)) < 500
