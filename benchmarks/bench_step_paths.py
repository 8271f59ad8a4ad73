#!/usr/bin/env python
"""Step paths: the default step (``passes="auto"``) against ``passes=2``, a plain loop with no
Trainer (as pytorch-metric-learning's examples write it), and the default with the graph meter.

P x K batches of seeded random images, semi-hard mining with the hardest fallback (every image
selected), triplet loss, margin 0.2; ``demo`` is configs/demo.yaml's model and optimizer. One
forked child per workload runs every variant in rotating rounds on the same batch after
untimed warm-up rounds; ratios use each variant's fastest round, ``*_median`` its median.

    python -m benchmarks.bench_step_paths --threads 1 --json step_paths.json   # --quick: seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_training_step import finish_report, ratio, start_report, time_rounds
from benchmarks.forking import run_forked
from benchmarks.measure import write_report
from facenet.memory import memory_figures
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer

MARGIN = 0.2
VARIANT_LABELS = {
    "auto": 'passes="auto" (new default)',
    "two_pass": "passes=2 (previous default)",
    "plain": "plain loop (no Trainer)",
    "auto_meter": 'passes="auto" + graph meter',
}


@dataclass(frozen=True)
class Workload:
    """A model, P x K batches (``batches`` distinct ones, cycled) and an optimizer ("adam" or
    "sgd" with momentum 0.9); ``ce_weight`` 0: no classifier head."""

    name: str
    backbone: str
    image_size: int
    p: int
    k: int
    ce_weight: float
    num_classes: int
    optimizer: str
    lr: float
    warmup: int
    rounds: int
    batches: int = 4

    def as_dict(self) -> dict:
        """The fields and the batch size, JSON-ready."""
        return {**dataclasses.asdict(self), "images": self.p * self.k}


def workloads(quick: bool) -> list[Workload]:
    """The demo config and resnet18 at 64 px; quick: the same models, small batches."""
    if quick:
        return [
            Workload("demo", "tiny", 32, 8, 4, 1.0, 600, "adam", 0.01, warmup=1, rounds=3),
            Workload("resnet18", "resnet18", 32, 8, 4, 0.0, 1000, "sgd", 1e-3, warmup=1, rounds=2),
        ]
    return [
        Workload("demo", "tiny", 32, 16, 4, 1.0, 600, "adam", 0.01, warmup=10, rounds=400),
        Workload("resnet18", "resnet18", 64, 24, 4, 0.0, 1000, "sgd", 1e-3, warmup=2, rounds=60),
    ]


def build_parts(work: Workload):
    """A seeded model (identical in every variant), its optimizer, a seeded miner, the loss."""
    torch.manual_seed(0)
    classes = work.num_classes if work.ce_weight > 0 else None
    model = EmbeddingNet(work.backbone, 128, num_classes=classes).train()
    if work.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=work.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    miner = SemiHardNegativeMiner(MARGIN, "squared", fallback="hardest", generator=generator)
    return model, optimizer, miner, TripletMarginLoss(MARGIN, distance="squared")


def make_batches(work: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded (images (PK, 3, S, S), labels (PK,)): P distinct identities x K random images."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(work.batches):
        labels = torch.randperm(work.num_classes, generator=gen)[: work.p].repeat_interleave(work.k)
        size = work.image_size
        batches.append((torch.randn(len(labels), 3, size, size, generator=gen), labels))
    return batches


def plain_stepper(work: Workload):
    """The plain loop's step on a batch; returns its triplets."""
    model, optimizer, miner, loss_fn = build_parts(work)

    def step(batch):
        images, labels = batch
        if work.ce_weight > 0:
            emb, logits = model(images, return_logits=True)
        else:
            emb, logits = model(images), None
        triplets = miner(emb.detach(), labels)
        loss = loss_fn(emb, triplets)
        if logits is not None:
            loss = loss + work.ce_weight * F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return triplets

    return step


def build_trainer(work: Workload, passes, graph_memory: bool = False) -> Trainer:
    """A Trainer as a run builds one (CPU, fp32)."""
    model, optimizer, miner, loss_fn = build_parts(work)
    return Trainer(
        model,
        miner,
        loss_fn,
        optimizer,
        ce_weight=work.ce_weight,
        passes=passes,
        graph_memory=graph_memory,
    )


