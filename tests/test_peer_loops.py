"""benchmarks.peer_loops: each peer's selection rule on hand-computed cases, its loss reaching
every parameter of the network, one step of each setup on tiny synthetic identity folders."""

import argparse
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_bench_real_faces import SMALL, folders  # noqa: F401 (the module's fixture)

from benchmarks import bench_real_faces as bench
from benchmarks import peer_loops as peers
from facenet.errors import ConfigError
from facenet.models.embedding import CosineClassifier
from facenet.training.build import build_data

# Sized for 8 training identities of 6 images (the fixture's 12 less 4 held out).
TINY = peers.PeerSettings(
    people_per_batch=3,
    images_per_person=4,
    sandberg_batch=12,
    identities_per_batch=4,
    triplets_per_batch=6,
)


def test_sandberg_select_triplets_by_hand():
    # Two people x 3 images on a line; squared distances, alpha 0.2.
    x = np.array([0.0, 0.1, 0.5, 0.3, 1.0, 2.0])[:, None]  # (6, 1): A = 0-2, B = 3-5
    got = peers.select_triplets(x, [3, 3], 2, 0.2, np.random.RandomState(7))
    # A: (0,1): neg - pos = 0.09-0.01 < 0.2 only for 3; (0,2): 0.09-0.25 (closer than the
    # positive: kept by his VGG Face rule), 1-0.25 no; (1,2): 0.04-0.16 only for 3.
    # B: every pair's positive is farther than every negative: all of 0, 1, 2 qualify.
    replay = np.random.RandomState(7)
    drawn = [replay.randint(3) for _ in range(3)]  # his one randint per pair, in pair order
    expected = [(0, 1, 3), (0, 2, 3), (1, 2, 3), (3, 4, drawn[0]), (3, 5, drawn[1])]
    expected.append((4, 5, drawn[2]))
    replay.shuffle(expected)  # then his shuffle of the whole list
    assert [tuple(map(int, t)) for t in got] == expected


def test_sandberg_select_triplets_leaves_out_pairs_without_a_negative_and_later_people():
    x = np.array([0.0, 0.0, 5.0, 5.0, 9.0, 9.1])[:, None]  # (6, 1): 3 people x 2
    # Only the first people_per_batch=2 people anchor (the rest are negatives only); A's pair
    # (distance 0) has no negative within 0.2, nor has B's.
    assert peers.select_triplets(x, [2, 2, 2], 2, 0.2, np.random.RandomState(0)) == []
    # alpha 20: A's negatives are 25 and more away, none; B's are C's (16, 16.81) but not A's
    # (25); C's pair would find B's, but C is not among the first two people.
    got = peers.select_triplets(x, [2, 2, 2], 2, 20.0, np.random.RandomState(0))
    assert len(got) == 1 and tuple(got[0][:2]) == (2, 3) and got[0][2] in (4, 5)


def test_sandberg_sample_people_fills_the_images_identity_by_identity():
    classes = [np.array([0]), np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8])]
    for seed in range(5):
        images, counts = peers.sample_people(classes, 2, 2, np.random.RandomState(seed))
        assert len(images) == 4 and sum(counts) == 4 and max(counts) <= 2
        start = 0
        for count in counts:  # each group is one identity's distinct images
            group = images[start : start + count]
            owners = {next(c for c, members in enumerate(classes) if i in members) for i in group}
            assert len(owners) == 1 and len(set(group)) == count
            start += count


def test_sandberg_loss_by_hand():
    e = torch.tensor([[0, 0], [0.1, 0], [0.3, 0], [0, 0], [1, 0], [0, 0.5], [0, 0], [0, 0], [1, 0]])
    # 0.01 - 0.09 + 0.2 = 0.12; 1 - 0.25 + 0.2 = 0.95; 0 - 1 + 0.2 < 0: 0.
    assert peers.sandberg_loss(e, 0.2).item() == pytest.approx((0.12 + 0.95 + 0) / 3)


def test_tamerthamoqa_selection_rule_by_hand():
    pos, neg = torch.tensor([0.1, 0.5, 0.3]), torch.tensor([0.2, 0.4, 1.0])
    # neg - pos = 0.1, -0.1, 0.7: hard keeps the first two, semi-hard also needs pos < neg.
    assert peers.tamerthamoqa_valid(pos, neg, 0.2, False).tolist() == [True, True, False]
    assert peers.tamerthamoqa_valid(pos, neg, 0.2, True).tolist() == [True, False, False]


