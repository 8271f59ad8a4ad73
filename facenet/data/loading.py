"""DataLoader construction with per-sample seeding, and a throughput measurement.

Augmentation draws from torch's random generator. Which process draws a sample, and in what
order, depends on ``num_workers``; where an interrupted epoch resumes, the workers start again.
So every sample is drawn with its own seed, a function of (run seed, rank, epoch, batch position
in the epoch, row in the batch): :class:`SeededBatches` attaches it to each index and
:class:`SeededSamples` draws the sample under it. A resumed epoch, on any number of workers
and ranks' restarts, then draws exactly what the uninterrupted epoch drew.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from facenet.data.batches import collate_batches

__all__ = [
    "SeededBatches",
    "SeededSamples",
    "sample_seed",
    "batch_seeds",
    "seed_worker",
    "make_loader",
    "available_cpus",
    "default_num_workers",
    "default_pin_memory",
    "resolve_loader_settings",
    "measure_throughput",
    "batch_to_device",
    "prefetch_to_device",
    "count_images",
]


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: SplitMix64's increment
# Workers beyond this rarely help one GPU's input pipeline and each holds its own cache share.
_MAX_AUTO_WORKERS = 8
# Batches each worker prepares ahead: uint8 batches are small, and a deeper queue rides out a
# slow file (a cold disk, a large JPEG) without the GPU waiting.
_PREFETCH_FACTOR = 4


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, rank: int, epoch: int, position: int, row: int) -> int:
    """The seed of one sample's augmentation (a 63-bit integer).

    Args:
        seed: the run's seed.
        rank: the process's rank.
        epoch: the epoch.
        position: the batch's position in the epoch (counting from the epoch's first batch).
        row: the sample's row in its batch.
    """
    z = _mix64(int(seed) & _MASK64)
    for value in (rank, epoch, position, row):
        z = _chain(z, value)
    return z >> 1


def _mix64_array(z: np.ndarray) -> np.ndarray:
    """:func:`_mix64` on a uint64 array (numpy's uint64 arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _chain(z: int, value: int) -> int:
    """One link of the seed's hash chain: ``value`` mixed into the state ``z``."""
    return _mix64(z ^ ((int(value) + _GOLDEN) & _MASK64))


def batch_seeds(seed: int, rank: int, epoch: int, position: int, rows: int) -> np.ndarray:
    """The seeds of a batch's ``rows`` samples, :func:`sample_seed` of rows 0..rows-1 (int64).

    The chain over (seed, rank, epoch, position) is hashed once per batch and its last link,
    the row, for all rows at once in numpy: about 15 us a batch instead of 5 us a sample.

    Args:
        seed, rank, epoch, position: as for :func:`sample_seed`.
        rows: the batch's size.
    """
    z = _mix64(int(seed) & _MASK64)
    for value in (rank, epoch, position):
        z = _chain(z, value)
    links = (np.arange(rows, dtype=np.uint64) + np.uint64(_GOLDEN)) ^ np.uint64(z)  # (rows,)
    return (_mix64_array(links) >> np.uint64(1)).astype(np.int64)  # 63 bits: fits int64


class SeededBatches:
    """Batches of ``(index, seed)``: each index of ``batch_sampler`` with its sample's seed.

    Args:
        batch_sampler: yields lists of dataset indices, the same order on every iteration of
            an epoch.
        seed: the run's seed.
        rank: this process's rank.
        epoch_of: the object whose ``epoch`` attribute is the current epoch (the sampler, or
            the triplet list); default ``batch_sampler``.
    """

    def __init__(self, batch_sampler, seed: int, rank: int = 0, epoch_of=None):
        self.batch_sampler, self.seed, self.rank = batch_sampler, int(seed), int(rank)
        self.epoch_of = batch_sampler if epoch_of is None else epoch_of

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        epoch = int(getattr(self.epoch_of, "epoch", 0))
        for position, batch in enumerate(self.batch_sampler):
            seeds = batch_seeds(self.seed, self.rank, epoch, position, len(batch)).tolist()
            yield [(int(index), seed) for index, seed in zip(batch, seeds)]


class SeededSamples(Dataset):
    """``dataset[index]`` drawn with torch's CPU generator seeded by the item's seed.

    The generator's state outside the call is left as it was (the main process's stream, or
    the worker's, does not move).

    Args:
        dataset: the dataset to wrap (``samples``, ``classes``, ... stay reachable through
            ``.dataset``).
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        return self.__getitems__([item])[0]

    def __getitems__(self, items: list[tuple[int, int]]) -> list:
        """A batch's samples, each drawn under its own seed (the DataLoader calls this once
        per batch, so the generator's state is saved and restored once, not per sample).

        Args:
            items: ``(index, seed)`` pairs.
        """
        generator = torch.default_generator  # the CPU generator the transforms draw from
        state = generator.get_state()  # ~2 us with the reseed (fork_rng costs ~75 us)
        try:
            samples = []
            for index, seed in items:
                generator.manual_seed(seed)
                samples.append(self.dataset[index])
            return samples
        finally:
            generator.set_state(state)


def seed_worker(worker_id: int) -> None:
    """Give a DataLoader worker its own numpy and ``random`` streams; leave signals to the parent.

    torch seeds each worker differently (base seed + worker id) but leaves numpy's and Python's
    global generators as forked, so without this every worker would draw the same numbers.

    A terminal's Ctrl-C sends SIGINT to every process of the job. A worker that died of it
    would fail the training loop's next fetch before the loop could finish its step and write
    a checkpoint, so workers ignore SIGINT: the main process stops them. (SIGTERM keeps its
    default: the loader ends stuck workers with it.)

    Args:
        worker_id: the worker's number (unused: torch's initial seed already differs).
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)
    if torch.utils.data.get_worker_info() is not None:  # never in the main process
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def available_cpus() -> int:
    """The CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def default_num_workers(device_type: str, local_processes: int = 1) -> int:
    """Loader workers for ``data.num_workers: auto``: one per core the step leaves free.

    Each of the ``local_processes`` training processes on this machine gets an equal share of
    its cores. On a GPU the training process needs one core to drive it; on the CPU the step
    uses ``torch.get_num_threads()`` cores. A worker only overlaps loading with the step when
    it has a core of its own; otherwise it would take time from the step, so 0 (load in the
    training process). At most 8.

    Args:
        device_type: "cuda" or "cpu", where the step runs.
        local_processes: training processes on this machine (torchrun's LOCAL_WORLD_SIZE).
    """
    cores = available_cpus() // max(1, local_processes)
    busy = 1 if device_type == "cuda" else torch.get_num_threads()
    return max(0, min(_MAX_AUTO_WORKERS, cores - busy))


def default_pin_memory(device_type: str) -> bool:
    """``data.pin_memory: auto``: page-locked batches when they go to a GPU (the copy is then
    asynchronous, so the next step's input moves while the current step runs), else not.

    Args:
        device_type: "cuda" or "cpu", where the step runs.
    """
    return device_type == "cuda"


def resolve_loader_settings(
    num_workers: int | str, pin_memory: bool | str, device_type: str
) -> tuple[int, bool]:
    """``(num_workers, pin_memory)`` with "auto" replaced by the machine's defaults.

    Args:
        num_workers: a count, or "auto" (:func:`default_num_workers`; the training processes
            of this machine are torchrun's ``LOCAL_WORLD_SIZE``).
        pin_memory: a bool, or "auto" (:func:`default_pin_memory`).
        device_type: "cuda" or "cpu", where the step runs.
    """
    if num_workers == "auto":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        num_workers = default_num_workers(device_type, local)
    if pin_memory == "auto":
        pin_memory = default_pin_memory(device_type)
    return int(num_workers), bool(pin_memory)


def make_loader(
    dataset: Dataset,
    batch_sampler: Iterable[list[int]],
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    rank: int = 0,
    epoch_of=None,
    collate_fn: Callable | None = None,
    persistent_workers: bool = True,
) -> DataLoader:
    """A DataLoader over ``dataset`` with batches from ``batch_sampler``, every sample seeded.

    Args:
        dataset: indexed by the sampler's indices.
        batch_sampler: yields lists of indices (e.g. :class:`~facenet.data.PKSampler`).
        num_workers: loader processes; 0 loads in the main process.
        pin_memory: page-locked host memory for faster, asynchronous copies to the GPU.
        seed: the run's seed: with the rank, the epoch and the position, each sample's seed.
        rank: this process's rank.
        epoch_of: where the current epoch is read (see :class:`SeededBatches`).
        collate_fn: forms a batch from its samples; default
            :func:`~facenet.data.batches.collate_batches` (pending crops are cropped and
            flipped per batch, everything else as torch's default collate).
        persistent_workers: workers start once, not every epoch (they keep their decoded
            cache). False for a dataset that changes per epoch in the main process (a triplet
            list): persistent workers would keep the first epoch's copy.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: expected >= 0")
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        SeededSamples(dataset),
        batch_sampler=SeededBatches(batch_sampler, seed, rank, epoch_of),
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=seed_worker,
        generator=generator,
        persistent_workers=persistent_workers and num_workers > 0,
        collate_fn=collate_batches if collate_fn is None else collate_fn,
        prefetch_factor=_PREFETCH_FACTOR if num_workers > 0 else None,
    )


def batch_to_device(batch, device: torch.device):
    """Every tensor of a batch (a tensor, or nested tuples/lists) on ``device``, copied with
    ``non_blocking=True`` (asynchronous from pinned memory); anything else as it is.

    Args:
        batch: what a loader yields.
        device: the destination.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(batch_to_device(item, device) for item in batch)
    return batch


def _record_on(batch, stream) -> None:
    """Tell the caching allocator that ``stream`` uses the batch's device tensors, so their
    memory (allocated on the copy stream) is not reused before the step has read it."""
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for item in batch:
            _record_on(item, stream)


def prefetch_to_device(loader: Iterable, device: torch.device):
    """The loader's batches, on a CUDA ``device`` already: batch n+1's host-to-device copy is
    issued on a side stream while step n runs, so the GPU never waits for an input copy.

    The copy of batch n+1 starts as soon as batch n is handed out (its copy done: the compute
    stream waits on the side stream), so the loader is read one batch ahead. On any other
    device the batches are passed through untouched (the step moves them).

    Args:
        loader: yields batches (tensors, or tuples/lists of them); pinned memory (the
            loader's ``pin_memory``) makes the copies truly asynchronous.
        device: where the step runs.
    """
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
        _record_on(pending, compute)
        batch, pending = pending, issue_next()
        yield batch


def count_images(batch) -> int:
    """The number of images in a batch: the leading size of every 4-D tensor in it.

    Args:
        batch: a tensor, or a tuple/list such as ``(images, labels)`` or
            ``(img_a, img_p, img_n, label_p, label_n)``.
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim == 4 else 0
    if isinstance(batch, (list, tuple)):
        return sum(count_images(item) for item in batch)
    return 0


def measure_throughput(loader: Iterable, max_batches: int) -> float:
    """Images per second delivered by ``loader``.

    The first batch (worker start-up) is not timed when more than one batch is read.

    Args:
        loader: yields batches (see :func:`count_images`).
        max_batches: read at most this many batches.
    """
    if max_batches < 1:
        raise ValueError(f"max_batches={max_batches}: expected >= 1")
    first_images, images, batches = 0, 0, 0
    started = timed_from = time.perf_counter()
    for batch in loader:
        batches += 1
        if batches == 1:
            first_images = count_images(batch)
            timed_from = time.perf_counter()  # start-up excluded
        else:
            images += count_images(batch)
        if batches >= max_batches:
            break
    if batches <= 1:  # a single batch: nothing to time but the start-up
        images, timed_from = first_images, started
    if images == 0:
        raise ValueError("measure_throughput: the loader gave no images (no 4-D tensors)")
    return images / max(time.perf_counter() - timed_from, 1e-9)
