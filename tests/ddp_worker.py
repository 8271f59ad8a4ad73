"""Run a few training steps under torchrun (gloo, CPU) and save rank 0's parameters.

Used by tests/test_distributed.py: ``torchrun --nproc_per_node=N tests/ddp_worker.py OUT``.
The same steps in one process on the concatenated batch must give the same parameters.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from facenet.distributed import (
    barrier,
    cleanup_distributed,
    get_rank,
    get_world_size,
    init_distributed,
)
from facenet.losses import TripletMarginLoss
from facenet.miners import BatchHardMiner
from facenet.trainer import Trainer

STEPS, P, K = 3, 6, 4


class GroupNormNet(nn.Module):
    """Batch-independent normalisation, so per-rank and whole-batch forwards agree exactly."""

    def __init__(self, dim=8, num_classes=P):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Linear(8, dim), nn.LayerNorm(dim))
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x, return_logits=False):
        z = self.head(self.backbone(x))
        embeddings = F.normalize(z, dim=1)
        return (embeddings, self.classifier(z)) if return_logits else embeddings


def batch(step):
    generator = torch.Generator().manual_seed(100 + step)
    images = torch.randn(P * K, 3, 8, 8, generator=generator, dtype=torch.float64)
    return images, torch.arange(P).repeat_interleave(K)


def train(passes, chunk_size=0, wrap=False):
    """The parameters after STEPS steps; this rank trains on its slice of each batch."""
    torch.manual_seed(0)
    model = GroupNormNet().double()
    if wrap:
        model = DistributedDataParallel(model, forward_sync_buffers=False)
    trainer = Trainer(
        model,
        BatchHardMiner(distance="squared"),
        TripletMarginLoss(margin=0.5),
        torch.optim.SGD(model.parameters(), lr=0.5),
        passes=passes,
        ce_weight=0.5,
        chunk_size=chunk_size,
    )
    rank, world = get_rank(), get_world_size()
    for step in range(STEPS):
        images, labels = batch(step)
        share = images.shape[0] // world
        local = slice(rank * share, (rank + 1) * share)
        stats = trainer.train_step(images[local], labels[local])
        assert "skipped" not in stats, stats
    core = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in core.state_dict().items()}


def embed_pairs(pairs_path):
    """Both sides of the pairs in ``pairs_path``, embedded by the ranks' shards."""
    from facenet.data.pairs import read_pairs
    from facenet.trainer import embed_pair_list

    torch.manual_seed(0)
    model = GroupNormNet().double().float()
    return embed_pair_list(model, read_pairs(pairs_path), image_size=8, batch_size=2)


def main(out, pairs_path=None):
    init_distributed("cpu")
    results = {
        "two_pass": train(passes=2, wrap=True),
        "one_pass": train(passes=1, wrap=True),
        "two_pass_chunked": train(passes=2, chunk_size=5, wrap=True),
    }
    if pairs_path:
        results["pairs"] = embed_pairs(pairs_path)
    if get_rank() == 0:
        torch.save(results, out)
    barrier()  # no rank tears the group down while another still uses it
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
