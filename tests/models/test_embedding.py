"""Tests for facenet.models.embedding: shapes, unit norms, one-pass logits, AMP, weights loading."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from facenet.config import ModelConfig
from facenet.errors import WeightsError
from facenet.models.backbones import BACKBONES
from facenet.models.embedding import (
    CosineClassifier,
    EmbeddingHead,
    EmbeddingNet,
    build_model,
    count_parameters,
)
from facenet.models.tiny import TinyCNN
from facenet.wings.publishers.inception_resnet_v1 import convert_facenet_pytorch_state_dict

NUM_CLASSES = 5
EXPECTED_FEATURE_DIM = {
    "tiny": 128,
    "resnet18": 512,
    "resnet34": 512,
    "resnet50": 2048,
    "mobilenet_v3_large": 960,
    "inception_resnet_v1": 1792,
    "mobilefacenet": 512,
}


def input_size(backbone: str) -> int | tuple[int, int]:
    # MobileFaceNet's global depthwise kernel fixes its input: 112 x 96 (H x W).
    return {"inception_resnet_v1": 160, "mobilefacenet": (112, 96)}.get(backbone, 64)


def images(batch: int, size, channels: int = 3, seed: int = 0) -> torch.Tensor:
    """(batch, channels, H, W) normal noise; ``size`` is S (square) or (H, W)."""
    height, width = (size, size) if isinstance(size, int) else size
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, channels, height, width, generator=gen)


@pytest.fixture(scope="module")
def model_cache():
    """Each backbone's EmbeddingNet, built once per module (the big ones take a second)."""
    cache: dict[str, EmbeddingNet] = {}

    def get(backbone: str) -> EmbeddingNet:
        if backbone not in cache:
            torch.manual_seed(0)
            cache[backbone] = EmbeddingNet(backbone, embedding_dim=16, num_classes=NUM_CLASSES)
        return cache[backbone]

    return get


class CallCounter:
    """A forward hook that counts calls and keeps the last output."""

    def __init__(self, module: nn.Module):
        self.calls = 0
        self.output = None
        self.handle = module.register_forward_hook(self)

    def __call__(self, module, inputs, output):
        self.calls += 1
        self.output = output.detach()


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("backbone", BACKBONES)
def test_one_backbone_pass_gives_unit_embeddings_and_logits(model_cache, backbone):
    model = model_cache(backbone).train()
    counter = CallCounter(model.backbone)
    x = images(2, input_size(backbone))
    try:
        with torch.no_grad():
            embeddings, logits = model(x, return_logits=True)
    finally:
        counter.handle.remove()

    assert counter.calls == 1
    assert model.feature_dim == EXPECTED_FEATURE_DIM[backbone]
    assert model.embed_dim == 16
    assert counter.output.shape == (2, model.feature_dim)
    assert embeddings.shape == (2, 16) and logits.shape == (2, NUM_CLASSES)
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(2))
    # Both outputs are the head applied to that one backbone output.
    with torch.no_grad():
        prelogits = model.embedding.prelogits(counter.output)
        torch.testing.assert_close(embeddings, F.normalize(prelogits, dim=1))
        torch.testing.assert_close(logits, model.classifier(prelogits))


def test_plain_call_returns_the_embeddings_of_the_logits_call(model_cache):
    model = model_cache("tiny").eval()
    x = images(4, 64)
    with torch.no_grad():
        embeddings, _ = model(x, return_logits=True)
        torch.testing.assert_close(model(x), embeddings)


def test_head_on_hand_computed_features():
    head = EmbeddingHead(2, 2).eval()
    with torch.no_grad():
        head.linear.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    features = torch.tensor([[3.0, 2.0], [0.0, -5.0]])
    # Linear -> (3, 4) and (0, -10); eval BN with mean 0, var 1 only rescales; then unit norm.
    expected = torch.tensor([[0.6, 0.8], [0.0, -1.0]])
    torch.testing.assert_close(head(features), expected)


def test_return_logits_without_classifier_is_a_clear_error_before_the_backbone():
    model = EmbeddingNet("tiny", embedding_dim=8)
    assert model.classifier is None
    counter = CallCounter(model.backbone)
    with pytest.raises(ValueError, match="num_classes"):
        model(images(2, 32), return_logits=True)
    assert counter.calls == 0


def test_tiny_is_small_and_takes_any_input_of_32_px_or_more():
    model = EmbeddingNet("tiny", embedding_dim=8).eval()
    assert 100_000 <= count_parameters(model.backbone) <= 300_000
    with torch.no_grad():
        for h, w in [(32, 32), (48, 40), (96, 96)]:
            out = model(torch.randn(3, 3, h, w))
            assert out.shape == (3, 8)
            torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


