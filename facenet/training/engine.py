"""The engine around the training step: optimizer, scaler, clipping, non-finite policy, state.

``Trainer.train_step(images, labels)`` runs the step path chosen once at construction (see
``facenet.training.step`` for what each path computes) and then::

    no triplet, or a non-finite loss, gradient or running statistic: drop the gradients,
        restore BatchNorm's running statistics (the model is as it was), look at the images
    clip the gradient norm (after unscaling, under fp16)
    scaler.step(optimizer); scaler.update(); optimizer.zero_grad(set_to_none=True)
    scheduler.step(): once per step, skipped ones included (the rates of the next step)

After the step no tensor saved for backward is alive: the step's embeddings, logits and loss
are locals that die with it. Statistics are detached device tensors, turned into Python floats
once per log interval. ``train_one_epoch`` runs an epoch and reports memory from cheap counters
(peak RSS, CUDA peaks); the saved-tensor graph meter is opt-in (``graph_memory=True``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import get_total_norm
from tqdm import tqdm

from facenet.data.batches import standardize
from facenet.data.loading import count_images, prefetch_to_device
from facenet.distributed import any_rank, get_rank, get_world_size
from facenet.errors import NonFiniteInputError, NonFiniteLossError
from facenet.memory import GraphMemoryMeter, memory_figures, reset_cuda_peaks
from facenet.training.step import build_step

__all__ = ["Trainer", "STAT_KEYS"]

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
_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _EpochTotals:
    """The epoch's per-step statistics, summed on the device; floats only when read.

    Args:
        device: where the sums live.
    """

    def __init__(self, device: torch.device):
        self.sums = {k: torch.zeros((), device=device) for k in STAT_KEYS}
        self.trained, self.images, self.start = 0, 0, time.perf_counter()
        self.data_seconds = 0.0  # the loop's wait for the loader's next batch

    def timed(self, batches: Iterable):
        """``batches``, adding the time each ``next`` takes (the wait for input) to
        ``data_seconds``: what torchvision's reference scripts log as data time."""
        iterator = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            finally:
                self.data_seconds += time.perf_counter() - started
            yield batch

    def add(self, stats: dict, batch) -> None:
        """Count a batch's images; add the statistics of a step that trained."""
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


