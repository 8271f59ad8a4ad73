#!/usr/bin/env python
"""Training step, side by side: the seed's loop, the two-pass step, the one-pass step.

Every variant trains the same initial network on the same batches with the same optimizer
(SGD, lr 1e-4, momentum 0.9), in its own forked process, so each gets its own peak resident
set size (``ru_maxrss`` of a forked child starts from what it maps at the fork). Measured per
variant: median step time over the timed steps (the first step is a warm-up), images per
second, peak graph bytes (:class:`facenet.memory.GraphMemoryMeter`, parameters and BatchNorm
buffers excluded, over every step: the seed loop's peak needs a second step, when the first
step's graphs are still alive), the graph bytes alive after the last step, peak RSS, and the
CUDA allocator's peak on a GPU.

Variants:

- ``seed``: ``benchmarks.seed_loop.seed_train_step``, the seed's loop ported faithfully (three
  grad forwards, the numpy filter, three ``forward_classifier`` passes, cross-entropy).
- ``two_pass``: ``Trainer(passes=2)``: a no-grad forward on the batch, the miner, one grad
  forward on the unique selected images (embeddings and logits from it).
- ``one_pass``: ``Trainer(passes=1)``: one grad forward on the whole batch.
- ``two_pass_chunked``: ``Trainer(passes=2, chunk_size=N)``: gradient caching.

Batches. Triplet mode (what the seed's loop eats): T triplets (3T images) of random images;
about 20% of each batch are hard by construction (see :func:`make_triplet_batches`). The
seed's own filter ``d(a,n) - d(a,p) < margin`` selects them; our steps use the same filter
(``TripletMarginMiner("all", distance="seed_l2", strict_margin=True)`` on the candidates) and
the same job (triplet loss + cross-entropy on the selected images). "sparse": a margin between
the hard and the easy triplets on the initial network, one for the seed's loop and one for our
steps (the seed's BatchNorm sees a, p and n as three batches, ours as one, so their embeddings
differ); the share each variant then selected is reported. "dense": margin 10, every triplet
passes. P x K mode: FaceNet's semi-hard mining over every anchor-positive pair, the triplet
loss alone; every image is selected.

Time. Each variant's own process times its steps (median after a warm-up step), but processes
run at different moments of a shared machine's load. So the ratios come from timing rounds in
one more process: each round runs one step of every variant (each on its own model) and each
part of the two-pass step alone, in a rotating order, on the same batch; each task's figure is
its fastest round (other jobs only ever add time).
The floor: the no-grad forward on the batch + the forward and backward on as many images as the
two-pass step selected; overhead = two-pass step / floor - 1. Also timed, outside the floor: the
optimizer step, a grad-mode forward on the batch (the one-pass step's), and the seed's
arithmetic (grad forwards on a, p and n apart, forward and backward on the selected images in
three parts), which bounds what two-pass can gain over the seed on the machine.

    python -m benchmarks.bench_training_step --json step.json       # CPU suite, ~3 min on 2 cores
    python -m benchmarks.bench_training_step --quick --json q.json   # seconds
    python -m benchmarks.bench_training_step --suite gpu --device cuda --json gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.forking import run_forked
from benchmarks.measure import (
    RSS_BEFORE_BYTES,
    memory_readings,
    metered_step,
    rss_before,
    seed_rule_parts,
    semihard_parts,
    timed,
    write_report,
)
from benchmarks.seed_loop import SeedModel, l2_dist, seed_train_step
from facenet.memory import (
    CUDA_MAX_ALLOCATED,
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    PEAK_RSS_BYTES,
    GraphMemoryMeter,
    reset_cuda_peaks,
)
from facenet.models.embedding import EmbeddingNet
from facenet.training.engine import Trainer
from facenet.training.step import frozen_bn_running_stats, unique_triplet_images

EMBEDDING_DIM = 128
NUM_CLASSES = 16  # triplet mode: labels of the classifier head
SPARSE_FRACTION = 0.2  # share of candidate triplets the sparse margin lets through
DENSE_MARGIN = 10.0  # unit embeddings: d(a,n) - d(a,p) >= -2 < 10, every triplet passes
PK_MARGIN = 0.2
POSITIVE_NOISE = 0.3  # positives = anchor + this x N(0, 1) in pixel space (images are N(0, 1))
LEARNING_RATE = 1e-4
VARIANTS = ("seed", "two_pass", "one_pass", "two_pass_chunked")
SELECTIONS = ("sparse", "dense")


@dataclass(frozen=True)
class Case:
    """One row group of the table: a model, a batch and the variants measured on it.

    Args:
        backbone: an ``EmbeddingNet`` backbone name.
        image_size: side of the square input images.
        batch: "triplets" (seed-style, 3T images) or "pk" (P identities x K images).
        selection: triplet mode: "sparse" or "dense"; P x K mode: "semihard".
        triplets: T, triplet mode.
        p, k: P x K mode.
        variants: which of :data:`VARIANTS` to run.
        repeats: timed steps per variant (after one warm-up step).
        chunk_size: images per chunk of ``two_pass_chunked``.
        device: "cpu" or "cuda".
        amp: "none" or "bf16" (autocast; the seed loop is wrapped in autocast).
        rounds: time the variants and the two-pass step's parts in rounds (the floor).
    """

    backbone: str
    image_size: int
    batch: str
    selection: str
    triplets: int = 0
    p: int = 0
    k: int = 0
    variants: tuple[str, ...] = ("seed", "two_pass", "one_pass")
    repeats: int = 3
    chunk_size: int = 0
    device: str = "cpu"
    amp: str = "none"
    rounds: bool = True

    @property
    def images_per_step(self) -> int:
        """Images in one batch: 3T or P x K."""
        return 3 * self.triplets if self.batch == "triplets" else self.p * self.k

    @property
    def name(self) -> str:
        """The label printed and written, e.g. ``resnet18 112px T=16 sparse``."""
        shape = f"T={self.triplets}" if self.batch == "triplets" else f"PxK={self.p}x{self.k}"
        amp = "" if self.amp == "none" else f" {self.amp}"
        return f"{self.backbone} {self.image_size}px {shape} {self.selection}{amp}"

    def as_dict(self) -> dict:
        """The fields and the name, JSON-ready."""
        return {**dataclasses.asdict(self), "name": self.name, "images": self.images_per_step}


# --------------------------------------------------------------------------- suites


def cpu_cases(quick: bool) -> list[Case]:
    """The CPU suite: the step on resnet18 and tiny, then the gradient-caching rows."""
    if quick:
        steps = [Case("tiny", 32, "triplets", sel, triplets=8, repeats=1) for sel in SELECTIONS]
        chunk_batches = [(8, 4), (16, 4)]
        chunk_size, chunk_repeats = 8, 1
    else:
        # resnet18 with T = 16: at 20%, about 3 triplets a step (with 1, the seed's
        # forward_classifier fails: BatchNorm1d in training mode needs more than one image).
        steps = [
            Case("resnet18", 112, "triplets", sel, triplets=16, repeats=6) for sel in SELECTIONS
        ] + [Case("tiny", 64, "triplets", sel, triplets=32, repeats=20) for sel in SELECTIONS]
        # FaceNet's batch was ~1,800 faces; K = 8 images per identity throughout.
        chunk_batches = [(32, 8), (64, 8), (225, 8)]
        chunk_size, chunk_repeats = 64, 6
    chunks = [
        Case(
            "tiny",
            32,
            "pk",
            "semihard",
            p=p,
            k=k,
            variants=("two_pass", "two_pass_chunked"),
            repeats=chunk_repeats,
            chunk_size=chunk_size,
        )
        for p, k in chunk_batches
    ]
    return steps + chunks


def gpu_cases() -> list[Case]:
    """The GPU suite: resnet50 at 160 px, 3 x 128 triplets and P x K = 256, fp32 and bf16."""
    cases = []
    for amp in ("none", "bf16"):
        cases += [
            Case("resnet50", 160, "triplets", sel, triplets=128, repeats=5, device="cuda", amp=amp)
            for sel in SELECTIONS
        ]
        cases.append(
            Case(
                "resnet50",
                160,
                "pk",
                "semihard",
                p=64,
                k=4,
                variants=("two_pass", "one_pass", "two_pass_chunked"),
                repeats=5,
                chunk_size=64,
                device="cuda",
                amp=amp,
            )
        )
    return cases


def override_cases(cases: list[Case], args: argparse.Namespace) -> list[Case]:
    """Apply the command line's --device/--backbone/--image-size/... to every case."""
    changes = {}
    if args.device:
        changes["device"] = args.device
    if args.backbone:
        changes["backbone"] = args.backbone
    if args.image_size:
        changes["image_size"] = args.image_size
    if args.repeats:
        changes["repeats"] = args.repeats
    out = []
    for case in cases:
        case = dataclasses.replace(case, **changes)
        if args.triplets and case.batch == "triplets":
            case = dataclasses.replace(case, triplets=args.triplets)
        if args.pk and case.batch == "pk":
            case = dataclasses.replace(case, p=args.pk[0], k=args.pk[1])
        if args.chunk_size and case.chunk_size:
            case = dataclasses.replace(case, chunk_size=args.chunk_size)
        out.append(case)
    return out


