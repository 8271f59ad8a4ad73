"""The measurement core of the training-step benchmarks and the memory report.

``bench_training_step``, ``bench_step_paths`` and ``memory_report`` time a step, read its memory
and build the corrected step's miner and loss through these functions, so that one figure has
one definition and one name: memory figures carry the names of ``facenet.memory.MEMORY_KEYS``,
the names of the trainer's epoch records in ``metrics.jsonl``.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from facenet.files import write_text_atomic
from facenet.memory import (
    GraphMemoryMeter,
    current_rss_bytes,
    memory_figures,
    reset_cuda_peaks,
)
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner, TripletMarginMiner

__all__ = [
    "RSS_BEFORE_BYTES",
    "synchronize",
    "timed",
    "metered_step",
    "memory_readings",
    "rss_before",
    "seed_rule_parts",
    "semihard_parts",
    "release_device_memory",
    "ForwardCounter",
    "GradBytesAtStep",
]

# Benchmark-only: the process's RSS before its steps (peak RSS minus this = what they added).
RSS_BEFORE_BYTES = "rss_before_bytes"


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work, so that timings and allocator figures are complete.

    Args:
        device: the device the work runs on; nothing to wait for off CUDA.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, fn())``, the device's queued work included.

    Args:
        device: where ``fn`` queues work.
        fn: the work.
    """
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def metered_step(
    meter: GraphMemoryMeter,
    device: torch.device | str,
    fn: Callable[[], Any],
    reset_peaks: bool = False,
) -> tuple[float, Any]:
    """Run ``fn()`` timed under ``meter``; ``(seconds, result)``.

    The meter keeps counting across calls, so graphs one step leaves behind are still seen (and
    their release counted) during the next one: the seed loop's peak needs that.

    Args:
        meter: the graph meter (entered for the call).
        device: the step's device.
        fn: one training step.
        reset_peaks: start the graph and CUDA peaks from what is alive now (a per-step peak);
            False keeps the peak over every call since the last reset.
    """
    if reset_peaks:
        reset_cuda_peaks(device)
    with meter:
        if reset_peaks:
            meter.reset_peak()  # the new peak starts from what the last step left alive
        return timed(device, fn)


def memory_readings(
    meter: GraphMemoryMeter, device: torch.device | str, rss: bool = False
) -> dict[str, int]:
    """Graph bytes (peak, alive now) and, on CUDA, the allocator's peaks and current figures.

    Args:
        meter: the meter the steps ran under.
        device: the steps' device.
        rss: add the process's peak RSS; only meaningful in a process of its own (a forked
            child), where the peak belongs to this measurement alone.

    Returns:
        ``{name: bytes}`` under ``facenet.memory.MEMORY_KEYS`` names.
    """
    return memory_figures(meter, torch.device(device), rss=rss, cuda_now=True)


def rss_before() -> dict[str, int]:
    """``{RSS_BEFORE_BYTES: the resident set size now}``, read before the steps."""
    return {RSS_BEFORE_BYTES: current_rss_bytes()}


def seed_rule_parts(margin: float) -> tuple[TripletMarginMiner, TripletMarginLoss]:
    """The seed's selection (``d(a,n) - d(a,p) < margin`` on its distance) and its mean
    triplet loss: what the corrected step runs on triplet batches.

    Args:
        margin: the selection and loss margin.
    """
    miner = TripletMarginMiner(
        margin=margin, type_of_triplets="all", distance="seed_l2", strict_margin=True
    )
    return miner, TripletMarginLoss(margin=margin, distance="seed_l2", reduction="mean")


def semihard_parts(margin: float, seed: int = 0) -> tuple[SemiHardNegativeMiner, TripletMarginLoss]:
    """FaceNet's semi-hard mining and the triplet loss, squared distance: P x K batches.

    Args:
        margin: the mining and loss margin.
        seed: seed of the miner's generator (its random negative choices).
    """
    generator = torch.Generator().manual_seed(seed)
    miner = SemiHardNegativeMiner(margin=margin, distance="squared", generator=generator)
    return miner, TripletMarginLoss(margin=margin, distance="squared")


def release_device_memory(device: torch.device | str) -> None:
    """On CUDA, collect garbage and return cached blocks, so measurements start alike.

    On the CPU nothing is needed: reference counting already freed the last one's tensors.

    Args:
        device: the measurements' device.
    """
    if torch.device(device).type == "cuda":
        gc.collect()  # a reference cycle would keep the last measurement's tensors allocated
        torch.cuda.empty_cache()


class ForwardCounter:
    """Counts images entering a module, with and without grad (a forward pre-hook).

    Args:
        module: the module whose inputs (first argument, (N, ...)) are counted.
    """

    def __init__(self, module: torch.nn.Module):
        self.with_grad = 0
        self.no_grad = 0
        self._handle = module.register_forward_pre_hook(self._count)

    def _count(self, module: torch.nn.Module, inputs: tuple) -> None:
        images = inputs[0].shape[0]
        if torch.is_grad_enabled():
            self.with_grad += images
        else:
            self.no_grad += images

    def remove(self) -> None:
        """Detach the hook from the module."""
        self._handle.remove()


class GradBytesAtStep:
    """Gradient bytes alive when ``optimizer.step()`` starts (an optimizer step pre-hook).

    Args:
        optimizer: the optimizer whose parameters' gradients are summed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.peak = 0
        self._handle = optimizer.register_step_pre_hook(self._record)

    def _record(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        grads = (p.grad for group in optimizer.param_groups for p in group["params"])
        self.peak = max(self.peak, sum(g.nbytes for g in grads if g is not None))

    def remove(self) -> None:
        """Detach the hook from the optimizer."""
        self._handle.remove()


def write_report(path: Path | None, report: dict) -> None:
    """Write a benchmark's JSON report, atomically (None: nowhere). The runners and
    ``run_all`` read these files; a timed-out run keeps what was written last.

    Args:
        path: the report file (its folder is created).
        report: plain JSON values.
    """
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(report, indent=1) + "\n")
