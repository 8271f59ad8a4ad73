"""Host syncs per training step, counted on the CPU (``host_syncs.HostSyncs``): the operations
that would block the host on CUDA. Targets: at most 3 a step on the default path (one process,
one pass, semi-hard), 2 more under fp16, 2 more under DDP."""

import pytest
import torch
from host_syncs import HostSyncs

from facenet import distributed
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer
from facenet.training.step import build_step

DEFAULT_PATH = 3


def make_trainer(**settings):
    torch.manual_seed(0)
    ce = settings.get("ce_weight", 0.0)
    model = EmbeddingNet("tiny", embedding_dim=16, num_classes=4 if ce else None)
    step = build_step(model, SemiHardNegativeMiner(), TripletMarginLoss(), **settings)
    return Trainer(step, torch.optim.SGD(model.parameters(), lr=0.01))


def uint8_batch():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (16, 3, 32, 32), generator=generator, dtype=torch.uint8)
    return images, torch.arange(4).repeat_interleave(4)


def syncs_per_step(trainer) -> int:
    """An epoch of 3 batches less an epoch of 1, halved: the epoch's own reads cancel."""
    counts = []
    for batches in (1, 3):
        with HostSyncs() as syncs:
            trainer.train_one_epoch(
                [uint8_batch()] * batches,
                0,
                log_interval=100,
                progress=False,
                should_stop=lambda: False,
            )
        counts.append(syncs.total)
    assert trainer.counts["trained"] == 4  # every step trained: the count is a trained step's
    return (counts[1] - counts[0]) // 2


def test_the_default_path_syncs_at_most_three_times_a_step():
    trainer = make_trainer()
    assert trainer.step.name == "one-pass"
    assert syncs_per_step(trainer) <= DEFAULT_PATH


@pytest.mark.parametrize(
    ("settings", "most"),
    [
        ({"amp": "fp16"}, DEFAULT_PATH + 2),  # the scaler's overflow check and its new scale
        ({"amp": "bf16"}, DEFAULT_PATH),
        ({"ce_weight": 1.0}, DEFAULT_PATH + 1),  # this rank's selected rows, for their logits
        ({"passes": 2}, DEFAULT_PATH + 2),  # unique images, this rank's rows of them
        ({"chunk_size": 8}, DEFAULT_PATH + 1),  # unique images (and the chunks to re-run)
    ],
)
def test_the_other_paths_add_few(settings, most):
    assert syncs_per_step(make_trainer(**settings)) <= most


@pytest.fixture
def one_rank_group(monkeypatch):
    """A gloo group of one process, taken for a multi-process one: any_rank's collectives run."""
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
    )
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    yield
    torch.distributed.destroy_process_group()


def test_ddp_adds_at_most_two(one_rank_group):
    assert syncs_per_step(make_trainer()) <= DEFAULT_PATH + 2


def test_the_counter_sees_what_blocks():
    x = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncs() as syncs:
        x[x > 0]  # boolean mask: nonzero on CUDA
        x.nonzero()
        float(x.sum())
        torch.unique(x)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # known size: no read
        x[torch.tensor([0, 2])]  # integer indices: no read
    assert dict(syncs.counts) == {
        "index": 1,
        "nonzero": 1,
        "_local_scalar_dense": 1,
        "_unique2": 1,
        "repeat_interleave": 1,
    }