# --------------------------------------------------------------------------- forked children


# --------------------------------------------------------------------------- inputs


def make_triplet_batches(case: Case, count: int, seed: int = 0) -> list[tuple]:
    """``count`` seed-style batches ``(a, p, n, label_p, label_n)`` on the case's device.

    Anchors are N(0, 1) images. In an easy triplet the positive is the anchor plus
    ``POSITIVE_NOISE`` x N(0, 1) and the negative another random image, so d(a,n) - d(a,p) is
    large; in the :func:`hard_triplets_per_batch` hard ones, at random places, the two swap
    roles, so it is very negative. Any margin between the two groups then selects exactly the
    hard triplets of every batch, in every variant: the selected images are the same count
    each step (no new tensor shapes from step to step) and the seed's loop never sees a
    single selected triplet (its ``forward_classifier`` would then give BatchNorm1d one image).
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (case.triplets, 3, case.image_size, case.image_size)
    batches = []
    for _ in range(count):
        anchor = torch.randn(shape, generator=gen)
        positive = anchor + POSITIVE_NOISE * torch.randn(shape, generator=gen)
        negative = torch.randn(shape, generator=gen)
        hard = torch.randperm(case.triplets, generator=gen)[: hard_triplets_per_batch(case)]
        positive[hard], negative[hard] = negative[hard].clone(), positive[hard].clone()
        label_p = torch.randint(0, NUM_CLASSES, (case.triplets,), generator=gen)
        offset = torch.randint(1, NUM_CLASSES, (case.triplets,), generator=gen)
        label_n = (label_p + offset) % NUM_CLASSES
        batch = (anchor, positive, negative, label_p, label_n)
        batches.append(tuple(t.to(case.device) for t in batch))
    return batches


def hard_triplets_per_batch(case: Case) -> int:
    """round(20% of T), at least 2: the triplets of a batch made hard by construction."""
    return max(2, round(SPARSE_FRACTION * case.triplets))


def make_pk_batches(case: Case, count: int, seed: int = 0) -> list[tuple]:
    """``count`` batches ``(images (PK, 3, S, S), labels (PK,))`` of random images."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(case.p).repeat_interleave(case.k)  # (PK,)
    shape = (case.p * case.k, 3, case.image_size, case.image_size)
    return [
        (torch.randn(shape, generator=gen).to(case.device), labels.to(case.device))
        for _ in range(count)
    ]


