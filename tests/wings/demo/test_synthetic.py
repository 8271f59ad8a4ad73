"""SyntheticIdentities: determinism, disjoint held-out identities, files, pairs, hardness."""

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.linear_model import RidgeClassifier
from sklearn.metrics import roc_auc_score

from facenet.cli import make_synthetic as make_synthetic_script
from facenet.config import DataConfig
from facenet.data.folder import IdentityFolder
from facenet.data.images import read_image
from facenet.data.pairs import read_pairs
from facenet.errors import ConfigError, DataError
from facenet.wings.demo import synthetic
from facenet.wings.demo.synthetic import (
    SyntheticIdentities,
    prepare_synthetic_data,
    sample_nuisance,
)

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def small_config(**overrides):
    values = dict(
        image_size=16,
        synthetic_identities=6,
        synthetic_images_per_identity=3,
        synthetic_heldout_identities=10,
        synthetic_heldout_images_per_identity=4,
        synthetic_pairs_per_fold=2,
        synthetic_seed=0,
    )
    values.update(overrides)
    return DataConfig(**values)


# ----------------------------------------------------------------------------- the dataset


def test_items_are_uint8_images_with_identity_labels():
    ds = SyntheticIdentities(3, 4, image_size=20)
    assert len(ds) == 12
    assert ds.targets == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    image, label = ds[5]
    assert image.dtype == torch.uint8 and image.shape == (3, 20, 20)
    assert label == 1
    assert ds.classes == ["id00000", "id00001", "id00002"]
    with pytest.raises(IndexError):
        ds[12]


def test_deterministic_per_seed_whatever_the_order_of_access():
    a = SyntheticIdentities(4, 3, image_size=16, seed=7)
    b = SyntheticIdentities(4, 3, image_size=16, seed=7)
    forward = [a[i][0] for i in range(len(a))]
    backward = [b[i][0] for i in reversed(range(len(b)))][::-1]
    for x, y in zip(forward, backward):
        assert torch.equal(x, y)
    other_seed = SyntheticIdentities(4, 3, image_size=16, seed=8)
    assert not torch.equal(forward[0], other_seed[0][0])


def test_images_of_one_identity_differ():
    ds = SyntheticIdentities(1, 6, image_size=16)
    images = [ds[i][0] for i in range(6)]
    for i in range(6):
        for j in range(i + 1, 6):
            assert not torch.equal(images[i], images[j])


def test_identity_offset_numbers_identities_globally():
    whole = SyntheticIdentities(6, 2, image_size=16, seed=1)
    tail = SyntheticIdentities(3, 2, image_size=16, seed=1, identity_offset=3)
    assert tail.classes == whole.classes[3:]
    for label in range(3):
        assert torch.equal(tail.image(label, 1), whole.image(label + 3, 1))


def test_heldout_identities_are_disjoint_from_training_ones():
    train = SyntheticIdentities(20, 1, seed=0)
    heldout = SyntheticIdentities(10, 1, seed=0, identity_offset=20)
    assert not set(train.classes) & set(heldout.classes)
    train_templates = {train.template(j) for j in range(20)}
    heldout_templates = {heldout.template(j) for j in range(10)}
    assert len(train_templates) == 20 and len(heldout_templates) == 10
    assert not train_templates & heldout_templates


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_identities=0"):
        SyntheticIdentities(0, 3)
    with pytest.raises(ValueError, match="image_size=-4"):
        SyntheticIdentities(2, 3, image_size=-4)


def test_write_to_disk_uses_the_lfw_layout_losslessly(tmp_path):
    ds = SyntheticIdentities(2, 3, image_size=16, identity_offset=10)
    written = ds.write_to_disk(tmp_path)
    assert written == {
        "id00010": ["id00010_0001.png", "id00010_0002.png", "id00010_0003.png"],
        "id00011": ["id00011_0001.png", "id00011_0002.png", "id00011_0003.png"],
    }
    assert torch.equal(read_image(tmp_path / "id00011" / "id00011_0002.png"), ds.image(1, 1))


