"""The input checks of distances, miners and losses: one wording for each mistake.

Every public entry point of :mod:`facenet.metric` checks its embeddings, labels and index
triplets here, so a (B,) tensor passed for (B, D) embeddings reads the same whether a miner,
a loss or a distance caught it. ``who`` (the class or function name) starts each message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_embeddings", "check_embedding_pair", "check_labels", "check_index_triplets"]


def check_embeddings(embeddings: torch.Tensor, who: str, name: str = "embeddings") -> None:
    """Raise unless ``embeddings`` is a 2-D tensor (B, D).

    Args:
        embeddings: the tensor to check.
        who: the caller, for the message.
        name: the argument's name, for the message ("embeddings", "ref_embeddings").
    """
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else embeddings
        raise ValueError(f"{who}: {name} must be a 2-D tensor (B, D), got {shape}")


def check_embedding_pair(x: torch.Tensor, y: torch.Tensor, who: str) -> None:
    """Raise unless ``x`` (N, D) and ``y`` (M, D) are 2-D and equally wide.

    Args:
        x: the first embeddings.
        y: the second embeddings.
        who: the caller, for the message.
    """
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(
            f"{who}: embeddings must be 2-D (N, D); got shapes {tuple(x.shape)} and "
            f"{tuple(y.shape)}"
        )
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"{who}: embedding widths differ: {tuple(x.shape)} vs {tuple(y.shape)}")


def check_labels(labels, embeddings: torch.Tensor, who: str, hint: str = "") -> torch.Tensor:
    """Identity labels as a (B,) integer tensor on the embeddings' device.

    Args:
        labels: a tensor or sequence of B integer labels.
        embeddings: the (B, D) embeddings they label.
        who: the caller, for the message.
        hint: appended to the message for missing labels (e.g. " unless candidates are given").
    """
    if labels is None:
        raise ValueError(f"{who}: labels are required{hint}")
    labels = torch.as_tensor(labels, device=embeddings.device)
    if labels.dim() != 1 or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"{who}: labels must have shape ({embeddings.shape[0]},) to match embeddings "
            f"{tuple(embeddings.shape)}, got {tuple(labels.shape)}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        # 1.0 and 1.0000001 would be different identities; True/False only two of them.
        raise ValueError(f"{who}: labels must be integers, got dtype {labels.dtype}")
    return labels


def check_index_triplets(
    triplets, device: torch.device, who: str, what: str = "triplet"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, positive, negative) index tensors as int64, each (T,), on ``device``.

    Args:
        triplets: a 3-sequence of integer index tensors (or sequences).
        device: where the returned tensors go (the embeddings' device).
        who: the caller, for the message.
        what: what the caller calls them: "triplet" (a loss) or "candidate" (a miner).
    """
    if not isinstance(triplets, Sequence) or len(triplets) != 3:
        count = len(triplets) if isinstance(triplets, Sequence) else type(triplets).__name__
        raise ValueError(
            f"{who}: {what}s must be a 3-tuple of index tensors (anchor, positive, negative), "
            f"got {count} (a 4-tuple of pairs (a1, p, a2, n) is not a triplet list)"
        )
    a, p, n = (torch.as_tensor(t, device=device) for t in triplets)  # (T,) each
    prefix = "" if what == "triplet" else f"{what} "
    for name, t in (("anchor", a), ("positive", p), ("negative", n)):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{who}: {prefix}{name} indices must be integers, got dtype {t.dtype}")
    if not (a.dim() == p.dim() == n.dim() == 1) or not (a.shape == p.shape == n.shape):
        raise ValueError(
            f"{who}: {what} index tensors must be 1-D and equally long, got shapes "
            f"{tuple(a.shape)}, {tuple(p.shape)}, {tuple(n.shape)}"
        )
    return a.long(), p.long(), n.long()
