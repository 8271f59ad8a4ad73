#!/usr/bin/env python
"""Training step, side by side: the seed's loop, the two-pass step, the one-pass step, chunks.

Each variant trains the same initial network on the same batches (SGD, lr 1e-4, momentum 0.9)
in a forked child of its own, so its peak RSS is its own; its graph peak runs over every step
(the seed loop's needs a second step, while the first step's graphs are alive). Time ratios
come from one more child running every variant and each part of the two-pass step in rotating
rounds on the same batch, each task's figure its fastest round. The floor: the no-grad forward
on the batch plus forward and backward on the images two-pass selected. P x K cases also run
the default step (``passes="auto"``: its path in ``step``), in the rounds under its graph meter.

    python -m benchmarks.bench_training_step --json step.json   # CPU suite; --quick: seconds
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import importlib.util
import statistics
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import memory_report
from benchmarks.forking import run_forked
from benchmarks.measure import (
    RSS_BEFORE_BYTES,
    benchmark_parser,
    describe_machine,
    device_name,
    ratio,
    run_benchmark,
    time_rounds,
    timed,
    write_report,
)
from benchmarks.seed_loop import l2_dist, seed_train_step
from facenet.cli.common import positive_int
from facenet.config import load_config
from facenet.errors import FacenetError
from facenet.memory import (
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    GRAPH_BYTES_PEAK,
    PEAK_RSS_BYTES,
    GraphMemoryMeter,
    current_rss_bytes,
    memory_figures,
    peak_rss_bytes,
    reset_cuda_peaks,
)
from facenet.metric.distances import get_distance
from facenet.models.embedding import EmbeddingNet
from facenet.training.build import build_trainer as build_trainer_from_config
from facenet.training.engine import Trainer
from facenet.training.step import frozen_bn_running_stats, unique_triplet_images

NUM_CLASSES = 16  # triplet mode: classes of the classifier head
SPARSE_FRACTION = 0.2  # share of a triplet batch made hard
DENSE_MARGIN = 10.0  # unit embeddings: d(a,n) - d(a,p) >= -2 < 10, every triplet passes
PK_MARGIN = 0.2
POSITIVE_NOISE = 0.3  # positive = anchor + this x N(0, 1), in pixel space
SELECTIONS = ("sparse", "dense")


@dataclass(frozen=True)
class Case:
    """A model and a batch: "triplets" (T of them, 3T images, the seed's input: selection
    "sparse" or "dense") or "pk" (P x K images, "semihard", triplet loss alone)."""

    backbone: str
    image_size: int
    batch: str
    selection: str
    triplets: int = 0
    p: int = 0
    k: int = 0
    variants: tuple[str, ...] = ("seed", "two_pass", "one_pass")
    repeats: int = 3  # timed steps, after a warm-up step
    chunk_size: int = 0  # images per chunk of two_pass_chunked
    device: str = "cpu"
    amp: str = "none"  # or "bf16"
    margin: float = PK_MARGIN  # a Trainer's (triplet batches: calibrated per variant)
    seed: int = 0  # of the weights and the miner
    embedding_dim: int = 128

    @property
    def images(self) -> int:
        """Images in one batch."""
        return 3 * self.triplets if self.batch == "triplets" else self.p * self.k

    @property
    def name(self) -> str:
        """E.g. ``resnet18 112px T=16 sparse``."""
        shape = f"T={self.triplets}" if self.batch == "triplets" else f"PxK={self.p}x{self.k}"
        amp = "" if self.amp == "none" else f" {self.amp}"
        return f"{self.backbone} {self.image_size}px {shape} {self.selection}{amp}"


def cpu_cases(quick: bool) -> list[Case]:
    """The step on resnet18 and tiny, then gradient caching on growing P x K batches."""
    if quick:
        steps = [Case("tiny", 32, "triplets", sel, triplets=8, repeats=1) for sel in SELECTIONS]
        batches, chunk_size, repeats = [(8, 4), (16, 4)], 8, 1
    else:
        # T = 16: 3 hard triplets a step (with 1, the seed's forward_classifier would give
        # BatchNorm1d a single image).
        steps = [Case("resnet18", 112, "triplets", s, triplets=16, repeats=6) for s in SELECTIONS]
        steps += [Case("tiny", 64, "triplets", s, triplets=32, repeats=20) for s in SELECTIONS]
        batches, chunk_size, repeats = [(32, 8), (64, 8), (225, 8)], 64, 6  # FaceNet's: ~1,800
    variants = ("two_pass", "two_pass_chunked", "auto")  # auto: the default's choice of path
    chunked = {"variants": variants, "chunk_size": chunk_size}
    return steps + [
        Case("tiny", 32, "pk", "semihard", p=p, k=k, repeats=repeats, **chunked) for p, k in batches
    ]


def gpu_cases(quick: bool) -> list[Case]:
    """resnet50 at 160 px, T = 128 and P x K = 64 x 4, fp32 and bf16 (quick: tiny, small);
    the device is set by :func:`main`."""
    backbone, size, triplets, p, k, chunk_size, repeats = (
        ("tiny", 32, 8, 4, 2, 4, 1) if quick else ("resnet50", 160, 128, 64, 4, 64, 5)
    )
    cases = []
    for amp in ("none", "bf16"):
        cases += [
            Case(backbone, size, "triplets", sel, triplets=triplets, repeats=repeats, amp=amp)
            for sel in SELECTIONS
        ]
        variants = ("two_pass", "one_pass", "two_pass_chunked")
        pk = {"variants": variants, "repeats": repeats, "chunk_size": chunk_size, "amp": amp}
        cases.append(Case(backbone, size, "pk", "semihard", p=p, k=k, **pk))
    return cases


def hard_triplets_per_batch(case: Case) -> int:
    """round(20% of T), at least 2."""
    return max(2, round(SPARSE_FRACTION * case.triplets))


def make_triplet_batches(case: Case, count: int) -> list[tuple]:
    """``count`` batches ``(a, p, n, label_p, label_n)`` of N(0, 1) images.

    An easy triplet's positive is its anchor plus noise and its negative another image; in
    :func:`hard_triplets_per_batch` of them, at random places, the two swap roles. Any margin
    between the two groups then selects the same count each step, in every variant.
    """
    gen = torch.Generator().manual_seed(0)
    batches = []
    for a, noise, n, label_p, label_n in memory_report.make_triplet_batches(
        count, case.triplets, case.image_size, NUM_CLASSES, seed=0
    ):
        p = a + POSITIVE_NOISE * noise
        hard = torch.randperm(case.triplets, generator=gen)[: hard_triplets_per_batch(case)]
        p[hard], n[hard] = n[hard].clone(), p[hard].clone()
        batches.append(tuple(t.to(case.device) for t in (a, p, n, label_p, label_n)))
    return batches


def make_batches(case: Case) -> list[tuple]:
    """One distinct batch per step (warm-up included), the same in every variant."""
    if case.batch == "triplets":
        return make_triplet_batches(case, case.repeats + 1)
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(case.p).repeat_interleave(case.k).to(case.device)  # (PK,)
    shape = (case.images, 3, case.image_size, case.image_size)
    images = (torch.randn(shape, generator=gen) for _ in range(case.repeats + 1))
    return [(x.to(case.device), labels) for x in images]


def autocast(case: Case) -> torch.autocast:
    """bf16 autocast on the case's device, when asked."""
    device_type = torch.device(case.device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=case.amp == "bf16")


