"""PKSampler (P x K batches, coverage, determinism, ranks, resume) and the loader functions."""

import math
import random
import time

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, TensorDataset, get_worker_info

from facenet.data.loading import count_images, make_loader, measure_throughput, seed_worker
from facenet.data.samplers import PKSampler


def random_labels(n_identities, low, high, seed=0):
    """Shuffled labels: identity i has between low and high images."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(low, high + 1, n_identities)
    labels = np.repeat(np.arange(n_identities), counts)
    return rng.permutation(labels)


def expected_length(labels, p, k, world_size=1):
    """About one look at every image, at least one pass over the identities."""
    drawable = labels[labels >= 0]
    one_pass = math.ceil(len(np.unique(drawable)) / p)
    one_look = math.ceil(len(drawable) / (p * k))
    return math.ceil(max(one_pass, one_look) / world_size)


def check_batch(batch, labels, p, k):
    """P distinct identities x K images, identity-major; distinct images when enough exist."""
    assert len(batch) == p * k
    grid = labels[np.asarray(batch)].reshape(p, k)  # (P, K)
    assert (grid == grid[:, :1]).all(), "each row of K images must be one identity"
    assert len(set(grid[:, 0])) == p, "the P identities must be distinct"
    counts = np.bincount(labels[labels >= 0])
    for row, identity in zip(np.asarray(batch).reshape(p, k), grid[:, 0]):
        expected_distinct = min(k, counts[identity])
        assert len(set(row.tolist())) == expected_distinct


def test_hand_case_two_identities():
    labels = np.array([0, 0, 1, 1])
    batches = list(PKSampler(labels, p=2, k=2))
    assert len(batches) == 1
    batch = batches[0]
    assert sorted(batch) == [0, 1, 2, 3]
    assert labels[batch[0]] == labels[batch[1]] != labels[batch[2]] == labels[batch[3]]


@settings(max_examples=30, deadline=None)
@given(
    n_identities=st.integers(2, 30),
    p=st.integers(2, 6),
    k=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_batches_are_p_by_k_and_an_epoch_covers_every_identity(n_identities, p, k, seed):
    assume(p <= n_identities)
    labels = random_labels(n_identities, 1, 8, seed=seed)
    assume(p * k <= len(labels))
    sampler = PKSampler(labels, p, k, seed=seed)
    batches = list(sampler)
    assert len(batches) == len(sampler) == expected_length(labels, p, k)
    for batch in batches:
        check_batch(batch, labels, p, k)
    first_pass = batches[: math.ceil(n_identities / p)]
    seen = {labels[i] for batch in first_pass for i in batch}
    assert seen == set(range(n_identities))


def test_identity_with_fewer_than_k_images_gives_all_of_them_with_repeats():
    labels = np.array([0] * 2 + [1] * 6 + [2] * 6)
    sampler = PKSampler(labels, p=3, k=4, with_replacement=True)
    rows = np.concatenate([np.asarray(batch).reshape(3, 4) for batch in sampler])
    small = [row for row in rows if labels[row[0]] == 0]
    assert len(small) == len(sampler)  # P = 3 of 3 identities: in every batch
    assert all(set(row.tolist()) == {0, 1} for row in small)


def test_without_replacement_small_identities_are_left_out():
    labels = np.array([0] * 2 + [1] * 4 + [2] * 4 + [3] * 5)
    sampler = PKSampler(labels, p=2, k=4, with_replacement=False)
    assert sampler.num_identities == 3
    drawn = {labels[i] for _ in range(5) for batch in sampler for i in batch}
    assert drawn == {1, 2, 3}


def test_negative_labels_are_never_drawn():
    labels = random_labels(10, 2, 6)
    labels[labels == 3] = -1
    labels[::7] = -1
    sampler = PKSampler(labels, p=3, k=2)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for batch in sampler:
            assert (labels[batch] >= 0).all()


def test_order_is_a_function_of_seed_and_epoch():
    labels = random_labels(20, 2, 9)
    a, b = PKSampler(labels, 4, 3, seed=5), PKSampler(labels, 4, 3, seed=5)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating again repeats the epoch
    epoch0 = list(a)
    a.set_epoch(1)
    assert list(a) != epoch0
    a.set_epoch(0)
    assert list(a) == epoch0
    assert list(PKSampler(labels, 4, 3, seed=6)) != epoch0


def test_images_of_large_identities_vary_across_epochs():
    labels = np.repeat(np.arange(4), 10)
    sampler = PKSampler(labels, 2, 2)
    drawn = set()
    for epoch in range(40):
        sampler.set_epoch(epoch)
        drawn |= {i for batch in sampler for i in batch}
    assert drawn == set(range(40))  # every image, including each identity's last one


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_equal_shares_covering_every_identity(world_size):
    labels = random_labels(23, 2, 7, seed=1)
    p, k = 3, 2
    samplers = [
        PKSampler(labels, p, k, seed=3, rank=r, world_size=world_size) for r in range(world_size)
    ]
    shares = [list(s) for s in samplers]
    assert len({len(s) for s in samplers}) == 1
    assert all(len(share) == len(samplers[0]) for share in shares)
    per_pass = math.ceil(23 / p)
    assert len(samplers[0]) == expected_length(labels, p, k, world_size)
    # Rebuild the global order: batch j of rank r is global batch j * world_size + r.
    ordered = [shares[g % world_size][g // world_size] for g in range(per_pass)]
    first_pass = [labels[i] for batch in ordered[: per_pass - 1] for i in batch[::k]]
    assert len(first_pass) == len(set(first_pass)), "identities repeat across ranks in a pass"
    seen = {labels[i] for share in shares for batch in share for i in batch}
    assert seen == set(range(23))
    as_tuples = [tuple(batch) for share in shares for batch in share]
    assert len(as_tuples) == len(set(as_tuples))
    for share in shares:
        for batch in share:
            check_batch(batch, labels, p, k)


def test_the_last_group_of_a_pass_is_completed_from_the_others():
    labels = np.repeat(np.arange(7), 3)
    sampler = PKSampler(labels, p=3, k=3)
    batches = list(sampler)
    assert [len(b) for b in batches] == [9, 9, 9]
    assert {labels[i] for b in batches for i in b} == set(range(7))


def test_epoch_length_follows_the_number_of_images():
    labels = np.repeat(np.arange(6), 20)  # 120 images, 6 identities
    sampler = PKSampler(labels, p=3, k=4)
    assert len(sampler) == len(list(sampler)) == 10  # 120 / 12, not 6 / 3


def test_batches_per_epoch_draws_more_passes():
    labels = np.repeat(np.arange(5), 3)
    sampler = PKSampler(labels, p=2, k=2, batches_per_epoch=7)
    batches = list(sampler)
    assert len(sampler) == len(batches) == 7
    for batch in batches:
        check_batch(batch, labels, 2, 2)
    first_pass = {labels[i] for b in batches[:3] for i in b}
    assert first_pass == set(range(5))


def test_state_dict_round_trip_resumes_the_same_epoch():
    labels = random_labels(12, 2, 5)
    sampler = PKSampler(labels, 3, 2, seed=11)
    sampler.set_epoch(7)
    state = sampler.state_dict()
    assert state == {"epoch": 7, "seed": 11}
    resumed = PKSampler(labels, 3, 2)
    resumed.load_state_dict(state)
    assert list(resumed) == list(sampler)
    with pytest.raises(KeyError, match="epoch"):
        resumed.load_state_dict({"seed": 1})


def test_too_large_p_names_the_real_constraint():
    labels = np.repeat(np.arange(3), 2)
    with pytest.raises(ValueError, match=r"P = 4 identities per batch, but only 3 identities"):
        PKSampler(labels, p=4, k=2)
    PKSampler(labels, p=3, k=4)  # K > images: resampled, as data.sample_with_replacement says
    with pytest.raises(ValueError, match="only 0 identities with at least K = 3 images"):
        PKSampler(np.repeat(np.arange(5), 2), p=2, k=3, with_replacement=False)


def test_bad_arguments_are_named():
    labels = np.repeat(np.arange(4), 2)
    with pytest.raises(ValueError, match="p=0"):
        PKSampler(labels, p=0, k=2)
    with pytest.raises(ValueError, match="rank=2"):
        PKSampler(labels, p=2, k=2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="integers"):
        PKSampler(np.array([0.5, 1.5]), p=1, k=1)


def test_works_as_a_dataloader_batch_sampler():
    labels = torch.arange(6).repeat_interleave(4)
    dataset = TensorDataset(torch.arange(24).float(), labels)
    loader = DataLoader(dataset, batch_sampler=PKSampler(labels, p=3, k=4))
    batches = list(loader)
    assert len(batches) == len(loader) == 2
    for values, batch_labels in batches:
        assert values.shape == (12,)
        assert torch.equal(batch_labels, labels[values.long()])


# ----------------------------------------------------------------------------- loading


class RandomDraws(Dataset):
    """Item i: (i, a torch draw, a numpy draw, a Python draw) from the loading process."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        info = get_worker_info()
        worker = -1 if info is None else info.id
        return i, worker, torch.rand(()), np.random.rand(), random.random()


