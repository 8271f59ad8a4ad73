"""Distances between embeddings, as (B, M) matrices or row by row.

Computed in float32 or wider, also under autocast: triplet conditions compare differences of
distances, and half precision cannot resolve a 0.2 margin on distances near 2. Named distances:
``squared`` ``||x - y||^2`` (FaceNet's); ``euclidean`` ``||x - y||``; ``cosine``
``1 - cos(x, y)``; ``angular`` ``arccos(cos(x, y)) / pi``, davidsandberg/facenet's
``distance_metric=1``; ``seed_l2`` ``sqrt(||x - y||^2 + 1e-4 / D)``, the seed training script's
``utils.PairwiseDistance(2)``, only to reproduce its selection. Square roots and arccos have
finite gradients everywhere. Any callable ``f(x, y) -> (B, M)`` can stand in for a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from facenet.metric.checks import check_choice, check_distance_inputs, check_matrix

MatrixFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_PAIRED_BLOCK = 256  # rows per block when a matrix-only distance is evaluated row by row


def _safe_sqrt(sq: torch.Tensor) -> torch.Tensor:
    """sqrt with gradient 0 (not inf) where the argument is 0."""
    positive = sq > 0
    root = torch.where(positive, sq, 1.0).sqrt()
    return torch.where(positive, root, 0.0)


def _safe_arccos(cos: torch.Tensor) -> torch.Tensor:
    """arccos(cos) / pi, cos clipped to [-1, 1] (rounding puts cos(x, x) above 1), with a zero
    gradient at the ends, where arccos' derivative is infinite: there the input is detached
    (``where``'s backward selects, so the infinite derivative is dropped, not multiplied)."""
    inside = cos.abs() < 1
    return torch.where(inside, cos, cos.detach()).clamp(-1, 1).arccos() / math.pi


def _squared_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||x_i - y_j||^2 by the Gram expansion, clamped at 0 against rounding. (B, M)"""
    x_sq = (x * x).sum(1)  # (B,)
    y_sq = (y * y).sum(1)  # (M,)
    sq = torch.addmm(x_sq[:, None] + y_sq, x, y.T, alpha=-2.0)
    return sq.clamp_min(0)


def _squared_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    diff = x - y  # (T, D)
    return (diff * diff).sum(1)


def _seed_l2(squared: MatrixFn) -> MatrixFn:
    """sqrt(squared(x, y) + 1e-4 / D). Row by row these are the seed's float32 results bit for
    bit: its ``pow(abs(diff), 2)`` is ``diff * diff`` and its ``pow(., 1 / 2)`` is ``sqrt`` in
    torch's kernels, the row sums in the same order."""
    return lambda x, y: (squared(x, y) + 1e-4 / x.shape[1]).sqrt()


def _cos_matrix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # F.normalize divides by max(norm, 1e-12): a zero vector stays finite.
    return F.normalize(x, dim=1) @ F.normalize(y, dim=1).T  # (B, M)


def _cos_paired(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (F.normalize(x, dim=1) * F.normalize(y, dim=1)).sum(1)  # (T,)


class Distance:
    """A distance: a ``matrix`` form ``f(x, y) -> (B, M)`` and, for named distances, a
    ``paired`` form on equal-length rows ``-> (T,)``. Calling it checks shapes and computes in
    float32 or wider with autocast off. ``zero_diagonal``: a self-distance matrix has an exact
    zero diagonal."""

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

    def __reduce__(self):
        # A named distance pickles by its name: its forms are lambdas.
        if _NAMED.get(self.name) is self:
            return get_distance, (self.name,)
        return super().__reduce__()

    def _widened(self, x: torch.Tensor, y: torch.Tensor, paired: bool):
        """``x`` and ``y``, checked, in their common dtype and at least float32."""
        check_distance_inputs(x, y, f"distance {self.name!r}", paired)
        dtype = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
        return x.to(dtype), y.to(dtype)

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The (B, M) distances between rows of ``x`` (B, D) and ``y`` (M, D; None: ``x``)."""
        self_distance = y is None
        x, y = self._widened(x, x if y is None else y, paired=False)
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = self.matrix_fn(x, y)
        check_matrix(out, x.shape[0], y.shape[0], f"distance {self.name!r}")
        if self_distance and self.zero_diagonal:
            # The Gram expansion leaves rounding residue. In place is safe: neither clamp_min
            # nor where saves its output for backward.
            out.fill_diagonal_(0)
        return out.to(torch.promote_types(out.dtype, torch.float32))

    def paired(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``d(x[i], y[i])`` of (T, D) rows, shape (T,)."""
        x, y = self._widened(x, y, paired=True)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if self.paired_fn is not None:
                return self.paired_fn(x, y)
            # A matrix-only distance: diagonals of small row-block matrices, (c, c) each.
            blocks = [
                self.matrix_fn(x[s : s + _PAIRED_BLOCK], y[s : s + _PAIRED_BLOCK]).diagonal()
                for s in range(0, x.shape[0], _PAIRED_BLOCK)
            ]
            return torch.cat(blocks) if blocks else x.new_zeros(0)


def _derived(transform, matrix: MatrixFn, paired: MatrixFn, name: str, zero_diagonal=False):
    """The :class:`Distance` ``transform(d)`` of a distance d given by its two forms."""
    return Distance(
        lambda x, y: transform(matrix(x, y)),
        lambda x, y: transform(paired(x, y)),
        name,
        zero_diagonal,
    )


_NAMED = {
    "squared": Distance(_squared_matrix, _squared_paired, "squared", zero_diagonal=True),
    "euclidean": _derived(_safe_sqrt, _squared_matrix, _squared_paired, "euclidean", True),
    "cosine": _derived(lambda cos: 1 - cos, _cos_matrix, _cos_paired, "cosine"),
    # arccos magnifies the rounding of cos(x, x) ~ 1 - 1e-16 to 1e-8: the diagonal is set to 0.
    "angular": _derived(_safe_arccos, _cos_matrix, _cos_paired, "angular", True),
    "seed_l2": Distance(_seed_l2(_squared_matrix), _seed_l2(_squared_paired), "seed_l2"),
}

DISTANCE_NAMES = tuple(_NAMED)

DistanceLike = str | MatrixFn | Distance


def get_distance(name_or_callable: DistanceLike) -> Distance:
    """The :class:`Distance` of a name in ``DISTANCE_NAMES`` or of a callable
    ``f(x, y) -> (B, M)`` (which then, too, runs in float32 or wider)."""
    if isinstance(name_or_callable, Distance):
        return name_or_callable
    if isinstance(name_or_callable, str):
        return _NAMED[check_choice(name_or_callable, DISTANCE_NAMES, "get_distance", "distance")]
    if callable(name_or_callable):
        return Distance(name_or_callable, name=getattr(name_or_callable, "__name__", "custom"))
    raise TypeError(
        f"distance must be a name ({', '.join(DISTANCE_NAMES)}) or a callable, got "
        f"{name_or_callable!r}"
    )


def pairwise_distance(
    x: torch.Tensor, y: torch.Tensor | None = None, metric: DistanceLike = "squared"
) -> torch.Tensor:
    """The (B, M) distances between rows of ``x`` (B, D) and ``y`` (M, D; None: ``x``, with an
    exact zero diagonal for squared and euclidean); float64 if an input is, else float32."""
    return get_distance(metric)(x, y)


def paired_distance(
    x: torch.Tensor, y: torch.Tensor, metric: DistanceLike = "squared"
) -> torch.Tensor:
    """Row-by-row distances ``d(x[i], y[i])`` of (T, D) inputs, shape (T,)."""
    return get_distance(metric).paired(x, y)
