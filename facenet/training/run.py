"""A whole training run from a configuration: data, model, trainer, epochs, checkpoints, logs.

``run_training(cfg)`` is what ``scripts/train.py`` calls. The run directory receives
``config.yaml``, ``metrics.jsonl`` (one line per epoch), TensorBoard events, ``roc_epoch_N.png``,
``last.pt`` / ``best.pt`` and ``summary.json``. The objects of a run are built in
``facenet.training.build``; what a checkpoint holds and how a run resumes is
``facenet.training.state``.

Reliability (see ``docs/reliability.md``):

- ``last.pt`` is written atomically after every epoch; ``kill -9`` at any moment leaves the
  previous or the new one, and ``--resume`` continues from it. It holds everything the next
  epoch depends on (model, optimizer, schedule, scaler, and every rank's RNG states, miner
  generator and sampler position), so on the CPU in deterministic mode, with any
  ``num_workers`` and the same number of processes, a resumed run ends with exactly the
  parameters of an uninterrupted one.
- SIGINT / SIGTERM: the current step finishes, ``last.pt`` is written and the run exits with
  128 + the signal number. If the epoch was not finished, the checkpoint records how many of its
  batches were trained and ``--resume`` continues with the next batch of the same epoch (the
  sampler's order is a function of the seed and the epoch, so it skips exactly the trained
  batches); that continuation is exact as well. A second signal stops at once.
- Bad input ends the run with one line naming the key or the file (exit code 2); a run of
  non-finite losses ends it with exit code 3.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from facenet.checkpoint import remove_stale_temporary_files
from facenet.config import Config, config_to_dict, save_config
from facenet.data.images import CorruptImageError
from facenet.data.pairs import MissingImagesError
from facenet.distributed import (
    DistInfo,
    agree_on_error,
    any_rank,
    cleanup_distributed,
    init_distributed,
    is_main_process,
    main_process_first,
)
from facenet.errors import FacenetError, NonFiniteInputError, NonFiniteLossError, RankFailure
from facenet.files import json_safe, write_text_atomic
from facenet.memory import format_bytes
from facenet.training.build import TrainingData, build_data, build_device, build_trainer
from facenet.training.engine import Trainer
from facenet.training.logger import RunLogger
from facenet.training.run_dir import RunDirLock, clear_previous_outputs
from facenet.training.state import (
    Progress,
    checkpoint_state,
    read_resume_checkpoint,
    remaining_loader,
    restore,
    rewrite_metrics,
    save_for_error,
    save_on_main,
    with_error_checkpoint,
)
from facenet.training.validation import figures_line, test_selected, validate

__all__ = ["fit", "run_training", "describe_error", "EXIT_BAD_INPUT", "EXIT_NONFINITE_LOSS"]

EXIT_BAD_INPUT = 2
EXIT_NONFINITE_LOSS = 3
_FILES_IN_MESSAGE = 3


# --------------------------------------------------------------------------- signals


class _StopFlag:
    """SIGINT/SIGTERM set a flag: the current step finishes, a checkpoint is written.

    A second signal raises ``KeyboardInterrupt`` at once (the checkpoint on disk is intact:
    writes are atomic).

    Args:
        then: what the run does after the first signal (for the console line).
    """

    def __init__(self, then: str = "finishing the current step, then writing a checkpoint"):
        self.signal: str | None = None
        self.then = then
        self._previous: dict = {}

    def __call__(self) -> bool:
        # Every rank asks at the same points, so all of them stop after the same step.
        return any_rank(self.signal is not None)

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


# --------------------------------------------------------------------------- batches


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


class _CountedBatches:
    """At most ``limit`` of the loader's batches, counted as they are handed out.

    Under several processes every rank learns, before anyone steps, whether every rank's
    fetch succeeded: a rank that found a corrupt image does not leave the others waiting in
    the step's collectives. Stopping after ``limit`` batches (rather than fetching one more and
    discarding it) keeps the global RNG where a run stopped by a signal at that point leaves it.
    """

    def __init__(self, loader, limit: int):
        self.loader, self.limit, self.yielded = loader, limit, 0

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


def _console_line(record: dict, epochs: int) -> str:
    line = (
        f"epoch {record['epoch']}/{epochs}  loss {record['loss']:.4f}  "
        f"active {record['active_fraction']:.2f}  {record['images_per_second']:.0f} img/s  "
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


def _collapse_warning(record: dict, margin: float) -> str | None:
    """The loss sits at the margin with d(a,p) ~ d(a,n) ~ 0: the embeddings have collapsed.

    Random initial embeddings also give d(a,p) ~ d(a,n), but far apart: a collapse is when
    every distance has shrunk below the margin.
    """
    dan = record.get("mean_dan", math.nan)
    gap = dan - record.get("mean_dap", math.nan)
    if abs(gap) < 0.05 * margin and dan < margin and record.get("triplet_loss", 0.0) > 0.9 * margin:
        return (
            f"warning: possible collapse at epoch {record['epoch']}: triplet loss "
            f"{record['triplet_loss']:.4f} ~ margin {margin} with d(a,n) - d(a,p) = {gap:.4f}"
        )
    return None


def _idle_warning(record: dict) -> str | None:
    """Every step of the epoch was skipped: nothing was trained."""
    skipped = record.get("skipped_no_triplets", 0) + record.get("skipped_nonfinite", 0)
    if record.get("steps", 0) and skipped == record["steps"]:
        return (
            f"warning: epoch {record['epoch']} trained on no step "
            f"({record.get('skipped_no_triplets', 0)} without triplets, "
            f"{record.get('skipped_nonfinite', 0)} with a non-finite loss)"
        )
    return None


def _epoch_length(data: TrainingData, cfg: Config) -> int:
    """Batches in one epoch: the sampler's, capped by ``train.steps_per_epoch``."""
    length = len(data.loader)
    return min(length, cfg.train.steps_per_epoch) if cfg.train.steps_per_epoch else length