def make_batches(case: Case) -> list[tuple]:
    """One distinct batch per step (warm-up included), the same in every variant."""
    count = case.repeats + 1
    if case.batch == "triplets":
        return make_triplet_batches(case, count)
    return make_pk_batches(case, count)


# --------------------------------------------------------------------------- models


def autocast(case: Case):
    """bf16 autocast on the case's device, or nothing."""
    if case.amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(case.device).type, dtype=torch.bfloat16)


def uses_classifier(case: Case) -> bool:
    """Triplet mode trains cross-entropy too (the seed's job); P x K mode the triplet loss only."""
    return case.batch == "triplets"


def build_network(case: Case) -> EmbeddingNet:
    """The network every variant of a case starts from (seeded: identical initial weights)."""
    torch.manual_seed(0)
    classes = NUM_CLASSES if uses_classifier(case) else None
    return EmbeddingNet(case.backbone, EMBEDDING_DIM, num_classes=classes)


def build_seed_model(case: Case) -> SeedModel:
    """The seed's ``FaceModel``: the same backbone and embedding, its own classifier."""
    torch.manual_seed(0)
    net = EmbeddingNet(case.backbone, EMBEDDING_DIM)
    return SeedModel(net, NUM_CLASSES).to(case.device)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The same optimizer for every variant."""
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=0.9)


def build_trainer(case: Case, variant: str, margin: float) -> Trainer:
    """A Trainer for ``variant`` ("two_pass", "one_pass", "two_pass_chunked")."""
    model = build_network(case)
    if case.batch == "triplets":
        miner, loss_fn = seed_rule_parts(margin)
    else:
        miner, loss_fn = semihard_parts(margin, seed=0)
    return Trainer(
        model,
        miner,
        loss_fn,
        make_optimizer(model),
        device=case.device,
        amp=case.amp,
        ce_weight=1.0 if uses_classifier(case) else 0.0,
        passes=1 if variant == "one_pass" else 2,
        chunk_size=case.chunk_size if variant == "two_pass_chunked" else 0,
        meter=GraphMemoryMeter(exclude=model),
    )


# --------------------------------------------------------------------------- calibration


def seed_filter_margins(model: SeedModel, batches: list[tuple]) -> torch.Tensor:
    """d(a,n) - d(a,p) of every candidate triplet, as the seed's loop computes it (count, T).

    Three separate forwards per batch in training mode (BatchNorm sees a, p and n apart, as in
    the seed), with no graph and the running statistics left alone.
    """
    margins = []  # one (T,) tensor per batch
    with torch.no_grad(), frozen_bn_running_stats(model):
        for data_a, data_p, data_n, _, _ in batches:
            out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)
            d_p = l2_dist.forward(out_a.float(), out_p.float())
            d_n = l2_dist.forward(out_a.float(), out_n.float())
            margins.append((d_n - d_p).cpu())
    return torch.stack(margins)  # (batches, T)


def step_filter_margins(model: EmbeddingNet, batches: list[tuple]) -> torch.Tensor:
    """d(a,n) - d(a,p) of every candidate triplet, as our steps' mining pass sees it (count, T).

    One no-grad forward on the concatenated (a, p, n) batch, as ``train_triplet_step`` runs it.
    """
    from facenet.metric.distances import get_distance

    distance = get_distance("seed_l2")
    margins = []  # one (T,) tensor per batch
    with torch.no_grad(), frozen_bn_running_stats(model):
        for data_a, data_p, data_n, _, _ in batches:
            out_a, out_p, out_n = model(torch.cat([data_a, data_p, data_n])).float().chunk(3)
            margins.append((distance.paired(out_a, out_n) - distance.paired(out_a, out_p)).cpu())
    return torch.stack(margins)  # (batches, T)


def margin_passing(margins: torch.Tensor, fraction: float) -> float:
    """A margin m such that exactly round(fraction x N) of ``margins`` satisfy ``tm < m``.

    Args:
        margins: (N,) values of d(a,n) - d(a,p).
        fraction: the share to let through, in (0, 1).
    """
    ordered = margins.double().sort().values  # (N,)
    count = max(1, min(len(ordered) - 1, round(fraction * len(ordered))))
    return float((ordered[count - 1] + ordered[count]) / 2)


def selection_margin(margins: torch.Tensor, case: Case) -> float:
    """The margin giving the case's selection: the hard share of ``margins`` (sparse, about
    20%) or every triplet (dense).

    Args:
        margins: (batches, T) values of d(a,n) - d(a,p).
        case: its ``selection`` and T.
    """
    if case.selection == "sparse":
        return margin_passing(margins.flatten(), hard_triplets_per_batch(case) / case.triplets)
    if case.selection == "dense":
        return DENSE_MARGIN
    raise ValueError(f"unknown selection {case.selection!r}; valid: {', '.join(SELECTIONS)}")


def calibrate(case: Case) -> dict:
    """The margins of a triplet-mode case: one for the seed's loop, one for our steps.

    The seed's BatchNorm sees a, p and n as three batches, ours as one, so their distances
    differ; each gets a margin that selects the case's share of the candidates on the initial
    network (the hard triplets, or all), so both do the same amount of work.
    """
    batches = make_batches(case)
    seed_model, network = build_seed_model(case), build_network(case).to(case.device)
    seed_model.train()
    network.train()
    with autocast(case):
        margins = {
            "seed": seed_filter_margins(seed_model, batches),
            "ours": step_filter_margins(network, batches),
        }
    result = {"candidates": int(margins["seed"].numel())}
    for kind, values in margins.items():
        margin = selection_margin(values, case)
        passing = values < margin  # (batches, T)
        result[f"margin_{kind}"] = margin
        result[f"pass_fraction_{kind}"] = float(passing.double().mean())
        result[f"passing_per_batch_{kind}"] = passing.sum(1).tolist()
    return result


# --------------------------------------------------------------------------- variants


def summarise_steps(case: Case, seconds: list[float], triplets: list[int], images: list[int]):
    """Median step time, images/s and the selection of the timed steps."""
    median = statistics.median(seconds)
    summary = {
        "step_seconds": seconds,
        "median_step_s": median,
        "images_per_s": case.images_per_step / median,
        "selected_triplets_mean": statistics.mean(triplets),
        "selected_images_mean": statistics.mean(images),
    }
    if case.batch == "triplets":
        summary["selected_fraction"] = statistics.mean(triplets) / case.triplets
    return summary


def measure_seed(case: Case, margin: float) -> dict:
    """The seed's loop: ``repeats + 1`` steps with its loop variables carried between them."""
    if case.batch != "triplets":
        raise ValueError("the seed loop takes (a, p, n) triplet batches only")
    batches = make_batches(case)
    model = build_seed_model(case)
    model.train()
    optimizer = make_optimizer(model)
    meter = GraphMemoryMeter(exclude=model)
    state: dict = {}  # the loop's variables: they outlive each iteration, as in the seed
    before = rss_before()
    reset_cuda_peaks(case.device)
    seconds, triplets, images = [], [], []

    def step(batch: tuple) -> dict:
        with autocast(case):
            return seed_train_step(model, optimizer, *batch, margin=margin, state=state)

    for index, batch in enumerate(batches):
        # The peak runs over every step: the seed's needs a second one (see the docstring).
        step_s, out = metered_step(meter, case.device, lambda b=batch: step(b))
        if index > 0:  # the first step is a warm-up
            seconds.append(step_s)
            triplets.append(out["n_selected"])
            images.append(3 * out["n_selected"])  # the seed runs forward_classifier on each
    readings = memory_readings(meter, case.device, rss=True)  # a forked child: its own RSS
    return {**summarise_steps(case, seconds, triplets, images), **before, **readings}


