"""Per-run logging: one JSON line per epoch, TensorBoard scalars, figures and hyper-parameters.

TensorBoard tags are grouped: ``train/`` every log interval (x: the global step),
``train_epoch/`` and ``memory/`` every epoch, ``eval/val/`` at each validation (x: the epoch,
0 before training), ``eval/test/best|last/`` once at the end, and the run's hyper-parameters
with its final figures in the HPARAMS tab.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from facenet.files import json_safe
from facenet.memory import MEMORY_KEYS

__all__ = ["RunLogger", "flat_hparams"]

# Epoch-record keys that are memory figures (the rest of the numbers are training figures).
_MEMORY = MEMORY_KEYS


def _numbers(values: dict) -> dict:
    """The int and float entries (not bools) of ``values``."""
    return {
        k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def flat_hparams(config: dict) -> dict:
    """``{"section.key": value}`` of a configuration dict, values TensorBoard accepts.

    Args:
        config: ``{section: {key: value}}`` (``config_to_dict``); None becomes "none".
    """
    flat = {}
    for section, values in config.items():
        for key, value in values.items():
            ok = isinstance(value, (int, float, str, bool))
            flat[f"{section}.{key}"] = value if ok else str(value).lower()
    return flat


class RunLogger:
    """Writes ``metrics.jsonl`` and TensorBoard events into a run directory.

    Args:
        run_dir: the run directory (created if needed).
        tensorboard: also write TensorBoard events (``torch.utils.tensorboard``).
        enabled: False on non-zero distributed ranks: then nothing is written.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            self.writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log_scalars(self, prefix: str, values: dict, step: int) -> None:
        """``prefix/key`` for every number in ``values`` at ``step`` (TensorBoard only)."""
        if self.enabled and self.writer is not None:
            for key, value in _numbers(values).items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def log_epoch(self, record: dict) -> None:
        """Append one line to ``metrics.jsonl``; its numbers to ``train_epoch/``, ``memory/``."""
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
        epoch = int(record.get("epoch", 0))
        numbers = {k: v for k, v in _numbers(record).items() if k != "epoch"}
        self.log_scalars("memory", {k: v for k, v in numbers.items() if k in _MEMORY}, epoch)
        self.log_scalars(
            "train_epoch", {k: v for k, v in numbers.items() if k not in _MEMORY}, epoch
        )
        if self.writer is not None:
            self.writer.flush()

    def log_figure(self, tag: str, figure, step: int) -> None:
        """Add a matplotlib figure to TensorBoard (the figure is closed)."""
        if self.enabled and self.writer is not None and figure is not None:
            self.writer.add_figure(tag, figure, step, close=True)

    def log_hparams(self, config: dict, metrics: dict) -> None:
        """The run's settings with its final figures, for TensorBoard's HPARAMS tab.

        Args:
            config: the configuration as a dict (``config_to_dict``).
            metrics: ``{"hparam/<name>": number}``; non-numbers are left out.
        """
        if self.enabled and self.writer is not None:
            self.writer.add_hparams(flat_hparams(config), _numbers(metrics), run_name=".")

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
