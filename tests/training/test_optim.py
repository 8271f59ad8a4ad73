"""Parameter groups, per-step schedules relative to each group's own rate, the freeze, the
fine-tuning recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from port_weights import port_state_dict

from facenet.config import OptimConfig, load_config
from facenet.errors import ConfigError, WeightsError
from facenet.models.embedding import EmbeddingNet
from facenet.training.build import build_trainer
from facenet.training.optim import (
    build_optimizer,
    build_scheduler,
    parameter_groups,
    schedule_shape,
)

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def lrs(optimizer) -> dict:
    return {g["name"]: g["lr"] for g in optimizer.param_groups}


def test_groups_split_the_backbone_at_the_named_stage():
    model = EmbeddingNet("tiny", 8, num_classes=3)  # stages "0".."3", then pooling
    cfg = OptimConfig(lr=0.1, backbone_lr_scale=0.5, freeze_backbone_epochs=1, freeze_up_to="1")
    groups = {g["name"]: g for g in parameter_groups(model, cfg)}
    named = dict(model.named_parameters())
    frozen = {n for n in named if n.startswith(("backbone.0.", "backbone.1."))}
    assert {id(p) for p in groups["backbone_frozen"]["params"]} == {id(named[n]) for n in frozen}
    assert len(groups["head"]["params"]) == 5  # linear, bn weight and bias, classifier w and b
    assert sum(len(g["params"]) for g in groups.values()) == len(named)
    assert (groups["backbone"]["lr"], groups["head"]["lr"]) == (0.05, 0.1)
    assert parameter_groups(model, OptimConfig()) == list(model.parameters())
    with pytest.raises(ValueError, match="stages, in order: 0, 1, 2, 3, 4, 5"):
        parameter_groups(model, OptimConfig(freeze_backbone_epochs=1, freeze_up_to="layer9"))


EPOCHS, STEPS_PER_EPOCH = 4, 5


def brute_force_factor(kind: str, step: int, cfg: OptimConfig) -> float:
    """The schedule's factor at ``step`` (0-based), written out epoch by epoch."""
    if kind == "none":
        return 1.0
    warmup = cfg.warmup_steps or cfg.warmup_epochs * STEPS_PER_EPOCH
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if kind == "step":
        decays = 0  # one at every step_size-th epoch boundary after warm-up
        for boundary in range(warmup, step + 1, STEPS_PER_EPOCH):
            epochs_after = (boundary - warmup) // STEPS_PER_EPOCH
            decays += epochs_after > 0 and epochs_after % cfg.step_size == 0
        return cfg.gamma**decays
    remaining = EPOCHS * STEPS_PER_EPOCH - warmup
    angle = math.pi * min(1.0, (step - warmup) / remaining)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * (1 + math.cos(angle)) / 2


SCHEDULE_CASES = {
    "cosine-warmup-epochs": dict(schedule="cosine", warmup_epochs=1),
    "cosine-warmup-steps": dict(schedule="cosine", warmup_steps=3, min_lr_ratio=0.05),
    "cosine-no-warmup": dict(schedule="cosine"),
    "step-warmup": dict(schedule="step", step_size=1, gamma=0.5, warmup_steps=2),
    "step-two-epochs": dict(schedule="step", step_size=2, gamma=0.1),
    "none": dict(schedule="none"),
}


