"""The epochs of a run: train, validate, log, checkpoint; stop on a signal; test at the end.

``fit(run)`` is the loop a reader follows to ``optimizer.step()``: ``Run.train_epochs`` ->
``Trainer.train_one_epoch`` -> ``Trainer.train_step`` -> the step. A signal stops the run after
the current step, every rank agreeing (``any_rank``). When an epoch ends with an error,
``Run.checkpoint_at_error`` alone says how far the epoch got and writes the checkpoint that
``--resume`` continues from.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from facenet.checkpoint import remove_stale_temporary_files
from facenet.config import Config, config_to_dict
from facenet.data.images import CorruptImageError
from facenet.distributed import any_rank, is_main_process
from facenet.errors import FacenetError, NonFiniteInputError, NonFiniteLossError, RankFailure
from facenet.evaluation.report import figures_line
from facenet.files import json_safe, write_text_atomic
from facenet.training.build import TrainingData
from facenet.training.console import (
    StopSignals,
    collapse_warning,
    epoch_line,
    hparam_metrics,
    idle_warning,
    name_input_files,
    show_bar,
    stop_message,
)
from facenet.training.engine import Trainer
from facenet.training.logger import RunLogger
from facenet.training.run_dir import RunOutputs
from facenet.training.state import (
    CountedBatches,
    Progress,
    rewrite_metrics,
    save_for_error,
    save_on_main,
)
from facenet.training.validation import test_selected, validate, validation_due

# What can end an epoch early with a checkpoint first.
_EPOCH_ERRORS = (NonFiniteInputError, CorruptImageError, RankFailure, NonFiniteLossError)


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
            and progress.patience_spent(cfg.eval.patience) is None
        ):
            epoch, skip = progress.epoch, progress.steps_done
            self.data.sampler.set_epoch(epoch)
            batches = CountedBatches(self.data.loader, skip, self.data.steps_per_epoch)
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

    def checkpoint_at_error(self, err: Exception, batches: CountedBatches) -> Exception:
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
            err = name_input_files(err, batches.loader, progress.epoch, batches.start)
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
        if self.data.val_pairs is not None and validation_due(cfg, epoch):
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
        spent = progress.patience_spent(cfg.eval.patience)
        if spent is not None and epoch < cfg.train.epochs:
            print(spent, flush=True)


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
                test = test_selected(run, progress.validation_of(progress.best_epoch))
        early = progress.epoch <= cfg.train.epochs and progress.patience_spent(cfg.eval.patience)
        summary = progress.summary(stopped_by, test, early or None)
        run.logger.log_hparams(config_to_dict(cfg), hparam_metrics(summary))
    finally:
        run.logger.close()
    if main:
        write_text_atomic(run.run_dir / "summary.json", json.dumps(json_safe(summary), indent=2))
    return summary
