"""Measuring what autograd graphs, the process and the CUDA allocator hold.

An autograd graph costs memory through the tensors its nodes save for backward (a convolution
saves its input, a ReLU its output, BatchNorm its input and batch statistics). Those tensors live
as long as the graph: ``backward()`` frees them, and otherwise they die with the last Python
reference to the graph's outputs. :class:`GraphMemoryMeter` counts them as they are saved and as
they are released, so "how much does this graph hold, and when is it freed?" gets a number.

The other functions measure the rest of the picture: the process's resident memory, the CUDA
caching allocator, and the bytes of parameters, gradients and optimizer state.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "GraphMemoryMeter",
    "TimelineEntry",
    "graph_bytes_by_variable",
    "peak_rss_bytes",
    "current_rss_bytes",
    "cuda_memory_stats",
    "reset_cuda_peaks",
    "module_state_bytes",
    "format_bytes",
    "memory_figures",
    "PEAK_RSS_BYTES",
    "GRAPH_BYTES_PEAK",
    "GRAPH_BYTES_ALIVE",
    "CUDA_MAX_ALLOCATED",
    "CUDA_MAX_RESERVED",
    "CUDA_ALLOCATED",
    "CUDA_RESERVED",
    "MEMORY_KEYS",
]

# The names of the memory figures: the trainer's epoch records (metrics.jsonl), the memory
# report's JSON and the benchmarks' JSON all use these. They are the names users' metrics.jsonl
# files already carry, so they are never renamed.
PEAK_RSS_BYTES = "peak_rss_bytes"  # the process's peak resident set size so far
GRAPH_BYTES_PEAK = "graph_bytes_peak"  # tensors saved for backward, peak since the meter's reset
GRAPH_BYTES_ALIVE = "graph_bytes_alive"  # tensors saved for backward, alive when read
CUDA_MAX_ALLOCATED = "cuda_max_allocated"  # the CUDA allocator's peak since reset_cuda_peaks
CUDA_MAX_RESERVED = "cuda_max_reserved"
CUDA_ALLOCATED = "cuda_allocated"  # the CUDA allocator's figures when read
CUDA_RESERVED = "cuda_reserved"
# Every memory figure an epoch record, a report variant or a benchmark variant may carry.
MEMORY_KEYS = (
    PEAK_RSS_BYTES,
    GRAPH_BYTES_PEAK,
    GRAPH_BYTES_ALIVE,
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    CUDA_ALLOCATED,
    CUDA_RESERVED,
)


# --------------------------------------------------------------------------- storages


def _storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of the storage under ``tensor`` (views of one storage share it); None if none."""
    try:
        # _cdata is the address of the StorageImpl: unique among storages alive at the same time,
        # and it also tells meta-device storages apart (their data pointers are all 0).
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None  # sparse or wrapper tensors without a plain storage


def _storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole storage under ``tensor`` (a small view still holds all of it)."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return tensor.element_size() * tensor.nelement()


def _is_trainable_leaf(tensor: torch.Tensor) -> bool:
    """True for a leaf requiring grad (a parameter) or a view of one (``weight.t()``).

    Such tensors are owned by the model, not by the graph: the graph dying frees none of them.
    """
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def _excluded_keys(exclude: nn.Module | Iterable[torch.Tensor] | None) -> set[int]:
    """Storage keys of the tensors named by ``exclude`` (a module: its parameters and buffers)."""
    if exclude is None:
        return set()
    if isinstance(exclude, nn.Module):
        tensors: Iterable[torch.Tensor] = [*exclude.parameters(), *exclude.buffers()]
    elif isinstance(exclude, torch.Tensor):
        tensors = [exclude]
    else:
        tensors = list(exclude)
    keys = set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"GraphMemoryMeter(exclude=...): expected an nn.Module or tensors, "
                f"got an item of type {type(tensor).__name__}"
            )
        key = _storage_key(tensor)
        if key is not None:
            keys.add(key)
    return keys


# --------------------------------------------------------------------------- the meter


