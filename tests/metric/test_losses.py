"""Triplet losses and the margin softmax: hand-computed values, brute force,
pytorch-metric-learning, gradients."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import losses as pml_losses
from pytorch_metric_learning import miners as pml_miners
from pytorch_metric_learning import reducers as pml_reducers

from facenet.config import LossConfig
from facenet.metric import build_loss, build_margin_loss
from facenet.metric.batch_all_loss import batch_all_triplet_loss
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.distances import pairwise_distance
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.margin_softmax import MarginSoftmaxLoss
from facenet.metric.miners import Triplets
from facenet.metric.triplet_margin_miner import TripletMarginMiner

REDUCTIONS = ("mean_active", "mean", "sum")
PML_REDUCERS = {
    "mean_active": pml_reducers.AvgNonZeroReducer,
    "mean": pml_reducers.MeanReducer,
    "sum": pml_reducers.SumReducer,
}


def random_batch(num: int, ids: int, dim: int = 4, seed: int = 0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(ids, dim, generator=gen, dtype=dtype)
    labels = torch.arange(num) % ids
    return centers[labels] + 0.8 * torch.randn(num, dim, generator=gen, dtype=dtype), labels


def all_valid_triplets(labels: torch.Tensor) -> Triplets:
    """Every (a, p, n) with a != p of one identity and n of another, by a triple loop."""
    lab = labels.tolist()
    rows = [
        (a, p, n)
        for a, p, n in itertools.product(range(len(lab)), repeat=3)
        if a != p and lab[a] == lab[p] and lab[a] != lab[n]
    ]
    return Triplets(*(torch.tensor(c, dtype=torch.long) for c in zip(*rows)))


def brute_force_loss(x, triplets, margin, metric, reduction, soft=False, swap=False):
    """The loss by a loop over triplets, from pairwise distances."""
    dist = pairwise_distance(x, metric=metric)
    losses = []
    for a, p, n in zip(*(t.tolist() for t in triplets)):
        d_an = min(dist[a, n], dist[p, n]) if swap else dist[a, n]
        v = dist[a, p] - d_an + margin
        losses.append(torch.nn.functional.softplus(v) if soft else torch.clamp(v, min=0))
    losses = torch.stack(losses)
    if reduction == "sum":
        return losses.sum()
    if reduction == "mean":
        return losses.mean()
    return losses[losses > 0].mean()


def pml_distance(metric: str):
    power = 2 if metric == "squared" else 1
    return pml_distances.LpDistance(normalize_embeddings=False, power=power)


# --------------------------------------------------------------------------- hand-computed


def test_hand_computed_1d():
    x = torch.tensor([[0.0], [1.0], [1.5]])
    # (0, 1, 2): squared d_ap 1, d_an 2.25 -> max(0, 1 - 2.25 + 0.2) = 0
    # (1, 0, 2): squared d_ap 1, d_an 0.25 -> 0.95;  euclidean 1 - 0.5 + 0.2 = 0.7
    triplets = (torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 2]))
    squared = lambda reduction: float(  # noqa: E731
        TripletMarginLoss(0.2, "squared", reduction)(x, triplets)
    )
    assert squared("mean_active") == pytest.approx(0.95)
    assert squared("mean") == pytest.approx(0.475)
    assert squared("sum") == pytest.approx(0.95)
    assert float(TripletMarginLoss(0.2, "euclidean")(x, triplets)) == pytest.approx(0.7)
    # swap: d(p, n) for (1, 0, 2) is 2.25 > 0.25, no change; soft margin: softplus.
    assert float(TripletMarginLoss(0.2, swap=True)(x, triplets)) == pytest.approx(0.95)
    soft = TripletMarginLoss(0.2, soft_margin=True, reduction="sum")(x, triplets)
    expected = torch.nn.functional.softplus(torch.tensor([-1.05, 0.95])).sum()
    assert float(soft) == pytest.approx(float(expected))


def test_swap_uses_the_positive_negative_distance_when_smaller():
    x = torch.tensor([[0.0], [1.0], [1.2]])
    # (0, 1, 2): d_ap 1, d_an 1.44, d_pn 0.04 -> swap: max(0, 1 - 0.04 + 0.2) = 1.16
    t = (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))
    assert float(TripletMarginLoss(0.2, swap=True)(x, t)) == pytest.approx(1.16)
    assert float(TripletMarginLoss(0.2, swap=False, reduction="sum")(x, t)) == 0.0


# --------------------------------------------------------------------------- brute force, PML


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("metric", ["squared", "euclidean", "cosine"])
@pytest.mark.parametrize("soft, swap", [(False, False), (True, False), (False, True)])
def test_matches_brute_force(reduction, metric, soft, swap):
    x, labels = random_batch(12, 3, seed=1)
    t = all_valid_triplets(labels)
    got = TripletMarginLoss(0.5, metric, reduction, soft, swap)(x, t)
    expected = brute_force_loss(x, t, 0.5, metric, reduction, soft, swap)
    assert torch.allclose(got, expected, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("metric", ["squared", "euclidean"])
@pytest.mark.parametrize("soft, swap", [(False, False), (True, False), (False, True), (True, True)])
def test_equals_pml_on_our_triplets(reduction, metric, soft, swap):
    x, labels = random_batch(32, 4, dim=6, seed=2)
    t = TripletMarginMiner(0.4, "all", distance=metric)(x, labels)
    ours = TripletMarginLoss(0.4, metric, reduction, soft, swap)(x, t)
    pml = pml_losses.TripletMarginLoss(
        0.4,
        swap=swap,
        smooth_loss=soft,
        distance=pml_distance(metric),
        reducer=PML_REDUCERS[reduction](),
    )
    assert torch.allclose(ours, pml(x, indices_tuple=t), atol=1e-12)


@pytest.mark.parametrize(
    "pml_miner",
    [
        pml_miners.TripletMarginMiner(0.3, "semihard"),
        pml_miners.BatchHardMiner(),
        pml_miners.BatchEasyHardMiner(pos_strategy="easy", neg_strategy="hard"),
    ],
    ids=type,
)
def test_accepts_pml_miner_triplets(pml_miner):
    x, labels = random_batch(32, 4, dim=6, seed=3)
    indices = pml_miner(x, labels)
    if len(indices) == 4:  # BatchEasyHardMiner returns pairs; make them triplets
        indices = (indices[0], indices[1], indices[3])
    ours = TripletMarginLoss(0.3, "euclidean")(x, indices)
    pml = pml_losses.TripletMarginLoss(0.3, distance=pml_distance("euclidean"))
    assert torch.allclose(ours, pml(x, indices_tuple=indices), atol=1e-12)


def test_ref_embeddings_equal_pml():
    x, labels = random_batch(10, 2, dim=5, seed=4)
    ref, ref_labels = random_batch(14, 2, dim=5, seed=5)
    lab, ref_lab = labels.tolist(), ref_labels.tolist()
    rows = [
        (a, p, n)
        for a in range(10)
        for p, n in itertools.product(range(14), repeat=2)
        if lab[a] == ref_lab[p] and lab[a] != ref_lab[n]
    ]
    t = tuple(torch.tensor(c) for c in zip(*rows))
    ours = TripletMarginLoss(0.5, "squared")(x, t, ref_embeddings=ref)
    pml = pml_losses.TripletMarginLoss(0.5, distance=pml_distance("squared"))
    assert torch.allclose(ours, pml(x, indices_tuple=t, ref_emb=ref), atol=1e-12)
    # swap with a reference set uses d(p, n) between reference rows.
    dist_ar = pairwise_distance(x, ref)
    dist_rr = pairwise_distance(ref)
    a, p, n = t
    d_neg = torch.minimum(dist_ar[a, n], dist_rr[p, n])
    losses = torch.clamp(dist_ar[a, p] - d_neg + 0.5, min=0)
    expected = losses.sum() / (losses > 0).sum()
    got = TripletMarginLoss(0.5, swap=True)(x, t, ref_embeddings=ref)
    assert torch.allclose(got, expected, atol=1e-12)


def test_pml_losses_accept_our_triplets():
    x, labels = random_batch(24, 3, dim=5, seed=6)
    t = BatchHardMiner(distance="euclidean")(x, labels)
    pml = pml_losses.TripletMarginLoss(0.2, distance=pml_distance("euclidean"))
    assert torch.allclose(pml(x, indices_tuple=t), TripletMarginLoss(0.2, "euclidean")(x, t))


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("metric", ["squared", "euclidean", "cosine"])
@pytest.mark.parametrize("soft, swap", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck(metric, soft, swap, reduction):
    x, labels = random_batch(8, 2, dim=3, seed=7)
    x.requires_grad_()
    t = all_valid_triplets(labels)
    loss_fn = TripletMarginLoss(0.5, metric, reduction, soft, swap)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, t), (x,))


def test_gradient_reaches_the_model():
    # The seed re-created the selected embeddings as new leaves: no gradient to the model.
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    images, labels = torch.randn(16, 6), torch.arange(16) % 4
    embeddings = model(images)
    t = TripletMarginMiner(10.0, "all")(embeddings, labels)
    TripletMarginLoss(10.0)(embeddings, t).backward()
    assert model.weight.grad is not None and model.weight.grad.abs().sum() > 0


def test_finite_gradient_with_coincident_points():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]], requires_grad=True)
    t = (torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([2, 0]))
    TripletMarginLoss(0.2, "euclidean", swap=True)(x, t).backward()
    assert torch.isfinite(x.grad).all()


# --------------------------------------------------------------------------- empty, stats, dtypes


def test_no_triplets_is_a_connected_zero():
    x = torch.randn(5, 3, requires_grad=True)
    empty = (torch.zeros(0, dtype=torch.long),) * 3
    loss_fn = TripletMarginLoss()
    loss = loss_fn(x, empty)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    stats = loss_fn.last_stats
    assert int(stats["num_triplets"]) == 0 and float(stats["active_fraction"]) == 0.0
    # With finite embeddings and ref_embeddings the gradient reaches both, as zeros.
    x, ref = torch.randn(2, 2, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    loss_fn(x, empty, ref_embeddings=ref).backward()
    assert torch.equal(ref.grad, torch.zeros_like(ref))
    # NaN or inf embeddings are not hidden behind an empty selection: the loss is NaN.
    bad = torch.tensor([[float("nan"), 1.0], [float("inf"), 0.0]], requires_grad=True)
    assert loss_fn(bad, empty).isnan()


def test_no_active_triplets_is_zero_not_nan():
    x = torch.tensor([[0.0], [0.1], [5.0]], requires_grad=True)
    t = (torch.tensor([0]), torch.tensor([1]), torch.tensor([2]))  # far from violating
    for reduction in REDUCTIONS:
        loss = TripletMarginLoss(0.2, reduction=reduction)(x, t)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.isfinite(x.grad).all()


def test_last_stats_are_detached_device_tensors_with_brute_force_values():
    x, labels = random_batch(12, 3, seed=8)
    x.requires_grad_()
    t = all_valid_triplets(labels)
    loss_fn = TripletMarginLoss(0.5, "euclidean")
    loss_fn(x, t)
    stats = loss_fn.last_stats
    assert set(stats) == {"num_triplets", "active_fraction", "mean_dap", "mean_dan"}
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in stats.values())
    assert all(v.device == x.device for v in stats.values())
    dist = pairwise_distance(x.detach(), metric="euclidean")
    a, p, n = t
    violation = dist[a, p] - dist[a, n] + 0.5
    assert int(stats["num_triplets"]) == len(a)
    assert float(stats["active_fraction"]) == pytest.approx(float((violation > 0).double().mean()))
    assert float(stats["mean_dap"]) == pytest.approx(float(dist[a, p].mean()))
    assert float(stats["mean_dan"]) == pytest.approx(float(dist[a, n].mean()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_embeddings(dtype):
    x, labels = random_batch(16, 4, seed=9, dtype=torch.float32)
    half = x.to(dtype).requires_grad_()
    t = all_valid_triplets(labels)
    loss = TripletMarginLoss(0.5)(half, t)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, TripletMarginLoss(0.5)(half.detach().float(), t), atol=1e-6)
    loss.backward()
    assert half.grad.dtype == dtype and torch.isfinite(half.grad.float()).all()


def test_float32_under_autocast():
    x, labels = random_batch(16, 4, seed=10, dtype=torch.float32)
    w = torch.eye(4, requires_grad=True)
    t = all_valid_triplets(labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = x @ w
        loss = TripletMarginLoss(0.5)(emb, t)
    assert loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_loss_equals_cpu_and_keeps_stats_on_the_device():
    x, labels = random_batch(24, 4, seed=16)
    t = all_valid_triplets(labels)
    loss_fn = TripletMarginLoss(0.5, swap=True)
    xc = x.cuda().requires_grad_()
    loss = loss_fn(xc, tuple(v.cuda() for v in t))
    assert all(v.device.type == "cuda" for v in loss_fn.last_stats.values())
    assert torch.allclose(loss.cpu(), loss_fn(x, t), atol=1e-10)
    loss.backward()
    assert torch.isfinite(xc.grad).all()
    batch_all = batch_all_triplet_loss(x.cuda(), labels.cuda(), 0.5)
    assert torch.allclose(batch_all.cpu(), batch_all_triplet_loss(x, labels, 0.5), atol=1e-10)


# --------------------------------------------------------------------------- batch-all


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("metric", ["squared", "euclidean", "cosine"])
@pytest.mark.parametrize("soft", [False, True])
def test_batch_all_equals_the_listed_loss(reduction, metric, soft):
    x, labels = random_batch(15, 3, seed=11)
    listed_x = x.clone().requires_grad_()
    listed = TripletMarginLoss(0.5, metric, reduction, soft)(listed_x, all_valid_triplets(labels))
    listed.backward()
    chunked_x = x.clone().requires_grad_()
    chunked = batch_all_triplet_loss(
        chunked_x, labels, 0.5, metric, reduction, chunk_size=4, soft_margin=soft
    )
    chunked.backward()
    assert torch.allclose(chunked, listed, atol=1e-12)
    assert torch.allclose(chunked_x.grad, listed_x.grad, atol=1e-12)


def test_batch_all_equals_pml_without_indices():
    x, labels = random_batch(40, 5, dim=6, seed=12)
    pml = pml_losses.TripletMarginLoss(0.3, distance=pml_distance("squared"))
    assert torch.allclose(batch_all_triplet_loss(x, labels, 0.3), pml(x, labels), atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_batch_all_gradcheck(reduction):
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3])
    fn = lambda e: batch_all_triplet_loss(e, labels, 0.5, reduction=reduction, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))


def test_batch_all_chunk_size_does_not_change_the_result():
    x, labels = random_batch(30, 4, seed=14)
    values = [batch_all_triplet_loss(x, labels, 0.4, chunk_size=c) for c in (1, 7, 30, 1000)]
    assert all(torch.allclose(v, values[0], atol=1e-12) for v in values)


def test_batch_all_degenerate_batches():
    for x, labels in [
        (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)),
        (torch.randn(5, 3), torch.zeros(5, dtype=torch.long)),
        (torch.randn(5, 3), torch.arange(5)),
    ]:
        x.requires_grad_()
        loss = batch_all_triplet_loss(x, labels)
        assert loss.item() == 0.0
        loss.backward()
        assert torch.equal(x.grad, torch.zeros_like(x))


def test_batch_all_half_precision():
    x, labels = random_batch(16, 4, seed=15, dtype=torch.float32)
    half = x.bfloat16().requires_grad_()
    loss = batch_all_triplet_loss(half, labels, 0.5)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, batch_all_triplet_loss(half.detach().float(), labels, 0.5))
    loss.backward()
    assert torch.isfinite(half.grad.float()).all()


# --------------------------------------------------------------------------- errors, factory


def test_bad_arguments_are_clear_errors():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="unknown reduction 'avg'.*mean_active, mean, sum"):
        TripletMarginLoss(reduction="avg")
    with pytest.raises(ValueError, match="4-tuple of pairs"):
        TripletMarginLoss()(x, (torch.zeros(1, dtype=torch.long),) * 4)
    with pytest.raises(ValueError, match="must be integers"):
        TripletMarginLoss()(x, (torch.zeros(1),) * 3)
    with pytest.raises(ValueError, match="equally long"):
        TripletMarginLoss()(x, (torch.zeros(1, dtype=torch.long),) * 2 + (torch.zeros(2).long(),))
    with pytest.raises(ValueError, match=r"embeddings must be a 2-D tensor"):
        TripletMarginLoss()(torch.zeros(4), (torch.zeros(1, dtype=torch.long),) * 3)
    with pytest.raises(ValueError, match=r"labels must have shape \(4,\)"):
        batch_all_triplet_loss(x, torch.zeros(5))
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        batch_all_triplet_loss(x, torch.zeros(4), chunk_size=0)


def test_build_loss_maps_the_config():
    loss_fn = build_loss(
        LossConfig(margin=0.3, distance="cosine", reduction="sum", soft_margin=True, swap=True)
    )
    assert isinstance(loss_fn, TripletMarginLoss)
    assert (loss_fn.margin, loss_fn.distance.name, loss_fn.reduction) == (0.3, "cosine", "sum")
    assert loss_fn.soft_margin and loss_fn.swap
    with pytest.raises(ValueError, match="unknown reduction"):
        build_loss(LossConfig(reduction="max"))


# --------------------------------------------------------------------------- margin softmax


def test_margin_softmax_hand_computed():
    """Two classes: each row's loss is log(1 + exp(s x (other cosine - target logit)))."""
    cosines = torch.tensor([[0.6, 0.8], [0.1, -0.95]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    cosface = MarginSoftmaxLoss("cosface", scale=2.0, margin=0.1)(cosines, labels)
    want = [math.log1p(math.exp(2 * (0.8 - 0.5))), math.log1p(math.exp(2 * (0.1 + 1.05)))]
    torch.testing.assert_close(cosface, torch.tensor(want, dtype=torch.float64))
    # ArcFace: row 0 at theta = acos(0.6) gets cos(theta + 0.5); row 1 at acos(-0.95) = 2.82
    # > pi - 0.5 gets -0.95 - 0.5 sin(0.5).
    arcface = MarginSoftmaxLoss("arcface", scale=2.0, margin=0.5)(cosines, labels)
    targets = (math.cos(math.acos(0.6) + 0.5), -0.95 - 0.5 * math.sin(0.5))
    want = [
        math.log1p(math.exp(2 * (0.8 - targets[0]))),
        math.log1p(math.exp(2 * (0.1 - targets[1]))),
    ]
    torch.testing.assert_close(arcface, torch.tensor(want, dtype=torch.float64))


def margin_softmax_case(seed: int, num=16, dim=6, classes=5):
    """Embeddings (N, D), labels, pml's (D, C) class weights; four rows point away from their
    class (angle past pi - margin: ArcFace's other branch)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(dim, classes, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, classes, (num,), generator=gen)
    x = torch.randn(num, dim, generator=gen, dtype=torch.float64)
    x[:4] = -weights[:, labels[:4]].T + 0.05 * x[:4]
    return x, labels, weights


@pytest.mark.parametrize(
    "kind, scale, margin", [("cosface", 64.0, 0.35), ("cosface", 8.0, 0.2), ("arcface", 64.0, 0.5),
                            ("arcface", 10.0, 0.3)]
)  # fmt: skip
def test_margin_softmax_equals_pml_and_its_gradients(kind, scale, margin):
    """pytorch-metric-learning 2.9.0's CosFaceLoss / ArcFaceLoss (weights (D, C), degrees for
    ArcFace, the mean over rows) on the same weights: loss and gradients."""
    x, labels, weights = margin_softmax_case(seed=int(scale))
    if kind == "cosface":
        pml = pml_losses.CosFaceLoss(5, 6, margin=margin, scale=scale)
    else:
        pml = pml_losses.ArcFaceLoss(5, 6, margin=math.degrees(margin), scale=scale)
    pml = pml.double()
    pml.W.data.copy_(weights)
    x_pml = x.clone().requires_grad_()
    want = pml(x_pml, labels)
    want.backward()
    x_ours, w_ours = x.clone().requires_grad_(), weights.clone().requires_grad_()
    cosines = F.normalize(x_ours, dim=1) @ F.normalize(w_ours, dim=0)  # (N, C)
    if kind == "arcface":
        assert (cosines.gather(1, labels[:, None])[:4] < math.cos(math.pi - margin)).all()
    got = MarginSoftmaxLoss(kind, scale, margin)(cosines, labels).mean()
    got.backward()
    torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=0)
    torch.testing.assert_close(x_ours.grad, x_pml.grad, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(w_ours.grad, pml.W.grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("kind", ["cosface", "arcface"])
def test_margin_softmax_gradient_matches_finite_differences(kind):
    x, labels, weights = margin_softmax_case(seed=3)
    cosines = (F.normalize(x, dim=1) @ F.normalize(weights, dim=0)).requires_grad_()
    loss = MarginSoftmaxLoss(kind, scale=4.0)
    assert torch.autograd.gradcheck(lambda c: loss(c, labels), (cosines,))


def test_build_margin_loss_maps_the_config():
    assert build_margin_loss(LossConfig()) is None  # softmax: the linear classifier's
    cosface = build_margin_loss(LossConfig(ce="cosface"))
    assert (cosface.kind, cosface.scale, cosface.margin) == ("cosface", 64.0, 0.35)
    arcface = build_margin_loss(LossConfig(ce="arcface", ce_scale=30.0, ce_margin=0.4))
    assert (arcface.kind, arcface.scale, arcface.margin) == ("arcface", 30.0, 0.4)
    assert build_margin_loss(LossConfig(ce="arcface")).margin == 0.5
    with pytest.raises(ValueError, match=r"margin must be in \[0, pi\).*margin=3.5"):
        MarginSoftmaxLoss("arcface", margin=3.5)
    with pytest.raises(ValueError, match="scale > 0.*scale=0.0"):
        MarginSoftmaxLoss("cosface", scale=0.0)
    with pytest.raises(ValueError, match="unknown kind 'sphereface'"):
        MarginSoftmaxLoss("sphereface")
