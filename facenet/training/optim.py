"""Optimizers and per-step learning-rate schedules from the ``optim`` section.

A schedule sets every parameter group's rate to that group's own starting rate times one
factor of the step, so a backbone started at ``lr x backbone_lr_scale`` keeps that ratio to the
head throughout; the ``backbone_frozen`` group has rate 0 for ``freeze_backbone_epochs``. Frozen
for the whole run (``freeze_backbone_epochs: all``), those stages are no group at all.
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


def backbone_units(backbone: nn.Module) -> list[tuple[str, nn.Module]]:
    """The backbone's stages in forward order, a sequential stage split into its elements
    (``blocks.0``, ``blocks.1``, ...): the places where it can be cut."""
    units = []
    for name, child in backbone.named_children():
        if type(child) is nn.Sequential:  # a subclass may change what its forward does
            units += [(f"{name}.{i}", element) for i, element in enumerate(child)]
        else:
            units.append((name, child))
    return units


def frozen_units(backbone: nn.Module, up_to: str | None) -> list[str]:
    """The units (of :func:`backbone_units`) up to and including ``up_to``: a stage (all its
    elements) or one element of a sequential stage (``blocks.9``); every unit for None."""
    units = [name for name, _ in backbone_units(backbone)]
    if up_to is None:
        return units
    last = [i for i, name in enumerate(units) if name == up_to or name.startswith(up_to + ".")]
    if not last:
        stages = ", ".join(name for name, _ in backbone.named_children())
        example = next((u for u in units if "." in u), "none here")
        raise ValueError(
            f"freeze_up_to: {up_to!r} is not a stage of this backbone; its stages, in order: "
            f"{stages} (or an element of a sequential one, such as {example})"
        )
    return units[: last[-1] + 1]


def frozen_prefixes(model: nn.Module, cfg: OptimConfig) -> list[str]:
    """Module names (``backbone.blocks.3``) of the stages ``optim`` freezes, [] for none."""
    if cfg.freeze_backbone_epochs == 0:
        return []
    return [f"backbone.{unit}" for unit in frozen_units(model.backbone, cfg.freeze_up_to)]


def under(name: str, prefixes) -> bool:
    """Whether the module or parameter ``name`` lies in one of the modules ``prefixes``."""
    return any(name == p or name.startswith(p + ".") or not p for p in prefixes)


def parameter_groups(model: nn.Module, cfg: OptimConfig) -> list[dict] | list[nn.Parameter]:
    """The parameters of an (unwrapped) EmbeddingNet, in named groups when fine-tuning:
    ``backbone_frozen`` (the stages up to ``freeze_up_to``, frozen for the first epochs) and
    ``backbone`` at ``lr x backbone_lr_scale``, ``head`` (embedding head, classifier) at ``lr``.
    With ``freeze_backbone_epochs: all`` the frozen stages' parameters get ``requires_grad``
    False here and join no group: no gradient, no optimizer state.
    """
    if cfg.backbone_lr_scale <= 0:  # 0 passes the configuration's range check
        raise ValueError(f"backbone_lr_scale must be > 0, got {cfg.backbone_lr_scale}")
    if cfg.backbone_lr_scale == 1.0 and cfg.freeze_backbone_epochs == 0:
        return list(model.parameters())
    frozen = frozen_prefixes(model, cfg)
    groups = {FROZEN_GROUP: [], "backbone": [], "head": []}
    for name, param in model.named_parameters():
        if not name.startswith("backbone."):
            groups["head"].append(param)
        elif not under(name, frozen):
            groups["backbone"].append(param)
        elif cfg.freeze_backbone_epochs == "all":
            param.requires_grad_(False)
        else:
            groups[FROZEN_GROUP].append(param)
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
    # "all": the frozen stages are in no group; the schedule holds nothing at rate 0.
    frozen_epochs = 0 if cfg.freeze_backbone_epochs == "all" else cfg.freeze_backbone_epochs
    if shape.kind == "none" and frozen_epochs == 0:
        return None
    frozen_steps = frozen_epochs * steps_per_epoch
    return StepSchedule(optimizer, shape, steps_per_epoch, frozen_steps)
