"""The training step: what each path computes, and exactly its gradient.

A step takes this rank's batch (P x K images, or seed-style a/p/n groups with candidate
triplets), mines triplets over the global batch (every rank's embeddings, gathered), and leaves
in ``.grad`` the gradient of the loss it states below. The optimizer update, the scaler, clipping
and the non-finite policy are the engine's (``facenet.training.engine``). With several
processes each rank backpropagates ``world_size x`` its share; DDP averages, so the parameters
receive the sum over ranks, which is the gradient of the stated loss.

"The batch" of a BatchNorm layer is what each path's grad forward sees, and the loss is computed
on that forward's embeddings, so autograd goes through the batch statistics as it would in the
plain forward written down for each path. ``tests/step_reference.py`` writes every path's
stated forward in plain autograd; ``tests/training/test_step.py`` and
``tests/test_distributed.py`` hold each path against it in float64:

- ``OnePassStep``: ``emb = model(images)`` with grad on the whole (rank's) batch, mining on its
  detached copy, ``loss(emb[triplets])``. The BatchNorm batch is the rank's batch.
- ``TwoPassStep``: a no-grad mining pass over the batch (BatchNorm running statistics
  untouched), then ``emb = model(images[selected])`` with grad on the rank's selected images
  only: they are their own BatchNorm batch (a rank with one selected image adds the first other
  image of its batch, unused by the loss: BatchNorm needs two). Mining may see other statistics
  than the loss; selection is the mining pass's, the loss and its gradient are the grad pass's.
- ``ChunkedStep`` (gradient caching, ghost BatchNorm): the rank's batch is cut into consecutive
  chunks of ``chunk_size`` images (a last chunk of one image joins the one before) and each
  chunk is a BatchNorm batch; the stated forward is
  ``emb = cat(model(chunk) for chunk in chunks)`` and ``loss(emb[triplets])``. A no-grad pass
  computes ``emb`` (and updates the running statistics once per chunk, as that forward does);
  the loss gradient with respect to ``emb`` is cached; each chunk holding a selected image is
  forwarded again with grad, with its random state replayed (dropout draws the same masks), and
  backpropagates its rows of the cached gradient. Peak graph memory: one chunk's. The replay
  covers torch's global generators (CPU and the device's): a layer drawing from its own
  ``torch.Generator`` or from Python's ``random`` would not recompute the cached rows.

Every path: triplets index the global batch in rank order; cross-entropy (``ce_weight > 0``)
is the mean over the selected images of the logits from the same grad forward. The path is
decided in one place, ``choose_step``, and built by ``build_step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from facenet.distributed import all_gather_tensor, gather_variable_rows, get_rank, get_world_size
from facenet.errors import ConfigError
from facenet.metric.miners import Triplets

__all__ = [
    "StepResult",
    "OnePassStep",
    "TwoPassStep",
    "ChunkedStep",
    "choose_step",
    "build_step",
    "batch_chunks",
    "frozen_bn_running_stats",
    "unique_triplet_images",
]


class StepResult(NamedTuple):
    """What a step leaves besides the gradients: the loss value and statistics.

    ``loss``: the stated loss (detached scalar, the same on every rank); ``stats``: detached
    device tensors (``triplet_loss``, ``ce_loss``, the loss's ``last_stats``,
    ``selected_images``).
    """

    loss: torch.Tensor
    stats: dict


@contextlib.contextmanager
def frozen_bn_running_stats(model: nn.Module) -> Iterator[None]:
    """BatchNorm layers normalise with batch statistics but leave running statistics alone.

    In training mode a ``_BatchNorm`` with ``track_running_stats=False`` uses the batch's
    statistics and neither updates ``running_mean``/``running_var`` nor counts the batch: what a
    mining or replayed pass needs, so the running statistics see each stated forward once.

    Args:
        model: the network (its training-mode BatchNorm layers are affected).
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
    flat = torch.cat([triplets.anchor, triplets.positive, triplets.negative])  # (3T,)
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    anchor, positive, negative = inverse.view(3, -1)  # (T,) each, also for T = 0
    return unique, Triplets(anchor, positive, negative)