def test_inception_rejects_inputs_under_its_minimum_size(model_cache):
    model = model_cache("inception_resnet_v1")
    with pytest.raises(ValueError, match="at least 75"):
        model(images(2, 64))


@pytest.mark.parametrize("backbone", BACKBONES)
def test_in_channels_reaches_the_first_convolution(backbone):
    model = EmbeddingNet(backbone, embedding_dim=8, in_channels=1)
    first_conv = next(m for m in model.backbone.modules() if isinstance(m, nn.Conv2d))
    assert first_conv.in_channels == 1
    if backbone in ("tiny", "resnet18"):
        with torch.no_grad():
            assert model.eval()(images(2, 64, channels=1)).shape == (2, 8)


def test_dropout_is_active_in_training_only():
    x = images(4, 32)
    with torch.no_grad():
        for dropout in (0.0, 0.5):
            torch.manual_seed(0)
            model = EmbeddingNet("tiny", embedding_dim=8, dropout=dropout)
            model.eval()
            torch.testing.assert_close(model(x), model(x))
            model.train()  # train-mode BN is deterministic: only dropout can differ
            assert torch.equal(model(x), model(x)) == (dropout == 0.0)


# --------------------------------------------------------------------------- memory format, AMP


@pytest.mark.parametrize("backbone", ["tiny", "resnet18"])
def test_channels_last_model_matches_contiguous_model(backbone):
    torch.manual_seed(0)
    reference = EmbeddingNet(backbone, embedding_dim=8).eval()
    model = build_model(ModelConfig(backbone=backbone, embedding_dim=8, channels_last=True))
    model.load_state_dict(reference.state_dict())
    model.eval()
    conv_weights = [m.weight for m in model.backbone.modules() if isinstance(m, nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in conv_weights)
    x = images(2, 64)
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(model(x.to(memory_format=torch.channels_last)), expected)
        torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("backbone", ["tiny", "resnet18"])
def test_bf16_autocast_gives_finite_unit_embeddings_and_gradients(backbone):
    torch.manual_seed(0)
    model = EmbeddingNet(backbone, embedding_dim=8, num_classes=NUM_CLASSES).train()
    x = images(4, 64)
    with torch.no_grad():
        reference = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        embeddings, logits = model(x, return_logits=True)
    assert embeddings.dtype == torch.float32  # normalised in float32
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(embeddings).all() and torch.isfinite(logits).all()
    torch.testing.assert_close(embeddings.norm(dim=1), torch.ones(4))
    cosine = (embeddings.detach() * reference).sum(dim=1)
    assert cosine.min() > 0.95
    (embeddings.sum() + logits.float().sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------- weights files


def tiny_state_dict_files(tmp_path, source: EmbeddingNet) -> dict[str, object]:
    """The same tiny backbone weights in each file layout the loader accepts."""
    backbone_state = source.backbone.state_dict()
    return {
        "backbone state dict": backbone_state,
        "EmbeddingNet state dict": source.state_dict(),
        "checkpoint with 'model'": {"model": source.state_dict(), "epoch": 3},
        "checkpoint with 'state_dict'": {"state_dict": backbone_state, "note": "x"},
    }


@pytest.mark.parametrize(
    "layout",
    [
        "backbone state dict",
        "EmbeddingNet state dict",
        "checkpoint with 'model'",
        "checkpoint with 'state_dict'",
    ],
)
def test_backbone_weights_round_trip(tmp_path, layout):
    torch.manual_seed(0)
    source = EmbeddingNet("tiny", embedding_dim=8)
    with torch.no_grad():
        for p in source.backbone.parameters():
            p.add_(1.0)  # far from any fresh initialisation
    source.backbone(images(2, 32))  # move the BN running statistics away from (0, 1)
    path = tmp_path / "weights.pt"
    torch.save(tiny_state_dict_files(tmp_path, source)[layout], path)

    loaded = EmbeddingNet("tiny", embedding_dim=8, weights=str(path))
    expected = source.backbone.state_dict()
    got = loaded.backbone.state_dict()
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key])


def test_torchvision_file_with_its_imagenet_head_loads(tmp_path):
    torch.manual_seed(0)
    source = torchvision.models.resnet18(weights=None)
    path = tmp_path / "resnet18.pth"
    torch.save(source.state_dict(), path)  # includes fc.weight, fc.bias
    model = build_model(ModelConfig(backbone="resnet18", embedding_dim=8, weights=str(path)))
    torch.testing.assert_close(model.backbone.conv1.weight, source.conv1.weight)
    torch.testing.assert_close(model.backbone.layer4[1].bn2.bias, source.layer4[1].bn2.bias)


