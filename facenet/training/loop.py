"""The epochs of a run: train, validate, log, checkpoint; stop on a signal; test at the end.

``fit`` is the loop a reader follows to ``optimizer.step()``::

    fit -> Trainer.train_one_epoch -> Trainer.train_step -> step(images, labels) + _update

Each epoch's batches are capped once (``train.steps_per_epoch``) by ``_CountedBatches``,
which also agrees across ranks on every fetch. A signal stops the run after the current step:
the engine asks ``any_rank(signals.received())`` after each step (a collective under several
processes). When an epoch ends with an error, ``_checkpoint_at_error`` is the one place that
says how far the epoch got and writes the checkpoint that ``--resume`` continues from.
"""

from __future__ import annotations

import itertools
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

from facenet.checkpoint import remove_stale_temporary_files
from facenet.config import Config, config_to_dict
from facenet.data.images import CorruptImageError
from facenet.distributed import agree_on_error, any_rank, is_main_process
from facenet.errors import FacenetError, NonFiniteInputError, NonFiniteLossError, RankFailure
from facenet.files import json_safe, write_text_atomic
from facenet.training.build import TrainingData
from facenet.training.console import (
    collapse_warning,
    describe_error,
    epoch_line,
    idle_warning,
    interval_logger,
    show_bar,
    stop_message,
)
from facenet.training.engine import Trainer
from facenet.training.logger import RunLogger
from facenet.training.run_dir import RunOutputs
from facenet.training.state import (
    Progress,
    checkpoint_state,
    remaining_loader,
    restore,
    rewrite_metrics,
    save_for_error,
    save_on_main,
    with_error_checkpoint,
)
from facenet.training.validation import figures_line, test_selected, validate

__all__ = ["StopSignals", "fit"]

_FILES_IN_MESSAGE = 3
# torch re-raises a worker's exception with its traceback in the message, as a RuntimeError
# when the class cannot be built from one string (CorruptImageError takes path and reason).
_WORKER_IMAGE_ERROR = re.compile(
    r"CorruptImageError: corrupt or unreadable image (?P<path>.+): (?P<reason>[^:\n]+)\s*$"
)
# What can end an epoch early with a checkpoint first.
_EPOCH_ERRORS = (NonFiniteInputError, CorruptImageError, RankFailure, NonFiniteLossError)