# torch re-raises a worker's exception with its traceback in the message, as a RuntimeError
# when the class cannot be built from one string (CorruptImageError takes path and reason).
_WORKER_IMAGE_ERROR = re.compile(
    r"CorruptImageError: corrupt or unreadable image (?P<path>.+): (?P<reason>[^:\n]+)\s*$"
)


def _worker_image_error(err: RuntimeError) -> CorruptImageError | None:
    """The CorruptImageError a DataLoader worker raised, rebuilt; None for other errors."""
    text = str(err)
    match = _WORKER_IMAGE_ERROR.search(text) if text.startswith("Caught ") else None
    return CorruptImageError(match["path"], match["reason"].strip()) if match else None


def _show_bar(cfg: Config) -> bool:
    """A progress bar only on rank 0 and only on a terminal (a log file gets lines)."""
    return cfg.logging.progress and is_main_process() and sys.stderr.isatty()


def _interval_logger(cfg: Config, logger, epoch: int, skip: int, length: int):
    """Every log interval: ``train/`` scalars by global step, and without a bar one line."""
    line = cfg.logging.progress and is_main_process() and not _show_bar(cfg)

    def on_interval(global_step: int, done: int, means: dict) -> None:
        logger.log_scalars("train", means, global_step)
        if line:
            print(
                f"epoch {epoch} step {skip + done}/{length}: loss {means['loss']:.4f} active "
                f"{means['active_fraction']:.2f} {means['images_per_second']:.0f} img/s",
                flush=True,
            )

    return on_interval


