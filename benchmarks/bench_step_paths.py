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

import contextlib
import dataclasses
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.bench_training_step import parse_options, ratio, start_report, time_rounds
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


def build_parts(work: Workload) -> tuple:
    """``(model, miner, loss, optimizer)``, seeded: the same in every variant."""
    torch.manual_seed(0)
    classes = work.num_classes if work.ce_weight > 0 else None
    model = EmbeddingNet(work.backbone, 128, num_classes=classes).train()
    if work.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=work.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)
    generator = torch.Generator().manual_seed(0)
    miner = SemiHardNegativeMiner(MARGIN, "squared", fallback="hardest", generator=generator)
    return model, miner, TripletMarginLoss(MARGIN, distance="squared"), optimizer


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
    """The plain loop's step (as pytorch-metric-learning's examples write it): images it
    trained on."""
    model, miner, loss_fn, optimizer = build_parts(work)

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
        return torch.cat([triplets.anchor, triplets.positive, triplets.negative]).unique().numel()

    return step


def trainer_stepper(trainer: Trainer):
    """A Trainer's step under its meter, if any: images it trained on (None: skipped)."""

    def step(batch):
        with trainer.meter or contextlib.nullcontext():
            stats = trainer.train_step(*batch)
        return None if "skipped" in stats else stats["selected_images"]

    return step


def variant_row(work: Workload, name: str, step: str, runs: list[tuple]) -> dict:
    """A variant's fastest and median round over its steps that were not skipped."""
    counts = [count for _, count in runs if count is not None]
    values = [seconds for seconds, count in runs if count is not None]
    row = {"label": VARIANT_LABELS[name], "step": step, "skipped_steps": len(runs) - len(values)}
    row["timed_steps"] = len(values)
    if values:
        row.update(
            fastest_s=min(values),
            median_s=statistics.median(values),
            images_per_s=work.p * work.k / min(values),
            selected_images_mean=statistics.fmean(counts),
        )
    return row


def measure_workload(work: Workload) -> dict:
    """Every variant in rounds in this process."""
    trainers = {
        name: Trainer(*build_parts(work), ce_weight=work.ce_weight, passes=passes,
                      graph_memory=name == "auto_meter")
        for name, passes in (("auto", "auto"), ("two_pass", 2), ("auto_meter", "auto"))
    }  # fmt: skip
    tasks = {name: trainer_stepper(trainer) for name, trainer in trainers.items()}
    tasks = {"auto": tasks["auto"], "two_pass": tasks["two_pass"], "plain": plain_stepper(work),
             "auto_meter": tasks["auto_meter"]}  # fmt: skip
    runs = time_rounds(tasks, make_batches(work), work.rounds, work.warmup)
    steps = {name: trainer.step.name for name, trainer in trainers.items()} | {"plain": "plain"}
    variants = {name: variant_row(work, name, steps[name], runs[name]) for name in tasks}
    # Graph bytes only: the variants share this process, so no RSS of their own.
    variants["auto_meter"].update(memory_figures(trainers["auto_meter"].meter, rss=False))
    ratios = workload_ratios(variants)
    return {"workload": workload_dict(work), "variants": variants, "ratios": ratios}


def workload_dict(work: Workload) -> dict:
    """The fields and the batch size, JSON-ready."""
    return {**dataclasses.asdict(work), "images": work.p * work.k}


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
    """Run the workloads, each in a forked child; write the JSON report after each."""
    args = parse_options(__doc__, argv)
    report = start_report("bench_step_paths", argv, "cpu", quick=args.quick, workloads=[])
    for work in workloads(args.quick):
        result = run_forked(measure_workload, work)
        if "error" in result:
            result = {"workload": workload_dict(work), "error": result["error"]}
        report["workloads"].append(result)
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