def build_network(case: Case) -> EmbeddingNet:
    """The seeded network every variant starts from; a classifier head in triplet mode."""
    return memory_report.build_network(case, NUM_CLASSES if case.batch == "triplets" else None)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of every variant."""
    return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)


def build_trainer(case: Case, variant: str, margin: float) -> Trainer:
    """A Trainer for "two_pass", "one_pass", "two_pass_chunked" or "auto" (``passes="auto"``)."""
    model, triplets = build_network(case), case.batch == "triplets"
    return memory_report.build_trainer(
        dataclasses.replace(case, margin=margin),
        model,
        make_optimizer(model),
        pk=not triplets,
        amp=case.amp,
        ce_weight=1.0 if triplets else 0.0,
        passes={"one_pass": 1, "auto": "auto"}.get(variant, 2),
        chunk_size=case.chunk_size if variant == "two_pass_chunked" else 0,
    )


def margin_passing(margins: torch.Tensor, fraction: float) -> float:
    """A margin m such that exactly round(fraction x N) of the (N,) ``margins`` are < m."""
    ordered = margins.double().sort().values  # (N,)
    count = max(1, min(len(ordered) - 1, round(fraction * len(ordered))))
    return float((ordered[count - 1] + ordered[count]) / 2)


def calibrate(case: Case) -> dict:
    """A margin for the seed's loop and one for our steps, each selecting the case's share of
    the candidates (the hard ones, or all) on the initial network. The seed's BatchNorm sees
    a, p and n as three batches, ours as one, so their distances differ."""
    seed_model = memory_report.build_seed_model(case, NUM_CLASSES)
    network = build_network(case).to(case.device)
    distance = get_distance("seed_l2")
    margins = {"seed": [], "ours": []}  # d(a,n) - d(a,p), a (T,) tensor per batch
    with torch.no_grad(), frozen_bn_running_stats(seed_model), autocast(case):
        with frozen_bn_running_stats(network.train()):
            for data_a, data_p, data_n, _, _ in make_batches(case):
                out_a, out_p, out_n = (seed_model(x).float() for x in (data_a, data_p, data_n))
                d_p, d_n = l2_dist.forward(out_a, out_p), l2_dist.forward(out_a, out_n)
                margins["seed"].append((d_n - d_p).cpu())
                out_a, out_p, out_n = network(torch.cat([data_a, data_p, data_n])).float().chunk(3)
                d_p, d_n = distance.paired(out_a, out_p), distance.paired(out_a, out_n)
                margins["ours"].append((d_n - d_p).cpu())
    result = {"candidates": case.triplets * (case.repeats + 1)}
    for kind, values in margins.items():
        values = torch.stack(values)  # (batches, T)
        margin = DENSE_MARGIN
        if case.selection == "sparse":
            margin = margin_passing(values.flatten(), hard_triplets_per_batch(case) / case.triplets)
        passing = values < margin
        result[f"margin_{kind}"] = margin
        result[f"pass_fraction_{kind}"] = float(passing.double().mean())
        result[f"passing_per_batch_{kind}"] = passing.sum(1).tolist()
    return result


def build_stepper(case: Case, variant: str, margin: float):
    """``(step(batch) -> its statistics, model, optimizer, meter, path)``: ``variant`` on its
    own model; ``path``: "seed" or the Trainer's step (one-pass, two-pass, chunked)."""
    if variant == "seed":
        model = memory_report.build_seed_model(case, NUM_CLASSES)
        optimizer, state = make_optimizer(model), {}  # state: the loop's variables, carried

        def seed_step(batch):
            with autocast(case):
                return seed_train_step(model, optimizer, *batch, margin=margin, state=state)

        return seed_step, model, optimizer, GraphMemoryMeter(exclude=model), "seed"
    trainer = build_trainer(case, variant, margin)
    trainer.model.train()
    train = trainer.train_triplet_step if case.batch == "triplets" else trainer.train_step
    return (
        (lambda batch: train(*batch)),
        trainer.model,
        trainer.optimizer,
        trainer.meter,
        trainer.step.name,
    )


