#!/usr/bin/env python
"""Step paths: the default step (``passes="auto"``) against the previous default (``passes=2``),
the overhead of the step over a plain loop, and the graph meter on vs off.

Two workloads, P x K batches of random images (``torch.randn``, seeded) with P identities of K
images each, FaceNet's semi-hard mining (margin 0.2, squared distance, hardest negative when the
band is empty, so every image is selected) and the triplet loss (margin 0.2):

- ``demo``: ``configs/demo.yaml``'s model and optimizer: ``tiny`` at 32 px, P x K = 16 x 4,
  cross-entropy (weight 1.0) from a classifier over 600 identities, Adam lr 0.01;
- ``resnet18``: ``EmbeddingNet("resnet18")`` (no pretrained weights, no classifier) at 64 px,
  P x K = 24 x 4 = 96 images, triplet loss alone, SGD (lr 1e-3, momentum 0.9).

Variants, each with its own copy of the same initial network, optimizer and seeded miner, all
trained on the same batches:

- ``auto``: ``Trainer(passes="auto")``, the new default; with this miner the one-pass step
  (recorded: ``trainer.step.name``);
- ``two_pass``: ``Trainer(passes=2)``, the previous default: a no-grad mining forward on the
  batch, then a grad forward on the selected images (here: all of them);
- ``plain``: a plain loop as pytorch-metric-learning's examples write it, no Trainer:
  ``emb = model(x)`` (with logits when cross-entropy is on), ``miner(emb.detach(), labels)``,
  loss on ``emb`` (+ cross-entropy), ``backward``, ``optimizer.step``,
  ``zero_grad(set_to_none=True)``;
- ``auto_meter``: ``Trainer(passes="auto", graph_memory=True)``, each step inside
  ``with trainer.meter:`` (the saved-tensor hooks of ``GraphMemoryMeter``).

Time. One forked process per workload runs every variant in rounds: each round runs one step
of every variant, in a rotating order, on the same batch, so the variants share the machine's
load over the same minutes. The first rounds are a warm-up, not timed. Per variant: the fastest
round (other jobs only ever add time; the ratios use it) and the median round. Ratios:
two-pass / auto step time, auto / plain - 1 (the step's overhead over the plain loop), meter on
/ meter off.

    python -m benchmarks.bench_step_paths --threads 1 --json step_paths.json   # ~4 min, 2 cores
    python -m benchmarks.bench_step_paths --quick --json q.json                # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.bench_training_step import (
    describe_machine,
    finish_report,
    ratio,
    round_order,
)
from benchmarks.forking import run_forked
from benchmarks.measure import write_report
from facenet.memory import memory_figures
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer

MARGIN = 0.2
EMBEDDING_DIM = 128
VARIANTS = ("auto", "two_pass", "plain", "auto_meter")
VARIANT_LABELS = {
    "auto": 'passes="auto" (new default)',
    "two_pass": "passes=2 (previous default)",
    "plain": "plain loop (no Trainer)",
    "auto_meter": 'passes="auto" + graph meter',
}


@dataclass(frozen=True)
class Workload:
    """A model, a batch shape and an optimizer; timed for ``rounds`` after ``warmup`` rounds.

    Args:
        name: the label printed and written.
        backbone: an ``EmbeddingNet`` backbone name.
        image_size: side of the square input images.
        p, k: identities per batch, images per identity.
        ce_weight: cross-entropy weight (0: no classifier head).
        num_classes: identities the labels are drawn from (the classifier's classes).
        optimizer: "adam" or "sgd" (momentum 0.9).
        lr: learning rate.
        warmup: untimed rounds first.
        rounds: timed rounds.
        batches: distinct batches, cycled over the rounds.
    """

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

    @property
    def images(self) -> int:
        """P x K."""
        return self.p * self.k

    def as_dict(self) -> dict:
        """The fields and the batch size, JSON-ready."""
        return {**dataclasses.asdict(self), "images": self.images}


def workloads(quick: bool) -> list[Workload]:
    """The demo config and resnet18 at 64 px; ``quick``: the same models on small batches."""
    if quick:
        return [
            Workload("demo", "tiny", 32, 8, 4, 1.0, 600, "adam", 0.01, warmup=1, rounds=3),
            Workload("resnet18", "resnet18", 32, 8, 4, 0.0, 1000, "sgd", 1e-3, warmup=1, rounds=2),
        ]
    return [
        Workload("demo", "tiny", 32, 16, 4, 1.0, 600, "adam", 0.01, warmup=10, rounds=400),
        Workload("resnet18", "resnet18", 64, 24, 4, 0.0, 1000, "sgd", 1e-3, warmup=2, rounds=60),
    ]


# --------------------------------------------------------------------------- the variants


def build_model(work: Workload) -> EmbeddingNet:
    """The network every variant starts from (seeded: identical initial weights)."""
    torch.manual_seed(0)
    classes = work.num_classes if work.ce_weight > 0 else None
    model = EmbeddingNet(work.backbone, EMBEDDING_DIM, num_classes=classes)
    return model.train()


def make_optimizer(work: Workload, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Adam (the demo's) or SGD with momentum."""
    if work.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=work.lr)
    return torch.optim.SGD(model.parameters(), lr=work.lr, momentum=0.9)


