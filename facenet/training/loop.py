"""The epochs of a run: train, validate, log, checkpoint; stop on a signal; test at the end.

``fit(run)`` is the loop a reader follows to ``optimizer.step()``: ``Run.train_epochs`` ->
``Trainer.train_one_epoch`` -> ``Trainer.train_step`` -> the step. A signal stops the run after
the current step, every rank agreeing (``any_rank``). When an epoch ends with an error,
``Run.checkpoint_at_error`` alone says how far the epoch got and writes the checkpoint that
``--resume`` continues from.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from facenet.checkpoint import remove_stale_temporary_files
from facenet.config import Config, config_to_dict
from facenet.data.images import CorruptImageError
from facenet.distributed import agree_on_error, any_rank, is_main_process
from facenet.errors import FacenetError, NonFiniteInputError, NonFiniteLossError, RankFailure
from facenet.evaluation.report import figures_line
from facenet.files import json_safe, write_text_atomic
from facenet.training.build import TrainingData
from facenet.training.console import (
    collapse_warning,
    describe_error,
    epoch_line,
    idle_warning,
    show_bar,
    stop_message,
)
from facenet.training.engine import Trainer
from facenet.training.logger import RunLogger
from facenet.training.run_dir import RunOutputs
from facenet.training.state import (
    Progress,
    remaining_loader,
    rewrite_metrics,
    save_for_error,
    save_on_main,
)
from facenet.training.validation import test_selected, validate

# torch re-raises a worker's exception with its traceback in the message, as a RuntimeError
# when the class cannot be built from one string (CorruptImageError takes path and reason).
_WORKER_IMAGE_ERROR = re.compile(
    r"CorruptImageError: corrupt or unreadable image (?P<path>.+): (?P<reason>[^:\n]+)\s*$"
)
# What can end an epoch early with a checkpoint first.
_EPOCH_ERRORS = (NonFiniteInputError, CorruptImageError, RankFailure, NonFiniteLossError)


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


@dataclass
class Run:
    """What the loop's parts share: the trainer, the data, the configuration, the run
    directory with the record of its outputs, where the run stands, and its logger."""

    trainer: Trainer
    data: TrainingData
    cfg: Config
    run_dir: Path
    outputs: RunOutputs
    progress: Progress = field(default_factory=Progress)
    logger: RunLogger | None = None

    def train_epochs(self, signals: StopSignals) -> str | None:
        """The epochs left; None when every epoch ran, else the name of the stopping signal."""
        progress, cfg = self.progress, self.cfg
        saved = False  # last.pt holds the current state
        # any_rank: a collective, so that every rank leaves the loop at the same epoch.
        while (
            progress.epoch <= cfg.train.epochs
            and not any_rank(signals.received())
            and patience_spent(progress, cfg.eval.patience) is None
        ):
            epoch, skip = progress.epoch, progress.steps_done
            self.data.sampler.set_epoch(epoch)
            loader = remaining_loader(self.data.loader, skip)
            batches = _CountedBatches(loader, skip, self.data.steps_per_epoch)
            try:
                record = self.trainer.train_one_epoch(
                    batches,
                    epoch,
                    log_interval=cfg.train.log_interval,
                    progress=show_bar(cfg),
                    should_stop=signals.received,
                    on_interval=self.log_interval,
                )
            except _EPOCH_ERRORS as err:
                raise self.checkpoint_at_error(err, batches) from None
            if skip + batches.yielded < batches.end:  # a signal stopped the epoch
                progress.steps_done = skip + batches.yielded
                break
            self.finish_epoch(record)
            saved = True
        return self.stopped_by(signals, saved)

    def log_interval(self, global_step: int, done: int, means: dict) -> None:
        """Every log interval: ``train/`` scalars by global step, and without a bar one line."""
        self.logger.log_scalars("train", means, global_step)
        if self.cfg.logging.progress and is_main_process() and not show_bar(self.cfg):
            print(
                f"epoch {self.progress.epoch} step {self.progress.steps_done + done}/"
                f"{self.data.steps_per_epoch}: loss {means['loss']:.4f} active "
                f"{means['active_fraction']:.2f} {means['images_per_second']:.0f} img/s",
                flush=True,
            )

    def checkpoint_at_error(self, err: Exception, batches: _CountedBatches) -> Exception:
        """Checkpoint where the epoch stopped; the error to raise. A batch with non-finite
        inputs was not trained (``--resume`` retries it); a non-finite loss's batch was."""
        progress = self.progress
        trained = batches.yielded - (1 if isinstance(err, NonFiniteInputError) else 0)
        progress.steps_done = batches.start + trained
        if isinstance(err, RankFailure) and not err.checkpointable:
            return err  # the failing rank leaves with a traceback; no collective checkpoint
        if isinstance(err, NonFiniteLossError):
            self.outputs.add(self.run_dir / "nonfinite.pt")
            last = self.run_dir / "last.pt"
            kept = f"{last} still holds epoch {progress.epoch - 1}" if last.is_file() else ""
            kept = kept or f"no checkpoint was written before ({last} does not exist)"
            err.checkpoint_note = f"{save_for_error(self, 'nonfinite.pt')} for inspection; {kept}"
            return err
        if isinstance(err, NonFiniteInputError):
            err = _name_files(err, batches.loader, progress.epoch, batches.start)
        saved = save_for_error(self, "last.pt")
        err.checkpoint_note = (
            f"{saved}; after fixing the data, --resume continues with step "
            f"{progress.steps_done + 1} of epoch {progress.epoch}"
        )
        return err

    def stopped_by(self, signals: StopSignals, saved: bool) -> str | None:
        """None when every epoch ran, else the signal's name, the current state in last.pt
        (written unless an epoch end in this loop wrote it)."""
        progress = self.progress
        # any_rank: the same collective the loop made, on every rank.
        if not any_rank(signals.received()) or progress.epoch > self.cfg.train.epochs:
            return None  # every epoch ran (a signal during the last step changes nothing)
        if not saved or progress.steps_done:  # the state on disk is not the current one
            save_on_main(self, "last.pt")
        signal_name = signals.signal or "SIGTERM"  # another rank received it
        if is_main_process():
            print(stop_message(signal_name, progress, self.run_dir / "last.pt"), file=sys.stderr)
        return signal_name

    def finish_epoch(self, record: dict) -> None:
        """Validate, log and checkpoint a finished epoch; best.pt follows validation accuracy."""
        cfg, progress, epoch = self.cfg, self.progress, record["epoch"]
        if self.data.val_pairs is not None and _due(cfg, epoch):
            try:
                record["validation"] = validate(self, epoch)
            except FacenetError as err:  # e.g. an unreadable validation image
                if isinstance(err, RankFailure) and not err.checkpointable:
                    raise  # the failing rank leaves with a traceback; no collective checkpoint
                progress.history.append(record)  # trained, not validated: kept in last.pt
                progress.epoch, progress.steps_done = epoch + 1, 0
                saved = save_for_error(self, "last.pt")
                err.checkpoint_note = (
                    f"{saved}: epoch {epoch} trained, not validated; --resume continues with "
                    f"epoch {epoch + 1}"
                )
                raise
        self.logger.log_epoch(record)
        progress.history.append(record)
        print(epoch_line(record, cfg.train.epochs), flush=True)
        for warning in (collapse_warning(record, cfg.loss.margin), idle_warning(record)):
            if warning:
                print(warning, file=sys.stderr)
        accuracy = record.get("validation", {}).get("accuracy_mean", -1.0)
        is_best = accuracy > progress.best
        if is_best:
            progress.best, progress.best_epoch = accuracy, epoch
        progress.epoch, progress.steps_done = epoch + 1, 0
        # best.pt first: last.pt never names a best epoch whose best.pt is not on disk.
        save_on_main(self, *(("best.pt", "last.pt") if is_best else ("last.pt",)))
        spent = patience_spent(progress, cfg.eval.patience)
        if spent is not None and epoch < cfg.train.epochs:
            print(spent, flush=True)


