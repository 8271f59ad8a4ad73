"""MobileFaceNet: the backbone's shapes, and the port of Xiaoccer/MobileFaceNet_Pytorch's layout
checked against an independent re-implementation of the publisher's network
(tests/mobilefacenet_reference.py) holding the same random weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mobilefacenet_reference import PublisherMobileFacenet, randomize

from facenet.models.backbones import BACKBONES
from facenet.models.embedding import EmbeddingNet, count_parameters
from facenet.wings.publishers.mobilefacenet import MobileFaceNet, convert_mobilefacenet_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def publisher():
    """The publisher's network with random weights (statistics and slopes included)."""
    return randomize(PublisherMobileFacenet(), seed=1)


def _images(n: int = 3, size=(112, 96)) -> torch.Tensor:
    return torch.randn(n, 3, *size, generator=torch.Generator().manual_seed(2))


def test_the_backbone_maps_112_by_96_faces_to_512_features():
    backbone = MobileFaceNet().eval()
    with torch.no_grad():
        assert backbone(_images(2)).shape == (2, 512)
    assert backbone.gdc.conv.kernel_size == (7, 6)  # the GDC spans the whole 7 x 6 map
    assert "mobilefacenet" in BACKBONES


def test_a_square_variant_has_a_square_gdc():
    backbone = MobileFaceNet(input_size=112).eval()
    with torch.no_grad():
        assert backbone(_images(2, (112, 112))).shape == (2, 512)
    assert backbone.gdc.conv.kernel_size == (7, 7)


def test_another_input_size_is_refused_by_name():
    with pytest.raises(ValueError, match=r"112 x 96 \(H x W\).*got 112 x 112"):
        MobileFaceNet()(_images(1, (112, 112)))
    with pytest.raises(ValueError, match="multiple of 16"):
        MobileFaceNet(input_size=(100, 96))


def test_it_has_the_publishers_parameters(publisher):
    # The head (Linear 512 -> 128 and its BatchNorm) is the publisher's linear1 conv and BN.
    assert count_parameters(EmbeddingNet("mobilefacenet")) == count_parameters(publisher)
    assert count_parameters(MobileFaceNet()) == 933_760


def test_every_published_key_maps_onto_one_of_ours(publisher):
    ours = convert_mobilefacenet_state_dict(publisher.state_dict())
    model = EmbeddingNet("mobilefacenet", embedding_dim=128)
    expected = model.state_dict()
    assert sorted(ours) == sorted(expected)
    assert all(ours[k].shape == v.shape for k, v in expected.items())


def test_the_head_keeps_the_publishers_batchnorm_epsilon():
    assert EmbeddingNet("mobilefacenet").embedding.bn.eps == 1e-5
    assert EmbeddingNet("tiny").embedding.bn.eps == 1e-3  # FaceNet's, unchanged


def test_converted_weights_give_the_publishers_outputs(publisher):
    model = EmbeddingNet("mobilefacenet", embedding_dim=128).eval()
    model.load_state_dict(convert_mobilefacenet_state_dict(publisher.state_dict()))
    images = _images()
    with torch.no_grad():
        raw = publisher(images)  # (3, 128), the publisher's features
        prelogits = model.embedding.prelogits(model.backbone(images))
        embeddings = model(images)
    torch.testing.assert_close(prelogits, raw, rtol=0, atol=1e-5)
    torch.testing.assert_close(embeddings, F.normalize(raw), rtol=0, atol=1e-5)


def test_model_weights_takes_the_publishers_file(publisher, tmp_path):
    path = tmp_path / "068.ckpt"
    state = {"epoch": 68, "net_state_dict": publisher.state_dict()}
    torch.save(state, path, _use_new_zipfile_serialization=False)  # the old format
    model = EmbeddingNet("mobilefacenet", weights=path, weights_head=True).eval()
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(model(images), F.normalize(publisher(images)), rtol=0, atol=1e-5)


def test_it_trains():
    model = EmbeddingNet("mobilefacenet", embedding_dim=16).train()
    embeddings = model(_images(4))
    embeddings.sum().backward()
    assert model.backbone.stem.conv.weight.grad is not None
