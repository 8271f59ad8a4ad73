"""Distance matrices: hand-computed values, brute force, precision policy, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from facenet.metric.distances import (
    DISTANCE_NAMES,
    Distance,
    get_distance,
    paired_distance,
    pairwise_distance,
)

METRICS = ("squared", "euclidean", "cosine", "angular", "seed_l2")


def brute_force(x: torch.Tensor, y: torch.Tensor, metric: str) -> torch.Tensor:
    """Distances by a double loop over rows, straight from the definitions. (B, M)"""
    out = torch.empty(x.shape[0], y.shape[0], dtype=torch.float64)
    for i, xi in enumerate(x.double()):
        for j, yj in enumerate(y.double()):
            sq = float(((xi - yj) ** 2).sum())
            if metric == "squared":
                out[i, j] = sq
            elif metric == "euclidean":
                out[i, j] = math.sqrt(sq)
            elif metric == "seed_l2":
                out[i, j] = math.sqrt(sq + 1e-4 / x.shape[1])
            elif metric == "angular":  # Kahan's stable angle: exactly 0 for equal rows
                u, v = xi / xi.norm(), yj / yj.norm()
                out[i, j] = 2 * math.atan2(float((u - v).norm()), float((u + v).norm())) / math.pi
            else:
                out[i, j] = 1 - float(xi @ yj) / float(xi.norm() * yj.norm())
    return out


def test_hand_computed_1d():
    x = torch.tensor([[0.0], [1.0], [3.0]])
    expected_squared = torch.tensor([[0.0, 1, 9], [1, 0, 4], [9, 4, 0]])
    assert torch.equal(pairwise_distance(x, metric="squared"), expected_squared)
    assert torch.equal(pairwise_distance(x, metric="euclidean"), expected_squared.sqrt())
    # seed_l2 adds 1e-4 / D under the root, so even the diagonal is sqrt(1e-4).
    assert torch.allclose(pairwise_distance(x, metric="seed_l2")[0, 0], torch.tensor(0.01))


def test_hand_computed_cosine():
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [1.0, 1.0]])
    d = pairwise_distance(x, metric="cosine")
    assert d[0, 1] == pytest.approx(1.0)  # orthogonal
    assert d[0, 2] == pytest.approx(2.0)  # opposite
    assert d[0, 3] == pytest.approx(1 - 1 / math.sqrt(2))  # 45 degrees
    assert d[1, 1] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("with_y", [False, True])
def test_matrix_matches_brute_force(metric, with_y):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, dtype=torch.float64, generator=gen)
    y = torch.randn(4, 5, dtype=torch.float64, generator=gen) if with_y else None
    got = pairwise_distance(x, y, metric)
    assert got.dtype == torch.float64
    assert torch.allclose(got, brute_force(x, x if y is None else y, metric), atol=1e-12)


@pytest.mark.parametrize("metric", METRICS)
def test_paired_matches_matrix_diagonal(metric):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 6, dtype=torch.float64, generator=gen)
    y = torch.randn(9, 6, dtype=torch.float64, generator=gen)
    expected = brute_force(x, y, metric).diagonal()
    assert torch.allclose(paired_distance(x, y, metric), expected, atol=1e-12)


def test_self_distance_has_exact_zero_diagonal():
    # Large offsets make the Gram expansion's rounding residue visible if not removed.
    x = torch.randn(50, 16) + 100.0
    for metric in ("squared", "euclidean"):
        assert torch.count_nonzero(pairwise_distance(x, metric=metric).diagonal()) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("metric", METRICS)
def test_half_inputs_computed_in_float32(dtype, metric):
    x = torch.nn.functional.normalize(torch.randn(12, 8), dim=1).to(dtype)
    got = pairwise_distance(x, metric=metric)
    assert got.dtype == torch.float32
    assert torch.allclose(got, pairwise_distance(x.float(), metric=metric), atol=1e-6)
    paired = paired_distance(x[:6], x[6:], metric)
    assert paired.dtype == torch.float32


@pytest.mark.parametrize("metric", METRICS)
def test_float32_under_autocast(metric):
    x = torch.randn(10, 8)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = x @ w  # bfloat16 under autocast
        assert emb.dtype == torch.bfloat16
        got = pairwise_distance(emb, metric=metric)
    assert got.dtype == torch.float32
    assert torch.allclose(got, pairwise_distance(emb.float(), metric=metric), atol=1e-5)


@pytest.mark.parametrize("metric", ["euclidean", "squared", "cosine", "seed_l2"])
def test_finite_gradient_at_zero_distance(metric):
    base = torch.randn(3, 4, dtype=torch.float64)
    x = torch.cat([base, base[:1]]).requires_grad_()  # row 3 duplicates row 0
    pairwise_distance(x, metric=metric).sum().backward()
    assert torch.isfinite(x.grad).all()
    y = x.detach().clone().requires_grad_()
    paired_distance(y, y.detach(), metric).sum().backward()  # every pair at distance 0
    assert torch.isfinite(y.grad).all()


def test_euclidean_gradient_is_zero_where_distance_is_zero():
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    pairwise_distance(x, metric="euclidean").sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("metric", METRICS)
def test_gradcheck(metric):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    y = torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: pairwise_distance(a, b, metric), (x, y))
    assert torch.autograd.gradcheck(lambda a: pairwise_distance(a, metric=metric), (x,))
    assert torch.autograd.gradcheck(
        lambda a, b: paired_distance(a, b[:1].expand(5, 3), metric), (x, y)
    )


def test_callable_metric_is_wrapped_and_upcast():
    seen = []

    def manhattan(a, b):
        seen.append(a.dtype)
        return (a[:, None, :] - b[None, :, :]).abs().sum(-1)

    x = torch.randn(6, 3).half()
    d = pairwise_distance(x, metric=manhattan)
    assert seen == [torch.float32] and d.dtype == torch.float32
    assert torch.allclose(d, (x.float()[:, None] - x.float()[None]).abs().sum(-1))
    dist = get_distance(manhattan)
    assert isinstance(dist, Distance) and dist.paired_fn is None
    # Row-wise form of a matrix-only distance: the diagonal of the block matrices.
    y = torch.randn(300, 3)
    z = torch.randn(300, 3)
    assert torch.allclose(dist.paired(y, z), (y - z).abs().sum(1), atol=1e-5)


def test_get_distance_by_name_and_identity():
    assert set(DISTANCE_NAMES) == set(METRICS)
    for name in METRICS:
        assert get_distance(name).name == name
        assert get_distance(get_distance(name)) is get_distance(name)


def test_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown distance 'manhatan'.*squared, euclidean"):
        get_distance("manhatan")
    with pytest.raises(TypeError, match="must be a name"):
        get_distance(3)


def test_shape_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"2-D.*\(4,\)"):
        pairwise_distance(torch.zeros(4))
    with pytest.raises(ValueError, match=r"y must be a 2-D tensor \(B, D\), got \(3,\)"):
        pairwise_distance(torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(ValueError, match=r"widths differ.*\(2, 3\) vs \(2, 4\)"):
        pairwise_distance(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rows differ"):
        paired_distance(torch.zeros(2, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"returned shape \(2,\)"):
        pairwise_distance(torch.zeros(2, 3), metric=lambda a, b: a.sum(1))


def test_empty_inputs():
    assert pairwise_distance(torch.zeros(0, 4)).shape == (0, 0)
    assert pairwise_distance(torch.zeros(0, 4), torch.zeros(3, 4)).shape == (0, 3)
    assert paired_distance(torch.zeros(0, 4), torch.zeros(0, 4)).shape == (0,)


@pytest.mark.parametrize("name", DISTANCE_NAMES)
def test_losses_and_miners_with_a_named_distance_pickle(name):
    import pickle

    from facenet.metric.losses import TripletMarginLoss
    from facenet.metric.miners import SemiHardNegativeMiner

    for thing in (TripletMarginLoss(0.2, distance=name), SemiHardNegativeMiner(0.2, distance=name)):
        copy = pickle.loads(pickle.dumps(thing))
        x = torch.randn(4, 3, dtype=torch.float64)
        assert torch.equal(copy.distance(x), get_distance(name)(x))