class Trainer:
    """Trains an embedding network with mined triplets, keeping no graph alive between steps.

    Args:
        model: an ``EmbeddingNet`` (``model(x)`` -> (B, D); ``model(x, return_logits=True)`` ->
            ``(embeddings, logits)`` from one backbone pass), possibly wrapped in DDP.
        miner: ``miner(embeddings, labels, candidates=None) -> Triplets``.
        loss_fn: ``loss_fn(embeddings, triplets) -> scalar``, with ``last_stats`` after a call.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        scheduler: stepped once per training step, skipped ones included (a step that
            raises is not a step: it is retried on resume), or None.
        device: where the step runs.
        amp: "none", "bf16" (autocast) or "fp16" (autocast + GradScaler).
        ce_weight: weight of the cross-entropy term (> 0 needs a classifier head).
        input_normalize: how uint8 batches (the training loader's) are standardised once
            they are on the device: "fixed" or "imagenet" (``data.normalize``); float batches
            are taken as already standardised.
        passes: "auto" (one pass when the miner selects every image, else two; chunked when
            ``chunk_size`` is set), 1 or 2. See ``facenet.training.step``.
        grad_clip: max gradient norm (0: off).
        max_nonfinite_steps: this many non-finite losses in a row stop the run.
        channels_last: feed images in channels-last memory format.
        chunk_size: gradient caching in chunks of this many images, each its own BatchNorm
            batch (0: off).
        triplet_lists: batches are seed-style (a, p, n) triplet lists (``passes="auto"``
            then takes two passes: the selection is sparse).
        meter: a :class:`GraphMemoryMeter` counting saved-tensor bytes during epochs, or None.
        graph_memory: make such a meter when ``meter`` is None (off by default: it costs a
            hook call per saved tensor).

    Under DDP (``model`` wrapped) every parameter must take part in the loss: a classifier
    head with ``ce_weight=0`` makes DDP wait for its gradient (build the model without it).
    """

    def __init__(
        self,
        model: nn.Module,
        miner,
        loss_fn,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler=None,
        device: str | torch.device = "cpu",
        amp: str = "none",
        ce_weight: float = 0.0,
        input_normalize: str = "fixed",
        passes: int | str = "auto",
        grad_clip: float = 0.0,
        max_nonfinite_steps: int = 5,
        channels_last: bool = False,
        chunk_size: int = 0,
        triplet_lists: bool = False,
        meter: GraphMemoryMeter | None = None,
        graph_memory: bool = False,
    ):
        if amp not in _AUTOCAST:
            raise ValueError(f"amp must be 'none', 'bf16' or 'fp16', got {amp!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        core = getattr(self.model, "module", self.model)
        if ce_weight > 0 and getattr(core, "classifier", None) is None:
            raise ValueError("ce_weight > 0 needs a model with a classifier head (num_classes)")
        self.optimizer, self.scheduler = optimizer, scheduler
        self.grad_clip = float(grad_clip)
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.channels_last = channels_last
        # Refuse a bad name now, not at the first batch.
        standardize(torch.zeros(1, 3, 1, 1, dtype=torch.uint8), input_normalize)
        self.input_normalize = input_normalize
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp == "fp16")
        self.step = build_step(
            self.model,
            miner,
            loss_fn,
            passes=passes,
            chunk_size=chunk_size,
            triplet_lists=triplet_lists,
            ce_weight=ce_weight,
            autocast_dtype=_AUTOCAST[amp],
            scale=self.scaler.scale,
        )
        # Excluding the model leaves out parameters and BatchNorm's running buffers.
        if meter is None and graph_memory:
            meter = GraphMemoryMeter(exclude=core)
        self.meter = meter
        self.global_step = 0
        self.nonfinite_in_a_row = 0
        self.counts = {"steps": 0, "trained": 0, "no_triplets": 0, "nonfinite": 0}
        self._bn_buffers = [
            buffer
            for module in core.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
            if buffer is not None
        ]

    @property
    def miner(self):
        """The step's miner (assignable)."""
        return self.step.miner

    @miner.setter
    def miner(self, miner) -> None:
        self.step.miner = miner

    @property
    def loss_fn(self):
        """The step's triplet loss (assignable)."""
        return self.step.loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn) -> None:
        self.step.loss_fn = loss_fn

    @property
    def core_model(self) -> nn.Module:
        """The model without a DistributedDataParallel wrapper (what checkpoints hold)."""
        return getattr(self.model, "module", self.model)

    # ------------------------------------------------------------------ the step

    def train_step(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> dict:
        """One complete optimisation step on a labelled batch.

        Args:
            images: (B, C, H, W) batch (P identities x K images, or concatenated a/p/n):
                uint8 (standardised here, on the device) or float (taken as it is).
            labels: (B,) identity labels.
            candidates: optional (a, p, n) index tensors (seed-compatible mode): the miner
                only filters these triplets.

        Returns:
            A dict of detached device tensors (``STAT_KEYS``), or ``{"skipped": reason}`` when
            no triplet was selected or the loss was not finite (no parameter update then).

        Raises:
            NonFiniteInputError: the step selected nothing or had a non-finite loss, and the
                images hold NaN or inf (``rows`` names them).
            NonFiniteLossError: ``max_nonfinite_steps`` non-finite losses in a row.
        """
        images = images.to(self.device, non_blocking=True)  # uint8: a quarter of the bytes
        images = standardize(images, self.input_normalize)  # (B, C, H, W) float, on the device
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        labels = labels.to(self.device, non_blocking=True)
        # The step may update BatchNorm's running statistics before it is known to count:
        # keep a copy, so that a skipped step leaves the model exactly as it was.
        bn_before = [b.clone() for b in self._bn_buffers]
        result = self.step(images, labels, candidates)
        if result is None:  # the same answer on every rank (the miner saw the global batch)
            self._undo(bn_before)
            self._check_images(images)
            return self._skipped("no_triplets")
        if not self._finite(result.loss):
            self._undo(bn_before)
            self._check_images(images)
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
                err = NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or "
                    f"gradient (last loss: {result.loss.item()}); check the learning rate"
                )
                err.agreed = get_world_size() > 1  # the same decision on every rank
                raise err
            return self._skipped("nonfinite")
        self.nonfinite_in_a_row = 0
        self._update()
        return result.stats

    def _finite(self, loss: torch.Tensor) -> bool:
        """The loss, the gradients and BatchNorm's running statistics are finite, on every rank.

        One host sync: a NaN image that the miner leaves out still poisons the running
        statistics and (through 0 x NaN) the gradients, with a finite loss. Under fp16 the
        GradScaler judges the gradients itself (it skips the update on inf).
        """
        checks = [loss]
        if not self.scaler.is_enabled():
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            checks += [get_total_norm(grads)] if grads else []
        buffers = [b for b in self._bn_buffers if b.is_floating_point()]
        checks += [get_total_norm(buffers)] if buffers else []
        finite = bool(torch.isfinite(torch.stack([c.float() for c in checks])).all())
        return not any_rank(not finite)  # one decision for all ranks

    def _undo(self, bn_before: list[torch.Tensor]) -> None:
        """Drop the step's gradients and restore BatchNorm's running statistics."""
        self.optimizer.zero_grad(set_to_none=True)
        for buffer, saved in zip(self._bn_buffers, bn_before):
            buffer.copy_(saved)

    @staticmethod
    def _check_images(images: torch.Tensor) -> None:
        """After a step that selected nothing or lost finiteness: are the inputs to blame?

        Every rank raises when any rank's images hold NaN or inf (``rows``: this rank's).
        """
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

    def _skipped(self, reason: str) -> dict:
        self.counts["steps"] += 1
        self.counts[reason] += 1
        self._advance_schedule()
        return {"skipped": reason, "selected_images": 0}

    def _advance_schedule(self) -> None:
        """One batch done: the schedule moves to the next step's rates.

        Skipped batches advance it too: the schedule follows how far the run is through its
        data (``counts["steps"]``), as the per-epoch schedule did, so decays given in epochs
        fall on epoch boundaries, the cosine reaches its floor at the run's last batch
        whatever was skipped, and the position is the same on every rank (skips are agreed).
        """
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            # A torch scheduler warns when its first step comes before any optimizer step
            # (a skipped first batch); the order is the intended one here.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
            self.scheduler.step()

    def train_triplet_step(self, data_a, data_p, data_n, label_p, label_n) -> dict:
        """Seed-compatible step: the dataset supplies (a, p, n) images; the miner filters them.

        The three groups go through the network as ONE batch (BatchNorm sees them together).
        """
        count = data_a.shape[0]
        images = torch.cat([data_a, data_p, data_n])  # (3T, C, H, W)
        labels = torch.cat([label_p, label_p, label_n])  # (3T,)
        index = torch.arange(count, device=self.device)
        candidates = (index, index + count, index + 2 * count)
        return self.train_step(images, labels, candidates=candidates)

    def _update(self) -> None:
        """Clip, step the optimizer through the scaler, drop the gradients."""
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.counts["steps"] += 1
        self.counts["trained"] += 1
        self._advance_schedule()

    # ------------------------------------------------------------------ the epoch

    def train_one_epoch(
        self,
        loader: Iterable,
        epoch: int,
        log_interval: int = 10,
        progress: bool = True,
        should_stop=None,
        on_interval=None,
    ) -> dict:
        """Run one epoch; returns averaged statistics, throughput and memory figures.

        Args:
            loader: yields ``(images, labels)`` or seed-style ``(a, p, n, label_p, label_n)``.
            epoch: the epoch number (for the progress bar).
            log_interval: batches between host syncs of the statistics.
            progress: show a tqdm bar.
            should_stop: callable returning True to stop after the current step (a signal);
                every rank's answer is agreed with ``any_rank`` after each step (an
                all-reduce under several processes), so all stop after the same step.
            on_interval: called as ``on_interval(global_step, batches_done, means)`` every
                ``log_interval`` batches, ``means`` the epoch's running means (floats) so far.
        """
        self.model.train()
        if self.meter is not None:
            self.meter.reset_peak()
        reset_cuda_peaks(self.device)
        totals, counts_before = _EpochTotals(self.device), dict(self.counts)
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = tqdm(total=total, desc=f"epoch {epoch}", disable=not progress, leave=False)
        stopped_early = False
        with self.meter if self.meter is not None else contextlib.nullcontext():
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
        """The epoch's means, counters, throughput, learning rate and memory figures."""
        seconds = time.perf_counter() - totals.start
        result = totals.means()
        del result["images_per_second"]
        result.update(
            epoch=epoch,
            steps=self.counts["steps"] - counts_before["steps"],
            skipped_no_triplets=self.counts["no_triplets"] - counts_before["no_triplets"],
            skipped_nonfinite=self.counts["nonfinite"] - counts_before["nonfinite"],
            images_per_second=totals.images / max(seconds, 1e-9),
            epoch_seconds=seconds,
            # The share of the epoch spent waiting for input: 0 when loading is overlapped.
            data_wait_seconds=totals.data_seconds,
            data_wait_fraction=totals.data_seconds / max(seconds, 1e-9),
            lr=self.optimizer.param_groups[0]["lr"],
            stopped_early=stopped_early,
        )
        result.update(self.memory_figures())
        return result

    def memory_figures(self) -> dict:
        """Peak RSS, CUDA peaks and, with a meter, graph bytes (epoch peak, alive now), under
        the names of ``facenet.memory.MEMORY_KEYS`` (the report and the benchmarks use them too).
        """
        return memory_figures(self.meter, self.device)

    # ------------------------------------------------------------------ state

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
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state.get("global_step", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.counts.update(state.get("counts", {}))