def patience_spent(progress: Progress, patience: int) -> str | None:
    """Why the run stops early, or None: ``patience`` (> 0) validations since the best one
    without a higher accuracy. Read from the history, so a resumed run decides the same."""
    if patience <= 0 or progress.best_epoch is None:
        return None
    since = [r for r in progress.history if "validation" in r and r["epoch"] > progress.best_epoch]
    if len(since) < patience:
        return None
    return (
        f"early stop after epoch {since[-1]['epoch']}: {len(since)} validations without a "
        f"better accuracy than epoch {progress.best_epoch}'s {progress.best:.4f} (eval.patience: "
        f"{patience}); best.pt holds epoch {progress.best_epoch}"
    )


def fit(run: Run) -> dict:
    """Train the run's epochs from ``run.progress`` (``state.restore``'s, on resume); the
    summary written to ``summary.json`` (``stopped_by``: the signal that stopped the run, or
    None). An error mid-epoch is raised after a checkpoint whose place its ``checkpoint_note``
    says."""
    cfg, data, progress, main = run.cfg, run.data, run.progress, is_main_process()
    if main:  # metrics.jsonl as the (restored) progress knows it
        remove_stale_temporary_files(run.run_dir)
        rewrite_metrics(run.run_dir, progress.history)
    run.logger = RunLogger(run.run_dir, tensorboard=cfg.logging.tensorboard, enabled=main)
    try:
        for note in data.notes if main else ():
            print(note, file=sys.stderr)
        if not progress.resumed and data.val_pairs is not None:
            progress.before_training = validate(run, 0)
            print(figures_line("before training: validation", progress.before_training))
        with StopSignals() as signals:
            stopped_by = run.train_epochs(signals)
        test = None
        if stopped_by is None and progress.history and data.test_pairs is not None:
            # A first signal lets the test finish; after a second, --resume runs the test.
            with StopSignals("finishing the test evaluation; the training is saved"):
                test = test_selected(run, _validation_of(progress, progress.best_epoch))
        early = progress.epoch <= cfg.train.epochs and patience_spent(progress, cfg.eval.patience)
        summary = _summary(progress, stopped_by, test, early or None)
        run.logger.log_hparams(config_to_dict(cfg), _final_metrics(summary))
    finally:
        run.logger.close()
    if main:
        write_text_atomic(run.run_dir / "summary.json", json.dumps(json_safe(summary), indent=2))
    return summary