@pytest.mark.parametrize("scale", [0.5, 0.001])
@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=list(SCHEDULE_CASES))
def test_each_group_follows_its_own_starting_rate_at_every_step(case, scale):
    cfg = OptimConfig(lr=0.1, backbone_lr_scale=scale, **SCHEDULE_CASES[case])
    optimizer = build_optimizer(parameter_groups(EmbeddingNet("tiny", 8), cfg), cfg)
    schedule = build_scheduler(optimizer, cfg, EPOCHS, STEPS_PER_EPOCH)
    assert (schedule is None) == (cfg.schedule == "none")
    starts = {"head": 0.1, "backbone": 0.1 * scale}
    warmup = cfg.warmup_steps or cfg.warmup_epochs * STEPS_PER_EPOCH
    seen = []
    for step in range(EPOCHS * STEPS_PER_EPOCH + 3):  # a little past the end: the floor holds
        factor = brute_force_factor(cfg.schedule, step, cfg)
        for name, start in starts.items():
            assert lrs(optimizer)[name] == pytest.approx(start * factor, rel=1e-12), (step, name)
        seen.append(lrs(optimizer)["backbone"])
        optimizer.step()  # no gradients: nothing moves; the usual order
        if schedule is not None:
            schedule.step()
            assert schedule.position == step + 1
    after_warmup = seen[warmup:]
    # The backbone's rate never rises after warm-up, and stays at or above its own floor.
    assert all(b <= a for a, b in zip(after_warmup, after_warmup[1:]))
    if cfg.schedule == "cosine":
        assert min(seen) == pytest.approx(0.1 * scale * cfg.min_lr_ratio)


def test_the_freeze_holds_lr_0_for_its_epochs_in_steps_then_gives_back_the_schedule():
    common = dict(lr=0.1, schedule="cosine", warmup_steps=2, backbone_lr_scale=0.5)
    frozen_cfg = OptimConfig(**common, freeze_backbone_epochs=2)
    plain_cfg = OptimConfig(**common)
    model = EmbeddingNet("tiny", 8)
    runs = []
    for cfg in (frozen_cfg, plain_cfg):
        optimizer = build_optimizer(parameter_groups(model, cfg), cfg)
        runs.append((optimizer, build_scheduler(optimizer, cfg, EPOCHS, STEPS_PER_EPOCH)))
    (frozen_opt, freeze), (plain_opt, plain) = runs
    for step in range(EPOCHS * STEPS_PER_EPOCH):
        want, got = lrs(plain_opt), lrs(frozen_opt)
        held = step < 2 * STEPS_PER_EPOCH
        assert got["backbone_frozen"] == (0.0 if held else pytest.approx(want["backbone"]))
        assert got["head"] == pytest.approx(want["head"])
        if step == 2 * STEPS_PER_EPOCH - 1:  # mid-run, still frozen: a resumed copy agrees
            resumed_opt = build_optimizer(parameter_groups(model, frozen_cfg), frozen_cfg)
            resumed = build_scheduler(resumed_opt, frozen_cfg, EPOCHS, STEPS_PER_EPOCH)
            resumed.load_state_dict(freeze.state_dict())
            assert lrs(resumed_opt) == got
        freeze.step(), plain.step()
    assert lrs(frozen_opt)["backbone_frozen"] > 0


def test_a_resumed_schedule_continues_at_the_same_rates_bit_for_bit():
    cfg = OptimConfig(lr=0.1, backbone_lr_scale=0.001, warmup_steps=3)
    model = EmbeddingNet("tiny", 8)
    optimizer = build_optimizer(parameter_groups(model, cfg), cfg)
    schedule = build_scheduler(optimizer, cfg, EPOCHS, STEPS_PER_EPOCH)
    for _ in range(7):
        schedule.step()
    copy_opt = build_optimizer(parameter_groups(model, cfg), cfg)
    copy = build_scheduler(copy_opt, cfg, EPOCHS, STEPS_PER_EPOCH)
    copy.load_state_dict(schedule.state_dict())
    for _ in range(EPOCHS * STEPS_PER_EPOCH - 7):
        assert lrs(copy_opt) == lrs(optimizer)  # the same floats, not approximately
        schedule.step(), copy.step()


def _schedule(cfg: OptimConfig, epochs: int, steps_per_epoch: int):
    optimizer = build_optimizer(EmbeddingNet("tiny", 8).parameters(), cfg)
    return build_scheduler(optimizer, cfg, epochs, steps_per_epoch)