def _train_epoch(trainer, data, cfg, progress: Progress, stop, run_dir: Path, logger):
    """Train (the rest of) ``progress.epoch``; returns (record, batches of it trained in all).

    On a data error or a run of non-finite losses a checkpoint of the state at the last
    finished step is written before the error propagates; its ``checkpoint_note`` says where.
    """
    epoch, skip = progress.epoch, progress.steps_done
    if hasattr(data.sampler, "set_epoch"):
        data.sampler.set_epoch(epoch)
    length = _epoch_length(data, cfg)
    loader = remaining_loader(data.loader, skip)
    batches = _CountedBatches(loader, length - skip)
    try:
        record = trainer.train_one_epoch(
            batches,
            epoch,
            max_steps=length - skip,
            log_interval=cfg.train.log_interval,
            progress=_show_bar(cfg),
            should_stop=stop,
            on_interval=_interval_logger(cfg, logger, epoch, skip, length),
        )
    except NonFiniteInputError as err:  # found by the step: the batch was not trained
        progress.steps_done = skip + batches.yielded - 1
        err = _name_files(err, loader, epoch, skip)
        raise with_error_checkpoint(err, trainer, data.sampler, cfg, progress, run_dir) from None
    except (CorruptImageError, RankFailure) as err:  # found while loading the next batch
        progress.steps_done = skip + batches.yielded
        if isinstance(err, RankFailure) and not err.checkpointable:
            raise  # the failing rank leaves with a traceback; no collective checkpoint
        raise with_error_checkpoint(err, trainer, data.sampler, cfg, progress, run_dir) from None
    except NonFiniteLossError as err:
        progress.steps_done = skip + batches.yielded
        state = checkpoint_state(trainer, data.sampler, cfg, progress)
        err.checkpoint_note = (
            f"{save_for_error(state, run_dir / 'nonfinite.pt')} for inspection; "
            f"{run_dir / 'last.pt'} still holds epoch {epoch - 1}"
        )
        raise
    return record, skip + batches.yielded


def _stop_message(signal_name: str, progress: Progress, path: Path) -> str:
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
    print(_console_line(record, cfg.train.epochs), flush=True)
    for warning in (_collapse_warning(record, cfg.loss.margin), _idle_warning(record)):
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


def _train_epochs(trainer, data, cfg, progress, run_dir, logger) -> str | None:
    """The epoch loop; returns the name of the signal that stopped it, or None."""
    saved = False
    with _StopFlag() as stop:
        while progress.epoch <= cfg.train.epochs and not stop():
            record, done = _train_epoch(trainer, data, cfg, progress, stop, run_dir, logger)
            if done < _epoch_length(data, cfg):  # a signal stopped the epoch
                progress.steps_done = done
                break
            _finish_epoch(trainer, data, cfg, progress, record, run_dir, logger)
            saved = True
        if not stop() or progress.epoch > cfg.train.epochs:
            return None  # every epoch ran (a signal during the last step changes nothing)
        if not saved or progress.steps_done:  # the state on disk is not the current one
            save_on_main(
                checkpoint_state(trainer, data.sampler, cfg, progress), run_dir / "last.pt"
            )
        signal_name = stop.signal or "SIGTERM"  # another rank received it
        if is_main_process():
            print(_stop_message(signal_name, progress, run_dir / "last.pt"), file=sys.stderr)
        return signal_name