def test_pose_nuisance_stays_within_its_bounds_and_occluders_are_occasional():
    draws = 2000
    nuisances = [sample_nuisance(np.random.default_rng(i)) for i in range(draws)]
    rotation = np.array([n.rotation for n in nuisances])
    scale = np.array([n.scale for n in nuisances])
    shift = np.array([n.shift for n in nuisances])  # (N, 2)
    yaw = np.array([n.yaw for n in nuisances])
    assert np.abs(rotation).max() <= synthetic.MAX_ROTATION
    assert np.std(rotation) == pytest.approx(synthetic.ROTATION_STD, rel=0.15)
    low, high = synthetic.SCALE_RANGE
    assert low <= scale.min() and scale.max() <= high
    assert np.abs(shift).max() <= synthetic.MAX_SHIFT
    assert np.abs(yaw).max() <= synthetic.MAX_YAW
    # Every range is used, not just respected: the extremes come within 5 % of the bounds.
    assert np.abs(yaw).max() >= 0.95 * synthetic.MAX_YAW
    assert scale.max() - scale.min() >= 0.95 * (high - low)
    occluded = np.mean([n.occluder is not None for n in nuisances])
    p = synthetic.OCCLUDER_PROBABILITY
    assert abs(occluded - p) <= 4 * np.sqrt(p * (1 - p) / draws), occluded


# ----------------------------------------------------------------------------- on disk


def test_prepare_writes_train_heldout_and_balanced_pairs(tmp_path):
    cfg = small_config()
    out = prepare_synthetic_data(tmp_path, cfg)
    assert out == {
        "train_root": str(tmp_path / "train"),
        "heldout_root": str(tmp_path / "heldout"),
        "val_pairs": str(tmp_path / "heldout" / "val_pairs.txt"),
        "test_pairs": str(tmp_path / "heldout" / "test_pairs.txt"),
    }
    train = IdentityFolder(out["train_root"])
    heldout = IdentityFolder(out["heldout_root"])
    assert len(train.classes) == 6 and len(train) == 18
    assert len(heldout.classes) == 10 and len(heldout) == 40
    assert not set(train.classes) & set(heldout.classes)
    identities = {}
    for split in ("val_pairs", "test_pairs"):
        pairs = read_pairs(out[split])
        assert pairs.n_folds == 10 and pairs.pairs_per_fold == 2
        same_per_fold = np.bincount(pairs.fold_ids, weights=pairs.issame, minlength=10)
        assert (same_per_fold == 2).all() and len(pairs) == 40  # balanced in every fold
        for path in pairs.paths1 + pairs.paths2:
            assert os.path.dirname(os.path.dirname(path)) == out["heldout_root"]
        identities[split] = {
            os.path.basename(os.path.dirname(p)) for p in pairs.paths1 + pairs.paths2
        }
    # Validation and test: identity-disjoint halves of the held-out identities.
    assert not identities["val_pairs"] & identities["test_pairs"]
    assert len(identities["val_pairs"] | identities["test_pairs"]) == 10


def test_prepare_deals_identities_to_disjoint_folds_when_it_can(tmp_path):
    cfg = small_config(synthetic_heldout_identities=40, synthetic_heldout_images_per_identity=4)
    out = prepare_synthetic_data(tmp_path, cfg)
    pairs = read_pairs(out["test_pairs"])
    identity = lambda path: os.path.basename(os.path.dirname(path))
    folds_of = {}
    for path1, path2, fold in zip(pairs.paths1, pairs.paths2, pairs.fold_ids):
        for path in (path1, path2):
            folds_of.setdefault(identity(path), set()).add(int(fold))
    assert all(len(folds) == 1 for folds in folds_of.values())


def test_prepare_reuses_matching_data_and_regenerates_on_change(tmp_path):
    cfg = small_config()
    out = prepare_synthetic_data(tmp_path, cfg)
    probe = tmp_path / "train" / "id00000" / "id00000_0001.png"
    stamp = probe.stat().st_mtime_ns
    prepare_synthetic_data(tmp_path, cfg)
    assert probe.stat().st_mtime_ns == stamp  # nothing rewritten
    changed = small_config(synthetic_images_per_identity=2)
    prepare_synthetic_data(tmp_path, changed)
    assert len(IdentityFolder(out["train_root"])) == 12
    (tmp_path / "heldout" / "id00006" / "id00006_0001.png").unlink()  # damaged: rewritten
    prepare_synthetic_data(tmp_path, changed)
    assert (tmp_path / "heldout" / "id00006" / "id00006_0001.png").is_file()


