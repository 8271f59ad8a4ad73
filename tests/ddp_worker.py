"""Run a few training steps under torchrun (gloo, CPU) and save rank 0's parameters.

Used by tests/test_distributed.py: ``torchrun --nproc_per_node=2 tests/ddp_worker.py OUT``.
Each case trains a conv-BatchNorm net in float64 with DDP; the test holds the result against
autograd through the stated forward (one process forwarding each rank's part separately).
"""

import sys

import torch
from step_reference import BNNet, make_batch  # tests/ is on PYTHONPATH (test_distributed.py)
from torch.nn.parallel import DistributedDataParallel

from facenet.distributed import (
    barrier,
    cleanup_distributed,
    get_rank,
    get_world_size,
    init_distributed,
)
from facenet.errors import NonFiniteInputError
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.presets import VerifySettings
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import Triplets
from facenet.metric.triplet_margin_miner import TripletMarginMiner
from facenet.training.engine import Trainer
from facenet.training.step import build_step

STEPS, P, K, LR, MARGIN = 3, 6, 4, 0.5, 0.5


class FirstBlockMiner:
    """Batch-hard triplets among the first 12 images only: rank 1 of 2 selects nothing."""

    selects_every_image = False

    def __call__(self, embeddings, labels, candidates=None):
        return BatchHardMiner()(embeddings[:12], labels[:12])


class OneOnRankOneMiner(FirstBlockMiner):
    """Like FirstBlockMiner, but the first triplet's negative is image 12: rank 1 of 2 has
    exactly one selected image."""

    def __call__(self, embeddings, labels, candidates=None):
        anchor, positive, negative = super().__call__(embeddings, labels)
        negative = negative.clone()
        negative[0] = 12
        return Triplets(anchor, positive, negative)


MINERS = {
    "batch_hard": BatchHardMiner,
    "sparse": lambda: TripletMarginMiner(margin=0.02, type_of_triplets="semihard"),
    "first_block": FirstBlockMiner,
    "one_on_rank_one": OneOnRankOneMiner,
}
# (path, miner, ce_weight, chunk_size)
CASES = [
    ("one-pass", "batch_hard", 0.5, 0),
    ("one-pass", "batch_hard", 0.0, 0),
    ("two-pass", "batch_hard", 0.5, 0),
    ("two-pass", "sparse", 0.5, 0),
    ("two-pass", "sparse", 0.0, 0),
    ("two-pass", "first_block", 0.5, 0),
    ("two-pass", "one_on_rank_one", 0.5, 0),
    ("chunked", "batch_hard", 0.5, 5),
    ("chunked", "sparse", 0.0, 4),
    ("chunked", "first_block", 0.5, 4),
    ("chunked", "batch_hard", 0.0, 11),  # 11 + 1: the last image joins the first chunk
]


NAN_CASES = [(1, 0), (2, 0), (2, 4)]


def initial_model(ce):
    torch.manual_seed(0)
    return BNNet(num_classes=P if ce else None).double()


def batches():
    return [make_batch(P, K, seed=100 + step) for step in range(STEPS)]


def train(path, miner, ce, chunk):
    """The parameters after STEPS steps; this rank trains on its block of each batch."""
    model = DistributedDataParallel(initial_model(ce), broadcast_buffers=False)
    step = build_step(
        model,
        MINERS[miner](),
        TripletMarginLoss(margin=MARGIN),
        passes=1 if path == "one-pass" else 2,
        ce_weight=ce,
        chunk_size=chunk,
    )
    trainer = Trainer(step, torch.optim.SGD(model.parameters(), lr=LR))
    assert trainer.step.name == path
    rank, world = get_rank(), get_world_size()
    for images, labels in batches():
        share = images.shape[0] // world
        local = slice(rank * share, (rank + 1) * share)
        stats = trainer.train_step(images[local], labels[local])
        assert "skipped" not in stats, stats
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def nan_on_rank_one(passes, chunk):
    """One step where only rank 1's images hold NaN; what each rank saw (every rank must raise,
    or the ranks would part ways at the next collective)."""
    model = DistributedDataParallel(initial_model(0.0), broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    step = build_step(
        model, BatchHardMiner(), TripletMarginLoss(MARGIN), passes=passes, chunk_size=chunk
    )
    trainer = Trainer(step, optimizer)
    images, labels = make_batch(P, K, seed=7)
    share = images.shape[0] // get_world_size()
    local = images[get_rank() * share : (get_rank() + 1) * share].clone()
    if get_rank() == 1:
        local[3, 0, 0, 0] = float("nan")
    try:
        trainer.train_step(local, labels[get_rank() * share : (get_rank() + 1) * share])
        seen = "trained"
    except NonFiniteInputError as err:
        seen = f"raised rows={err.rows}"
    everyone = [None] * get_world_size()
    torch.distributed.all_gather_object(everyone, seen)  # the group still works
    return everyone


def embed_pairs(pairs_path):
    """Both sides of the pairs in ``pairs_path``, embedded by the ranks' shards."""
    from facenet.data.pairs import read_pairs

    torch.manual_seed(0)
    model = BNNet(num_classes=None).eval()
    return embed_pair_list(model, read_pairs(pairs_path), 8, VerifySettings(batch_size=2))


def main(out, pairs_path=None):
    init_distributed("cpu")
    results = {"|".join(map(str, case)): train(*case) for case in CASES}
    results["nan_on_rank_one"] = {
        f"{passes}|{chunk}": nan_on_rank_one(passes, chunk) for passes, chunk in NAN_CASES
    }
    if pairs_path:
        results["pairs"] = embed_pairs(pairs_path)
    if get_rank() == 0:
        torch.save(results, out)
    barrier()  # no rank tears the group down while another still uses it
    cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