class StopSignals:
    """SIGINT/SIGTERM set a flag: the current step finishes, a checkpoint is written.

    ``received()`` is this rank's flag; every rank stops after the same step by agreeing on it
    with ``any_rank`` (an all-reduce under several processes), where the loop says so.

    A second signal raises ``KeyboardInterrupt`` at once (the checkpoint on disk is intact:
    writes are atomic).

    Args:
        then: what the run does after the first signal (for the console line).
    """

    def __init__(self, then: str = "finishing the current step, then writing a checkpoint"):
        self.signal: str | None = None
        self.then = then
        self._previous: dict = {}

    def received(self) -> bool:
        """This process received a signal (this rank only: agree with ``any_rank``)."""
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
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave the handlers alone
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def fit(
    trainer: Trainer,
    data: TrainingData,
    cfg: Config,
    run_dir: Path,
    resume_state: dict | None = None,
    outputs: RunOutputs | None = None,
) -> dict:
    """Train for ``cfg.train.epochs`` epochs with evaluation, logging and checkpoints.

    Args:
        trainer: built by ``facenet.training.build.build_trainer``.
        data: built by ``facenet.training.build.build_data``.
        cfg: the run configuration.
        run_dir: the run directory.
        resume_state: a ``last.pt`` to continue from (``read_resume_checkpoint``), or None.
        outputs: the record of what the run writes (``--overwrite`` removes exactly that
            later); default: a record kept in ``run_dir``.

    Returns:
        The summary written to ``summary.json``; ``stopped_by`` names the signal that stopped
        the run early (None when all epochs ran).

    Raises:
        CorruptImageError, NonFiniteInputError, NonFiniteLossError: mid-epoch; a checkpoint of
            the last finished step is written first and the error's ``checkpoint_note`` says
            where.
    """
    run_dir, main = Path(run_dir), is_main_process()
    outputs = outputs or RunOutputs(run_dir, enabled=main)
    _record_outputs(outputs, data, cfg, run_dir)
    progress = _start(trainer, data, cfg, run_dir, resume_state)
    logger = RunLogger(run_dir, tensorboard=cfg.logging.tensorboard, enabled=main)
    try:
        for note in data.notes if main else ():
            print(note, file=sys.stderr)
        if not progress.resumed and data.val_pairs is not None and cfg.eval.every > 0:
            progress.before_training = validate(trainer, data, cfg, 0, run_dir, logger)
            print(figures_line("before training: validation", progress.before_training))
        saved = False  # last.pt holds the current state
        with StopSignals() as signals:
            # any_rank: a collective, so that every rank leaves the loop at the same epoch.
            while progress.epoch <= cfg.train.epochs and not any_rank(signals.received()):
                epoch, skip = progress.epoch, progress.steps_done
                batches = _epoch_batches(data, cfg, epoch, skip)
                try:
                    record = trainer.train_one_epoch(
                        batches,
                        epoch,
                        log_interval=cfg.train.log_interval,
                        progress=show_bar(cfg),
                        should_stop=signals.received,
                        on_interval=interval_logger(cfg, logger, epoch, skip, batches.end),
                    )
                except _EPOCH_ERRORS as err:
                    raise _checkpoint_at_error(
                        err, batches, trainer, data, cfg, progress, run_dir, outputs
                    ) from None
                if skip + batches.yielded < batches.end:  # a signal stopped the epoch
                    progress.steps_done = skip + batches.yielded
                    break
                _finish_epoch(trainer, data, cfg, progress, record, run_dir, logger)
                saved = True
            stopped_by = _stopped_by(signals, saved, trainer, data, cfg, progress, run_dir)
        test = None
        if stopped_by is None and progress.history and data.test_pairs is not None:
            # A first SIGINT/SIGTERM now lets the test finish (the training is done and on
            # disk); a second stops at once, and --resume evaluates the test pairs.
            with StopSignals("finishing the test evaluation; the training is saved"):
                test = _test(trainer, data, cfg, progress, run_dir, logger)
        summary = _summary(progress, stopped_by, test)
        logger.log_hparams(config_to_dict(cfg), _final_metrics(summary))
    finally:
        logger.close()
    if main:
        write_text_atomic(run_dir / "summary.json", json.dumps(json_safe(summary), indent=2))
    return summary


def _record_outputs(outputs: RunOutputs, data, cfg, run_dir: Path) -> None:
    """Record, before writing them, the files every run of this configuration writes."""
    names = ["metrics.jsonl", "last.pt", "summary.json"]
    names += ["tensorboard"] if cfg.logging.tensorboard else []
    evaluated = cfg.eval.every > 0 and (data.val_pairs or data.test_pairs) is not None
    names += ["best.pt", "roc_*.png"] if evaluated else []
    for name in names:
        outputs.add(run_dir / name)


def _start(trainer, data, cfg, run_dir: Path, resume_state: dict | None) -> Progress:
    """The run's progress: restored from ``resume_state``, or a new run's; metrics.jsonl
    rewritten to match it."""
    if is_main_process():
        remove_stale_temporary_files(run_dir)
    progress = Progress()
    if resume_state is not None:
        progress = restore(trainer, data.sampler, cfg, resume_state, run_dir / "last.pt")
    if is_main_process():
        rewrite_metrics(run_dir, progress.history)
    return progress