def test_prepare_says_how_far_each_part_is_and_writes_the_same_bytes(tmp_path, capsys):
    cfg = small_config(synthetic_identities=20)
    prepare_synthetic_data(tmp_path / "data", cfg)
    lines = capsys.readouterr().err.splitlines()
    train, heldout = tmp_path / "data" / "train", tmp_path / "data" / "heldout"
    assert lines == [f"{train}: {2 * n}/20 identities written" for n in range(1, 11)] + [
        f"{heldout}: {n}/10 identities written" for n in range(1, 11)
    ]
    prepare_synthetic_data(tmp_path / "data", cfg)  # complete: nothing written, nothing said
    assert capsys.readouterr().err == ""
    # The lines change nothing in the images: the same bytes as written without them.
    quiet = SyntheticIdentities(20, 3, image_size=16, seed=0).write_to_disk(tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    for name, files in quiet.items():
        for file in files:
            assert (tmp_path / "quiet" / name / file).read_bytes() == (
                train / name / file
            ).read_bytes()


def test_prepare_refuses_to_overwrite_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "train" / "someone").mkdir(parents=True)
    (tmp_path / "train" / "someone" / "photo.png").write_bytes(b"data")
    with pytest.raises(ValueError, match="not written by prepare_synthetic_data"):
        prepare_synthetic_data(tmp_path, small_config())
    assert (tmp_path / "train" / "someone" / "photo.png").is_file()


def user_folders(root):
    """A user's train/ and heldout/ folders under ``root``; returns their files."""
    files = [root / "train" / "alice" / "a.png", root / "heldout" / "bob" / "b.png"]
    for file in files:
        file.parent.mkdir(parents=True)
        file.write_bytes(b"the user's photo")
    return files


@pytest.mark.parametrize(
    "manifest", ["", "{}", "[]", '{"train": {}, "heldout": {}}', "\xff", "[" * 100_000]
)
def test_a_manifest_not_written_here_is_refused_and_nothing_is_removed(tmp_path, manifest):
    files = user_folders(tmp_path)
    (tmp_path / "manifest.json").write_text(manifest, encoding="latin-1")
    with pytest.raises(DataError, match="manifest.json: not written by prepare_synthetic_data"):
        prepare_synthetic_data(tmp_path, small_config())
    assert all(f.read_bytes() == b"the user's photo" for f in files)
    assert (tmp_path / "manifest.json").read_text(encoding="latin-1") == manifest


@pytest.mark.parametrize(
    ("added", "named"),
    [
        ("train/alice/a.png", "train/alice"),  # a folder the manifest does not list
        ("train/id00000/notes.txt", None),  # a file in a listed folder
        ("heldout/id00006/id00006_0099.png", None),  # an image number past its count
        ("heldout/id00006/id00006_1.png", None),  # a number written otherwise
        ("train/id00099/id00099_0001.png", "train/id00099"),  # an identity past its count
        ("heldout/id00000/id00000_0001.png", "heldout/id00000"),  # a training identity
        ("train/.hidden", None),
    ],
)
def test_a_file_the_manifest_does_not_list_keeps_both_folders(tmp_path, added, named):
    prepare_synthetic_data(tmp_path, small_config())
    (tmp_path / added).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / added).write_bytes(b"the user's")
    with pytest.raises(DataError, match=f"{named or added}: not written by prepare_synthetic"):
        prepare_synthetic_data(tmp_path, small_config(synthetic_images_per_identity=2))
    assert (tmp_path / added).read_bytes() == b"the user's"
    ours = [p for p in tmp_path.glob("*/id*/*.png") if p != tmp_path / added]
    assert len(ours) == 6 * 3 + 10 * 4  # nothing removed


