"""Batch-level augmentation: the augmented batch equals the per-sample transform under the
same per-sample seeds, through the loader too, with any number of workers; the decoded cache
stays within its limit."""

import pytest
import torch
from torchvision.transforms import v2

from facenet.data import IdentityFolder, PKSampler
from facenet.data.batches import (
    DecodedCache,
    TrainCrops,
    collate_batches,
    collate_crops,
    crop_and_flip,
    standardize,
)
from facenet.data.images import build_transform, cover_size, resize_to_cover
from facenet.data.loading import batch_seeds, make_loader, resolve_loader_settings
from facenet.wings.demo.synthetic import SyntheticIdentities

# Square crops as aligned faces are stored, and other sizes: each its own resize group.
SHAPES = [(32, 32)] * 5 + [(40, 30), (30, 41), (100, 100), (17, 60)]


def reference_and_batch(size, normalize="fixed", random_crop=True, hflip=True, seed=3):
    """(per-sample transform stacked, batch transform) on the same images and seeds."""
    reference = build_transform(size, True, normalize, hflip=hflip, random_crop=random_crop)
    crops = TrainCrops(size, random_crop=random_crop, hflip=hflip)
    generator = torch.Generator().manual_seed(seed)
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator) for h, w in SHAPES
    ]
    expected, pending = [], []
    for row, image in enumerate(images):
        seed_of_sample = int(batch_seeds(seed, 0, 1, 2, len(SHAPES))[row])
        torch.manual_seed(seed_of_sample)
        expected.append(reference(image))  # (3, S, S) float
        torch.manual_seed(seed_of_sample)
        pending.append(crops(image))
    return torch.stack(expected), standardize(collate_crops(pending), normalize)


@pytest.mark.parametrize("size", [8, 16, 32, 112])
@pytest.mark.parametrize("normalize", ["fixed", "imagenet"])
def test_the_augmented_batch_equals_the_per_sample_reference_with_the_same_seeds(size, normalize):
    expected, batch = reference_and_batch(size, normalize)
    assert batch.dtype == torch.float32 and batch.shape == (len(SHAPES), 3, size, size)
    assert torch.equal(batch, expected)


@pytest.mark.parametrize("random_crop, hflip", [(False, True), (True, False), (False, False)])
def test_centre_crops_and_no_flip_equal_the_reference_too(random_crop, hflip):
    expected, batch = reference_and_batch(16, random_crop=random_crop, hflip=hflip)
    assert torch.equal(batch, expected)


def test_crop_and_flip_is_slicing_and_mirroring():
    images = torch.arange(2 * 3 * 6 * 7, dtype=torch.int64).reshape(2, 3, 6, 7)  # (B, C, H, W)
    out = crop_and_flip(
        images, torch.tensor([1, 2]), torch.tensor([3, 0]), torch.tensor([False, True]), 4
    )
    assert torch.equal(out[0], images[0, :, 1:5, 3:7])
    assert torch.equal(out[1], images[1, :, 2:6, 0:4].flip(-1))


def test_square_resize_matches_torchvision():
    for height, width in SHAPES:
        image = torch.randint(0, 256, (3, height, width), dtype=torch.uint8)
        resized = v2.Resize(18, antialias=True)(image)
        assert cover_size(height, width, (18, 18)) == tuple(resized.shape[-2:])
        assert torch.equal(resize_to_cover(image, (18, 18)), resized)


def test_collate_leaves_other_samples_to_the_default_collate():
    crops = TrainCrops(8)
    image = torch.zeros(3, 9, 9, dtype=torch.uint8)
    images, labels = collate_batches([(crops(image), 1), (crops(image), 2)])
    assert images.shape == (2, 3, 8, 8) and images.dtype == torch.uint8
    assert labels.tolist() == [1, 2]
    floats, ints = collate_batches([(torch.ones(2), 1), (torch.zeros(2), 0)])
    assert floats.shape == (2, 2) and ints.tolist() == [1, 0]
    assert standardize(floats) is floats  # an already standardised batch passes through


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("faces")
    SyntheticIdentities(6, 4, image_size=20, seed=0).write_to_disk(root)
    return root