def make_miner() -> SemiHardNegativeMiner:
    """Semi-hard with the hardest fallback (selects every image), its own seeded generator."""
    return SemiHardNegativeMiner(
        MARGIN, "squared", fallback="hardest", generator=torch.Generator().manual_seed(0)
    )


def make_batches(work: Workload) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``work.batches`` seeded (images, labels): P distinct identities x K random images."""
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(work.batches):
        ids = torch.randperm(work.num_classes, generator=gen)[: work.p]  # (P,)
        labels = ids.repeat_interleave(work.k)  # (P*K,)
        size = work.image_size
        images = torch.randn(work.images, 3, size, size, generator=gen)  # (P*K, 3, S, S)
        batches.append((images, labels))
    return batches


def build_trainer(work: Workload, passes, graph_memory: bool = False) -> Trainer:
    """A Trainer as a run builds one (CPU, fp32), with ``passes`` and the meter on or off."""
    model = build_model(work)
    return Trainer(
        model,
        make_miner(),
        TripletMarginLoss(MARGIN, distance="squared"),
        make_optimizer(work, model),
        ce_weight=work.ce_weight,
        passes=passes,
        graph_memory=graph_memory,
    )


def plain_stepper(work: Workload):
    """The plain loop's step: one grad forward, mining on its detached copy, loss, update."""
    model = build_model(work)
    miner, loss_fn = make_miner(), TripletMarginLoss(MARGIN, distance="squared")
    optimizer = make_optimizer(work, model)
    with_ce = work.ce_weight > 0

    def step(images, labels):
        if with_ce:
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


def build_steppers(work: Workload) -> tuple[dict, dict]:
    """``{variant: step(images, labels)}`` and the Trainers by variant."""
    trainers = {
        "auto": build_trainer(work, "auto"),
        "two_pass": build_trainer(work, 2),
        "auto_meter": build_trainer(work, "auto", graph_memory=True),
    }

    def metered(images, labels, trainer=trainers["auto_meter"]):
        with trainer.meter:
            return trainer.train_step(images, labels)

    steppers = {
        "auto": trainers["auto"].train_step,
        "two_pass": trainers["two_pass"].train_step,
        "plain": plain_stepper(work),
        "auto_meter": metered,
    }
    return {v: steppers[v] for v in VARIANTS}, trainers


def selected_images(output) -> float | None:
    """Images a step trained on: the Trainer's statistic, or the plain loop's unique indices."""
    if isinstance(output, dict):
        return None if "skipped" in output else float(output["selected_images"])
    flat = torch.cat([output.anchor, output.positive, output.negative])
    return float(torch.unique(flat).numel())


# --------------------------------------------------------------------------- measuring