def test_a_link_in_the_folders_is_refused_and_its_target_kept(tmp_path):
    prepare_synthetic_data(tmp_path, small_config())
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.png").write_bytes(b"the user's")
    link = tmp_path / "train" / "id00000" / "id00000_0001.png"
    link.unlink()
    link.symlink_to(tmp_path / "photos" / "a.png")
    (tmp_path / "heldout").rename(tmp_path / "elsewhere")
    (tmp_path / "heldout").symlink_to(tmp_path / "photos")
    for cfg in (small_config(synthetic_seed=1), small_config()):
        with pytest.raises(DataError, match="not written by prepare_synthetic_data"):
            prepare_synthetic_data(tmp_path, cfg)
        link.unlink()
        link.write_bytes(b"")  # the link gone: the heldout/ link is refused still
    assert (tmp_path / "photos" / "a.png").read_bytes() == b"the user's"


def test_a_fifo_named_manifest_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "manifest.json")
    with pytest.raises(DataError, match="manifest.json: not written by prepare_synthetic_data"):
        prepare_synthetic_data(tmp_path, small_config())
    assert not (tmp_path / "train").exists()


def test_sizes_too_small_for_the_pairs_are_refused_before_anything_is_removed(tmp_path):
    prepare_synthetic_data(tmp_path, small_config())
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="synthetic_pairs_per_fold"):
        prepare_synthetic_data(tmp_path, small_config(synthetic_pairs_per_fold=1000))
    assert sorted(tmp_path.rglob("*")) == before
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is True


def test_its_own_folders_with_a_training_index_and_a_temporary_file_are_rewritten(tmp_path):
    out = prepare_synthetic_data(tmp_path, small_config())
    IdentityFolder(out["train_root"])  # writes train/.facenet_index.json
    (tmp_path / "heldout" / ".val_pairs.txt.123.tmp").write_text("cut short by a crash")
    prepare_synthetic_data(tmp_path, small_config(synthetic_images_per_identity=2))
    assert len(IdentityFolder(out["train_root"])) == 12
    assert not (tmp_path / "heldout" / ".val_pairs.txt.123.tmp").exists()


# ----------------------------------------------------------------------------- hardness


class TwoConvNet(nn.Module):
    """A throwaway embedding network: two convolutions, global pooling, a linear layer."""

    def __init__(self, width=16, dim=32):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 5, padding=2)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(width), nn.BatchNorm2d(2 * width)
        self.embed = nn.Linear(2 * width, dim)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)  # (B, W, S/2, S/2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)  # (B, 2W, S/4, S/4)
        return self.embed(x.mean(dim=(2, 3)))  # (B, D)


class FourConvNet(nn.Module):
    """A small embedding network for the training check: four conv blocks, global pooling."""

    def __init__(self, width=24, dim=64):
        super().__init__()
        channels = [3, width, 2 * width, 4 * width, 4 * width]
        blocks = []
        for c_in, c_out in zip(channels[:-1], channels[1:]):
            blocks += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            blocks.append(nn.MaxPool2d(2) if c_out != channels[-1] else nn.Identity())
        self.features = nn.Sequential(*blocks)  # (B, 4W, S/8, S/8)
        self.embed = nn.Linear(4 * width, dim)

    def forward(self, x):
        return self.embed(self.features(x).mean(dim=(2, 3)))  # (B, D)


def as_batch(ds):
    images = torch.stack([ds[i][0] for i in range(len(ds))])  # (N, 3, S, S) uint8
    return (images.float() - 127.5) / 128.0, torch.tensor(ds.targets)


def verification_pairs(labels, seed=0):
    """Every same pair and as many random different pairs: (M, 2) indices, (M,) is-same."""
    labels = labels.numpy()
    same = [(i, j) for i in range(len(labels)) for j in range(i + 1, len(labels))]
    same = [pair for pair in same if labels[pair[0]] == labels[pair[1]]]
    rng = np.random.default_rng(seed)
    different = []
    while len(different) < len(same):
        i, j = rng.integers(0, len(labels), 2)
        if labels[i] != labels[j]:
            different.append((i, j))
    issame = np.r_[np.ones(len(same)), np.zeros(len(different))]
    return np.array(same + different), issame