def test_resume_problems_name_what_changed():
    cosine, step = OptimConfig(), OptimConfig(schedule="step", warmup_steps=2)
    saved = _schedule(cosine, 4, 5).state_dict()
    assert _schedule(cosine, 4, 5).resume_problem(saved) is None
    assert "train.epochs: 6 differs from the checkpoint's 4" in _schedule(
        cosine, 6, 5
    ).resume_problem(saved)
    assert "an epoch is now 7 steps" in _schedule(cosine, 4, 7).resume_problem(saved)
    saved_step = _schedule(step, 4, 5).state_dict()
    assert _schedule(step, 9, 5).resume_problem(saved_step) is None  # step: length-free
    assert "an epoch is now 3 steps" in _schedule(step, 4, 3).resume_problem(saved_step)
    legacy = {"last_epoch": 2, "base_lrs": [0.001], "_last_lr": [0.0009]}  # torch's, per epoch
    assert "stepped per epoch" in _schedule(cosine, 4, 5).resume_problem(legacy)
    with pytest.raises(ValueError, match="stepped per epoch"):
        _schedule(cosine, 4, 5).load_state_dict(legacy)


def test_warmup_given_twice_or_a_run_without_steps_is_refused():
    with pytest.raises(ConfigError, match="give the warm-up's length once"):
        load_config(None, ["optim.warmup_steps=2", "optim.warmup_epochs=1"])
    with pytest.raises(ValueError, match="needs steps"):
        _schedule(OptimConfig(), 4, 0)
    shape = schedule_shape(OptimConfig(schedule="step", step_size=3), 10, 7)
    assert (shape.total_steps, shape.decay_every, shape.warmup_steps) == (70, 21, 0)


@pytest.fixture(scope="module")
def port_file(tmp_path_factory):
    """A facenet-pytorch 20180402-114759-vggface2.pt layout file with random weights."""
    torch.manual_seed(0)
    source = EmbeddingNet("inception_resnet_v1", embedding_dim=512, num_classes=7)
    path = tmp_path_factory.mktemp("port") / "20180402-114759-vggface2.pt"
    torch.save(port_state_dict(source), path)
    return path, source.state_dict()


def test_the_recipe_starts_from_the_file_and_freezes_up_to_its_stage(port_file):
    path, source = port_file
    cfg = load_config(
        REPO / "configs" / "finetune_facenet_pytorch.yaml",
        [f"model.weights={path}", "train.device=cpu", "optim.freeze_up_to=repeat_1"],
    )
    trainer = build_trainer(cfg, num_classes=None, device=torch.device("cpu"), steps_per_epoch=4)
    model = trainer.core_model
    for key in (
        "embedding.linear.weight",
        "embedding.bn.running_var",
        "backbone.block8.conv2d.bias",
    ):
        assert torch.equal(model.state_dict()[key], source[key])
    assert lrs(trainer.optimizer) == {"backbone_frozen": 0.0, "backbone": 1e-5, "head": 1e-4}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    images, labels = torch.randn(4, 3, 80, 80), torch.tensor([0, 0, 1, 1])
    trainer.train_step(images, labels)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    frozen = ("backbone.conv2d_", "backbone.repeat_1.")
    assert moved and not any(n.startswith(frozen) for n in moved)
    assert "embedding.linear.weight" in moved and "backbone.repeat_2.0.conv2d.weight" in moved


def test_a_head_of_another_size_is_refused_naming_the_key(port_file):
    with pytest.raises(WeightsError, match="embedding head.*shape mismatches"):
        EmbeddingNet("inception_resnet_v1", 128, weights=port_file[0], weights_head=True)
    with pytest.raises(ConfigError, match="optim: .*backbone_lr_scale"):
        cfg = load_config(None, ["optim.backbone_lr_scale=0", "train.device=cpu"])
        build_trainer(cfg, num_classes=None, device=torch.device("cpu"), steps_per_epoch=4)