class TimelineEntry(NamedTuple):
    """One point of a meter's timeline: a label and the graph bytes alive at that moment."""

    label: str
    alive_bytes: int


class _SavedTensorHolder:
    """What autograd keeps in place of a saved tensor while the meter's hooks are active.

    Autograd drops its reference to this object when it frees the saved variable (after a
    backward without ``retain_graph``, or when the node dies with its graph); the meter's count
    drops with it.
    """

    __slots__ = ("tensor", "version", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: GraphMemoryMeter | None, key: Any):
        # A detached alias: holding the tensor itself would hold its grad_fn, and for a node that
        # saves its own output (ReLU, exp) that is a reference cycle the collector cannot see
        # through, so the graph would never be freed. The alias shares storage and version counter.
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        if self.meter is not None:
            self.meter._release(self.key)


class GraphMemoryMeter:
    """Bytes held by autograd graphs: saved tensors alive now, and the peak since a reset.

    Enter it (``with meter:``) around code that builds graphs, once around a whole epoch or once
    per step. Every tensor saved for backward inside the block is counted until autograd releases
    it, also after the block has ended. Storages are counted once however many saved tensors view
    them, by their full size. Parameters, and any leaf tensor requiring grad or a view of one, are
    not counted: they belong to the model and outlive every graph.

    Built on ``torch.autograd.graph.saved_tensors_hooks``, so code that installs its own hooks
    inside the block (``torch.utils.checkpoint``, ``save_on_cpu``) hides its saved tensors from
    the meter. Counts are storage sizes, not what an allocator rounds them up to.

    Args:
        exclude: tensors whose storages are never counted, or a module whose parameters and
            buffers are never counted (BatchNorm saves its running statistics for backward; pass
            the model to leave them out). Read again each time the meter is entered.

    Example::

        meter = GraphMemoryMeter()
        with meter:
            loss = model(x).sum()
            meter.mark("forward")
            loss.backward()
            meter.mark("backward")
        meter.alive_bytes, meter.peak_bytes, meter.timeline
    """

    def __init__(self, exclude: nn.Module | Iterable[torch.Tensor] | None = None):
        # Reentrant: a holder's __del__ can run from the garbage collector inside a locked section.
        self._lock = threading.RLock()
        self._storage_refs: dict[Any, list[int]] = {}  # key -> [holders alive, storage nbytes]
        self._alive = 0
        self._peak = 0
        self._exclude = exclude
        self._excluded: set[int] = set()
        self._local = threading.local()  # per-thread stack of entered hook contexts
        self.timeline: list[TimelineEntry] = []

    # ----------------------------------------------------------------- context manager

    def __enter__(self) -> GraphMemoryMeter:
        self._excluded = _excluded_keys(self._exclude)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._contexts().append(hooks)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._contexts().pop().__exit__(*exc_info)

    def _contexts(self) -> list:
        """The hook contexts this thread has entered (saved-tensor hooks are per thread)."""
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    # ----------------------------------------------------------------- readings

    @property
    def alive_bytes(self) -> int:
        """Bytes of the distinct storages saved for backward and not yet released."""
        with self._lock:
            return self._alive

    @property
    def peak_bytes(self) -> int:
        """The largest ``alive_bytes`` seen since construction or the last ``reset_peak()``."""
        with self._lock:
            return self._peak

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        with self._lock:
            self._peak = self._alive

    def mark(self, label: str) -> int:
        """Append ``(label, alive_bytes)`` to ``timeline`` and return the bytes.

        Args:
            label: what just ran, e.g. the source line of a training step.
        """
        alive = self.alive_bytes
        self.timeline.append(TimelineEntry(str(label), alive))
        return alive

    def clear_timeline(self) -> None:
        """Forget the recorded timeline (counts and peak are kept)."""
        self.timeline.clear()

    # ----------------------------------------------------------------- hooks

    def _pack(self, tensor: torch.Tensor) -> _SavedTensorHolder:
        """Called by autograd for each tensor saved for backward while the meter is entered."""
        key = _storage_key(tensor)
        if _is_trainable_leaf(tensor) or key in self._excluded:
            return _SavedTensorHolder(tensor, None, None)
        if key is None:
            key = object()  # no shareable storage: count this tensor on its own
        self._acquire(key, _storage_nbytes(tensor))
        return _SavedTensorHolder(tensor, self, key)

    @staticmethod
    def _unpack(holder: _SavedTensorHolder) -> torch.Tensor:
        """Called by autograd when backward needs a saved tensor back."""
        # Autograd skips its in-place modification check for hooked tensors; keep it, so that
        # measuring never turns a loud error into a silently wrong gradient.
        if holder.tensor._version != holder.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a saved tensor of shape {tuple(holder.tensor.shape)} is at "
                f"version {holder.tensor._version}; expected version {holder.version} instead."
            )
        return holder.tensor

    def _acquire(self, key: Any, nbytes: int) -> None:
        with self._lock:
            entry = self._storage_refs.get(key)
            if entry is None:
                self._storage_refs[key] = [1, nbytes]
                self._alive += nbytes
                self._peak = max(self._peak, self._alive)
            else:
                entry[0] += 1

    def _release(self, key: Any) -> None:
        with self._lock:
            entry = self._storage_refs.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._storage_refs[key]
                self._alive -= entry[1]


