"""Multi-process training under ``torchrun``: process group, gathers, rank-0 helpers.

The process group is initialised from torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
(NCCL on GPUs, gloo on the CPU); without them everything here is a no-op for one process.
Cross-rank mining and its exact gradient: docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from facenet.errors import FacenetError, RankFailure


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str = "auto") -> torch.device:
    """The device of "auto" (CUDA when present), "cpu", "cuda" or "cuda:N"; a FacenetError
    when CUDA is asked for and absent, or N is not a visible device (found here, at start,
    rather than as "invalid device ordinal" at the first kernel)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FacenetError(f"device {name!r} was asked for but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise FacenetError(f"device {name!r}: {count} CUDA device(s) visible (cuda:0..{count - 1})")
    return device


def set_threads(threads: int) -> None:
    """torch's intra-op CPU threads; 0 keeps torch's default (one per core). On a shared machine
    an op split over several threads waits for descheduled siblings (README measures it)."""
    if threads:
        torch.set_num_threads(threads)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_distributed() -> bool:
    """True when a process group of more than one process is initialised."""
    return _initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def init_distributed(device: str = "auto", timeout_minutes: float = 30) -> DistInfo:
    """Initialise the process group from torchrun's environment, if there is one; CUDA
    ranks use ``cuda:LOCAL_RANK``, one process the ``device`` resolved. Every CUDA process
    makes its device the current one (else pinned-memory threads and the RNG open a context on
    GPU 0). ``timeout_minutes`` bounds each collective's wait, a barrier's included."""
    target = resolve_device(device)
    use_cuda = target.type == "cuda"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        if use_cuda:
            torch.cuda.set_device(target)
        return DistInfo(device=target)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        target = resolve_device(f"cuda:{local_rank}")
        torch.cuda.set_device(target)
    if not dist.is_initialized():
        # env:// (the default) reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; device_id
        # binds NCCL's communicator to this rank's GPU at once (no guessing at first use).
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            timeout=datetime.timedelta(minutes=timeout_minutes),
            **({"device_id": target} if use_cuda else {}),
        )
    return DistInfo(rank, world_size, local_rank, target)


def cleanup_distributed() -> None:
    if _initialized():
        # DDP wrappers sit in reference cycles; collected only at interpreter exit, after the
        # group is gone, their reducer aborts the process ("terminate called without an
        # active exception"). Collect them while the group still exists.
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block (writing data, caches) before the others, at one barrier."""
    if not is_main_process():
        barrier()
    yield
    if is_main_process():
        barrier()


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank; every rank must call it at the same point."""
    if not is_distributed():
        return flag
    # NCCL collectives need CUDA tensors; gloo takes CPU tensors.
    device = torch.cuda.current_device() if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def all_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's (b, ...) tensor, in rank order: (world_size * b, ...), no autograd history."""
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def gather_variable_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's (n_r, ...) tensor, in rank order, on this rank's device; no autograd
    history (unlike DistributedSampler's repeats, nothing is padded)."""
    if not is_distributed():
        return [tensor]
    return [part.to(tensor.device) for part in gather_objects(tensor.detach().cpu())]


def gather_objects(obj) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    if not is_distributed():
        return [obj]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), in place, so an
    evaluation sharded over the ranks uses the model checkpoints hold. Changes no gradient:
    training-mode forwards normalise with batch statistics."""
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)


def agree_on_error(error: BaseException | None, message: str | None = None) -> None:
    """Raise on every rank when any rank has an error, so no rank goes on into a collective
    another will never enter: the rank that had it raises it, the others a ``RankFailure``
    naming that rank and its ``message`` (default ``str(error)``)."""
    if not any_rank(error is not None):
        return
    data_error = isinstance(error, FacenetError)
    report = error and (get_rank(), message or str(error) or type(error).__name__, data_error)
    failures = [r for r in gather_objects(report) if r is not None]  # [report] on one process
    if error is not None:
        error.agreed = data_error
        raise error
    rank, text, _ = failures[0]
    raise RankFailure(f"rank {rank}: {text}", checkpointable=all(f[2] for f in failures))
