"""Evaluating a run: validation pairs choose, test pairs report.

Validation (before training and every ``eval.every`` epochs) chooses ``best.pt`` and the
threshold the run hands on; the test pairs, identity-disjoint, are evaluated once at the end,
for the selected and the last model, and choose nothing.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np

from facenet.checkpoint import load_checkpoint, weights_digest
from facenet.config import Config
from facenet.data.loading import resolve_loader_settings
from facenet.distributed import broadcast_buffers, is_main_process
from facenet.errors import CheckpointError
from facenet.evaluation.plots import plot_roc
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.report import figures
from facenet.evaluation.verify import verify
from facenet.files import write_atomic
from facenet.memory import memory_figures, reset_cuda_peaks
from facenet.training.logger import max_over_ranks


def verify_settings(cfg: Config, device_type: str = "cpu") -> VerifySettings:
    """The run's ``eval`` section as verification settings; "auto" loader workers depend on
    where the model runs."""
    workers, _ = resolve_loader_settings(cfg.data.num_workers, False, device_type)
    return replace(VerifySettings.of(cfg.eval), num_workers=workers)


def validation_due(cfg: Config, epoch: int) -> bool:
    """Whether validation runs after ``epoch`` (every ``eval.every`` epochs, and the last)."""
    every = cfg.eval.every
    return every > 0 and (epoch % every == 0 or epoch == cfg.train.epochs)


def _verify(run, model, pairs):
    """(VerificationResult, (N,) pair distances) of ``model`` on ``pairs`` of the run's images,
    every rank embedding with rank 0's statistics."""
    data, device = run.cfg.data, run.trainer.device
    broadcast_buffers(model)
    settings = verify_settings(run.cfg, device.type)
    return verify(
        model,
        pairs,
        data.image_size,
        settings,
        normalize=data.normalize,
        device=device,
        return_distances=True,
    )


def _plot(run, result, name: str, title: str, step: int) -> None:
    """The ROC figure, drawn once by rank 0: saved as a PNG and logged to TensorBoard."""
    if not is_main_process():  # rank 0's logger is the enabled one
        return
    title = f"{run.run_dir.name}: {title}"
    figure = plot_roc(result, log_scale=run.cfg.eval.log_scale_roc, title=title)
    # replaced whole, never written into: a hard link's other names keep their bytes
    write_atomic(run.run_dir / f"roc_{name}.png", lambda fh: figure.savefig(fh, format="png"))
    run.logger.log_figure(f"eval/{name.split('_')[0]}/roc", figure, step)


def validate(run, epoch: int) -> dict:
    """Validation figures of the run's model as it is (epoch 0: before training), with the
    threshold, its distance and ``threshold_for``: the weights' content hash (the epoch's
    checkpoint, written right after from them, gives the same) and the preparation; on CUDA
    the allocator's peaks during validation; ``roc_val_epoch_<epoch>.png``."""
    model, device = run.trainer.core_model, run.trainer.device
    reset_cuda_peaks(device)  # the epoch's record has read the training peaks
    result, _ = _verify(run, model, run.data.val_pairs)
    _plot(run, result, f"val_epoch_{epoch}", f"validation, epoch {epoch}", epoch)
    # on CUDA, validation's own peaks (its batches are not training's), over the ranks
    values = {**figures(result), **max_over_ranks(memory_figures(device=device, rss=False))}
    run.logger.log_scalars("eval/val", values, epoch)
    provenance = VerifySettings.of(run.cfg.eval).provenance()
    values["threshold_for"] = {"weights_sha256": weights_digest(model), **provenance}
    return values


def _selected_model(run, best_epoch: int):
    """A copy of the model with ``best.pt``'s weights."""
    path, model = run.run_dir / "best.pt", run.trainer.core_model
    if not path.is_file():
        raise CheckpointError(f"{path} (epoch {best_epoch}) is missing")
    # Read on the CPU (the file's optimizer state never reaches the device, mapped and left
    # unread); only the model's weights are copied into the device's model.
    state = load_checkpoint(path, map_location="cpu")
    if int(state["epoch"]) != best_epoch:  # never report one epoch's file as another's
        raise CheckpointError(
            f"{path} holds epoch {state['epoch']}, but validation chose epoch {best_epoch}"
        )
    model = copy.deepcopy(model)
    model.load_state_dict(state["model"])
    return model


def _test_one(run, model, threshold: float | None):
    pairs = run.data.test_pairs
    result, distances = _verify(run, model, pairs)
    values = figures(result)
    # the run's threshold is the validation one, not the test pairs' own
    del values["threshold"], values["distance"]
    if threshold is not None and not run.cfg.eval.subtract_mean:
        same = np.asarray(pairs.issame, dtype=bool)
        values["accuracy_at_validation_threshold"] = float(np.mean((distances < threshold) == same))
    return result, values


def test_selected(run, best: dict | None) -> dict:
    """``{"last": figures, "best": figures}`` on the test pairs, once, at the end (``best``:
    ``best.pt``'s epoch, chosen on validation, whose figures ``best`` are; it is ``last`` when
    they are one model, absent without a selection)."""
    best_epoch, last_epoch = run.progress.best_epoch, run.progress.history[-1]["epoch"]
    threshold = (best or {}).get("threshold")
    result, last = _test_one(run, run.trainer.core_model, threshold)
    last, out = {"epoch": last_epoch, **last}, {}
    if best_epoch is not None and best_epoch != last_epoch:
        result, figures_best = _test_one(run, _selected_model(run, best_epoch), threshold)
        out["best"] = {"epoch": best_epoch, **figures_best}
    elif best_epoch is not None:
        out["best"] = last
    out["last"] = last
    _plot(run, result, "test", f"test, epoch {out.get('best', last)['epoch']}", last_epoch)
    for name, values in out.items():
        run.logger.log_scalars(f"eval/test/{name}", values, last_epoch)
    return out
