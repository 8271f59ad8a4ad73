"""The miners' and losses' refusals: indices outside [0, rows) for every index argument, NaN
and inf embeddings for every class, and no host read added on the training path."""

import pytest
import torch
from host_syncs import HostSyncs

from facenet.config import LossConfig, MiningConfig
from facenet.metric import build_loss, build_miner
from facenet.metric.batch_all_loss import batch_all_triplet_loss
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.checks import check_index_range
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.metric.triplet_margin_miner import TripletMarginMiner
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer
from facenet.training.step import build_step

MINERS = {
    "triplet_margin": lambda **kw: TripletMarginMiner(0.5, "all", **kw),
    "batch_hard": lambda **kw: BatchHardMiner(**kw),
    "semihard": lambda **kw: SemiHardNegativeMiner(0.5, generator=torch.Generator(), **kw),
}
ARGUMENTS = ("anchor", "positive", "negative")


def batch(p=4, k=4, d=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.functional.normalize(torch.randn(p * k, d, generator=generator), dim=1)
    return embeddings, torch.arange(p).repeat_interleave(k)


def triplets_with(position: int, value: int, t=3):
    """Valid (a, p, n) index tensors with ``value`` at ``position`` of one of them."""
    good = [torch.tensor([0, 1, 2][:t]), torch.tensor([1, 2, 3][:t]), torch.tensor([4, 5, 6][:t])]
    good[position] = good[position].clone()
    good[position][-1] = value
    return tuple(good)


# --------------------------------------------------------------------------- indices


@pytest.mark.parametrize("position", range(3))
@pytest.mark.parametrize("value", [-1, -16, 16, 1000])
def test_the_loss_refuses_every_out_of_range_index(position, value):
    embeddings, _ = batch()  # 16 rows
    loss_fn = TripletMarginLoss()
    with pytest.raises(IndexError, match=rf"{ARGUMENTS[position]} indices must lie in \[0, 16\)"):
        loss_fn(embeddings, triplets_with(position, value))
    with pytest.raises(IndexError, match=rf"got {value}$"):
        loss_fn(embeddings, triplets_with(position, value))


@pytest.mark.parametrize("position", [1, 2])
def test_ref_embeddings_bound_the_positives_and_negatives(position):
    embeddings, _ = batch()  # 16 rows
    ref = embeddings[:8]
    loss_fn = TripletMarginLoss()
    loss_fn(embeddings, triplets_with(position, 7), ref_embeddings=ref)  # 7 < 8: fine
    with pytest.raises(IndexError, match=r"\[0, 8\) \(ref_embeddings has 8 rows"):
        loss_fn(embeddings, triplets_with(position, 8), ref_embeddings=ref)
    # Anchors index the embeddings: 15 is a valid anchor even though ref has 8 rows.
    loss_fn(embeddings, triplets_with(0, 15), ref_embeddings=ref)


@pytest.mark.parametrize("miner", MINERS)
@pytest.mark.parametrize("position", range(3))
@pytest.mark.parametrize("value", [-1, 16])
def test_every_miner_refuses_out_of_range_candidates(miner, position, value):
    embeddings, labels = batch()
    with pytest.raises(IndexError, match=f"candidate {ARGUMENTS[position]} indices must lie"):
        MINERS[miner]()(embeddings, labels, candidates=triplets_with(position, value))


def test_batch_all_and_miners_with_valid_candidates_still_run():
    embeddings, labels = batch()
    for make in MINERS.values():
        make()(embeddings, labels, candidates=triplets_with(0, 15))
    assert torch.isfinite(batch_all_triplet_loss(embeddings, labels))


def test_the_range_check_names_many_bad_values_briefly():
    with pytest.raises(IndexError, match=r"got -3, -2, -1, 9, 10 \(and 2 more\)"):
        check_index_range(torch.tensor([-3, -2, -1, 0, 9, 10, 11, 12]), 9, "f", "anchor", "x")
    check_index_range(torch.zeros(0, dtype=torch.long), 0, "f", "anchor", "x")  # empty: fine


# --------------------------------------------------------------------------- non-finite


def poisoned(value, row=5):
    embeddings, labels = batch()
    embeddings[row, 2] = value
    return embeddings, labels


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("miner", MINERS)
def test_every_miner_selects_nothing_from_a_non_finite_batch(miner, value):
    embeddings, labels = poisoned(value)
    assert MINERS[miner]()(embeddings, labels).num_triplets == 0
    candidates = triplets_with(0, 0)  # rows 0..6; row 5 (non-finite) among them
    assert MINERS[miner]()(embeddings, labels, candidates=candidates).num_triplets == 0
    far = (torch.tensor([8]), torch.tensor([9]), torch.tensor([12]))  # rows without it
    assert MINERS[miner]()(embeddings, labels, candidates=far).num_triplets == 0
    assert MINERS[miner]()(*batch()).num_triplets > 0  # the same miner on a finite batch


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("miner", MINERS)
def test_every_miner_raises_naming_the_rows_when_asked(miner, value):
    embeddings, labels = poisoned(value, row=7)
    name = type(MINERS[miner]()).__name__
    with pytest.raises(ValueError, match=rf"{name}: 1 of 16 embeddings rows .*\(rows 7\)"):
        MINERS[miner](on_nonfinite="raise")(embeddings, labels)
    with pytest.raises(ValueError, match=r"rows 7"):
        MINERS[miner](on_nonfinite="raise")(embeddings, None, candidates=triplets_with(0, 0))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_losses_are_nan_for_non_finite_embeddings(value):
    embeddings, labels = poisoned(value, row=12)  # a row no triplet below uses
    embeddings.requires_grad_(True)
    unused = triplets_with(0, 0)
    assert TripletMarginLoss()(embeddings, unused).isnan()
    assert TripletMarginLoss(swap=True)(embeddings, unused).isnan()
    clean, _ = batch()
    assert TripletMarginLoss()(clean, unused, ref_embeddings=embeddings).isnan()
    assert batch_all_triplet_loss(embeddings, labels).isnan()
    assert torch.isfinite(TripletMarginLoss()(clean, unused))


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_the_losses_raise_naming_the_rows_when_asked(value):
    embeddings, labels = poisoned(value, row=3)
    t = triplets_with(0, 0)
    with pytest.raises(ValueError, match=r"TripletMarginLoss: 1 of 16 embeddings rows .*rows 3"):
        TripletMarginLoss(on_nonfinite="raise")(embeddings, t)
    clean, _ = batch()
    with pytest.raises(ValueError, match=r"1 of 16 ref_embeddings rows .*rows 3"):
        TripletMarginLoss(on_nonfinite="raise")(clean, t, ref_embeddings=embeddings)
    with pytest.raises(ValueError, match=r"batch_all_triplet_loss: 1 of 16 .*rows 3"):
        batch_all_triplet_loss(embeddings, labels, on_nonfinite="raise")


def test_unknown_on_nonfinite_is_refused():
    for make in (*MINERS.values(), TripletMarginLoss):
        with pytest.raises(ValueError, match="unknown on_nonfinite 'ignore'; valid: defer, raise"):
            make(on_nonfinite="ignore")
    with pytest.raises(ValueError, match="unknown on_nonfinite"):
        batch_all_triplet_loss(*batch(), on_nonfinite="warn")


def test_objects_built_from_the_config_defer_to_the_trainer():
    assert build_loss(LossConfig()).on_nonfinite == "defer"
    for name in MINERS:
        assert build_miner(MiningConfig(miner=name)).on_nonfinite == "defer"


# --------------------------------------------------------------------------- no host read


class HostReads:
    """Counts the Python-level ways of reading a tensor back to the host."""

    NAMES = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(original))

    def _counting(self, original):
        def read(tensor, *args, **kwargs):
            self.count += 1
            return original(tensor, *args, **kwargs)

        return read


