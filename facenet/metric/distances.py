"""Distances between embeddings, as (B, M) matrices or row by row.

Every distance here is computed in float32 or wider, also under autocast: a float16 or
bfloat16 embedding is upcast before the matrix is formed, because triplet conditions compare
differences of distances, and half precision cannot resolve a 0.2 margin on distances near 2.

Named distances:

- ``"squared"``: ``||x - y||^2``, FaceNet's distance (Schroff et al. 2015).
- ``"euclidean"``: ``||x - y||``, with a zero (finite) gradient where the distance is zero.
- ``"cosine"``: ``1 - cos(x, y)``.
- ``"angular"``: ``arccos(cos(x, y)) / pi`` over [0, 1], davidsandberg/facenet's
  ``distance_metric=1`` (its published LFW figures), with a finite gradient at cos = +-1.
- ``"seed_l2"``: ``sqrt(||x - y||^2 + 1e-4 / D)``, the distance of the seed training script
  (``utils.PairwiseDistance(2)`` in liorshk/facenet_pytorch). Only for reproducing its triplet
  selection; a training run should use one of the others.

Any callable ``f(x, y) -> (B, M)`` can stand in for a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from facenet.metric.checks import check_embedding_pair

__all__ = [
    "DISTANCE_NAMES",
    "Distance",
    "DistanceLike",
    "compute_dtype",
    "get_distance",
    "pairwise_distance",
    "paired_distance",
]

MatrixFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_PAIRED_BLOCK = 256  # rows per block when a matrix-only distance is evaluated row by row


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype distances (and losses) are computed in: float32, or float64 if an input is.

    Args:
        tensors: the inputs, any dtype.
    """
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _safe_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """sqrt with gradient 0 (not inf) where the argument is 0."""
    positive = sq > 0
    # sqrt of a placeholder 1 where sq == 0, so neither value nor gradient is inf there.
    root = torch.where(positive, sq, torch.ones_like(sq)).sqrt()
    return torch.where(positive, root, torch.zeros_like(sq))


# --------------------------------------------------------------------------- matrix forms


