"""Count, on the CPU, the operations that would block the host on CUDA.

A ``TorchDispatchMode`` sees every aten call; those listed here read a device value back to
the host (a data-dependent output shape, or ``.item()``). The same step on CUDA makes the same
calls, so a count taken on the CPU is the count ``torch.cuda.set_sync_debug_mode`` would report.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Output shape depends on the values, or the value itself goes to the host.
_BLOCKING = {
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten._local_scalar_dense.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


def _blocks(func, args, kwargs) -> bool:
    if func in _BLOCKING:
        return func is not aten.nonzero_static.default
    if func in _INDEXING:  # a boolean mask among the indices turns into nonzero on CUDA
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype == torch.bool for i in indices)
    if func is aten.repeat_interleave.Tensor:  # without output_size it reads the total
        return kwargs.get("output_size") is None
    return False


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs() as syncs:`` ... ``syncs.total``, ``syncs.counts`` (op name: calls)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _blocks(func, args, kwargs):
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())
