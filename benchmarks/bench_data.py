#!/usr/bin/env python
"""Data loading: images/s of IdentityFolder + the training transforms, 0 and 2 workers.

The built-in synthetic identities are written as PNG files (128 px, like aligned face crops
stored a little larger than the network's input), then read back the way a run reads them:
``IdentityFolder`` with the training transform, ``PKSampler`` batches, ``make_loader``; the
first batch (worker start-up) is not timed. Given the training-step benchmark's JSON, each row
is set against the images/s the two-pass step consumes at the same image size: a ratio of at
least 1 means the loader keeps up.

    python -m benchmarks.bench_data --json data.json [--step-json training_step.json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.measure import benchmark_parser, run_benchmark, show, stop_workers
from facenet.data import (
    IdentityFolder,
    PKSampler,
    SyntheticIdentities,
    build_transform,
    make_loader,
    measure_throughput,
)
from facenet.errors import FacenetError


def loader_throughput(root: Path, image_size: int, workers: int, pk: tuple, batches: int) -> float:
    """Images/s of IdentityFolder + training transform + P x K batches with ``workers``."""
    dataset = IdentityFolder(root, transform=build_transform(image_size, train=True))
    sampler = PKSampler(dataset.triplet_labels, *pk, seed=0, batches_per_epoch=batches)
    loader = make_loader(dataset, sampler, num_workers=workers, seed=0)
    try:
        return measure_throughput(loader, batches)
    finally:
        stop_workers(loader)


def step_consumption(step_report: dict | None, image_size: int, rate: float) -> list[dict]:
    """The two-pass step's images/s of every training-step case at ``image_size``."""
    rows = []
    for result in (step_report or {}).get("cases", []):
        two_pass = result["variants"].get("two_pass") or {}
        # The rate timed in rounds beside the other variants: what the ratios use.
        step_rate = two_pass.get("rounds_images_per_s", two_pass.get("images_per_s"))
        if result["case"]["image_size"] == image_size and step_rate:
            case = result["case"]["name"]
            rows.append(
                {"case": case, "images_per_s": step_rate, "loader_vs_step": rate / step_rate}
            )
    return rows


def measure(args) -> dict:
    """Write the folder, measure every (image size, workers) row, compare with the step."""
    if args.step_json and not args.step_json.is_file():
        raise FacenetError(f"--step-json {args.step_json}: no such file")
    step_report = json.loads(args.step_json.read_text()) if args.step_json else None
    # identities, images per identity, stored px, network px, P x K, batches read
    ids, per_id, stored, sizes, pk, batches = (
        (8, 4, 48, [32], (4, 2), 4) if args.quick else (32, 8, 128, [112, 64], (8, 4), 8)
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="facenet_bench_data_") as root:
        started = time.perf_counter()
        SyntheticIdentities(ids, per_id, image_size=stored, seed=0).write_to_disk(Path(root))
        write_seconds = time.perf_counter() - started
        for image_size in sizes:
            for workers in (0, 2):
                rate = loader_throughput(Path(root), image_size, workers, pk, batches)
                consumers = step_consumption(step_report, image_size, rate)
                rows.append(
                    {"image_size": image_size, "workers": workers, "images_per_s": rate}
                    | {"step_consumption": consumers}
                )
                show(rows[-1])
    return {
        "benchmark": "bench_data",
        "command": "python -m benchmarks.bench_data " + " ".join(args.argv),
        "stored_size": stored,
        "identities": ids,
        "images": ids * per_id,
        "batch": "{}x{}".format(*pk),
        "batches_read": batches,
        "write_seconds": write_seconds,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--quick``: a few small images)."""
    parser = benchmark_parser(__doc__)
    parser.add_argument("--step-json", type=Path, default=None, help="bench_training_step JSON")
    return run_benchmark(parser, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
