"""Per-sample seeding: a sample's augmentation draws the same numbers with any number of
workers, and a resumed epoch draws what the uninterrupted one drew."""

import torch
from torch.utils.data import Dataset

from facenet.data.loading import make_loader, sample_seed
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
        sample_seed(0, r, e, p, w) for r in (0, 1) for e in (1, 2) for p in (0, 1) for w in (0, 1)
    }
    assert len(seeds) == 16
    state = torch.get_rng_state()
    epoch_batches(make_loader(Draws(), Batches(), num_workers=0, seed=5))
    assert torch.equal(torch.get_rng_state(), state)
