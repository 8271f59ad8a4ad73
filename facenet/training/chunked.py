"""The chunked step: gradient caching with ghost BatchNorm, for batches whose graph does not fit.

``build_step`` loads it when ``train.chunk_size`` is set; its gradient is held against
``tests/step_reference.py`` beside the other paths' (``tests/training/test_step.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from facenet.distributed import get_rank, get_world_size
from facenet.training.step import Step, StepResult, frozen_bn_running_stats, unique_triplet_images


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


class ChunkedStep(Step):
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
        chunks = batch_chunks(count, self.settings.chunk_size, images.device)
        embeddings, states = self._no_grad_pass(images, chunks)  # (b, D), one state per chunk
        everyone, triplets = self.mine(embeddings, labels, candidates)  # (W*b, D)
        if triplets.anchor.numel() == 0:
            return None
        unique, local = unique_triplet_images(triplets)
        cached = everyone[unique].requires_grad_(True)  # (U, D) leaf
        triplet_loss = self.loss_fn(cached, local)
        scaled = self.scale(triplet_loss) * get_world_size()  # DDP averages the ranks
        (grad,) = torch.autograd.grad(scaled, cached)  # (U, D)
        # Scattered over the global batch, then this rank's block: no mask indexing.
        own = slice(get_rank() * count, (get_rank() + 1) * count)
        row_grads = grad.new_zeros((everyone.shape[0], grad.shape[1]))  # (W*b, D)
        row_grads[unique] = grad  # zero for unselected images
        selected = torch.zeros(everyone.shape[0], dtype=torch.bool, device=images.device)
        selected[unique] = True  # (W*b,)
        row_grads, selected = row_grads[own], selected[own]  # (b, D), (b,)
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
