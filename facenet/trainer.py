"""The corrected training step and loop.

One step (two-pass, the default)::

    with torch.no_grad(): embeddings = model(images)        # (B, D), no graph is built
    triplets = miner(embeddings, labels)                     # (a, p, n) indices, on the device
    unique, local = unique_triplet_images(triplets)          # (U,), indices remapped into 0..U-1
    emb, logits = model(images[unique], return_logits=...)   # ONE forward with grad, (U, D)
    loss = triplet_loss(emb, local) + w * cross_entropy(logits, labels[unique])
    loss.backward()                                          # frees every saved tensor
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

After the step no tensor saved for backward is alive: ``emb``, ``logits`` and ``loss`` are
locals of the step and die with it, so the graph object dies too. Statistics are kept as
detached device tensors and turned into Python floats once per log interval.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from facenet.distributed import (
    all_gather_tensor,
    gather_variable_rows,
    get_rank,
    get_world_size,
)
from facenet.grad_cache import BatchState
from facenet.memory import (
    GraphMemoryMeter,
    cuda_memory_stats,
    peak_rss_bytes,
    reset_cuda_peaks,
)
from facenet.miners import Triplets

__all__ = [
    "NonFiniteLossError",
    "Trainer",
    "frozen_bn_running_stats",
    "unique_triplet_images",
    "STAT_KEYS",
]

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


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Losses run in float32 or wider, also under autocast (float64 stays float64)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a scalar statistic (itself for one process)."""
    if get_world_size() > 1:
        value = value.clone()
        torch.distributed.all_reduce(value)
    return value


class NonFiniteLossError(RuntimeError):
    """Too many steps in a row had a non-finite loss; the run stops."""


@contextlib.contextmanager
def frozen_bn_running_stats(model: nn.Module) -> Iterator[None]:
    """BatchNorm layers normalise with batch statistics but leave running statistics alone.

    In training mode a ``_BatchNorm`` with ``track_running_stats=False`` uses the batch's
    statistics and neither updates ``running_mean``/``running_var`` nor counts the batch, which is
    what the mining pass needs: the grad pass then updates them exactly once per step.
    """
    layers = [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.training
    ]
    for layer in layers:
        layer.track_running_stats = False
    try:
        yield
    finally:
        for layer in layers:
            layer.track_running_stats = True


def unique_triplet_images(triplets: Triplets) -> tuple[torch.Tensor, Triplets]:
    """The unique images used by ``triplets`` and the triplets re-indexed into them.

    Args:
        triplets: ``(anchor, positive, negative)`` index tensors of length T into the batch.

    Returns:
        ``unique`` (U,) sorted batch indices and ``local`` triplets with values in ``0..U-1``.
    """
    count = triplets.anchor.numel()
    flat = torch.cat([triplets.anchor, triplets.positive, triplets.negative])  # (3T,)
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    anchor, positive, negative = inverse.split(count)
    return unique, Triplets(anchor, positive, negative)


