"""DataLoader construction with per-sample seeding, and a throughput measurement.

Augmentation draws from torch's random generator. Which process draws a sample, and in what
order, depends on ``num_workers``; where an interrupted epoch resumes, the workers start again.
So every sample is drawn with its own seed, a function of (run seed, rank, epoch, batch position
in the epoch, row in the batch): :class:`SeededBatches` attaches it to each index and
:class:`SeededSamples` draws the sample under it. A resumed epoch, on any number of workers
and ranks' restarts, then draws exactly what the uninterrupted epoch drew.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "SeededBatches",
    "SeededSamples",
    "sample_seed",
    "seed_worker",
    "make_loader",
    "measure_throughput",
    "count_images",
]


_MASK64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers that scatters every bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_seed(seed: int, rank: int, epoch: int, position: int, row: int) -> int:
    """The seed of one sample's augmentation (a 63-bit integer), about 1 us to compute.

    Args:
        seed: the run's seed.
        rank: the process's rank.
        epoch: the epoch.
        position: the batch's position in the epoch (counting from the epoch's first batch).
        row: the sample's row in its batch.
    """
    z = _mix64(int(seed) & _MASK64)
    for value in (rank, epoch, position, row):
        z = _mix64(z ^ ((int(value) + 0x9E3779B97F4A7C15) & _MASK64))
    return z >> 1


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
            yield [
                (int(index), sample_seed(self.seed, self.rank, epoch, position, row))
                for row, index in enumerate(batch)
            ]


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
        index, seed = item
        generator = torch.default_generator  # the CPU generator the transforms draw from
        state = generator.get_state()  # ~2 us with the reseed (fork_rng costs ~75 us)
        generator.manual_seed(seed)
        try:
            return self.dataset[index]
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


def make_loader(
    dataset: Dataset,
    batch_sampler: Iterable[list[int]],
    num_workers: int = 0,
    pin_memory: bool = False,
    seed: int = 0,
    rank: int = 0,
    epoch_of=None,
) -> DataLoader:
    """A DataLoader over ``dataset`` with batches from ``batch_sampler``, every sample seeded.

    Args:
        dataset: indexed by the sampler's indices.
        batch_sampler: yields lists of indices (e.g. :class:`~facenet.data.PKSampler`).
        num_workers: loader processes; 0 loads in the main process. With workers they are
            persistent, so they start once, not every epoch.
        pin_memory: page-locked host memory for faster, asynchronous copies to the GPU.
        seed: the run's seed: with the rank, the epoch and the position, each sample's seed.
        rank: this process's rank.
        epoch_of: where the current epoch is read (see :class:`SeededBatches`).
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
        persistent_workers=num_workers > 0,
    )


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