def fit(
    trainer: Trainer,
    data: TrainingData,
    cfg: Config,
    run_dir: Path,
    resume: bool,
    resume_state: dict | None = None,
) -> dict:
    """Train for ``cfg.train.epochs`` epochs with evaluation, logging and checkpoints.

    Args:
        trainer: built by :func:`build_trainer`.
        data: built by :func:`build_data`.
        cfg: the run configuration.
        run_dir: the run directory.
        resume: continue from ``run_dir/last.pt`` when it exists.
        resume_state: that checkpoint, already loaded (``run_training`` reads it first).

    Returns:
        The summary written to ``summary.json``; ``stopped_by`` names the signal that stopped
        the run early (None when all epochs ran).

    Raises:
        CorruptImageError, NonFiniteInputError, NonFiniteLossError: mid-epoch; a checkpoint of
            the last finished step is written first and the error's ``checkpoint_note`` says
            where.
    """
    run_dir = Path(run_dir)
    main = is_main_process()
    if main:
        remove_stale_temporary_files(run_dir)
    if resume and resume_state is None:
        resume_state = read_resume_checkpoint(run_dir)
    progress = Progress()
    if resume_state is not None:
        progress = restore(trainer, data.sampler, cfg, resume_state, run_dir / "last.pt")
    if main:
        rewrite_metrics(run_dir, progress.history)
    logger = RunLogger(run_dir, tensorboard=cfg.logging.tensorboard, enabled=main)
    try:
        for note in data.notes if main else ():
            print(note, file=sys.stderr)
        if not progress.resumed and data.val_pairs is not None and cfg.eval.every > 0:
            progress.before_training = validate(trainer, data, cfg, 0, run_dir, logger)
            print(figures_line("before training: validation", progress.before_training))
        stopped_by = _train_epochs(trainer, data, cfg, progress, run_dir, logger)
        test = None
        if stopped_by is None and progress.history and data.test_pairs is not None:
            # A first SIGINT/SIGTERM now lets the test finish (the training is done and on
            # disk); a second stops at once, and --resume evaluates the test pairs.
            with _StopFlag("finishing the test evaluation; the training is saved"):
                test = _test(trainer, data, cfg, progress, run_dir, logger)
        summary = _summary(progress, stopped_by, test)
        logger.log_hparams(config_to_dict(cfg), _final_metrics(summary))
    finally:
        logger.close()
    if main:
        write_text_atomic(run_dir / "summary.json", json.dumps(json_safe(summary), indent=2))
    return summary


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
        "threshold": best
        and {
            "value": best["threshold"],
            "distance": best["distance"],
            "chosen_on": "validation pairs",
            "epoch": progress.best_epoch,
        },
        "test": test,
        "wall_seconds": progress.elapsed(),
        "train_seconds": sum(r.get("epoch_seconds", 0.0) for r in history),
        "images_per_second": _mean([r.get("images_per_second") for r in history]),
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


# --------------------------------------------------------------------------- the command


def describe_error(err: BaseException) -> str:
    """One line for the user: what went wrong, naming the file or configuration key.

    Args:
        err: an error from setting up or running the training.
    """
    if isinstance(err, MissingImagesError):
        head = str(err).splitlines()[0].rstrip(":")
        first = err.missing[0]
        text = (
            f"{head}; first: {first} (line {err.lines[first][0]}); "
            "eval.skip_missing: true skips those pairs"
        )
    elif isinstance(err, OSError) and err.filename and err.strerror:
        text = f"{err.filename}: {err.strerror}"
    else:
        text = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        text = text or type(err).__name__
    note = getattr(err, "checkpoint_note", None)
    return f"{text} ({note})" if note else text


def _prepare_run_dir(
    run_dir: Path, cfg: Config, resume: bool, overwrite: bool, stack: contextlib.ExitStack
) -> str | None:
    """Create and lock the run directory, clear it on --overwrite, write ``config.yaml``.

    Returns an error message, or None. Rank 0 holds the lock for the life of ``stack``.
    """
    if not is_main_process():  # rank 0 decides, and reports, for every rank
        return None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create the run directory {run_dir}: {err.strerror or err}"
    if (run_dir / "last.pt").exists() and not (resume or overwrite):
        return (
            f"{run_dir / 'last.pt'} exists: --resume continues that run, --overwrite starts a "
            "new one in its place (or choose another --out)"
        )
    try:
        stack.enter_context(RunDirLock(run_dir))
        if overwrite:  # a new run: nothing of the previous one may mix with it
            clear_previous_outputs(run_dir)
        save_config(cfg, run_dir / "config.yaml")
    except FacenetError as err:  # locked by a live process
        return str(err)
    except OSError as err:
        return f"cannot write the run directory {run_dir}: {err.strerror or err}"
    return None


