"""Input checks of distances, miners and losses: one wording for each mistake, ``who`` first.

Shapes, dtypes and labels are read from metadata, free. Index ranges are checked with
``torch._assert_async``, with no host read: on the CPU a bad index raises an ``IndexError`` at
once; on CUDA it is a device-side assert, fatal to the context as CUDA's own indexing assert is.
NaN or inf embeddings are a data condition and never end a context: under ``"defer"`` (what
the Trainer relies on) a miner selects nothing and a loss is NaN, at the cost of one
``isfinite`` reduction; ``"raise"`` names the rows at once (a host read per call).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from facenet.errors import some_names

ON_NONFINITE = ("defer", "raise")
INPUTS = ("embeddings", "ref_embeddings")  # what a loss's anchors, and its p and n, index

_SHOWN = 5  # offending values or rows quoted in a message


def check_embeddings(embeddings: torch.Tensor, who: str, name: str = "embeddings") -> None:
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, torch.Tensor) else embeddings
        raise ValueError(f"{who}: {name} must be a 2-D tensor (B, D), got {shape}")


def check_distance_inputs(x: torch.Tensor, y: torch.Tensor, who: str, paired: bool) -> None:
    """(B, D) ``x`` and (M, D) ``y`` of one width; ``paired``: also B == M."""
    check_embeddings(x, who, "x")
    check_embeddings(y, who, "y")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"{who}: embedding widths differ: {tuple(x.shape)} vs {tuple(y.shape)}")
    if paired and x.shape[0] != y.shape[0]:
        raise ValueError(f"{who}: paired rows differ in number: {x.shape[0]} vs {y.shape[0]}")


def check_matrix(matrix: torch.Tensor, rows: int, columns: int, who: str) -> None:
    """What a distance callable returned: (rows, columns) distances."""
    if matrix.shape != (rows, columns):
        raise ValueError(f"{who} returned shape {tuple(matrix.shape)}, expected {(rows, columns)}")


def check_count(value, minimum: int, who: str, name: str) -> int:
    """An int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{who}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def check_labels(labels, embeddings: torch.Tensor, who: str) -> torch.Tensor:
    """Identity labels as a (B,) integer tensor on the embeddings' device."""
    if labels is None:
        raise ValueError(f"{who}: labels are required unless candidates are given")
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


def check_choice(value: str, choices: tuple[str, ...], who: str, name: str) -> str:
    if value not in choices:
        raise ValueError(f"{who}: unknown {name} {value!r}; valid: " + ", ".join(choices))
    return value


def finite_flag(on_nonfinite: str, who: str, *tensors: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on the device (no host read): every value of the (B, D)
    ``embeddings`` (and ``ref_embeddings``) is finite. Each must be 2-D; under "raise", a
    ``ValueError`` names the rows holding NaN or inf (one host read)."""
    for name, t in zip(INPUTS, tensors):
        check_embeddings(t, who, name)
        if on_nonfinite != "raise":
            continue
        rows = (~torch.isfinite(t).all(dim=1)).nonzero().flatten().tolist()  # (bad rows,)
        if rows:
            raise ValueError(
                f"{who}: {len(rows)} of {t.shape[0]} {name} rows hold NaN or infinite values "
                f"(rows {some_names(rows, _SHOWN)}); no triplet can be mined from them or "
                "trained on"
            )
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def check_index_range(index: torch.Tensor, rows: int, who: str, name: str, of: str) -> None:
    """Refuse an index of ``name`` outside ``[0, rows)`` of ``of``; devices other than the CPU
    and CUDA (no ``_assert_async`` kernel) read the flag back to the host."""
    ok = ((index >= 0) & (index < rows)).all()  # 0-dim bool, on the device
    message = (
        f"{who}: {name} indices must lie in [0, {rows}) ({of} has {rows} rows; a negative "
        "index would wrap around to the last rows)"
    )
    try:
        if index.device.type in ("cpu", "cuda"):
            # No host read: CUDA reports a failure asynchronously, the CPU raises at once.
            torch._assert_async(ok, message)
        elif not bool(ok):
            raise RuntimeError(message)
    except RuntimeError:
        bad = index[(index < 0) | (index >= rows)].tolist()  # only once refused: the details
        raise IndexError(f"{message}; got {some_names(bad, _SHOWN)}") from None


def check_index_triplets(
    triplets, who: str, *inputs: torch.Tensor, what: str = "triplet"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(anchor, positive, negative) as int64 (T,) tensors on the inputs' device. ``inputs``:
    the embeddings the anchors index and, when given, the ref_embeddings the positives and
    negatives index; ``what``: "triplet" (a loss) or "candidate" (a miner)."""
    if not isinstance(triplets, Sequence) or len(triplets) != 3:
        count = len(triplets) if isinstance(triplets, Sequence) else type(triplets).__name__
        raise ValueError(
            f"{who}: {what}s must be a 3-tuple of index tensors (anchor, positive, negative), "
            f"got {count} (a 4-tuple of pairs (a1, p, a2, n) is not a triplet list)"
        )
    tensors = [torch.as_tensor(t, device=inputs[0].device) for t in triplets]  # (T,) each
    a, p, n = tensors
    if a.dim() != 1 or not a.shape == p.shape == n.shape:  # then all are 1-D
        raise ValueError(
            f"{who}: {what} index tensors must be 1-D and equally long, got shapes "
            f"{tuple(a.shape)}, {tuple(p.shape)}, {tuple(n.shape)}"
        )
    prefix = "" if what == "triplet" else f"{what} "
    last = len(inputs) - 1  # p and n index the last input
    for name, t, i in zip(("anchor", "positive", "negative"), tensors, (0, last, last)):
        if t.is_floating_point() or t.dtype == torch.bool:
            raise ValueError(f"{who}: {prefix}{name} indices must be integers, got dtype {t.dtype}")
        check_index_range(t, inputs[i].shape[0], who, prefix + name, INPUTS[i])
    return tuple(t.long() for t in tensors)