@torch.no_grad()
def pair_auc(net, images, pairs, issame):
    """AUC of the negative squared L2 distance between normalised embeddings."""
    net.eval()
    emb = F.normalize(net(images), dim=1)  # (N, D)
    dist = ((emb[pairs[:, 0]] - emb[pairs[:, 1]]) ** 2).sum(dim=1)  # (M,)
    return roc_auc_score(issame, -dist.numpy())


def test_untrained_network_is_near_chance_on_heldout_pairs():
    images, labels = as_batch(SyntheticIdentities(40, 6, image_size=32, identity_offset=1000))
    pairs, issame = verification_pairs(labels)
    aucs = []
    for seed in range(3):
        torch.manual_seed(seed)
        aucs.append(pair_auc(TwoConvNet(), images, pairs, issame))
    assert all(0.4 <= auc <= 0.7 for auc in aucs), aucs
    assert np.mean(aucs) <= 0.65, aucs


def ridge_probe_accuracy(ds, aligned, train_images):
    """Closed-set identification by a linear probe on standardised raw pixels."""
    rows, labels = [], []
    for label in range(ds.num_identities):
        for i in range(ds.images_per_identity):
            pixels = ds.image(label, i, aligned=aligned).float()
            rows.append(((pixels - pixels.mean()) / (pixels.std() + 1e-3)).flatten())
            labels.append(label)
    x, y = torch.stack(rows).numpy(), np.array(labels)
    train = np.tile(np.arange(ds.images_per_identity) < train_images, ds.num_identities)
    probe = RidgeClassifier(alpha=100.0).fit(x[train], y[train])
    return probe.score(x[~train], y[~train])


def test_identity_is_in_the_pixels_once_pose_is_removed():
    ds = SyntheticIdentities(10, 20, image_size=32, seed=0)
    chance = 1 / ds.num_identities
    aligned = ridge_probe_accuracy(ds, aligned=True, train_images=15)
    unaligned = ridge_probe_accuracy(ds, aligned=False, train_images=15)
    assert aligned >= 5 * chance, aligned  # the structure is consistent per identity
    assert aligned > unaligned  # and pose is a real nuisance


def test_identity_is_not_readable_from_global_colour():
    # Per-image mean and spread of each channel: every colour is redrawn per image, so a
    # probe on them identifies no better than chance (1 / 10).
    ds = SyntheticIdentities(10, 20, image_size=32, seed=0)
    rows, labels = [], []
    for label in range(ds.num_identities):
        for i in range(ds.images_per_identity):
            pixels = ds.image(label, i).float() / 255.0  # (3, S, S)
            rows.append(torch.cat([pixels.mean(dim=(1, 2)), pixels.std(dim=(1, 2))]).numpy())
            labels.append(label)
    x, y = np.stack(rows), np.array(labels)
    train = np.tile(np.arange(ds.images_per_identity) < 15, ds.num_identities)
    probe = RidgeClassifier(alpha=1.0).fit(x[train], y[train])
    assert probe.score(x[~train], y[~train]) <= 2.5 / ds.num_identities


def test_raw_pixel_distance_is_near_chance_on_heldout_pairs():
    # No shortcut in the pixels themselves: standardised images compared directly.
    images, labels = as_batch(SyntheticIdentities(40, 6, image_size=32, identity_offset=1000))
    pairs, issame = verification_pairs(labels)
    flat = images.flatten(1)
    flat = (flat - flat.mean(dim=1, keepdim=True)) / flat.std(dim=1, keepdim=True)  # (N, 3S²)
    dist = ((flat[pairs[:, 0]] - flat[pairs[:, 1]]) ** 2).sum(dim=1)  # (M,)
    assert roc_auc_score(issame, -dist.numpy()) <= 0.65