def _epoch_batches(data: TrainingData, cfg: Config, epoch: int, skip: int):
    """The epoch's batches after the ``skip`` already trained, capped at the epoch's length."""
    if hasattr(data.sampler, "set_epoch"):
        data.sampler.set_epoch(epoch)
    end = data.steps_per_epoch  # the epoch's one cap (build.epoch_length)
    return _CountedBatches(remaining_loader(data.loader, skip), skip, end)


def _checkpoint_at_error(err, batches, trainer, data, cfg, progress, run_dir, outputs):
    """Where the epoch stopped, the checkpoint written for it, and the error to raise.

    The one place for resume bookkeeping: a batch whose inputs were found non-finite was
    not trained (``--resume`` retries it); a failed fetch never yielded its batch; the
    batch of a non-finite loss run was skipped and counts as done.
    """
    trained = batches.yielded - (1 if isinstance(err, NonFiniteInputError) else 0)
    progress.steps_done = batches.start + trained
    if isinstance(err, RankFailure) and not err.checkpointable:
        return err  # the failing rank leaves with a traceback; no collective checkpoint
    if isinstance(err, NonFiniteLossError):
        outputs.add(run_dir / "nonfinite.pt")
        state = checkpoint_state(trainer, data.sampler, cfg, progress)
        err.checkpoint_note = (
            f"{save_for_error(state, run_dir / 'nonfinite.pt')} for inspection; "
            f"{run_dir / 'last.pt'} still holds epoch {progress.epoch - 1}"
        )
        return err
    if isinstance(err, NonFiniteInputError):
        err = _name_files(err, batches.loader, progress.epoch, batches.start)
    return with_error_checkpoint(err, trainer, data.sampler, cfg, progress, run_dir)


def _stopped_by(signals, saved: bool, trainer, data, cfg, progress, run_dir: Path) -> str | None:
    """After the epoch loop: None when every epoch ran, else the signal's name, with the
    current state in ``last.pt`` (written unless an epoch end in this loop wrote it)."""
    # any_rank: the same collective the loop made, on every rank.
    if not any_rank(signals.received()) or progress.epoch > cfg.train.epochs:
        return None  # every epoch ran (a signal during the last step changes nothing)
    if not saved or progress.steps_done:  # the state on disk is not the current one
        save_on_main(checkpoint_state(trainer, data.sampler, cfg, progress), run_dir / "last.pt")
    signal_name = signals.signal or "SIGTERM"  # another rank received it
    if is_main_process():
        print(stop_message(signal_name, progress, run_dir / "last.pt"), file=sys.stderr)
    return signal_name


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
    """Raise on every rank when any rank's fetch failed (see ``agree_on_error``)."""
    if isinstance(error, RuntimeError):  # a DataLoader worker's CorruptImageError, re-wrapped
        error = _worker_image_error(error) or error
    agree_on_error(error, None if error is None else describe_error(error))


def _worker_image_error(err: RuntimeError) -> CorruptImageError | None:
    """The CorruptImageError a DataLoader worker raised, rebuilt; None for other errors."""
    text = str(err)
    match = _WORKER_IMAGE_ERROR.search(text) if text.startswith("Caught ") else None
    return CorruptImageError(match["path"], match["reason"].strip()) if match else None


def _files_of_batch(loader, position: int, rows: list[int]) -> list[str]:
    """The image files at ``rows`` of the loader's batch ``position`` (PK batches only)."""
    dataset, batch_sampler = loader.dataset, getattr(loader, "batch_sampler", None)
    dataset = getattr(dataset, "dataset", dataset)  # under SeededSamples
    if not hasattr(dataset, "samples") or batch_sampler is None:
        return []
    # The order of an epoch is fixed, so iterating the sampler again finds the same batch.
    items = next(itertools.islice(iter(batch_sampler), position, None), None)
    if items is None:
        return []
    indices = [item[0] if isinstance(item, tuple) else item for item in items]
    return [dataset.samples[indices[r]][0] for r in rows if r < len(indices)]


