"""Optimizers and learning-rate schedules from the run configuration.

Fine-tuning options (``optim.backbone_lr_scale``, ``optim.freeze_backbone_epochs``,
``optim.freeze_up_to``) split the parameters into named groups (:func:`parameter_groups`):
the backbone's learning rate is scaled, and :class:`FrozenGroups` holds the frozen groups'
learning rate at 0 for the first epochs on top of any schedule.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.optim import lr_scheduler

from facenet.config import OptimConfig

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "FrozenGroups",
    "build_optimizer",
    "build_scheduler",
    "parameter_groups",
]

FROZEN_GROUP = "backbone_frozen"


def _frozen_stages(backbone: nn.Module, up_to: str | None) -> set[str]:
    """Names of the backbone's top-level stages frozen: all, or those up to ``up_to``."""
    names = [name for name, _ in backbone.named_children()]
    if up_to is None:
        return set(names)
    if up_to not in names:
        raise ValueError(
            f"freeze_up_to: {up_to!r} is not a stage of this backbone; its stages, in order: "
            + ", ".join(names)
        )
    return set(names[: names.index(up_to) + 1])


def _finetuning(cfg: OptimConfig) -> bool:
    return cfg.backbone_lr_scale != 1.0 or cfg.freeze_backbone_epochs > 0


def parameter_groups(model: nn.Module, cfg: OptimConfig) -> list[dict] | list[nn.Parameter]:
    """The model's parameters, split into named groups when fine-tuning options are set.

    Groups: ``backbone_frozen`` (stages frozen for the first epochs), ``backbone`` (the other
    stages; both at ``lr x backbone_lr_scale``) and ``head`` (embedding head and classifier,
    at ``lr``). Without fine-tuning options: the plain parameter list.

    Args:
        model: an EmbeddingNet (its ``backbone`` attribute), not wrapped in DDP.
        cfg: the ``optim`` section.
    """
    if cfg.backbone_lr_scale <= 0 or cfg.freeze_backbone_epochs < 0:
        raise ValueError(
            "backbone_lr_scale must be > 0 and freeze_backbone_epochs >= 0, got "
            f"{cfg.backbone_lr_scale} and {cfg.freeze_backbone_epochs}"
        )
    if not _finetuning(cfg):
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


class FrozenGroups:
    """Learning rate 0 for the ``backbone_frozen`` group during the first N epochs.

    Stepped once per epoch like the schedule it wraps: before the inner schedule steps, the
    frozen groups get back the learning rate it had set (chainable schedules read it), and
    afterwards it is kept and replaced by 0 while the freeze lasts. With learning rate 0 every
    optimizer here leaves the weights as they are (weight decay included); the BatchNorm
    running statistics of frozen stages still follow the new data (train mode).

    Args:
        optimizer: its param groups carry a "name" (:func:`parameter_groups`).
        inner: the learning-rate schedule, or None.
        epochs: N.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, inner, epochs: int):
        self.optimizer, self.inner, self.epochs = optimizer, inner, epochs
        self.groups = [g for g in optimizer.param_groups if g.get("name") == FROZEN_GROUP]
        self.epoch = 0
        self.kept = [g["lr"] for g in self.groups]
        self._apply()

    def _apply(self) -> None:
        for group, lr in zip(self.groups, self.kept):
            group["lr"] = 0.0 if self.epoch < self.epochs else lr

    def step(self) -> None:
        """End of an epoch: step the inner schedule, then freeze or release."""
        for group, lr in zip(self.groups, self.kept):
            group["lr"] = lr
        if self.inner is not None:
            self.inner.step()
        self.kept = [g["lr"] for g in self.groups]
        self.epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        inner = None if self.inner is None else self.inner.state_dict()
        return {"inner": inner, "epoch": self.epoch, "kept": list(self.kept)}

    def load_state_dict(self, state: dict) -> None:
        if self.inner is not None and state.get("inner") is not None:
            self.inner.load_state_dict(state["inner"])
        self.epoch, self.kept = int(state["epoch"]), list(state["kept"])
        self._apply()


def _sgd(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _adam(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _adamw(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _adagrad(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


# optim.name -> builder: the choices of the configuration's optim.name.
OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw, "adagrad": _adagrad}
# optim.schedule: cosine with linear warm-up, step decay, or a constant learning rate.
SCHEDULES = ("cosine", "step", "none")


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam, AdamW or Adagrad over ``params`` (``OPTIMIZERS``).

    Args:
        params: the parameters (or parameter groups) to optimise.
        cfg: the ``optim`` section.
    """
    if cfg.name not in OPTIMIZERS:
        raise ValueError(
            f"optim.name: unknown optimizer {cfg.name!r}; valid: " + ", ".join(OPTIMIZERS)
        )
    return OPTIMIZERS[cfg.name](params, cfg)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, epochs: int
) -> lr_scheduler.LRScheduler | None:
    """A schedule stepped once per epoch: cosine with linear warm-up, step decay, or none;
    wrapped in :class:`FrozenGroups` when ``freeze_backbone_epochs`` > 0.

    Args:
        optimizer: the optimizer whose learning rate is scheduled.
        cfg: the ``optim`` section (schedule, warmup_epochs, step_size, gamma).
        epochs: the length of the run, for the cosine period.
    """
    main = _schedule(optimizer, cfg, epochs)
    if cfg.freeze_backbone_epochs > 0:
        return FrozenGroups(optimizer, main, cfg.freeze_backbone_epochs)
    return main


def _schedule(optimizer, cfg: OptimConfig, epochs: int) -> lr_scheduler.LRScheduler | None:
    """The learning-rate schedule of ``optim.schedule`` (see :func:`build_scheduler`)."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(
            f"optim.schedule: unknown {cfg.schedule!r}; valid: " + ", ".join(SCHEDULES)
        )
    if cfg.schedule == "none":
        return None
    if cfg.schedule == "step":
        main = lr_scheduler.StepLR(optimizer, step_size=cfg.step_size, gamma=cfg.gamma)
    else:
        main = lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=max(1, epochs - cfg.warmup_epochs), eta_min=cfg.lr * 1e-2
        )
    if cfg.warmup_epochs <= 0:
        return main
    warmup = lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / (cfg.warmup_epochs + 1), total_iters=cfg.warmup_epochs
    )
    return lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[cfg.warmup_epochs])
