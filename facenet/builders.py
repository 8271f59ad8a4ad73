"""Turning a configuration into the objects of a run: device, data, loader, pairs, trainer.

``build_data`` reads the ``data`` and ``eval`` sections (writing the synthetic set first when
asked for), ``build_device`` the ``train.device`` key and ``build_trainer`` the ``model``,
``mining``, ``loss``, ``optim`` and ``train`` sections. Bad input raises a ``FacenetError``
whose message names the configuration key to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from facenet.config import Config
from facenet.data import IdentityFolder, PKSampler, TripletListDataset, build_transform
from facenet.data.images import CorruptImageError
from facenet.data.loading import make_loader
from facenet.data.pairs import MissingImagesError, PairsFormatError, read_pairs
from facenet.data.synthetic import prepare_synthetic_data
from facenet.distributed import is_distributed, resolve_device
from facenet.errors import ConfigError, DataError, FacenetError
from facenet.losses import build_loss
from facenet.miners import build_miner
from facenet.models import build_model
from facenet.optim import build_optimizer, build_scheduler, parameter_groups
from facenet.trainer import Trainer

__all__ = ["TrainingData", "build_data", "build_device", "build_trainer"]


@dataclass
class TrainingData:
    """Everything the loop needs from the data side.

    Args:
        loader: yields the training batches of one epoch.
        sampler: orders the batches; has ``set_epoch``, ``state_dict`` and ``load_state_dict``.
        num_classes: identities in the training data.
        eval_pairs: the held-out ``PairList``, or None when evaluation is off.
        image_size: the network's input size (``data.image_size``).
        normalize: the pixel standardisation of training (``data.normalize``).
    """

    loader: Any
    sampler: Any  # has set_epoch / state_dict / load_state_dict
    num_classes: int
    eval_pairs: Any  # a PairList, or None
    image_size: int
    normalize: str


def build_device(cfg: Config) -> torch.device:
    """The device of ``train.device`` ("auto": CUDA when present)."""
    try:
        return resolve_device(cfg.train.device)
    except FacenetError as err:
        raise ConfigError(f"train.device: {err}") from None


def _from_section(section: str, build, *args, **kwargs):
    """``build(*args, **kwargs)``; a value it refuses becomes a ConfigError naming ``section``."""
    try:
        return build(*args, **kwargs)
    except FacenetError:
        raise
    except ValueError as err:
        raise ConfigError(f"{section}: {err}") from None


def _data_roots(cfg: Config, run_dir: Path) -> tuple[str, str | None]:
    """The training image folder and the pairs file, generating the synthetic set if needed."""
    data = cfg.data
    if data.dataset == "synthetic":
        root = Path(data.root) if data.root else run_dir / "data"
        try:
            prepared = prepare_synthetic_data(root, data)
        except OSError as err:
            raise OSError(err.errno, f"data.root: cannot write the synthetic data: {err}") from err
        return str(prepared["train_root"]), cfg.eval.pairs or str(prepared["pairs"])
    if not data.root:
        raise ConfigError(f"data.root: required for data.dataset: {data.dataset}")
    return data.root, cfg.eval.pairs


def _identity_folder(cfg: Config, train_root: str):
    """The training images, with errors that name the ``data`` keys to change."""
    data = cfg.data
    transform = build_transform(
        data.image_size,
        train=True,
        normalize=data.normalize,
        hflip=data.hflip,
        random_crop=data.random_crop,
    )
    try:
        return IdentityFolder(
            train_root,
            transform=transform,
            on_corrupt=data.on_corrupt,
            cache_dir=data.cache_dir,
            max_pixels=data.max_image_pixels,
            max_aspect_ratio=data.max_aspect_ratio,
        )
    except CorruptImageError as err:
        raise CorruptImageError(
            err.path, f"{err.reason} (data.on_corrupt: skip leaves such files out)"
        ) from None
    except DataError as err:
        raise DataError(f"data.root: {err}") from None


def _batch_loader(cfg: Config, dataset, rank: int, world_size: int):
    """(loader, sampler): P x K batches, or seed-style triplet batches (data.dataset: triplets)."""
    data, seed = cfg.data, cfg.train.seed
    if data.dataset == "triplets":
        try:
            sampler = TripletListDataset(
                dataset.targets, data.triplets_per_epoch, seed=seed, paths_or_dataset=dataset
            )
        except ValueError as err:
            raise ConfigError(f"data.triplets_per_epoch: {err}") from None
        if data.triplet_batch_size > len(sampler):
            raise ConfigError(
                f"data.triplet_batch_size={data.triplet_batch_size} is larger than "
                f"data.triplets_per_epoch={len(sampler)}: an epoch would hold no batch"
            )
        # Several ranks: each takes every W-th triplet of the (already random) list.
        split = (
            torch.utils.data.DistributedSampler(
                sampler, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True
            )
            if world_size > 1
            else None
        )
        loader = torch.utils.data.DataLoader(
            sampler,
            batch_size=data.triplet_batch_size,
            sampler=split,
            shuffle=False,
            num_workers=data.num_workers,
            pin_memory=data.pin_memory,
            drop_last=True,
        )
        return loader, sampler
    try:
        sampler = PKSampler(
            dataset.triplet_labels,
            p=data.p,
            k=data.k,
            seed=seed,
            with_replacement=data.sample_with_replacement,
            rank=rank,
            world_size=world_size,
        )
    except ValueError as err:
        raise ConfigError(f"data.p={data.p}, data.k={data.k}: {err}") from None
    return make_loader(dataset, sampler, data.num_workers, data.pin_memory, seed=seed), sampler


def _eval_pairs(cfg: Config, pairs_path: str | None):
    """The held-out pairs, or None when evaluation is off."""
    if cfg.eval.every <= 0 or not pairs_path:
        return None
    try:
        return read_pairs(pairs_path, root=cfg.eval.root, skip_missing=cfg.eval.skip_missing)
    except (PairsFormatError, MissingImagesError):
        raise  # their messages name the file, the line and the eval.skip_missing option
    except FileNotFoundError as err:
        key = "eval.pairs" if not Path(pairs_path).is_file() else "eval.root"
        what = f"file not found: {pairs_path}" if key == "eval.pairs" else str(err)
        raise ConfigError(f"{key}: {what}") from None
    except UnicodeDecodeError:
        raise DataError(f"eval.pairs: {pairs_path} is not a text file") from None


def build_data(cfg: Config, run_dir: Path, rank: int = 0, world_size: int = 1) -> TrainingData:
    """Datasets, sampler and loader from the ``data`` and ``eval`` sections.

    Errors name the configuration key to change (``data.root``, ``data.p``, ``eval.pairs``...).

    Args:
        cfg: the run configuration.
        run_dir: the run directory (the synthetic data goes there when ``data.root`` is unset).
        rank: this process's rank (the sampler gives each rank disjoint batches).
        world_size: number of processes.
    """
    train_root, pairs_path = _data_roots(cfg, Path(run_dir))
    dataset = _identity_folder(cfg, train_root)
    loader, sampler = _batch_loader(cfg, dataset, rank, world_size)
    return TrainingData(
        loader,
        sampler,
        len(dataset.classes),
        _eval_pairs(cfg, pairs_path),
        cfg.data.image_size,
        cfg.data.normalize,
    )


def build_trainer(cfg: Config, num_classes: int | None, device: torch.device) -> Trainer:
    """Model, miner, loss, optimizer and schedule from the configuration.

    Args:
        cfg: the run configuration.
        num_classes: identities in the training data (for the optional classifier head).
        device: where the model and the miner's generator live.
    """
    use_ce = cfg.loss.ce_weight > 0
    num_classes = num_classes if use_ce else None
    model = _from_section("model", build_model, cfg.model, num_classes=num_classes).to(device)
    # Named groups when fine-tuning (backbone lr scale, frozen stages); read before DDP wraps it.
    params = _from_section("optim", parameter_groups, model, cfg.optim)
    if is_distributed():
        # Buffers sync once at start, then running statistics stay per rank (rank 0's saved).
        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False,
        )
    # The miner's own generator (the max_triplets cap draws from it): checkpointed with the run.
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed)
    miner = _from_section("mining", build_miner, cfg.mining, generator=generator)
    optimizer = _from_section("optim", build_optimizer, params, cfg.optim)
    scheduler = _from_section("optim", build_scheduler, optimizer, cfg.optim, cfg.train.epochs)
    # Seed-style triplet lists are sparse selections whatever the miner: two passes.
    passes = cfg.mining.passes
    if passes == "auto" and cfg.data.dataset == "triplets" and cfg.train.chunk_size == 0:
        passes = 2
    return Trainer(
        model,
        miner,
        _from_section("loss", build_loss, cfg.loss),
        optimizer,
        scheduler=scheduler,
        device=device,
        amp=cfg.train.amp,
        ce_weight=cfg.loss.ce_weight,
        passes=passes,
        grad_clip=cfg.optim.grad_clip,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps,
        channels_last=cfg.model.channels_last,
        chunk_size=cfg.train.chunk_size,
        graph_memory=cfg.logging.graph_memory,
    )
