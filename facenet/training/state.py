"""What a training checkpoint holds, and how a run continues from one, bit for bit.

``last.pt`` / ``best.pt`` hold everything the rest of the run depends on: the trainer's state
(model, optimizer, schedule, scaler), every rank's RNG states, miner generator and sampler
position, the history and, when an epoch stopped part-way, how many of its batches were
trained (``--resume`` skips exactly those). ``CountedBatches`` hands out an epoch's batches
from that point and counts them; ``Progress`` is where the run stands, and what it reports.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from facenet.checkpoint import (
    first_line,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from facenet.config import Config, config_to_dict
from facenet.data.images import CorruptImageError
from facenet.distributed import (
    agree_on_error,
    any_rank,
    gather_objects,
    get_rank,
    get_world_size,
    is_main_process,
)
from facenet.errors import CheckpointError, ConfigError, one_line, shown
from facenet.files import json_safe, write_text_atomic
from facenet.training.engine import Trainer

CHECKPOINT_FORMAT = 2
# Keys every training checkpoint holds; a file without them is not one of ours.
_REQUIRED_KEYS = ("model", "optimizer", "epoch", "rng", "config", "history", "best_accuracy")
# Settings that may change between a run and its resumption without a warning.
_FREELY_CHANGED = ("logging.", "train.epochs", "train.device", "data.num_workers", "eval.")
# Settings the checkpoint's state was built for (the optimizer's kind and parameter groups, the
# schedule the position continues, the network and its classifier head): a change is refused.
# The optimizer's other hyper-parameters (lr, momentum, weight_decay) apply as configured.
STATE_SHAPING = (
    "optim.name",
    "optim.schedule",
    "optim.warmup_epochs",
    "optim.warmup_steps",
    "optim.step_size",
    "optim.gamma",
    "optim.min_lr_ratio",
    "optim.backbone_lr_scale",
    "optim.freeze_backbone_epochs",
    "optim.freeze_up_to",
    "model.backbone",
    "model.embedding_dim",
    "loss.ce",
    "loss.ce_weight",
)


@dataclass
class Progress:
    """Where a run stands: ``epoch`` to train next (1-based), ``steps_done`` of its batches,
    the best validation accuracy (-1 before any) and its epoch, one ``history`` record per
    finished epoch (as in ``metrics.jsonl``); ``seconds``: wall time of earlier sessions. What
    the run reports is read from it: its summary, and whether patience ran out."""

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
        return self.seconds + time.perf_counter() - self.session_start

    def validation_of(self, epoch: int | None) -> dict | None:
        """The validation figures recorded for ``epoch``, or None."""
        validated = (r for r in self.history if r.get("epoch") == epoch and "validation" in r)
        return next((r["validation"] for r in validated), None)

    def patience_spent(self, patience: int) -> str | None:
        """Why the run stops early, or None: ``patience`` (> 0) validations since the best one
        without a higher accuracy. Read from the history, so a resumed run decides the same."""
        best_epoch = self.best_epoch
        if patience <= 0 or best_epoch is None:
            return None
        since = [r for r in self.history if "validation" in r and r["epoch"] > best_epoch]
        if len(since) < patience:
            return None
        return (
            f"early stop after epoch {since[-1]['epoch']}: {len(since)} validations without a "
            f"better accuracy than epoch {best_epoch}'s {self.best:.4f} (eval.patience: "
            f"{patience}); best.pt holds epoch {best_epoch}"
        )

    def summary(self, stopped_by: str | None, test: dict | None, early: str | None) -> dict:
        """What ``summary.json`` holds: selection, threshold, test figures, time, memory;
        ``stopped_by``: the signal that stopped the run, or None; ``early``: why
        ``eval.patience`` stopped the run before its last epoch, or None."""
        history = self.history
        best = self.validation_of(self.best_epoch)
        validated = [r["validation"] for r in history if "validation" in r]
        rates = [r["images_per_second"] for r in history if r.get("images_per_second") is not None]
        summary: dict[str, Any] = {
            "epochs": len(history),
            "stopped_by": stopped_by,
            "early_stop": early,
            "before_training": self.before_training and {"validation": self.before_training},
            "best_epoch": self.best_epoch,
            "best_validation": best,
            "final_validation": validated[-1] if validated else None,
            # The threshold with what it was chosen for (weights' hash, flip, mean subtraction,
            # preprocessing): the after-training tools use it only where all of these match.
            "threshold": best
            and {
                "value": best["threshold"],
                "distance": best["distance"],
                "chosen_on": "validation pairs",
                "epoch": self.best_epoch,
                **(best.get("threshold_for") or {}),
            },
            "test": test,
            "wall_seconds": self.elapsed(),
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


def _miner_generator(trainer: Trainer) -> torch.Generator | None:
    return getattr(trainer.step.miner, "generator", None)


def checkpoint_state(run) -> dict:
    """Everything the rest of the ``loop.Run`` depends on, as plain contents; every rank calls
    it (a collective: the ranks' own random states and data positions are gathered into
    ``ranks``). ``epoch`` is the last finished epoch; ``partial`` is ``{"epoch",
    "steps_done"}`` when the run stands inside an epoch, else None.
    """
    trainer, sampler, progress = run.trainer, run.data.sampler, run.progress
    generator = _miner_generator(trainer)
    own = {
        "rng": rng_state(),
        "miner_rng": None if generator is None else generator.get_state(),
        "sampler": sampler.state_dict() if hasattr(sampler, "state_dict") else None,
    }
    ranks = gather_objects(own)  # every rank calls this
    state = trainer.state_dict()
    state.update(
        format=CHECKPOINT_FORMAT,
        epoch=progress.epoch - 1,
        partial={"epoch": progress.epoch, "steps_done": progress.steps_done}
        if progress.steps_done
        else None,
        config=config_to_dict(run.cfg),
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


def read_resume_checkpoint(run_dir: Path, cfg: Config) -> dict | None:
    """``run_dir/last.pt``, checked to be a training checkpoint (else CheckpointError) of
    ``cfg``'s ``STATE_SHAPING`` settings and synthetic data set (else ConfigError), other
    changes warned of; None, with a note, if absent."""
    path = run_dir / "last.pt"
    if not path.exists():
        print(f"--resume: no checkpoint at {path}; starting a new run", file=sys.stderr)
        return None
    state = load_checkpoint(path, map_location="cpu")
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(
            f"{path} is not a training checkpoint of this package (missing: {', '.join(missing)})"
        )
    if not isinstance(state["config"], dict):
        raise CheckpointError(f"{path}: its config field is not a mapping")
    changes = _changed_settings(state["config"], config_to_dict(cfg))
    # A changed synthetic set would be generated anew over the one the run trained on.
    data = ("data.synthetic_", "data.image_size") if cfg.data.dataset == "synthetic" else ()
    refused = [change for name, change in changes if name in STATE_SHAPING or name.startswith(data)]
    if refused:
        raise ConfigError(
            f"{path} does not fit this configuration: {'; '.join(refused)} (its state was built "
            "for the checkpoint's value): resume with that, or start a new run from its "
            "weights (model.weights)"
        )
    if changes:
        warned = "; ".join(change for _, change in changes)
        print(f"warning: resuming with changed settings: {warned}", file=sys.stderr)
    return state


def _changed_settings(saved: dict, current: dict) -> list[tuple[str, str]]:
    changes = []
    for section, values in current.items():
        saved_section = saved.get(section)
        for key, value in values.items():
            name = f"{section}.{key}"
            old = saved_section.get(key, value) if isinstance(saved_section, dict) else value
            if old != value and not name.startswith(_FREELY_CHANGED):
                changes.append((name, f"{name}: {shown(old)} -> {shown(value)}"))
    return changes


def restore(run, state: dict) -> Progress:
    """Load ``state`` (read from the run's ``last.pt``) into its trainer, sampler and RNGs;
    where the run stands. CheckpointError (ConfigError) when it does not fit."""
    trainer, sampler, path = run.trainer, run.data.sampler, run.run_dir / "last.pt"
    _check_schedule(trainer, state, path)
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
        reason = first_line(err)
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
    """A schedule built for other lengths cannot continue exactly: refused
    (``StepSchedule.resume_problem``)."""
    schedule, saved = trainer.scheduler, state.get("scheduler")
    if saved is None or schedule is None:
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
    """A batch sampler without its first ``skip`` batches; its order must be the same on
    every iteration of an epoch (PKSampler's and TripletListDataset's are)."""

    def __init__(self, batch_sampler, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self):
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


def remaining_loader(loader, skip: int):
    """``loader`` from its batch ``skip`` on, without loading the skipped batches."""
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
        # The global generator must not advance: the epoch drew its loader seed before.
        generator=torch.Generator(),
    )


# torch re-raises a worker's exception with its traceback in the message, as a RuntimeError
# when the class cannot be built from one string (CorruptImageError takes path and reason).
_WORKER_IMAGE_ERROR = re.compile(
    r"CorruptImageError: corrupt or unreadable image (?P<path>.+): (?P<reason>[^:\n]+)\s*$"
)


class CountedBatches:
    """An epoch's batches ``start`` to ``end`` (the epoch's one cap) of ``loader``, the first
    ``start`` skipped unloaded (``remaining_loader``), counted as handed out (``yielded``).

    Under several processes every rank learns, before anyone steps, whether every rank's
    fetch succeeded: a rank that found a corrupt image does not leave the others waiting in
    the step's collectives. Stopping after ``limit`` batches (rather than fetching one more and
    discarding it) keeps the global RNG where a run stopped by a signal at that point leaves it.
    """

    def __init__(self, loader, start: int, end: int):
        self.loader, self.start, self.end = remaining_loader(loader, start), start, end
        self.limit, self.yielded = end - start, 0

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
    agree_on_error(error, None if error is None else one_line(error))


def save_on_main(run, *names: str) -> None:
    """Rank 0 writes the run's checkpoint atomically to each of ``names`` in its directory;
    every rank waits until it is on disk, or raises CheckpointError with it (no rank waits in
    a collective rank 0 never enters)."""
    state = checkpoint_state(run)
    for path in (run.run_dir / name for name in names):
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


def save_for_error(run, name: str) -> str:
    """Write the run's checkpoint ``name`` while an error propagates; what happened, for the
    error's ``checkpoint_note`` (a failure to write is reported, not raised)."""
    state, path = checkpoint_state(run), run.run_dir / name
    if not is_main_process():
        return f"rank 0 writes {path}"
    try:
        save_checkpoint(state, path)
    except CheckpointError as err:
        return f"no checkpoint written ({err})"
    return f"checkpoint written to {path}"


def rewrite_metrics(run_dir: Path, history: list) -> None:
    """``metrics.jsonl`` as the checkpoint knows it: epochs after the checkpoint are dropped."""
    lines = "".join(json.dumps(json_safe(record)) + "\n" for record in history)
    write_text_atomic(run_dir / "metrics.jsonl", lines)
