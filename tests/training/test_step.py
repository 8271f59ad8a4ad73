"""Every step path's gradient is the autograd gradient of its stated forward, BatchNorm
included (float64, conv-BatchNorm net); running statistics follow that forward; the path is
chosen once, from the miner and the settings."""

import copy

import pytest
import torch
from step_reference import BNNet, assert_relative_close, make_batch, stated_backward
from torch import nn

from facenet.config import StepSettings, load_config
from facenet.errors import ConfigError
from facenet.memory import GraphMemoryMeter
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.margin_softmax import MarginSoftmaxLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.metric.triplet_margin_miner import TripletMarginMiner
from facenet.models.embedding import CosineClassifier
from facenet.training.chunked import ChunkedStep
from facenet.training.engine import Trainer, TrainerSettings
from facenet.training.step import OnePassStep, TwoPassStep, build_step, choose_step


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.recorded = [
            None if p.grad is None else p.grad.clone()
            for group in self.param_groups
            for p in group["params"]
        ]
        return super().step(closure)


def sparse_miner():
    return TripletMarginMiner(margin=0.01, type_of_triplets="semihard")


MINERS = {"batch_hard": BatchHardMiner, "sparse": sparse_miner}
# No cross-entropy, plain cross-entropy (weight 0.5), a margin softmax's kind (weight 0.5)
CE = [0.0, 0.5, "cosface", "arcface"]


def with_ce(model, ce):
    """``model`` (8-d prelogits, 6 classes) and its ce_weight for a ``CE`` case: a kind puts a
    cosine classifier holding that margin softmax in place of the linear one."""
    if isinstance(ce, str):
        model.classifier = CosineClassifier(8, 6, MarginSoftmaxLoss(ce, scale=8.0))
        return model, 0.5
    return model, ce


def bn_buffers(model):
    return [
        buffer.clone()
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        for buffer in (m.running_mean, m.running_var, m.num_batches_tracked)
    ]


def compare_one_step(path, miner, ce, chunk=0, dropout=0.0, passes=None):
    """One trainer step against autograd through the stated forward, from the same state."""
    torch.manual_seed(0)
    model, ce = with_ce(BNNet(num_classes=6 if ce else None, dropout=dropout), ce)
    model = model.double()
    reference = copy.deepcopy(model)
    images, labels = make_batch()
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    step = build_step(
        model,
        MINERS[miner](),
        TripletMarginLoss(margin=0.5),
        ce_weight=ce,
        passes=passes or (1 if path == "one-pass" else 2),
        chunk_size=chunk,
    )
    trainer = Trainer(step, optimizer)
    assert trainer.step.name == path
    torch.manual_seed(1)
    stats = trainer.train_step(images, labels)
    assert "skipped" not in stats
    torch.manual_seed(1)
    want_loss = stated_backward(
        reference,
        images,
        labels,
        path,
        MINERS[miner](),
        TripletMarginLoss(margin=0.5),
        chunk=chunk,
        ce=ce,
    )
    assert_relative_close(stats["loss"], want_loss, rel=1e-10)
    want = [p.grad for p in reference.parameters()]
    assert [g is None for g in optimizer.recorded] == [g is None for g in want]
    # Relative to the largest gradient (a conv bias before BatchNorm has a zero gradient).
    largest = max(g.abs().max() for g in want if g is not None)
    for got, expected in zip(optimizer.recorded, want):
        if expected is not None:
            assert_relative_close(got, expected, scale=largest)
    for got, expected in zip(bn_buffers(model), bn_buffers(reference)):
        assert_relative_close(got, expected, rel=1e-12)
    return stats


@pytest.mark.parametrize("ce", CE)
@pytest.mark.parametrize("miner", ["batch_hard", "sparse"])
@pytest.mark.parametrize("path", ["one-pass", "two-pass"])
def test_one_and_two_pass_equal_autograd_through_their_forward(path, miner, ce):
    stats = compare_one_step(path, miner, ce)
    if miner == "sparse" and path == "two-pass":
        assert stats["selected_images"] < 24  # a subset: its own BatchNorm batch


@pytest.mark.parametrize("ce", CE)
@pytest.mark.parametrize("miner", ["batch_hard", "sparse"])
@pytest.mark.parametrize("chunk", [5, 8, 23, 24])  # 23: 23 + 1, one chunk of 24
def test_chunked_equals_autograd_through_per_chunk_forwards(chunk, miner, ce):
    compare_one_step("chunked", miner, ce, chunk=chunk)