def run_trainer_step(trainer: Trainer, case: Case, batch: tuple) -> dict:
    """One step of our trainer on a triplet or P x K batch."""
    if case.batch == "triplets":
        return trainer.train_triplet_step(*batch)
    return trainer.train_step(*batch)


def measure_trainer(case: Case, variant: str, margin: float) -> dict:
    """Our step (two-pass, one-pass or chunked): ``repeats + 1`` steps."""
    batches = make_batches(case)
    trainer = build_trainer(case, variant, margin)
    trainer.model.train()
    before = rss_before()
    reset_cuda_peaks(case.device)
    seconds, triplets, images = [], [], []
    for index, batch in enumerate(batches):
        step_s, stats = metered_step(
            trainer.meter, case.device, lambda b=batch: run_trainer_step(trainer, case, b)
        )
        if index > 0:
            seconds.append(step_s)
            skipped = "skipped" in stats
            triplets.append(0 if skipped else int(stats["num_triplets"]))
            images.append(0 if skipped else int(stats["selected_images"]))
    readings = memory_readings(trainer.meter, case.device, rss=True)  # a forked child
    return {**summarise_steps(case, seconds, triplets, images), **before, **readings}


def measure_variant(case: Case, variant: str, margin: float) -> dict:
    """Dispatch one variant (runs in a forked child)."""
    if variant == "seed":
        return measure_seed(case, margin)
    if variant in ("two_pass", "one_pass", "two_pass_chunked"):
        return measure_trainer(case, variant, margin)
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")


# --------------------------------------------------------------------------- the floor


def batch_tensors(case: Case, batch: tuple):
    """(images (B, C, S, S), labels (B,), candidates or None) as the trainer's step sees them."""
    if case.batch != "triplets":
        return batch[0], batch[1], None
    data_a, data_p, data_n, label_p, label_n = batch
    index = torch.arange(case.triplets, device=data_a.device)
    candidates = (index, index + case.triplets, index + 2 * case.triplets)
    images = torch.cat([data_a, data_p, data_n])
    return images, torch.cat([label_p, label_p, label_n]), candidates