def measure_trainer(case: Case, variant: str, margin: float) -> dict:
    """``repeats + 1`` steps of one variant, the seed's loop or a Trainer: the memory report's
    figures, median step time and selection after the warm-up step, and the peak RSS (run it
    in a forked child)."""
    step, model, optimizer, meter, path = build_stepper(case, variant, margin)
    before = {RSS_BEFORE_BYTES: current_rss_bytes()}
    figures = memory_report.measure_steps(
        case.device, make_batches(case), step, model, optimizer, meter
    )
    timed = figures["per_step"][1:]
    triplets = statistics.mean(s["selected_triplets"] for s in timed)
    figures.update(
        median_step_s=figures["step_seconds"],
        selected_images_mean=statistics.mean(s["selected_images"] for s in timed),
        step=path,
        **before,
        **{PEAK_RSS_BYTES: peak_rss_bytes()},
    )
    if case.batch == "triplets":
        figures["selected_fraction"] = triplets / case.triplets
    return figures


def batch_tensors(case: Case, batch: tuple):
    """``(images (B, C, S, S), labels (B,), candidate triplets or None)`` as a step sees them."""
    if case.batch != "triplets":
        return batch[0], batch[1], None
    data_a, data_p, data_n, label_p, label_n = batch
    index = torch.arange(case.triplets, device=data_a.device)
    candidates = (index, index + case.triplets, index + 2 * case.triplets)
    return torch.cat([data_a, data_p, data_n]), torch.cat([label_p, label_p, label_n]), candidates


