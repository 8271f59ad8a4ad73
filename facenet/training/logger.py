"""Per-run logging: one JSON line per epoch in ``metrics.jsonl``, and TensorBoard: ``train/``
every log interval (x: the global step), ``train_epoch/`` and ``memory/`` every epoch,
``eval/val/`` at each validation (x: the epoch, 0 before training), ``eval/test/best|last/``
at the end, hyper-parameters with the final figures in the HPARAMS tab.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from facenet.distributed import is_distributed
from facenet.files import json_safe
from facenet.memory import MEMORY_KEYS


def _numbers(values: dict) -> dict:
    return {
        k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def max_over_ranks(figures: dict) -> dict:
    """``figures`` with its CUDA ones (``cuda_*``) the maximum over the ranks: each rank has
    its own allocator, and the two-pass and chunked steps forward different images on each. A
    collective, when there are CUDA figures."""
    keys = [key for key in figures if key.startswith("cuda_")]
    if not keys or not is_distributed():
        return figures
    cuda = torch.distributed.get_backend() == "nccl"  # NCCL needs CUDA tensors, gloo CPU ones
    values = torch.tensor([figures[key] for key in keys], device="cuda" if cuda else "cpu")
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    return {**figures, **dict(zip(keys, values.tolist()))}


class RunLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events into a run directory (rank 0:
    ``enabled``)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        tensorboard = enabled and tensorboard
        self.writer = SummaryWriter(self.run_dir / "tensorboard") if tensorboard else None

    def log_scalars(self, prefix: str, values: dict, step: int) -> None:
        if self.writer is not None:
            for key, value in _numbers(values).items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def log_epoch(self, record: dict) -> None:
        """Every rank calls it: the record's CUDA figures become the maximum over the ranks
        (:func:`max_over_ranks`); rank 0 writes it."""
        record.update(max_over_ranks(record))
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
        if self.writer is None:
            return
        epoch = int(record.get("epoch", 0))
        for key, value in _numbers(record).items():
            prefix = "memory" if key in MEMORY_KEYS else "train_epoch"
            if key != "epoch":
                self.writer.add_scalar(f"{prefix}/{key}", value, epoch)
        self.writer.flush()

    def log_figure(self, tag: str, figure, step: int) -> None:
        if self.writer is not None:
            self.writer.add_figure(tag, figure, step, close=True)

    def log_hparams(self, config: dict, metrics: dict) -> None:
        """``config``: ``config_to_dict``'s, flattened to ``section.key`` with values TensorBoard
        accepts (None becomes "none")."""
        if self.writer is None:
            return
        flat = {
            f"{section}.{key}": value
            if isinstance(value, (int, float, str, bool))
            else str(value).lower()
            for section, values in config.items()
            for key, value in values.items()
        }
        self.writer.add_hparams(flat, _numbers(metrics), run_name=".")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