def floor_parts(trainer: Trainer, case: Case, batch: tuple, selected: torch.Tensor):
    """The parts of a step, each a callable: what the floor adds up, and what it leaves out.

    Args:
        trainer: its model, miner and optimizer are used.
        case: autocast and the classifier.
        batch: a batch of the case.
        selected: (U, C, S, S) as many images as the step selects.
    """
    model, with_logits = trainer.model, uses_classifier(case)
    images, labels, candidates = batch_tensors(case, batch)  # (B, C, S, S), (B,)
    with torch.no_grad(), autocast(case):
        embeddings = model(images).float()  # (B, D), for the miner alone

    def forward_backward(x, on=model):
        with autocast(case):
            out = on(x, return_logits=with_logits)
        outputs = out if with_logits else (out,)
        sum(o.float().sum() for o in outputs).backward()
        on.zero_grad(set_to_none=True)  # as the step does after its update

    # The update on a copy whose gradients stay: every timed call has all of them to apply.
    update_model = copy.deepcopy(model)
    with autocast(case):
        out = update_model(selected, return_logits=with_logits)
    sum(o.float().sum() for o in (out if with_logits else (out,))).backward()
    optimizer = make_optimizer(update_model)

    def nograd_forward():
        with torch.no_grad(), frozen_bn_running_stats(model), autocast(case):
            model(images)

    def selected_forward_backward():
        forward_backward(selected)

    def optimizer_step():
        optimizer.step()

    def mine():
        trainer.miner(embeddings, labels, candidates=candidates)

    def grad_forward():  # the one-pass step's forward on the batch (graph dropped)
        with autocast(case):
            model(images, return_logits=with_logits)

    def seed_parts():  # the seed's arithmetic: a, p, n apart with grad, the selected by thirds
        with autocast(case):
            for third in images.chunk(3):
                model(third)
        for third in selected.chunk(3):
            forward_backward(third)

    parts = {
        "nograd_forward_s": nograd_forward,
        "selected_forward_backward_s": selected_forward_backward,
        "optimizer_step_s": optimizer_step,
        "miner_s": mine,
        "grad_forward_s": grad_forward,
    }
    if "seed" in case.variants:
        parts["seed_parts_s"] = seed_parts
    return parts


def build_stepper(case: Case, variant: str, margin: float):
    """``step(batch)``: one training step of ``variant`` on its own model and optimizer."""
    if variant == "seed":
        model = build_seed_model(case)
        model.train()
        optimizer = make_optimizer(model)
        state: dict = {}  # carried between steps, as the seed's loop variables are

        def seed_step(batch):
            with autocast(case):
                return seed_train_step(model, optimizer, *batch, margin=margin, state=state)

        return seed_step
    trainer = build_trainer(case, variant, margin)
    trainer.model.train()
    return lambda batch: run_trainer_step(trainer, case, batch)