def floor_parts(trainer: Trainer, case: Case, batch: tuple, selected: torch.Tensor) -> dict:
    """The parts of a step as callables: the floor's two, and what it leaves out.

    ``selected`` (U, C, S, S): as many images as the two-pass step selects.
    """
    model, with_logits = trainer.model, case.batch == "triplets"
    images, labels, candidates = batch_tensors(case, batch)
    with torch.no_grad(), autocast(case):
        embeddings = model(images).float()  # (B, D), for the miner

    def backward(x, on=model):
        with autocast(case):
            out = on(x, return_logits=with_logits)
        sum(o.float().sum() for o in (out if with_logits else (out,))).backward()

    def forward_backward(x):
        backward(x)
        model.zero_grad(set_to_none=True)  # as the step does after its update

    def grad_forward():  # the one-pass step's forward on the batch (graph dropped)
        with autocast(case):
            model(images, return_logits=with_logits)

    def nograd_forward():
        with torch.no_grad(), frozen_bn_running_stats(model), autocast(case):
            model(images)

    def seed_parts():  # a, p, n apart with grad, then the selected images by thirds
        with autocast(case):
            for third in images.chunk(3):
                model(third)
        for third in selected.chunk(3):
            forward_backward(third)

    # The update on a copy whose gradients stay: every timed call has all of them to apply.
    update_model = copy.deepcopy(model)
    backward(selected, on=update_model)
    parts = {
        "nograd_forward_s": nograd_forward,
        "selected_forward_backward_s": lambda: forward_backward(selected),
        "optimizer_step_s": make_optimizer(update_model).step,
        "miner_s": lambda: trainer.step.miner(embeddings, labels, candidates=candidates),
        "grad_forward_s": grad_forward,
    }
    if "seed" in case.variants:
        parts["seed_parts_s"] = seed_parts
    return parts


def measure_rounds(case: Case, margins: dict, selected_images: int, variants: list[str]):
    """Every variant's step and the two-pass step's parts in rounds, in one process; each
    task's figure is its fastest round after the first (other jobs only ever add time)."""
    batches = make_batches(case)
    images, _, _ = batch_tensors(case, batches[0])
    # (U, C, S, S): the cost depends on U alone; its own storage (a view would count the batch).
    selected = images[: max(1, selected_images)].clone()
    parts_trainer = build_trainer(case, "two_pass", margins["ours"])
    parts_trainer.model.train()
    tasks = {
        f"{v}_step_s": build_stepper(case, v, margins["seed" if v == "seed" else "ours"])[0]
        for v in variants
    }
    if "auto" in variants:  # the graph meter's cost: the default step under its meter
        step, *_, meter, _ = build_stepper(case, "auto", margins["ours"])
        tasks["auto_metered_step_s"] = lambda batch: metered(meter, step, batch)
    for name, part in floor_parts(parts_trainer, case, batches[0], selected).items():
        tasks[name] = lambda batch, f=part: f()
    times = time_rounds(tasks, batches, case.repeats, case.device)
    rounds = {name: min(values) for name, values in times.items()}
    rounds["medians"] = {name: statistics.median(values) for name, values in times.items()}
    rounds["floor_s"] = rounds["nograd_forward_s"] + rounds["selected_forward_backward_s"]
    rounds["selected_images"] = int(selected.shape[0])
    rounds["rounds"] = case.repeats
    model = parts_trainer.model
    rounds["selected_forward_graph_bytes"] = forward_graph_bytes(model, selected, case)
    if case.chunk_size:
        chunk = selected[: case.chunk_size].clone()
        rounds["chunk_forward_graph_bytes"] = forward_graph_bytes(model, chunk, case)
        rounds["loss_graph_bytes"] = loss_graph_bytes(parts_trainer, case, batches[0])
    return rounds


