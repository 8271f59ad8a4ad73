"""The engine around the training step: the update, the non-finite policy, one epoch, state.

A step with no triplet, or a non-finite loss, gradient or running statistic, leaves the model
as it was (gradients dropped, BatchNorm's running statistics restored). No tensor saved for
backward outlives a step; statistics stay on the device until a log interval reads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from facenet.data.batches import standardize
from facenet.data.loading import count_images, prefetch_to_device
from facenet.distributed import any_rank, get_rank, get_world_size
from facenet.errors import NonFiniteInputError, NonFiniteLossError
from facenet.memory import GraphMemoryMeter, memory_figures, reset_cuda_peaks
from facenet.training.optim import under


def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together: ``torch.nn.utils.get_total_norm`` (torch >= 2.6),
    else the norm of the per-tensor norms, as it computes it."""
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


# Per-step statistics kept on the device and averaged over the steps that trained.
STAT_KEYS = (
    "loss",
    "triplet_loss",
    "ce_loss",
    "num_triplets",
    "active_fraction",
    "mean_dap",
    "mean_dan",
    "selected_images",
)


class _EpochTotals:
    """The epoch's per-step statistics, summed on the device; floats only when read."""

    def __init__(self, device: torch.device):
        self.sums = {k: torch.zeros((), device=device) for k in STAT_KEYS}
        self.trained, self.images, self.start = 0, 0, time.perf_counter()
        self.data_seconds = 0.0

    def timed(self, batches: Iterable):
        """``batches``, adding each ``next``'s wait to ``data_seconds`` (torchvision's
        reference scripts' data time)."""
        iterator, done = iter(batches), object()
        while True:
            started = time.perf_counter()
            batch = next(iterator, done)
            self.data_seconds += time.perf_counter() - started
            if batch is done:
                return
            yield batch

    def add(self, stats: dict, batch) -> None:
        self.images += count_images(batch)  # (a, p, n, ...) batches count 3T images
        if "skipped" in stats:
            return
        self.trained += 1
        for key in STAT_KEYS:
            if key in stats:
                self.sums[key] += stats[key].to(self.sums[key].device)

    def means(self) -> dict:
        """Mean of every statistic over the trained steps (NaN if none); images per second."""
        out = {
            k: (v / self.trained).item() if self.trained else float("nan")
            for k, v in self.sums.items()
        }
        out["images_per_second"] = self.images / max(time.perf_counter() - self.start, 1e-9)
        return out


@dataclass(frozen=True)
class TrainerSettings:
    """What the Trainer does around the step.

    ``input_normalize``: how uint8 batches are standardised on the device, "fixed" or
    "imagenet" (float batches are taken as standardised); ``grad_clip``: max gradient norm (0:
    off); ``max_nonfinite_steps``: non-finite losses in a row that stop the run;
    ``graph_memory``: count saved-tensor bytes during epochs (a hook call per saved tensor);
    ``frozen_bn``: module names whose BatchNorm layers train in eval mode (their running
    statistics used and kept; "" names every one).
    """

    input_normalize: str = "fixed"
    grad_clip: float = 0.0
    max_nonfinite_steps: int = 5
    channels_last: bool = False
    graph_memory: bool = False
    frozen_bn: tuple[str, ...] = ()