def round_order(names: list[str], round_index: int) -> list[str]:
    """``names`` rotated by the round number: no task always runs right after the same one."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def measure_rounds(case: Case, margins: dict, selected_images: int, variants: list[str]):
    """Every variant's step and the two-pass step's parts, timed in rounds in one process.

    Each round runs each task once, in a rotating order, on the same batch; each task's figure
    is its fastest round after the first (a warm-up): on a shared machine other jobs only add
    time, never remove it (timeit's rule). Tasks that share the rounds share the machine's load
    over the same minutes. Memory is not measured here (the variants' own processes do).

    Args:
        case: the case.
        margins: ``{"seed": m, "ours": m}`` from the calibration.
        selected_images: how many images the two-pass step selected (its mean, rounded).
        variants: the variants to time (those that ran in their own process).
    """
    batches = make_batches(case)
    images, _, _ = batch_tensors(case, batches[0])
    # (U, C, S, S): cost depends on U only. Own storages: a saved view would count the batch's.
    selected = images[: max(1, selected_images)].clone()
    parts_trainer = build_trainer(case, "two_pass", margins["ours"])
    parts_trainer.model.train()
    tasks = {
        f"{v}_step_s": build_stepper(case, v, margins["seed" if v == "seed" else "ours"])
        for v in variants
    }
    tasks.update(
        {
            name: (lambda batch, f=part: f())
            for name, part in floor_parts(parts_trainer, case, batches[0], selected).items()
        }
    )
    times: dict[str, list[float]] = {name: [] for name in tasks}
    for index in range(case.repeats + 1):
        batch = batches[index % len(batches)]
        for name in round_order(list(tasks), index):
            seconds, _ = timed(case.device, lambda t=tasks[name], b=batch: t(b))
            if index > 0:
                times[name].append(seconds)
    # Other jobs only ever add time: the fastest round is the closest to a task's own cost.
    rounds = {name: min(values) for name, values in times.items()}
    rounds["medians"] = {name: statistics.median(values) for name, values in times.items()}
    rounds["floor_s"] = rounds["nograd_forward_s"] + rounds["selected_forward_backward_s"]
    rounds["selected_images"] = int(selected.shape[0])
    rounds["rounds"] = case.repeats
    rounds.update(floor_graph_bytes(parts_trainer, case, batches[0], selected))
    return rounds


def forward_graph_bytes(model: torch.nn.Module, images: torch.Tensor, case: Case) -> int:
    """Graph bytes of one grad forward on ``images`` (embeddings and logits), then freed."""
    meter = GraphMemoryMeter(exclude=model)
    with meter, autocast(case):
        outputs = model(images, return_logits=uses_classifier(case))
        peak = meter.peak_bytes
        del outputs
    return int(peak)


def loss_graph_bytes(trainer: Trainer, case: Case, batch: tuple) -> int:
    """Graph bytes of the triplet loss on cached (U, D) embeddings, as gradient caching runs it.

    Mines the batch like a step, then computes the loss on a leaf copy of the selected
    embeddings: what the chunked step holds between the mining pass and the first chunk.
    """
    images, labels, candidates = batch_tensors(case, batch)
    with torch.no_grad(), frozen_bn_running_stats(trainer.model), autocast(case):
        embeddings = trainer.model(images).float()  # (B, D)
    triplets = trainer.miner(embeddings, labels, candidates=candidates)
    unique, local = unique_triplet_images(triplets)
    cached = embeddings[unique].clone().requires_grad_(True)  # (U, D)
    meter = GraphMemoryMeter()
    with meter:
        loss = trainer.loss_fn(cached, local)
        peak = meter.peak_bytes
        del loss
    return int(peak)


def floor_graph_bytes(trainer: Trainer, case: Case, batch: tuple, selected: torch.Tensor):
    """Graph bytes of a grad forward on the selected images, on one chunk, and of the loss."""
    model = trainer.model
    figures = {"selected_forward_graph_bytes": forward_graph_bytes(model, selected, case)}
    if case.chunk_size:
        chunk = selected[: case.chunk_size].clone()
        figures["chunk_forward_graph_bytes"] = forward_graph_bytes(model, chunk, case)
        figures["loss_graph_bytes"] = loss_graph_bytes(trainer, case, batch)
    return figures


# --------------------------------------------------------------------------- gradient caching


def probe_chunking() -> dict:
    """Whether ``Trainer(chunk_size=N)`` works and lowers the peak (forked child, < 1 s).

    A tiny P x K step with chunks of 4 must run and peak below 3/4 of the unchunked step.
    """
    case = Case("tiny", 32, "pk", "semihard", p=4, k=4, repeats=1, chunk_size=4, rounds=False)
    try:
        chunked = measure_trainer(case, "two_pass_chunked", PK_MARGIN)
    except (TypeError, NotImplementedError) as err:
        return {"available": False, "reason": f"{type(err).__name__}: {err}"}
    plain = measure_trainer(case, "two_pass", PK_MARGIN)
    if chunked[GRAPH_BYTES_PEAK] >= 0.75 * plain[GRAPH_BYTES_PEAK]:
        return {
            "available": False,
            "reason": "Trainer(chunk_size=4) ran but its peak graph bytes did not fall "
            f"({chunked[GRAPH_BYTES_PEAK]} vs {plain[GRAPH_BYTES_PEAK]} unchunked)",
        }
    return {"available": True, "reason": ""}


# --------------------------------------------------------------------------- one case


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def case_ratios(variants: dict, rounds: dict | None) -> dict:
    """The ratios the targets are stated in: memory from the variants' own processes, time
    from the rounds (:func:`measure_rounds`)."""

    def value(variant: str, key: str):
        row = variants.get(variant) or {}
        return None if "error" in row else row.get(key)

    ratios = {
        "graph_peak_two_pass_vs_seed": ratio(
            value("two_pass", GRAPH_BYTES_PEAK), value("seed", GRAPH_BYTES_PEAK)
        ),
        "graph_peak_one_pass_vs_seed": ratio(
            value("one_pass", GRAPH_BYTES_PEAK), value("seed", GRAPH_BYTES_PEAK)
        ),
        "graph_peak_chunked_vs_two_pass": ratio(
            value("two_pass_chunked", GRAPH_BYTES_PEAK), value("two_pass", GRAPH_BYTES_PEAK)
        ),
    }
    if rounds and "error" not in rounds:
        # Throughput = the inverse ratio of step times timed in the same rounds (same load).
        two_pass = rounds.get("two_pass_step_s")
        ratios.update(
            throughput_two_pass_vs_seed=ratio(rounds.get("seed_step_s"), two_pass),
            throughput_one_pass_vs_seed=ratio(
                rounds.get("seed_step_s"), rounds.get("one_pass_step_s")
            ),
            throughput_chunked_vs_two_pass=ratio(two_pass, rounds.get("two_pass_chunked_step_s")),
            two_pass_overhead_above_floor=None
            if two_pass is None
            else two_pass / rounds["floor_s"] - 1.0,
            seed_step_vs_floor=ratio(rounds.get("seed_step_s"), rounds["floor_s"]),
            # The two-pass / seed throughput that the arithmetic alone allows on this machine.
            seed_parts_vs_floor=ratio(rounds.get("seed_parts_s"), rounds["floor_s"]),
            graph_peak_chunked_vs_one_chunk=ratio(
                value("two_pass_chunked", GRAPH_BYTES_PEAK),
                rounds.get("chunk_forward_graph_bytes"),
            ),
        )
    return {key: val for key, val in ratios.items() if val is not None}


def run_case(case: Case, chunking: dict) -> dict:
    """Calibrate, run every variant in its own child (memory, selection), then the timing
    rounds in another; ratios at the end."""
    result: dict = {"case": case.as_dict(), "variants": {}}
    if case.batch == "triplets":
        calibration = run_forked(calibrate, case)
        result["calibration"] = calibration
        if "error" in calibration:
            return result
        margins = {"seed": calibration["margin_seed"], "ours": calibration["margin_ours"]}
    else:
        margins = {"seed": PK_MARGIN, "ours": PK_MARGIN}
    result["margins"] = margins
    for variant in case.variants:
        if variant == "two_pass_chunked" and not chunking["available"]:
            result["variants"][variant] = {
                "error": "not available: " + chunking["reason"],
                "not_available": True,
            }
            continue
        margin = margins["seed" if variant == "seed" else "ours"]
        result["variants"][variant] = run_forked(measure_variant, case, variant, margin)
    ran = [name for name, row in result["variants"].items() if "error" not in row]
    two_pass = result["variants"].get("two_pass") or {}
    if case.rounds and "selected_images_mean" in two_pass:
        selected = round(two_pass["selected_images_mean"])
        result["rounds"] = run_forked(measure_rounds, case, margins, selected, ran)
        for name in ran:  # images/s in the rounds, next to the variant's own figures
            step_s = result["rounds"].get(f"{name}_step_s")
            if step_s:
                result["variants"][name]["rounds_step_s"] = step_s
                result["variants"][name]["rounds_images_per_s"] = case.images_per_step / step_s
    result["ratios"] = case_ratios(result["variants"], result.get("rounds"))
    return result


# --------------------------------------------------------------------------- largest batch


def try_batch(case: Case) -> dict:
    """One two-pass step on a P x K batch: did it fit? (forked child)"""
    variant = "two_pass_chunked" if case.chunk_size else "two_pass"
    result = measure_trainer(dataclasses.replace(case, rounds=False), variant, PK_MARGIN)
    return {key: result[key] for key in ("median_step_s", GRAPH_BYTES_PEAK)} | {
        key: result[key] for key in (CUDA_MAX_ALLOCATED,) if key in result
    }


def search_largest_batch(template: Case, sizes: list[int], chunking: dict) -> list[dict]:
    """For each chunk setting, the P x K sizes (K fixed) tried in order until one fails."""
    rows = []
    settings = [0] + ([template.chunk_size] if chunking["available"] else [])
    for chunk_size in settings:
        for size in sizes:
            case = dataclasses.replace(
                template,
                p=size // template.k,
                repeats=1,
                chunk_size=chunk_size,
            )
            outcome = run_forked(try_batch, case)
            rows.append({"batch": case.p * case.k, "chunk_size": chunk_size, **outcome})
            print(
                f"  P x K = {case.p * case.k:>5}, chunk {chunk_size:>3}: "
                + ("fits" if "error" not in outcome else outcome["error"][:90]),
                flush=True,
            )
            if "error" in outcome:
                break
    return rows


# --------------------------------------------------------------------------- report


def describe_machine(device: str) -> dict:
    """CPU model, cores, torch version, threads, load, and the GPU when one is used."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    machine = {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": os.getloadavg()[0],
    }
    if torch.device(device).type == "cuda":
        machine["gpu"] = run_forked(_gpu_name).get("name", "unknown")
    return machine


def _gpu_name() -> dict:
    return {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}"


def print_case(result: dict) -> None:
    """One case's rows: per variant, time, images/s, selection, graph and RSS figures."""
    case = result["case"]
    calibration = result.get("calibration") or {}
    head = f"== {case['name']}  ({case['batch']}, {case['images']} images/step"
    for kind in ("seed", "ours"):
        if f"margin_{kind}" in calibration:
            head += (
                f"; {kind}: margin {calibration[f'margin_{kind}']:.4g} passes "
                f"{calibration[f'pass_fraction_{kind}']:.1%}"
            )
    print(head + ")", flush=True)
    print(
        f"   {'variant':<18}{'step s':>8}{'img/s':>9}{'selected':>10}{'graph MiB':>11}"
        f"{'alive':>7}{'RSS MiB':>9}{'+RSS':>8}{'CUDA MiB':>10}"
    )
    for name, row in result["variants"].items():
        if "error" in row:
            print(f"   {name:<18}{row['error'][:100]}")
            continue
        selected = row.get("selected_fraction")
        if selected is None:
            selected = f"{row['selected_images_mean']:.0f}"
        else:
            selected = f"{selected:.0%}"
        print(
            f"   {name:<18}{row['median_step_s']:>8.3f}{row['images_per_s']:>9.1f}{selected:>10}"
            f"{_mib(row[GRAPH_BYTES_PEAK]):>11}{_mib(row[GRAPH_BYTES_ALIVE]):>7}"
            f"{_mib(row[PEAK_RSS_BYTES]):>9}"
            f"{_mib(row[PEAK_RSS_BYTES] - row[RSS_BEFORE_BYTES]):>8}"
            f"{_mib(row.get(CUDA_MAX_ALLOCATED)):>10}"
        )
    rounds = result.get("rounds") or {}
    if "floor_s" in rounds:
        steps = ", ".join(
            f"{name} {rounds[name + '_step_s']:.3f} s"
            for name in VARIANTS
            if name + "_step_s" in rounds
        )
        print(
            f"   rounds: {steps}; floor: no-grad forward {rounds['nograd_forward_s']:.3f} s + "
            f"forward/backward on {rounds['selected_images']} images "
            f"{rounds['selected_forward_backward_s']:.3f} s = {rounds['floor_s']:.3f} s "
            f"(optimizer step {rounds['optimizer_step_s']:.3f} s, miner {rounds['miner_s']:.3f} s, "
            f"grad forward on the batch "
            f"{rounds['grad_forward_s']:.3f} s"
            + (
                f", the seed's arithmetic {rounds['seed_parts_s']:.3f} s)"
                if "seed_parts_s" in rounds
                else ")"
            )
        )
    elif "error" in rounds:
        print(f"   rounds: {rounds['error']}")
    for key, value in result.get("ratios", {}).items():
        print(f"   {key}: {value:.3f}")


def finish_report(path: Path | None, report: dict, started: float) -> None:
    """Total time and the load at the end into the report; write it; say so."""
    report["seconds_total"] = time.perf_counter() - started
    report["load_average_after"] = os.getloadavg()[0]
    write_report(path, report)
    print(f"total {report['seconds_total']:.0f} s")
    if path:
        print(f"wrote {path}")


# --------------------------------------------------------------------------- main


def parse_pk(text: str) -> tuple[int, int]:
    """``"64x4"`` -> (64, 4)."""
    try:
        p, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pk {text!r}: expected PxK, e.g. 64x4") from None
    if p < 2 or k < 2:
        raise argparse.ArgumentTypeError(f"--pk {text!r}: P and K must be at least 2")
    return p, k


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny model, small batches")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--device", default=None, help="override every case's device")
    parser.add_argument("--backbone", default=None, help="override every case's backbone")
    parser.add_argument("--image-size", type=int, default=0, help="override the image size")
    parser.add_argument("--triplets", type=int, default=0, help="override T (triplet mode)")
    parser.add_argument("--pk", type=parse_pk, default=None, help="override P x K, e.g. 64x4")
    parser.add_argument("--chunk-size", type=int, default=0, help="override the chunk size")
    parser.add_argument("--repeats", type=int, default=0, help="override the timed steps")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument(
        "--pk-search",
        type=lambda s: [int(v) for v in s.split(",")],
        default=None,
        help="comma-separated P x K sizes: find the largest two-pass batch that fits, with and "
        "without chunks (after the suite)",
    )
    parser.add_argument("--only-search", action="store_true", help="skip the suite")
    parser.add_argument(
        "--only-case",
        action="append",
        default=[],
        help="run only the cases whose name contains this text (repeatable)",
    )
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot run, with the flag named."""
    if sys.platform != "linux":
        raise SystemExit("bench_training_step.py: Linux only (fork, /proc)")
    device = args.device or ("cuda" if args.suite == "gpu" else "cpu")
    if device.startswith("cuda") and not run_forked(_cuda_available)["available"]:
        raise SystemExit(f"--device {device}: torch sees no CUDA device")
    for flag in ("image_size", "triplets", "chunk_size", "repeats", "threads"):
        if getattr(args, flag) < 0:
            raise SystemExit(f"--{flag.replace('_', '-')} must be positive")


def _cuda_available() -> dict:
    return {"available": torch.cuda.is_available()}


def main(argv: list[str] | None = None) -> int:
    """Run the suite; print the tables; write the JSON report."""
    args = get_args_parser().parse_args(argv)
    check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)  # inherited by every forked child
    cases = cpu_cases(args.quick) if args.suite == "cpu" else gpu_cases()
    cases = override_cases(cases, args)
    if args.only_case:
        cases = [c for c in cases if any(text in c.name for text in args.only_case)]
        if not cases:
            raise SystemExit(f"--only-case {args.only_case}: no case of the suite matches")
    device = cases[0].device
    report: dict = {
        "benchmark": "bench_training_step",
        "suite": args.suite,
        "quick": args.quick,
        "command": "python -m benchmarks.bench_training_step " + " ".join(argv or sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": describe_machine(device),
        "cases": [],
    }
    started = time.perf_counter()
    report["chunking"] = run_forked(probe_chunking)
    if "error" in report["chunking"]:
        report["chunking"] = {"available": False, "reason": report["chunking"]["error"]}
    print(
        f"torch {torch.__version__}, {report['machine']['cpu_count']} CPUs "
        f"({report['machine']['cpu_model']}), load {report['machine']['load_average']:.2f}; "
        f"gradient caching: {'available' if report['chunking']['available'] else 'not available'}"
        f"{'' if report['chunking']['available'] else ' (' + report['chunking']['reason'] + ')'}",
        flush=True,
    )
    if not args.only_search:
        for case in cases:
            result = run_case(case, report["chunking"])
            print_case(result)
            report["cases"].append(result)
            report["seconds_total"] = time.perf_counter() - started
            write_report(args.json, report)
    if args.pk_search:
        template = next(c for c in cases if c.batch == "pk")
        print(f"largest P x K (K = {template.k}) on {template.backbone} {template.image_size}px:")
        report["pk_search"] = search_largest_batch(template, args.pk_search, report["chunking"])
    finish_report(args.json, report, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
