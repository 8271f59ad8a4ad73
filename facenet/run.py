"""A whole training run from a configuration: data, model, trainer, epochs, checkpoints, logs.

``run_training(cfg)`` is what ``scripts/train.py`` calls. The run directory receives
``config.yaml``, ``metrics.jsonl`` (one line per epoch), TensorBoard events, ``roc_epoch_N.png``,
``last.pt`` / ``best.pt`` and ``summary.json``.
"""

from __future__ import annotations

import json
import math
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from facenet.checkpoint import (
    CheckpointError,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from facenet.config import Config, config_to_dict, save_config
from facenet.memory import format_bytes
from facenet.run_logger import RunLogger
from facenet.trainer import NonFiniteLossError, Trainer

__all__ = ["TrainingData", "build_data", "build_trainer", "resolve_device", "fit", "run_training"]

SUMMARY_KEYS = ("accuracy_mean", "accuracy_std", "val", "val_std", "far", "auc", "eer")


@dataclass
class TrainingData:
    """Everything the loop needs from the data side."""

    loader: Any
    sampler: Any  # has set_epoch / state_dict / load_state_dict
    num_classes: int
    eval_pairs: Any  # a PairList, or None
    image_size: int
    normalize: str


def resolve_device(name: str) -> torch.device:
    """"auto" picks CUDA when present; "cuda" without a GPU is an error naming the key."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def _data_roots(cfg: Config, run_dir: Path) -> tuple[str, str | None]:
    """The training image folder and the pairs file, generating the synthetic set if needed."""
    data = cfg.data
    if data.dataset == "synthetic":
        from facenet.data.synthetic import prepare_synthetic_data

        root = Path(data.root) if data.root else run_dir / "data"
        prepared = prepare_synthetic_data(root, data)
        return str(prepared["train_root"]), cfg.eval.pairs or str(prepared["pairs"])
    if not data.root:
        raise ValueError(f"data.root: required for data.dataset: {data.dataset}")
    return data.root, cfg.eval.pairs


def build_data(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1) -> TrainingData:
    """Datasets, sampler and loader from the ``data`` and ``eval`` sections.

    Args:
        cfg: the run configuration.
        run_dir: the run directory (the synthetic data goes there when ``data.root`` is unset).
        rank: this process's rank (the sampler gives each rank disjoint batches).
        world_size: number of processes.
    """
    from facenet.data import IdentityFolder, PKSampler, TripletListDataset, build_transform
    from facenet.data.loading import make_loader

    data = cfg.data
    train_root, pairs_path = _data_roots(cfg, run_dir)
    transform = build_transform(
        data.image_size,
        train=True,
        normalize=data.normalize,
        hflip=data.hflip,
        random_crop=data.random_crop,
    )
    dataset = IdentityFolder(
        train_root, transform=transform, on_corrupt=data.on_corrupt, cache_dir=data.cache_dir
    )
    seed = cfg.train.seed
    if data.dataset == "triplets":
        sampler = TripletListDataset(
            dataset.targets, data.triplets_per_epoch, seed=seed, paths_or_dataset=dataset
        )
        loader = torch.utils.data.DataLoader(
            sampler,
            batch_size=data.triplet_batch_size,
            shuffle=False,
            num_workers=data.num_workers,
            pin_memory=data.pin_memory,
            drop_last=True,
        )
    else:
        sampler = PKSampler(
            dataset.targets,
            p=data.p,
            k=data.k,
            seed=seed,
            with_replacement=data.sample_with_replacement,
            rank=rank,
            world_size=world_size,
        )
        loader = make_loader(dataset, sampler, data.num_workers, data.pin_memory, seed=seed)
    eval_pairs = None
    if cfg.eval.every > 0 and pairs_path:
        from facenet.data.pairs import read_pairs

        eval_pairs = read_pairs(pairs_path, root=cfg.eval.root, skip_missing=cfg.eval.skip_missing)
    return TrainingData(
        loader, sampler, len(dataset.classes), eval_pairs, data.image_size, data.normalize
    )


def build_trainer(cfg: Config, num_classes: int | None, device: torch.device) -> Trainer:
    """Model, miner, loss, optimizer and schedule from the configuration."""
    from facenet.losses import build_loss
    from facenet.miners import build_miner
    from facenet.models import build_model
    from facenet.optim import build_optimizer, build_scheduler

    use_ce = cfg.loss.ce_weight > 0
    model = build_model(cfg.model, num_classes=num_classes if use_ce else None)
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed)
    miner = build_miner(cfg.mining, generator=generator)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    return Trainer(
        model,
        miner,
        build_loss(cfg.loss),
        optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, cfg.train.epochs),
        device=device,
        amp=cfg.train.amp,
        ce_weight=cfg.loss.ce_weight,
        passes=cfg.mining.passes,
        grad_clip=cfg.optim.grad_clip,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps,
        channels_last=cfg.model.channels_last,
        chunk_size=cfg.train.chunk_size,
    )


class _StopFlag:
    """SIGINT/SIGTERM set a flag: the current step finishes, a checkpoint is written."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __call__(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

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


def _eval_record(result) -> dict:
    return {key: float(getattr(result, key)) for key in SUMMARY_KEYS}


def _console_line(record: dict, epochs: int) -> str:
    line = (
        f"epoch {record['epoch']}/{epochs}  loss {record['loss']:.4f}  "
        f"active {record['active_fraction']:.2f}  {record['images_per_second']:.0f} img/s  "
        f"| graph peak {format_bytes(record['graph_bytes_peak'])} "
        f"alive {format_bytes(record['graph_bytes_alive'])} "
        f"rss {format_bytes(record['peak_rss_bytes'])}"
    )
    if "cuda_max_allocated" in record:
        line += f" cuda {format_bytes(record['cuda_max_allocated'])}"
    if "accuracy_mean" in record:
        line += (
            f"  | acc {record['accuracy_mean']:.4f}±{record['accuracy_std']:.4f} "
            f"val {record['val']:.4f} auc {record['auc']:.4f}"
        )
    return line


def _collapse_warning(record: dict, margin: float) -> str | None:
    """The loss sits at the margin with d(a,p) ~ d(a,n): embeddings may have collapsed."""
    gap = record.get("mean_dan", math.nan) - record.get("mean_dap", math.nan)
    if abs(gap) < 0.05 * margin and record.get("triplet_loss", 0.0) > 0.9 * margin:
        return (
            f"warning: possible collapse at epoch {record['epoch']}: triplet loss "
            f"{record['triplet_loss']:.4f} ~ margin {margin} with d(a,n) - d(a,p) = {gap:.4f}"
        )
    return None


def _checkpoint_state(trainer, data, cfg, epoch, best, history) -> dict:
    state = trainer.state_dict()
    state.update(
        epoch=epoch,
        config=config_to_dict(cfg),
        rng=rng_state(),
        sampler=data.sampler.state_dict() if hasattr(data.sampler, "state_dict") else None,
        best_accuracy=best,
        history=history,
    )
    return state


def _resume(trainer, data, run_dir: Path) -> tuple[int, float, list]:
    state = load_checkpoint(run_dir / "last.pt", map_location="cpu")
    trainer.load_state_dict(state)
    if state.get("sampler") is not None and hasattr(data.sampler, "load_state_dict"):
        data.sampler.load_state_dict(state["sampler"])
    set_rng_state(state["rng"])
    print(f"resumed from {run_dir / 'last.pt'} after epoch {state['epoch']}")
    return int(state["epoch"]) + 1, float(state["best_accuracy"]), list(state["history"])


def _evaluate(trainer, data, cfg, epoch, run_dir, logger) -> dict:
    from facenet.evaluation import plot_roc

    result = trainer.evaluate(data.eval_pairs, cfg.eval, data.image_size, data.normalize)
    plot_roc(result, run_dir / f"roc_epoch_{epoch}.png", log_scale=cfg.eval.log_scale_roc)
    logger.log_figure("roc", plot_roc(result, log_scale=cfg.eval.log_scale_roc), epoch)
    return _eval_record(result)


def fit(trainer: Trainer, data: TrainingData, cfg: Config, run_dir: Path, resume: bool) -> dict:
    """Train for ``cfg.train.epochs`` epochs with evaluation, logging and checkpoints.

    Returns the summary written to ``summary.json``.
    """
    logger = RunLogger(run_dir, tensorboard=cfg.logging.tensorboard)
    start, best, history = 1, -1.0, []
    summary: dict[str, Any] = {}
    if resume and (run_dir / "last.pt").exists():
        start, best, history = _resume(trainer, data, run_dir)
        summary_path = run_dir / "summary.json"
        if summary_path.exists():
            summary = json.loads(summary_path.read_text())
    elif data.eval_pairs is not None:
        summary["before_training"] = _evaluate(trainer, data, cfg, 0, run_dir, logger)
        print(f"before training: accuracy {summary['before_training']['accuracy_mean']:.4f}")
    epoch = start - 1
    try:
        with _StopFlag() as stop:
            for epoch in range(start, cfg.train.epochs + 1):
                if hasattr(data.sampler, "set_epoch"):
                    data.sampler.set_epoch(epoch)
                record = trainer.train_one_epoch(
                    data.loader,
                    epoch,
                    max_steps=cfg.train.steps_per_epoch,
                    log_interval=cfg.train.log_interval,
                    progress=cfg.logging.progress,
                    should_stop=stop,
                )
                every = cfg.eval.every
                if data.eval_pairs is not None and every > 0 and (
                    epoch % every == 0 or epoch == cfg.train.epochs
                ):
                    record.update(_evaluate(trainer, data, cfg, epoch, run_dir, logger))
                logger.log_epoch(record)
                history.append(record)
                print(_console_line(record, cfg.train.epochs))
                warning = _collapse_warning(record, cfg.loss.margin)
                if warning:
                    print(warning, file=sys.stderr)
                is_best = record.get("accuracy_mean", -1.0) > best
                best = max(best, record.get("accuracy_mean", -1.0))
                state = _checkpoint_state(trainer, data, cfg, epoch, best, history)
                save_checkpoint(state, run_dir / "last.pt")
                if is_best:
                    save_checkpoint(state, run_dir / "best.pt")
                if stop():
                    print(
                        f"stopped by {stop.signal} during epoch {epoch}; checkpoint written to "
                        f"{run_dir / 'last.pt'} (--resume continues with epoch {epoch + 1})",
                        file=sys.stderr,
                    )
                    break
    except NonFiniteLossError:
        state = _checkpoint_state(trainer, data, cfg, epoch - 1, best, history)
        save_checkpoint(state, run_dir / "nonfinite.pt")
        raise
    finally:
        logger.close()
    summary.update(_summary(history, best))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _summary(history: list, best: float) -> dict:
    evaluated = [r for r in history if "accuracy_mean" in r]
    summary = {
        "epochs": len(history),
        "best_accuracy": best if best >= 0 else None,
        "memory_per_epoch": [
            {k: r[k] for k in r if k == "epoch" or "bytes" in k or k.startswith("cuda")}
            for r in history
        ],
    }
    if evaluated:
        summary["final"] = {k: evaluated[-1][k] for k in SUMMARY_KEYS}
    return summary


def run_training(cfg: Config, resume: bool = False) -> int:
    """The whole run for ``scripts/train.py``; returns an exit code."""
    run_dir = Path(cfg.logging.out_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    except OSError as err:
        print(f"error: cannot write the run directory {run_dir}: {err.strerror}", file=sys.stderr)
        return 2
    torch.manual_seed(cfg.train.seed)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    try:
        device = resolve_device(cfg.train.device)
        data = build_data(cfg, run_dir)
        trainer = build_trainer(cfg, data.num_classes, device)
        summary = fit(trainer, data, cfg, run_dir, resume)
    except (ValueError, FileNotFoundError, CheckpointError, NonFiniteLossError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if not isinstance(err, NonFiniteLossError) else 3
    before = summary.get("before_training", {}).get("accuracy_mean")
    final = summary.get("final", {})
    if final:
        print(
            "held-out verification: accuracy "
            + (f"{before:.4f} before training -> " if before is not None else "")
            + f"{final['accuracy_mean']:.4f} ± {final['accuracy_std']:.4f} after; "
            f"VAL@FAR={cfg.eval.far_target:g}: {final['val']:.4f}; AUC {final['auc']:.4f}; "
            f"EER {final['eer']:.4f}"
        )
    print(f"run directory: {run_dir}")
    return 0
