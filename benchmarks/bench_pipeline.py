#!/usr/bin/env python
"""The input pipeline side by side: our loader against torchvision's, training end to end
against the step alone, and the folder index's build time.

On folders of synthetic identities written here: images/s of our training loader (decoded
cache, ``TrainCrops``, 0-2 workers; first and second pass) against torchvision's
``ImageFolder`` + ``DataLoader`` with the same augmentation; a Trainer fed by the loader against
the same Trainer on preloaded tensors, in alternating rounds on the same batches (fastest round
kept: other jobs only ever add time); seconds for ``IdentityFolder`` to index JPEG and PNG
folders, per 10,000 files and projected to VGGFace2's 3.3 M. Details: BENCHMARKS.md, section 5.

    python -m benchmarks.bench_pipeline [--quick] --threads 1 --json pipeline.json
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2

from benchmarks.measure import (
    benchmark_parser,
    run_benchmark,
    show,
    stop_workers,
    timed,
)
from facenet.config import load_config
from facenet.data import IdentityFolder, PKSampler, build_transform
from facenet.data.batches import TrainCrops, standardize
from facenet.data.loading import (
    count_images,
    make_loader,
    measure_throughput,
    resolve_loader_settings,
)
from facenet.training.build import build_trainer
from facenet.wings.demo.synthetic import SyntheticIdentities

REPO = Path(__file__).resolve().parents[1]
VGGFACE2_FILES = 3_300_000
# (network input px, stored px, training workload): the demo's 32 px PNGs, and 112 px crops
# stored a little larger.
SIZES = ((32, 32, "demo"), (112, 128, "resnet18"))


# --------------------------------------------------------------------------- loaders


def our_loader(root: Path, size: int, workers: int, p: int, k: int, batches: int):
    """Our training loader over ``root`` (sampler and loader), as a run builds it."""
    dataset = IdentityFolder(root, transform=TrainCrops(size), cache_bytes=2**30)
    sampler = PKSampler(dataset.triplet_labels, p, k, seed=0, batches_per_epoch=batches)
    return make_loader(dataset, sampler, num_workers=workers, seed=0), sampler


def torchvision_loader(root: Path, size: int, workers: int, batch: int):
    """``ImageFolder`` + ``DataLoader`` with the same augmentation, per sample (PIL decoding)."""
    steps = [v2.PILToTensor(), *build_transform(size, train=True).transforms]
    dataset = ImageFolder(str(root), transform=v2.Compose(steps))
    return DataLoader(
        dataset, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=workers > 0
    )


def images_per_second(loader, batches: int) -> float:
    """Images/s of one pass of at most ``batches`` batches, standardised as the Trainer does
    (the first batch, worker start-up, not timed)."""
    return measure_throughput(((standardize(x), y) for x, y in loader), batches)


def loader_rows(root: Path, size: int, p: int, k: int, batches: int) -> list:
    """One row per worker count (0-2): ours (first pass, second pass) and torchvision's."""
    rows = []
    for workers in (0, 1, 2):
        ours, sampler = our_loader(root, size, workers, p, k, batches)
        first = images_per_second(ours, batches)
        sampler.set_epoch(1)
        second = images_per_second(ours, batches)
        stop_workers(ours)
        theirs = torchvision_loader(root, size, workers, p * k)
        torchvision_rate = images_per_second(theirs, batches)
        stop_workers(theirs)
        rows.append(
            {
                "image_size": size,
                "workers": workers,
                "ours_first_pass": first,
                "ours": second,
                "torchvision": torchvision_rate,
                "ours_vs_torchvision": second / torchvision_rate,
            }
        )
        show(rows[-1])
    return rows


# --------------------------------------------------------------------------- training


def workload_config(name: str, root: Path, workers):
    """The configuration of a training workload on the folder ``root``."""
    common = [f"data.root={root}", "data.dataset=folder", "train.device=cpu"]
    common += [f"data.num_workers={workers}", "logging.progress=false"]
    if name == "demo":  # configs/demo.yaml's model, loss and optimizer
        return load_config(REPO / "configs" / "demo.yaml", common)
    settings = ["data.image_size=112", "data.p=8", "data.k=4", "model.backbone=resnet18"]
    return load_config(None, [*common, *settings, "optim.name=sgd", "optim.lr=0.001"])


def timed_rounds(trainer, loader, sampler, rounds: int) -> tuple[list, list, int]:
    """Seconds of each round's epoch trained from preloaded batches and through the loader,
    and the images of an epoch."""
    start = copy.deepcopy(trainer.state_dict())
    step_alone, end_to_end = [], []
    for round_index in range(1, rounds + 1):
        # Both sides train the same model state on the same batches (the epoch's, read
        # first, which also fills the decoded cache): the same arithmetic, only the input
        # differs (preloaded and standardised, or through the loader).
        sampler.set_epoch(round_index)
        preloaded = [(standardize(images), labels) for images, labels in loader]
        trainer.load_state_dict(copy.deepcopy(start))
        started = time.perf_counter()
        for images, labels in preloaded:
            trainer.train_step(images, labels)
        step_alone.append(time.perf_counter() - started)
        trainer.load_state_dict(copy.deepcopy(start))
        started = time.perf_counter()
        trainer.train_one_epoch(loader, round_index, progress=False)
        end_to_end.append(time.perf_counter() - started)
    return step_alone, end_to_end, sum(count_images(batch) for batch in preloaded)


