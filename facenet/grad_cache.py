"""Gradient caching support: make a chunked grad pass recompute the mining pass's embeddings.

Gradient caching (Gao et al. 2021) computes the loss on embeddings from a no-grad pass, takes
the loss gradient with respect to those embeddings, then re-runs the forward with grad chunk by
chunk and backpropagates each chunk's slice of that gradient. This is exact only if each chunk
recomputes exactly the cached embeddings. Two kinds of layer break that:

- BatchNorm in training mode normalises with the statistics of whatever batch it sees, so a
  chunk would be normalised with the chunk's statistics. :class:`BatchState` records each
  BatchNorm layer's batch mean and variance in the mining pass (over the whole batch) and replays
  them, fixed, in every chunk (as constants: no gradient flows through the batch statistics, the
  one difference from an unchunked step on a BatchNorm model). Running statistics are then
  updated once, with the whole batch's statistics.
- Dropout draws a fresh mask per call. The mining pass's masks are recorded per image and the
  chunks reuse the rows of their images.

Layers whose output does not depend on the rest of the batch (GroupNorm, LayerNorm, convolutions)
need nothing: for such a model the chunked gradient equals the unchunked one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["BatchState"]


class BatchState:
    """Records batch-dependent state in one pass and replays it for subsets of the batch.

    Args:
        model: the network; its BatchNorm and Dropout layers (in training mode) are handled.
    """

    def __init__(self, model: nn.Module):
        self.norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.training]
        self.dropouts = [
            m for m in model.modules() if isinstance(m, _DropoutNd) and m.training and m.p > 0
        ]
        self.stats: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.masks: dict[nn.Module, torch.Tensor] = {}

    # ------------------------------------------------------------------ recording

    def _record_stats(self, module: nn.Module, inputs: tuple) -> None:
        x = inputs[0]  # (N, C, ...)
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.float()
        dims = [0, *range(2, x.dim())]
        mean = x.mean(dims)  # (C,)
        var = x.var(dims, unbiased=False)  # (C,) what training-mode BatchNorm divides by
        self.stats[module] = (mean.detach(), var.detach(), x.numel() // x.shape[1])

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Within this context, forwards record batch statistics and dropout masks."""
        handles = [m.register_forward_pre_hook(self._record_stats) for m in self.norms]
        for module in self.dropouts:
            module.forward = self._recording_dropout(module)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module in self.dropouts:
                del module.forward  # back to the class's forward

    def _recording_dropout(self, module: _DropoutNd):
        def forward(x: torch.Tensor) -> torch.Tensor:
            keep = 1.0 - module.p
            mask = torch.empty_like(x).bernoulli_(keep) / keep  # (N, ...) inverted dropout
            self.masks[module] = mask
            return x * mask

        return forward

    # ------------------------------------------------------------------ replaying

    @contextlib.contextmanager
    def replay(self, rows: list[torch.Tensor] | None = None) -> Iterator[list]:
        """Within this context, BatchNorm uses the recorded statistics and Dropout the masks.

        Yields a one-element list: set ``rows[0]`` to the batch indices (N,) of the images of
        the next forward, so dropout takes their rows of the recorded masks.
        """
        rows = rows if rows is not None else [None]
        saved = {}
        for module in self.norms:
            mean, var, _ = self.stats[module]
            saved[module] = (module.running_mean, module.running_var)
            # In eval mode BatchNorm normalises with these buffers as constants.
            module._buffers["running_mean"], module._buffers["running_var"] = mean, var
            module.eval()
        for module in self.dropouts:
            mask = self.masks[module]
            module.forward = lambda x, mask=mask: x * mask[rows[0]]
        try:
            yield rows
        finally:
            for module, (mean, var) in saved.items():
                module._buffers["running_mean"], module._buffers["running_var"] = mean, var
                module.train()
            for module in self.dropouts:
                del module.forward

    @torch.no_grad()
    def update_running_stats(self) -> None:
        """One running-statistics update per BatchNorm layer, from the recorded batch."""
        for module in self.norms:
            if not module.track_running_stats or module.running_mean is None:
                continue
            mean, var, count = self.stats[module]
            module.num_batches_tracked += 1
            momentum = module.momentum
            if momentum is None:  # cumulative moving average
                momentum = 1.0 / float(module.num_batches_tracked)
            unbiased = var * count / max(count - 1, 1)
            module.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
