"""The corrected step, measured: no graph alive after a step, the peak bounded by the selected
images' forward, the triplet gradient reaching the model, BatchNorm updated once per step."""

import copy
import time

import pytest
import torch

from facenet.errors import NonFiniteInputError, NonFiniteLossError
from facenet.memory import GraphMemoryMeter
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import Triplets
from facenet.metric.triplet_margin_miner import TripletMarginMiner
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer, TrainerSettings
from facenet.training.step import build_step, unique_triplet_images


def make_batch(p=4, k=4, size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(p * k, 3, size, size, generator=generator)
    labels = torch.arange(p).repeat_interleave(k)
    return images, labels


def make_trainer(passes=2, ce_weight=0.0, miner=None, margin=0.2, lr=0.01, seed=0, **kwargs):
    torch.manual_seed(seed)
    model = EmbeddingNet("tiny", embedding_dim=16, num_classes=4 if ce_weight else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    settings = TrainerSettings(graph_memory=True, **kwargs.pop("settings", {}))
    step = build_step(
        model,
        miner or BatchHardMiner(distance="squared"),
        TripletMarginLoss(margin=margin),
        passes=passes,
        ce_weight=ce_weight,
        **kwargs,
    )
    return Trainer(step, optimizer, settings=settings)


def step_under_meter(trainer, *batch, triplet_mode=False):
    meter = trainer.meter
    with meter:
        meter.reset_peak()
        if triplet_mode:
            stats = trainer.train_triplet_step(*batch)
        else:
            stats = trainer.train_step(*batch)
    return stats, meter.peak_bytes, meter.alive_bytes


def seed_triplets(t=8, size=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a, p, n = (torch.randn(t, 3, size, size, generator=generator) for _ in range(3))
    label_p = torch.randint(0, 4, (t,), generator=generator)
    label_n = (label_p + 1) % 4
    return a, p, n, label_p, label_n


# ---------------------------------------------------------------- no graph outlives the step


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("ce_weight", [0.0, 1.0])
def test_no_graph_bytes_alive_after_a_step(passes, ce_weight):
    trainer = make_trainer(passes=passes, ce_weight=ce_weight)
    for seed in range(2):
        stats, peak, alive = step_under_meter(trainer, *make_batch(seed=seed))
        assert "skipped" not in stats
        assert peak > 0  # the grad forward did hold activations during the step
        assert alive == 0


def test_no_graph_bytes_alive_after_a_seed_compatible_step():
    miner = TripletMarginMiner(margin=10.0, type_of_triplets="all", distance="euclidean")
    trainer = make_trainer(miner=miner, margin=0.2)
    stats, peak, alive = step_under_meter(trainer, *seed_triplets(), triplet_mode=True)
    assert "skipped" not in stats and peak > 0 and alive == 0


# ---------------------------------------------------------------- peak graph memory


def forward_peak(model, images):
    """Graph bytes of one grad forward on ``images`` (what the step must not exceed)."""
    model = copy.deepcopy(model)
    meter = GraphMemoryMeter()
    with meter:
        embeddings = model(images)
        peak = meter.peak_bytes
        del embeddings
    return peak


class FirstIdentitiesMiner:
    """Batch-hard mining restricted to the first ``n`` identities: a known, sparse selection."""

    def __init__(self, n):
        self.n, self.inner = n, BatchHardMiner(distance="squared")

    def __call__(self, embeddings, labels, candidates=None):
        keep = torch.nonzero(labels < self.n).squeeze(1)
        a, p, n = self.inner(embeddings[keep], labels[keep])
        return Triplets(keep[a], keep[p], keep[n])


@pytest.mark.parametrize("identities", [2, 4, 8])
def test_two_pass_peak_is_one_forward_on_the_selected_images(identities):
    images, labels = make_batch(p=8, k=4)
    trainer = make_trainer(miner=FirstIdentitiesMiner(identities))
    selected = images[labels < identities]
    expected = forward_peak(trainer.model, selected)
    _, peak, alive = step_under_meter(trainer, images, labels)
    assert alive == 0
    assert expected * 0.95 <= peak <= 1.05 * expected + 64 * 1024
    # Activations scale with the number of images: the peak falls with the selection.
    full_batch = forward_peak(trainer.model, images)
    assert peak <= full_batch * (selected.shape[0] / images.shape[0]) * 1.1 + 64 * 1024


def test_one_pass_peak_is_the_whole_batch():
    images, labels = make_batch(p=8, k=4)
    two = make_trainer(passes=2, miner=FirstIdentitiesMiner(4))
    one = make_trainer(passes=1, miner=FirstIdentitiesMiner(4))
    _, peak_two, _ = step_under_meter(two, images, labels)
    _, peak_one, _ = step_under_meter(one, images, labels)
    assert peak_one >= forward_peak(one.model, images) * 0.95
    assert peak_two < peak_one


def test_dense_selection_peak_is_at_most_half_the_seed_loops():
    from benchmarks.seed_loop import SeedModel, seed_epoch

    batches = [seed_triplets(t=8, seed=s) for s in range(3)]
    torch.manual_seed(0)
    seed_model = SeedModel(EmbeddingNet("tiny", embedding_dim=16), num_classes=4)
    optimizer = torch.optim.SGD(seed_model.parameters(), lr=0.01)
    seed_meter = GraphMemoryMeter()
    with seed_meter:
        seed_epoch(seed_model, optimizer, batches, margin=10.0)  # margin 10: all triplets "hard"
    miner = TripletMarginMiner(margin=10.0, type_of_triplets="all", distance="euclidean")
    trainer = make_trainer(miner=miner)
    peaks = []
    for batch in batches:
        stats, peak, _ = step_under_meter(trainer, *batch, triplet_mode=True)
        assert stats["selected_images"].item() == 24  # nearly every image selected: all of them
        peaks.append(peak)
    assert max(peaks) <= 0.5 * seed_meter.peak_bytes


# ---------------------------------------------------------------- gradients and BatchNorm


def test_triplet_gradient_reaches_every_parameter():
    trainer = make_trainer(ce_weight=0.0, lr=0.1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stats = trainer.train_step(*make_batch())
    assert stats["triplet_loss"].item() > 0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert set(changed) == set(before)


class TripletTermOff(TripletMarginLoss):
    """The same loss value and statistics, with the triplet gradient cut to zero."""

    def forward(self, embeddings, triplets, ref_embeddings=None):
        return super().forward(embeddings, triplets, ref_embeddings) * 0.0


def test_triplet_term_changes_the_update_beyond_cross_entropy():
    images, labels = make_batch()
    with_triplet = make_trainer(ce_weight=1.0, lr=0.1)
    ce_only = make_trainer(ce_weight=1.0, lr=0.1)
    ce_only.step.loss_fn = TripletTermOff(margin=0.2)
    assert with_triplet.train_step(images, labels)["triplet_loss"].item() > 0
    ce_only.train_step(images, labels)
    backbone_a = [p for p in with_triplet.model.backbone.parameters()]
    backbone_b = [p for p in ce_only.model.backbone.parameters()]
    assert any(not torch.allclose(a, b) for a, b in zip(backbone_a, backbone_b))


def test_batchnorm_running_stats_change_exactly_once_per_step():
    trainer = make_trainer()
    images, labels = make_batch(p=8, k=4)
    reference = copy.deepcopy(trainer.model)
    with torch.no_grad():
        triplets = trainer.step.miner(copy.deepcopy(reference)(images), labels)
    unique, _ = unique_triplet_images(triplets)
    reference.train()
    with torch.no_grad():
        reference(images[unique])  # one update, by the selected images only
    trainer.train_step(images, labels)
    bns = [m for m in trainer.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    ref_bns = [m for m in reference.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns
    for bn, ref in zip(bns, ref_bns):
        assert bn.num_batches_tracked.item() == 1
        torch.testing.assert_close(bn.running_mean, ref.running_mean)
        torch.testing.assert_close(bn.running_var, ref.running_var)


# ---------------------------------------------------------------- nothing mined, non-finite


def test_no_triplets_means_no_grad_forward_and_no_update():
    trainer = make_trainer()
    images = torch.randn(8, 3, 32, 32)
    labels = torch.zeros(8, dtype=torch.long)  # one identity: no negatives
    calls = []
    trainer.model.backbone.register_forward_hook(
        lambda m, i, o: calls.append(torch.is_grad_enabled())
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    stats = trainer.train_step(images, labels)
    assert stats["skipped"] == "no_triplets"
    assert calls == [False]  # only the no-grad mining pass ran
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.counts["no_triplets"] == 1


class NanAfter(TripletMarginLoss):
    """The triplet loss for ``good`` calls, then NaN."""

    def __init__(self, good, margin=0.2):
        super().__init__(margin=margin)
        self.good, self.calls = good, 0

    def forward(self, embeddings, triplets):
        self.calls += 1
        loss = super().forward(embeddings, triplets)
        return loss if self.calls <= self.good else loss * float("nan")


def test_nonfinite_loss_is_skipped_then_stops_the_run():
    trainer = make_trainer(settings={"max_nonfinite_steps": 3})
    trainer.step.loss_fn = NanAfter(good=0)
    images, labels = make_batch()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert trainer.train_step(images, labels)["skipped"] == "nonfinite"
    assert trainer.train_step(images, labels)["skipped"] == "nonfinite"
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    with pytest.raises(NonFiniteLossError, match="3 steps in a row"):
        trainer.train_step(images, labels)


@pytest.mark.parametrize("passes", [1, 2])
def test_nonfinite_images_are_refused_at_once_naming_their_rows(passes):
    trainer = make_trainer(passes=passes)
    images, labels = make_batch()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    images[5, 0, 0, 0] = float("nan")
    images[9, 1, 2, 3] = float("inf")
    with pytest.raises(NonFiniteInputError, match="2 of 16 input images") as info:
        trainer.train_step(images, labels)
    assert info.value.rows == [5, 9]
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_bf16_autocast_step_runs_and_frees_the_graph():
    trainer = make_trainer(amp="bf16")
    stats, peak, alive = step_under_meter(trainer, *make_batch())
    assert torch.isfinite(stats["loss"]) and alive == 0


@pytest.mark.parametrize("passes, chunk_size", [(1, 0), (2, 0), (2, 4)])
def test_a_skipped_nonfinite_step_leaves_batchnorm_statistics_untouched(passes, chunk_size):
    trainer = make_trainer(passes=passes, chunk_size=chunk_size)
    trainer.step.loss_fn = NanAfter(good=1)
    images, labels = make_batch()
    trainer.train_step(images, labels)  # one good step: statistics are not the initial ones
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.train_step(images, labels)["skipped"] == "nonfinite"
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_memory_is_flat_across_epochs():
    from facenet.memory import current_rss_bytes

    trainer = make_trainer(miner=FirstIdentitiesMiner(3))
    loader = [make_batch(p=4, k=4, seed=s) for s in range(2)]  # the same batches each epoch
    records, rss = [], []
    for epoch in range(1, 6):
        records.append(trainer.train_one_epoch(loader, epoch, progress=False))
        rss.append(current_rss_bytes())
    first, last = records[0], records[-1]
    assert first["graph_bytes_peak"] > 0
    assert last["graph_bytes_peak"] <= first["graph_bytes_peak"] * 1.02
    assert last["graph_bytes_alive"] == first["graph_bytes_alive"] == 0
    assert rss[-1] <= rss[0] + 32 * 2**20  # nothing accumulates from epoch to epoch


class NoNormNet(torch.nn.Module):
    """Convolutions only: a NaN image leaves the other images' embeddings finite."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 16),
        )

    def forward(self, x):
        return torch.nn.functional.normalize(self.net(x), dim=1)


@pytest.mark.parametrize("passes, chunk_size", [(1, 0), (2, 0), (2, 8)])
@pytest.mark.parametrize("batchnorm", [True, False])
def test_a_nan_image_the_miner_leaves_out_is_still_refused(passes, chunk_size, batchnorm):
    """A NaN image makes the miner select nothing (or, were it selected, poisons the loss,
    BatchNorm's running statistics or the gradients): the step is undone and the image
    named, on every path."""
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16) if batchnorm else NoNormNet()
    miner = TripletMarginMiner(margin=0.5, type_of_triplets="all")
    step = build_step(model, miner, TripletMarginLoss(0.2), passes=passes, chunk_size=chunk_size)
    trainer = Trainer(step, torch.optim.SGD(model.parameters(), 0.1))
    images, labels = make_batch(p=8, k=4)
    images[30, 0, 0, 0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteInputError) as info:
        trainer.train_step(images, labels)
    assert info.value.rows == [30]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("passes, chunk_size", [(1, 0), (2, 0), (2, 4)])
def test_a_batch_without_triplets_leaves_the_model_as_it_was(passes, chunk_size):
    trainer = make_trainer(passes=passes, chunk_size=chunk_size)
    images, labels = make_batch(p=16, k=1)  # K = 1: no positive, no triplet
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert trainer.train_step(images, labels)["skipped"] == "no_triplets"
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name


# ---------------------------------------------------------------- the schedule, per step


def scheduled_trainer(**kwargs):
    """A trainer whose cosine schedule (warm-up 2 steps) spans 3 epochs of 4 steps."""
    from facenet.config import OptimConfig
    from facenet.training.optim import build_scheduler

    trainer = make_trainer(lr=0.1, **kwargs)
    cfg = OptimConfig(lr=0.1, warmup_steps=2)
    trainer.scheduler = build_scheduler(trainer.optimizer, cfg, epochs=3, steps_per_epoch=4)
    return trainer


def test_the_schedule_advances_once_per_step_skipped_ones_included():
    trainer = scheduled_trainer(settings={"max_nonfinite_steps": 3})
    shape, schedule = trainer.scheduler.shape, trainer.scheduler
    rates = []

    def step_and_check(*batch):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        stats = trainer.train_step(*batch)
        assert schedule.position == trainer.counts["steps"]
        assert trainer.optimizer.param_groups[0]["lr"] == 0.1 * shape.factor(schedule.position)
        return stats

    assert "skipped" not in step_and_check(*make_batch())
    # A batch without triplets trains nothing, and still moves the schedule on.
    assert step_and_check(*make_batch(p=16, k=1))["skipped"] == "no_triplets"
    trainer.step.loss_fn = NanAfter(good=0)
    assert step_and_check(*make_batch())["skipped"] == "nonfinite"
    assert schedule.position == 3 and trainer.global_step == 1
    assert rates == [0.1 * shape.factor(s) for s in range(3)]
    # A batch refused for its images is not a step: retried on resume, the schedule waits.
    images, labels = make_batch()
    images[0, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteInputError):
        trainer.train_step(images, labels)
    assert schedule.position == 3


def test_an_epoch_adds_no_schedule_step_of_its_own():
    trainer = scheduled_trainer()
    loader = [make_batch(seed=s) for s in range(4)]
    record = trainer.train_one_epoch(loader, 1, progress=False)
    assert trainer.scheduler.position == 4 == record["steps"]
    assert record["lr"] == 0.1 * trainer.scheduler.shape.factor(4)  # the next step's rate
    state = trainer.state_dict()["scheduler"]
    assert state["position"] == 4 and state["steps_per_epoch"] == 4


def test_the_epoch_record_says_how_long_the_loop_waited_for_input():
    trainer = make_trainer()
    batches = [make_batch(seed=s) for s in range(3)]

    def slow_loader():  # 0.1 s before each batch, nothing after the last
        for batch in batches:
            time.sleep(0.1)
            yield batch

    slow = trainer.train_one_epoch(slow_loader(), 1, progress=False)
    assert 0.3 <= slow["data_wait_seconds"] < slow["epoch_seconds"]
    assert slow["data_wait_fraction"] == pytest.approx(
        slow["data_wait_seconds"] / slow["epoch_seconds"]
    )
    ready = trainer.train_one_epoch(batches, 2, progress=False)
    assert ready["data_wait_seconds"] < 0.05 and ready["steps"] == 3


class Scaled(TripletMarginLoss):
    """The triplet loss times ``factor``: finite in float32, its fp16 gradients overflow."""

    def __init__(self, factor, margin=0.2):
        super().__init__(margin=margin)
        self.factor = factor

    def forward(self, embeddings, triplets):
        return super().forward(embeddings, triplets) * self.factor


def test_an_fp16_gradient_overflow_is_counted_as_non_finite_not_trained():
    trainer = make_trainer(amp="fp16", settings={"max_nonfinite_steps": 2})
    trainer.step.loss_fn = Scaled(1e6)
    images, labels = make_batch()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    scale = trainer.scaler.get_scale()
    for _ in range(3):  # the scaler's own recovery: never a run of non-finite losses
        assert trainer.train_step(images, labels)["skipped"] == "nonfinite"
    assert trainer.scaler.get_scale() < scale and trainer.global_step == 0
    assert trainer.counts["nonfinite"] == 3 and trainer.counts["trained"] == 0
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    trainer.step.loss_fn = Scaled(1.0)
    assert "skipped" not in trainer.train_step(images, labels)


@pytest.mark.parametrize("amp, passes", [("fp16", 2), ("fp16", 1), ("none", 2)])
def test_overflowing_embeddings_are_non_finite_not_a_batch_without_triplets(amp, passes):
    trainer = make_trainer(amp=amp, passes=passes, settings={"max_nonfinite_steps": 2})
    trainer.model.backbone.register_forward_hook(lambda module, args, out: out * 1e6)
    if amp == "none":  # a float32 overflow of the same kind
        trainer.model.backbone.register_forward_hook(lambda module, args, out: out * 1e38)
    images, _ = make_batch()
    one_identity = torch.zeros(16, dtype=torch.long)  # nothing to mine either way
    assert trainer.train_step(images, one_identity)["skipped"] == "nonfinite"
    assert trainer.counts["no_triplets"] == 0
    with pytest.raises(NonFiniteLossError, match="non-finite embeddings"):
        trainer.train_step(images, one_identity)
    fine = make_trainer(amp=amp, passes=passes)
    assert fine.train_step(images, one_identity)["skipped"] == "no_triplets"