def _due(cfg: Config, epoch: int) -> bool:
    """Whether validation runs after ``epoch``."""
    every = cfg.eval.every
    return every > 0 and (epoch % every == 0 or epoch == cfg.train.epochs)


def planned_outputs(cfg: Config, resumed: bool) -> list[str]:
    """The names a run of ``cfg`` writes in its run directory (``build_data`` adds the held-out
    pairs, an error ``nonfinite.pt``); validation and test pairs as ``build_data`` finds them."""
    ev, names = cfg.eval, ["config.yaml", "metrics.jsonl", "last.pt", "summary.json"]
    names += ["tensorboard"] if cfg.logging.tensorboard else []
    made = cfg.data.dataset == "synthetic" or ev.heldout_identities > 0
    val, test = ev.every > 0 and (made or ev.val_pairs), ev.every > 0 and (made or ev.pairs)
    names += ["best.pt"] if val or test else []
    epochs = [e for e in range(int(resumed), cfg.train.epochs + 1) if val and _due(cfg, e)]
    names += [f"roc_val_epoch_{e}.png" for e in epochs]
    return names + ["roc_test.png"] if test else names


class _CountedBatches:
    """An epoch's batches ``start`` to ``end`` (the epoch's one cap), counted as handed out.

    Under several processes every rank learns, before anyone steps, whether every rank's
    fetch succeeded: a rank that found a corrupt image does not leave the others waiting in
    the step's collectives. Stopping after ``limit`` batches (rather than fetching one more and
    discarding it) keeps the global RNG where a run stopped by a signal at that point leaves it.
    """

    def __init__(self, loader, start: int, end: int):
        self.loader, self.start, self.end, self.yielded = loader, start, end, 0
        self.limit = end - start

    def __len__(self) -> int:
        return min(len(self.loader), self.limit)

    def __iter__(self):
        batches = iter(itertools.islice(self.loader, self.limit))
        while True:
            try:
                batch, error = next(batches), None
            except StopIteration:  # every rank holds the same number of batches
                return
            except Exception as err:  # this rank's fetch failed
                batch, error = None, err
            _agree_on_fetch(error)
            self.yielded += 1
            yield batch