def test_tamerthamoqa_triplets_come_from_the_batch_identities():
    classes = [np.array([0]), np.array([1, 2]), np.array([3, 4, 5]), np.array([6, 7, 8, 9])]
    owner = {int(i): c for c, members in enumerate(classes) for i in members}
    batch = peers.generate_triplet_batch(classes, 3, 200, np.random.RandomState(1))
    again = peers.generate_triplet_batch(classes, 3, 200, np.random.RandomState(1))
    assert batch == again and len(batch) == 200
    assert len({owner[int(i)] for triplet in batch for i in triplet}) <= 3
    for a, p, n in batch:
        assert owner[a] == owner[p] != owner[n] and a != p and owner[a] != 0
    with pytest.raises(ConfigError, match="identities_per_batch"):
        peers.generate_triplet_batch(classes[:1] * 3, 2, 1, np.random.RandomState(0))


def test_peer_setting_parses_and_refuses():
    assert peers.peer_setting("sandberg_batch=12") == ("sandberg_batch", 12)
    assert peers.peer_setting("semihard=True") == ("semihard", True)
    assert peers.peer_setting("margin=0.5") == ("margin", 0.5)
    for bad in ("nope=1", "margin=nan", "pml_m=0", "pml_m=2.5", "semihard=yes", "margin"):
        with pytest.raises(argparse.ArgumentTypeError):
            peers.peer_setting(bad)


@pytest.fixture(scope="module")
def tiny(folders, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """The bench's configuration and data on the synthetic folders."""
    run_dir = tmp_path_factory.mktemp("run")
    args = SimpleNamespace(
        train_root=folders / "train", pairs=folders / "pairs.txt", lfw_root=folders / "lfw"
    )
    cfg = bench.load_configs(args, bench.SCRATCH_CONFIG, SMALL, run_dir)
    return cfg, build_data(cfg, run_dir), run_dir


@pytest.mark.parametrize("method", list(peers.PEERS))
def test_one_step_of_each_peer_reaches_every_parameter(tiny, method):
    cfg, data, run_dir = tiny
    torch.manual_seed(0)
    model, optimizer, step, peer_data, _ = peers.PEERS[method](cfg, data, run_dir, TINY)
    before = [p.detach().clone() for p in model.parameters()]
    peer_data.sampler.set_epoch(1)
    loss, images = step(next(iter(peer_data.loader)))
    assert np.isfinite(loss) and loss > 0 and images > 0
    for (name, p), old in zip(model.named_parameters(), before):
        assert p.grad is not None and p.grad.abs().sum() > 0, name  # the loss reached it
        assert not torch.equal(p.detach(), old), name  # and the step moved it


def test_sandberg_counts_the_embedded_images_once(tiny):
    cfg, data, run_dir = tiny
    torch.manual_seed(0)
    _, _, step, peer_data, _ = peers.setup_sandberg(cfg, data, run_dir, TINY)
    counts = [step(batch)[1] for batch in peer_data.loader]  # one round
    embedded = TINY.people_per_batch * TINY.images_per_person
    assert counts and counts[0] > embedded and sum(counts) % 3 == embedded % 3
    assert all(c <= TINY.sandberg_batch for c in counts[1:])


@pytest.mark.parametrize(
    "method, change, key",
    [
        ("sandberg", {"people_per_batch": 40}, "people_per_batch"),
        ("sandberg", {"sandberg_batch": 10}, "sandberg_batch"),
        ("tamerthamoqa", {"identities_per_batch": 9}, "identities_per_batch"),
        ("pml", {"pml_m": 3}, "pml_m"),
    ],
)
def test_a_setting_the_data_cannot_meet_is_a_config_error(tiny, method, change, key):
    cfg, data, run_dir = tiny
    settings = peers.PeerSettings(**{**TINY.__dict__, **change})
    with pytest.raises(ConfigError, match=key):
        peers.PEERS[method](cfg, data, run_dir, settings)


def test_every_setup_starts_from_the_same_network(tiny):
    cfg, data, run_dir = tiny
    states = {}
    for method, setup in bench.SETUPS.items():
        torch.manual_seed(0)  # as bench.train seeds each method
        states[method] = setup(cfg, data, run_dir, TINY)[0].state_dict()
    first = states["pml"]
    for method, state in states.items():  # a classifier where the loop trains one, beside
        assert set(first) <= set(state), method
        assert all(torch.equal(first[k], state[k]) for k in first), method


@pytest.mark.parametrize("ce", ["softmax", "cosface"])
def test_the_plain_loop_builds_the_configured_cross_entropy_head(tiny, ce):
    cfg, data, run_dir = tiny
    cfg = copy.deepcopy(cfg)
    cfg.loss.ce = ce
    torch.manual_seed(0)
    model, _, _, _, _ = bench.setup_plain(cfg, data, run_dir, TINY)
    assert isinstance(model.classifier, CosineClassifier) == (ce == "cosface")