def metered(meter: GraphMemoryMeter, step, batch: tuple):
    """``step(batch)`` inside ``meter``."""
    with meter:
        return step(batch)


def forward_graph_bytes(model: torch.nn.Module, images: torch.Tensor, case: Case) -> int:
    """Graph bytes of one grad forward on ``images`` (embeddings and logits)."""
    meter = GraphMemoryMeter(exclude=model)
    with meter, autocast(case):
        outputs = model(images, return_logits=case.batch == "triplets")  # noqa: F841 (held)
        return int(meter.peak_bytes)


def loss_graph_bytes(trainer: Trainer, case: Case, batch: tuple) -> int:
    """Graph bytes of the loss on the selected embeddings cached as a leaf (U, D): what the
    chunked step holds between its mining pass and its first chunk."""
    images, labels, candidates = batch_tensors(case, batch)
    with torch.no_grad(), frozen_bn_running_stats(trainer.model), autocast(case):
        embeddings = trainer.model(images).float()  # (B, D)
    triplets = trainer.step.miner(embeddings, labels, candidates=candidates)
    unique, local = unique_triplet_images(triplets)
    cached = embeddings[unique].clone().requires_grad_(True)  # (U, D)
    meter = GraphMemoryMeter()
    with meter:
        loss = trainer.step.loss_fn(cached, local)  # noqa: F841 (held while the peak is read)
        return int(meter.peak_bytes)


# ratio: (numerator, denominator) among the rounds' figures and the variants' graph peaks;
# throughput is the inverse ratio of step times.
RATIOS = {
    "graph_peak_two_pass_vs_seed": ("two_pass_peak", "seed_peak"),
    "graph_peak_one_pass_vs_seed": ("one_pass_peak", "seed_peak"),
    "graph_peak_chunked_vs_two_pass": ("two_pass_chunked_peak", "two_pass_peak"),
    "throughput_two_pass_vs_seed": ("seed_step_s", "two_pass_step_s"),
    "throughput_one_pass_vs_seed": ("seed_step_s", "one_pass_step_s"),
    "throughput_chunked_vs_two_pass": ("two_pass_step_s", "two_pass_chunked_step_s"),
    "two_pass_vs_auto": ("two_pass_step_s", "auto_step_s"),  # step times
    "meter_on_vs_off": ("auto_metered_step_s", "auto_step_s"),
    "two_pass_above_floor": ("two_pass_step_s", "floor_s"),
    "seed_step_vs_floor": ("seed_step_s", "floor_s"),
    # What the arithmetic alone allows two-pass to gain over the seed on this machine.
    "seed_parts_vs_floor": ("seed_parts_s", "floor_s"),
    "graph_peak_chunked_vs_one_chunk": ("two_pass_chunked_peak", "chunk_forward_graph_bytes"),
}


def case_ratios(variants: dict, rounds: dict | None) -> dict:
    """The ratios the targets are stated in: memory from the variants' own processes, time
    from the rounds."""
    figures = dict(rounds if rounds and "error" not in rounds else {})
    for variant, row in variants.items():
        if "error" not in row:
            figures[f"{variant}_peak"] = row.get(GRAPH_BYTES_PEAK)
    ratios = {key: ratio(figures.get(num), figures.get(den)) for key, (num, den) in RATIOS.items()}
    above_floor = ratios.pop("two_pass_above_floor")
    if above_floor is not None:
        ratios["two_pass_overhead_above_floor"] = above_floor - 1.0
    return {key: value for key, value in ratios.items() if value is not None}