def measure_workload(work: Workload) -> dict:
    """Every variant in rounds in this process; per variant the fastest and median round."""
    torch.manual_seed(0)
    batches = make_batches(work)
    steppers, trainers = build_steppers(work)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    selected: dict[str, list[float]] = {v: [] for v in VARIANTS}
    skipped = dict.fromkeys(VARIANTS, 0)
    started = time.perf_counter()
    for index in range(work.warmup + work.rounds):
        images, labels = batches[index % len(batches)]
        for name in round_order(list(VARIANTS), index):
            start = time.perf_counter()
            output = steppers[name](images, labels)
            seconds = time.perf_counter() - start
            count = selected_images(output)
            if count is None:
                skipped[name] += 1
            elif index >= work.warmup:
                times[name].append(seconds)
                selected[name].append(count)
    variants = {}
    for name in VARIANTS:
        values = times[name]
        row = {
            "label": VARIANT_LABELS[name],
            "step": trainers[name].step.name if name in trainers else "plain",
            "skipped_steps": skipped[name],
            "timed_steps": len(values),
        }
        if values:
            row.update(
                fastest_s=min(values),
                median_s=statistics.median(values),
                images_per_s=work.images / min(values),
                selected_images_mean=statistics.fmean(selected[name]),
                times_s=[round(v, 5) for v in values],
            )
        variants[name] = row
    # Graph bytes only: the workload's variants share this process (no RSS of their own).
    variants["auto_meter"].update(memory_figures(trainers["auto_meter"].meter, rss=False))
    return {
        "workload": work.as_dict(),
        "variants": variants,
        "ratios": workload_ratios(variants),
        "seconds": time.perf_counter() - started,
    }


def workload_ratios(variants: dict) -> dict:
    """Two-pass / auto, auto / plain - 1, meter on / off: from the fastest and median rounds."""

    def value(name: str, key: str):
        return (variants.get(name) or {}).get(key)

    ratios = {}
    for key, suffix in (("fastest_s", ""), ("median_s", "_median")):
        over_plain = ratio(value("auto", key), value("plain", key))
        ratios["two_pass_vs_auto" + suffix] = ratio(value("two_pass", key), value("auto", key))
        ratios["auto_overhead_vs_plain" + suffix] = None if over_plain is None else over_plain - 1
        ratios["meter_on_vs_off" + suffix] = ratio(value("auto_meter", key), value("auto", key))
    return ratios


# --------------------------------------------------------------------------- report


def print_workload(result: dict) -> None:
    """One workload's rows and ratios."""
    work = result["workload"]
    print(
        f"== {work['name']}: {work['backbone']} {work['image_size']}px, P x K = {work['p']}x"
        f"{work['k']}, ce_weight {work['ce_weight']}, {work['optimizer']} lr {work['lr']}; "
        f"{work['rounds']} rounds after {work['warmup']} ({result['seconds']:.0f} s)",
        flush=True,
    )
    print(f"   {'variant':<32}{'step':>10}{'fastest s':>11}{'median s':>10}{'img/s':>9}")
    for row in result["variants"].values():
        if "fastest_s" not in row:
            print(f"   {row['label']:<32}{row['step']:>10}  no timed step")
            continue
        print(
            f"   {row['label']:<32}{row['step']:>10}{row['fastest_s']:>11.4f}"
            f"{row['median_s']:>10.4f}{row['images_per_s']:>9.1f}"
        )
    for key, value in result["ratios"].items():
        print(f"   {key}: {'-' if value is None else f'{value:.3f}'}")


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, a few rounds")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--rounds", type=int, default=0, help="override the timed rounds")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=("demo", "resnet18"),
        help="run only this workload (repeatable)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the workloads, print the tables, write the JSON report."""
    args = get_args_parser().parse_args(argv)
    if sys.platform != "linux":
        raise SystemExit("bench_step_paths.py: Linux only (fork)")
    if args.threads < 0 or args.rounds < 0:
        raise SystemExit("--threads and --rounds must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)  # inherited by the forked children
    works = workloads(args.quick)
    if args.rounds:
        works = [dataclasses.replace(w, rounds=args.rounds) for w in works]
    if args.only:
        works = [w for w in works if w.name in args.only]
    report: dict = {
        "benchmark": "bench_step_paths",
        "quick": args.quick,
        "command": "python -m benchmarks.bench_step_paths " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": describe_machine("cpu"),
        "rule": "ratios from each variant's fastest round (median-round ratios: *_median)",
        "workloads": [],
    }
    started = time.perf_counter()
    for work in works:
        result = run_forked(measure_workload, work)
        if "error" in result:
            result = {"workload": work.as_dict(), "error": result["error"]}
            print(f"== {work.name}: {result['error']}", flush=True)
        else:
            print_workload(result)
        report["workloads"].append(result)
        report["seconds_total"] = time.perf_counter() - started
        write_report(args.json, report)
    finish_report(args.json, report, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