def every_triplet(labels):
    """Every valid (a, p, n) of a labelled batch, as candidate index tensors."""
    same = labels[:, None] == labels[None, :]
    positive = same & ~torch.eye(len(labels), dtype=torch.bool)
    a, p, n = (positive[:, :, None] & ~same[:, None, :]).nonzero(as_tuple=True)
    return a, p, n


def one_step_reads(monkeypatch, miner_name, checks_on, candidates=False):
    """Host reads in one Trainer step built from the config, with the checks on or off."""
    import facenet.metric.checks as checks

    if not checks_on:  # the baseline: range checks and the finiteness flag as no-ops
        monkeypatch.setattr(checks, "check_index_range", lambda *a, **k: None)
        for module in ("facenet.metric.miners", "facenet.metric.losses"):
            monkeypatch.setattr(f"{module}.finite_flag", lambda *a: torch.tensor(True))
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16)
    miner = build_miner(MiningConfig(miner=miner_name), generator=torch.Generator().manual_seed(0))
    step = build_step(model, miner, build_loss(LossConfig()), passes=2)
    trainer = Trainer(step, torch.optim.SGD(model.parameters(), lr=0.01))
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(16, 3, 32, 32, generator=generator)
    labels = torch.arange(4).repeat_interleave(4)
    triplet_candidates = every_triplet(labels) if candidates else None
    reads = HostReads(monkeypatch)
    stats = trainer.train_step(images, labels, triplet_candidates)
    monkeypatch.undo()
    assert "skipped" not in stats
    return reads.count


@pytest.mark.parametrize("miner", MINERS)
@pytest.mark.parametrize("candidates", [False, True])
def test_the_checks_add_no_host_read_to_a_training_step(monkeypatch, miner, candidates):
    with_checks = one_step_reads(monkeypatch, miner, True, candidates)
    without = one_step_reads(monkeypatch, miner, False, candidates)
    assert with_checks == without > 0  # the step's own reads (selection sizes, _finite)


def test_the_checks_and_losses_make_no_blocking_call():
    """What the CUDA test below runs under sync-debug "error", counted on the CPU."""
    embeddings, labels = batch()
    t = triplets_with(0, 0)
    with HostSyncs() as syncs:
        check_index_range(t[0], 16, "f", "anchor", "embeddings")
        TripletMarginLoss()(embeddings, t)
        batch_all_triplet_loss(embeddings, labels)
        batch_all_triplet_loss(embeddings, labels, chunk_size=3, soft_margin=True)
    assert syncs.total == 0, dict(syncs.counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_checks_do_not_synchronise():
    embeddings, labels = batch()
    embeddings, labels = embeddings.cuda(), labels.cuda()
    t = tuple(x.cuda() for x in triplets_with(0, 0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        check_index_range(t[0], 16, "f", "anchor", "embeddings")
        TripletMarginLoss()(embeddings, t)
        batch_all_triplet_loss(embeddings, labels)
    finally:
        torch.cuda.set_sync_debug_mode("default")
