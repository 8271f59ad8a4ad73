"""DataLoader construction with seeded workers, and a throughput measurement."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["seed_worker", "make_loader", "measure_throughput", "count_images"]


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
) -> DataLoader:
    """A DataLoader over ``dataset`` with batches from ``batch_sampler``, reproducibly seeded.

    Args:
        dataset: indexed by the sampler's indices.
        batch_sampler: yields lists of indices (e.g. :class:`~facenet.data.PKSampler`).
        num_workers: loader processes; 0 loads in the main process. With workers they are
            persistent, so they start once, not every epoch.
        pin_memory: page-locked host memory for faster, asynchronous copies to the GPU.
        seed: seeds the loader's generator, from which each worker's torch seed derives.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers}: expected >= 0")
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
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
