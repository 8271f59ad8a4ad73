"""What a training run prints: epoch and interval lines, warnings, the stop signals and message,
the final figures (and those TensorBoard shows beside the hyper-parameters), and every error as
one line naming the file or key (rank 0's console only)."""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import sys
from pathlib import Path

from facenet.config import Config
from facenet.distributed import is_main_process
from facenet.errors import NonFiniteInputError, one_line
from facenet.evaluation.report import figures_line
from facenet.memory import format_bytes
from facenet.training.state import Progress


def epoch_line(record: dict, epochs: int) -> str:
    line = (
        f"epoch {record['epoch']}/{epochs}  loss {record['loss']:.4f}  "
        f"active {record['active_fraction']:.2f}  {record['images_per_second']:.0f} img/s  "
        f"(input wait {record['data_wait_fraction']:.0%})  "
        f"| rss {format_bytes(record['peak_rss_bytes'])}"
    )
    if "graph_bytes_peak" in record:
        line += (
            f" graph peak {format_bytes(record['graph_bytes_peak'])} "
            f"alive {format_bytes(record['graph_bytes_alive'])}"
        )
    if "cuda_max_allocated" in record:
        line += f" cuda {format_bytes(record['cuda_max_allocated'])}"
    if "validation" in record:
        line += "  | " + figures_line("validation", record["validation"])
    return line


def collapse_warning(record: dict, margin: float) -> str | None:
    """The loss sits at the margin with d(a,p) ~ d(a,n) below it: the embeddings collapsed
    (random initial embeddings also give d(a,p) ~ d(a,n), but far apart)."""
    dan = record.get("mean_dan", math.nan)
    gap = dan - record.get("mean_dap", math.nan)
    if abs(gap) < 0.05 * margin and dan < margin and record.get("triplet_loss", 0.0) > 0.9 * margin:
        return (
            f"warning: possible collapse at epoch {record['epoch']}: triplet loss "
            f"{record['triplet_loss']:.4f} ~ margin {margin} with d(a,n) - d(a,p) = {gap:.4f}"
        )
    return None


def idle_warning(record: dict) -> str | None:
    no_triplets = record.get("skipped_no_triplets", 0)
    nonfinite = record.get("skipped_nonfinite", 0)
    if record.get("steps", 0) and no_triplets + nonfinite == record["steps"]:
        return (
            f"warning: epoch {record['epoch']} trained on no step ({no_triplets} without "
            f"triplets, {nonfinite} non-finite: loss, gradients, embeddings or an fp16 overflow)"
        )
    return None


def show_bar(cfg: Config) -> bool:
    """A progress bar only on rank 0 and only on a terminal (a log file gets lines)."""
    return cfg.logging.progress and is_main_process() and sys.stderr.isatty()


class StopSignals:
    """SIGINT/SIGTERM set a flag (``received()``, this rank's): the current step finishes and a
    checkpoint is written. A second signal raises ``KeyboardInterrupt`` at once (the checkpoint
    on disk is intact: writes are atomic). ``then``: what the run does after the first."""

    def __init__(self, then: str = "finishing the current step, then writing a checkpoint"):
        self.signal: str | None = None
        self.then = then
        self._previous: dict = {}

    def received(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt(f"second signal {signal.Signals(signum).name}")
        self.signal = signal.Signals(signum).name
        if is_main_process():  # one console line, though every rank gets the signal
            print(
                f"{self.signal} received: {self.then} (send it again to stop at once)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave the handlers
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def stop_message(signal_name: str, progress: Progress, path: Path) -> str:
    if progress.steps_done:
        where = f"after step {progress.steps_done} of epoch {progress.epoch}"
        then = f"step {progress.steps_done + 1} of epoch {progress.epoch}"
    else:
        where = f"after epoch {progress.epoch - 1}"
        then = f"epoch {progress.epoch}"
    return (
        f"stopped by {signal_name} {where}; checkpoint written to {path}; "
        f"--resume continues with {then}"
    )


def final_lines(summary: dict) -> list[str]:
    lines = []
    before = (summary.get("before_training") or {}).get("validation")
    best = summary.get("best_validation")
    if best:
        start = f"{before['accuracy_mean']:.4f} before training -> " if before else ""
        threshold = summary["threshold"]
        lines.append(
            f"validation: accuracy {start}{best['accuracy_mean']:.4f} at epoch "
            f"{summary['best_epoch']} (best.pt; threshold {threshold['value']:.4f} on "
            f"{threshold['distance']} distance)"
        )
    test = dict(summary.get("test") or {})
    if "best" in test and test["best"]["epoch"] == test["last"]["epoch"]:
        test = {"same": test.pop("best")}  # best.pt is the last model: one line
    for name, values in test.items():
        what = {"best": "best.pt", "last": "last model", "same": "best.pt = last model"}[name]
        line = figures_line(f"test ({what}, epoch {values['epoch']}):", values)
        at_threshold = values.get("accuracy_at_validation_threshold")
        if at_threshold is not None:
            line += f"; accuracy at the validation threshold {at_threshold:.4f}"
        lines.append(line)
    return lines


def hparam_metrics(summary: dict) -> dict:
    """The figures shown next to the hyper-parameters in TensorBoard."""
    metrics = {}
    if summary["best_validation"]:
        metrics["hparam/best_validation_accuracy"] = summary["best_validation"]["accuracy_mean"]
    for name, values in (summary["test"] or {}).items():
        metrics[f"hparam/test_{name}_accuracy"] = values["accuracy_mean"]
    return metrics


def name_input_files(err: NonFiniteInputError, loader, epoch: int, first_step: int):
    """The error, its message naming the epoch, the step and (PK batches) the files."""
    position = err.batch_index  # set by Trainer.train_one_epoch
    dataset, batch_sampler = loader.dataset, getattr(loader, "batch_sampler", None)
    dataset = getattr(dataset, "dataset", dataset)  # under SeededSamples
    items = ()
    if hasattr(dataset, "samples") and batch_sampler is not None:
        # The order of an epoch is fixed, so iterating the sampler again finds the same batch.
        items = next(itertools.islice(iter(batch_sampler), position, None), ())
    indices = [item[0] if isinstance(item, tuple) else item for item in items]
    rows = err.rows[:3]  # the first three files
    files = [dataset.samples[indices[r]][0] for r in rows if r < len(indices)]
    named = ""
    if files:
        named = ": " + ", ".join(files) + (" ..." if len(err.rows) > len(files) else "")
    return NonFiniteInputError(
        f"epoch {epoch}, step {first_step + position + 1}: {err}{named}", rows=err.rows
    )


def describe_error(err: BaseException) -> str:
    """One line for the user: what went wrong, naming the file or configuration key."""
    text = one_line(err)
    note = getattr(err, "checkpoint_note", None)
    return f"{text} ({note})" if note else text