def _interrupted_message(err: KeyboardInterrupt, run_dir: Path) -> str:
    """What a Ctrl-C outside the stopping protocol (or a second signal) leaves behind."""
    how = f"stopped at once ({err})" if str(err) else "interrupted"
    last = run_dir / "last.pt"
    if last.is_file():
        return f"{how}; {last}, written before, is intact: --resume continues from it"
    return f"{how}; no checkpoint was written"


def _run(cfg: Config, run_dir: Path, resume: bool, info: DistInfo) -> dict:
    state = read_resume_checkpoint(run_dir) if resume else None  # refused files fail fast
    device = info.device if info.world_size > 1 else build_device(cfg)
    if cfg.train.deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    with main_process_first():  # rank 0 writes the synthetic data and the folder index
        data = build_data(cfg, run_dir, info.rank, info.world_size)
    trainer = build_trainer(cfg, data.num_classes, device)
    return fit(trainer, data, cfg, run_dir, resume=state is not None, resume_state=state)


def _final_lines(summary: dict) -> list[str]:
    """The run's figures for the console: selection on validation, then the test figures."""
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


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False) -> int:
    """The whole run for ``scripts/train.py``; returns an exit code.

    Args:
        cfg: the run configuration (``logging.out_dir`` is the run directory).
        resume: continue from ``<out_dir>/last.pt`` (a new run if there is none).
        overwrite: start a new run even if ``<out_dir>/last.pt`` exists: the previous run's
            checkpoints, logs, figures and TensorBoard events are removed first.

    Returns:
        0 when every epoch ran; 2 for bad input (configuration, data, pairs, checkpoint, an
        unwritable output folder, a run directory another process trains in), 3 for a run of
        non-finite losses, 128 + the signal number when SIGINT/SIGTERM stopped the run, 130
        for a second signal or a Ctrl-C outside the training loop.
    """
    try:
        info = init_distributed(cfg.train.device)
    except FacenetError as err:  # CUDA asked for where there is none
        print(f"error: train.device: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with contextlib.ExitStack() as stack:
            if not info.is_main:  # one console: rank 0's (errors still reach stderr)
                devnull = stack.enter_context(open(os.devnull, "w"))
                stack.enter_context(contextlib.redirect_stdout(devnull))
            return _run_training(cfg, resume, overwrite, info)
    finally:
        cleanup_distributed()


def _run_training(cfg: Config, resume: bool, overwrite: bool, info: DistInfo) -> int:
    run_dir = Path(cfg.logging.out_dir)
    with contextlib.ExitStack() as stack:
        problem = _prepare_run_dir(run_dir, cfg, resume, overwrite, stack)
        if any_rank(problem is not None):  # every rank stops when rank 0 cannot go on
            if problem:
                print(f"error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        deterministic_before = torch.are_deterministic_algorithms_enabled()
        torch.manual_seed(cfg.train.seed + info.rank)  # augmentation differs per rank
        if cfg.train.deterministic:
            # warn_only: some CUDA backward kernels (adaptive average pooling) have no
            # deterministic version; they warn instead of stopping the run.
            torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            summary = _run(cfg, run_dir, resume, info)
        except KeyboardInterrupt as err:
            print(f"error: {_interrupted_message(err, run_dir)}", file=sys.stderr)
            return 128 + signal.SIGINT
        except (FacenetError, OSError) as err:  # a bug keeps its traceback
            if info.is_main or not getattr(err, "agreed", False):  # one report of it
                print(f"error: {describe_error(err)}", file=sys.stderr)
            return EXIT_NONFINITE_LOSS if isinstance(err, NonFiniteLossError) else EXIT_BAD_INPUT
        finally:
            torch.use_deterministic_algorithms(deterministic_before)
    for line in _final_lines(summary):
        print(line)
    print(f"run directory: {run_dir}")
    if summary["stopped_by"]:
        return 128 + signal.Signals[summary["stopped_by"]].value
    return 0
