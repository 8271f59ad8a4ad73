"""The training step: what each path computes, and exactly its gradient.

A step mines triplets over the global batch (every rank's embeddings, gathered in rank order)
and leaves in ``.grad`` the gradient of the loss its class docstring states; BatchNorm's batch
is what that path's grad forward sees, and autograd goes through its statistics.
``tests/step_reference.py`` writes each stated forward in plain autograd and the tests hold
every path against it in float64. With W processes each rank backpropagates W x its share and
DDP averages, so the parameters receive the gradient of the stated loss. Cross-entropy
(``ce_weight > 0``) is the mean over the selected images of the same grad forward's logits:
plain, or the margin softmax a cosine classifier holds as its ``loss``.
The path is decided in ``choose_step`` alone: one pass or two here, gradient caching in
``facenet.training.chunked``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from facenet.config import StepSettings
from facenet.distributed import all_gather_tensor, gather_variable_rows, get_rank, get_world_size
from facenet.metric.miners import Triplets
from facenet.registry import load

_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Gradient caching (train.chunk_size > 0), loaded when a run asks for it.
_CHUNKED = "facenet.training.chunked:ChunkedStep"


class StepResult(NamedTuple):
    """The stated loss (detached, the same on every rank) and detached device statistics."""

    loss: torch.Tensor
    stats: dict


@contextlib.contextmanager
def frozen_bn_running_stats(model: nn.Module) -> Iterator[None]:
    """Training-mode BatchNorm normalises with the batch's statistics but leaves its running
    statistics and batch count alone (``track_running_stats=False``): for mining and replayed
    passes, so the running statistics see each stated forward once."""
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
    """``unique`` (U,) sorted batch indices the triplets use, and the triplets re-indexed into
    them (values in ``0..U-1``)."""
    flat = torch.cat([triplets.anchor, triplets.positive, triplets.negative])  # (3T,)
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    anchor, positive, negative = inverse.view(3, -1)  # (T,) each, also for T = 0
    return unique, Triplets(anchor, positive, negative)


def _at_least_float32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Losses run in float32 or wider, also under autocast (float64 stays float64)."""
    return None if tensor is None else tensor.to(torch.promote_types(tensor.dtype, torch.float32))


class Step:
    """What every path shares. ``model`` sits on its device, possibly DDP-wrapped (no-grad
    forwards skip the wrapper); ``settings.amp``: "none", "bf16" (autocast) or "fp16" (autocast
    and ``scaler``, a GradScaler whose ``scale`` multiplies every backward)."""

    name = ""

    def __init__(self, model, miner, loss_fn, settings: StepSettings):
        self.model, self.core = model, getattr(model, "module", model)
        # (logits, labels, reduction): a cosine classifier's margin softmax, or plain; "sum" is
        # not "none" summed in float32 (another order), and the one-pass path has always summed so
        classifier = getattr(self.core, "classifier", None)
        self.ce_loss = getattr(classifier, "loss", None) or F.cross_entropy
        self.miner, self.loss_fn, self.settings = miner, loss_fn, settings
        self.ce_weight = float(settings.ce_weight)
        self.autocast_dtype = _AUTOCAST[settings.amp]
        device = next(self.core.parameters()).device
        self.scaler = torch.amp.GradScaler(device.type, enabled=settings.amp == "fp16")
        self.scale = self.scaler.scale  # the identity without fp16
        self.finite = torch.tensor(True)  # (): the last mined embeddings were finite

    def forward(self, images, with_logits=False, grad=True):
        """(embeddings (N, D), logits (N, C) or None), float32 or wider."""
        model = self.model if grad else self.core
        dtype = self.autocast_dtype
        with torch.autocast(images.device.type, dtype, enabled=dtype is not None):
            if with_logits:
                embeddings, logits = model(images, return_logits=True)
            else:
                embeddings, logits = model(images), None
        return _at_least_float32(embeddings), _at_least_float32(logits)

    def mine(self, embeddings, labels, candidates):
        """Gather every rank's detached (b, D) embeddings and mine the global (W*b) batch."""
        rank, count = get_rank(), embeddings.shape[0]
        all_embeddings, all_labels = all_gather_tensor(embeddings), all_gather_tensor(labels)
        if candidates is not None:  # this rank's indices, shifted to its block of the batch
            candidates = tuple(all_gather_tensor(c + rank * count) for c in candidates)
        triplets = self.miner(all_embeddings, all_labels, candidates=candidates)
        self.finite = torch.isfinite(all_embeddings).all()  # read only when nothing was mined
        return all_embeddings, triplets

    @staticmethod
    def own_rows(global_rows: torch.Tensor, count: int) -> torch.Tensor:
        """This rank's images among ``global_rows``, as rows of its local batch."""
        start = get_rank() * count
        mine = (global_rows >= start) & (global_rows < start + count)
        return global_rows[mine] - start

    def loss_and_backward(self, embeddings, triplets, selected, logits, ce_labels) -> StepResult:
        """The stated loss on ``embeddings`` (N, D), in triplet index order, this rank's rows
        carrying the graph; backward. ``selected``: U, every rank's selected images (the
        cross-entropy is their mean); ``logits`` (u, C) of this rank's, or None."""
        triplet_loss = loss = self.loss_fn(embeddings, triplets)
        ce_sum = None
        if logits is not None:
            ce_sum = self.ce_loss(logits, ce_labels, reduction="sum")
            loss = loss + self.ce_weight * ce_sum / selected
        # DDP averages the ranks' gradients; each rank's share is 1/W of the sum.
        self.scale(loss * get_world_size()).backward()  # frees every tensor saved for backward
        return self.result(triplet_loss, ce_sum, selected)

    def result(self, triplet_loss, ce_sum, selected) -> StepResult:
        """The stated loss and statistics; ``ce_sum``: this rank's cross-entropy sum, or None."""
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
        stats["triplet_loss"] = value = triplet_loss.detach()
        if ce_sum is not None:
            ce_sum = ce_sum.detach().clone()
            if get_world_size() > 1:  # every rank's selected images
                torch.distributed.all_reduce(ce_sum)
            stats["ce_loss"] = ce_sum / selected
            value = value + self.ce_weight * stats["ce_loss"]
        # U: an int, or a device tensor where the path counted it; on the device either way (a
        # host tensor would be copied there, blocking, when the epoch sums it)
        stats["loss"], stats["selected_images"] = value, torch.zeros_like(value) + selected
        return StepResult(value, stats)