# --------------------------------------------------------------------------- who holds what


def _saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """The tensors a graph node has saved for backward; [] once backward has freed them."""
    if hasattr(node, "saved_tensors"):  # a custom autograd.Function
        try:
            return list(node.saved_tensors)
        except RuntimeError:
            return []
    saved = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed by a backward
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        saved.extend(v for v in values if isinstance(v, torch.Tensor))
    return saved


def _graph_saved_bytes(root: torch.Tensor) -> int:
    """Bytes of the distinct storages saved by the graph reachable from ``root.grad_fn``."""
    if root.grad_fn is None:
        return 0
    seen_nodes, stack = set(), [root.grad_fn]
    saved: dict[int, int] = {}  # storage key -> nbytes
    leaf_keys: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf requiring grad
            leaf_keys.add(_storage_key(node.variable))
        for tensor in _saved_tensors_of(node):
            saved[_storage_key(tensor) or id(tensor)] = _storage_nbytes(tensor)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(nbytes for key, nbytes in saved.items() if key not in leaf_keys)


def graph_bytes_by_variable(variables: Mapping[str, Any]) -> dict[str, int]:
    """For each named tensor, the saved-tensor bytes of the graph its ``grad_fn`` keeps alive.

    Walks the graph from each tensor's ``grad_fn`` and sums the distinct storages its nodes
    saved for backward, leaving out leaves that require grad (parameters), as the meter does.
    A graph already freed by backward counts 0. Two variables sharing part of a graph both
    report the shared part. Works with or without a :class:`GraphMemoryMeter`.

    Args:
        variables: name -> value, e.g. a loop's variables; values that are not tensors with a
            ``grad_fn`` are reported as 0.

    Returns:
        name -> bytes, in the order given.
    """
    return {
        name: _graph_saved_bytes(value) if isinstance(value, torch.Tensor) else 0
        for name, value in variables.items()
    }


# --------------------------------------------------------------------------- process memory


