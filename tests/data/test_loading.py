"""Per-sample seeding: a sample's augmentation draws the same numbers with any number of
workers, and a resumed epoch draws what the uninterrupted one drew."""

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from facenet.data.loading import (
    batch_seeds,
    batch_to_device,
    make_loader,
    prefetch_to_device,
)
from facenet.training.state import remaining_loader


class Draws(Dataset):
    """Item i: (i, a random draw from torch's generator), like an augmentation."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor(index), torch.rand(3)


class Batches:
    """A fixed batch order per epoch (as PKSampler's), with an ``epoch`` attribute."""

    epoch = 1

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        order = torch.randperm(64, generator=generator).tolist()
        return iter([order[i : i + 8] for i in range(0, 64, 8)])

    def __len__(self):
        return 8


def epoch_batches(loader):
    return [torch.cat([b[0][:, None].float(), b[1]], dim=1) for b in loader]


def test_workers_do_not_change_what_a_sample_draws():
    by_workers = {
        n: epoch_batches(make_loader(Draws(), Batches(), num_workers=n, seed=5)) for n in (0, 2)
    }
    assert all(torch.equal(a, b) for a, b in zip(by_workers[0], by_workers[2]))


def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew():
    loader = make_loader(Draws(), Batches(), num_workers=0, seed=5)
    whole = epoch_batches(loader)
    torch.rand(100)  # the global stream moved on meanwhile: it must not matter
    rest = epoch_batches(
        remaining_loader(make_loader(Draws(), Batches(), num_workers=2, seed=5), 3)
    )
    assert len(rest) == 5 and all(torch.equal(a, b) for a, b in zip(whole[3:], rest))


def test_seeds_differ_by_rank_epoch_position_and_row_and_leave_the_global_stream_alone():
    seeds = {
        int(seed)
        for r in (0, 1)
        for e in (1, 2)
        for p in (0, 1)
        for seed in batch_seeds(0, r, e, p, 2)
    }
    assert len(seeds) == 16
    state = torch.get_rng_state()
    epoch_batches(make_loader(Draws(), Batches(), num_workers=0, seed=5))
    assert torch.equal(torch.get_rng_state(), state)


def sample_seed(seed, rank, epoch, position, row):
    """A sample's seed from a batch just long enough to hold it."""
    return int(batch_seeds(seed, rank, epoch, position, row + 1)[row])


def test_batch_seeds_equal_the_per_sample_seeds():
    generator = np.random.default_rng(0)
    for _ in range(300):
        run, rank, epoch, position = (int(generator.integers(0, 2**63)) for _ in range(4))
        rows = int(generator.integers(1, 80))
        expected = [sample_seed(run, rank, epoch, position, row) for row in range(rows)]
        assert batch_seeds(run, rank, epoch, position, rows).tolist() == expected
    assert batch_seeds(1, 0, 2, 3, 4).tolist() == [sample_seed(1, 0, 2, 3, r) for r in range(4)]


def test_prefetch_to_device_passes_cpu_batches_through_untouched():
    batches = [(torch.arange(4), [torch.ones(2), "name"]), (torch.zeros(3), [torch.ones(1), "x"])]
    out = list(prefetch_to_device(batches, torch.device("cpu")))
    assert len(out) == 2 and all(a is b for a, b in zip(out, batches))


def test_batch_to_device_moves_every_tensor_and_keeps_the_structure():
    batch = (torch.arange(3), [torch.ones(2), "label"], 7)
    moved = batch_to_device(batch, torch.device("meta"))
    assert isinstance(moved, tuple) and isinstance(moved[1], list)
    assert moved[0].device.type == "meta" and moved[1][0].device.type == "meta"
    assert moved[1][1] == "label" and moved[2] == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefetch_to_device_copies_ahead_on_cuda():
    reads = []

    def loader():
        for i in range(4):
            reads.append(i)
            yield torch.full((2, 3), i, dtype=torch.uint8).pin_memory(), torch.tensor([i])

    device = torch.device("cuda")
    for i, (images, labels) in enumerate(prefetch_to_device(loader(), device)):
        assert images.is_cuda and labels.is_cuda
        assert reads == list(range(min(i + 2, 4)))  # batch i+1 already read (and copying)
        assert torch.equal(images.cpu(), torch.full((2, 3), i, dtype=torch.uint8))