class Trainer:
    """Trains an embedding network with mined triplets, keeping no graph alive between steps.

    ``step``: from ``build_step``, its model on its device (the Trainer's device);
    ``scheduler``: stepped once per batch, skipped ones included, or None. Under DDP every
    parameter must take part in the loss: build the model without a classifier head when
    ``ce_weight`` is 0.
    """

    def __init__(self, step, optimizer: torch.optim.Optimizer, scheduler=None, settings=None):
        self.step, self.optimizer, self.scheduler = step, optimizer, scheduler
        self.settings = settings or TrainerSettings()
        self.model, self.scaler = step.model, step.scaler
        self.device = next(self.model.parameters()).device
        # Excluding the model leaves out parameters and BatchNorm's running buffers.
        self.meter = GraphMemoryMeter(exclude=step.core) if self.settings.graph_memory else None
        self.global_step = 0
        self._scale = None  # the scaler's scale after the last update, read once
        self.nonfinite_in_a_row = 0
        self.counts = {"steps": 0, "trained": 0, "no_triplets": 0, "nonfinite": 0}
        # The whole model without a DistributedDataParallel wrapper (what checkpoints hold and
        # validation embeds with); a FeatureHead (train.cache_frozen) trains part of its whole.
        self.core_model: nn.Module = getattr(step.core, "whole", step.core)
        batchnorms = [
            (name, module)
            for name, module in self.core_model.named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
        ]
        # running_mean, running_var, num_batches_tracked (absent without running statistics)
        self._bn_buffers = [b for _, module in batchnorms for b in module.buffers(recurse=False)]
        self._frozen_bn = [m for name, m in batchnorms if under(name, self.settings.frozen_bn)]

    def train_mode(self) -> None:
        """The model in training mode, the frozen BatchNorm layers in eval mode."""
        self.model.train()
        for layer in self._frozen_bn:
            layer.eval()

    def train_step(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> dict:
        """One optimisation step on (B, C, H, W) uint8 (standardised on the device) or float
        ``images`` with (B,) ``labels``; ``candidates``: (a, p, n) indices the miner filters.

        Returns detached device tensors (``STAT_KEYS``), or ``{"skipped": reason}``. Raises
        NonFiniteInputError when the images are to blame, NonFiniteLossError after
        ``max_nonfinite_steps`` non-finite losses in a row.
        """
        images = images.to(self.device, non_blocking=True)  # uint8: a quarter of the bytes
        settings = self.settings
        images = standardize(images, settings.input_normalize)  # (B, C, H, W) float
        if settings.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        # The step may update running statistics before it is known to count: keep a copy.
        bn_before = [b.clone() for b in self._bn_buffers]
        result = self.step(images, labels, candidates)
        # None: the same answer on every rank (the miner saw the global batch).
        finite = result is not None and self._finite(result.loss)
        if finite and self._update():
            self.global_step += 1
            self._count("trained")
            return result.stats
        self.optimizer.zero_grad(set_to_none=True)
        for buffer, saved in zip(self._bn_buffers, bn_before):
            buffer.copy_(saved)
        self._check_images(images)
        # Non-finite embeddings (an fp16 overflow) leave no triplet: counted as what they are.
        no_triplets = result is None and bool(self.step.finite)
        if finite:  # fp16's scaler found an overflow and lowered its scale
            self.nonfinite_in_a_row = 0
        elif not no_triplets:
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= settings.max_nonfinite_steps:
                last = "non-finite embeddings" if result is None else result.loss.item()
                err = NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or "
                    f"gradient (last loss: {last}); check the learning rate"
                )
                err.agreed = get_world_size() > 1  # the same decision on every rank
                raise err
        skipped = "no_triplets" if no_triplets else "nonfinite"
        self._count(skipped)
        return {"skipped": skipped, "selected_images": 0}

    def _update(self) -> bool:
        """Clip and step; False when fp16's scaler skipped the step (gradients overflowed and
        it lowered its scale). The scale before is the one read after the last update: one
        host read a step for it."""
        if self._scale is None:
            self._scale = self.scaler.get_scale()  # 1.0 without fp16
        scale = self._scale
        if self.settings.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self._scale = self.scaler.get_scale()
        return self._scale >= scale

    def _finite(self, loss: torch.Tensor) -> bool:
        """Loss, gradients and running statistics are finite on every rank: a NaN image the
        miner leaves out still poisons the last two. Under fp16 the scaler judges gradients."""
        checks = [loss]
        if not self.scaler.is_enabled():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            checks += [total_norm(grads)] if grads else []
        buffers = [b for b in self._bn_buffers if b.is_floating_point()]
        checks += [total_norm(buffers)] if buffers else []
        finite = bool(torch.isfinite(torch.stack([c.float() for c in checks])).all())
        return not any_rank(not finite)  # one decision for all ranks

    @staticmethod
    def _check_images(images: torch.Tensor) -> None:
        """Every rank raises when any rank's images hold NaN or inf (``rows``: this rank's)."""
        bad = ~torch.isfinite(images).flatten(1).all(dim=1)  # (B,)
        if any_rank(bool(bad.any())):
            rows = bad.nonzero().flatten().tolist()
            where = f"{len(rows)} of {bad.numel()}" if rows else "some"
            err = NonFiniteInputError(
                f"{where} input images hold NaN or infinite values after the transform"
                + ("" if rows else f" (on another rank than rank {get_rank()})"),
                rows=rows,
            )
            err.agreed = get_world_size() > 1  # every rank raises it here
            raise err

    def _count(self, outcome: str) -> None:
        """Count a batch ("trained", "no_triplets" or "nonfinite") and step the schedule:
        skipped batches too, so decays given in epochs fall on epoch boundaries."""
        self.counts["steps"] += 1
        self.counts[outcome] += 1
        if self.scheduler is not None:
            self.scheduler.step()

    def train_triplet_step(self, data_a, data_p, data_n, label_p, label_n) -> dict:
        """Seed-style step: the (a, p, n) images go through the network as one batch
        (BatchNorm sees them together); the miner filters the given triplets."""
        count = data_a.shape[0]
        images = torch.cat([data_a, data_p, data_n])  # (3T, C, H, W)
        labels = torch.cat([label_p, label_p, label_n])  # (3T,)
        index = torch.arange(count, device=self.device)
        candidates = (index, index + count, index + 2 * count)
        return self.train_step(images, labels, candidates=candidates)

    def train_one_epoch(
        self,
        loader: Iterable,
        epoch: int,
        log_interval: int = 10,
        progress: bool = True,
        should_stop=None,
        on_interval=None,
    ) -> dict:
        """One epoch over ``(images, labels)`` or ``(a, p, n, label_p, label_n)`` batches; the
        epoch's record (mean statistics, counters, throughput, memory).

        ``log_interval``: batches between host syncs of the statistics, each followed by
        ``on_interval(global_step, batches_done, running means)``; ``should_stop()`` is agreed
        across ranks after every step, so all stop after the same one.
        """
        self.train_mode()
        if self.meter is not None:
            self.meter.reset_peak()
        reset_cuda_peaks(self.device)
        totals, counts_before = _EpochTotals(self.device), dict(self.counts)
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = tqdm(total=total, desc=f"epoch {epoch}", disable=not progress, leave=False)
        stopped_early = False
        with self.meter or contextlib.nullcontext():
            for index, batch in enumerate(totals.timed(prefetch_to_device(loader, self.device))):
                try:
                    if len(batch) == 5:  # seed-style (a, p, n, label_p, label_n)
                        stats = self.train_triplet_step(*batch)
                    else:
                        stats = self.train_step(batch[0], batch[1])
                except NonFiniteInputError as err:
                    err.batch_index = index  # the loader's batch, for naming its files
                    raise
                totals.add(stats, batch)
                del batch  # nothing of this step outlives it
                bar.update(1)
                if (index + 1) % log_interval == 0 and totals.trained:
                    means = totals.means()
                    bar.set_postfix(
                        loss=f"{means['loss']:.4f}", active=f"{means['active_fraction']:.2f}"
                    )
                    if on_interval is not None:
                        on_interval(self.global_step, index + 1, means)
                # A collective: every rank stops after the same step.
                if should_stop is not None and any_rank(should_stop()):
                    stopped_early = total is None or index + 1 < total
                    break
        bar.close()
        return self._epoch_record(totals, epoch, counts_before, stopped_early)

    def _epoch_record(self, totals, epoch: int, counts_before: dict, stopped_early: bool) -> dict:
        result = totals.means()
        seconds = time.perf_counter() - totals.start
        done = {k: n - counts_before[k] for k, n in self.counts.items()}
        result.update(
            epoch=epoch,
            steps=done["steps"],
            skipped_no_triplets=done["no_triplets"],
            skipped_nonfinite=done["nonfinite"],
            epoch_seconds=seconds,
            data_wait_seconds=totals.data_seconds,
            data_wait_fraction=totals.data_seconds / max(seconds, 1e-9),
            lr=self.optimizer.param_groups[0]["lr"],
            stopped_early=stopped_early,
        )
        result.update(memory_figures(self.meter, self.device))
        return result

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler states plus counters (plain contents)."""
        return {
            "model": self.core_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self.global_step,
            "counts": dict(self.counts),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.core_model.load_state_dict(state["model"])
        groups = self.optimizer.param_groups
        configured = [{k: v for k, v in group.items() if k != "params"} for group in groups]
        self.optimizer.load_state_dict(state["optimizer"])
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)  # the configuration's hyper-parameters, the checkpoint's state
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
            self._scale = None
        self.global_step = int(state.get("global_step", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.counts.update(state.get("counts", {}))
