"""A whole training run from a configuration: what ``facenet-train`` calls.

``run_training(cfg)`` starts the process group, prepares and locks the run directory, builds
the objects (``build``) and hands them to ``loop.fit``; errors become one line and an exit
code (2: bad input, 3: a run of non-finite losses, 128 + N: stopped by signal N). What a
checkpoint holds and how a run resumes bit for bit is ``state``; docs/reliability.md gives
the guarantees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch

from facenet.config import Config, save_config
from facenet.data.folder import prepare_index
from facenet.distributed import (
    DistInfo,
    any_rank,
    cleanup_distributed,
    gather_objects,
    init_distributed,
    is_main_process,
    main_process_first,
    set_threads,
)
from facenet.errors import EXIT_BAD_INPUT, FacenetError, NonFiniteLossError
from facenet.registry import load
from facenet.training.build import build_data, build_network, build_trainer
from facenet.training.console import describe_error, final_lines
from facenet.training.loop import Run, fit
from facenet.training.run_dir import RunDirLock, RunOutputs
from facenet.training.state import read_resume_checkpoint, restore
from facenet.training.validation import validation_due

EXIT_NONFINITE_LOSS = 3


def run_training(cfg: Config, resume: bool = False, overwrite: bool = False) -> int:
    """The run in ``logging.out_dir``; the exit code (130 also for a second signal or a
    Ctrl-C outside the training loop). ``resume``: continue from its ``last.pt`` (a new run if
    there is none); ``overwrite``: start a new run in place of the previous one, whose outputs
    are removed when the new run first writes."""
    set_threads(cfg.train.threads)  # before any torch work
    cfg.train.threads = torch.get_num_threads()  # config.yaml records the count used
    try:
        info = init_distributed(cfg.train.device, cfg.train.dist_timeout_minutes)
    except FacenetError as err:  # CUDA asked for where there is none
        print(f"error: train.device: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_dir = Path(cfg.logging.out_dir)
    with contextlib.ExitStack() as stack:
        stack.callback(cleanup_distributed)  # last, after the lock and stdout are released
        if not info.is_main:  # one console: rank 0's (errors still reach stderr)
            devnull = stack.enter_context(open(os.devnull, "w"))
            stack.enter_context(contextlib.redirect_stdout(devnull))
        problem = _prepare_run_dir(run_dir, cfg, resume, overwrite, stack)
        # any_rank: a collective; every rank stops when rank 0 cannot go on.
        if any_rank(problem is not None):
            if problem:
                print(f"error: {problem}", file=sys.stderr)
            return EXIT_BAD_INPUT
        stack.enter_context(_seeded(cfg, info.rank))
        try:
            # Refused files and settings fail before anything is written.
            state = read_resume_checkpoint(run_dir, cfg) if resume else None
            outputs = RunOutputs(run_dir, overwrite, _read_paths(cfg), enabled=info.is_main)
            outputs.plan(planned_outputs(cfg, resumed=state is not None))
            summary = fit(_build(cfg, run_dir, info, outputs, overwrite, state))
        except KeyboardInterrupt as err:
            print(f"error: {_interrupted_message(err, run_dir)}", file=sys.stderr)
            return 128 + signal.SIGINT
        except (FacenetError, OSError) as err:  # a bug keeps its traceback
            if info.is_main or not getattr(err, "agreed", False):  # one report of it
                print(f"error: {describe_error(err)}", file=sys.stderr)
            return EXIT_NONFINITE_LOSS if isinstance(err, NonFiniteLossError) else EXIT_BAD_INPUT
        for line in final_lines(summary):  # inside the stack: rank 0's console only
            print(line)
        print(f"run directory: {run_dir}")
    if summary["stopped_by"]:
        return 128 + signal.Signals[summary["stopped_by"]].value
    return 0


def _build(
    cfg: Config,
    run_dir: Path,
    info: DistInfo,
    outputs: RunOutputs,
    check_model_first: bool,
    state: dict | None,
) -> Run:
    """The run's data and trainer on this rank's device, ``state`` (``--resume``) restored,
    then ``config.yaml``. The first file written removes the previous run under --overwrite:
    ``check_model_first`` builds the model once before the data, so that a model mistake also
    leaves the previous run as it was."""
    device = info.device
    if cfg.train.deterministic and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    if check_model_first:
        build_network(cfg)
    _index_training_folder(cfg, info)
    # Rank 0 writes the synthetic data and the held-out pairs; the others wait for work that
    # is bounded (the folder's index is ready on every rank).
    with main_process_first():
        data = build_data(cfg, run_dir, info.rank, info.world_size, outputs, device.type)
    trainer = build_trainer(cfg, data.num_classes, device, data.steps_per_epoch)
    run = Run(trainer, data, cfg, run_dir, outputs)
    if state is not None:  # a checkpoint that does not fit leaves config.yaml as it was
        run.progress = restore(run, state)
    if cfg.train.cache_frozen:  # from the restored weights (the frozen ones never change)
        cached_loader = load("facenet.training.cache:cached_loader")  # only this run's option
        loader, note = cached_loader(trainer.step.core, data.loader, cfg, info.rank)
        run.data = dataclasses.replace(data, loader=loader, notes=[*data.notes, note])
    if info.is_main:
        outputs.add(run_dir / "config.yaml")
        save_config(cfg, run_dir / "config.yaml")
    if outputs.removed:
        print(
            f"--overwrite: removed {len(outputs.removed)} outputs of the previous run in "
            f"{run_dir} ({', '.join(p.name for p in outputs.removed[:6])}"
            f"{', ...' if len(outputs.removed) > 6 else ''})",
            file=sys.stderr,
        )
    return run


def _index_training_folder(cfg: Config, info: DistInfo) -> None:
    """Check or build the training folder's index on every rank together: each checks every
    world_size-th identity folder and the parts are gathered, so no rank waits in a barrier
    while another checks the whole folder (a wait bounded only by the process-group timeout)."""
    data = cfg.data
    if data.dataset in ("folder", "triplets") and data.root:
        limits = (data.max_image_pixels, data.max_aspect_ratio)
        part = (info.rank, info.world_size)
        prepare_index(data.root, data.cache_dir, limits, part, gather_objects)


def planned_outputs(cfg: Config, resumed: bool) -> list[str]:
    """The names a run of ``cfg`` writes in its run directory (``build_data`` adds the held-out
    pairs, an error ``nonfinite.pt``); validation and test pairs as ``build_data`` finds them."""
    ev, names = cfg.eval, ["config.yaml", "metrics.jsonl", "last.pt", "summary.json"]
    names += ["tensorboard"] if cfg.logging.tensorboard else []
    made = cfg.data.dataset == "synthetic" or ev.heldout_identities > 0
    val, test = ev.every > 0 and (made or ev.val_pairs), ev.every > 0 and (made or ev.pairs)
    names += ["best.pt"] if val or test else []
    epochs = [
        e for e in range(int(resumed), cfg.train.epochs + 1) if val and validation_due(cfg, e)
    ]
    names += [f"roc_val_epoch_{e}.png" for e in epochs]
    return names + ["roc_test.png"] if test else names


def _read_paths(cfg: Config) -> list[str]:
    """Every path the configuration reads (None where unset): never removed by --overwrite."""
    data, ev = cfg.data, cfg.eval
    read = [data.root, data.cache_dir, cfg.model.weights]
    return read + [ev.val_pairs, ev.val_root, ev.pairs, ev.root]


@contextlib.contextmanager
def _seeded(cfg: Config, rank: int):
    """Seed this rank (augmentation differs per rank); deterministic algorithms on request."""
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(cfg.train.seed + rank)
    if cfg.train.deterministic:
        # warn_only: CUDA's adaptive average pooling backward has no deterministic version.
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic_before)


def _prepare_run_dir(
    run_dir: Path, cfg: Config, resume: bool, overwrite: bool, stack: contextlib.ExitStack
) -> str | None:
    """Create and lock the run directory (rank 0, for the life of ``stack``); an error
    message, or None. Nothing of a previous run is removed yet."""
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
        stack.enter_context(RunDirLock(run_dir))  # also proves the directory writable
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