def test_wrong_backbone_file_names_missing_and_unexpected_keys(tmp_path):
    path = tmp_path / "tiny.pt"
    torch.save(TinyCNN().state_dict(), path)
    with pytest.raises(WeightsError) as err:
        EmbeddingNet("resnet18", weights=path)
    message = str(err.value)
    assert str(path) in message and "'resnet18'" in message
    assert "missing keys: conv1.weight" in message
    assert "unexpected keys: 0.0.weight" in message


def test_shape_mismatch_is_named(tmp_path):
    path = tmp_path / "narrow.pt"
    torch.save(TinyCNN(widths=(16, 64, 128, 128)).state_dict(), path)
    with pytest.raises(WeightsError, match=r"shape mismatches: 0\.0\.weight: file \(16, 3, 3, 3\)"):
        EmbeddingNet("tiny", weights=path)


class NotWeights:
    """An arbitrary pickled object, which weights_only=True must refuse."""


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "No such file"),
        (b"not a torch file at all", "cannot read"),
        (NotWeights(), "refused"),
        ({"lr": 0.1, "epoch": 3}, "expected a state dict"),
    ],
    ids=["missing", "garbage", "pickled object", "no tensors"],
)
def test_unusable_weights_file_is_a_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        torch.save(content, path)
    with pytest.raises(WeightsError, match=match) as err:
        EmbeddingNet("tiny", weights=path)
    assert str(path) in str(err.value)
    assert isinstance(err.value, ValueError)


class RunsCode:
    """A pickle that would make a folder when loaded: code execution, in miniature."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_weights_pickle_that_would_run_code_is_refused_without_the_unsafe_advice(tmp_path):
    path, marker = tmp_path / "evil.pt", tmp_path / "ran"
    torch.save({"conv.weight": RunsCode(marker)}, path)
    with pytest.raises(WeightsError, match="refused to load weights file .*evil.pt") as err:
        EmbeddingNet("tiny", weights=path)
    message = str(err.value)
    assert "weights_only=False" not in message and "weights_only` set to" not in message
    assert "unsupported GLOBAL" in message and not marker.exists()


# --------------------------------------------------------------------------- facenet-pytorch layout

# Keys and shapes of the facenet-pytorch port's InceptionResnetV1 (classify=True, 10 classes),
# read off its architecture: stem, each block type, both reductions, and the head.
PORT_KEY_SHAPES = {
    "conv2d_1a.conv.weight": (32, 3, 3, 3),
    "conv2d_2b.bn.running_mean": (64,),
    "conv2d_4b.bn.running_var": (256,),
    "repeat_1.0.conv2d.bias": (256,),
    "repeat_1.4.branch2.2.conv.weight": (32, 32, 3, 3),
    "mixed_6a.branch1.2.conv.weight": (256, 192, 3, 3),
    "repeat_2.9.branch1.1.conv.weight": (128, 128, 1, 7),
    "repeat_2.9.branch1.2.conv.weight": (128, 128, 7, 1),
    "mixed_7a.branch2.2.conv.weight": (256, 256, 3, 3),
    "repeat_3.4.branch1.1.conv.weight": (192, 192, 1, 3),
    "block8.conv2d.weight": (1792, 384, 1, 1),
    "last_linear.weight": (512, 1792),
    "last_bn.running_var": (512,),
    "logits.weight": (10, 512),
}
PORT_MODULES = {
    "conv2d_1a", "conv2d_2a", "conv2d_2b", "conv2d_3b", "conv2d_4a", "conv2d_4b",
    "repeat_1", "mixed_6a", "repeat_2", "mixed_7a", "repeat_3", "block8",
}  # fmt: skip


@pytest.fixture(scope="module")
def inception_512():
    torch.manual_seed(0)
    return EmbeddingNet("inception_resnet_v1", embedding_dim=512, num_classes=10)


def test_port_keys_map_onto_embedding_net_with_their_shapes(inception_512):
    ours = inception_512.state_dict()
    port = {key: torch.zeros(shape) for key, shape in PORT_KEY_SHAPES.items()}
    converted = convert_facenet_pytorch_state_dict(port)
    assert len(converted) == len(port)
    for key, value in converted.items():
        assert key in ours, key
        assert ours[key].shape == value.shape, key
    assert converted["embedding.linear.weight"] is port["last_linear.weight"]
    assert "classifier.weight" in converted and "backbone.block8.conv2d.weight" in converted


def test_backbone_keys_are_the_port_module_names(inception_512):
    top_level = {key.split(".")[0] for key in inception_512.backbone.state_dict()}
    assert top_level == PORT_MODULES
    # A torchinfo summary of the port's InceptionResnetV1 with a 10-class logits layer counts
    # 23,487,754 parameters, 5,130 of them in logits.
    assert count_parameters(inception_512) == 23_487_754
    assert count_parameters(inception_512.classifier) == 5_130


def port_layout(model: EmbeddingNet) -> dict[str, torch.Tensor]:
    """The state dict renamed to the port's layout (the inverse of the documented mapping)."""
    renames = {"backbone.": "", "embedding.linear.": "last_linear.", "embedding.bn.": "last_bn.",
               "classifier.": "logits."}  # fmt: skip
    out = {}
    for key, value in model.state_dict().items():
        prefix = next(p for p in renames if key.startswith(p))
        out[renames[prefix] + key[len(prefix) :]] = value
    return out


