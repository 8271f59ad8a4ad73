"""Memory report: what the seed's loop and the corrected steps hold, measured on one batch.

Runs a few steps of the seed loop's port (``seed``), of the two-pass and one-pass steps on the
same 3T images through ``Trainer.train_triplet_step`` with the seed's selection rule and
(unless ``--pk 0``) on them as a P x K batch with semi-hard mining (``*_pk``). Per variant:
graph bytes alive after a step and at its peak, state bytes, step time, the CUDA allocator's
figures; then the seed loop's per-line timeline and what frees a graph (docs/memory.md).
``--plot``: a chart of what the seed loop and the two-pass step hold after each phase of their
last step. A line on stderr says which measurement runs.

    python -m benchmarks.memory_report --backbone tiny --image-size 64 --json report.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from benchmarks import seed_loop
from benchmarks.measure import (
    benchmark_parser,
    output_path,
    positive_float,
    timed,
    write_report,
)
from facenet.cli.common import parse_device, positive_int
from facenet.errors import FacenetError
from facenet.files import json_safe
from facenet.memory import (
    CUDA_ALLOCATED,
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    CUDA_RESERVED,
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    GraphMemoryMeter,
    graph_bytes_by_variable,
    memory_figures,
    module_state_bytes,
    reset_cuda_peaks,
)
from facenet.metric.losses import TripletMarginLoss
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.metric.triplet_margin_miner import TripletMarginMiner
from facenet.models.backbones import BACKBONES
from facenet.models.embedding import EmbeddingNet
from facenet.sizes import ImageSize, image_hw, plain_size
from facenet.training.engine import Trainer, TrainerSettings
from facenet.training.step import build_step

# Every variant has these keys; CUDA_KEYS too on a CUDA device.
REQUIRED_KEYS = (
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "step_seconds",
)
CUDA_KEYS = (CUDA_MAX_ALLOCATED, CUDA_ALLOCATED, CUDA_RESERVED, CUDA_MAX_RESERVED)
CONFIG_KEYS = ("backbone", "image_size", "batch_size", "steps", "margin", "seed", "embedding_dim")
CONFIG_KEYS += ("optimizer", "lr")

# The phases of a step the chart shows, each with the seed loop's line it is read after; the
# Trainer's step marks them from hooks (PhaseRecorder.watch).
SEED_PHASES = {
    "start of step": "for batch_idx, (data_a, data_p, data_n,label_p,label_n) in pbar:",
    "after mining forward": "out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)",
    "after mining": "hard_triplets = np.where(all == 1)",
    "after training forward": "cls_n = model.forward_classifier(selected_data_n)",
    "after backward": "loss.backward()",
    "after optimizer step": "optimizer.step()",
    "end of step": "labels.append(np.ones(dists.size(0)))  # end of the loop body",
}
# What a phase holds, in the chart's stacking order: figure key -> legend.
HELD = {
    "param_bytes": "parameters",
    "optimizer_state_bytes": "optimizer state",
    "grad_bytes": "gradients",
    GRAPH_BYTES_ALIVE: "graphs (tensors saved for backward)",
}


def image_size_arg(text: str) -> int | list[int]:
    """``64`` (square) or ``112x96`` (H x W), as ``data.image_size`` stores it."""
    try:
        sides = [int(part) for part in text.lower().replace(",", "x").split("x")]
        return plain_size(sides[0] if len(sides) == 1 else sides)
    except ValueError:
        message = f"{text!r}: expected a positive integer or HxW (e.g. 112x96)"
        raise argparse.ArgumentTypeError(message) from None


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m benchmarks.memory_report``."""
    parser = benchmark_parser(__doc__, quick=False)
    parser.prog = "python -m benchmarks.memory_report"
    add = parser.add_argument
    add("--backbone", choices=BACKBONES, default="tiny")
    add("--image-size", type=image_size_arg, default=64, help="S, or HxW (e.g. 112x96)")
    add("--batch-size", type=positive_int, default=8, help="T triplets per batch: 3T images")
    add("--steps", type=positive_int, default=3, help="steps per variant")
    add("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add("--margin", type=positive_float, default=0.2, help="selection and loss margin")
    add("--seed", type=int, default=0, help="seed of the weights and images")
    add("--embedding-dim", type=positive_int, default=128)
    add("--num-classes", type=positive_int, default=10, help="classifier size")
    add("--optimizer", choices=("adagrad", "adam", "sgd"), default="adagrad")
    add("--lr", type=positive_float, default=0.01)
    add("--pk", type=int, default=3, help="K images per identity of the P x K rows; 0: none")
    add(
        "--snapshot",
        type=output_path,
        help="CUDA: the allocator's history during the seed loop, for https://pytorch.org/memory_viz",
    )
    add("--memory-summary", action="store_true", help="CUDA: print torch.cuda.memory_summary")
    add("--plot", type=output_path, help="PNG: what each phase of a step holds, seed vs ours")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check; a bad value exits naming its flag. Adds ``identities`` (P, 0 without
    P x K rows) and ``classes`` (at least P, so that every P x K label has a class)."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    images = 3 * args.batch_size
    errors = {
        "--steps": (args.steps < 2, "at least 2: the seed loop's graphs reach into the next step"),
        "--num-classes": (args.num_classes < 2, "negatives need at least 2 classes"),
        "--pk": (
            args.pk < 0 or (args.pk and (args.pk < 2 or images % args.pk)),
            f"K must be 0 (none) or at least 2 and divide the 3 x --batch-size = {images} "
            "images of a batch",
        ),
    }
    for flag, (failed, why) in errors.items():
        if failed:
            parser.error(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}: {why}")
    try:
        args.device = parse_device(args.device)
    except FacenetError as err:
        parser.error(str(err))
    if args.device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: only cpu and cuda are measured")
    if (args.snapshot or args.memory_summary) and args.device.type != "cuda":
        parser.error("--snapshot and --memory-summary need a CUDA --device")
    args.identities = images // args.pk if args.pk else 0
    args.classes = max(args.num_classes, args.identities)
    return args


def make_triplet_batches(
    steps: int, batch_size: int, image_size: ImageSize, num_classes: int, seed: int
) -> list[tuple[torch.Tensor, ...]]:
    """Seeded ``(data_a, data_p, data_n, label_p, label_n)``: (T, 3, H, W) images each, labels
    in ``0..num_classes-1`` with ``label_n != label_p``."""
    generator = torch.Generator().manual_seed(seed)
    height, width = image_hw(image_size)
    batches = []
    for _ in range(steps):
        a, p, n = (torch.randn(batch_size, 3, height, width, generator=generator) for _ in "apn")
        label_p = torch.randint(0, num_classes, (batch_size,), generator=generator)
        offset = torch.randint(1, num_classes, (batch_size,), generator=generator)
        batches.append((a, p, n, label_p, (label_p + offset) % num_classes))
    return batches


def build_network(args, classes: int | None) -> EmbeddingNet:
    """The seeded network: the same initial weights in every variant. ``args``: this module's
    options, or any object with ``backbone``, ``image_size``, ``embedding_dim``, ``seed`` (and
    ``device``, ``margin`` for the two functions below), as the training-step benchmark's case."""
    torch.manual_seed(args.seed)
    size = image_hw(args.image_size)
    return EmbeddingNet(args.backbone, args.embedding_dim, num_classes=classes, input_size=size)


def build_seed_model(args, classes: int) -> seed_loop.SeedModel:
    """The seed's ``FaceModel`` on the seeded network, in training mode on ``args.device``."""
    return seed_loop.SeedModel(build_network(args, None), classes).to(args.device).train()


def seed_rule_parts(margin: float) -> tuple[TripletMarginMiner, TripletMarginLoss]:
    """The seed's selection (``d(a,n) - d(a,p) < margin`` on its distance) and its mean
    triplet loss: what the corrected step runs on triplet batches."""
    miner = TripletMarginMiner(
        margin=margin, type_of_triplets="all", distance="seed_l2", strict_margin=True
    )
    return miner, TripletMarginLoss(margin=margin, distance="seed_l2", reduction="mean")


def semihard_parts(margin: float, seed: int = 0) -> tuple[SemiHardNegativeMiner, TripletMarginLoss]:
    """FaceNet's semi-hard mining and the triplet loss, squared distance: P x K batches;
    ``seed`` seeds the miner's random negative choices."""
    generator = torch.Generator().manual_seed(seed)
    miner = SemiHardNegativeMiner(margin=margin, distance="squared", generator=generator)
    return miner, TripletMarginLoss(margin=margin, distance="squared")


def build_trainer(args, network: EmbeddingNet, optimizer, pk: bool, **settings) -> Trainer:
    """A Trainer with a graph meter: the seed's selection rule and loss or, ``pk``, semi-hard
    mining (``settings``: ``build_step``'s keywords)."""
    miner, loss_fn = semihard_parts(args.margin, args.seed) if pk else seed_rule_parts(args.margin)
    step = build_step(network.to(args.device), miner, loss_fn, **settings)
    return Trainer(step, optimizer, settings=TrainerSettings(graph_memory=True))


def selection(result: dict) -> tuple[int, int]:
    """``(triplets, images)`` a step trained on, from the seed loop's result (its classifier
    forwards the three images of each triplet) or a Trainer's statistics."""
    if "n_selected" in result:
        return result["n_selected"], 3 * result["n_selected"]
    return (0, 0) if "skipped" in result else (result["num_triplets"], result["selected_images"])


def count_hooks(module: torch.nn.Module, optimizer) -> tuple[dict[str, int], list]:
    """``(counts, hook handles)``: images entering ``module`` (first argument, (N, ...)) with
    and without grad, and the most gradient bytes alive when ``optimizer.step()`` started."""
    counts = {"with_grad": 0, "no_grad": 0, "grad_bytes_at_optimizer_step": 0}

    def forward(module, inputs: tuple) -> None:
        counts["with_grad" if torch.is_grad_enabled() else "no_grad"] += inputs[0].shape[0]

    def optimizer_step(optimizer, args, kwargs) -> None:
        grads = (p.grad for group in optimizer.param_groups for p in group["params"])
        alive = sum(g.nbytes for g in grads if g is not None)
        counts["grad_bytes_at_optimizer_step"] = max(counts["grad_bytes_at_optimizer_step"], alive)

    hooks = [module.register_forward_pre_hook(forward)]
    return counts, [*hooks, optimizer.register_step_pre_hook(optimizer_step)]


def say(message: str) -> None:
    """One progress line on stderr (stdout may carry the JSON report), shown at once."""
    print(f"memory report: {message}", file=sys.stderr, flush=True)


class PhaseRecorder:
    """``mark(label)`` appends to ``rows`` what a step holds at that point, in bytes: the
    parameters, optimizer state and gradients of ``model``, and the graphs ``meter`` counts.
    The seed loop calls it as its meter after every ported line; the Trainer's step through
    the hooks of :meth:`watch`."""

    def __init__(self, meter: GraphMemoryMeter, model: torch.nn.Module, optimizer):
        self.meter, self.model, self.optimizer = meter, model, optimizer
        self.rows: list[dict[str, Any]] = []

    def mark(self, label: str) -> None:
        held = module_state_bytes(self.model, self.optimizer)
        self.meter.mark(label)
        self.rows.append({"phase": label, **held, GRAPH_BYTES_ALIVE: self.meter.alive_bytes})

    def watch(self, network: torch.nn.Module) -> list:
        """Hook handles marking a two-pass step's phases: its no-grad forward of ``network``
        is the mining one, the grad forward starts once mining is done, and the optimizer's
        step follows backward."""

        def before_forward(module, inputs) -> None:
            if torch.is_grad_enabled():
                self.mark("after mining")

        def after_forward(module, inputs, output) -> None:
            training = torch.is_grad_enabled()
            self.mark("after training forward" if training else "after mining forward")

        optimizer = self.optimizer
        return [
            network.register_forward_pre_hook(before_forward),
            network.register_forward_hook(after_forward),
            optimizer.register_step_pre_hook(lambda *_: self.mark("after backward")),
            optimizer.register_step_post_hook(lambda *_: self.mark("after optimizer step")),
        ]

    def phases(self, lines: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """The rows of :data:`HELD` figures, named by phase; ``lines``: phase -> the label
        marked after it (default: the phase itself). A phase the step did not reach is left
        out (a seed step that selected nothing)."""
        by_label = {row["phase"]: row for row in self.rows}
        lines = lines or {phase: phase for phase in SEED_PHASES}
        return [
            {"phase": phase, **{key: by_label[label][key] for key in HELD}}
            for phase, label in lines.items()
            if label in by_label
        ]


def measure_steps(
    device,
    batches: Sequence[tuple],
    step: Callable[[tuple], dict],
    model,
    optimizer,
    meter: GraphMemoryMeter,
) -> dict[str, Any]:
    """``step`` on each batch under ``meter`` (which counts across steps, so that graphs a step
    leaves behind are seen in the next; each step's peak starts from what the last one left):
    peaks over the steps, what the last one left, the state's bytes, and ``per_step``.
    ``step_seconds``: the median after the first step."""
    network = getattr(model, "model", model)  # a SeedModel wraps the EmbeddingNet
    counts, hooks = count_hooks(network.backbone, optimizer)
    per_step = []
    for batch in batches:
        with_grad, no_grad = counts["with_grad"], counts["no_grad"]
        reset_cuda_peaks(device)
        with meter:
            meter.reset_peak()
            seconds, result = timed(device, lambda b=batch: step(b))
        triplets, images = selection(result)
        # Every variant shares this process: its peak RSS would mix them, so it is left out.
        per_step.append(
            {
                **memory_figures(meter, torch.device(device), rss=False, cuda_now=True),
                "step_seconds": seconds,
                "images_forwarded_with_grad": counts["with_grad"] - with_grad,
                "images_forwarded_no_grad": counts["no_grad"] - no_grad,
                "selected_triplets": int(triplets),
                "selected_images": int(images),
            }
        )
    for hook in hooks:
        hook.remove()
    figures: dict[str, Any] = {
        **module_state_bytes(model, optimizer),  # grad_bytes: gradients left after the step
        "grad_bytes_at_optimizer_step": counts["grad_bytes_at_optimizer_step"],
        "step_seconds": statistics.median(s["step_seconds"] for s in per_step[1:]),
    }
    for key in per_step[0]:  # peaks over the steps, what the last one left, means of counts
        if key in (GRAPH_BYTES_PEAK, CUDA_MAX_ALLOCATED, CUDA_MAX_RESERVED):
            figures[key] = max(s[key] for s in per_step)
        elif key in (GRAPH_BYTES_ALIVE, CUDA_ALLOCATED, CUDA_RESERVED):
            figures[key] = per_step[-1][key]
        elif key != "step_seconds":
            figures[key] = statistics.mean(s[key] for s in per_step)
    return {**figures, "per_step": per_step}


def measure_seed(
    args: argparse.Namespace, batches: Sequence[tuple]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The seed loop's port, its loop variables carried between steps: its figures, and the
    last step's timeline with the graph bytes each loop variable keeps alive after it."""
    model = build_seed_model(args, args.classes)
    optimizer = seed_loop.create_optimizer(model, name=args.optimizer, lr=args.lr)
    meter, state = GraphMemoryMeter(exclude=model), {}
    recorder = PhaseRecorder(meter, model, optimizer)

    def run_step(batch: tuple) -> dict:
        meter.clear_timeline()  # the last step's timeline and phases only
        recorder.rows.clear()
        return seed_loop.seed_train_step(
            model, optimizer, *batch, margin=args.margin, state=state, meter=recorder
        )

    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    figures = measure_steps(args.device, batches, run_step, model, optimizer, meter)
    figures["phases"] = recorder.phases(SEED_PHASES)
    if args.snapshot:
        args.snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(args.snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    alive = [alive for _, alive in meter.timeline]
    holders = {k: v for k, v in state.items() if getattr(v, "grad_fn", None) is not None}
    if getattr(model, "features", None) is not None:  # kept on the module, as the original did
        holders["model.features"] = model.features
    timeline = {
        "step": len(batches),
        "lines": [
            {"line": label, "alive_bytes": now, "change_bytes": now - before}
            for (label, now), before in zip(meter.timeline, alive[:1] + alive)
        ],
        "held_by_variable": graph_bytes_by_variable(holders),  # 0: freed by backward
        "alive_after_step": meter.alive_bytes,
        "peak": meter.peak_bytes,
    }
    del holders
    state.clear()  # the loop's variables go, and their graphs with them
    figures["graph_bytes_after_loop_variables_deleted"] = meter.alive_bytes
    return figures, timeline


def measure_trainer(
    args: argparse.Namespace, batches: Sequence[tuple], passes: int, pk: bool = False
) -> dict[str, Any]:
    """The Trainer's step with the seed loop's model, classifier and optimizer and
    cross-entropy weight 1 (the seed's ``loss = ce + triplet``); ``pk``: the batch's 3T
    images as P x K identities with semi-hard mining, instead of the seed's rule. A two-pass
    step's figures have the ``phases`` of its last step."""
    network = build_network(args, args.classes).to(args.device)
    optimizer = seed_loop.create_optimizer(network, name=args.optimizer, lr=args.lr)
    trainer = build_trainer(args, network, optimizer, pk, passes=passes, ce_weight=1.0)
    network.train()
    labels = torch.arange(args.identities).repeat_interleave(args.pk or 1)  # (3T,) when pk
    recorder = PhaseRecorder(trainer.meter, network, optimizer)
    hooks = recorder.watch(network) if passes == 2 else []

    def run_step(batch: tuple) -> dict:
        recorder.rows.clear()  # the last step's phases only
        recorder.mark("start of step")
        if pk:
            result = trainer.train_step(torch.cat(batch[:3]), labels)  # (3T, 3, H, W)
        else:
            result = trainer.train_triplet_step(*batch)
        recorder.mark("end of step")
        return result

    figures = measure_steps(args.device, batches, run_step, network, optimizer, trainer.meter)
    for hook in hooks:
        hook.remove()
    return {**figures, "phases": recorder.phases()} if hooks else figures


def graph_lifecycle(args: argparse.Namespace, images: torch.Tensor) -> dict[str, Any]:
    """Graph bytes alive after one grad forward of ``images`` (N, 3, H, W), after its
    backward, after ``del`` of an output never backpropagated, with ``retain_graph=True``,
    under ``no_grad`` and ``inference_mode``; the peak when a variable is rebound to a new
    forward's output, without and with ``del`` first; what a second backward raises."""
    model = build_network(args, None).to(args.device).train()
    images = images.to(args.device)
    meter = GraphMemoryMeter(exclude=model)
    figures: dict[str, Any] = {"images": int(images.shape[0])}

    def alive_after(key: str | None, action: Callable[[], Any] = lambda: model(images)):
        with meter:
            result = action()  # default: the forward, (N, D)
        if key:
            figures[key] = meter.alive_bytes
        return result

    out = alive_after("forward_with_grad")
    alive_after("after_backward_output_still_referenced", lambda o=out: o.sum().backward())
    try:
        out.sum().backward()
        figures["second_backward_error"] = "no error"
    except RuntimeError as err:
        figures["second_backward_error"] = str(err).split(".")[0]
    out = alive_after(None)
    del out  # no backward: the last reference goes, and the graph with it
    figures["after_del_output_without_backward"] = meter.alive_bytes
    out = alive_after(None)
    alive_after("after_backward_retain_graph", lambda o=out: o.sum().backward(retain_graph=True))
    del out
    figures["after_retained_output_deleted"] = meter.alive_bytes
    with torch.no_grad():
        alive_after("forward_no_grad")
    with torch.inference_mode():
        alive_after("forward_inference_mode")
    # A loop variable rebound to the next forward: the old graph lives until the new one exists.
    out = alive_after(None)
    for key in ("rebind_without_del_peak", "rebind_after_del_peak"):
        meter.reset_peak()
        out = alive_after(None)
        figures[key] = meter.peak_bytes
        del out
    model.zero_grad(set_to_none=True)
    return figures


def release_device_memory(device: torch.device) -> None:
    """On CUDA, collect garbage and return cached blocks, so measurements start alike (on the
    CPU reference counting already freed the last one's tensors)."""
    if device.type == "cuda":
        gc.collect()  # a reference cycle would keep the last measurement's tensors allocated
        torch.cuda.empty_cache()


def run_report(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant on the same batches, then the graph lifecycle (see :func:`main`)."""
    batches = make_triplet_batches(
        args.steps, args.batch_size, args.image_size, args.classes, args.seed
    )
    variants: dict[str, dict[str, Any]] = {}
    say(f"seed loop, {args.steps} steps")
    variants["seed"], timeline = measure_seed(args, batches)
    release_device_memory(args.device)
    for name, passes, pk in (
        ("two_pass", 2, False),
        ("one_pass", 1, False),
        ("two_pass_pk", 2, True),
        ("one_pass_pk", 1, True),
    ):
        if args.pk or not pk:
            say(f"{name}, {args.steps} steps")
            variants[name] = measure_trainer(args, batches, passes, pk)
            release_device_memory(args.device)
    say("graph lifecycle")
    lifecycle = graph_lifecycle(args, batches[0][0])
    release_device_memory(args.device)
    config = {key: getattr(args, key) for key in CONFIG_KEYS}
    config.update(
        images_per_batch=3 * args.batch_size,
        pk={"P": args.identities, "K": args.pk} if args.pk else None,
        device=str(args.device),
        num_classes=args.classes,
        torch=torch.__version__,
    )
    return {
        "config": config,
        "variants": variants,
        "seed_timeline": timeline,
        "graph_lifecycle": lifecycle,
    }


def plot_phases(report: dict[str, Any], path: Path) -> Figure:
    """Write to ``path`` (PNG) and return a chart of what the seed loop and the two-pass step
    hold after each phase of their last step: one panel each, bars of :data:`HELD` stacked."""
    config, variants = report["config"], report["variants"]
    panels = {
        "the seed's loop (benchmarks/seed_loop.py)": variants["seed"]["phases"],
        "ours: Trainer, two passes": variants["two_pass"]["phases"],
    }
    figure = Figure(figsize=(12, 4.8), layout="constrained")
    axes = figure.subplots(1, 2, sharey=True)
    for ax, (title, phases) in zip(axes, panels.items()):
        names = [textwrap.fill(row["phase"], 10) for row in phases]
        bottom = np.zeros(len(phases))
        for key, legend in HELD.items():
            mib = np.array([row[key] for row in phases]) / 2**20  # (phases,)
            ax.bar(names, mib, bottom=bottom, label=legend)
            bottom += mib
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("MiB held after the phase")
    axes[1].legend(loc="upper right", fontsize="small")
    figure.suptitle(
        f"Memory held during step {config['steps']}: {config['backbone']}, "
        f"{config['image_size']} px, {config['images_per_batch']} images a batch, "
        f"{config['optimizer']}, {config['device']}"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure).print_png(str(path))
    return figure


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the report and write it to ``--json`` (or stdout), its chart to ``--plot``; returns
    it: ``config``, ``variants`` (name -> figures, with :data:`REQUIRED_KEYS`, and
    :data:`CUDA_KEYS` on CUDA; ``phases`` for the seed and two-pass ones), ``seed_timeline``
    and ``graph_lifecycle``."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run_report(args)
    if args.plot:
        plot_phases(report, args.plot)
        say(f"wrote the chart {args.plot}")
    if args.memory_summary:
        print(torch.cuda.memory_summary(args.device, abbreviated=True), file=sys.stderr)
    if args.json is None:
        print(json.dumps(json_safe(report), indent=2))
        return report
    try:
        write_report(args.json, report)
    except FacenetError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return report


if __name__ == "__main__":
    main()
