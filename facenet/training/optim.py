"""Optimizers and per-step learning-rate schedules from the ``optim`` section.

A schedule sets every parameter group's rate to that group's own starting rate times one
factor of the step, so a backbone started at ``lr x backbone_lr_scale`` keeps that ratio to the
head throughout; the ``backbone_frozen`` group has rate 0 for ``freeze_backbone_epochs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from facenet.config import OptimConfig

FROZEN_GROUP = "backbone_frozen"
_PER_EPOCH = (
    "the checkpoint's learning-rate schedule was stepped per epoch (an earlier version wrote "
    "it) and cannot continue per step: finish that run with that version"
)


def _frozen_stages(backbone: nn.Module, up_to: str | None) -> set[str]:
    names = [name for name, _ in backbone.named_children()]
    if up_to is None:
        return set(names)
    if up_to not in names:
        raise ValueError(
            f"freeze_up_to: {up_to!r} is not a stage of this backbone; its stages, in order: "
            + ", ".join(names)
        )
    return set(names[: names.index(up_to) + 1])


def parameter_groups(model: nn.Module, cfg: OptimConfig) -> list[dict] | list[nn.Parameter]:
    """The parameters of an (unwrapped) EmbeddingNet, in named groups when fine-tuning:
    ``backbone_frozen`` (the stages up to ``freeze_up_to``, frozen for the first epochs) and
    ``backbone`` at ``lr x backbone_lr_scale``, ``head`` (embedding head, classifier) at ``lr``.
    """
    if cfg.backbone_lr_scale <= 0:  # 0 passes the configuration's range check
        raise ValueError(f"backbone_lr_scale must be > 0, got {cfg.backbone_lr_scale}")
    if cfg.backbone_lr_scale == 1.0 and cfg.freeze_backbone_epochs == 0:
        return list(model.parameters())
    frozen = _frozen_stages(model.backbone, cfg.freeze_up_to)
    if cfg.freeze_backbone_epochs == 0:
        frozen = set()
    groups = {FROZEN_GROUP: [], "backbone": [], "head": []}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[0] != "backbone":
            groups["head"].append(param)
        else:
            groups[FROZEN_GROUP if parts[1] in frozen else "backbone"].append(param)
    backbone_lr = cfg.lr * cfg.backbone_lr_scale
    lrs = {FROZEN_GROUP: backbone_lr, "backbone": backbone_lr, "head": cfg.lr}
    return [
        {"params": params, "lr": lrs[name], "name": name}
        for name, params in groups.items()
        if params
    ]


OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "adagrad": torch.optim.Adagrad,
}
# optim.schedule: cosine with linear warm-up, step decay, or a constant learning rate.
SCHEDULES = ("cosine", "step", "none")


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """``optim.name`` over ``params`` (parameters or groups); SGD with ``optim.momentum``."""
    momentum = {"momentum": cfg.momentum} if cfg.name == "sgd" else {}
    return OPTIMIZERS[cfg.name](params, lr=cfg.lr, weight_decay=cfg.weight_decay, **momentum)


@dataclass(frozen=True)
class ScheduleShape:
    """The factor every group's starting learning rate is multiplied by at each step.

    Warm-up (cosine and step): ``(step + 1) / (warmup_steps + 1)`` for the first
    ``warmup_steps`` steps. Then ``cosine`` falls from 1 to ``floor`` over the remaining
    ``total_steps - warmup_steps`` steps; ``step`` multiplies by ``gamma`` every
    ``decay_every`` steps; ``none`` stays at 1 (no warm-up).
    """

    kind: str
    total_steps: int
    warmup_steps: int = 0
    decay_every: int = 1
    gamma: float = 0.1
    floor: float = 0.01

    def factor(self, step: int) -> float:
        if self.kind == "none":
            return 1.0
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        after = step - self.warmup_steps
        if self.kind == "step":
            return self.gamma ** (after // self.decay_every)
        # Past the run's end (a longer run continued by hand) the floor holds: no climb.
        progress = min(1.0, after / max(1, self.total_steps - self.warmup_steps))
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StepSchedule:
    """Per-step learning rates: each group's starting rate (its ``lr`` when built, so a
    changed ``optim.lr`` applies on resume) x ``shape.factor(position)``; ``position`` counts
    the batches, skipped ones included. ``steps_per_epoch`` is recorded (a resume must see the
    same); the ``backbone_frozen`` group has rate 0 for ``frozen_steps``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        shape: ScheduleShape,
        steps_per_epoch: int,
        frozen_steps: int = 0,
    ):
        self.optimizer, self.shape = optimizer, shape
        self.steps_per_epoch, self.frozen_steps = steps_per_epoch, frozen_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.position = 0
        self._apply()

    def _apply(self) -> None:
        factor = self.shape.factor(self.position)
        frozen = self.position < self.frozen_steps
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            # With learning rate 0 every optimizer here leaves the weights as they are (weight
            # decay included); BatchNorm statistics of frozen stages still follow the data.
            held = frozen and group.get("name") == FROZEN_GROUP
            group["lr"] = 0.0 if held else base * factor

    def step(self) -> None:
        self.position += 1
        self._apply()

    def state_dict(self) -> dict:
        return {
            "kind": self.shape.kind,
            "position": self.position,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.shape.total_steps,
            "warmup_steps": self.shape.warmup_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if "position" not in state:
            raise ValueError(_PER_EPOCH)
        self.position = int(state["position"])
        self._apply()

    def resume_problem(self, state: dict) -> str | None:
        """Why a checkpoint's schedule state cannot continue in this one, or None: another
        epoch length would move decays, warm-up and freeze off their epochs; a cosine's run
        length is part of its shape."""
        if not isinstance(state, dict) or "position" not in state:
            return _PER_EPOCH
        old_length = max(1, int(state["steps_per_epoch"]))
        if old_length != self.steps_per_epoch:
            return (
                f"an epoch is now {self.steps_per_epoch} steps and the checkpoint's schedule "
                f"was built for epochs of {old_length} (the training data or "
                "train.steps_per_epoch changed); resume with the same ones"
            )
        old_total = int(state["total_steps"])
        if self.shape.kind == "cosine" and old_total != self.shape.total_steps:
            old, now = old_total // old_length, self.shape.total_steps // self.steps_per_epoch
            return (
                f"train.epochs: {now} differs from the checkpoint's {old}, and its "
                f"optim.schedule: cosine was built for {old} epochs (the learning rate would "
                f"jump, or climb again); resume with --set train.epochs={old}"
            )
        return None


def schedule_shape(cfg: OptimConfig, epochs: int, steps_per_epoch: int) -> ScheduleShape:
    """The per-step factor of ``optim.schedule``, lengths given in epochs converted to steps
    (the configuration refuses a warm-up given both ways)."""
    if steps_per_epoch < 1 or epochs < 1:
        raise ValueError(f"a schedule needs steps: {epochs} epochs of {steps_per_epoch} steps")
    return ScheduleShape(
        kind=cfg.schedule,
        total_steps=epochs * steps_per_epoch,
        warmup_steps=cfg.warmup_steps or cfg.warmup_epochs * steps_per_epoch,
        decay_every=cfg.step_size * steps_per_epoch,  # exactly step_size epochs
        gamma=cfg.gamma,
        floor=cfg.min_lr_ratio,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, epochs: int, steps_per_epoch: int
) -> StepSchedule | None:
    """The schedule of ``optim.schedule`` (None for a constant rate without a freeze)."""
    shape = schedule_shape(cfg, epochs, steps_per_epoch)
    if shape.kind == "none" and cfg.freeze_backbone_epochs == 0:
        return None
    frozen_steps = cfg.freeze_backbone_epochs * steps_per_epoch
    return StepSchedule(optimizer, shape, steps_per_epoch, frozen_steps)
