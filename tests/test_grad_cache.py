"""Gradient caching: exact gradients without batch-dependent layers, one chunk's graph memory,
BatchNorm statistics and dropout masks replayed so chunks recompute the cached embeddings."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from facenet.grad_cache import BatchState
from facenet.losses import TripletMarginLoss
from facenet.memory import GraphMemoryMeter
from facenet.miners import BatchHardMiner
from facenet.models import EmbeddingNet
from facenet.trainer import Trainer


class GroupNormNet(nn.Module):
    """A small embedding net whose output for an image does not depend on the rest of the batch."""

    def __init__(self, dim=8, num_classes=6):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.GroupNorm(4, 16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(16, dim), nn.LayerNorm(dim))
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x, return_logits=False):
        z = self.head(self.backbone(x))
        embeddings = F.normalize(z, dim=1)
        return (embeddings, self.classifier(z)) if return_logits else embeddings


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.recorded = [
            None if p.grad is None else p.grad.clone()
            for group in self.param_groups
            for p in group["params"]
        ]
        return super().step(closure)


def make_batch(p=6, k=3, size=12, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(p * k, 3, size, size, generator=generator, dtype=dtype)
    return images, torch.arange(p).repeat_interleave(k)


def trainer_for(model, chunk_size, ce_weight=0.0):
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    trainer = Trainer(
        model,
        BatchHardMiner(distance="squared"),
        TripletMarginLoss(margin=0.5),
        optimizer,
        ce_weight=ce_weight,
        chunk_size=chunk_size,
    )
    return trainer, optimizer


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 18, 64])
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_chunked_gradients_equal_unchunked_without_batch_dependence(chunk_size, ce_weight):
    torch.manual_seed(0)
    model = GroupNormNet().double()
    images, labels = make_batch()
    reference, ref_opt = trainer_for(copy.deepcopy(model), 0, ce_weight)
    chunked, opt = trainer_for(copy.deepcopy(model), chunk_size, ce_weight)
    ref_stats = reference.train_step(images, labels)
    stats = chunked.train_step(images, labels)
    assert stats["selected_images"].item() == 18  # 18 % 4 and 18 % 5 leave a partial chunk
    torch.testing.assert_close(stats["loss"], ref_stats["loss"], rtol=0, atol=1e-10)
    assert [g is None for g in opt.recorded] == [g is None for g in ref_opt.recorded]
    for got, want in zip(opt.recorded, ref_opt.recorded):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-8)


def forward_peak(model, images):
    meter = GraphMemoryMeter(exclude=model)
    with meter:
        out = model(images)
        peak = meter.peak_bytes
        del out
    return peak


@pytest.mark.parametrize("chunk_size", [3, 6, 9])
def test_chunked_peak_is_one_chunks_worth(chunk_size):
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16)
    images, labels = make_batch(p=6, k=3, size=32, dtype=torch.float32)
    unchunked, _ = trainer_for(copy.deepcopy(model), 0)
    chunked, _ = trainer_for(copy.deepcopy(model), chunk_size)
    peaks = {}
    for name, trainer in (("unchunked", unchunked), ("chunked", chunked)):
        with trainer.meter:
            trainer.train_step(images, labels)
        peaks[name] = trainer.meter.peak_bytes
        assert trainer.meter.alive_bytes == 0
    ratio = chunk_size / images.shape[0]
    assert peaks["chunked"] <= ratio * peaks["unchunked"] * 1.1 + 32 * 1024
    assert peaks["chunked"] <= forward_peak(copy.deepcopy(model).train(), images[:chunk_size]) * 1.1


def test_replay_recomputes_the_cached_embeddings_with_batchnorm_and_dropout():
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16, dropout=0.5).train()
    images, _ = make_batch(p=4, k=4, size=32, dtype=torch.float32)
    state = BatchState(model)
    assert state.norms and state.dropouts
    with torch.no_grad(), state.record():
        cached = model(images)  # (16, D)
    pieces = []
    with state.replay() as rows:
        for chunk in torch.arange(16).split(5):
            rows[0] = chunk
            pieces.append(model(images[chunk]))
    torch.testing.assert_close(torch.cat(pieces), cached, rtol=1e-4, atol=1e-5)
    assert all(m.training for m in state.norms)  # modes and buffers restored


def test_running_stats_updated_once_with_the_whole_batch():
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16)
    reference = copy.deepcopy(model).train()
    images, labels = make_batch(p=6, k=3, size=32, dtype=torch.float32)
    trainer, _ = trainer_for(model, chunk_size=4)
    trainer.train_step(images, labels)  # batch hard selects every image of this batch
    with torch.no_grad():
        reference(images)  # one ordinary training-mode update over the whole batch
    for bn, ref in zip(
        [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)],
        [m for m in reference.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)],
    ):
        assert bn.num_batches_tracked.item() == 1
        torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-4, atol=1e-6)


def test_batchnorm_model_gradient_stays_close_to_unchunked():
    """With BatchNorm the chunks treat the batch statistics as constants; measure the gap."""
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16).double()
    images, labels = make_batch(p=6, k=3, size=32)
    reference, ref_opt = trainer_for(copy.deepcopy(model), 0)
    chunked, opt = trainer_for(copy.deepcopy(model), 6)
    reference.train_step(images, labels)
    chunked.train_step(images, labels)
    flat_ref = torch.cat([g.flatten() for g in ref_opt.recorded])
    flat = torch.cat([g.flatten() for g in opt.recorded])
    cosine = F.cosine_similarity(flat, flat_ref, dim=0).item()
    relative = ((flat - flat_ref).norm() / flat_ref.norm()).item()
    print(
        f"BatchNorm model, chunked vs unchunked gradient: cosine {cosine:.4f}, rel {relative:.4f}"
    )
    assert cosine > 0.5
