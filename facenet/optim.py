"""Optimizers and learning-rate schedules from the run configuration."""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler

from facenet.config import OptimConfig

__all__ = ["build_optimizer", "build_scheduler"]


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD (with momentum), Adam, AdamW or Adagrad over ``params``.

    Args:
        params: the parameters (or parameter groups) to optimise.
        cfg: the ``optim`` section.
    """
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    if cfg.name == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.name == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, epochs: int
) -> lr_scheduler.LRScheduler | None:
    """A schedule stepped once per epoch: cosine with linear warm-up, step decay, or none.

    Args:
        optimizer: the optimizer whose learning rate is scheduled.
        cfg: the ``optim`` section (schedule, warmup_epochs, step_size, gamma).
        epochs: the length of the run, for the cosine period.
    """
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
