"""Miners: hand-computed cases, brute-force triple loops, pytorch-metric-learning, the seed."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import miners as pml_miners

from facenet.config import MiningConfig
from facenet.metric import build_miner
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.distances import pairwise_distance
from facenet.metric.miners import SemiHardNegativeMiner, Triplets
from facenet.metric.triplet_margin_miner import TRIPLET_TYPES, TripletMarginMiner

METRICS = ("squared", "euclidean", "cosine")


# --------------------------------------------------------------------------- references


def as_set(triplets) -> set[tuple[int, int, int]]:
    a, p, n = (t.tolist() for t in triplets)
    assert len(a) == len(p) == len(n)
    return set(zip(a, p, n))


def passes(tm: float, margin: float, kind: str, strict: bool = False) -> bool:
    """pytorch-metric-learning's conditions on tm = d(a,n) - d(a,p) (strict: < m, >= m)."""
    within = tm < margin if strict else tm <= margin
    if kind == "all":
        return within
    if kind == "hard":
        return within and tm <= 0
    if kind == "semihard":
        return within and tm > 0
    return not within


def brute_force_triplets(dist, labels, margin, kind, strict=False) -> set[tuple[int, int, int]]:
    """Every valid (a, p, n) by a triple loop, kept if it passes the condition."""
    labels = labels.tolist()
    out = set()
    for a, p, n in itertools.product(range(len(labels)), repeat=3):
        if a == p or labels[a] != labels[p] or labels[a] == labels[n]:
            continue
        tm = float(dist[a, n]) - float(dist[a, p])
        if passes(tm, margin, kind, strict):
            out.add((a, p, n))
    return out


def brute_force_batch_hard(dist, labels) -> set[tuple[int, int, int]]:
    labels = labels.tolist()
    out = set()
    for a in range(len(labels)):
        pos = [j for j in range(len(labels)) if j != a and labels[j] == labels[a]]
        neg = [j for j in range(len(labels)) if labels[j] != labels[a]]
        if pos and neg:
            p = max(pos, key=lambda j: float(dist[a, j]))
            n = min(neg, key=lambda j: float(dist[a, j]))
            out.add((a, p, n))
    return out


