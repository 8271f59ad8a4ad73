"""Fine-tuning options: parameter groups, the backbone freeze over any schedule, the recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from port_weights import port_state_dict

from facenet.config import OptimConfig, load_config
from facenet.errors import ConfigError, WeightsError
from facenet.models.embedding import EmbeddingNet
from facenet.training.build import build_trainer
from facenet.training.optim import FrozenGroups, build_optimizer, build_scheduler, parameter_groups

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


@pytest.mark.parametrize("schedule", ["cosine", "step", "none"])
def test_the_freeze_holds_lr_0_then_gives_back_the_schedule(schedule):
    model = EmbeddingNet("tiny", 8)
    frozen_cfg = OptimConfig(
        lr=0.1,
        schedule=schedule,
        step_size=1,
        warmup_epochs=1,
        freeze_backbone_epochs=2,
        backbone_lr_scale=0.5,
    )
    plain_cfg = OptimConfig(
        lr=0.1, schedule=schedule, step_size=1, warmup_epochs=1, backbone_lr_scale=0.5
    )
    runs = []
    for cfg in (frozen_cfg, plain_cfg):
        optimizer = build_optimizer(parameter_groups(model, cfg), cfg)
        runs.append((optimizer, build_scheduler(optimizer, cfg, epochs=6)))
    (frozen_opt, freeze), (plain_opt, plain) = runs
    assert isinstance(freeze, FrozenGroups)
    for epoch in range(5):
        want = lrs(plain_opt)
        got = lrs(frozen_opt)
        assert got["backbone_frozen"] == (0.0 if epoch < 2 else pytest.approx(want["backbone"]))
        assert got["head"] == pytest.approx(want["head"])
        frozen_opt.step(), plain_opt.step()  # no gradients: nothing moves; the usual order
        freeze.step()
        if plain is not None:
            plain.step()
    resumed_opt = build_optimizer(parameter_groups(model, frozen_cfg), frozen_cfg)
    resumed = build_scheduler(resumed_opt, frozen_cfg, epochs=6)
    resumed.load_state_dict(freeze.state_dict())
    assert lrs(resumed_opt)["backbone_frozen"] == lrs(frozen_opt)["backbone_frozen"] > 0


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
    trainer = build_trainer(cfg, num_classes=None, device=torch.device("cpu"))
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
        build_trainer(cfg, num_classes=None, device=torch.device("cpu"))