def draws_by_worker(seed):
    labels = np.repeat(np.arange(4), 4)
    loader = make_loader(RandomDraws(), PKSampler(labels, 2, 2), num_workers=2, seed=seed)
    assert loader.persistent_workers and loader.worker_init_fn is seed_worker
    rows = []
    for index, worker, t, n, r in loader:
        rows += list(zip(index.tolist(), worker.tolist(), t.tolist(), n.tolist(), r.tolist()))
    return sorted(rows)


def test_workers_get_their_own_streams_reproducibly_from_the_seed():
    first, again, other = draws_by_worker(0), draws_by_worker(0), draws_by_worker(1)
    assert first == again
    assert [row[2:] for row in first] != [row[2:] for row in other]
    by_worker = {}
    for _, worker, t, n, r in first:
        by_worker.setdefault(worker, []).append((t, n, r))
    assert set(by_worker) == {0, 1}
    for stream in range(3):  # torch, numpy and random differ between the two workers
        assert {v[stream] for v in by_worker[0]}.isdisjoint({v[stream] for v in by_worker[1]})


def test_make_loader_in_process_yields_the_sampler_batches():
    labels = torch.arange(5).repeat_interleave(3)
    sampler = PKSampler(labels, p=2, k=3)
    dataset = TensorDataset(torch.arange(15), labels)
    loader = make_loader(dataset, sampler, pin_memory=False)
    assert not loader.persistent_workers
    assert [values.tolist() for values, _ in loader] == list(sampler)
    with pytest.raises(ValueError, match="num_workers=-1"):
        make_loader(dataset, sampler, num_workers=-1)


def test_count_images_counts_every_image_tensor():
    images = torch.zeros(4, 3, 8, 8)
    labels = torch.zeros(4)
    assert count_images((images, labels)) == 4
    assert count_images((images, images, images, labels, labels)) == 12
    assert count_images(labels) == 0


def slow_batches(first_delay, delay, n, batch_size=8):
    """Batches of 8 images after a sleep: a loader whose speed is known."""
    for i in range(n):
        time.sleep(first_delay if i == 0 else delay)
        yield torch.zeros(batch_size, 3, 2, 2), torch.zeros(batch_size)


def test_throughput_is_bounded_by_the_loader_speed_and_skips_start_up():
    rate = measure_throughput(slow_batches(0.5, 0.02, 100), max_batches=6)
    assert rate <= 8 / 0.02 * 1.05  # cannot beat the sleeps
    assert rate >= 8 / 0.02 / 3  # the slow first batch is not timed
    single = measure_throughput(slow_batches(0.05, 0.0, 1), max_batches=5)
    assert single <= 8 / 0.05 * 1.05
    with pytest.raises(ValueError, match="max_batches=0"):
        measure_throughput(slow_batches(0, 0, 1), max_batches=0)
