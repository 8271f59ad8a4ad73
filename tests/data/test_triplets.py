"""TripletListDataset: valid triplets, every identity and image drawn, seeding, items."""

import time

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from facenet.data.triplets import TripletListDataset, generate_triplets

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def uneven_labels(seed=0):
    """Eight identities with 1 to 6 images, shuffled; identity 7 (the last) has 2."""
    counts = [3, 1, 6, 2, 4, 5, 1, 2]
    labels = np.repeat(np.arange(len(counts)), counts)
    return np.random.default_rng(seed).permutation(labels)


def check_valid(triplets, labels):
    a, p, n = np.asarray(triplets).T
    assert (a != p).all(), "anchor and positive must be different images"
    assert (labels[a] == labels[p]).all()
    assert (labels[a] != labels[n]).all()
    assert (labels[a] >= 0).all() and (labels[n] >= 0).all()


def test_triplets_are_valid_on_random_labels():
    for seed in range(5):
        labels = np.random.default_rng(seed).integers(0, 12, 80)
        triplets = generate_triplets(labels, 2000, np.random.default_rng(seed))
        assert triplets.shape == (2000, 3)
        check_valid(triplets, labels)


def test_every_identity_and_image_is_drawn_including_the_last():
    labels = uneven_labels()
    ds = TripletListDataset(labels, num_triplets=20000, seed=0)
    a, p, n = ds.triplets.numpy().T
    counts = np.bincount(labels)
    can_anchor = np.flatnonzero(counts >= 2)
    assert set(labels[a]) == set(can_anchor)  # the last identity (7) included
    assert set(labels[n]) == set(range(len(counts)))  # every identity as a negative
    images_of_anchor_identities = set(np.flatnonzero(counts[labels] >= 2))
    assert set(a) == images_of_anchor_identities  # every image, the last of each included
    assert set(p) == images_of_anchor_identities
    assert set(n) == set(range(len(labels)))
    for identity in range(len(counts)):
        last_image = np.flatnonzero(labels == identity).max()
        assert last_image in set(n)


def seed_style_triplets(labels, num_triplets, rng):
    """The original generator's draws, with its exclusive upper bounds (the off-by-one)."""
    classes = np.unique(labels)
    by_class = {c: np.flatnonzero(labels == c) for c in classes}
    rows = []
    for _ in range(num_triplets):
        pos_class = rng.integers(0, len(classes) - 1)
        while len(by_class[classes[pos_class]]) < 2:
            pos_class = rng.integers(0, len(classes) - 1)
        images = by_class[classes[pos_class]]
        ianc, ipos = rng.integers(0, len(images) - 1), rng.integers(0, len(images) - 1)
        rows.append((images[ianc], images[ipos]))
    return np.array(rows)


def test_the_coverage_check_catches_the_seed_off_by_one():
    labels = uneven_labels()
    old = seed_style_triplets(labels, 3000, np.random.default_rng(0))
    assert 7 not in set(labels[old[:, 0]])  # the last identity is never an anchor
    new = generate_triplets(labels, 3000, np.random.default_rng(0))
    assert 7 in set(labels[new[:, 0]])


def test_anchor_identities_and_images_are_uniform():
    labels = np.repeat(np.arange(5), [2, 3, 4, 5, 10])
    triplets = generate_triplets(labels, 50000, np.random.default_rng(1))
    a, p, n = triplets.T
    anchor_ids = np.bincount(labels[a], minlength=5)
    expected = 50000 / 5
    assert np.abs(anchor_ids - expected).max() < 5 * np.sqrt(expected)
    last = labels == 4  # 10 images: each is the anchor about 1/10 of identity 4's triplets
    per_image = np.bincount(a[last[a]], minlength=len(labels))[last]
    assert np.abs(per_image - per_image.mean()).max() < 5 * np.sqrt(per_image.mean())


def test_negative_labels_are_never_drawn():
    labels = uneven_labels()
    labels[labels == 2] = -1
    triplets = generate_triplets(labels, 5000, np.random.default_rng(0))
    check_valid(triplets, labels)
    assert not np.isin(triplets, np.flatnonzero(labels < 0)).any()


def test_seeded_and_regenerated_per_epoch():
    labels = uneven_labels()
    a = TripletListDataset(labels, 500, seed=3)
    b = TripletListDataset(labels, 500, seed=3)
    assert torch.equal(a.triplets, b.triplets)
    epoch0 = a.triplets.clone()
    a.set_epoch(1)
    assert not torch.equal(a.triplets, epoch0)
    check_valid(a.triplets, labels)
    a.set_epoch(0)
    assert torch.equal(a.triplets, epoch0)
    assert not torch.equal(TripletListDataset(labels, 500, seed=4).triplets, epoch0)


def test_a_million_triplets_take_about_a_second():
    labels = np.repeat(np.arange(10000), 30)
    start = time.perf_counter()
    ds = TripletListDataset(labels, 1_000_000)
    elapsed = time.perf_counter() - start
    assert ds.triplets.shape == (1_000_000, 3) and ds.triplets.dtype == torch.int64
    assert elapsed < 3.0, f"{elapsed:.2f}s for a million triplets"


def test_index_items_without_images():
    labels = uneven_labels()
    ds = TripletListDataset(labels, 10)
    a, p, n, label_p, label_n = ds[4]
    assert [a, p, n] == ds.triplets[4].tolist()
    assert label_p == labels[p] and label_n == labels[n]
    assert len(ds) == 10


def test_items_over_a_dataset_are_its_images():
    labels = torch.tensor(uneven_labels())
    images = torch.arange(len(labels)).float().view(-1, 1, 1, 1).expand(-1, 3, 2, 2)
    ds = TripletListDataset(labels, 50, dataset=TensorDataset(images, labels))
    for i in range(len(ds)):
        img_a, img_p, img_n, label_p, label_n = ds[i]
        a, p, n = ds.triplets[i].tolist()
        assert torch.equal(img_a, images[a]) and torch.equal(img_p, images[p])
        assert torch.equal(img_n, images[n])
        assert (label_p, label_n) == (labels[p].item(), labels[n].item())


def test_impossible_or_inconsistent_input_is_named():
    with pytest.raises(ValueError, match="at least 2 images"):
        TripletListDataset([0, 1, 2], 10)
    with pytest.raises(ValueError, match="at least 2 images"):
        TripletListDataset([0, 0, 0], 10)  # no second identity for negatives
    with pytest.raises(ValueError, match="num_triplets=0"):
        TripletListDataset([0, 0, 1], 0)
    with pytest.raises(ValueError, match="2 items but labels has 3"):
        TripletListDataset([0, 0, 1], 5, dataset=TensorDataset(torch.zeros(2)))
