"""Measuring what autograd graphs, the process and the CUDA allocator hold, and glibc's malloc
set up for tensor work (every command does it at start, the library never: see the last section).

A graph holds memory through the tensors its nodes save for backward; ``backward()`` frees
them, otherwise they die with the last reference to the graph's outputs.
:class:`GraphMemoryMeter` counts them as they are saved and released; the other functions read
the process's resident memory, the CUDA allocator, and parameters, gradients and optimizer
state. The figures' names (``MEMORY_KEYS``) are those metrics.jsonl files carry: never renamed.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

PEAK_RSS_BYTES = "peak_rss_bytes"
GRAPH_BYTES_PEAK = "graph_bytes_peak"  # since the meter's reset_peak
GRAPH_BYTES_ALIVE = "graph_bytes_alive"
CUDA_MAX_ALLOCATED = "cuda_max_allocated"  # since reset_cuda_peaks
CUDA_MAX_RESERVED = "cuda_max_reserved"
CUDA_ALLOCATED = "cuda_allocated"
CUDA_RESERVED = "cuda_reserved"
MEMORY_KEYS = (
    PEAK_RSS_BYTES,
    GRAPH_BYTES_PEAK,
    GRAPH_BYTES_ALIVE,
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    CUDA_ALLOCATED,
    CUDA_RESERVED,
)
CudaDevice = torch.device | str | int | None  # None: the current CUDA device; an int: its index


def _storage(tensor: torch.Tensor) -> tuple[int | None, int]:
    """(key, bytes) of the whole storage under ``tensor``, shared by its views (a small view
    holds all of it); (None, the tensor's bytes) for sparse or wrapper tensors."""
    try:
        storage = tensor.untyped_storage()
        # The StorageImpl's address: unique among live storages, meta-device ones included.
        return storage._cdata, int(storage.nbytes())
    except (RuntimeError, NotImplementedError, AttributeError):
        return None, tensor.element_size() * tensor.nelement()


def _is_trainable_leaf(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (``weight.t()``): the model's, not the graph's."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


class TimelineEntry(NamedTuple):
    label: str
    alive_bytes: int


class _SavedTensorHolder:
    """What autograd keeps in place of a saved tensor; the count drops when autograd drops it."""

    __slots__ = ("tensor", "version", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: GraphMemoryMeter | None, key: Any):
        # A detached alias (same storage and version counter): holding the tensor would hold its
        # grad_fn, a cycle for nodes saving their own output, and the graph would never be freed.
        self.tensor = tensor.detach()
        self.version = tensor._version
        self.meter = meter
        self.key = key

    def __del__(self) -> None:
        if self.meter is not None:
            self.meter._release(self.key)


class GraphMemoryMeter:
    """Bytes held by autograd graphs: saved tensors alive now, and the peak since a reset.

    Every tensor saved for backward inside ``with meter:`` is counted until autograd releases
    it, also after the block. Storages count once, at full size; parameters and views of them
    never. Built on ``saved_tensors_hooks``: code installing its own hooks inside the block
    (``torch.utils.checkpoint``, ``save_on_cpu``) hides its tensors. ``exclude``: a module whose
    parameters and buffers (BatchNorm's running statistics) are not counted.
    """

    def __init__(self, exclude: nn.Module | None = None):
        # Reentrant: a holder's __del__ can run from the garbage collector inside a locked section.
        self._lock = threading.RLock()
        self._storage_refs: dict[Any, list[int]] = {}  # key -> [holders alive, storage nbytes]
        self.alive_bytes = 0
        self.peak_bytes = 0  # the largest alive_bytes since construction or reset_peak()
        if not isinstance(exclude, (nn.Module, type(None))):
            kind = type(exclude).__name__
            raise TypeError(f"GraphMemoryMeter(exclude=...): expected an nn.Module, got a {kind}")
        self._exclude = nn.Module() if exclude is None else exclude
        # Stateless: entering pushes the hooks on this thread's stack, leaving pops them.
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self.timeline: list[TimelineEntry] = []

    def __enter__(self) -> GraphMemoryMeter:
        # Read at each entry: a model moved to another device has new storages.
        tensors = [*self._exclude.parameters(), *self._exclude.buffers()]
        self._excluded = {_storage(t)[0] for t in tensors} - {None}
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.alive_bytes

    def mark(self, label: str) -> int:
        """Append ``(label, alive_bytes)`` to ``timeline``; return the bytes."""
        alive = self.alive_bytes
        self.timeline.append(TimelineEntry(str(label), alive))
        return alive

    def clear_timeline(self) -> None:
        self.timeline.clear()

    def _pack(self, tensor: torch.Tensor) -> _SavedTensorHolder:
        key, nbytes = _storage(tensor)
        if _is_trainable_leaf(tensor) or key in self._excluded:
            return _SavedTensorHolder(tensor, None, None)
        if key is None:
            key = object()  # no shareable storage: count this tensor on its own
        self._acquire(key, nbytes)
        return _SavedTensorHolder(tensor, self, key)

    @staticmethod
    def _unpack(holder: _SavedTensorHolder) -> torch.Tensor:
        # Autograd skips its in-place modification check for hooked tensors: keep it, so that
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
            entry = self._storage_refs.setdefault(key, [0, nbytes])
            entry[0] += 1
            if entry[0] == 1:
                self.alive_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.alive_bytes)

    def _release(self, key: Any) -> None:
        with self._lock:
            entry = self._storage_refs[key]
            entry[0] -= 1
            if entry[0] == 0:
                del self._storage_refs[key]
                self.alive_bytes -= entry[1]


def _saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """The tensors a graph node saved for backward; [] once backward freed them."""
    custom = hasattr(node, "saved_tensors")  # a custom autograd.Function
    names = ["saved_tensors"] if custom else [n for n in dir(node) if n.startswith("_saved_")]
    saved = []
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed by a backward
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        saved.extend(v for v in values if isinstance(v, torch.Tensor))
    return saved


def _graph_saved_bytes(root: torch.Tensor) -> int:
    seen_nodes, stack = set(), [root.grad_fn]
    saved: dict[int, int] = {}  # storage key -> nbytes
    leaf_keys: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf requiring grad
            leaf_keys.add(_storage(node.variable)[0])
        for tensor in _saved_tensors_of(node):
            key, nbytes = _storage(tensor)
            saved[key or id(tensor)] = nbytes
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(nbytes for key, nbytes in saved.items() if key not in leaf_keys)


def graph_bytes_by_variable(variables: Mapping[str, Any]) -> dict[str, int]:
    """For each named value, the bytes its graph's nodes saved for backward, counted as the
    meter counts them; 0 for non-tensors and freed graphs. Shared parts count for each."""
    return {
        name: _graph_saved_bytes(value) if isinstance(value, torch.Tensor) else 0
        for name, value in variables.items()
    }


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # KiB on Linux


def current_rss_bytes() -> int:
    """Resident bytes now, from ``/proc/self/statm``; the peak (an upper bound) without it."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return peak_rss_bytes()
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def reset_cuda_peaks(device: CudaDevice = None) -> None:
    if _is_cuda_device(device):
        torch.cuda.reset_peak_memory_stats(device)


def _is_cuda_device(device: CudaDevice) -> bool:
    return torch.cuda.is_available() and (
        device is None or isinstance(device, int) or torch.device(device).type == "cuda"
    )


def _tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def module_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes kept between steps: ``param_bytes`` (shared ones once), ``grad_bytes``,
    ``buffer_bytes`` and ``optimizer_state_bytes`` (0 without an optimizer)."""
    params = list(model.parameters())
    state = optimizer.state.values() if optimizer is not None else []
    return {
        "param_bytes": _tensor_bytes(params),
        "grad_bytes": _tensor_bytes(p.grad for p in params),
        "buffer_bytes": _tensor_bytes(model.buffers()),
        "optimizer_state_bytes": sum(_tensor_bytes(s.values()) for s in state),
    }


def memory_figures(
    meter: GraphMemoryMeter | None = None,
    device: CudaDevice = None,
    *,
    rss: bool = True,
    cuda_now: bool = False,
) -> dict[str, int]:
    """The figures under their ``MEMORY_KEYS`` names, read now: the meter's, the CUDA
    allocator's peaks since :func:`reset_cuda_peaks` on a CUDA ``device`` (also its current
    bytes with ``cuda_now``), and the peak RSS unless ``rss`` is false (where several
    measurements share a process)."""
    figures = {PEAK_RSS_BYTES: peak_rss_bytes()} if rss else {}
    if meter is not None:
        figures[GRAPH_BYTES_PEAK] = meter.peak_bytes
        figures[GRAPH_BYTES_ALIVE] = meter.alive_bytes
    # None would mean "the current CUDA device" to torch.cuda: no device, no CUDA figures.
    if device is not None and _is_cuda_device(device):
        figures[CUDA_MAX_ALLOCATED] = torch.cuda.max_memory_allocated(device)
        figures[CUDA_MAX_RESERVED] = torch.cuda.max_memory_reserved(device)
        if cuda_now:
            figures[CUDA_ALLOCATED] = torch.cuda.memory_allocated(device)
            figures[CUDA_RESERVED] = torch.cuda.memory_reserved(device)
    return figures


def format_bytes(n: int) -> str:
    """``512 B``, ``1.5 KiB``, ``-12.3 MiB`` (powers of 1024)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(size) < 1024 or unit == "PiB":
            break
        size /= 1024
    return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"


# --------------------------------------------------------------------------- malloc
# glibc's malloc set up for tensor work; every command does it at start, the library never.
#
# glibc serves each block over its mmap threshold (128 KiB, raised as blocks are freed to at most
# 32 MiB) from a mapping of its own and unmaps it on free. A forward frees and requests the same
# activation buffers every batch (Inception-ResNet-v1 on 128 images at 160 px: buffers up to
# 190 MB, most over any threshold), and the kernel faults each page back in, zeroed: 40% of an LFW
# evaluation's CPU time went to the kernel. With no block mapped on its own, freed buffers stay
# in the heap and are reused; its free top goes back to the kernel past ``TRIM_THRESHOLD``, which
# bounds what the process holds beyond its live memory. BENCHMARKS.md ("CPU: the kernel's share")
# has the measured cost: 1.7-1.9x faster forwards for 1.06-1.27x the peak RSS.
#
# ``FACENET_MALLOC=system`` (or a glibc ``MALLOC_*_`` / ``GLIBC_TUNABLES`` setting of one's own)
# leaves malloc as the platform set it. Elsewhere than on glibc (macOS, Windows, musl) there is
# no such control and nothing is changed.

ENV = "FACENET_MALLOC"
CHOICES = ("keep", "system")  # keep freed memory in the heap (default); the platform's own
# glibc's own environment settings: one of them means the user chose for themselves
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_")
_USER_SETTINGS += ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# Free heap top kept before it is returned: above one forward's buffers, which are then
# never faulted in again (256 MiB still left 6% of the forward's CPU to the kernel).
TRIM_THRESHOLD = 1 << 30
_keeping = False  # whether keep_freed_memory set this process's malloc up


def _has_glibc() -> bool:
    try:  # no confstr on Windows; no such name on macOS; EINVAL from musl
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        return False


def glibc_call(name: str, *args) -> int | None:
    """glibc's function ``name`` called with ``args``; None where there is no glibc."""
    return getattr(ctypes.CDLL(None), name)(*args) if _has_glibc() else None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks in its heap (no block mapped on its own, heap
    top returned past ``TRIM_THRESHOLD``) unless ``FACENET_MALLOC`` or the user's own glibc
    settings say otherwise; whether it was set. Process-wide, and inherited by forked workers.
    """
    choice = os.environ.get(ENV, "keep")
    if choice not in CHOICES:
        warnings.warn(
            f"{ENV}={choice!r} is not one of {CHOICES}: malloc left as it is", stacklevel=2
        )
    if choice != "keep" or any(name in os.environ for name in _USER_SETTINGS):
        return False
    global _keeping
    settings = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD}
    _keeping = all(glibc_call("mallopt", key, value) for key, value in settings.items())
    return _keeping


def keeps_freed_memory() -> bool:
    """Whether :func:`keep_freed_memory` set this process's malloc up (a forked child's too)."""
    return _keeping