@pytest.mark.parametrize("chunk", [6, 10])
def test_chunked_replays_dropout_masks(chunk):
    compare_one_step("chunked", "batch_hard", 0.5, chunk=chunk, dropout=0.3)


def test_chunked_skips_chunks_without_selected_images():
    """Chunks with no selected image get no grad forward; the no-grad pass covers them all."""
    torch.manual_seed(0)
    model = BNNet(num_classes=None).double()
    images, labels = make_batch(p=4, k=4)
    miner = TripletMarginMiner(margin=10.0, type_of_triplets="all")  # keeps every candidate
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    trainer = Trainer(build_step(model, miner, TripletMarginLoss(0.5), chunk_size=4), optimizer)
    forwards = []
    model.backbone[0].register_forward_hook(
        lambda m, i, o: forwards.append(torch.is_grad_enabled())
    )
    candidates = tuple(torch.tensor([v]) for v in (0, 1, 4))  # chunks 0 and 1 only
    stats = trainer.train_step(images, labels, candidates=candidates)
    assert stats["selected_images"] == 3
    assert forwards == [False] * 4 + [True] * 2


@pytest.mark.parametrize(
    "passes, chunk, dense, expected",
    [
        ("auto", 0, True, "one-pass"),
        ("auto", 0, False, "two-pass"),
        ("auto", 4, True, "chunked"),
        (2, 4, True, "chunked"),
        (2, 0, True, "two-pass"),
        (1, 0, False, "one-pass"),
    ],
)
def test_choose_step(passes, chunk, dense, expected):
    assert choose_step(StepSettings(passes, chunk), dense) == expected


def test_triplet_lists_take_two_passes_unless_told_otherwise():
    assert choose_step(StepSettings("auto", 0, triplet_lists=True), True) == "two-pass"
    assert choose_step(StepSettings("auto", 4, triplet_lists=True), True) == "chunked"
    explicit = StepSettings(1, 0, triplet_lists=True)
    assert choose_step(explicit, True) == "one-pass"  # explicit passes kept


