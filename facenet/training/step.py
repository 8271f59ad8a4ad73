"""The training step: what each path computes, and exactly its gradient.

A step mines triplets over the global batch (every rank's embeddings, gathered in rank order)
and leaves in ``.grad`` the gradient of the loss its class docstring states; BatchNorm's batch
is what that path's grad forward sees, and autograd goes through its statistics.
``tests/step_reference.py`` writes each stated forward in plain autograd and the tests hold
every path against it in float64. With W processes each rank backpropagates W x its share and
DDP averages, so the parameters receive the gradient of the stated loss. Cross-entropy
(``ce_weight > 0``) is the mean over the selected images of the same grad forward's logits:
plain, or the margin softmax a cosine classifier holds as its ``loss``.
The path is decided in ``choose_step`` alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from facenet.distributed import all_gather_tensor, gather_variable_rows, get_rank, get_world_size
from facenet.errors import ConfigError
from facenet.metric.miners import Triplets

_AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


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


class _Step:
    """What every path shares. ``model`` sits on its device, possibly DDP-wrapped (no-grad
    forwards skip the wrapper); ``amp``: "none", "bf16" (autocast) or "fp16" (autocast and
    ``scaler``, a GradScaler whose ``scale`` multiplies every backward); ``chunk_size``: images
    per chunk of the chunked path."""

    name = ""

    def __init__(self, model, miner, loss_fn, *, ce_weight=0.0, amp="none", chunk_size=0):
        self.model, self.core = model, getattr(model, "module", model)
        # (logits, labels, reduction): a cosine classifier's margin softmax, or plain; "sum" is
        # not "none" summed in float32 (another order), and the one-pass path has always summed so
        classifier = getattr(self.core, "classifier", None)
        self.ce_loss = getattr(classifier, "loss", None) or F.cross_entropy
        self.miner, self.loss_fn, self.ce_weight = miner, loss_fn, float(ce_weight)
        self.chunk_size = int(chunk_size)
        self.autocast_dtype = _AUTOCAST[amp]
        device = next(self.core.parameters()).device
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
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
    def own_rows(global_rows: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask over ``global_rows`` of this rank's images, their rows in the local batch)."""
        start = get_rank() * count
        mine = (global_rows >= start) & (global_rows < start + count)
        return mine, global_rows[mine] - start

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

    def result(self, triplet_loss, ce_sum, selected: int) -> StepResult:
        """The stated loss and statistics; ``ce_sum``: this rank's cross-entropy sum, or None."""
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
        stats["triplet_loss"] = value = triplet_loss.detach()
        if ce_sum is not None:
            ce_sum = ce_sum.detach().clone()
            if get_world_size() > 1:  # every rank's selected images
                torch.distributed.all_reduce(ce_sum)
            stats["ce_loss"] = ce_sum / selected
            value = value + self.ce_weight * stats["ce_loss"]
        stats["loss"], stats["selected_images"] = value, torch.tensor(float(selected))
        return StepResult(value, stats)


class OnePassStep(_Step):
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
        used, _ = unique_triplet_images(triplets)  # (U,) global indices of used images
        _, rows = self.own_rows(used, count)
        ce_logits = None if logits is None else logits[rows]
        return self.loss_and_backward(embeddings, triplets, used.numel(), ce_logits, labels[rows])


class TwoPassStep(_Step):
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
        _, rows = self.own_rows(unique, images.shape[0])  # (u,) this rank's selected images
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