def loader_batches(folder, transform, workers, cache_bytes=0):
    dataset = IdentityFolder(folder, transform=transform, cache_bytes=cache_bytes)
    sampler = PKSampler(dataset.triplet_labels, 3, 2, seed=1)
    sampler.set_epoch(2)
    loader = make_loader(dataset, sampler, num_workers=workers, seed=7)
    return [(standardize(images), labels) for images, labels in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_the_per_sample_transforms_batches_with_any_workers(folder, workers):
    reference = loader_batches(folder, build_transform(16, train=True), 0)
    batched = loader_batches(folder, TrainCrops(16), workers, cache_bytes=2**20)
    assert len(batched) == len(reference) > 1
    for (images, labels), (expected, expected_labels) in zip(batched, reference):
        assert torch.equal(labels, expected_labels) and torch.equal(images, expected)


def test_the_decoded_cache_keeps_images_up_to_its_limit(folder):
    image = torch.zeros(3, 10, 10, dtype=torch.uint8)  # 300 bytes
    cache = DecodedCache(max_bytes=700)
    for index in range(4):
        cache.put(index, image)
    assert cache.bytes == 600 and sorted(cache.images) == [0, 1]
    assert cache.images.get(0) is image and cache.images.get(3) is None
    dataset = IdentityFolder(folder, transform=None, cache_bytes=3 * 20 * 20 * 3)
    first = [dataset[i][0] for i in range(len(dataset))]
    assert len(dataset.decoded.images) == 3  # three 20 px images fit
    assert all(torch.equal(a, dataset[i][0]) for i, a in enumerate(first))
    with pytest.raises(ValueError, match="max_bytes"):
        DecodedCache(-1)


def test_auto_loader_settings_follow_the_device_and_the_cores(monkeypatch):
    monkeypatch.setattr("facenet.data.loading.available_cpus", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_loader_settings("auto", "auto", "cuda") == (8, True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_loader_settings("auto", "auto", "cuda") == (3, True)
    monkeypatch.setattr("facenet.data.loading.available_cpus", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert resolve_loader_settings("auto", "auto", "cpu") == (1, False)  # a core for a worker
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert resolve_loader_settings("auto", "auto", "cpu") == (0, False)  # none left
    assert resolve_loader_settings(3, True, "cpu") == (3, True)  # given values are kept


@pytest.mark.parametrize("size", [(24, 20), [20, 24], (112, 96)])
@pytest.mark.parametrize("random_crop, hflip", [(True, True), (False, False)])
def test_non_square_batches_equal_the_per_sample_reference(size, random_crop, hflip):
    """[H, W]: the images (of every shape) resized to cover 1.125 x (H, W), then cropped H x W."""
    expected, batch = reference_and_batch(size, random_crop=random_crop, hflip=hflip)
    assert batch.shape == (len(SHAPES), 3, *size)  # (B, 3, H, W)
    assert torch.equal(batch, expected)


def test_a_prepared_non_square_image_is_not_resized_again():
    crops = TrainCrops((24, 20))
    image = torch.randint(0, 256, (3, 50, 40), dtype=torch.uint8)
    prepared = crops.prepare(image)
    # covers 1.125 x (24, 20) = (27, 22): the width needs the larger scale (22 / 40 > 27 / 50)
    assert tuple(prepared.shape[-2:]) == (27, 22)
    assert crops.prepare(prepared) is prepared


@pytest.mark.parametrize("extent_h, extent_w", [(36, 36), (36, 40), (40, 36), (32, 36), (36, 32)])
def test_draws_take_torchvisions_numbers_over_many_seeds(extent_h, extent_w):
    """TrainCrops.draw against the calls v2.RandomCrop and v2.RandomHorizontalFlip make."""
    crops, generator = TrainCrops(32), torch.default_generator
    for seed in range(0, 1000 * 7919, 7919):
        generator.manual_seed(seed)
        top = int(torch.randint(0, extent_h - 31, size=(1,))) if extent_h > 32 else 0
        left = int(torch.randint(0, extent_w - 31, size=(1,))) if extent_w > 32 else 0
        flip = bool(torch.rand(1) < 0.5)
        after = torch.rand(1)  # the stream is left where torchvision's calls leave it
        generator.manual_seed(seed)
        assert crops.draw(extent_h, extent_w) == (top, left, flip)
        assert torch.equal(torch.rand(1), after)
