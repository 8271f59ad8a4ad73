#!/usr/bin/env python
"""A million-image start: the folder source and RecordIO side by side, on the same images.

Writes a folder of small JPEGs (``IMAGES_PER_IDENTITY`` per identity, MS1MV2's ratio) and the
``.rec`` that facenet-make-rec's writer packs from it, then measures, each in a fresh process:
the ``.rec``, the folder with its index built, the folder with its index reused. For each:
seconds from the dataset's construction to the loader's first P x K batch (4 workers), the CPU
seconds of the main process over that start (the index's checking threads included), its peak
and steady RSS, the dataset's bytes per image, then ``--batches`` more batches (a shortened
epoch) for the loader's images/s and each worker's growth in RSS and in private memory. Figures
are also given per million images and scaled to MS1MV2 and Glint360K. Details: BENCHMARKS.md,
section 6.

    python -m benchmarks.bench_scale --images 1000000 --json scale.json
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torchvision.io import encode_jpeg

from facenet.data import IdentityFolder, PKSampler
from facenet.data.batches import TrainCrops
from facenet.data.folder import INDEX_FILE_NAME
from facenet.data.loading import make_loader
from facenet.data.recordio import RecordIODataset, write_insightface

SETS = {"MS1MV2": 5_822_653, "Glint360K": 17_091_657}
IMAGES_PER_IDENTITY = 68  # MS1MV2: 5,822,653 images of 85,742 identities
RUNS = ("rec", "folder_built", "folder_reused")


def small_jpeg(size: int = 112) -> bytes:
    """A smooth face-sized JPEG of about 1.5 KB (the set's files are all this one)."""
    ramp = torch.linspace(0, 255, size).to(torch.uint8)  # (S,)
    across, down = ramp.expand(size, size), ramp[:, None].expand(size, size)  # (S, S) each
    image = torch.stack([across, down, 255 - across]).contiguous()  # (3, S, S)
    return encode_jpeg(image, quality=75).numpy().tobytes()


def write_sets(work: Path, images: int) -> dict:
    """``work/folder/<identity>/<image>.jpg`` and ``work/rec`` (train.rec, .idx, property);
    seconds each took."""
    data, identities = small_jpeg(), []
    start = time.perf_counter()
    for first in range(0, images, IMAGES_PER_IDENTITY):
        folder = work / "folder" / f"{first // IMAGES_PER_IDENTITY:07d}"
        folder.mkdir(parents=True)
        paths = [folder / f"{i:06d}.jpg" for i in range(min(IMAGES_PER_IDENTITY, images - first))]
        for path in paths:
            path.write_bytes(data)
        identities.append(paths)
    written = time.perf_counter()
    write_insightface(work / "rec", identities, (112, 112))
    return {"folder_write_s": written - start, "rec_write_s": time.perf_counter() - written}


def memory_mib(pid: int | str = "self") -> dict:
    """``{"rss": MiB, "private": MiB}`` of a process now (private: its pages no other shares)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":")
        fields[name] = int(value.split()[0]) / 1024
    return {"rss": fields["Rss"], "private": fields["Private_Clean"] + fields["Private_Dirty"]}


def per_image_bytes(dataset) -> float:
    """Bytes of the dataset's numpy arrays per image (its per-image state)."""
    arrays = [value for value in vars(dataset).values() if isinstance(value, np.ndarray)]
    return sum(array.nbytes for array in arrays) / len(dataset)


def measure_start(run: str, work: Path, batches: int, workers: int, p: int, k: int) -> dict:
    """One run's figures, in this (fresh) process."""
    transform = TrainCrops(112)
    baseline = memory_mib()["rss"]  # the interpreter with torch loaded
    wall, cpu = time.perf_counter(), time.process_time()
    if run == "rec":
        dataset = RecordIODataset(work / "rec", transform=transform)
    else:
        dataset = IdentityFolder(work / "folder", transform=transform)
    sampler = PKSampler(dataset.triplet_labels, p=p, k=k, seed=0)
    loader = make_loader(dataset, sampler, workers, False, seed=0)
    batch_iter = iter(loader)
    next(batch_iter)
    figures = {
        "images": len(dataset),
        "start_s": time.perf_counter() - wall,
        "start_cpu_s": time.process_time() - cpu,
        "baseline_rss_mib": baseline,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steady_rss_mib": memory_mib()["rss"],
        "bytes_per_image": per_image_bytes(dataset),
        "index_reused": getattr(dataset, "index_reused", None),
    }
    pids = [worker.pid for worker in batch_iter._workers]
    before = [memory_mib(pid) for pid in pids]
    started = time.perf_counter()
    for _ in range(batches):
        next(batch_iter)
    figures["images_per_s"] = batches * p * k / (time.perf_counter() - started)
    after = [memory_mib(pid) for pid in pids]
    for kind in ("rss", "private"):
        growth = [a[kind] - b[kind] for a, b in zip(after, before)]
        figures[f"worker_{kind}_growth_mib"] = max(growth)
    return figures


def run_child(run: str, args: argparse.Namespace) -> dict:
    """``measure_start`` in a fresh interpreter (its RSS and CPU its own)."""
    command = [sys.executable, "-m", "benchmarks.bench_scale", "--child", run]
    command += ["--work", str(args.work), "--batches", str(args.batches)]
    command += ["--workers", str(args.workers), "--p", str(args.p), "--k", str(args.k)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{run}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout.splitlines()[-1])


def scaled(figures: dict) -> dict:
    """Start seconds and CPU seconds per million images, and at each named set's size."""
    per_million = 1e6 / figures["images"]
    out = {f"{key}_per_million": figures[key] * per_million for key in ("start_s", "start_cpu_s")}
    for name, size in SETS.items():
        out[f"start_s_{name}"] = figures["start_s"] * size / figures["images"]
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--images", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=200, help="the shortened epoch")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--p", type=int, default=30)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--work", type=Path, help="where the sets go (default: a new /tmp dir)")
    parser.add_argument("--keep", action="store_true", help="leave the sets in --work")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        figures = measure_start(args.child, args.work, args.batches, args.workers, args.p, args.k)
        print(json.dumps(figures))
        return figures
    made_work = args.work is None
    args.work = args.work or Path(tempfile.mkdtemp(prefix="bench_scale_", dir="/tmp"))
    try:
        results = {"images": args.images, "batches": args.batches, "workers": args.workers}
        results.update(write_sets(args.work, args.images))
        (args.work / "folder" / INDEX_FILE_NAME).unlink(missing_ok=True)
        for run in RUNS:  # folder_built leaves the index folder_reused reads
            results[run] = {**(figures := run_child(run, args)), **scaled(figures)}
            print(run, json.dumps(results[run]), flush=True)
    finally:
        if made_work and not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