@contextlib.contextmanager
def _replayed_rng(state: tuple, device: torch.device) -> Iterator[None]:
    """Run a block with the random state ``state``; the global state is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def batch_chunks(count: int, chunk_size: int, device=None) -> list[torch.Tensor]:
    """Consecutive index chunks of ``chunk_size`` rows; a last chunk of one row joins the one
    before (a single image is not a BatchNorm batch)."""
    chunks = list(torch.arange(count, device=device).split(chunk_size))
    if len(chunks) > 1 and chunks[-1].numel() == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


class ChunkedStep(_Step):
    """Gradient caching with ghost BatchNorm: ``emb = cat(model(chunk) for chunk in
    batch_chunks(b, chunk_size))``, each chunk a BatchNorm batch, and ``loss(emb[triplets])``.

    A no-grad pass computes ``emb`` (updating the running statistics once per chunk, as that
    forward does); the loss gradient with respect to ``emb`` is cached; each chunk holding a
    selected image is forwarded again with grad, its random state replayed (dropout draws the
    same masks), and backpropagates its rows of the cached gradient. Peak graph memory: one
    chunk's. The replay covers torch's global generators only, not a layer's own generator.
    """

    name = "chunked"

    def __call__(self, images, labels, candidates=None) -> StepResult | None:
        count = images.shape[0]
        chunks = batch_chunks(count, self.chunk_size, images.device)
        embeddings, states = self._no_grad_pass(images, chunks)  # (b, D), one state per chunk
        everyone, triplets = self.mine(embeddings, labels, candidates)  # (W*b, D)
        if triplets.anchor.numel() == 0:
            return None
        unique, local = unique_triplet_images(triplets)
        cached = everyone[unique].requires_grad_(True)  # (U, D) leaf
        triplet_loss = self.loss_fn(cached, local)
        scaled = self.scale(triplet_loss) * get_world_size()  # DDP averages the ranks
        (grad,) = torch.autograd.grad(scaled, cached)  # (U, D)
        mine, rows = self.own_rows(unique, count)
        row_grads = grad.new_zeros((count, grad.shape[1]))  # (b, D), zero for unselected
        row_grads[rows] = grad[mine]
        selected = torch.zeros(count, dtype=torch.bool, device=images.device)
        selected[rows] = True
        ce_sum = self._backward_chunks(
            images, labels, chunks, states, row_grads, selected, unique.numel()
        )
        return self.result(triplet_loss, ce_sum if self.ce_weight > 0 else None, unique.numel())

    def _no_grad_pass(self, images, chunks):
        """The stated forward without a graph; the random state before each chunk."""
        pieces, states, device = [], [], images.device
        with torch.no_grad():
            for chunk in chunks:
                cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
                states.append((torch.get_rng_state(), cuda))
                pieces.append(self.forward(images[chunk], grad=False)[0])
        return torch.cat(pieces), states

    def _backward_chunks(self, images, labels, chunks, states, row_grads, selected, total):
        """Re-forward with grad the chunks holding a selected image, backpropagate their rows;
        this rank's cross-entropy sum (``total``: U). A rank with none runs its last chunk with
        zero gradients: DDP's all-reduce, on the last backward, needs every rank."""
        with_logits, ce_sum = self.ce_weight > 0, row_grads.new_zeros(())
        ce_scale = self.ce_weight * get_world_size() / total
        has_selected = torch.stack([selected[chunk].any() for chunk in chunks]).tolist()
        run = [i for i, flag in enumerate(has_selected) if flag] or [len(chunks) - 1]
        for position, index in enumerate(run):
            chunk, last = chunks[index], position == len(run) - 1
            sync = self.model.no_sync() if hasattr(self.model, "no_sync") and not last else None
            with (
                sync or contextlib.nullcontext(),
                _replayed_rng(states[index], images.device),
                frozen_bn_running_stats(self.core),
            ):
                embeddings, logits = self.forward(images[chunk], with_logits)  # = cached rows
                surrogate = (embeddings * row_grads[chunk]).sum()  # d/d(embeddings) = grads
                if logits is not None:  # masked, not indexed: the head stays in the graph
                    ce = self.ce_loss(logits, labels[chunk], reduction="none")
                    ce = (ce * selected[chunk]).sum()
                    ce_sum += ce.detach()
                    surrogate = surrogate + self.scale(ce * ce_scale)
                surrogate.backward()  # frees this chunk's graph before the next is built
        return ce_sum


def choose_step(
    passes: int | str, chunk_size: int, selects_every_image: bool, triplet_lists: bool = False
) -> str:
    """The path: "one-pass", "two-pass" or "chunked". ``passes="auto"``: chunked when
    ``chunk_size > 0``; one pass when the miner selects every image (a selection-only pass
    would forward the same images again); else two, always for seed-style triplet lists."""
    if isinstance(passes, bool) or passes not in ("auto", 1, 2):
        raise ConfigError(f"passes must be 'auto', 1 or 2, got {passes!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ConfigError(f"chunk_size must be an int >= 0, got {chunk_size!r}")
    if chunk_size > 0:
        if passes == 1:
            raise ConfigError(
                f"passes=1 and chunk_size={chunk_size} exclude each other: a chunked step "
                "is a two-pass step (passes: 2 or auto)"
            )
        return "chunked"
    if passes == "auto":
        return "one-pass" if selects_every_image and not triplet_lists else "two-pass"
    return "one-pass" if passes == 1 else "two-pass"


def build_step(model, miner, loss_fn, *, passes="auto", triplet_lists=False, **settings) -> _Step:
    """The step of :func:`choose_step`'s path, built (``settings``: ``_Step``'s keywords)."""
    every = getattr(miner, "selects_every_image", False)
    name = choose_step(passes, settings.get("chunk_size", 0), every, triplet_lists)
    path = {"one-pass": OnePassStep, "two-pass": TwoPassStep, "chunked": ChunkedStep}[name]
    return path(model, miner, loss_fn, **settings)