def training_row(name: str, root: Path, workers: int, batches: int, rounds: int) -> dict:
    """End to end (the loader feeding the Trainer) against the step on preloaded tensors."""
    cfg = workload_config(name, root, workers)
    d = cfg.data
    loader, sampler = our_loader(root, d.image_size, workers, d.p, d.k, batches)
    classes = len(loader.dataset.dataset.classes)  # the IdentityFolder under SeededSamples
    trainer = build_trainer(cfg, classes, torch.device("cpu"), batches)
    trainer.train_one_epoch(loader, 0, progress=False)  # a warm-up epoch (workers start)
    step_alone, end_to_end, images = timed_rounds(trainer, loader, sampler, rounds)
    stop_workers(loader)
    auto, _ = resolve_loader_settings("auto", False, "cpu")  # what the default would choose
    alone, through = np.array(step_alone), np.array(end_to_end)
    row = {
        "workload": name,
        "workers": workers,
        "workers_setting": "auto" if workers == auto else workers,
        "batches": batches,
        "rounds": rounds,
        "step_images_per_s": images / alone.min(),
        "end_to_end_images_per_s": images / through.min(),
        "step_images_per_s_median": images / np.median(alone),
        "end_to_end_images_per_s_median": images / np.median(through),
        "end_to_end_vs_step": alone.min() / through.min(),
        # each round's pair (the same batches, one after the other): less exposed to other jobs
        "end_to_end_vs_step_paired_median": np.median(alone / through),
    }
    show(row)
    return row


# --------------------------------------------------------------------------- index


def write_encoded(root: Path, files: int, fmt: str, side: int = 128) -> None:
    """``files`` distinct images (noise on a gradient) as JPEG or PNG, 50 per identity folder."""
    rng = np.random.default_rng(0)
    base = np.linspace(0, 200, side * side * 3).reshape(side, side, 3)
    for index in range(files):
        pixels = np.clip(base + rng.integers(0, 40, base.shape), 0, 255).astype(np.uint8)
        folder = root / f"id{index // 50:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"{index:06d}.{fmt.lower()}", format=fmt)


def index_row(root: Path, fmt: str, files: int) -> dict:
    """Seconds to build the index of ``files`` images (none cached), and to reuse it."""
    write_encoded(root, files, fmt)
    megabytes = sum(f.stat().st_size for f in root.rglob("*.*")) / 2**20
    cache = root.parent / f"index_{fmt}"
    build, _ = timed("cpu", lambda: IdentityFolder(root, cache_dir=cache))
    reuse, reused = timed("cpu", lambda: IdentityFolder(root, cache_dir=cache))
    assert reused.index_reused
    row = {
        "format": fmt,
        "files": files,
        "megabytes": megabytes,
        "build_s": build,
        "reuse_s": reuse,
        "build_s_per_10k": build / files * 10_000,
        "reuse_s_per_10k": reuse / files * 10_000,
        "build_s_vggface2": build / files * VGGFACE2_FILES,
    }
    show(row)
    return row


# --------------------------------------------------------------------------- the run


def run(args) -> dict:
    """Write the folders, measure the three parts, return the report."""
    identities, per_identity, batches, files = (16, 4, 4, 200) if args.quick else (64, 8, 12, 2000)
    # workload: (batches, rounds); the demo at 32 px, resnet18 at 112
    workloads = {"demo": (2, 2)} if args.quick else {"demo": (24, 8), "resnet18": (4, 3)}
    report = {
        "identities": identities,
        "images_per_identity": per_identity,
        "batches": batches,
        "loader": [],
        "training": [],
    }
    with tempfile.TemporaryDirectory(prefix="facenet_bench_pipeline_") as work:
        for size, stored, workload in SIZES:
            root = Path(work) / f"faces_{stored}"
            SyntheticIdentities(identities, per_identity, stored, seed=0).write_to_disk(root)
            p, k = min(16 if size == 32 else 8, identities), 2 if args.quick else 4
            report["loader"] += loader_rows(root, size, p, k, batches)
            for workers in (0, 1) if workload in workloads else ():
                report["training"].append(
                    training_row(workload, root, workers, *workloads[workload])
                )
        formats = ("JPEG", "PNG")
        report["index"] = [index_row(Path(work) / f"{f}_files", f, files) for f in formats]
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--quick``: small folders, few batches)."""
    return run_benchmark(benchmark_parser(__doc__), argv, run)


if __name__ == "__main__":
    sys.exit(main())