class OnePassStep(Step):
    """``emb = model(images)`` with grad on the rank's whole batch (its BatchNorm batch),
    mining on its detached copy, ``loss(emb[triplets])``."""

    name = "one-pass"

    def __call__(self, images, labels, candidates=None) -> StepResult | None:
        count, rank = images.shape[0], get_rank()
        embeddings, logits = self.forward(images, self.ce_weight > 0)  # (b, D) graph on all b
        everyone, triplets = self.mine(embeddings.detach(), labels, candidates)  # (W*b, D)
        if triplets.anchor.numel() == 0:
            return None  # the graph dies with this frame's locals
        if get_world_size() > 1:  # the global batch, this rank's block carrying the graph
            embeddings = torch.cat(
                [everyone[: rank * count], embeddings, everyone[(rank + 1) * count :]]
            )
        # Which of the W*b images the triplets use, counted on the device (no unique).
        used = torch.zeros(everyone.shape[0], dtype=torch.bool, device=everyone.device)
        used[torch.cat(triplets)] = True  # (W*b,)
        if logits is None:
            return self.loss_and_backward(embeddings, triplets, used.sum(), None, None)
        rows = used[rank * count : (rank + 1) * count].nonzero().squeeze(1)  # (u,) own rows
        return self.loss_and_backward(embeddings, triplets, used.sum(), logits[rows], labels[rows])


class TwoPassStep(Step):
    """A no-grad mining pass over the batch (running statistics untouched), then
    ``emb = model(images[selected])`` with grad on the rank's selected images only, their own
    BatchNorm batch, and ``loss(emb[triplets])``: selection is the mining pass's, the loss and
    its gradient the grad pass's.

    BatchNorm needs two images: a rank with one selected image adds the first other image of
    its batch, unused by the loss. A rank with none still joins DDP's all-reduce through a
    zero-length slice of a forward that updates nothing.
    """

    name = "two-pass"

    def __call__(self, images, labels, candidates=None) -> StepResult | None:
        with torch.no_grad(), frozen_bn_running_stats(self.core):
            mining, _ = self.forward(images, grad=False)  # (b, D), no graph is built
        _, triplets = self.mine(mining, labels, candidates)
        del mining
        if triplets.anchor.numel() == 0:
            return None
        unique, local = unique_triplet_images(triplets)  # (U,) sorted global, local in 0..U-1
        rows = self.own_rows(unique, images.shape[0])  # (u,) this rank's selected images
        embeddings, logits = self._grad_forward(images, rows)  # (u, D): their own BN batch
        if get_world_size() > 1:  # every rank's grad-pass rows, in `unique` (rank) order
            parts = gather_variable_rows(embeddings.detach())
            parts[get_rank()] = embeddings
            embeddings = torch.cat(parts)  # (U, D)
        return self.loss_and_backward(embeddings, local, unique.numel(), logits, labels[rows])

    def _grad_forward(self, images, rows):
        with_logits, count = self.ce_weight > 0, rows.numel()
        if count == 0:
            with frozen_bn_running_stats(self.core):
                embeddings, logits = self.forward(images, with_logits)
        elif count == 1 and images.shape[0] > 1:
            other = rows.new_tensor([int(rows[0] == 0)])  # image 0, or 1 if 0 is selected
            embeddings, logits = self.forward(images[torch.cat([rows, other])], with_logits)
        else:
            return self.forward(images[rows], with_logits)
        return embeddings[:count], None if logits is None else logits[:count]


def choose_step(settings: StepSettings, selects_every_image: bool) -> str:
    """The path: "one-pass", "two-pass" or "chunked": chunked whenever ``chunk_size > 0``,
    else the ``passes`` given; ``passes="auto"``: one pass when the miner selects every image (a
    selection-only pass would forward the same images again), else two, always for seed-style
    triplet lists."""
    if settings.chunk_size > 0:
        return "chunked"
    if settings.passes == "auto":
        every = selects_every_image and not settings.triplet_lists
        return "one-pass" if every else "two-pass"
    return "one-pass" if settings.passes == 1 else "two-pass"


def build_step(model, miner, loss_fn, **settings) -> Step:
    """The step of :func:`choose_step`'s path, built (``settings``: :class:`StepSettings`'
    fields, checked there)."""
    settings = StepSettings(**settings)
    path = choose_step(settings, getattr(miner, "selects_every_image", False))
    built = {"one-pass": OnePassStep, "two-pass": TwoPassStep}.get(path) or load(_CHUNKED)
    return built(model, miner, loss_fn, settings)