def _squared_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x_i - y_j||^2 by the Gram expansion, clamped at 0 against rounding. (B, M)"""
    x_sq = (x * x).sum(1)  # (B,)
    y_sq = (y * y).sum(1)  # (M,)
    sq = torch.addmm(x_sq[:, None] + y_sq[None, :], x, y.T, beta=1.0, alpha=-2.0)
    return sq.clamp_min(0)


def _euclidean_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _safe_sqrt(_squared_matrix(x, y))


def _cosine_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # F.normalize divides by max(norm, 1e-12): a zero vector stays finite.
    return 1 - F.normalize(x, dim=1) @ F.normalize(y, dim=1).T


def _safe_arccos(cos: torch.Tensor) -> torch.Tensor:
    """arccos(cos) / pi, with cos clipped to [-1, 1] and a zero (not inf) gradient at the ends.

    Rounding puts the cosine of two (nearly) identical embeddings just above 1, where arccos is
    NaN; and arccos' derivative is infinite at +-1, which would make the gradient NaN.
    """
    inside = cos.abs() < 1
    clipped = torch.where(inside, cos, torch.zeros_like(cos))  # a finite gradient everywhere
    angle = torch.where(inside, torch.arccos(clipped), torch.arccos(cos.clamp(-1, 1).detach()))
    return angle / math.pi


def _angular_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _safe_arccos(F.normalize(x, dim=1) @ F.normalize(y, dim=1).T)  # (B, M)


def _seed_l2_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (_squared_matrix(x, y) + 1e-4 / x.shape[1]).sqrt()


# --------------------------------------------------------------------------- row-wise forms


def _squared_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    diff = x - y  # (T, D)
    return (diff * diff).sum(1)


def _euclidean_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _safe_sqrt(_squared_paired(x, y))


def _cosine_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 1 - (F.normalize(x, dim=1) * F.normalize(y, dim=1)).sum(1)


def _angular_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _safe_arccos((F.normalize(x, dim=1) * F.normalize(y, dim=1)).sum(1))  # (T,)


def _seed_l2_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The seed's operations in the seed's order, so float32 results are bit-identical.
    eps = 1e-4 / x.size(1)
    out = torch.pow(torch.abs(x - y), 2).sum(dim=1)
    return torch.pow(out + eps, 1.0 / 2)


class Distance:
    """A distance: a (B, M) matrix form and, for named distances, a row-wise form.

    Calling it applies the precision policy (float32 or wider, autocast off) and checks shapes.

    Args:
        matrix: ``f(x, y) -> (B, M)`` on float tensors.
        paired: ``g(x, y) -> (T,)`` on equal-length rows, or None when only the matrix is known.
        name: shown in messages and ``repr``.
        zero_diagonal: the self-distance matrix has an exact zero diagonal (squared, euclidean).
    """

    def __init__(
        self,
        matrix: MatrixFn,
        paired: MatrixFn | None = None,
        name: str = "custom",
        zero_diagonal: bool = False,
    ) -> None:
        self.matrix_fn = matrix
        self.paired_fn = paired
        self.name = name
        self.zero_diagonal = zero_diagonal

    def __repr__(self) -> str:
        return f"Distance({self.name!r})"

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The (B, M) distance matrix between rows of ``x`` (B, D) and ``y`` (M, D).

        Args:
            x: (B, D) embeddings.
            y: (M, D) embeddings; None for ``x`` against itself.
        """
        self_distance = y is None
        y = x if y is None else y
        check_embedding_pair(x, y, f"distance {self.name!r}")
        dtype = compute_dtype(x, y)
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = self.matrix_fn(x.to(dtype), y.to(dtype))
        if out.shape != (x.shape[0], y.shape[0]):
            raise ValueError(
                f"distance {self.name!r} returned shape {tuple(out.shape)}, expected "
                f"{(x.shape[0], y.shape[0])}"
            )
        if self_distance and self.zero_diagonal:
            # x_i against itself is exactly 0; the Gram expansion leaves rounding residue.
            # Safe in place: neither clamp_min nor where saves its output for backward.
            out.fill_diagonal_(0)
        return out.to(torch.promote_types(out.dtype, torch.float32))

    @property
    def has_paired(self) -> bool:
        """Whether a row-wise form exists (named distances only)."""
        return self.paired_fn is not None

    def paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Distances between matching rows: ``d(x[i], y[i])``, shape (T,).

        Args:
            x: (T, D) embeddings.
            y: (T, D) embeddings.
        """
        check_embedding_pair(x, y, f"distance {self.name!r}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(
                f"distance {self.name!r}: paired rows differ in number: {x.shape[0]} vs "
                f"{y.shape[0]}"
            )
        dtype = compute_dtype(x, y)
        with torch.autocast(device_type=x.device.type, enabled=False):
            x, y = x.to(dtype), y.to(dtype)
            if self.paired_fn is not None:
                return self.paired_fn(x, y)
            # A matrix-only distance: diagonals of small row-block matrices, (c, c) each.
            blocks = [
                self.matrix_fn(x[s : s + _PAIRED_BLOCK], y[s : s + _PAIRED_BLOCK]).diagonal()
                for s in range(0, x.shape[0], _PAIRED_BLOCK)
            ]
            return torch.cat(blocks) if blocks else x.new_zeros(0)


_NAMED = {
    "squared": Distance(_squared_matrix, _squared_paired, "squared", zero_diagonal=True),
    "euclidean": Distance(_euclidean_matrix, _euclidean_paired, "euclidean", zero_diagonal=True),
    "cosine": Distance(_cosine_matrix, _cosine_paired, "cosine"),
    # arccos magnifies the rounding of cos(x, x) ~ 1 - 1e-16 to 1e-8: the diagonal is set to 0.
    "angular": Distance(_angular_matrix, _angular_paired, "angular", zero_diagonal=True),
    "seed_l2": Distance(_seed_l2_matrix, _seed_l2_paired, "seed_l2"),
}

DISTANCE_NAMES = tuple(_NAMED)

DistanceLike = str | MatrixFn | Distance


def get_distance(name_or_callable: DistanceLike) -> Distance:
    """The distance for a name or a callable, as a callable ``(x, y=None) -> (B, M)``.

    Args:
        name_or_callable: one of ``DISTANCE_NAMES``, a :class:`Distance`, or any callable
            ``f(x, y) -> (B, M)`` (wrapped so it, too, runs in float32 or wider).

    Raises:
        ValueError: an unknown name, naming the valid ones.
    """
    if isinstance(name_or_callable, Distance):
        return name_or_callable
    if isinstance(name_or_callable, str):
        try:
            return _NAMED[name_or_callable]
        except KeyError:
            raise ValueError(
                f"unknown distance {name_or_callable!r}; valid: " + ", ".join(DISTANCE_NAMES)
            ) from None
    if callable(name_or_callable):
        return Distance(name_or_callable, name=getattr(name_or_callable, "__name__", "custom"))
    raise TypeError(
        f"distance must be a name ({', '.join(DISTANCE_NAMES)}) or a callable, got "
        f"{name_or_callable!r}"
    )


def pairwise_distance(
    x: torch.Tensor, y: torch.Tensor | None = None, metric: DistanceLike = "squared"
) -> torch.Tensor:
    """The (B, M) matrix of distances between rows of ``x`` and rows of ``y``.

    Args:
        x: (B, D) embeddings, any float dtype.
        y: (M, D) embeddings; None for ``x`` against itself (exact zero diagonal for
            squared and euclidean).
        metric: a name in ``DISTANCE_NAMES`` or a callable ``f(x, y) -> (B, M)``.

    Returns:
        (B, M) float32 matrix (float64 if an input is float64), differentiable.
    """
    return get_distance(metric)(x, y)


def paired_distance(
    x: torch.Tensor, y: torch.Tensor, metric: DistanceLike = "squared"
) -> torch.Tensor:
    """Row-by-row distances ``d(x[i], y[i])``, shape (T,), in float32 or wider.

    Args:
        x: (T, D) embeddings.
        y: (T, D) embeddings.
        metric: a name in ``DISTANCE_NAMES`` or a callable ``f(x, y) -> (B, M)``.
    """
    return get_distance(metric).paired(x, y)