@pytest.mark.slow
def test_short_cpu_training_clearly_learns_heldout_verification():
    torch.manual_seed(0)
    train_x, train_y = as_batch(SyntheticIdentities(40, 20, image_size=32, seed=0))
    test_x, test_y = as_batch(SyntheticIdentities(30, 6, image_size=32, identity_offset=40))
    pairs, issame = verification_pairs(test_y)
    net = FourConvNet(width=24, dim=64)
    classifier = nn.Linear(64, 40)
    before = pair_auc(net, test_x, pairs, issame)
    optimizer = torch.optim.Adam([*net.parameters(), *classifier.parameters()], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    net.train()
    for _ in range(200):
        batch = torch.randint(0, len(train_x), (64,), generator=generator)
        x = train_x[batch]
        x = torch.where(torch.rand(64, 1, 1, 1, generator=generator) < 0.5, x, x.flip(3))
        loss = F.cross_entropy(classifier(net(x)), train_y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    after = pair_auc(net, test_x, pairs, issame)
    print(f"held-out AUC before {before:.3f}, after 200 steps {after:.3f}")
    assert after >= 0.7 and after - before >= 0.15, (before, after)


@pytest.mark.slow
def test_demo_config_meets_its_target(tmp_path):
    # configs/demo.yaml as `make train` runs it, from an empty data folder: near chance before
    # training, at least 0.90 held-out accuracy after (about 2 minutes on 2 quiet cores).
    root = Path(__file__).resolve().parents[3]
    command = [
        sys.executable,
        str(root / "scripts" / "train.py"),
        "--config",
        str(root / "configs" / "demo.yaml"),
        "--out",
        str(tmp_path / "run"),
        "--set",
        f"data.root={tmp_path / 'data'}",
        "--set",
        "logging.progress=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # no spin-waiting threads on shared cores
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before = summary["before_training"]["validation"]["accuracy_mean"]
    after = summary["test"]["best"]["accuracy_mean"]  # best.pt, chosen on validation
    print(f"demo: validation {before:.4f} before training; test {after:.4f} in {seconds:.0f} s")
    assert before <= 0.65 and after >= 0.90, (before, after)


def test_make_train_says_it_installs_before_its_silent_install(tmp_path):
    # `make -n`: the commands a fresh checkout runs, printed, not run (VENV: none there yet).
    if shutil.which("make") is None:
        pytest.skip("no make")
    root = Path(__file__).resolve().parents[3]
    argv = ["make", "--no-print-directory", "-n", "train", f"VENV={tmp_path / 'venv'}"]
    # Run from `make test` too: the outer make's level and flags are not this one's.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == 'echo "installing the environment (once, about 3-4 minutes)..."'


# ----------------------------------------------------------------------------- the script


SMALL_SETTINGS = [
    "--set",
    "data.image_size=16",
    "--set",
    "data.synthetic_identities=3",
    "--set",
    "data.synthetic_images_per_identity=2",
    "--set",
    "data.synthetic_heldout_identities=8",
    "--set",
    "data.synthetic_heldout_images_per_identity=3",
    "--set",
    "data.synthetic_pairs_per_fold=1",
]


def test_script_writes_the_data_set_and_a_preview(tmp_path, capsys):
    main = make_synthetic_script.main
    out = tmp_path / "synthetic"
    preview = tmp_path / "preview.png"
    assert main([str(out), *SMALL_SETTINGS, "--preview", str(preview)]) == 0
    assert len(IdentityFolder(out / "train")) == 6
    assert read_pairs(out / "heldout" / "test_pairs.txt").n_folds == 10
    assert read_image(preview).shape == (3, 8 * 18 + 2, 8 * 18 + 2)
    captured = capsys.readouterr()
    assert "heldout" in captured.out
    assert captured.err.splitlines()[-1] == f"{out / 'heldout'}: 8/8 identities written"


def test_script_preview_of_a_non_square_input_is_drawn_at_the_faces_side(tmp_path):
    preview = tmp_path / "preview.png"
    settings = [*SMALL_SETTINGS, "--set", "data.image_size=[16,12]", "--preview", str(preview)]
    assert make_synthetic_script.main([str(tmp_path / "synthetic"), *settings]) == 0
    assert read_image(preview).shape == (3, 8 * 18 + 2, 8 * 18 + 2)


def test_script_replaces_an_existing_preview_only_with_overwrite(tmp_path, capsys):
    preview = tmp_path / "mine.png"
    preview.write_bytes(b"the user's own")
    argv = [str(tmp_path / "synthetic"), *SMALL_SETTINGS, "--preview", str(preview)]
    assert make_synthetic_script.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {preview} exists") and len(err.splitlines()) == 1
    assert preview.read_bytes() == b"the user's own" and not (tmp_path / "synthetic").exists()
    assert make_synthetic_script.main([*argv, "--overwrite"]) == 0
    assert read_image(preview).shape == (3, 8 * 18 + 2, 8 * 18 + 2)


@pytest.mark.parametrize("inside", ["train/id00000/zz.png", "zz.png", "."])
def test_script_refuses_a_preview_inside_the_data_set(tmp_path, capsys, inside):
    out = tmp_path / "synthetic"
    argv = [str(out), *SMALL_SETTINGS, "--preview", str(out / inside)]
    assert make_synthetic_script.main(argv) == 2
    err = capsys.readouterr().err
    assert f"lies inside OUT {out}" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_script_reports_a_bad_key_with_exit_code_2(tmp_path, capsys):
    main = make_synthetic_script.main
    assert main([str(tmp_path), "--set", "data.synthetic_faces=3"]) == 2
    assert "synthetic_faces" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("data.synthetic_identities=0", "data.synthetic_identities"),
        ("data.image_size=-4", "data.image_size"),
        ("data.synthetic_heldout_identities=1", "data.synthetic_heldout_identities"),
    ],
)
def test_script_reports_unusable_sizes_on_one_line_with_exit_code_2(tmp_path, capsys, setting, key):
    main = make_synthetic_script.main
    assert main([str(tmp_path / "out"), *SMALL_SETTINGS, "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and key in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_script_refuses_a_foreign_manifest_or_too_few_pairs_keeping_every_file(tmp_path, capsys):
    main = make_synthetic_script.main
    assert main([str(tmp_path), *SMALL_SETTINGS]) == 0
    capsys.readouterr()  # the progress lines of the first writing
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main([str(tmp_path), *SMALL_SETTINGS, "--set", "data.synthetic_pairs_per_fold=999"]) == 2
    (tmp_path / "manifest.json").write_text("")
    assert main([str(tmp_path), *SMALL_SETTINGS, "--set", "data.synthetic_seed=1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert "synthetic_pairs_per_fold" in err[0] and "manifest.json: not written" in err[1]
    assert len(err) == 2 and {p: p.read_bytes() for p in before} == {
        **before,
        tmp_path / "manifest.json": b"",
    }


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG, as a full disk fails them with ENOSPC
    (Python ignores SIGXFSZ, so the write returns the error)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_write_that_fails_part_way_is_an_error_and_the_set_is_not_complete(tmp_path):
    cfg = small_config(image_size=32)  # PNGs of about 2.5 KB; the manifest and pairs are < 1.5 KB
    with file_size_limit(1536), pytest.raises(OSError) as err:
        prepare_synthetic_data(tmp_path, cfg)
    assert str(err.value.filename).endswith(".png")  # the file that could not be written
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is False
    out = prepare_synthetic_data(tmp_path, cfg)  # the next call writes the set again, whole
    assert all(
        read_image(p).shape == (3, 32, 32) for p, _ in IdentityFolder(out["train_root"]).samples
    )


def test_a_complete_set_with_an_empty_file_is_written_again(tmp_path):
    out = prepare_synthetic_data(tmp_path, small_config())
    victim = sorted(Path(out["train_root"]).glob("*/*.png"))[0]
    victim.write_bytes(b"")  # what torchvision's write_png left on a full disk
    prepare_synthetic_data(tmp_path, small_config())
    assert read_image(victim).shape == (3, 16, 16)


def test_script_preview_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys):
    main = make_synthetic_script.main
    preview = tmp_path / "no_such_folder" / "preview.png"
    assert main([str(tmp_path / "data"), *SMALL_SETTINGS, "--preview", str(preview)]) == 2
    err = capsys.readouterr().err
    *progress, error = err.splitlines()  # the data set was written first
    assert all(line.endswith(" identities written") for line in progress)
    assert error.startswith("error: cannot write the preview") and "Traceback" not in err