def _agree_on_fetch(error: Exception | None) -> None:
    """Raise on every rank when any rank's fetch failed (see ``agree_on_error``); a DataLoader
    worker's CorruptImageError, re-wrapped in a RuntimeError, is rebuilt."""
    text = str(error) if isinstance(error, RuntimeError) else ""
    match = _WORKER_IMAGE_ERROR.search(text) if text.startswith("Caught ") else None
    if match:
        error = CorruptImageError(match["path"], match["reason"].strip())
    agree_on_error(error, None if error is None else describe_error(error))


def _name_files(err: NonFiniteInputError, loader, epoch: int, first_step: int):
    """The error, its message naming the epoch, the step and (PK batches) the files."""
    position = err.batch_index  # set by Trainer.train_one_epoch
    dataset, batch_sampler = loader.dataset, getattr(loader, "batch_sampler", None)
    dataset = getattr(dataset, "dataset", dataset)  # under SeededSamples
    items = None
    if hasattr(dataset, "samples") and batch_sampler is not None:
        # The order of an epoch is fixed, so iterating the sampler again finds the same batch.
        items = next(itertools.islice(iter(batch_sampler), position, None), None)
    indices = [item[0] if isinstance(item, tuple) else item for item in items or ()]
    rows = err.rows[:3]  # the first three files
    files = [dataset.samples[indices[r]][0] for r in rows if r < len(indices)]
    named = ""
    if files:
        named = ": " + ", ".join(files) + (" ..." if len(err.rows) > len(files) else "")
    return NonFiniteInputError(
        f"epoch {epoch}, step {first_step + position + 1}: {err}{named}", rows=err.rows
    )


def _validation_of(progress: Progress, epoch: int | None) -> dict | None:
    """The validation figures recorded for ``epoch``, or None."""
    for record in progress.history:
        if record.get("epoch") == epoch and "validation" in record:
            return record["validation"]
    return None


def _summary(
    progress: Progress, stopped_by: str | None, test: dict | None, early: str | None
) -> dict:
    """What ``summary.json`` holds: selection, threshold, test figures, time, memory;
    ``early``: why ``eval.patience`` stopped the run before its last epoch, or None."""
    history = progress.history
    best = _validation_of(progress, progress.best_epoch)
    validated = [r["validation"] for r in history if "validation" in r]
    rates = [r["images_per_second"] for r in history if r.get("images_per_second") is not None]
    summary: dict[str, Any] = {
        "epochs": len(history),
        "stopped_by": stopped_by,
        "early_stop": early,
        "before_training": progress.before_training and {"validation": progress.before_training},
        "best_epoch": progress.best_epoch,
        "best_validation": best,
        "final_validation": validated[-1] if validated else None,
        # The threshold with what it was chosen for (weights' hash, flip, mean subtraction,
        # preprocessing): the after-training tools use it only where all of these match.
        "threshold": best
        and {
            "value": best["threshold"],
            "distance": best["distance"],
            "chosen_on": "validation pairs",
            "epoch": progress.best_epoch,
            **(best.get("threshold_for") or {}),
        },
        "test": test,
        "wall_seconds": progress.elapsed(),
        "train_seconds": sum(r.get("epoch_seconds", 0.0) for r in history),
        "images_per_second": sum(rates) / len(rates) if rates else None,
        "data_wait_seconds": sum(r.get("data_wait_seconds", 0.0) for r in history),
        "peak_rss_bytes": max((r.get("peak_rss_bytes", 0) for r in history), default=None),
        "memory_per_epoch": [
            {k: r[k] for k in r if k == "epoch" or "bytes" in k or k.startswith("cuda")}
            for r in history
        ],
    }
    if any("cuda_max_allocated" in r for r in history):
        summary["cuda_max_allocated"] = max(r.get("cuda_max_allocated", 0) for r in history)
    return summary


def _final_metrics(summary: dict) -> dict:
    """The figures shown next to the hyper-parameters in TensorBoard."""
    metrics = {}
    if summary["best_validation"]:
        metrics["hparam/best_validation_accuracy"] = summary["best_validation"]["accuracy_mean"]
    for name, values in (summary["test"] or {}).items():
        metrics[f"hparam/test_{name}_accuracy"] = values["accuracy_mean"]
    return metrics