def run_case(case: Case) -> dict:
    """Calibrate, run each variant in its own child, then the rounds in another; ratios."""
    case_dict = {**dataclasses.asdict(case), "name": case.name, "images": case.images}
    result: dict = {"case": case_dict, "variants": {}}
    margins = {"seed": PK_MARGIN, "ours": PK_MARGIN}
    if case.batch == "triplets":
        result["calibration"] = calibration = run_forked(calibrate, case)
        if "error" in calibration:
            return result
        margins = {"seed": calibration["margin_seed"], "ours": calibration["margin_ours"]}
    result["margins"] = margins
    variants = result["variants"]
    for variant in case.variants:
        margin = margins["seed" if variant == "seed" else "ours"]
        variants[variant] = run_forked(measure_trainer, case, variant, margin)
    ran = [name for name, row in variants.items() if "error" not in row]
    if "selected_images_mean" in variants.get("two_pass", {}):
        selected = round(variants["two_pass"]["selected_images_mean"])
        result["rounds"] = run_forked(measure_rounds, case, margins, selected, ran)
        for name in ran:
            step_s = result["rounds"].get(f"{name}_step_s")
            if step_s:
                variants[name]["rounds_step_s"] = step_s
                variants[name]["rounds_images_per_s"] = case.images / step_s
    result["ratios"] = case_ratios(variants, result.get("rounds"))
    return result


def try_batch(case: Case) -> dict:
    """One two-pass step on a P x K batch: did it fit?"""
    variant = "two_pass_chunked" if case.chunk_size else "two_pass"
    result = measure_trainer(case, variant, PK_MARGIN)
    keys = ("median_step_s", GRAPH_BYTES_PEAK, CUDA_MAX_ALLOCATED)
    return {key: result[key] for key in keys if key in result}


def search_largest_batch(template: Case, sizes: list[int]) -> list[dict]:
    """Per chunk setting (none, the template's), the P x K sizes tried until one fails."""
    rows = []
    for chunk_size in (0, template.chunk_size):
        for size in sizes:
            case = dataclasses.replace(
                template, p=size // template.k, repeats=1, chunk_size=chunk_size
            )
            outcome = run_forked(try_batch, case)
            rows.append({"batch": case.images, "chunk_size": chunk_size, **outcome})
            if "error" in outcome:
                break
    return rows


# ---------------------------------------------------------------- configs/facenet_1800.yaml
# What benchmarks/gpu_check.sh measures on one GPU, in this order; the JSON is written after
# each. "default": the configuration without train.chunk_size (the default step's path).
FACENET_1800 = Path(__file__).resolve().parents[1] / "configs" / "facenet_1800.yaml"
FACENET_1800_CASES = (
    "default",
    "chunked",
    "seed_largest",
    "ours_at_seed_batch",
    "ours_at_1800",
    "sync_debug",
    "cuda_tests",
)
# (the smoke test's): a tiny network on 4 x 4 images of 32 px, chunks of 8
QUICK_1800 = ["model.backbone=tiny", "data.image_size=32", "data.p=4", "data.k=4"]
SEED_TRIPLETS = (200, 400, 600)  # the seed's batch: 3 T = 600, 1,200, 1,800 images
CUDA_TESTS = ["tests/metric", "tests/data/test_loading.py", "tests/test_memory.py", "-k", "cuda"]


def config_1800(device: str, quick: bool, overrides: list[str]):
    """configs/facenet_1800.yaml on ``device`` (quick: :data:`QUICK_1800`), ``overrides`` last."""
    settings = [f"train.device={device}"] + (QUICK_1800 + ["train.chunk_size=8"]) * quick
    return load_config(FACENET_1800, settings + overrides)


def config_step(device: str, quick: bool, overrides: list[str], repeats: int) -> dict:
    """The run's trainer (``facenet.training.build``) on one uint8 batch held on the CPU, as
    the loader hands it: a warm-up step, then ``repeats`` timed ones; images/s and the CUDA
    peaks of the timed steps. Run it forked: each measurement its own CUDA context."""
    cfg = config_1800(device, quick, overrides)
    trainer = build_trainer_from_config(cfg, None, torch.device(device), steps_per_epoch=1)
    count, size = cfg.data.p * cfg.data.k, cfg.data.image_size
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.arange(cfg.data.p).repeat_interleave(cfg.data.k)
    trainer.train_mode()
    trainer.train_step(images, labels)
    reset_cuda_peaks(trainer.device)
    seconds, _ = timed(device, lambda: [trainer.train_step(images, labels) for _ in range(repeats)])
    figures = memory_figures(device=trainer.device, rss=False)
    return {
        "images": count,
        "step": trainer.step.name,
        "images_per_s": count * repeats / seconds,
        **figures,
    }


