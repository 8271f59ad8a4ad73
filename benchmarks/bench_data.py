#!/usr/bin/env python
"""Data loading: images/s of IdentityFolder + the training transforms, 0 and 2 workers.

The built-in synthetic identities are written once as PNG files (``root/<identity>/<image>``,
128 px, like aligned face crops stored a little larger than the network's input), then read
back the way a run reads them: ``IdentityFolder`` with the training transform (resize, random
crop, flip, standardisation), batches from ``PKSampler``, a seeded ``DataLoader`` from
``make_loader``. ``measure_throughput`` reports images per second, the first batch (worker
start-up) left out. Given the training-step benchmark's JSON, each row is set against the
images/s the two-pass training step consumes at the same image size: a ratio of at least 1
means the loader keeps up.

    python -m benchmarks.bench_data --json data.json [--step-json step.json]
    python -m benchmarks.bench_data --quick --json q.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.measure import write_report
from facenet.data import (
    IdentityFolder,
    PKSampler,
    SyntheticIdentities,
    build_transform,
    make_loader,
    measure_throughput,
)

STORED_SIZE = 128


def write_folder(root: Path, identities: int, images_per_identity: int, stored_size: int) -> int:
    """Write the synthetic identities as PNG files under ``root``; return the image count.

    A folder that already holds the same number of identity folders and images is reused.

    Args:
        root: the dataset folder.
        identities: identity folders to write.
        images_per_identity: images in each.
        stored_size: side of the stored images in pixels.
    """
    expected = identities * images_per_identity
    existing = list(root.glob("*/*.png")) if root.is_dir() else []
    if len(existing) == expected and len(list(root.iterdir())) >= identities:
        return expected
    data = SyntheticIdentities(identities, images_per_identity, image_size=stored_size, seed=0)
    data.write_to_disk(root)
    return expected


def loader_throughput(
    root: Path, image_size: int, workers: int, p: int, k: int, max_batches: int
) -> float:
    """Images/s of IdentityFolder + training transform + PKSampler batches with ``workers``.

    Args:
        root: the dataset folder.
        image_size: the network's input size (the transform's output side).
        workers: DataLoader worker processes (0: the main process decodes).
        p, k: the batch's identities and images per identity.
        max_batches: batches read (the first one, start-up, is not timed).
    """
    dataset = IdentityFolder(root, transform=build_transform(image_size, train=True))
    sampler = PKSampler(dataset.triplet_labels, p, k, seed=0, batches_per_epoch=max_batches)
    loader = make_loader(dataset, sampler, num_workers=workers, seed=0)
    try:
        return measure_throughput(loader, max_batches)
    finally:
        # Persistent workers otherwise live until the loader is collected.
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def step_consumption(step_report: dict | None, image_size: int) -> list[dict]:
    """The two-pass step's images/s of every training-step case at ``image_size``.

    Args:
        step_report: the JSON of ``bench_training_step.py`` (or None).
        image_size: the input size to match.
    """
    if not step_report:
        return []
    rows = []
    for result in step_report.get("cases", []):
        case = result["case"]
        two_pass = result["variants"].get("two_pass") or {}
        # Prefer the rate timed in rounds with the other variants (the one the ratios use).
        rate = two_pass.get("rounds_images_per_s", two_pass.get("images_per_s"))
        if case["image_size"] == image_size and rate:
            rows.append({"case": case["name"], "images_per_s": rate})
    return rows


def run(args: argparse.Namespace) -> dict:
    """Write the folder, measure every (image size, workers) row, compare with the step."""
    if args.quick:
        identities, per_identity, stored, sizes = 8, 4, 48, [32]
        p, k, batches = 4, 2, 4
    else:
        identities, per_identity, stored, sizes = 32, 8, STORED_SIZE, [112, 64]
        p, k, batches = 8, 4, 8
    step_report = json.loads(args.step_json.read_text()) if args.step_json else None
    own_dir = args.data_dir is None
    root = Path(tempfile.mkdtemp(prefix="facenet_bench_data_")) if own_dir else args.data_dir
    try:
        started = time.perf_counter()
        images = write_folder(root, identities, per_identity, stored)
        write_seconds = time.perf_counter() - started
        rows = []
        for image_size in sizes:
            for workers in args.workers:
                rate = loader_throughput(root, image_size, workers, p, k, batches)
                consumers = step_consumption(step_report, image_size)
                for consumer in consumers:
                    consumer["loader_vs_step"] = rate / consumer["images_per_s"]
                rows.append(
                    {
                        "image_size": image_size,
                        "workers": workers,
                        "images_per_s": rate,
                        "step_consumption": consumers,
                    }
                )
                print(_row_text(rows[-1]), flush=True)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "benchmark": "bench_data",
        "command": "python -m benchmarks.bench_data " + " ".join(args.argv),
        "stored_size": stored,
        "identities": identities,
        "images": images,
        "batch": f"{p}x{k}",
        "batches_read": batches,
        "write_seconds": write_seconds,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }


def _row_text(row: dict) -> str:
    text = f"{row['image_size']:>4} px  {row['workers']} workers  {row['images_per_s']:>8.0f} img/s"
    for consumer in row["step_consumption"]:
        text += (
            f"  | {consumer['case']}: step eats {consumer['images_per_s']:.0f} img/s, "
            f"loader/step {consumer['loader_vs_step']:.1f}x"
        )
    return text


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few small images")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--step-json", type=Path, default=None, help="bench_training_step JSON")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="keep the images here (default: a temp dir)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write the JSON report."""
    args = get_args_parser().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    if any(w < 0 for w in args.workers):
        print(f"--workers must be >= 0, got {args.workers}", file=sys.stderr)
        return 2
    if args.step_json and not args.step_json.is_file():
        print(f"--step-json {args.step_json}: no such file", file=sys.stderr)
        return 2
    if args.threads < 0:
        print(f"--threads must be >= 0, got {args.threads}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)  # the main process's transforms
    report = run(args)
    if args.json:
        write_report(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
