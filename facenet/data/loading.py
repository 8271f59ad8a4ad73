"""The DataLoader, with every sample drawn under its own seed, and feeding batches to a GPU.

Which worker draws a sample depends on ``num_workers``, and a resumed epoch starts its workers
again; so each sample's augmentation is drawn under a seed hashed from (run seed, rank, epoch,
batch position, row): :class:`SeededBatches` attaches it to each index, :class:`SeededSamples`
draws under it. A resumed epoch, on any number of workers, draws what the whole epoch drew.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from facenet.data.batches import collate_batches

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: SplitMix64's increment
_MAX_AUTO_WORKERS = 8  # more rarely help one GPU, and each holds its own cache share
# Batches each worker prepares ahead: uint8 batches are small, and a deeper queue rides out a
# slow file without the GPU waiting.
_PREFETCH_FACTOR = 4


def _mix64(z):
    """SplitMix64's finaliser on a Python int or a uint64 array: every bit scattered."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def batch_seeds(seed: int, rank: int, epoch: int, position: int, rows: int) -> np.ndarray:
    """int64 (rows,): the 63-bit augmentation seeds of a batch's rows, ``position`` counting
    batches from the epoch's first; a SplitMix64 hash chain over the five numbers."""
    z = _mix64(int(seed) & _MASK64)
    for value in (rank, epoch, position):
        z = _mix64(z ^ ((int(value) + _GOLDEN) & _MASK64))
    links = (np.arange(rows, dtype=np.uint64) + np.uint64(_GOLDEN)) ^ np.uint64(z)  # (rows,)
    return (_mix64(links) >> 1).astype(np.int64)


class SeededBatches:
    """``batch_sampler``'s batches as ``(index, seed)`` pairs; the epoch is read from
    ``epoch_of.epoch`` (default: the batch sampler's)."""

    def __init__(self, batch_sampler, seed: int, rank: int = 0, epoch_of=None):
        self.batch_sampler, self.seed, self.rank = batch_sampler, seed, rank
        self.epoch_of = batch_sampler if epoch_of is None else epoch_of

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        epoch = int(getattr(self.epoch_of, "epoch", 0))
        for position, batch in enumerate(self.batch_sampler):
            seeds = batch_seeds(self.seed, self.rank, epoch, position, len(batch)).tolist()
            yield [(int(index), seed) for index, seed in zip(batch, seeds)]


class SeededSamples(Dataset):
    """``dataset[index]`` of each ``(index, seed)`` of a batch (the loader fetches whole batches),
    drawn with torch's CPU generator seeded by ``seed``; the generator's state outside is kept."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        # Saved and restored once per batch: ~2 us with the reseeds (fork_rng costs ~75 us).
        generator = torch.default_generator
        state = generator.get_state()
        try:
            samples = []
            for index, seed in items:
                generator.manual_seed(seed)
                samples.append(self.dataset[index])
            return samples
        finally:
            generator.set_state(state)


def seed_worker(worker_id: int) -> None:
    """Seed a worker's numpy and ``random`` streams (torch leaves them as forked), and make it
    ignore SIGINT: a Ctrl-C reaches every process of the job, and a worker dead of it would
    fail the loop's next fetch before the main process could write its checkpoint."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    if torch.utils.data.get_worker_info() is not None:  # never in the main process
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def resolve_loader_settings(
    num_workers: int | str, pin_memory: bool | str, device_type: str
) -> tuple[int, bool]:
    """``(num_workers, pin_memory)`` with "auto" resolved for ``device_type`` ("cuda", "cpu"):
    a worker per core of this process's share (torchrun's ``LOCAL_WORLD_SIZE`` processes on
    this machine) that the step leaves free (a GPU step needs one core, a CPU step
    ``torch.get_num_threads()``), at most 8; pinned memory (asynchronous copies) for a GPU."""
    if num_workers == "auto":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        busy = 1 if device_type == "cuda" else torch.get_num_threads()
        num_workers = max(0, min(_MAX_AUTO_WORKERS, available_cpus() // max(1, local) - busy))
    if pin_memory == "auto":
        pin_memory = device_type == "cuda"
    return int(num_workers), bool(pin_memory)


def make_loader(
    dataset: Dataset,
    batch_sampler: Iterable[list[int]],
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    rank: int = 0,
    epoch_of=None,
    persistent_workers: bool = True,
) -> DataLoader:
    """A DataLoader of ``batch_sampler``'s batches, every sample seeded (:func:`batch_seeds`),
    batches collated by :func:`~facenet.data.batches.collate_batches`.

    ``persistent_workers`` keeps workers (and their decoded caches) across epochs; False for a
    dataset redrawn per epoch in the main process (a triplet list), which they would not see.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: expected >= 0")
    return DataLoader(
        SeededSamples(dataset),
        batch_sampler=SeededBatches(batch_sampler, seed, rank, epoch_of),
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=persistent_workers and num_workers > 0,
        collate_fn=collate_batches,
        prefetch_factor=_PREFETCH_FACTOR if num_workers > 0 else None,
    )


def batch_to_device(batch, device: torch.device):
    """Every tensor of a batch (nested tuples/lists) copied to ``device`` with
    ``non_blocking=True``; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch_to_device(item, device) for item in batch)
    return batch


def _tensors(batch):
    """The tensors of a batch: a tensor, or nested tuples/lists of them and other items."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            yield from _tensors(item)


def prefetch_to_device(loader: Iterable, device: torch.device):
    """The loader's batches on a CUDA ``device``, batch n+1 copied on a side stream while step
    n runs (asynchronous from pinned memory); on other devices the batches as they come."""
    if torch.device(device).type != "cuda":
        yield from loader
        return
    copy_stream = torch.cuda.Stream(device)
    batches, done = iter(loader), object()

    def issue_next():
        batch = next(batches, done)
        if batch is done:
            return done
        with torch.cuda.stream(copy_stream):
            return batch_to_device(batch, device)

    pending = issue_next()
    while pending is not done:
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copy_stream)  # the step reads the batch after its copy
        for tensor in _tensors(pending):  # allocated on the copy stream: kept till it is read
            if tensor.is_cuda:
                tensor.record_stream(compute)
        batch, pending = pending, issue_next()
        yield batch


def count_images(batch) -> int:
    """The images in a batch: the leading sizes of its 4-D tensors (nested tuples/lists)."""
    return sum(tensor.shape[0] for tensor in _tensors(batch) if tensor.ndim == 4)


def measure_throughput(loader: Iterable, max_batches: int) -> float:
    """Images per second over at most ``max_batches`` batches, the first (worker start-up)
    untimed when there are more."""
    if max_batches < 1:
        raise ValueError(f"max_batches={max_batches}: expected >= 1")
    counts, times = [], [time.perf_counter()]  # times[i + 1]: when batch i had come
    for batch in itertools.islice(loader, max_batches):
        counts.append(count_images(batch))
        times.append(time.perf_counter())
    start = 1 if len(counts) > 1 else 0
    images = sum(counts[start:])
    if images == 0:
        raise ValueError("measure_throughput: the loader gave no images (no 4-D tensors)")
    return images / max(times[-1] - times[start], 1e-9)
