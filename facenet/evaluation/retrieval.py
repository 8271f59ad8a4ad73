"""Retrieval figures of embeddings: Precision@1, R-Precision and MAP@R.

Definitions of Musgrave et al., "A Metric Learning Reality Check" (2020), as
pytorch-metric-learning's ``AccuracyCalculator`` computes them when the query set is the
reference set: each query's own row is left out, R is the number of other rows of its label,
queries with R = 0 are left out (and counted), neighbours are exact (Euclidean, ``torch.cdist``,
float32, ties broken by the lower row index) and every figure is a plain mean over the queries used.
"""

from __future__ import annotations

import numpy as np
import torch

CHUNK_BYTES = 2**28  # distances of one chunk of queries against every row: 256 MiB


def _nearest(distances: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (C, n) of each row's n smallest distances, ties broken by the lower index."""
    top = distances.topk(n, largest=False).indices.sort(dim=1).values
    top = top.gather(1, distances.gather(1, top).sort(dim=1, stable=True).indices)
    # a tie across the n-th place: topk's choice among the tied is arbitrary, so sort the row
    boundary = (distances <= distances.gather(1, top[:, -1:])).sum(dim=1) > n
    if boundary.any():
        top[boundary] = distances[boundary].sort(dim=1, stable=True).indices[:, :n]
    return top


def _neighbour_labels(queries, everything, first, labels, k):
    """Labels (C, k) of each query's k nearest other rows, picked as pytorch-metric-learning's
    CustomKNN picks them: the k + 1 nearest, then the query's own row dropped (or the last)."""
    found = _nearest(torch.cdist(queries, everything), k + 1)  # (C, k+1)
    own = found == torch.arange(first, first + len(queries)).unsqueeze(1)
    own[~own.any(dim=1), -1] = True
    return labels[found[~own].view(len(queries), k)]


def retrieval_metrics(embeddings, labels) -> dict:
    """``precision_at_1``, ``r_precision``, ``mean_average_precision_at_r`` of ``embeddings``
    (N, D) with integer ``labels`` (N,) (tensors or arrays), plus ``queries`` (used) and
    ``lone_queries`` (R = 0, left out). Memory: 256 MiB of distances per chunk of queries plus
    (chunk, k) neighbours, k the largest R; 100,000 x 128 embeddings stay well under 2 GB."""
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
    for first in range(0, len(x) if k else 0, chunk):
        rows = slice(first, first + chunk)
        same = _neighbour_labels(x[rows], x, first, y, k) == y[rows].unsqueeze(1)  # (C, k)
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