def selected_images(output) -> float | None:
    """Images a step trained on: the Trainer's statistic, or the plain loop's unique indices;
    None for a skipped step."""
    if isinstance(output, dict):
        return None if "skipped" in output else float(output["selected_images"])
    return float(torch.cat([output.anchor, output.positive, output.negative]).unique().numel())


def variant_row(work: Workload, name: str, step: str, runs: list[tuple]) -> dict:
    """A variant's fastest and median round over its steps that were not skipped."""
    counted = [(seconds, selected_images(output)) for seconds, output in runs]
    values = [seconds for seconds, count in counted if count is not None]
    row = {"label": VARIANT_LABELS[name], "step": step, "skipped_steps": len(runs) - len(values)}
    row["timed_steps"] = len(values)
    if values:
        row.update(
            fastest_s=min(values),
            median_s=statistics.median(values),
            images_per_s=work.p * work.k / min(values),
            selected_images_mean=statistics.fmean(c for _, c in counted if c is not None),
            times_s=[round(v, 5) for v in values],
        )
    return row


def measure_workload(work: Workload) -> dict:
    """Every variant in rounds in this process."""
    torch.manual_seed(0)
    batches = make_batches(work)
    auto, two_pass = build_trainer(work, "auto"), build_trainer(work, 2)
    metered = build_trainer(work, "auto", graph_memory=True)
    trainers = {"auto": auto, "two_pass": two_pass, "auto_meter": metered}

    def metered_step(batch):
        with metered.meter:
            return metered.train_step(*batch)

    tasks = {"auto": lambda b: auto.train_step(*b), "two_pass": lambda b: two_pass.train_step(*b)}
    tasks.update(plain=plain_stepper(work), auto_meter=metered_step)
    started = time.perf_counter()
    runs = time_rounds(tasks, batches, work.rounds, work.warmup)
    steps = {name: trainer.step.name for name, trainer in trainers.items()} | {"plain": "plain"}
    variants = {name: variant_row(work, name, steps[name], runs[name]) for name in tasks}
    # Graph bytes only: the variants share this process, so no RSS of their own.
    variants["auto_meter"].update(memory_figures(metered.meter, rss=False))
    ratios = workload_ratios(variants)
    return {"workload": work.as_dict(), "variants": variants, "ratios": ratios,
            "seconds": time.perf_counter() - started}  # fmt: skip


def workload_ratios(variants: dict) -> dict:
    """Two-pass / auto, auto / plain - 1, meter on / off: fastest rounds, then medians."""
    ratios = {}
    for key, suffix in (("fastest_s", ""), ("median_s", "_median")):
        auto, plain = variants["auto"].get(key), variants["plain"].get(key)
        over_plain = ratio(auto, plain)
        ratios["two_pass_vs_auto" + suffix] = ratio(variants["two_pass"].get(key), auto)
        ratios["auto_overhead_vs_plain" + suffix] = None if over_plain is None else over_plain - 1
        ratios["meter_on_vs_off" + suffix] = ratio(variants["auto_meter"].get(key), auto)
    return ratios


def main(argv: list[str] | None = None) -> int:
    """Run the workloads; write the JSON report after each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, a few rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if sys.platform != "linux":
        raise SystemExit("bench_step_paths.py: Linux only (fork)")
    if args.threads < 0:
        raise SystemExit("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)  # inherited by the forked children
    report = start_report("bench_step_paths", argv, "cpu")
    report.update(quick=args.quick, workloads=[])
    report["rule"] = "ratios from each variant's fastest round (median-round ratios: *_median)"
    started = time.perf_counter()
    for work in workloads(args.quick):
        result = run_forked(measure_workload, work)
        if "error" in result:
            result = {"workload": work.as_dict(), "error": result["error"]}
        print(work.name, result.get("error") or result["ratios"], flush=True)
        report["workloads"].append(result)
        report["seconds_total"] = time.perf_counter() - started
        write_report(args.json, report)
    finish_report(args.json, report, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