def peak_rss_bytes() -> int:
    """The peak resident set size of this process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def current_rss_bytes() -> int:
    """The resident set size of this process now, in bytes.

    Read from ``/proc/self/statm`` (Linux); where that file does not exist, the peak RSS is
    returned instead, an upper bound.
    """
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- CUDA


def cuda_memory_stats(device: torch.device | str | int | None = None) -> dict[str, int]:
    """The CUDA caching allocator's figures for ``device``, in bytes; {} without CUDA.

    Args:
        device: a CUDA device; None is the current one. A non-CUDA device gives {}.

    Returns:
        ``allocated`` and ``reserved`` (now), ``max_allocated`` and ``max_reserved`` (peaks
        since the last :func:`reset_cuda_peaks`).
    """
    if not _is_cuda_device(device):
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
    }


def reset_cuda_peaks(device: torch.device | str | int | None = None) -> None:
    """Restart the CUDA peak figures from the current ones; nothing without CUDA.

    Args:
        device: a CUDA device; None is the current one.
    """
    if _is_cuda_device(device):
        torch.cuda.reset_peak_memory_stats(device)


def _is_cuda_device(device: torch.device | str | int | None) -> bool:
    """True when CUDA is usable and ``device`` names a CUDA device (or is None)."""
    if not torch.cuda.is_available():
        return False
    if device is None or isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


# --------------------------------------------------------------------------- model state


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    """Sum of ``nbytes`` over the tensors among ``tensors``."""
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def module_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes that stay between steps: parameters, their gradients, buffers, optimizer state.

    Args:
        model: the module; shared parameters are counted once.
        optimizer: optional; the tensors in ``optimizer.state`` (momentum, Adam moments, step
            counters) are summed.

    Returns:
        ``param_bytes``, ``grad_bytes`` (gradients that exist now), ``buffer_bytes`` (e.g.
        BatchNorm running statistics) and ``optimizer_state_bytes`` (0 without an optimizer).
    """
    params = list(model.parameters())
    state = optimizer.state.values() if optimizer is not None else []
    return {
        "param_bytes": _tensor_bytes(params),
        "grad_bytes": _tensor_bytes(p.grad for p in params),
        "buffer_bytes": _tensor_bytes(model.buffers()),
        "optimizer_state_bytes": sum(_tensor_bytes(s.values()) for s in state),
    }


# --------------------------------------------------------------------------- one reading


def memory_figures(
    meter: GraphMemoryMeter | None = None,
    device: torch.device | str | int | None = None,
    *,
    rss: bool = True,
    cuda_now: bool = False,
) -> dict[str, int]:
    """The memory figures under their :data:`MEMORY_KEYS` names, read now.

    Args:
        meter: a graph meter: its peak and alive bytes; None leaves them out.
        device: the CUDA allocator's peaks on a CUDA device; other devices (and None without
            CUDA) leave them out.
        rss: include the process's peak RSS (false where several measurements share a process,
            whose peak would mix them).
        cuda_now: also the allocator's allocated and reserved bytes now (on CUDA).

    Returns:
        ``{name: bytes}``; the trainer logs exactly what ``memory_figures(meter, device)`` gives.
    """
    figures = {PEAK_RSS_BYTES: int(peak_rss_bytes())} if rss else {}
    if meter is not None:
        figures[GRAPH_BYTES_PEAK] = int(meter.peak_bytes)
        figures[GRAPH_BYTES_ALIVE] = int(meter.alive_bytes)
    # None would mean "the current CUDA device" to cuda_memory_stats: no device, no CUDA figures.
    cuda = cuda_memory_stats(device) if device is not None else {}
    if cuda:
        figures[CUDA_MAX_ALLOCATED] = int(cuda["max_allocated"])
        figures[CUDA_MAX_RESERVED] = int(cuda["max_reserved"])
        if cuda_now:
            figures[CUDA_ALLOCATED] = int(cuda["allocated"])
            figures[CUDA_RESERVED] = int(cuda["reserved"])
    return figures


# --------------------------------------------------------------------------- formatting

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float) -> str:
    """A byte count for people: ``512 B``, ``1.5 KiB``, ``12.3 MiB`` (powers of 1024).

    Args:
        n: bytes; negative values (differences) keep their sign.
    """
    if isinstance(n, float) and not math.isfinite(n):
        return f"{n} B"
    sign = "-" if n < 0 else ""
    size = float(abs(n))
    unit = 0
    while size >= 1024 and unit < len(_UNITS) - 1:
        size /= 1024
        unit += 1
    if unit == 0:
        return f"{sign}{int(size)} B"
    return f"{sign}{size:.1f} {_UNITS[unit]}"