def synced_step(device: str, quick: bool, overrides: list[str]) -> dict:
    """One step after a warm-up under ``torch.cuda.set_sync_debug_mode("warn")``: the host
    syncs CUDA reports (each a warning). CUDA only."""
    cfg = config_1800(device, quick, overrides)
    trainer = build_trainer_from_config(cfg, None, torch.device(device), steps_per_epoch=1)
    images = torch.randint(
        0,
        256,
        (cfg.data.p * cfg.data.k, 3, cfg.data.image_size, cfg.data.image_size),
        dtype=torch.uint8,
    )
    labels = torch.arange(cfg.data.p).repeat_interleave(cfg.data.k)
    trainer.train_mode()
    trainer.train_step(images, labels)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(images, labels)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = [str(w.message).splitlines()[0] for w in caught if "synchron" in str(w.message)]
    return {"step": trainer.step.name, "syncs": len(where), "messages": where[:20]}


def seed_at(device: str, quick: bool, triplets: int) -> dict:
    """The seed's loop (benchmarks/seed_loop.py) on the configuration's network at ``triplets``
    triplets (3 T images, copied from the CPU each step as its loop does): images/s, peaks."""
    cfg = config_1800(device, quick, [])
    case = Case(
        cfg.model.backbone,
        cfg.data.image_size,
        "triplets",
        "sparse",
        triplets=triplets,
        amp=cfg.train.amp,
        embedding_dim=cfg.model.embedding_dim,
    )
    (cpu_batch,) = make_triplet_batches(case, 1)
    step, *_ = build_stepper(dataclasses.replace(case, device=device), "seed", PK_MARGIN)
    step(tuple(t.to(device) for t in cpu_batch))
    reset_cuda_peaks(device)
    seconds, _ = timed(device, lambda: step(tuple(t.to(device) for t in cpu_batch)))
    figures = memory_figures(device=torch.device(device), rss=False)
    return {"images": 3 * triplets, "images_per_s": 3 * triplets / seconds, **figures}


def cuda_tests() -> dict:
    """The tests a CPU machine skips for want of CUDA, where pytest is installed."""
    if importlib.util.find_spec("pytest") is None:
        return {"error": "pytest is not installed: the CUDA tests were not run"}
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    return {
        "command": " ".join(command[1:]),
        "returncode": done.returncode,
        "summary": done.stdout.strip().splitlines()[-3:],
    }


def markdown_1800(results: dict) -> str:
    """BENCHMARKS.md's GPU table of :func:`measure_1800`'s results (as far as they go)."""
    mib = lambda row, key: f"{row[key] / 2**20:,.0f}" if key in row else ""  # noqa: E731
    lines = [
        "| measurement | step | images | images/s | peak allocated MiB | peak reserved MiB |",
        "|---|---|--:|--:|--:|--:|",
    ]
    rows = [(name, results[name]) for name in ("default", "chunked") if name in results]
    rows += [(f"seed T={r['triplets']}", r) for r in results.get("seed_largest", [])]
    rows += [
        (f"ours at the seed's batch, {k}", r)
        for k, r in results.get("ours_at_seed_batch", {}).items()
    ]
    for name, row in rows:
        speed = f"{row['images_per_s']:,.0f}" if "images_per_s" in row else row.get("error", "")
        lines.append(
            f"| {name} | {row.get('step', 'seed')} | {row.get('images', '')} | {speed} | "
            f"{mib(row, CUDA_MAX_ALLOCATED)} | {mib(row, CUDA_MAX_RESERVED)} |"
        )
    for path, row in results.get("sync_debug", {}).items():
        if isinstance(row, dict):
            lines.append(
                f"| sync-debug warn | {path} | | syncs: {row.get('syncs', row.get('error'))} | | |"
            )
    tests = results.get("cuda_tests", {})
    if tests:
        lines.append(f"\nCUDA tests: {' '.join(tests.get('summary', [tests.get('error', '')]))}")
    return "\n".join(lines) + "\n"


