#!/usr/bin/env python
"""CPU commands with glibc's malloc as the platform sets it and as the commands set it up.

Each measurement runs in a fresh Python process, as a command does (a forked child would not
count the library pages its parent mapped in its peak RSS), once with malloc left alone
(``system``) and once with :func:`facenet.memory.keep_freed_memory` (``keep``), in turns:
the bare forward of Inception-ResNet-v1 (random weights) on a batch at 160 px, the evaluation's
embedding of LFW pairs (``embed_pair_list``, sandberg's settings: flip, crop), alignment of LFW
photos (``Aligner``, sandberg's preset) and, as its anchor, facenet-pytorch's own MTCNN saving
each photo's crop. Per task: CPU milliseconds per image (user + system, this process and its
workers), the system share, minor page faults and the peak RSS. Targets (BENCHMARKS.md): a
system share of at most 10% with ``keep``; the evaluation at most 1.1x the CPU of the bare
forwards it needs; the bare forward 1.3x faster; peak RSS at most 1.3x.

    python -m benchmarks.bench_cpu_kernel --lfw /tmp/realdata [--quick] [--json cpu.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from facenet_pytorch import MTCNN
from PIL import Image

from benchmarks.measure import benchmark_parser, input_path, ratio, run_benchmark, show
from facenet.cli.common import positive_int
from facenet.data.pairs import read_pairs
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.presets import EVAL_PRESETS
from facenet.memory import keep_freed_memory
from facenet.models.embedding import EmbeddingNet
from facenet.wings.align.aligner import Aligner, AlignSettings

MODES = ("system", "keep")
TARGETS = {"system_share": 0.10, "evaluation_over_forward": 1.1, "forward_speedup": 1.3}
TARGETS["peak_rss_ratio"] = 1.3
IMAGE_SIZE = 160


def cpu_counters() -> dict:
    """User and system CPU seconds of this process and its reaped workers, minor faults."""
    own, workers = (
        resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return {
        "user": own.ru_utime + workers.ru_utime,
        "system": own.ru_stime + workers.ru_stime,
        "minor_faults": own.ru_minflt + workers.ru_minflt,
    }


def measured(work, images: int) -> dict:
    """``work()``'s CPU per image, system share and faults; the process's peak RSS."""
    before = cpu_counters()
    work()
    spent = {key: value - before[key] for key, value in cpu_counters().items()}
    cpu = spent["user"] + spent["system"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "images": images,
        "cpu_ms_per_image": 1000 * cpu / images,
        "system_share": spent["system"] / cpu,
        "minor_faults": spent["minor_faults"],
        "peak_rss_mb": peak / 2**20,
    }


def _network() -> torch.nn.Module:
    torch.manual_seed(0)
    return EmbeddingNet("inception_resnet_v1", 512).eval()


def bare_forward(args) -> dict:
    """``args.batches`` forwards of a batch after one to warm up."""
    model, images = _network(), torch.randn(args.batch, 3, IMAGE_SIZE, IMAGE_SIZE)
    with torch.inference_mode():
        model(images)
        return measured(
            lambda: [model(images) for _ in range(args.batches)], args.batch * args.batches
        )


def evaluation(args) -> dict:
    """The first ``args.pairs`` LFW pairs embedded (each unique image and its mirror image),
    after one forward to warm up, as the bare forward is measured."""
    model, pair_list = (
        _network(),
        read_pairs(args.lfw / "lfw_pairs.txt", args.lfw / "lfw_pairs_150"),
    )
    pair_list.paths1, pair_list.paths2 = (
        pair_list.paths1[: args.pairs],
        pair_list.paths2[: args.pairs],
    )
    settings = replace(EVAL_PRESETS["sandberg"], batch_size=args.batch)
    with torch.inference_mode():
        model(torch.randn(args.batch, 3, IMAGE_SIZE, IMAGE_SIZE))
    forwards = 2 * len(pair_list.unique_paths()[0])
    return measured(lambda: embed_pair_list(model, pair_list, IMAGE_SIZE, settings), forwards)


def _per_photo(args, align_to) -> dict:
    """``align_to(photos, folder)`` measured on the photos after one pass to warm up (as the
    forwards are measured: a long folder's cost per photo, not a first pass's heap growth)."""
    photos = sorted((args.lfw / "lfw_pairs_150").glob("*/*.jpg"))[: args.photos]
    with tempfile.TemporaryDirectory() as warm_up, tempfile.TemporaryDirectory() as out:
        align_to(photos, Path(warm_up))
        return measured(lambda: align_to(photos, Path(out)), len(photos))


def alignment(args) -> dict:
    """``args.photos`` LFW photos aligned by an :class:`Aligner` (sandberg's preset)."""
    aligner = Aligner(AlignSettings.from_preset("sandberg"))

    def align_to(photos, out: Path):
        aligner.align([(str(p), str(out / f"{i}.png")) for i, p in enumerate(photos)])

    return _per_photo(args, align_to)


def facenet_pytorch_mtcnn(args) -> dict:
    """The same photos, each decoded and saved as a crop by facenet-pytorch's MTCNN."""
    mtcnn = MTCNN(image_size=IMAGE_SIZE, margin=32)

    def align_to(photos, out: Path):
        for i, photo in enumerate(photos):
            mtcnn(Image.open(photo).convert("RGB"), save_path=str(out / f"{i}.png"))

    return _per_photo(args, align_to)


TASKS = {
    "bare_forward": bare_forward,
    "evaluation": evaluation,
    "alignment": alignment,
    "facenet_pytorch_mtcnn": facenet_pytorch_mtcnn,
}


def _in_child(task: str, mode: str, args) -> dict:
    torch.set_num_threads(args.threads)
    set_up = keep_freed_memory() if mode == "keep" else False
    return {"task": task, "mode": mode, "malloc_set_up": set_up, **TASKS[task](args)}


def _run_child(task: str, mode: str, argv: list[str]) -> dict:
    """``_in_child`` in a fresh interpreter: its row, or ``{"error": ...}``."""
    command = [sys.executable, "-m", "benchmarks.bench_cpu_kernel", *argv, "--child", task, mode]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"task": task, "mode": mode, "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.splitlines()[-1])


def summary(rows: list[dict]) -> dict:
    """Each task's ``keep`` over ``system`` ratios (round medians) and the targets' checks."""
    by = {(r["task"], r["mode"]): r for r in rows if "error" not in r}
    out = {}
    for task in TASKS:
        system, keep = by.get((task, "system")), by.get((task, "keep"))
        if system and keep:
            out[task] = {
                "speedup": ratio(system["cpu_ms_per_image"], keep["cpu_ms_per_image"]),
                "peak_rss_ratio": ratio(keep["peak_rss_mb"], system["peak_rss_mb"]),
            }
    for mode in MODES:
        evaluation_ms, forward_ms = (
            by.get((t, mode), {}).get("cpu_ms_per_image") for t in ("evaluation", "bare_forward")
        )
        out[f"evaluation_over_forward_{mode}"] = ratio(evaluation_ms, forward_ms)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--lfw",
        type=lambda t: input_path(t, folder=True),
        required=True,
        help="the unpacked real data: lfw_pairs.txt, lfw_pairs_150/",
    )
    parser.add_argument("--batch", type=positive_int, default=128, help="images per forward")
    parser.add_argument("--batches", type=positive_int, default=2, help="bare forwards timed")
    parser.add_argument("--pairs", type=positive_int, default=300, help="LFW pairs embedded")
    parser.add_argument("--photos", type=positive_int, default=48, help="LFW photos aligned")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument("--child", nargs=2, metavar=("TASK", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one measurement, its row on stdout
        print(json.dumps(_in_child(*args.child, args)))
        return 0

    def measure(args) -> dict:
        if args.quick:
            args.batch, args.batches, args.pairs, args.photos = 8, 1, 4, 2
        sizes = ("lfw", "threads", "batch", "batches", "pairs", "photos")
        child_argv = [text for key in sizes for text in (f"--{key}", str(getattr(args, key)))]
        rows = []
        for task in args.tasks:
            for mode in MODES:
                rows.append(_run_child(task, mode, child_argv))
                show(rows[-1])
        return {"rows": rows, "summary": summary(rows), "targets": TARGETS}

    return run_benchmark(parser, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