def _name_files(err: NonFiniteInputError, loader, epoch: int, first_step: int):
    """The error, its message naming the epoch, the step and (PK batches) the files."""
    position = getattr(err, "batch_index", 0)
    files = _files_of_batch(loader, position, err.rows[:_FILES_IN_MESSAGE])
    named = ""
    if files:
        named = ": " + ", ".join(files) + (" ..." if len(err.rows) > len(files) else "")
    return NonFiniteInputError(
        f"epoch {epoch}, step {first_step + position + 1}: {err}{named}", rows=err.rows
    )


def _validation_due(data: TrainingData, cfg: Config, epoch: int) -> bool:
    every = cfg.eval.every
    return (
        data.val_pairs is not None
        and every > 0
        and (epoch % every == 0 or epoch == cfg.train.epochs)
    )


def _checkpoint_unvalidated(trainer, data, cfg, progress, record, run_dir, err) -> None:
    """An epoch trained but not validated: keep its training in last.pt, then raise ``err``."""
    if isinstance(err, RankFailure) and not err.checkpointable:
        raise err  # the failing rank leaves with a traceback; no collective checkpoint
    epoch = record["epoch"]
    progress.history.append(record)
    progress.epoch, progress.steps_done = epoch + 1, 0
    saved = save_for_error(
        checkpoint_state(trainer, data.sampler, cfg, progress), run_dir / "last.pt"
    )
    err.checkpoint_note = (
        f"{saved}: epoch {epoch} trained, not validated; --resume continues with epoch {epoch + 1}"
    )
    raise err


def _finish_epoch(trainer, data, cfg, progress, record, run_dir, logger) -> None:
    """Validate, log and checkpoint a finished epoch; best.pt follows validation accuracy."""
    epoch = record["epoch"]
    if _validation_due(data, cfg, epoch):
        try:
            record["validation"] = validate(trainer, data, cfg, epoch, run_dir, logger)
        except FacenetError as err:  # e.g. an unreadable validation image
            _checkpoint_unvalidated(trainer, data, cfg, progress, record, run_dir, err)
    logger.log_epoch(record)
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
    state = checkpoint_state(trainer, data.sampler, cfg, progress)
    if is_best:  # first: last.pt never names a best epoch whose best.pt is not on disk
        save_on_main(state, run_dir / "best.pt")
    save_on_main(state, run_dir / "last.pt")


def _validation_of(progress: Progress, epoch: int | None) -> dict | None:
    """The validation figures recorded for ``epoch``, or None."""
    for record in progress.history:
        if record.get("epoch") == epoch and "validation" in record:
            return record["validation"]
    return None


def _test(trainer, data, cfg, progress, run_dir, logger) -> dict:
    """The test pairs, once: best.pt (chosen on validation) and the last model."""
    best = _validation_of(progress, progress.best_epoch)
    threshold = None if best is None else best["threshold"]
    last_epoch = progress.history[-1]["epoch"]
    return test_selected(
        trainer, data, cfg, progress.best_epoch, threshold, last_epoch, run_dir, logger
    )


def _summary(progress: Progress, stopped_by: str | None, test: dict | None) -> dict:
    """What ``summary.json`` holds: selection, threshold, test figures, time, memory."""
    history = progress.history
    best = _validation_of(progress, progress.best_epoch)
    validated = [r["validation"] for r in history if "validation" in r]
    summary: dict[str, Any] = {
        "epochs": len(history),
        "stopped_by": stopped_by,
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
        "images_per_second": _mean([r.get("images_per_second") for r in history]),
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


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _final_metrics(summary: dict) -> dict:
    """The figures shown next to the hyper-parameters in TensorBoard."""
    metrics = {}
    if summary["best_validation"]:
        metrics["hparam/best_validation_accuracy"] = summary["best_validation"]["accuracy_mean"]
    for name, values in (summary["test"] or {}).items():
        metrics[f"hparam/test_{name}_accuracy"] = values["accuracy_mean"]
    return metrics
