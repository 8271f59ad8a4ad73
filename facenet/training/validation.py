"""Evaluating a run: validation pairs choose, test pairs report.

Validation (before training and every ``eval.every`` epochs) chooses ``best.pt`` and the
threshold the run hands on; the test pairs, identity-disjoint, are evaluated once at the end,
for the selected and the last model, and choose nothing.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from facenet.checkpoint import load_checkpoint
from facenet.config import Config
from facenet.data.loading import resolve_loader_settings
from facenet.distributed import broadcast_buffers, is_main_process
from facenet.errors import CheckpointError
from facenet.evaluation.plots import plot_roc
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.report import figures
from facenet.evaluation.verify import verify
from facenet.inference.loading import weights_digest


def verify_settings(cfg: Config, device_type: str = "cpu") -> VerifySettings:
    """The run's ``eval`` section as verification settings; "auto" loader workers depend on
    where the model runs."""
    workers, _ = resolve_loader_settings(cfg.data.num_workers, False, device_type)
    return replace(VerifySettings.of(cfg.eval), num_workers=workers)


def _verify(model, pairs, data, cfg: Config, device):
    """(VerificationResult, (N,) pair distances) of ``model`` on ``pairs`` of ``data``'s images."""
    settings = verify_settings(cfg, torch.device(device).type)
    return verify(
        model,
        pairs,
        data.image_size,
        settings,
        normalize=data.normalize,
        device=device,
        return_distances=True,
    )


def _plot(result, run_dir: Path, name: str, title: str, cfg: Config, logger, step: int) -> None:
    """The ROC figure, drawn once by rank 0: saved as a PNG and logged to TensorBoard."""
    if not is_main_process():  # rank 0's logger is the enabled one
        return
    figure = plot_roc(result, log_scale=cfg.eval.log_scale_roc, title=title)
    figure.savefig(run_dir / f"roc_{name}.png", format="png")
    logger.log_figure(f"eval/{name.split('_')[0]}/roc", figure, step)


def threshold_for(model, cfg: Config) -> dict:
    """What a validation threshold is chosen for: the weights' content hash (the epoch's
    checkpoint, written right after from these weights, gives the same digest) and the
    preparation."""
    return {"weights_sha256": weights_digest(model), **VerifySettings.of(cfg.eval).provenance()}


def validate(trainer, data, cfg: Config, epoch: int, run_dir: Path, logger) -> dict:
    """Validation figures of the model as it is (epoch 0: before training), with the
    threshold, its distance and ``threshold_for``; ``roc_val_epoch_<epoch>.png``."""
    broadcast_buffers(trainer.core_model)  # every rank embeds with rank 0's statistics
    result, _ = _verify(trainer.core_model, data.val_pairs, data, cfg, trainer.device)
    title = f"{run_dir.name}: validation, epoch {epoch}"
    _plot(result, run_dir, f"val_epoch_{epoch}", title, cfg, logger, epoch)
    values = figures(result)
    logger.log_scalars("eval/val", values, epoch)
    values["threshold_for"] = threshold_for(trainer.core_model, cfg)
    return values


def _selected_model(trainer, run_dir: Path, best_epoch: int):
    """A copy of the model with ``best.pt``'s weights."""
    path = run_dir / "best.pt"
    if not path.is_file():
        raise CheckpointError(f"{path} (epoch {best_epoch}) is missing")
    state = load_checkpoint(path, map_location=trainer.device)
    if int(state["epoch"]) != best_epoch:  # never report one epoch's file as another's
        raise CheckpointError(
            f"{path} holds epoch {state['epoch']}, but validation chose epoch {best_epoch}"
        )
    model = copy.deepcopy(trainer.core_model)
    model.load_state_dict(state["model"])
    return model


def _test_one(model, trainer, data, cfg, threshold: float | None):
    result, distances = _verify(model, data.test_pairs, data, cfg, trainer.device)
    values = figures(result)
    # the run's threshold is the validation one, not the test pairs' own
    del values["threshold"], values["distance"]
    if threshold is not None and not cfg.eval.subtract_mean:
        same = np.asarray(data.test_pairs.issame, dtype=bool)
        values["accuracy_at_validation_threshold"] = float(np.mean((distances < threshold) == same))
    return result, values


def test_selected(trainer, data, cfg, best_epoch, threshold, last_epoch, run_dir, logger) -> dict:
    """``{"last": figures, "best": figures}`` on the test pairs, once, at the end (``best``:
    ``best.pt``'s epoch ``best_epoch``, chosen on validation; it is ``last`` when they are one
    model, absent without a selection); ``threshold``: the validation one, or None."""
    broadcast_buffers(trainer.core_model)  # every rank embeds with rank 0's statistics
    with torch.no_grad():
        result, last = _test_one(trainer.core_model, trainer, data, cfg, threshold)
    last = {"epoch": last_epoch, **last}
    out = {}
    if best_epoch is not None and best_epoch != last_epoch:
        best_model = _selected_model(trainer, run_dir, best_epoch)
        result, best = _test_one(best_model, trainer, data, cfg, threshold)
        out["best"] = {"epoch": best_epoch, **best}
    elif best_epoch is not None:
        out["best"] = last
    out["last"] = last
    chosen = out.get("best", last)
    title = f"{run_dir.name}: test, epoch {chosen['epoch']}"
    _plot(result, run_dir, "test", title, cfg, logger, last_epoch)
    for name, values in out.items():
        logger.log_scalars(f"eval/test/{name}", values, last_epoch)
    return out
