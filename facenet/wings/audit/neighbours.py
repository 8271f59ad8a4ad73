"""Exact nearest rows of one set of embeddings in another, in chunks of queries (the retrieval
wing's operands and selection): never the (Q, N) distance matrix whole.

Memory: ``CHUNK_BYTES`` (64 MiB) of squared distances per chunk of queries, with the chunk's
operands and candidates, and the (N, D + 2) operands of the reference set (two while they are
made): for a million 256-D reference rows 2 GiB at most, besides the rows themselves (1 GiB).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.functional import normalize

from facenet.wings.retrieval import CHUNK_BYTES, cdist_operands, nearest_columns


def unit_rows(embeddings) -> torch.Tensor:
    """(N, D) float32 rows of length 1: Euclidean distances between them are monotone in the
    cosine distance, whatever the features (raw, or flip-concatenated)."""
    return normalize(torch.as_tensor(np.asarray(embeddings), dtype=torch.float32), dim=1)


def nearest(queries: torch.Tensor, reference: torch.Tensor, k: int):
    """``(indices, distances)``, (Q, k) each, nearest first: each query's ``k`` nearest rows of
    ``reference`` (N, D) by Euclidean distance (k at most N)."""
    k = min(k, len(reference))
    _, right = cdist_operands(reference)  # (N, D + 2)
    chunk = max(1, CHUNK_BYTES // (4 * max(len(reference), 1)))
    indices, distances = [], []
    for first in range(0, len(queries), chunk):
        left, _ = cdist_operands(queries[first : first + chunk])  # (C, D + 2)
        squared = left @ right.T  # (C, N)
        found = nearest_columns(squared, k)  # (C, k)
        indices.append(found)
        distances.append(squared.gather(1, found).clamp_min(0).sqrt())
    if not indices:
        return torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k)
    return torch.cat(indices), torch.cat(distances)


def nearest_other(queries: torch.Tensor, reference: torch.Tensor, own: torch.Tensor):
    """``(indices, distances)``, (Q,) each: each query's nearest row of ``reference`` other than
    its ``own`` (Q,) row; ``reference`` holds at least two rows."""
    found, distances = nearest(queries, reference, 2)  # (Q, 2)
    second = found[:, 0] == own  # its own row came first: take the next
    return found[:, 0].where(~second, found[:, 1]), distances[:, 0].where(~second, distances[:, 1])
