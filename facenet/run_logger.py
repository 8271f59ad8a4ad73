"""Per-run logging: one JSON line per epoch, TensorBoard scalars and figures, console lines."""

from __future__ import annotations

import json
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from facenet.files import json_safe

__all__ = ["RunLogger"]


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

    def log_epoch(self, record: dict) -> None:
        """Append one line to ``metrics.jsonl`` and the numeric values to TensorBoard."""
        if not self.enabled:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(json_safe(record)) + "\n")
        if self.writer is not None:
            epoch = int(record.get("epoch", 0))
            for key, value in record.items():
                if (
                    key != "epoch"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self.writer.add_scalar(key, value, epoch)
            self.writer.flush()

    def log_figure(self, tag: str, figure, epoch: int) -> None:
        """Add a matplotlib figure to TensorBoard (the figure is closed)."""
        if self.enabled and self.writer is not None and figure is not None:
            self.writer.add_figure(tag, figure, epoch, close=True)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
