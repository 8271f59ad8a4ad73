"""Retrieval figures of embeddings: Precision@1, R-Precision and MAP@R.

Definitions of Musgrave et al., "A Metric Learning Reality Check" (2020), as
pytorch-metric-learning's ``AccuracyCalculator`` computes them when the query set is the
reference set: each query's own row is left out, R is the number of other rows of its label,
queries with R = 0 are left out (and counted), neighbours are exact (Euclidean, float32, as
``torch.cdist`` computes them through its matrix product, its default beyond 25 rows; ties broken
by the lower row index) and every figure is a plain mean over the queries used.
"""

from __future__ import annotations

import math

import numpy as np
import torch

CHUNK_BYTES = 2**26  # squared distances of one chunk of queries against every row: 64 MiB


def cdist_operands(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, D + 2) operands whose product ``left[rows] @ right.T`` is the squared distance matrix
    before ``clamp_min(0).sqrt()``, bit for bit as torch.cdist forms it (PyTorch 2.14,
    aten/src/ATen/native/Distance.cpp, ``_euclidean_dist``; the tests hold them equal)."""
    norms = x.pow(2).sum(-1, keepdim=True)
    ones = torch.ones_like(norms)
    return torch.cat([x.mul(-2), norms, ones], -1), torch.cat([x, ones, norms], -1)


def _candidates(squared: torch.Tensor, m: int) -> torch.Tensor:
    """Columns (C, M) holding each row's m smallest values: group column j with j + L, j + 2L, ...;
    every value below the m-th smallest group minimum lies in one of the m groups of smallest
    minimum, and a value equal to it is interchangeable with that minimum."""
    rows, n = squared.shape
    # about sqrt(N / m) columns a group balance the (C, L) minima against the (C, m * group)
    # candidates; beyond 32 the scattered reads of the candidates cost more than they save
    group = max(1, min(32, math.isqrt(n // m)))
    length = n // group  # >= m, as group * m <= n
    minima = squared[:, : length * group].view(rows, group, length).amin(1)  # (C, L)
    groups = minima.topk(m, largest=False, sorted=False).indices  # (C, m)
    members = (groups.unsqueeze(2) + length * torch.arange(group)).flatten(1)  # (C, m * group)
    rest = torch.arange(length * group, n).expand(rows, -1)  # the columns no group holds
    return torch.cat([members, rest], 1)


def nearest_columns(squared: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (C, n) of each row's n smallest distances ``squared.clamp_min(0).sqrt()``, ties
    broken by the lower index. Candidates are ranked on ``squared``: the square root keeps its
    order but may merge neighbouring values, so ties are judged on the distances."""
    m = min(n + 1, squared.shape[1])
    columns = _candidates(squared, m)
    best = squared.gather(1, columns).topk(m, largest=False)  # sorted: (C, m)
    top = columns.gather(1, best.indices[:, :n]).sort(dim=1).values
    distances = squared.gather(1, top).clamp_min(0).sqrt()
    top = top.gather(1, distances.sort(dim=1, stable=True).indices)
    if m > n:  # the n smallest are a set only when the (n + 1)-th distance exceeds the n-th
        edge = best.values[:, n - 1 :].clamp_min(0).sqrt()  # (C, 2)
        tied = edge[:, 0] == edge[:, 1]
        if tied.any():
            row = squared[tied].clamp_min(0).sqrt()
            top[tied] = row.sort(dim=1, stable=True).indices[:, :n]
    return top


def _neighbour_labels(squared, first, labels, k):
    """Labels (C, k) of each query's k nearest other rows, picked as pytorch-metric-learning's
    CustomKNN picks them: the k + 1 nearest, then the query's own row dropped (or the last)."""
    found = nearest_columns(squared, k + 1)  # (C, k+1)
    own = found == torch.arange(first, first + len(squared)).unsqueeze(1)
    own[~own.any(dim=1), -1] = True
    return labels[found[~own].view(len(squared), k)]


def retrieval_metrics(embeddings, labels) -> dict:
    """``precision_at_1``, ``r_precision``, ``mean_average_precision_at_r`` of ``embeddings``
    (N, D) with integer ``labels`` (N,) (tensors or arrays), plus ``queries`` (used) and
    ``lone_queries`` (R = 0, left out). Memory: 64 MiB of distances per chunk of queries, two
    (N, D + 2) copies of the embeddings and (chunk, 32 k) candidates, k the largest R."""
    x = torch.as_tensor(np.asarray(embeddings), dtype=torch.float32)
    y = torch.as_tensor(np.asarray(labels)).long()
    if x.ndim != 2 or y.shape != (len(x),) or not torch.isfinite(x).all():
        raise ValueError(
            f"expected finite (N, D) embeddings and (N,) labels, got "
            f"{tuple(x.shape)} and {tuple(y.shape)}"
        )
    _, inverse, counts = torch.unique(y, return_inverse=True, return_counts=True)
    r = counts[inverse] - 1  # (N,) other rows of each query's label
    k = int(r.max()) if len(r) else 0
    sums = torch.zeros(3, dtype=torch.float64)
    chunk = max(1, CHUNK_BYTES // (4 * max(len(x), 1)))
    left, right = cdist_operands(x)  # (N, D + 2)
    squared = torch.empty(min(chunk, len(x)), len(x))  # reused: fresh pages cost a third more
    for first in range(0, len(x) if k else 0, chunk):
        rows = slice(first, first + chunk)
        queries = left[rows]
        block = torch.mm(queries, right.T, out=squared[: len(queries)])  # (C, N)
        same = _neighbour_labels(block, first, y, k) == y[rows].unsqueeze(1)  # (C, k)
        r_rows = r[rows].unsqueeze(1)  # (C, 1)
        within_r = same & (torch.arange(1, k + 1) <= r_rows)  # relevant hits in the first R
        hits = within_r.cumsum(dim=1) * within_r
        ap = (hits / torch.arange(1, k + 1, dtype=torch.float64)).sum(dim=1)
        per_query = torch.stack([same[:, 0], within_r.sum(dim=1), ap], 1).double()  # (C, 3)
        per_query[:, 1:] /= r_rows  # R-Precision and AP are over R; R = 0 rows are left out
        sums += per_query[r[rows] > 0].sum(dim=0)
    used = int((r > 0).sum())
    means = (sums / used).tolist() if used else [float("nan")] * 3
    return {
        "precision_at_1": means[0],
        "r_precision": means[1],
        "mean_average_precision_at_r": means[2],
        "queries": used,
        "lone_queries": len(x) - used,
    }