def _at_least_float32(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """Losses run in float32 or wider, also under autocast (float64 stays float64)."""
    if tensor is not None and tensor.dtype in (torch.float16, torch.bfloat16):
        return tensor.float()
    return tensor


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a tensor (itself for one process)."""
    if get_world_size() > 1:
        value = value.clone()
        torch.distributed.all_reduce(value)
    return value


class _Step:
    """What every path shares: the forward, global mining, the loss and its statistics.

    Args:
        model: the network, possibly wrapped in DistributedDataParallel (grad forwards go
            through the wrapper, no-grad forwards through the module itself).
        miner: ``miner(embeddings, labels, candidates=None) -> Triplets``.
        loss_fn: ``loss_fn(embeddings, triplets) -> scalar`` with ``last_stats`` after a call.
        ce_weight: weight of the cross-entropy term (0: off).
        autocast_dtype: None, ``torch.bfloat16`` or ``torch.float16``.
        scale: the GradScaler's ``scale`` (identity without fp16).
    """

    name = ""

    def __init__(self, model, miner, loss_fn, *, ce_weight=0.0, autocast_dtype=None, scale=None):
        self.model, self.core = model, getattr(model, "module", model)
        self.miner, self.loss_fn, self.ce_weight = miner, loss_fn, float(ce_weight)
        self.autocast_dtype = autocast_dtype
        self.scale: Callable = scale if scale is not None else (lambda loss: loss)

    def forward(self, images, with_logits=False, grad=True):
        """(embeddings (N, D), logits (N, C) or None), float32 or wider."""
        model = self.model if grad else self.core
        device_type = images.device.type
        with torch.autocast(
            device_type, self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
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
        return all_embeddings, triplets

    @staticmethod
    def own_rows(global_rows: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask over ``global_rows`` of this rank's images, their rows in the local batch)."""
        start = get_rank() * count
        mine = (global_rows >= start) & (global_rows < start + count)
        return mine, global_rows[mine] - start

    def loss_and_backward(self, embeddings, triplets, selected, logits, ce_labels) -> StepResult:
        """The stated loss on ``embeddings`` (this rank's rows carry the graph); backward.

        Args:
            embeddings: (N, D) the global batch or its selected images, in triplet index order.
            triplets: index tensors into ``embeddings``.
            selected: U, the number of selected images (cross-entropy is their mean).
            logits: (u, C) logits of this rank's selected images, or None.
            ce_labels: (u,) their labels.
        """
        triplet_loss = self.loss_fn(embeddings, triplets)
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
        stats["triplet_loss"] = triplet_loss.detach()
        loss, value = triplet_loss, triplet_loss.detach()
        if logits is not None:
            ce_sum = F.cross_entropy(logits, ce_labels, reduction="sum")
            loss = loss + self.ce_weight * ce_sum / selected
            stats["ce_loss"] = _all_reduce_sum(ce_sum.detach()) / selected
            value = value + self.ce_weight * stats["ce_loss"]
        # DDP averages the ranks' gradients; each rank's share is 1/W of the sum.
        self.scale(loss * get_world_size()).backward()  # frees every tensor saved for backward
        stats["loss"] = value
        stats["selected_images"] = torch.tensor(float(selected))
        return StepResult(value, stats)


class OnePassStep(_Step):
    """One forward with grad on the rank's whole batch; mining on its detached embeddings."""

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
    """A no-grad mining pass, then one grad forward on the rank's selected images only."""

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
        """The grad forward on ``images[rows]``, their own BatchNorm batch.

        BatchNorm needs two images: a rank with one selected image adds the first other image
        of its batch, whose embedding the loss does not use. A rank with none still joins
        DDP's all-reduce through a zero-length slice of a forward that updates nothing.
        """
        with_logits = self.ce_weight > 0
        if rows.numel() == 0:
            with frozen_bn_running_stats(self.core):
                embeddings, logits = self.forward(images, with_logits)
            return embeddings[:0], None if logits is None else logits[:0]
        if rows.numel() == 1 and images.shape[0] > 1:
            other = rows.new_tensor([int(rows[0] == 0)])  # image 0, or 1 if 0 is selected
            embeddings, logits = self.forward(images[torch.cat([rows, other])], with_logits)
            return embeddings[:1], None if logits is None else logits[:1]
        return self.forward(images[rows], with_logits)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replayed_rng(state: tuple, device: torch.device) -> Iterator[None]:
    """Run a block with the random state ``state``; the global state is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def batch_chunks(count: int, chunk_size: int, device=None) -> list[torch.Tensor]:
    """Consecutive chunks of ``chunk_size`` rows; a last chunk of one row joins the one before
    (a single image is not a BatchNorm batch).

    Args:
        count: rows in the batch.
        chunk_size: rows per chunk.
        device: where the index tensors live.
    """
    chunks = list(torch.arange(count, device=device).split(chunk_size))
    if len(chunks) > 1 and chunks[-1].numel() == 1:
        chunks[-2:] = [torch.cat(chunks[-2:])]
    return chunks


class ChunkedStep(_Step):
    """Gradient caching over chunks that are their own BatchNorm batches (ghost BatchNorm).

    Args:
        chunk_size: images per chunk (the last chunk may be smaller).
        (the rest as for the other steps)
    """

    name = "chunked"

    def __init__(self, model, miner, loss_fn, *, chunk_size: int, **kwargs):
        super().__init__(model, miner, loss_fn, **kwargs)
        self.chunk_size = int(chunk_size)

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
        stats = {k: v.detach() for k, v in self.loss_fn.last_stats.items()}
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
        stats["triplet_loss"] = value = triplet_loss.detach()
        if self.ce_weight > 0:
            stats["ce_loss"] = _all_reduce_sum(ce_sum) / unique.numel()
            value = value + self.ce_weight * stats["ce_loss"]
        stats["loss"], stats["selected_images"] = value, torch.tensor(float(unique.numel()))
        return StepResult(value, stats)

    def _no_grad_pass(self, images, chunks):
        """The stated forward without a graph, chunk by chunk: each chunk its own BatchNorm
        batch, running statistics updated once per chunk; the random state before each."""
        pieces, states = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(_rng_state(images.device))
                pieces.append(self.forward(images[chunk], grad=False)[0])
        return torch.cat(pieces), states

    def _backward_chunks(self, images, labels, chunks, states, row_grads, selected, total):
        """Re-forward with grad the chunks holding a selected image; backpropagate their rows.

        A rank with no selected image runs its last chunk with zero gradients, so that it
        joins DDP's all-reduce, which happens on the last backward only. Returns this rank's
        cross-entropy sum over its selected images (``total``: U, of every rank).
        """
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
                    ce = F.cross_entropy(logits, labels[chunk], reduction="none")
                    ce = (ce * selected[chunk]).sum()
                    ce_sum += ce.detach()
                    surrogate = surrogate + self.scale(ce * ce_scale)
                surrogate.backward()  # frees this chunk's graph before the next is built
        return ce_sum


def choose_step(
    passes: int | str, chunk_size: int, selects_every_image: bool, triplet_lists: bool = False
) -> str:
    """The step path for the settings: "one-pass", "two-pass" or "chunked". The one place
    where the path is decided (``build_step`` asks it).

    ``auto``: chunked when ``chunk_size > 0``; one pass when the miner selects every image (a
    second, selection-only pass would forward the same images again); two passes otherwise,
    and always for seed-style triplet lists (the miner filters given triplets: sparse).

    Args:
        passes: "auto", 1 or 2.
        chunk_size: gradient-caching chunk (0: off).
        selects_every_image: the miner's ``selects_every_image``.
        triplet_lists: the batches are seed-style (a, p, n) triplet lists.

    Raises:
        ConfigError: ``passes=1`` with ``chunk_size > 0`` (a chunked step is a two-pass step),
            or an unknown value.
    """
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


def build_step(
    model,
    miner,
    loss_fn,
    *,
    passes: int | str = "auto",
    chunk_size: int = 0,
    triplet_lists: bool = False,
    **kwargs,
) -> _Step:
    """The step object for the settings: the path from :func:`choose_step`, built.

    Args:
        model, miner, loss_fn: as for the steps.
        passes, chunk_size, triplet_lists: as for :func:`choose_step` (``chunk_size``: images
            per chunk of the chunked path).
        kwargs: ``ce_weight``, ``autocast_dtype``, ``scale``.
    """
    every = getattr(miner, "selects_every_image", False)
    name = choose_step(passes, chunk_size, every, triplet_lists)
    if name == "chunked":
        return ChunkedStep(model, miner, loss_fn, chunk_size=chunk_size, **kwargs)
    return {"one-pass": OnePassStep, "two-pass": TwoPassStep}[name](model, miner, loss_fn, **kwargs)