def measure_1800(args: argparse.Namespace, report: dict) -> dict:
    """:data:`FACENET_1800_CASES`, each written to ``--json`` as soon as measured."""
    device, quick, repeats = args.device or "cuda", args.quick, 1 if args.quick else 2
    results = report["facenet_1800"] = {}

    def record(name, value):
        results[name] = value
        write_report(args.json, report)
        if args.json is not None:  # the table beside it: gpu_check.md
            Path(args.json).with_suffix(".md").write_text(markdown_1800(results))

    record("default", run_forked(config_step, device, quick, ["train.chunk_size=0"], repeats))
    record("chunked", run_forked(config_step, device, quick, [], repeats))
    seed_rows = []
    for triplets in SEED_TRIPLETS[:2] if quick else SEED_TRIPLETS:
        seed_rows.append({"triplets": triplets, **run_forked(seed_at, device, quick, triplets)})
        record("seed_largest", seed_rows)
        if "error" in seed_rows[-1]:
            break
    fitted = [row for row in seed_rows if "error" not in row]
    if fitted:  # ours on the same images: k = 40 (quick: 4) per identity, as many as fit
        k = config_1800(device, quick, []).data.k
        same = [f"data.p={max(2, fitted[-1]['images'] // k)}"]
        record(
            "ours_at_seed_batch",
            {
                path: run_forked(config_step, device, quick, same + chunk, repeats)
                for path, chunk in (("default", ["train.chunk_size=0"]), ("chunked", []))
            },
        )
    record("ours_at_1800", {"default": results["default"], "chunked": results["chunked"]})
    paths = {
        "one-pass": ["train.chunk_size=0", "mining.passes=1"],
        "two-pass": ["train.chunk_size=0", "mining.passes=2"],
        "chunked": [],
    }
    if device.startswith("cuda"):
        record(
            "sync_debug", {p: run_forked(synced_step, device, quick, o) for p, o in paths.items()}
        )
        record("cuda_tests", cuda_tests())
    else:
        record(
            "sync_debug", {"error": "CUDA only (tests/training/test_host_syncs.py counts on CPU)"}
        )
        record("cuda_tests", {"error": "CUDA only"})
    return report


def measure(args: argparse.Namespace, argv: list[str]) -> dict:
    """Run the suite, writing the report to ``--json`` after each case (a run stopped by a
    time limit keeps the cases it finished)."""
    if sys.platform != "linux":
        raise FacenetError("Linux only (fork, /proc)")
    device = args.device or ("cpu" if args.suite == "cpu" else "cuda")
    cuda = run_forked(lambda: {"ok": torch.cuda.is_available()}) if device != "cpu" else {}
    if device.startswith("cuda") and not cuda.get("ok"):
        raise FacenetError(f"--device {device}: torch sees no CUDA device")
    report = {
        "benchmark": "bench_training_step",
        "command": "python -m benchmarks.bench_training_step " + " ".join(argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": describe_machine(device),
        "suite": args.suite,
        "quick": args.quick,
    }
    if args.suite == "facenet1800":
        return measure_1800(args, report)
    cases = gpu_cases(args.quick) if args.suite == "gpu" else cpu_cases(args.quick)
    cases = [dataclasses.replace(case, device=device) for case in cases]
    report["cases"] = []
    for case in [] if args.only_search else cases:
        report["cases"].append(run_case(case))
        write_report(args.json, report)
    if args.pk_search:
        template = next(case for case in cases if case.batch == "pk")
        report["pk_search"] = search_largest_batch(template, args.pk_search)
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the suite and write the JSON report after each case."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = benchmark_parser(__doc__)
    add = parser.add_argument
    add(
        "--suite",
        choices=("cpu", "gpu", "facenet1800"),
        default="cpu",
        help="facenet1800: configs/facenet_1800.yaml as benchmarks/gpu_check.sh measures it",
    )
    add("--device", type=device_name, help="every case's device (default: cuda, GPU suite)")
    add("--pk-search", type=lambda text: [positive_int(v) for v in text.split(",")],
        help="P x K sizes, comma-separated: the largest two-pass batch that fits, with and "
        "without chunks (after the suite)")  # fmt: skip
    add("--only-search", action="store_true", help="skip the suite")
    return run_benchmark(parser, argv, lambda args: measure(args, argv))


if __name__ == "__main__":
    sys.exit(main())