def test_one_pass_with_chunks_is_refused_naming_both():
    """The settings refuse, for callers of build_step, what the configuration refuses; the
    configuration's message names its keys."""
    with pytest.raises(ConfigError, match="^passes: 1 cannot be used with chunk_size: 4;"):
        StepSettings(1, 4)
    with pytest.raises(ConfigError, match="passes: 1 cannot be used with chunk_size: 4"):
        build_step(BNNet(num_classes=None), BatchHardMiner(), None, passes=1, chunk_size=4)
    for bad in (3, True):
        with pytest.raises(ConfigError, match="^passes: "):
            StepSettings(bad, 0)
    for bad in (-1, 1, 2.5, "4", True):
        with pytest.raises(ConfigError, match="^chunk_size: .*; 0 \\(off\\) or at least 2"):
            StepSettings(2, bad)
    with pytest.raises(ConfigError, match="mining.passes: 1 .*train.chunk_size: 4"):
        load_config(None, ["mining.passes=1", "train.chunk_size=4"])
    for bad in ("3", "true"):
        with pytest.raises(ConfigError, match="passes"):
            load_config(None, [f"mining.passes={bad}"])
    for bad in ("-1", "1", "2.5", "'4'", "true"):
        with pytest.raises(ConfigError, match="train.chunk_size: "):
            load_config(None, [f"train.chunk_size={bad}"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.chunk_size=1"], "train.chunk_size: 1; 0 (off) or at least 2: each chunk is"),
        (["train.chunk_size=-3"], "train.chunk_size: -3; 0 (off) or at least 2: each chunk is"),
        (
            ["mining.passes=1", "train.chunk_size=8"],
            "mining.passes: 1 cannot be used with train.chunk_size: 8; chunked steps are "
            "two-pass (use mining.passes: 2 or auto)",
        ),
    ],
)
def test_the_configuration_names_the_keys_the_step_settings_refuse(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(f"<defaults> with --set overrides: {message}")


@pytest.mark.parametrize(
    "miner, expected",
    [
        (BatchHardMiner(), OnePassStep),
        (SemiHardNegativeMiner(fallback="hardest"), OnePassStep),
        (SemiHardNegativeMiner(fallback="skip"), TwoPassStep),
        (SemiHardNegativeMiner(fallback="hardest", max_triplets=10), TwoPassStep),
        (TripletMarginMiner(margin=0.2), TwoPassStep),
    ],
)
def test_auto_follows_the_miners_selection(miner, expected):
    model = BNNet(num_classes=None)
    assert type(build_step(model, miner, TripletMarginLoss(0.2))) is expected


def test_auto_with_chunk_size_is_chunked():
    model = BNNet(num_classes=None)
    step = build_step(model, BatchHardMiner(), TripletMarginLoss(0.2), chunk_size=8)
    assert type(step) is ChunkedStep


@pytest.mark.parametrize("passes, chunk", [(1, 0), (2, 0), (2, 6)])
def test_no_graph_outlives_a_step(passes, chunk):
    torch.manual_seed(0)
    model = BNNet(num_classes=6)
    images, labels = make_batch(dtype=torch.float32)
    step = build_step(
        model,
        BatchHardMiner(),
        TripletMarginLoss(0.5),
        ce_weight=0.5,
        passes=passes,
        chunk_size=chunk,
    )
    trainer = Trainer(
        step, torch.optim.SGD(model.parameters(), 0.1), settings=TrainerSettings(graph_memory=True)
    )
    with trainer.meter:
        trainer.train_step(images, labels)
        assert trainer.meter.peak_bytes > 0
        assert trainer.meter.alive_bytes == 0


# ---------------------------------------------------------------- without batch dependence


class GroupNormNet(nn.Module):
    """An embedding net whose output for an image does not depend on the rest of the batch."""

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
        embeddings = torch.nn.functional.normalize(z, dim=1)
        return (embeddings, self.classifier(z)) if return_logits else embeddings


# 2: the smallest chunk; 17: 17 + 1, the single last image joins the chunk before
@pytest.mark.parametrize("chunk", [2, 4, 5, 17, 18, 64])
@pytest.mark.parametrize("ce", CE)
def test_without_batch_dependence_chunked_equals_unchunked(chunk, ce):
    torch.manual_seed(0)
    model, ce = with_ce(GroupNormNet(), ce)
    model = model.double()
    images, labels = make_batch(p=6, k=3, size=12)
    recorded = []
    for chunk_size, passes in ((0, 1), (chunk, 2)):
        copy_ = copy.deepcopy(model)
        optimizer = RecordingSGD(copy_.parameters(), lr=0.1)
        step = build_step(
            copy_,
            BatchHardMiner(),
            TripletMarginLoss(0.5),
            ce_weight=ce,
            passes=passes,
            chunk_size=chunk_size,
        )
        trainer = Trainer(step, optimizer)
        stats = trainer.train_step(images, labels)
        recorded.append((stats["loss"], optimizer.recorded))
    (want_loss, want), (got_loss, got) = recorded
    assert_relative_close(got_loss, want_loss, rel=1e-12)
    largest = max(g.abs().max() for g in want if g is not None)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert_relative_close(g, w, scale=largest)


def forward_peak(model, images):
    meter = GraphMemoryMeter(exclude=model)
    with meter:
        out = model(images)
        peak = meter.peak_bytes
        del out
    return peak


@pytest.mark.parametrize("chunk", [3, 6, 9])
def test_chunked_peak_is_one_chunks_worth(chunk):
    torch.manual_seed(0)
    model = BNNet(num_classes=None)
    images, labels = make_batch(p=6, k=3, size=32, dtype=torch.float32)
    peaks = {}
    for name, chunk_size, passes in (("whole", 0, 1), ("chunked", chunk, 2)):
        copy_ = copy.deepcopy(model)
        step = build_step(
            copy_, BatchHardMiner(), TripletMarginLoss(0.5), passes=passes, chunk_size=chunk_size
        )
        trainer = Trainer(
            step,
            torch.optim.SGD(copy_.parameters(), 0.1),
            settings=TrainerSettings(graph_memory=True),
        )
        with trainer.meter:
            trainer.train_step(images, labels)
        peaks[name] = trainer.meter.peak_bytes
        assert trainer.meter.alive_bytes == 0
    assert peaks["chunked"] <= chunk / images.shape[0] * peaks["whole"] * 1.1 + 32 * 1024
    one_chunk = forward_peak(copy.deepcopy(model).train(), images[:chunk])
    assert peaks["chunked"] <= one_chunk * 1.1 + 32 * 1024
