"""Turning a configuration into the objects of a run: device, data, loader, pairs, trainer.

Bad input raises a ``FacenetError`` whose message names the configuration key to change.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from facenet.config import Config
from facenet.data import IdentityFolder, PKSampler
from facenet.data.batches import TrainCrops
from facenet.data.images import CorruptImageError
from facenet.data.loading import make_loader, resolve_loader_settings
from facenet.data.pairs import (
    MissingImagesError,
    PairsFormatError,
    read_pairs,
)
from facenet.distributed import broadcast_buffers, is_distributed, is_main_process
from facenet.errors import ConfigError, DataError, FacenetError
from facenet.files import write_text_atomic
from facenet.metric import build_loss, build_margin_loss, build_miner
from facenet.models.embedding import build_model
from facenet.registry import load
from facenet.training.engine import Trainer, TrainerSettings
from facenet.training.optim import (
    build_optimizer,
    build_scheduler,
    frozen_prefixes,
    parameter_groups,
)
from facenet.training.step import build_step

# What only some runs use, loaded when the configuration asks for it: the demo's data (a wing;
# data.dataset: synthetic), seed-style triplet lists (data.dataset: triplets), identities held
# out of a folder (eval.heldout_identities) and the frozen stages' cache (train.cache_frozen).
_SYNTHETIC = "facenet.wings.demo.synthetic:prepare_synthetic_data"
_RECORDIO = "facenet.data.recordio:RecordIODataset"  # data.dataset: recordio (train.rec)
_TRIPLET_LIST = "facenet.data.triplets:TripletListDataset"
_HELD_OUT = "facenet.data.heldout:"
_CACHE = "facenet.training.cache:"


@dataclass
class TrainingData:
    """Everything the loop needs from the data side. ``val_pairs`` choose the model and the
    threshold, ``test_pairs`` are reported once at the end (PairLists, or None); ``notes``: what
    the run says at its start; ``steps_per_epoch``: the loader's batches, capped by
    ``train.steps_per_epoch`` (the schedule's unit)."""

    loader: Any
    sampler: Any  # has set_epoch / state_dict / load_state_dict
    num_classes: int
    val_pairs: Any  # a PairList, or None
    test_pairs: Any  # a PairList, or None
    notes: list = field(default_factory=list)
    steps_per_epoch: int = 0


def _from_section(section: str, build, *args, **kwargs):
    """``build(*args, **kwargs)``; a value it refuses becomes a ConfigError naming ``section``."""
    try:
        return build(*args, **kwargs)
    except FacenetError:
        raise
    except ValueError as err:
        raise ConfigError(f"{section}: {err}") from None


def _data_roots(cfg: Config, run_dir: Path, fresh: bool):
    """(training image folder, {split: (pairs file, image root) or None}, HeldOut or None):
    the synthetic set generated if needed, or identities of a folder held out (``fresh``: do
    not read a held-out record)."""
    data, ev = cfg.data, cfg.eval
    given = {
        "val": (ev.val_pairs, ev.val_root) if ev.val_pairs else None,
        "test": (ev.pairs, ev.root) if ev.pairs else None,
    }
    if data.dataset == "synthetic":
        root = Path(data.root) if data.root else run_dir / "data"
        try:
            prepared = load(_SYNTHETIC)(root, data)
        except OSError as err:
            raise OSError(err.errno, f"data.root: cannot write the synthetic data: {err}") from err
        given["val"] = given["val"] or (prepared["val_pairs"], ev.val_root)
        given["test"] = given["test"] or (prepared["test_pairs"], ev.root)
        return str(prepared["train_root"]), given, None
    if not data.root:
        raise ConfigError(f"data.root: required for data.dataset: {data.dataset}")
    if ev.heldout_identities <= 0:
        return data.root, given, None
    if data.dataset == "recordio":  # held-out pairs are drawn from identity folders
        raise ConfigError(
            "eval.heldout_identities: held-out identities need data.dataset: folder; give a "
            "RecordIO run eval.val_pairs and eval.pairs"
        )
    if given["val"] and given["test"]:
        raise ConfigError(
            f"eval.heldout_identities: {ev.heldout_identities}, but eval.val_pairs and "
            "eval.pairs are both given: there is nothing to hold out identities for"
        )
    settings = load(_HELD_OUT + "HeldOutSettings")(
        ev.heldout_identities,
        ev.n_folds,
        ev.heldout_pairs_per_fold,
        cfg.train.seed,
        data.max_image_pixels,
        data.max_aspect_ratio,
    )
    splits = [name for name, source in given.items() if source is None]
    held = load(_HELD_OUT + "hold_out")(Path(data.root), run_dir, splits, settings, fresh)
    given.update({split: (path, str(Path(data.root))) for split, path in held.pairs.items()})
    return data.root, given, held


def _identity_folder(cfg: Config, train_root: str, exclude=()):
    """The training images, with errors that name the ``data`` keys to change.

    A sample is the decoded uint8 image with its crop and flip drawn (``TrainCrops``); the
    loader's collate crops and flips the batch, the Trainer standardises it on the device.
    """
    data = cfg.data
    transform = TrainCrops(data.image_size, random_crop=data.random_crop, hflip=data.hflip)
    settings = dict(
        transform=transform,
        on_corrupt=data.on_corrupt,
        exclude=exclude,
        limits=(data.max_image_pixels, data.max_aspect_ratio),
        cache_bytes=data.decoded_cache_mib * 2**20,
    )
    try:
        if data.dataset == "recordio":  # data.root: the folder of train.rec and train.idx
            return load(_RECORDIO)(train_root, **settings)
        return IdentityFolder(train_root, cache_dir=data.cache_dir, **settings)
    except CorruptImageError as err:
        raise CorruptImageError(
            err.path, f"{err.reason} (data.on_corrupt: skip leaves such files out)"
        ) from None
    except DataError as err:
        raise DataError(f"data.root: {err}") from None


def _batch_loader(cfg: Config, dataset, rank: int, world_size: int, device_type: str = "cpu"):
    """(loader, sampler): P x K batches, or seed-style triplet batches (data.dataset: triplets)."""
    data, seed = cfg.data, cfg.train.seed
    workers, pin = resolve_loader_settings(data.num_workers, data.pin_memory, device_type)
    if data.dataset == "triplets":
        try:
            sampler = load(_TRIPLET_LIST)(
                dataset.targets, data.triplets_per_epoch, seed=seed, dataset=dataset
            )
        except ValueError as err:
            raise ConfigError(f"data.triplets_per_epoch: {err}") from None
        if data.triplet_batch_size > len(sampler):
            raise ConfigError(
                f"data.triplet_batch_size={data.triplet_batch_size} is larger than "
                f"data.triplets_per_epoch={len(sampler)}: an epoch would hold no batch"
            )
        # Each rank takes every W-th triplet of the (already random) list.
        split = torch.utils.data.DistributedSampler(
            sampler, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True
        )
        batches = torch.utils.data.BatchSampler(split, data.triplet_batch_size, drop_last=True)
        # Workers start each epoch: the triplet list is drawn anew in this process per epoch.
        loader = make_loader(
            sampler, batches, workers, pin, seed, rank, epoch_of=sampler, persistent_workers=False
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
    loader = make_loader(dataset, sampler, workers, pin, seed, rank)
    return loader, sampler


def _read_eval_pairs(cfg: Config, source, keys: tuple[str, str]):
    """A validation or test PairList, or None; errors name the keys (pairs file, root)."""
    if cfg.eval.every <= 0 or source is None:
        return None
    pairs_path, root = source
    pairs_key, root_key = keys
    try:
        return read_pairs(pairs_path, root=root, skip_missing=cfg.eval.skip_missing)
    except PairsFormatError:
        raise  # its message names the file and the line
    except MissingImagesError as err:  # one line: the first image, its line, the keys to give
        raise DataError(err.named(root_key, "eval.skip_missing: true")) from None
    except FileNotFoundError as err:
        key = pairs_key if not Path(pairs_path).is_file() else root_key
        what = f"file not found: {pairs_path}" if key == pairs_key else str(err)
        raise ConfigError(f"{key}: {what}") from None
    except UnicodeDecodeError:
        raise DataError(f"{pairs_key}: {pairs_path} is not a text file") from None


def _identity_folders(pairs) -> set[str]:
    """The identity folders (absolute paths) a pairs list uses."""
    return {os.path.dirname(os.path.abspath(p)) for p in pairs.paths1 + pairs.paths2}


def _check_apart(val, test, dataset) -> None:
    """Validation, test and training must not share images, and should not share identities.

    The same pairs for validation and test would report a test figure the selection was
    made on: refused. Shared identities are warned of (a user may mean it).
    """
    if val is not None and test is not None:
        if os.path.realpath(val.source) == os.path.realpath(test.source):
            raise ConfigError(
                f"eval.val_pairs and eval.pairs are the same file ({test.source}): the test "
                "figure would come from the pairs that chose best.pt"
            )
        shared = _identity_folders(val) & _identity_folders(test)
        if shared:
            warnings.warn(
                f"{len(shared)} identities are in both the validation and the test pairs "
                f"(e.g. {sorted(shared)[0]}): the test figure is not independent of the selection",
                stacklevel=2,
            )
    root = os.path.abspath(dataset.root)  # identity folders, not every sample: start-up cost
    trained = {os.path.join(root, name) for name in dataset.classes}
    for name, pairs in (("validation", val), ("test", test)):
        overlap = _identity_folders(pairs) & trained if pairs is not None else set()
        if overlap:
            warnings.warn(
                f"{len(overlap)} identities of the {name} pairs are trained on "
                f"(e.g. {sorted(overlap)[0]})",
                stacklevel=2,
            )


def _evaluation_notes(cfg: Config, val, test) -> list[str]:
    """What a run says at its start when an evaluation set is missing."""
    if cfg.eval.every <= 0:
        return ["evaluation is off (eval.every: 0): no best.pt, no test figure"]
    if val is None and test is None:
        return [
            "nothing will be evaluated: no validation or test pairs (set eval.val_pairs and "
            "eval.pairs, or eval.heldout_identities for a folder)"
        ]
    if val is None:
        return [
            "no validation pairs (eval.val_pairs): best.pt is not chosen; the test pairs are "
            "evaluated once, at the end, for the last model"
        ]
    if test is None:
        return ["no test pairs (eval.pairs): validation figures only"]
    return []


def build_data(
    cfg: Config,
    run_dir: Path,
    rank: int = 0,
    world_size: int = 1,
    outputs=None,
    device_type: str = "cpu",
) -> TrainingData:
    """Datasets, sampler, loader and evaluation sets from the ``data`` and ``eval`` sections.

    ``run_dir`` receives the synthetic data (without ``data.root``) and the held-out pairs,
    recorded in ``outputs`` (under ``clear_previous``, a previous held-out record is not read).
    """
    fresh = outputs is not None and outputs.clear_previous
    train_root, sources, held = _data_roots(cfg, Path(run_dir), fresh)
    dataset = _identity_folder(cfg, train_root, exclude=held.identities if held else ())
    loader, sampler = _batch_loader(cfg, dataset, rank, world_size, device_type)
    keys = {"val": ("eval.val_pairs", "eval.val_root"), "test": ("eval.pairs", "eval.root")}
    written = held.pairs if held else {}
    # Given pairs files are read (checked) before the run's first write: the held-out files.
    pairs = {s: _read_eval_pairs(cfg, sources[s], keys[s]) for s in keys if s not in written}
    for path, text in held.pending if held and is_main_process() else ():
        if outputs is not None:
            outputs.add(path)
        write_text_atomic(path, text)
    pairs.update({s: _read_eval_pairs(cfg, sources[s], keys[s]) for s in written})
    val, test = pairs["val"], pairs["test"]
    _check_apart(val, test, dataset)
    return TrainingData(
        loader,
        sampler,
        len(dataset.classes),
        val,
        test,
        notes=([held.note] if held else []) + _evaluation_notes(cfg, val, test),
        steps_per_epoch=min(len(loader), cfg.train.steps_per_epoch or len(loader)),
    )


def build_network(cfg: Config, num_classes: int | None = None):
    """The network of the ``model`` section on the CPU, its weights file read; ``num_classes``
    sizes a classifier head. Built once first, a mistake there is found before a run writes."""
    margin_loss = _from_section("loss", build_margin_loss, cfg.loss)  # loss.ce's, or None
    return _from_section(
        "model",
        build_model,
        cfg.model,
        num_classes=num_classes,
        image_size=cfg.data.image_size,
        margin_loss=margin_loss,
    )


def build_trainer(
    cfg: Config, num_classes: int | None, device: torch.device, steps_per_epoch: int
) -> Trainer:
    """Model, step, optimizer and per-step schedule (``steps_per_epoch`` turns its epochs into
    steps) on ``device``; ``num_classes`` sizes the classifier head of ``loss.ce_weight``."""
    model = build_network(cfg, num_classes if cfg.loss.ce_weight > 0 else None).to(device)
    # Named groups when fine-tuning (backbone lr scale, frozen stages); read before DDP wraps it.
    params = _from_section("optim", parameter_groups, model, cfg.optim)
    frozen_bn = _frozen_bn(cfg, model)
    if cfg.train.cache_frozen:  # the step sees the frozen stages' outputs, not images
        load(_CACHE + "check_cache_settings")(cfg)
        model = _from_section("optim", load(_CACHE + "FeatureHead"), model, cfg.optim.freeze_up_to)
    if is_distributed():
        # Buffers sync once, here, then running statistics stay per rank (rank 0's saved): a
        # forward-time broadcast would hang the chunked step's ranks, whose forward counts
        # differ. broadcast_buffers=False turns both off on every torch (DDP's own
        # forward_sync_buffers keyword, torch >= 2.13, would keep the first).
        broadcast_buffers(model)
        model = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            broadcast_buffers=False,
        )
    # The miner's own generator (the max_triplets cap draws from it): checkpointed with the run.
    generator = torch.Generator(device=device).manual_seed(cfg.train.seed)
    miner = _from_section("mining", build_miner, cfg.mining, generator=generator)
    optimizer = _from_section("optim", build_optimizer, params, cfg.optim)
    scheduler = _from_section(
        "optim", build_scheduler, optimizer, cfg.optim, cfg.train.epochs, steps_per_epoch
    )
    step = build_step(
        model,
        miner,
        _from_section("loss", build_loss, cfg.loss),
        passes=cfg.mining.passes,
        chunk_size=cfg.train.chunk_size,
        triplet_lists=cfg.data.dataset == "triplets",
        ce_weight=cfg.loss.ce_weight,
        amp=cfg.train.amp,
    )
    settings = TrainerSettings(
        input_normalize=cfg.data.normalize,
        grad_clip=cfg.optim.grad_clip,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps,
        channels_last=cfg.model.channels_last,
        graph_memory=cfg.logging.graph_memory,
        frozen_bn=frozen_bn,
    )
    return Trainer(step, optimizer, scheduler, settings)


def _frozen_bn(cfg: Config, model) -> tuple[str, ...]:
    """The module names whose BatchNorm layers ``optim.bn`` keeps in eval mode."""
    if cfg.optim.bn == "adapt":
        return ()
    if cfg.optim.bn == "frozen":
        return ("",)
    prefixes = _from_section("optim", frozen_prefixes, model, cfg.optim)
    if not prefixes:
        raise ConfigError(
            "optim.bn: frozen_stages needs frozen stages: set optim.freeze_backbone_epochs "
            "(> 0, or all) and optim.freeze_up_to"
        )
    return tuple(prefixes)