class Trainer:
    """Trains an embedding network with mined triplets, keeping no graph alive between steps.

    Args:
        model: an ``EmbeddingNet`` (``model(x)`` -> (B, D); ``model(x, return_logits=True)`` ->
            ``(embeddings, logits)`` from one backbone pass).
        miner: ``miner(embeddings, labels, candidates=None) -> Triplets``.
        loss_fn: ``loss_fn(embeddings, triplets) -> scalar``, with ``last_stats`` after a call.
        optimizer: a ``torch.optim`` optimizer over the model's parameters.
        scheduler: stepped once per epoch, or None.
        device: where the step runs.
        amp: "none", "bf16" (autocast) or "fp16" (autocast + GradScaler).
        ce_weight: weight of the cross-entropy term (> 0 needs a classifier head).
        passes: 2 (no-grad mining pass + grad pass on the selected images) or 1 (one grad pass
            on the whole batch, mining on its detached embeddings).
        grad_clip: max gradient norm (0: off).
        max_nonfinite_steps: this many non-finite losses in a row stop the run.
        channels_last: feed images in channels-last memory format.
        chunk_size: gradient caching: run the grad pass in chunks of this many images with
            the loss gradient cached on the mining embeddings (0: off).
        meter: a :class:`GraphMemoryMeter`; one is made if None.
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
        passes: int = 2,
        grad_clip: float = 0.0,
        max_nonfinite_steps: int = 5,
        channels_last: bool = False,
        chunk_size: int = 0,
        meter: GraphMemoryMeter | None = None,
    ):
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes!r}")
        if amp not in ("none", "bf16", "fp16"):
            raise ValueError(f"amp must be 'none', 'bf16' or 'fp16', got {amp!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.miner = miner
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.amp = amp
        self.ce_weight = float(ce_weight)
        if self.ce_weight > 0 and getattr(self._core_model, "classifier", None) is None:
            raise ValueError("ce_weight > 0 needs a model with a classifier head (num_classes)")
        self.passes = passes
        self.grad_clip = float(grad_clip)
        self.max_nonfinite_steps = int(max_nonfinite_steps)
        self.channels_last = channels_last
        if chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0, got {chunk_size!r}")
        self.chunk_size = int(chunk_size)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp == "fp16")
        # Excluding the model leaves out parameters and BatchNorm's running buffers (saved too).
        self.meter = meter if meter is not None else GraphMemoryMeter(exclude=self.model)
        self.global_step = 0
        self.nonfinite_in_a_row = 0
        self.counts = {"steps": 0, "trained": 0, "no_triplets": 0, "nonfinite": 0}
        self._bn_buffers = [
            buffer
            for module in self._core_model.modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm)
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
            if buffer is not None
        ]
        self._bn_before_step: list = []

    # ------------------------------------------------------------------ helpers

    @property
    def _core_model(self) -> nn.Module:
        """The model without a DistributedDataParallel wrapper."""
        return getattr(self.model, "module", self.model)

    def _autocast(self):
        if self.amp == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _to_device(self, images: torch.Tensor, labels: torch.Tensor):
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return images, labels.to(self.device, non_blocking=True)

    def _forward(self, images: torch.Tensor, with_logits: bool, model: nn.Module | None = None):
        """One forward; returns (embeddings (N, D) float32+, logits (N, C) or None)."""
        model = self.model if model is None else model
        with self._autocast():
            if with_logits:
                embeddings, logits = model(images, return_logits=True)
            else:
                embeddings, logits = model(images), None
        return _at_least_float32(embeddings), None if logits is None else _at_least_float32(logits)

    def _skipped(self, reason: str) -> dict:
        self.counts["steps"] += 1
        self.counts[reason] += 1
        return {"skipped": reason, "selected_images": 0}

    # ------------------------------------------------------------------ the step

    def train_step(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        candidates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> dict:
        """One complete optimisation step on a labelled batch.

        Args:
            images: (B, C, H, W) batch (P identities x K images, or concatenated a/p/n).
            labels: (B,) identity labels.
            candidates: optional (a, p, n) index tensors (seed-compatible mode): the miner
                only filters these triplets.

        Returns:
            A dict of detached device tensors (``STAT_KEYS``), or ``{"skipped": reason}`` when
            no triplet was selected or the loss was not finite (no parameter update then).
        """
        images, labels = self._to_device(images, labels)
        # BatchNorm updates its running statistics in the grad pass, before the loss is known:
        # keep a copy so that a skipped (non-finite) step leaves them as they were.
        self._bn_before_step = [(b, b.clone()) for b in self._bn_buffers]
        if get_world_size() > 1:
            return self._cached_gradient_step(images, labels, candidates, self.passes == 1)
        if self.passes == 1:
            return self._one_pass_step(images, labels, candidates)
        if self.chunk_size > 0:
            return self._cached_gradient_step(images, labels, candidates)
        # 1. Mining pass: no graph, BatchNorm running statistics untouched.
        with torch.no_grad(), frozen_bn_running_stats(self.model):
            mining_embeddings, _ = self._forward(images, with_logits=False)  # (B, D)
        # 2. Miner on the device.
        triplets = self.miner(mining_embeddings, labels, candidates=candidates)
        del mining_embeddings
        if triplets.anchor.numel() == 0:
            return self._skipped("no_triplets")
        # 3. The unique selected images; 4. ONE forward with grad on them.
        unique, local = unique_triplet_images(triplets)
        embeddings, logits = self._forward(images[unique], self.ce_weight > 0)  # (U, D), (U, C)
        loss, stats = self._loss(embeddings, local, logits, labels[unique])
        stats["selected_images"] = torch.tensor(float(unique.numel()))
        # 5. backward frees the graph; the optimizer steps.
        self.scaler.scale(loss).backward()  # every tensor saved for backward is released here
        return self._finish_step(loss, stats, images)

    def _cached_gradient_step(self, images, labels, candidates, one_pass: bool = False) -> dict:
        """Gradient caching, and the multi-process step (the same mechanism).

        The loss over the triplets mined in the GLOBAL batch (all ranks' embeddings gathered)
        is computed on detached embeddings; its gradient with respect to them is cached and
        backpropagated through a grad pass over this rank's own images, in chunks of
        ``chunk_size``, so the peak graph memory is one chunk's. With N ranks the cached
        gradient is multiplied by N: DDP averages the ranks' gradients, which then equal the
        single-process gradient on the concatenated batch. With ``one_pass`` the grad forward
        on the whole local batch comes first and the cached gradient goes through its graph.
        """
        world, rank, count = get_world_size(), get_rank(), images.shape[0]
        state = BatchState(self._core_model)
        with_logits = self.ce_weight > 0
        if one_pass:
            local_embeddings, local_logits = self._forward(images, with_logits)  # (b, D) graph
            detached = local_embeddings.detach()
        else:
            with torch.no_grad(), frozen_bn_running_stats(self.model), state.record():
                detached, _ = self._forward(images, False, model=self._core_model)  # (b, D)
        embeddings = all_gather_tensor(detached)  # (W*b, D), rank-major
        all_labels = all_gather_tensor(labels)  # (W*b,)
        if candidates is not None:
            candidates = tuple(all_gather_tensor(c + rank * count) for c in candidates)
        triplets = self.miner(embeddings, all_labels, candidates=candidates)
        if triplets.anchor.numel() == 0:  # the same answer on every rank
            return self._skipped("no_triplets")
        unique, local = unique_triplet_images(triplets)  # (U,) global indices
        cached = embeddings[unique].detach().requires_grad_(True)  # (U, D) leaf
        triplet_loss = self.loss_fn(cached, local)
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
        stats["triplet_loss"] = triplet_loss.detach()
        (cached_grad,) = torch.autograd.grad(self.scaler.scale(triplet_loss) * world, cached)
        mine = (unique >= rank * count) & (unique < (rank + 1) * count)
        rows, grads = unique[mine] - rank * count, cached_grad[mine]  # this rank's images
        # Cross-entropy: mean over the U selected images, summed across ranks by DDP.
        ce_scale = self.ce_weight * world / unique.numel()
        if one_pass:
            logits = local_logits[rows] if with_logits else None
            ce_sum = self._surrogate_backward(
                local_embeddings[rows], grads, logits, labels[rows], ce_scale
            )
        else:
            ce_sum = self._chunked_backward(images, labels, rows, grads, state, ce_scale)
            state.update_running_stats()  # once per step, with the mining pass's statistics
        loss = triplet_loss.detach()
        if with_logits:
            stats["ce_loss"] = _all_reduce_sum(ce_sum) / unique.numel()
            loss = loss + self.ce_weight * stats["ce_loss"]
        stats["loss"] = loss
        stats["selected_images"] = torch.tensor(float(unique.numel()))
        return self._finish_step(loss, stats, images)

    def _gradient_sync(self, last: bool):
        """DDP all-reduces on the last backward of a step only (``no_sync`` before it)."""
        if last or not hasattr(self.model, "no_sync"):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def _surrogate_backward(self, embeddings, grads, logits, ce_labels, ce_scale):
        """Backward of sum(embeddings * grads) (+ scaled cross-entropy); returns the CE sum."""
        surrogate = (embeddings * grads).sum()  # d(surrogate)/d(embeddings) = grads
        ce_sum = torch.zeros((), device=self.device, dtype=grads.dtype)
        if logits is not None:
            ce = F.cross_entropy(logits, ce_labels, reduction="sum")
            ce_sum = ce.detach()
            surrogate = surrogate + self.scaler.scale(ce * ce_scale)
        surrogate.backward()  # frees this graph before the next one is built
        return ce_sum

    def _chunked_backward(self, images, labels, rows, grads, state, ce_scale):
        """The grad pass over ``rows`` in chunks; DDP synchronises on the last chunk only."""
        size = self.chunk_size or max(1, rows.numel())
        chunks = list(torch.arange(rows.numel(), device=self.device).split(size))
        if not chunks:
            # No image of this rank was selected: one zero-gradient pass still joins DDP's
            # all-reduce, so every rank runs exactly one synchronising backward.
            rows, grads = rows.new_zeros(1), grads.new_zeros((1, grads.shape[1]))
            chunks = [torch.zeros(1, dtype=torch.long, device=self.device)]
            ce_scale = 0.0
        ce_total = torch.zeros((), device=self.device, dtype=grads.dtype)
        with state.replay() as replay_rows:
            for index, chunk in enumerate(chunks):
                replay_rows[0] = rows[chunk]  # batch indices of this chunk's images
                with self._gradient_sync(last=index == len(chunks) - 1):
                    embeddings, logits = self._forward(images[replay_rows[0]], self.ce_weight > 0)
                    ce_total += self._surrogate_backward(
                        embeddings, grads[chunk], logits, labels[replay_rows[0]], ce_scale
                    )
        return ce_total

    def _one_pass_step(self, images, labels, candidates) -> dict:
        """Forward with grad on the whole batch; mine on detached embeddings; index the graph."""
        embeddings, logits = self._forward(images, self.ce_weight > 0)  # (B, D), graph on all B
        triplets = self.miner(embeddings.detach(), labels, candidates=candidates)
        if triplets.anchor.numel() == 0:
            return self._skipped("no_triplets")  # the graph dies with this frame's locals
        used, _ = unique_triplet_images(triplets)  # (U,) images in some triplet
        ce_logits, ce_labels = (None, None) if logits is None else (logits[used], labels[used])
        loss, stats = self._loss(embeddings, triplets, ce_logits, ce_labels)
        stats["selected_images"] = torch.tensor(float(used.numel()))
        self.scaler.scale(loss).backward()  # every tensor saved for backward is released here
        return self._finish_step(loss, stats, images)

    def _loss(self, embeddings, triplets, logits, ce_labels):
        triplet_loss = self.loss_fn(embeddings, triplets)
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
        stats["triplet_loss"] = triplet_loss.detach()
        loss = triplet_loss
        if logits is not None:
            ce_loss = F.cross_entropy(logits, ce_labels)
            stats["ce_loss"] = ce_loss.detach()
            loss = loss + self.ce_weight * ce_loss
        stats["loss"] = loss.detach()
        return loss, stats

    def _finish_step(self, loss: torch.Tensor, stats: dict, images: torch.Tensor) -> dict:
        """After backward: skip a non-finite step, else clip, step and zero the gradients."""
        # One host sync per step: a non-finite loss must not reach the parameters.
        if not bool(torch.isfinite(loss)):
            self.optimizer.zero_grad(set_to_none=True)
            for buffer, saved in self._bn_before_step:
                buffer.copy_(saved)
            self.nonfinite_in_a_row += 1
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
                cause = (
                    "the input images hold NaN or inf"
                    if not bool(torch.isfinite(images).all())
                    else "check the learning rate and the data"
                )
                raise NonFiniteLossError(
                    f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss "
                    f"(last: {loss.item()}); {cause}"
                )
            return self._skipped("nonfinite")
        self.nonfinite_in_a_row = 0
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.counts["steps"] += 1
        self.counts["trained"] += 1
        return stats

    def train_triplet_step(self, data_a, data_p, data_n, label_p, label_n) -> dict:
        """Seed-compatible step: the dataset supplies (a, p, n) images; the miner filters them.

        The three groups go through the network as ONE batch (BatchNorm sees them together);
        only the unique images of the triplets the miner keeps get a forward with grad.
        """
        count = data_a.shape[0]
        images = torch.cat([data_a, data_p, data_n])  # (3T, C, H, W)
        labels = torch.cat([label_p, label_p, label_n])  # (3T,)
        index = torch.arange(count, device=self.device)
        candidates = (index, index + count, index + 2 * count)
        return self.train_step(images, labels, candidates=candidates)

    # ------------------------------------------------------------------ the epoch

    def train_one_epoch(
        self,
        loader: Iterable,
        epoch: int,
        max_steps: int = 0,
        log_interval: int = 10,
        progress: bool = True,
        should_stop=None,
    ) -> dict:
        """Run one epoch; returns averaged statistics, throughput and memory figures.

        Args:
            loader: yields ``(images, labels)`` or seed-style ``(a, p, n, label_p, label_n)``.
            epoch: the epoch number (for the progress bar).
            max_steps: stop after this many batches (0: the whole loader).
            log_interval: batches between host syncs of the statistics.
            progress: show a tqdm bar.
            should_stop: callable returning True to stop after the current step (signals).
        """
        from tqdm import tqdm

        self.model.train()
        self.meter.reset_peak()
        reset_cuda_peaks(self.device)
        totals = {k: torch.zeros((), device=self.device) for k in STAT_KEYS}
        counts_before = dict(self.counts)
        images_seen, trained, start = 0, 0, time.perf_counter()
        total = max_steps or (len(loader) if hasattr(loader, "__len__") else None)
        bar = tqdm(total=total, desc=f"epoch {epoch}", disable=not progress, leave=False)
        batches = itertools.islice(loader, max_steps) if max_steps else loader
        stopped_early = False
        with self.meter:
            for index, batch in enumerate(batches):
                stats = self._run_batch(batch)
                images_seen += batch[0].shape[0] * (3 if len(batch) == 5 else 1)
                if "skipped" not in stats:
                    trained += 1
                    for key in STAT_KEYS:
                        if key in stats:
                            totals[key] += stats[key].to(self.device)
                del stats, batch  # nothing of this step outlives it
                bar.update(1)
                if (index + 1) % log_interval == 0 and trained:
                    bar.set_postfix(self._postfix(totals, trained, images_seen, start))
                if should_stop is not None and should_stop():
                    stopped_early = total is None or index + 1 < total
                    break
        bar.close()
        seconds = time.perf_counter() - start
        result = {k: (v / trained).item() if trained else float("nan") for k, v in totals.items()}
        result.update(
            epoch=epoch,
            steps=self.counts["steps"] - counts_before["steps"],
            skipped_no_triplets=self.counts["no_triplets"] - counts_before["no_triplets"],
            skipped_nonfinite=self.counts["nonfinite"] - counts_before["nonfinite"],
            images_per_second=images_seen / max(seconds, 1e-9),
            epoch_seconds=seconds,
            lr=self.optimizer.param_groups[0]["lr"],
            stopped_early=stopped_early,
        )
        result.update(self.memory_figures())
        # An epoch cut short by a signal is continued on resume, not ended: no schedule step.
        if self.scheduler is not None and not stopped_early:
            self.scheduler.step()
        return result

    def _run_batch(self, batch) -> dict:
        if len(batch) == 5:
            return self.train_triplet_step(*batch)
        images, labels = batch[0], batch[1]
        return self.train_step(images, labels)

    @staticmethod
    def _postfix(totals, trained, images_seen, start) -> dict:
        return {
            "loss": f"{(totals['loss'] / trained).item():.4f}",
            "active": f"{(totals['active_fraction'] / trained).item():.2f}",
            "img/s": f"{images_seen / max(time.perf_counter() - start, 1e-9):.0f}",
        }

    def memory_figures(self) -> dict:
        """Graph bytes (peak since the epoch began, alive now), peak RSS, CUDA peaks."""
        figures = {
            "graph_bytes_peak": int(self.meter.peak_bytes),
            "graph_bytes_alive": int(self.meter.alive_bytes),
            "peak_rss_bytes": int(peak_rss_bytes()),
        }
        cuda = cuda_memory_stats(self.device)
        if cuda:
            figures["cuda_max_allocated"] = int(cuda["max_allocated"])
            figures["cuda_max_reserved"] = int(cuda["max_reserved"])
        return figures

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler states plus counters (plain contents)."""
        return {
            "model": self._core_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "global_step": self.global_step,
            "counts": dict(self.counts),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._core_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state.get("global_step", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
        self.counts.update(state.get("counts", {}))

    # ------------------------------------------------------------------ from a config

    @classmethod
    def from_config(cls, cfg, run_dir=None) -> Trainer:
        """Build the data, model, miner, loss and optimizer of a run configuration.

        The returned trainer carries ``data`` (loader, sampler, held-out pairs) and ``cfg``, so
        ``trainer.fit()`` runs the whole configured training.
        """
        from pathlib import Path

        from facenet.run import build_data, build_trainer, resolve_device

        run_dir = Path(run_dir or cfg.logging.out_dir)
        data = build_data(cfg, run_dir)
        trainer = build_trainer(cfg, data.num_classes, resolve_device(cfg.train.device))
        trainer.data, trainer.cfg, trainer.run_dir = data, cfg, run_dir
        return trainer

    def fit(self, resume: bool = False) -> dict:
        """Run the configured training (after :meth:`from_config`); returns the summary."""
        from facenet.run import fit

        self.run_dir.mkdir(parents=True, exist_ok=True)
        return fit(self, self.data, self.cfg, self.run_dir, resume)

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self, pair_list, eval_cfg, image_size: int, normalize: str = "fixed", num_workers: int = 0
    ):
        """Verification on held-out pairs with the LFW protocol.

        Args:
            pair_list: a ``facenet.data.pairs.PairList``.
            eval_cfg: the ``eval`` section (distance, flip, subtract_mean, folds, FAR target).
            image_size: the network's input size.
            normalize: the pixel standardisation used in training.
            num_workers: DataLoader workers decoding the images.

        Returns:
            A ``VerificationResult``.
        """
        from facenet.evaluation import evaluate_embeddings

        emb1, emb2 = embed_pair_list(
            self._core_model,
            pair_list,
            image_size=image_size,
            batch_size=eval_cfg.batch_size,
            device=self.device,
            flip=eval_cfg.flip,
            normalize=normalize,
            num_workers=num_workers,
        )
        # The file's own folds (they differ from contiguous blocks once pairs were skipped).
        same_folds = getattr(pair_list, "n_folds", None) == eval_cfg.n_folds
        return evaluate_embeddings(
            emb1.numpy(),
            emb2.numpy(),
            pair_list.issame,
            metric=eval_cfg.distance,
            subtract_mean=eval_cfg.subtract_mean,
            n_folds=eval_cfg.n_folds,
            far_target=eval_cfg.far_target,
            folds=pair_list.fold_ids if same_folds else None,
        )


def _gather_shards(chunks: list[torch.Tensor], total: int, world: int) -> torch.Tensor:
    """Reassemble embeddings sharded round-robin over ranks into input order (U, D)."""
    local = torch.cat(chunks) if chunks else torch.zeros(0)
    if world == 1:
        return local.cpu()
    shards = gather_variable_rows(local)
    out = torch.empty((total, shards[0].shape[1]), dtype=local.dtype)
    for rank, shard in enumerate(shards):
        out[rank::world] = shard.cpu()
    return out


class _PathDataset(torch.utils.data.Dataset):
    """Images by path, decoded and transformed for evaluation."""

    def __init__(self, paths, transform):
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        from facenet.data.images import read_image

        return self.transform(read_image(self.paths[index]))


def embed_pair_list(
    model: nn.Module,
    pair_list,
    image_size: int,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    flip: bool = False,
    normalize: str = "fixed",
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed both sides of every pair, each unique image once, in eval mode without autograd.

    Args:
        model: the embedding network.
        pair_list: a ``PairList`` (``unique_paths()`` gives the images and the index of each side).
        image_size: the network's input size.
        batch_size: images per forward.
        device: where the network runs.
        flip: concatenate the embedding of each image with that of its horizontal flip
            (the classic option: the result is (N, 2D)).
        normalize: the pixel standardisation.
        num_workers: DataLoader workers decoding images.

    Returns:
        ``(emb1, emb2)``, each (N, D) or (N, 2D) float32 on the CPU.
    """
    from facenet.data.images import build_transform

    paths, index1, index2 = pair_list.unique_paths()
    transform = build_transform(image_size, train=False, normalize=normalize)
    # Several ranks: rank r embeds images r, r + W, r + 2W, ...; the shards are gathered
    # without padding and interleaved back, so every image counts once.
    rank, world = get_rank(), get_world_size()
    loader = torch.utils.data.DataLoader(
        _PathDataset(paths[rank::world], transform), batch_size=batch_size, num_workers=num_workers
    )
    was_training = model.training
    model.eval()
    chunks = []
    try:
        with torch.inference_mode():
            for images in loader:
                images = images.to(device)
                embeddings = model(images)  # (b, D)
                if flip:
                    embeddings = torch.cat([embeddings, model(images.flip(-1))], dim=1)
                chunks.append(embeddings.float())
    finally:
        model.train(was_training)
    embeddings = _gather_shards(chunks, len(paths), world)  # (U, D) on the CPU
    index1 = torch.as_tensor(index1, dtype=torch.long)
    index2 = torch.as_tensor(index2, dtype=torch.long)
    return embeddings[index1], embeddings[index2]