def test_port_file_loads_whole_model_and_as_backbone_weights(tmp_path, inception_512):
    port = port_layout(inception_512)
    converted = convert_facenet_pytorch_state_dict(port)
    assert converted.keys() == inception_512.state_dict().keys()
    inception_512.load_state_dict(converted)  # strict: every key and shape fits

    path = tmp_path / "port.pt"
    torch.save(port, path)  # its last_linear / last_bn / logits keys are not backbone keys
    backbone_only = EmbeddingNet("inception_resnet_v1", embedding_dim=128, weights=path)
    expected = inception_512.backbone.state_dict()
    for key, value in backbone_only.backbone.state_dict().items():
        torch.testing.assert_close(value, expected[key])


# --------------------------------------------------------------------------- construction


def test_unknown_backbone_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown backbone 'resnet19'") as err:
        EmbeddingNet("resnet19")
    for name in BACKBONES:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"embedding_dim": 0}, "embedding_dim"),
        ({"embedding_dim": True}, "embedding_dim"),
        ({"num_classes": 0}, "num_classes"),
        ({"dropout": 1.0}, "dropout"),
        ({"in_channels": 0}, "in_channels"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EmbeddingNet("tiny", **kwargs)


def test_build_model_honours_the_config():
    cfg = ModelConfig(backbone="tiny", embedding_dim=24, dropout=0.25)
    model = build_model(cfg, num_classes=7)
    assert model.backbone_name == "tiny" and model.embed_dim == 24
    assert model.embedding.dropout.p == 0.25
    assert model.classifier.in_features == 24 and model.classifier.out_features == 7
    assert build_model(cfg).classifier is None


def test_build_model_with_a_margin_loss_puts_a_cosine_classifier_holding_it():
    """Its logits are the cosines between each unit embedding and each unit weight row."""
    margin_loss = nn.Identity()  # any module: the classifier only holds it
    model = build_model(ModelConfig(embedding_dim=24), num_classes=7, margin_loss=margin_loss)
    assert isinstance(model.classifier, CosineClassifier) and model.classifier.loss is margin_loss
    assert set(model.state_dict()) - set(build_model(ModelConfig(embedding_dim=24))
                                         .state_dict()) == {"classifier.weight"}  # fmt: skip
    with torch.no_grad():
        model.classifier.weight.mul_(torch.arange(1.0, 8.0)[:, None])  # rows of norms 1x..7x
    model.eval()
    embeddings, cosines = model(images(3, 32), return_logits=True)
    weights = model.classifier.weight
    for i, j in [(0, 0), (1, 3), (2, 6)]:
        want = embeddings[i].dot(weights[j]) / weights[j].norm()
        torch.testing.assert_close(cosines[i, j], want)
    assert build_model(ModelConfig(), margin_loss=margin_loss).classifier is None


def test_count_parameters_against_a_hand_count():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))  # 12 + 4 + 8
    assert count_parameters(model) == 24
    model[0].requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 8


def test_build_model_builds_mobilefacenet_for_the_configured_size():
    from facenet.models.embedding import build_model

    cfg = ModelConfig(backbone="mobilefacenet", embedding_dim=16)
    for size, kernel in (([112, 96], (7, 6)), (112, (7, 7)), (None, (7, 6))):
        model = build_model(cfg, image_size=size).eval()
        assert model.backbone.gdc_size == kernel  # the global depthwise kernel
        height, width = (112, 96) if size is None else ((112, 112) if size == 112 else size)
        with torch.no_grad():
            assert model(torch.randn(2, 3, height, width)).shape == (2, 16)  # (B, 3, H, W)
    with pytest.raises(ValueError, match="multiple of 16"):
        build_model(cfg, image_size=[24, 20])


def test_a_weights_file_with_an_expanded_tensor_is_refused_before_it_materialises(tmp_path):
    state = EmbeddingNet("tiny", embedding_dim=8).state_dict()
    state["backbone.extra"] = torch.zeros(1).expand(2**40)  # 4 TiB of floats, declared
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(WeightsError, match=r"weights file .*w.pt: a torch.strided tensor"):
        EmbeddingNet("tiny", embedding_dim=8, weights=tmp_path / "w.pt")
