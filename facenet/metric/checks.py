"""The input checks of distances, miners and losses: one wording for each mistake.

Every public entry point of :mod:`facenet.metric` checks its embeddings, labels and index
triplets here, so a (B,) tensor passed for (B, D) embeddings reads the same whether a miner,
a loss or a distance caught it. ``who`` (the class or function name) starts each message.

Checks on values, and what each costs (none reads the device on the training path):

- Shapes, dtypes, labels: from tensor metadata, free.
- Index ranges (:func:`check_index_range`: the ``Triplets`` a loss is given, the
  ``candidates`` a miner filters): every index in ``[0, rows)``. Negative indices would wrap
  around to the last rows and indices past the end fail somewhere deep in an indexing kernel,
  so both are refused. The check is ``torch._assert_async``: one comparison and reduction
  over the indices, on the device, with no host read. On the CPU it raises at once (an
  ``IndexError`` naming the argument, the bound and the offending values). On CUDA it is a
  device-side assert, reported by the next synchronising call and fatal to the process's CUDA
  context, as CUDA's own indexing assert is: a bad index is a bug in the caller, not data.
  Other devices (no ``_assert_async`` kernel) read the flag back to the host.
- Non-finite embeddings, ``on_nonfinite`` of the miners and losses. NaN or inf embeddings are
  a data condition (a damaged image, a diverging run), so they never end a CUDA context:

  - ``"defer"`` (the default; what :class:`facenet.training.engine.Trainer` relies on): no
    host read. A miner selects nothing from a batch holding a non-finite embedding (the flag
    is folded into the selection whose size the miner reads anyway) and a loss given one is
    NaN. The Trainer already checks each step's loss, gradients and BatchNorm statistics
    (``Trainer._finite``, one host read per step) and, after a step that selected nothing,
    its images (``Trainer._check_images``): the step is undone and the images are named.
    Cost here: one ``isfinite`` reduction over the (B, D) embeddings.
  - ``"raise"``: refuse at once with a ``ValueError`` naming the rows
    (:func:`check_finite`). On the CPU that costs nothing more; on an accelerator it reads
    one flag back, a host synchronisation per call, so a training loop that checks its loss
    (as the Trainer does) keeps ``"defer"``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "ON_NONFINITE",
    "all_finite",
    "check_embeddings",
    "check_embedding_pair",
    "check_finite",
    "check_index_range",
    "check_index_triplets",
    "check_labels",
    "check_on_nonfinite",
]

ON_NONFINITE = ("defer", "raise")

# Devices with a ``torch._assert_async`` kernel: the range check stays on the device there.
_ASYNC_ASSERT_DEVICES = ("cpu", "cuda")
_SHOWN = 5  # offending values or rows quoted in a message


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


def check_on_nonfinite(on_nonfinite: str, who: str) -> str:
    """Raise unless ``on_nonfinite`` is one of ``ON_NONFINITE``; return it.

    Args:
        on_nonfinite: "defer" or "raise" (see the module docstring).
        who: the caller, for the message.
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"{who}: unknown on_nonfinite {on_nonfinite!r}; valid: " + ", ".join(ON_NONFINITE)
        )
    return on_nonfinite


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the device: every value of every tensor is finite. No host read.

    Args:
        tensors: the tensors to look at (any shapes, one device).
    """
    flags = [torch.isfinite(t).all() for t in tensors]
    return torch.stack(flags).all() if len(flags) > 1 else flags[0]


def _quote(values: list, total: int) -> str:
    """The first few of ``total`` values, as "1, 2, 3 (and 7 more)"."""
    shown = ", ".join(str(v) for v in values[:_SHOWN])
    return shown + (f" (and {total - _SHOWN} more)" if total > _SHOWN else "")


def check_finite(embeddings: torch.Tensor, who: str, name: str = "embeddings") -> None:
    """Raise a ``ValueError`` naming the rows of (B, D) ``embeddings`` that hold NaN or inf.

    Reads one flag back to the host: a synchronisation on an accelerator (see the module
    docstring for the check that costs none).

    Args:
        embeddings: (B, D) embeddings.
        who: the caller, for the message.
        name: the argument's name, for the message.
    """
    bad = ~torch.isfinite(embeddings).all(dim=1)  # (B,)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten().tolist()
    raise ValueError(
        f"{who}: {len(rows)} of {embeddings.shape[0]} {name} rows hold NaN or infinite "
        f"values (rows {_quote(rows, len(rows))}); no triplet can be mined from them or "
        "trained on"
    )


def check_index_range(index: torch.Tensor, rows: int, who: str, name: str, of: str) -> None:
    """Refuse an index outside ``[0, rows)`` without a host read (``torch._assert_async``).

    On the CPU a bad index raises an ``IndexError`` at once; on CUDA it is a device-side
    assert (module docstring); elsewhere the flag is read back to the host.

    Args:
        index: (T,) integer indices.
        rows: the number of rows they index.
        who: the caller, for the message.
        name: what they are ("anchor", "candidate negative"), for the message.
        of: what they index ("embeddings", "ref_embeddings"), for the message.
    """
    ok = ((index >= 0) & (index < rows)).all()  # 0-dim bool, on the device
    message = (
        f"{who}: {name} indices must lie in [0, {rows}) ({of} has {rows} rows; a negative "
        "index would wrap around to the last rows)"
    )
    if index.device.type == "cuda":
        torch._assert_async(ok, message)  # no host read: CUDA reports it asynchronously
        return
    try:
        if index.device.type in _ASYNC_ASSERT_DEVICES:
            torch._assert_async(ok, message)  # on the CPU this raises at once
        elif not bool(ok):
            raise RuntimeError(message)
    except RuntimeError:
        bad = index[(index < 0) | (index >= rows)].tolist()  # only once refused: the details
        raise IndexError(f"{message}; got {_quote(bad, len(bad))}") from None


def check_index_triplets(
    triplets,
    device: torch.device,
    who: str,
    what: str = "triplet",
    rows: tuple[int, int] | None = None,
    of: tuple[str, str] = ("embeddings", "embeddings"),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, positive, negative) index tensors as int64, each (T,), on ``device``.

    Args:
        triplets: a 3-sequence of integer index tensors (or sequences).
        device: where the returned tensors go (the embeddings' device).
        who: the caller, for the message.
        what: what the caller calls them: "triplet" (a loss) or "candidate" (a miner).
        rows: (rows the anchors index, rows the positives and negatives index): each index
            must lie in ``[0, rows)`` (:func:`check_index_range`); None skips the range check.
        of: the names of those two tensors, for the message.
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
    if rows is not None:
        limits = (("anchor", a, rows[0], of[0]), ("positive", p, rows[1], of[1]))
        for name, t, limit, target in (*limits, ("negative", n, rows[1], of[1])):
            check_index_range(t, limit, who, prefix + name, target)
    return a.long(), p.long(), n.long()
