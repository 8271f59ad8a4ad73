"""Multi-process training under ``torchrun``: process group, gathers, rank-0 helpers.

``torchrun --nproc_per_node=N [--nnodes=M --node_rank=R --rdzv_endpoint=HOST:PORT]
scripts/train.py --config ...`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; the process
group is initialised from them (``env://``), with NCCL on GPUs and gloo on the CPU. Without those
variables everything here is a no-op for a single process.

Cross-rank mining (see ``Trainer``): each rank embeds its own P x K batch without grad, the
embeddings and labels are all-gathered, triplets are mined over the global batch (identically on
every rank), and the loss over ALL triplets is computed on every rank from the gathered
(detached) embeddings. Its gradient with respect to the embeddings is then backpropagated by each
rank through a grad pass over its own images only, multiplied by the world size: DDP averages the
ranks' gradients, so the result is exactly the single-process gradient on the concatenated batch.
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

__all__ = [
    "DistInfo",
    "resolve_device",
    "init_distributed",
    "cleanup_distributed",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "barrier",
    "main_process_first",
    "any_rank",
    "all_gather_tensor",
    "gather_variable_rows",
    "gather_objects",
    "broadcast_buffers",
    "agree_on_error",
]


@dataclass
class DistInfo:
    """Where this process stands: rank, world size, local rank and its device."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that logs and writes checkpoints."""
        return self.rank == 0


def resolve_device(name: str = "auto") -> torch.device:
    """The device a run asks for by name.

    Args:
        name: "auto" (CUDA when present), "cpu", "cuda" or "cuda:N".

    Raises:
        FacenetError: CUDA was asked for but no CUDA device is available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FacenetError(f"device {name!r} was asked for but no CUDA device is available")
    return device


def is_distributed() -> bool:
    """True when a process group with more than one process is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0."""
    return get_rank() == 0


def init_distributed(device: str = "auto", timeout_minutes: int = 30) -> DistInfo:
    """Initialise the process group from torchrun's environment, if there is one.

    Args:
        device: "auto", "cpu" or "cuda"; CUDA ranks use ``cuda:LOCAL_RANK`` and NCCL, CPU ranks
            use gloo.
        timeout_minutes: collective timeout.
    """
    use_cuda = resolve_device(device).type == "cuda"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return DistInfo(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        target = torch.device("cuda", local_rank)
    else:
        target = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return DistInfo(rank, world_size, local_rank, target)


def cleanup_distributed() -> None:
    """Destroy the process group (a clean shutdown)."""
    if dist.is_available() and dist.is_initialized():
        # DDP wrappers sit in reference cycles; collected only at interpreter exit, after the
        # group is gone, their reducer aborts the process ("terminate called without an
        # active exception"). Collect them while the group still exists.
        gc.collect()
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first (writing data, caches); the others run it after it.

    The ranks meet at one barrier: rank 0 after the block, the others before it.
    """
    if is_distributed() and not is_main_process():
        dist.barrier()
    yield
    if is_distributed() and is_main_process():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank; every rank must call it at the same point."""
    if not is_distributed():
        return flag
    value = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _collective_device() -> torch.device:
    """NCCL collectives need CUDA tensors; gloo takes CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, in rank order.

    Args:
        tensor: (b, ...) on this rank; every rank must pass the same shape.

    Returns:
        (world_size * b, ...) without autograd history.
    """
    if not is_distributed():
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def gather_variable_rows(tensor: torch.Tensor) -> list[torch.Tensor]:
    """All ranks' tensors of different lengths along dim 0, padded for the collective and
    trimmed again (no padding reaches the result, unlike DistributedSampler's repeats).

    Args:
        tensor: (n_r, ...) on rank r.

    Returns:
        The list of every rank's (n_r, ...) tensor, in rank order.
    """
    if not is_distributed():
        return [tensor]
    size = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    longest = int(max(s.item() for s in sizes))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return [part[: int(s.item())] for part, s in zip(parts, sizes)]


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` for one process.

    Args:
        obj: this rank's object; every rank must call at the same point.
    """
    if not is_distributed():
        return [obj]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics), in place.

    Ranks update their running statistics from their own batches; an evaluation sharded over
    the ranks must use one model's: rank 0's, the one checkpoints hold. Training-mode forwards
    normalise with batch statistics, so this changes no gradient.

    Args:
        module: the model without its DDP wrapper; every rank must call this together.
    """
    if is_distributed():
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)


def agree_on_error(error: BaseException | None, message: str | None = None) -> None:
    """Raise on every rank when any rank has an error, at the same point on every rank.

    The rank that had it raises its own error; the others raise ``RankFailure`` naming that
    rank and its message, so no rank goes on into a collective another will never enter.

    Args:
        error: this rank's error, or None.
        message: how to describe ``error`` to the other ranks (default ``str(error)``).
    """
    if not is_distributed():
        if error is not None:
            raise error
        return
    if not any_rank(error is not None):
        return
    data_error = isinstance(error, FacenetError)
    report = None
    if error is not None:
        report = (get_rank(), message or str(error) or type(error).__name__, data_error)
    failures = [r for r in gather_objects(report) if r is not None]
    if error is not None:
        error.agreed = data_error
        raise error
    rank, text, _ = failures[0]
    raise RankFailure(f"rank {rank}: {text}", checkpointable=all(f[2] for f in failures))