def random_batch(num: int, ids: int, dim: int = 4, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(ids, dim, generator=gen, dtype=dtype)
    labels = torch.randint(0, ids, (num,), generator=gen)
    noise = 0.8 * torch.randn(num, dim, generator=gen, dtype=dtype)
    return centers[labels] + noise, labels


def pml_distance(metric: str):
    if metric == "squared":
        return pml_distances.LpDistance(normalize_embeddings=False, power=2)
    if metric == "euclidean":
        return pml_distances.LpDistance(normalize_embeddings=False)
    # PML's cosine is a similarity; d = 1 - s gives the same margins d(a,n) - d(a,p).
    return pml_distances.CosineSimilarity()


# --------------------------------------------------------------------------- hand-computed


# 1-D points: identity 0 at 0.0 and 0.1, identity 1 at 0.5 and 2.0; squared distances.
HAND_X = torch.tensor([[0.0], [0.1], [0.5], [2.0]], dtype=torch.float64)
HAND_Y = torch.tensor([0, 0, 1, 1])


def test_hand_computed_triplet_margin():
    # d(0,1)=0.01 d(0,2)=0.25 d(0,3)=4 | d(1,2)=0.16 d(1,3)=3.61 | d(2,3)=2.25
    # tm per triplet: (0,1,2) .24  (0,1,3) 3.99  (1,0,2) .15  (1,0,3) 3.6
    #                 (2,3,0) -2.0 (2,3,1) -2.09 (3,2,0) 1.75 (3,2,1) 1.36
    miner = lambda kind: set(  # noqa: E731
        as_set(TripletMarginMiner(0.2, kind)(HAND_X, HAND_Y))
    )
    assert miner("all") == {(1, 0, 2), (2, 3, 0), (2, 3, 1)}
    assert miner("hard") == {(2, 3, 0), (2, 3, 1)}
    assert miner("semihard") == {(1, 0, 2)}
    assert miner("easy") == {(0, 1, 2), (0, 1, 3), (1, 0, 3), (3, 2, 0), (3, 2, 1)}


def test_hand_computed_batch_hard_and_semihard():
    assert as_set(BatchHardMiner()(HAND_X, HAND_Y)) == {
        (0, 1, 2),
        (1, 0, 2),
        (2, 3, 1),
        (3, 2, 1),
    }
    # Bands (d(a,p), d(a,p) + 0.2): only (1, 0) has a negative in it (2 at 0.16).
    skip = SemiHardNegativeMiner(0.2, fallback="skip")(HAND_X, HAND_Y)
    assert as_set(skip) == {(1, 0, 2)}
    # With the fallback every pair takes its anchor's nearest negative.
    hardest = SemiHardNegativeMiner(0.2, fallback="hardest")(HAND_X, HAND_Y)
    assert as_set(hardest) == {(0, 1, 2), (1, 0, 2), (2, 3, 1), (3, 2, 1)}


# --------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("kind", TRIPLET_TYPES)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("margin", [0.0, 0.2, 1.0])
def test_triplet_margin_miner_matches_brute_force(kind, metric, margin):
    x, labels = random_batch(14, 3, seed=hash((kind, metric, margin)) % 1000)
    got = TripletMarginMiner(margin, kind, distance=metric)(x, labels)
    expected = brute_force_triplets(pairwise_distance(x, metric=metric), labels, margin, kind)
    assert as_set(got) == expected
    assert len(got.anchor) == len(expected)  # no duplicates


@pytest.mark.parametrize("step", [1, 4, 16])
def test_output_written_in_many_steps_is_complete(monkeypatch, step):
    # Large batches fill the output in steps of pairs; force small steps on a small batch.
    import facenet.metric.triplet_margin_miner as triplet_margin_miner

    monkeypatch.setattr(triplet_margin_miner, "_expand_step", lambda batch_size: step)
    x, labels = random_batch(14, 3, seed=61)
    got = TripletMarginMiner(1.0, "all")(x, labels)
    expected = brute_force_triplets(pairwise_distance(x), labels, 1.0, "all")
    pairs = int((labels[:, None] == labels).sum()) - len(labels)
    assert pairs > 2 * step  # several steps
    assert len(got.anchor) == len(expected) and as_set(got) == expected


@pytest.mark.parametrize("kind", TRIPLET_TYPES)
def test_strict_margin_on_exact_ties(kind):
    # 1-D points on a grid of 1/4: squared distances and their differences are exact, so
    # tm == m happens for real and strict and non-strict tests differ on those triplets.
    x = torch.tensor([[0.0], [0.5], [1.0], [1.5], [2.0], [0.25]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    dist = pairwise_distance(x)
    for strict in (False, True):
        got = TripletMarginMiner(0.75, kind, strict_margin=strict)(x, labels)
        assert as_set(got) == brute_force_triplets(dist, labels, 0.75, kind, strict)
    loose = as_set(TripletMarginMiner(0.75, kind)(x, labels))
    assert loose != as_set(TripletMarginMiner(0.75, kind, strict_margin=True)(x, labels)) or (
        kind == "hard"
    )


@pytest.mark.parametrize("metric", METRICS)
def test_batch_hard_matches_brute_force(metric):
    x, labels = random_batch(16, 4, seed=5)
    got = BatchHardMiner(distance=metric)(x, labels)
    assert as_set(got) == brute_force_batch_hard(pairwise_distance(x, metric=metric), labels)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("fallback", ["hardest", "skip"])
@pytest.mark.parametrize("margin", [0.2, 1.0])
def test_semihard_negatives_are_in_band_or_fallback(metric, fallback, margin):
    x, labels = random_batch(16, 3, seed=7)
    dist = pairwise_distance(x, metric=metric)
    got = SemiHardNegativeMiner(margin, metric, fallback, generator=torch.Generator())(x, labels)
    pairs = [(a, p) for a, p in itertools.permutations(range(16), 2) if labels[a] == labels[p]]
    by_pair = {(a, p): n for a, p, n in as_set(got)}
    assert len(by_pair) == len(got.anchor)  # one negative per pair
    for a, p in pairs:
        negatives = [n for n in range(16) if labels[n] != labels[a]]
        band = [n for n in negatives if dist[a, p] < dist[a, n] < dist[a, p] + margin]
        if band:
            assert by_pair[(a, p)] in band
        elif fallback == "hardest" and negatives:
            assert by_pair[(a, p)] == min(negatives, key=lambda n: float(dist[a, n]))
        else:
            assert (a, p) not in by_pair
    assert set(by_pair) <= set(pairs)


def test_semihard_draw_is_uniform_over_the_band():
    # Anchor 0 and positive 1 at distance 1; four negatives inside the band, one outside.
    x = torch.tensor([[0.0], [1.0], [1.01], [-1.02], [1.03], [-1.04], [5.0]])
    labels = torch.tensor([0, 0, 1, 1, 1, 1, 1])
    gen = torch.Generator().manual_seed(0)
    miner = SemiHardNegativeMiner(margin=0.2, distance="euclidean", generator=gen)
    draws = 2000
    counts = dict.fromkeys(range(2, 6), 0)
    for _ in range(draws):
        t = miner(x, labels)
        first = (t.anchor == 0).nonzero()[0, 0]
        counts[int(t.negative[first])] += 1
    # Each of the four is drawn 500 times on average; 5 standard deviations is ~97.
    assert all(abs(c - draws / 4) < 100 for c in counts.values()), counts


def test_semihard_is_reproducible_with_a_seeded_generator():
    x, labels = random_batch(40, 4, seed=9)
    mine = lambda seed: SemiHardNegativeMiner(  # noqa: E731
        margin=4.0, generator=torch.Generator().manual_seed(seed)
    )(x, labels)
    first, again, other = mine(3), mine(3), mine(4)
    assert all(torch.equal(u, v) for u, v in zip(first, again))
    assert not torch.equal(first.negative, other.negative)


# --------------------------------------------------------------------------- PML 2.9.0


@pytest.mark.parametrize("kind", ["all", "hard", "semihard", "easy"])
@pytest.mark.parametrize("metric", METRICS)
def test_triplet_margin_miner_equals_pml(kind, metric):
    x, labels = random_batch(48, 6, dim=8, seed=11)
    ours = TripletMarginMiner(0.3, kind, distance=metric)(x, labels)
    theirs = pml_miners.TripletMarginMiner(0.3, kind, distance=pml_distance(metric))(x, labels)
    assert len(ours.anchor) == len(theirs[0]) > 0
    assert as_set(ours) == as_set(theirs)


@pytest.mark.parametrize("metric", METRICS)
def test_batch_hard_equals_pml(metric):
    x, labels = random_batch(48, 6, dim=8, seed=12)
    ours = BatchHardMiner(distance=metric)(x, labels)
    theirs = pml_miners.BatchHardMiner(distance=pml_distance(metric))(x, labels)
    assert all(torch.equal(u, v) for u, v in zip(ours, theirs))


def test_triplets_sorted_by_anchor_then_positive():
    x, labels = random_batch(30, 3, seed=13)
    t = TripletMarginMiner(0.5, "all")(x, labels)
    key = t.anchor * 30 + t.positive
    assert torch.all(key[1:] >= key[:-1])


# --------------------------------------------------------------------------- candidates / seed


def seed_l2_dist(x1, x2):
    """The seed script's utils.PairwiseDistance(2).forward, verbatim in its arithmetic."""
    eps = 1e-4 / x1.size(1)
    diff = torch.abs(x1 - x2)
    out = torch.pow(diff, 2).sum(dim=1)
    return torch.pow(out + eps, 1.0 / 2)


def seed_selection(out_a, out_p, out_n, margin):
    """The seed's numpy filter: np.where((d_n - d_p < margin).cpu().data.numpy().flatten())."""
    d_p = seed_l2_dist(out_a, out_p)
    d_n = seed_l2_dist(out_a, out_n)
    selected = (d_n - d_p < margin).cpu().numpy().flatten()
    return np.where(selected == 1)[0]


def seed_batch(num: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    out_a, out_p, out_n = (torch.randn(num, 16, generator=gen) for _ in range(3))
    embeddings = torch.cat([out_a, out_p, out_n])  # (3T, D): the three forwards, stacked
    idx = torch.arange(num)
    return (out_a, out_p, out_n), embeddings, (idx, idx + num, idx + 2 * num)


def test_candidates_reproduce_the_seed_filter_exactly():
    (out_a, out_p, out_n), emb, candidates = seed_batch(300, seed=21)
    d_p = seed_l2_dist(out_a, out_p)
    d_n = seed_l2_dist(out_a, out_n)
    # A margin equal to one triplet's float32 d_n - d_p puts it exactly on the boundary.
    margin = float((d_n - d_p)[17])
    expected = seed_selection(out_a, out_p, out_n, margin)
    miner = TripletMarginMiner(margin, "all", distance="seed_l2", strict_margin=True)
    got = miner(emb, None, candidates=candidates)
    assert 0 < len(expected) < 300 and 17 not in expected
    assert torch.equal(got.anchor, torch.from_numpy(expected))
    assert torch.equal(got.positive, got.anchor + 300) and torch.equal(
        got.negative, got.anchor + 600
    )
    # pytorch-metric-learning's non-strict "all" keeps the boundary triplet as well.
    loose = TripletMarginMiner(margin, "all", distance="seed_l2")(emb, None, candidates=candidates)
    assert set(loose.anchor.tolist()) == set(expected.tolist()) | {17}


@pytest.mark.parametrize("kind", TRIPLET_TYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_candidates_filter_matches_brute_force(kind, metric):
    x, labels = random_batch(12, 3, seed=31)
    dist = pairwise_distance(x, metric=metric)
    all_valid = brute_force_triplets(dist, labels, float("inf"), "all")
    cand = tuple(torch.tensor(c) for c in zip(*sorted(all_valid)))
    got = TripletMarginMiner(0.3, kind, distance=metric)(x, labels, candidates=cand)
    assert as_set(got) == brute_force_triplets(dist, labels, 0.3, kind)
    # Filtering every valid triplet gives what mining the batch gives.
    assert as_set(got) == as_set(TripletMarginMiner(0.3, kind, distance=metric)(x, labels))


def test_semihard_and_batch_hard_candidate_filters():
    x, labels = random_batch(12, 3, seed=32)
    dist = pairwise_distance(x)
    valid = sorted(brute_force_triplets(dist, labels, float("inf"), "all"))
    cand = tuple(torch.tensor(c) for c in zip(*valid))
    band = {(a, p, n) for a, p, n in valid if dist[a, p] < dist[a, n] < dist[a, p] + 0.5}
    assert as_set(SemiHardNegativeMiner(0.5)(x, None, candidates=cand)) == band
    # Batch-hard over candidates: per anchor the triplet with the largest d(a,p) - d(a,n).
    hardest = {}
    for a, p, n in valid:
        v = float(dist[a, p] - dist[a, n])
        if a not in hardest or v > hardest[a][0]:
            hardest[a] = (v, (a, p, n))
    got = BatchHardMiner()(x, None, candidates=cand)
    assert as_set(got) == {t for _, t in hardest.values()}
    assert as_set(got) == brute_force_batch_hard(dist, labels)  # every triplet was a candidate


def test_candidates_with_a_matrix_only_distance():
    x, labels = random_batch(10, 2, seed=33)
    valid = sorted(brute_force_triplets(pairwise_distance(x), labels, float("inf"), "all"))
    cand = tuple(torch.tensor(c) for c in zip(*valid))
    custom = lambda a, b: pairwise_distance(a, b, "squared")  # noqa: E731
    got = TripletMarginMiner(0.3, "semihard", distance=custom)(x, labels, candidates=cand)
    assert as_set(got) == as_set(TripletMarginMiner(0.3, "semihard")(x, labels, candidates=cand))


# --------------------------------------------------------------------------- edge cases


def all_miners():
    return [
        *(TripletMarginMiner(0.2, kind) for kind in TRIPLET_TYPES),
        BatchHardMiner(),
        SemiHardNegativeMiner(fallback="hardest"),
        SemiHardNegativeMiner(fallback="skip"),
    ]


@pytest.mark.parametrize("miner", all_miners(), ids=repr)
def test_degenerate_batches_give_no_triplets(miner):
    cases = [
        (torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)),  # empty batch
        (torch.randn(6, 4), torch.zeros(6, dtype=torch.long)),  # one identity: no negative
        (torch.randn(6, 4), torch.arange(6)),  # all unique: no positive
        (torch.randn(1, 4), torch.zeros(1, dtype=torch.long)),
    ]
    for x, labels in cases:
        t = miner(x, labels)
        assert isinstance(t, Triplets) and t.num_triplets == 0
        assert all(v.dtype == torch.int64 and v.shape == (0,) for v in t)


@pytest.mark.parametrize("miner", all_miners(), ids=repr)
def test_output_is_int64_without_graph(miner):
    x, labels = random_batch(20, 4, seed=41, dtype=torch.float32)
    x.requires_grad_()
    t = miner(x, labels)
    assert all(v.dtype == torch.int64 and not v.requires_grad for v in t)
    assert x.grad_fn is None and x.grad is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("miner", all_miners(), ids=repr)
def test_half_precision_inputs_mine_as_their_float32_values(dtype, miner):
    x, labels = random_batch(24, 4, seed=42, dtype=torch.float32)
    half = x.to(dtype)
    miner.generator = torch.Generator().manual_seed(0)
    got = miner(half, labels)
    miner.generator = torch.Generator().manual_seed(0)  # the same draws for SemiHard
    assert as_set(got) == as_set(miner(half.float(), labels))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("miner", all_miners(), ids=repr)
def test_cuda_mines_on_the_device_as_on_the_cpu(miner):
    x, labels = random_batch(64, 8, seed=44)
    miner.generator = None
    got = miner(x.cuda(), labels.cuda())
    assert all(t.device.type == "cuda" and t.dtype == torch.int64 for t in got)
    if not isinstance(miner, SemiHardNegativeMiner):  # its draws use the device's generator
        assert as_set(got) == as_set(miner(x, labels))
    candidates = tuple(t.cuda() for t in TripletMarginMiner(1e9, "all")(x, labels))
    filtered = miner(x.cuda(), None, candidates=candidates)
    assert as_set(filtered) == as_set(miner(x, None, candidates=tuple(t.cpu() for t in candidates)))


def test_labels_may_be_a_list_and_are_moved_to_the_device():
    x, labels = random_batch(10, 2, seed=43)
    t = BatchHardMiner()(x, labels.tolist())
    assert as_set(t) == as_set(BatchHardMiner()(x, labels))


# --------------------------------------------------------------------------- max_triplets


def test_max_triplets_is_a_seeded_ordered_subset():
    x, labels = random_batch(30, 3, seed=51)
    full = TripletMarginMiner(1.0, "all")(x, labels)
    assert full.num_triplets > 50
    capped = lambda seed: TripletMarginMiner(  # noqa: E731
        1.0, "all", max_triplets=50, generator=torch.Generator().manual_seed(seed)
    )(x, labels)
    first, again, other = capped(0), capped(0), capped(1)
    assert first.num_triplets == 50
    assert as_set(first) <= as_set(full)
    assert all(torch.equal(u, v) for u, v in zip(first, again))
    assert as_set(first) != as_set(other)
    position = {t: i for i, t in enumerate(zip(*(v.tolist() for v in full)))}
    order = [position[t] for t in zip(*(v.tolist() for v in first))]
    assert order == sorted(order)
    small = TripletMarginMiner(1.0, "all", max_triplets=10**9)(x, labels)
    assert all(torch.equal(u, v) for u, v in zip(small, full))


# --------------------------------------------------------------------------- errors, factory


def test_bad_arguments_are_clear_errors():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="unknown type_of_triplets 'hardest'.*all, hard"):
        TripletMarginMiner(type_of_triplets="hardest")
    with pytest.raises(ValueError, match="unknown fallback 'none'"):
        SemiHardNegativeMiner(fallback="none")
    with pytest.raises(ValueError, match="max_triplets must be an int >= 0.*-1"):
        BatchHardMiner(max_triplets=-1)
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\).*got \(3,\)"):
        BatchHardMiner()(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels are required"):
        BatchHardMiner()(x, None)
    with pytest.raises(ValueError, match=r"2-D tensor \(B, D\), got \(4,\)"):
        BatchHardMiner()(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="3-tuple"):
        BatchHardMiner()(x, None, candidates=(torch.zeros(2), torch.zeros(2)))
    with pytest.raises(ValueError, match="equally long"):
        BatchHardMiner()(
            x, None, candidates=(torch.zeros(2).long(),) * 2 + (torch.zeros(3).long(),)
        )
    with pytest.raises(ValueError, match="candidate anchor indices must be integers"):
        BatchHardMiner()(x, None, candidates=(torch.zeros(2),) * 3)
    with pytest.raises(ValueError, match="unknown distance"):
        BatchHardMiner(distance="l3")


def test_build_miner_maps_the_config():
    gen = torch.Generator()
    semihard = build_miner(
        MiningConfig(
            miner="semihard", margin=0.3, fallback="skip", distance="euclidean", max_triplets=7
        ),
        gen,
    )
    assert isinstance(semihard, SemiHardNegativeMiner)
    assert (semihard.margin, semihard.fallback, semihard.distance.name) == (
        0.3,
        "skip",
        "euclidean",
    )
    assert semihard.max_triplets == 7 and semihard.generator is gen
    hard = build_miner(MiningConfig(miner="batch_hard", distance="cosine"))
    assert isinstance(hard, BatchHardMiner) and hard.distance.name == "cosine"
    margin = build_miner(MiningConfig(miner="triplet_margin", type_of_triplets="easy", margin=0.5))
    assert isinstance(margin, TripletMarginMiner)
    assert (margin.type_of_triplets, margin.margin, margin.max_triplets) == ("easy", 0.5, 0)
    with pytest.raises(ValueError, match="mining.miner: unknown miner 'random'"):
        build_miner(MiningConfig(miner="random"))


# --------------------------------------------------------------------------- memory


PEAK_SCRIPT = textwrap.dedent(
    """
    import re, sys, torch
    from facenet.metric.miners import SemiHardNegativeMiner
    from facenet.metric.triplet_margin_miner import TripletMarginMiner

    def rss(field):
        text = open("/proc/self/status").read()
        return int(re.search(field + r":\\s+(\\d+) kB", text).group(1)) * 1024

    def peak_delta(fn):
        base = rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as fh:  # reset the high-water mark
            fh.write("5")
        out = fn()
        return rss("VmHWM") - base, out

    B, ids = 512, 8
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(B) % ids
    centers = torch.nn.functional.normalize(torch.randn(ids, 64, generator=gen), dim=1)
    noise = 0.15 * torch.randn(B, 64, generator=gen)
    emb = torch.nn.functional.normalize(centers[labels] + noise, dim=1)
    TripletMarginMiner(0.2, "all")(emb[:64], labels[:64])  # warm up the thread pool
    peak_all, t = peak_delta(lambda: TripletMarginMiner(0.2, "all")(emb, labels))
    peak_semi, _ = peak_delta(lambda: SemiHardNegativeMiner(0.2)(emb, labels))
    cube, _ = peak_delta(lambda: torch.ones(B, B, B, dtype=torch.bool).any())
    print(peak_all, peak_semi, cube, t.num_triplets)
    """
)


def test_mining_memory_is_quadratic_not_cubic():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pytest.skip("peak RSS cannot be reset here (/proc/self/clear_refs)")
    result = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, check=True
    )
    peak_all, peak_semi, cube, num = map(int, result.stdout.split())
    batch = 512
    # A B x B x B bool mask alone is 134 MB; the measurement must see it ...
    assert cube > 0.9 * batch**3
    # ... while the miners stay within the output plus a few B x B matrices.
    assert num > 0
    assert peak_all < 24 * num + 16 * min(num, 2**22) + 40 * batch**2 + 16 * 2**20
    assert peak_semi < 40 * batch**2 + 16 * 2**20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_labels_that_are_not_integers_are_refused(dtype):
    embeddings = torch.eye(4)
    labels = torch.tensor([0, 0, 1, 1]).to(dtype)
    for miner in (BatchHardMiner(), SemiHardNegativeMiner(), TripletMarginMiner(margin=0.2)):
        with pytest.raises(ValueError, match="labels must be integers"):
            miner(embeddings, labels)
