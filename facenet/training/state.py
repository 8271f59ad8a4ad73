"""What a training checkpoint holds, and how a run continues from one.

``last.pt`` / ``best.pt`` hold everything the rest of the run depends on: the trainer's state
(model, optimizer, schedule, scaler), the global RNG states, the miner's generator, the sampler,
the history and, when a signal or an error stopped an epoch part-way, how many of its batches
were trained. Resuming reads the checkpoint back (refusing files that are not training
checkpoints of this package), warns about changed settings, restores every state, rewrites
``metrics.jsonl`` to the checkpoint's history and skips the batches already trained.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from facenet.checkpoint import (
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from facenet.config import Config, config_to_dict
from facenet.distributed import (
    any_rank,
    gather_objects,
    get_rank,
    get_world_size,
    is_main_process,
)
from facenet.errors import CheckpointError, ConfigError
from facenet.files import json_safe, write_text_atomic
from facenet.training.engine import Trainer

__all__ = [
    "CHECKPOINT_FORMAT",
    "Progress",
    "checkpoint_state",
    "read_resume_checkpoint",
    "restore",
    "remaining_loader",
    "save_on_main",
    "save_for_error",
    "with_error_checkpoint",
    "rewrite_metrics",
]

CHECKPOINT_FORMAT = 2
# Keys every training checkpoint holds; a file without them is not one of ours.
_REQUIRED_KEYS = ("model", "optimizer", "epoch", "rng", "config", "history", "best_accuracy")
# Settings that may change between a run and its resumption without a warning.
_FREELY_CHANGED = ("logging.", "train.epochs", "train.device", "data.num_workers", "eval.")


@dataclass
class Progress:
    """Where a run stands: the next epoch, how many of its batches are trained, the history.

    Args:
        epoch: the epoch to train next (1-based).
        steps_done: batches of ``epoch`` already trained (0 at an epoch's start).
        best: the best validation accuracy so far (-1 before any evaluation).
        best_epoch: the epoch ``best.pt`` holds (None before any validation).
        history: one record per finished epoch, as written to ``metrics.jsonl``.
        before_training: the validation figures before the first step, or None.
        resumed: True when the run continues from a checkpoint.
        seconds: training wall time so far (earlier sessions of a resumed run included).
    """

    epoch: int = 1
    steps_done: int = 0
    best: float = -1.0
    best_epoch: int | None = None
    history: list = field(default_factory=list)
    before_training: dict | None = None
    resumed: bool = False
    seconds: float = 0.0
    session_start: float = field(default_factory=time.perf_counter, repr=False)

    def elapsed(self) -> float:
        """Wall time of the run so far, earlier sessions included."""
        return self.seconds + time.perf_counter() - self.session_start


# --------------------------------------------------------------------------- contents


def _miner_generator(trainer: Trainer) -> torch.Generator | None:
    return getattr(trainer.step.miner, "generator", None)


def _rank_state(trainer: Trainer, sampler) -> dict:
    """What this rank alone draws from: its random generators and its data position."""
    generator = _miner_generator(trainer)
    return {
        "rng": rng_state(),
        "miner_rng": None if generator is None else generator.get_state(),
        "sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
    }


def checkpoint_state(trainer: Trainer, sampler, cfg: Config, progress: Progress) -> dict:
    """Everything the rest of the run depends on, as plain contents.

    ``epoch`` is the last finished epoch; ``partial`` is None, or ``{"epoch", "steps_done"}``
    when ``progress`` stands inside an epoch (some of its batches trained). ``ranks`` holds
    every rank's own random states and data position (each rank restores its own); every
    rank must call this at the same point (the ranks' states are gathered).

    Args:
        trainer: the run's trainer (model, optimizer, schedule, scaler, miner).
        sampler: the run's batch order (its ``state_dict`` is saved, if it has one).
        cfg: the run configuration (saved to compare on resume).
        progress: where the run stands.
    """
    partial = None
    if progress.steps_done:
        partial = {"epoch": progress.epoch, "steps_done": progress.steps_done}
    ranks = gather_objects(_rank_state(trainer, sampler))  # every rank calls this
    state = trainer.state_dict()
    state.update(
        format=CHECKPOINT_FORMAT,
        epoch=progress.epoch - 1,
        partial=partial,
        config=config_to_dict(cfg),
        **ranks[0],  # rng, miner_rng, sampler: rank 0's at the top level
        world_size=len(ranks),
        ranks=ranks,
        best_accuracy=progress.best,
        best_epoch=progress.best_epoch,
        seconds=progress.elapsed(),
        history=progress.history,
        before_training=progress.before_training,
    )
    return state


# --------------------------------------------------------------------------- resuming


def read_resume_checkpoint(run_dir: Path) -> dict | None:
    """``run_dir/last.pt``, checked to be a training checkpoint; None (with a note) if absent.

    Args:
        run_dir: the run directory.

    Raises:
        CheckpointError: the file is unreadable, refused, or not a training checkpoint.
    """
    path = run_dir / "last.pt"
    if not path.exists():
        print(f"--resume: no checkpoint at {path}; starting a new run", file=sys.stderr)
        return None
    state = load_checkpoint(path, map_location="cpu")
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if not missing and not isinstance(state["config"], dict):
        raise CheckpointError(f"{path}: its config field is not a mapping")
    if missing:
        raise CheckpointError(
            f"{path} is not a training checkpoint of this package (missing: {', '.join(missing)})"
        )
    return state


def _changed_settings(saved: dict, current: dict) -> list[str]:
    """``section.key: old -> new`` for settings that differ from the checkpoint's."""
    changes = []
    for section, values in current.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            old = (saved.get(section) or {}).get(key, value)
            if old != value and not name.startswith(_FREELY_CHANGED):
                changes.append(f"{name}: {old!r} -> {value!r}")
    return changes


def restore(trainer: Trainer, sampler, cfg: Config, state: dict, path: Path) -> Progress:
    """Load a checkpoint into the trainer, sampler and RNGs; where the run stands.

    Args:
        trainer: receives the model, optimizer, schedule and scaler states.
        sampler: receives the sampler state (if it has ``load_state_dict``).
        cfg: the current configuration (settings changed since the checkpoint are warned of).
        state: the checkpoint, from :func:`read_resume_checkpoint`.
        path: the checkpoint's file (for messages).

    Raises:
        CheckpointError: the checkpoint does not fit the trainer built from ``cfg``.
    """
    _check_schedule(trainer, state, path)
    changes = _changed_settings(state["config"], config_to_dict(cfg))
    if changes:
        print("warning: resuming with changed settings: " + "; ".join(changes), file=sys.stderr)
    own = _own_rank_state(state, path)
    try:
        trainer.load_state_dict(state)
        if own.get("sampler") is not None and hasattr(sampler, "load_state_dict"):
            sampler.load_state_dict(own["sampler"])
        generator = _miner_generator(trainer)
        if generator is not None and own.get("miner_rng") is not None:
            generator.set_state(own["miner_rng"])
        set_rng_state(own["rng"])
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path} does not fit this configuration: {reason}") from None
    try:
        progress = _progress_of(state)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: a field holds a value of the wrong type: {err}") from None
    where = f"step {progress.steps_done + 1} of " if progress.steps_done else ""
    print(f"resumed from {path}: continuing with {where}epoch {progress.epoch}")
    return progress


def _own_rank_state(state: dict, path: Path) -> dict:
    """This rank's random states and data position; another world size is refused."""
    saved, world = int(state.get("world_size", 1)), get_world_size()
    if saved != world:
        raise ConfigError(
            f"{path} was written by a run of {saved} process(es) and this run has {world}: "
            "each rank resumes its own random state and data position, so resume with "
            f"{saved} process(es) (torchrun --nproc_per_node and --nnodes)"
        )
    ranks = state.get("ranks")
    return ranks[get_rank()] if isinstance(ranks, list) and ranks else state


def _progress_of(state: dict) -> Progress:
    """Where the checkpointed run stands (fields of the wrong type raise TypeError/ValueError)."""
    partial = state.get("partial")
    history = state["history"]
    if not isinstance(history, list) or not all(isinstance(r, dict) for r in history):
        raise TypeError(f"history: expected a list of records, got {type(history).__name__}")
    best_epoch = state.get("best_epoch")
    return Progress(
        epoch=int(partial["epoch"]) if partial else int(state["epoch"]) + 1,
        steps_done=int(partial["steps_done"]) if partial else 0,
        best=float(state["best_accuracy"]),
        best_epoch=None if best_epoch is None else int(best_epoch),
        history=list(history),
        before_training=state.get("before_training"),
        resumed=True,
        seconds=float(state.get("seconds", 0.0)),
    )


def _check_schedule(trainer: Trainer, state: dict, path: Path) -> None:
    """A schedule built for other lengths cannot continue exactly: refused.

    The schedule is stepped per batch: another epoch length (other data, another
    ``train.steps_per_epoch``) moves its epoch boundaries, and a cosine built for another
    ``train.epochs`` would make the learning rate jump or climb again
    (``StepSchedule.resume_problem``). A checkpoint whose schedule was stepped per epoch (an
    earlier version) is refused the same way.
    """
    schedule, saved = trainer.scheduler, state.get("scheduler")
    if saved is None or not hasattr(schedule, "resume_problem"):
        return
    try:
        problem = schedule.resume_problem(saved)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(
            f"{path}: its scheduler field is not a schedule's state ({err!r})"
        ) from None
    if problem:
        raise ConfigError(
            f"{problem}, or start a new run from the weights of {path} (model.weights)"
        )


class _SkipBatches:
    """A batch sampler without its first ``skip`` batches (a resumed, half-trained epoch).

    Args:
        batch_sampler: yields lists of dataset indices, the same order on every iteration of
            an epoch (PKSampler and TripletListDataset orders are functions of seed and epoch).
        skip: batches already trained.
    """

    def __init__(self, batch_sampler, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


def remaining_loader(loader, skip: int):
    """``loader`` from its batch ``skip`` on, without loading the skipped batches.

    Args:
        loader: the epoch's DataLoader (its batch sampler's order is fixed within an epoch).
        skip: batches of the epoch already trained.
    """
    if skip == 0:
        return loader
    return torch.utils.data.DataLoader(
        loader.dataset,
        batch_sampler=_SkipBatches(loader.batch_sampler, skip),
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        collate_fn=loader.collate_fn,
        prefetch_factor=loader.prefetch_factor,
        worker_init_fn=loader.worker_init_fn,
        # Its own generator: the global one must not advance (the interrupted epoch already
        # drew its loader seed from it before the checkpoint captured its state).
        generator=torch.Generator(),
    )


# --------------------------------------------------------------------------- saving


def save_on_main(state: dict, path: Path) -> None:
    """Rank 0 writes the checkpoint; every rank waits until it is on disk, or fails with it.

    Args:
        state: from :func:`checkpoint_state`.
        path: the checkpoint file (written atomically).

    Raises:
        CheckpointError: on every rank, when rank 0 could not write it (a full disk): no rank
            goes on to wait in a collective that rank 0 will never enter.
    """
    error = None
    if is_main_process():
        try:
            save_checkpoint(state, path)
        except CheckpointError as err:
            error = err
    if any_rank(error is not None):  # also the barrier: rank 0 has finished writing
        error = error or CheckpointError(f"rank 0 could not write {path}")
        error.agreed = True  # every rank raises it here; rank 0 reports it
        raise error


def save_for_error(state: dict, path: Path) -> str:
    """Write a checkpoint while an error propagates; a failure to write is reported, not raised.

    Args:
        state: from :func:`checkpoint_state`.
        path: the checkpoint file.

    Returns:
        What happened, for the error's ``checkpoint_note``.
    """
    if not is_main_process():
        return f"rank 0 writes {path}"
    try:
        save_checkpoint(state, path)
    except CheckpointError as err:
        return f"no checkpoint written ({err})"
    return f"checkpoint written to {path}"


def with_error_checkpoint(
    err: Exception,
    trainer: Trainer,
    sampler,
    cfg: Config,
    progress: Progress,
    run_dir: Path,
) -> Exception:
    """Write ``last.pt`` at the last finished step; the error, with a note saying so.

    Args:
        err: a data error raised mid-epoch (it receives ``checkpoint_note``).
        trainer: the run's trainer.
        sampler: the run's batch order.
        cfg: the run configuration.
        progress: where the run stands (``steps_done``: the batches trained before the error).
        run_dir: the run directory.
    """
    state = checkpoint_state(trainer, sampler, cfg, progress)
    saved = save_for_error(state, run_dir / "last.pt")
    err.checkpoint_note = (
        f"{saved}; after fixing the data, --resume continues with step "
        f"{progress.steps_done + 1} of epoch {progress.epoch}"
    )
    return err


# --------------------------------------------------------------------------- files


def rewrite_metrics(run_dir: Path, history: list) -> None:
    """``metrics.jsonl`` as the checkpoint knows it: epochs after the checkpoint are dropped.

    Args:
        run_dir: the run directory.
        history: one record per finished epoch (the checkpoint's, or empty for a new run).
    """
    lines = "".join(json.dumps(json_safe(record)) + "\n" for record in history)
    write_text_atomic(run_dir / "metrics.jsonl", lines)
