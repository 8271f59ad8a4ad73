"""Memory report: what the seed's loop and the corrected steps hold, measured on one batch.

On one model, batch and device, runs a few steps of

- ``seed``: the faithful port of the original loop (``benchmarks.seed_loop``), fed triplet
  batches (anchor, positive, negative: T images each);
- ``two_pass``: the corrected step (no-grad mining pass, one grad forward on the selected images),
  fed the same 3T images through ``Trainer.train_triplet_step`` with the seed's selection rule;
- ``one_pass``: the corrected one-pass step (one grad forward on all 3T images) on the same batch;
- ``two_pass_pk`` and ``one_pass_pk`` (unless ``--pk 0``): the same 3T images labelled as a
  P x K batch, with semi-hard mining.

For each it reports graph bytes (tensors saved for backward) alive after the step and at the
step's peak, bytes of parameters, gradients and optimizer state, step time and, on CUDA, the
caching allocator's allocated / reserved / peak bytes. It prints a table and the seed loop's
timeline (graph bytes after each source line, and which loop variable keeps which graph), writes
``--json`` and a chart ``--plot``. See docs/memory.md. Memory figures carry the names of the
trainer's epoch records (``facenet.memory.MEMORY_KEYS``), measured by ``benchmarks.measure``,
the core the training-step benchmark uses too.

    python -m benchmarks.memory_report --backbone tiny --image-size 64 --json report.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import seed_loop
from benchmarks.measure import (
    ForwardCounter,
    GradBytesAtStep,
    memory_readings,
    metered_step,
    release_device_memory,
    seed_rule_parts,
    semihard_parts,
)
from facenet.cli.common import positive_int
from facenet.distributed import resolve_device
from facenet.errors import FacenetError
from facenet.files import json_safe, write_text_atomic
from facenet.memory import (
    CUDA_ALLOCATED,
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    CUDA_RESERVED,
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    GraphMemoryMeter,
    format_bytes,
    graph_bytes_by_variable,
    module_state_bytes,
)
from facenet.models.embedding import BACKBONES, EmbeddingNet
from facenet.sizes import ImageSize, image_hw, plain_size, size_text
from facenet.training.engine import Trainer

__all__ = [
    "REQUIRED_KEYS",
    "CUDA_KEYS",
    "get_args_parser",
    "parse_args",
    "make_triplet_batches",
    "measure_seed",
    "measure_trainer",
    "graph_lifecycle",
    "run_report",
    "format_table",
    "format_timeline",
    "plot_report",
    "main",
]

# Keys every variant has in the JSON; CUDA_KEYS are added on a CUDA device. The memory figures
# are named as in the trainer's epoch records (facenet.memory.MEMORY_KEYS).
REQUIRED_KEYS = (
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "step_seconds",
)
CUDA_KEYS = (CUDA_MAX_ALLOCATED, CUDA_ALLOCATED, CUDA_RESERVED, CUDA_MAX_RESERVED)
OPTIMIZERS = ("adagrad", "adam", "sgd")


# --------------------------------------------------------------------------- command line


def image_size_arg(text: str) -> int | list[int]:
    """``--image-size``: ``64`` (square) or ``112x96`` (H x W), as ``data.image_size`` stores it.

    Args:
        text: the argument.
    """
    try:
        sides = [int(part) for part in text.lower().replace(",", "x").split("x")]
        return plain_size(sides[0] if len(sides) == 1 else sides)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a positive integer or HxW (e.g. 112x96)"
        ) from None


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``python -m benchmarks.memory_report``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.memory_report", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--backbone", choices=BACKBONES, default="tiny")
    parser.add_argument(
        "--image-size",
        type=image_size_arg,
        default=64,
        help="S pixels, or HxW for a non-square input (e.g. 112x96; default 64)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=8, help="T triplets per batch: 3T images (8)"
    )
    parser.add_argument("--steps", type=positive_int, default=3, help="steps per variant (3)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument("--margin", type=float, default=0.2, help="selection and loss margin")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and images")
    parser.add_argument("--embedding-dim", type=positive_int, default=128)
    parser.add_argument("--num-classes", type=positive_int, default=10, help="classifier size")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad", help="(adagrad)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--pk", type=int, default=3, help="K images per identity of the P x K case; 0: skip (3)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the chart (PNG) here")
    parser.add_argument(
        "--snapshot",
        type=Path,
        default=None,
        help="CUDA only: record the allocator's history during the seed loop and dump a "
        "snapshot (open it at https://pytorch.org/memory_viz)",
    )
    parser.add_argument(
        "--memory-summary", action="store_true", help="CUDA only: print torch.cuda.memory_summary"
    )
    return parser


def _resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; a CUDA device that is not there is an error."""
    try:
        device = resolve_device(name)
    except FacenetError:
        raise ValueError(f"--device {name}: CUDA is not available on this machine") from None
    except RuntimeError:  # torch cannot parse the name
        raise ValueError(
            f"--device: unknown device {name!r}; use cpu, cuda, cuda:N or auto"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are measured")
    return device


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments; bad values exit with a message naming the flag.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` if None).

    Adds ``device`` (a torch.device), ``identities`` (P of the P x K case, 0 when skipped) and
    ``classes`` (classifier size: at least P, so every P x K label has a class).
    """
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(
            f"--steps {args.steps}: at least 2, the seed loop's graphs reach into the next step"
        )
    if args.num_classes < 2:
        parser.error(f"--num-classes {args.num_classes}: negatives need at least 2 classes")
    if not args.margin > 0:
        parser.error(f"--margin {args.margin}: must be > 0")
    images = 3 * args.batch_size
    if args.pk < 0 or (args.pk and (args.pk < 2 or images % args.pk)):
        parser.error(
            f"--pk {args.pk}: K must be 0 (skip) or at least 2 and divide the "
            f"3 x --batch-size = {images} images of a batch"
        )
    try:
        args.device = _resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None and path.is_dir():  # found now, not after the whole report
            parser.error(f"{flag} {path}: is a folder; give a file name")
    if (args.snapshot or args.memory_summary) and args.device.type != "cuda":
        parser.error("--snapshot and --memory-summary need a CUDA --device")
    args.identities = images // args.pk if args.pk else 0
    args.classes = max(args.num_classes, args.identities)
    return args


# --------------------------------------------------------------------------- batches


def make_triplet_batches(
    steps: int, batch_size: int, image_size: ImageSize, num_classes: int, seed: int
) -> list[tuple[torch.Tensor, ...]]:
    """Seeded random triplet batches ``(data_a, data_p, data_n, label_p, label_n)``.

    Args:
        steps: how many batches.
        batch_size: T, images in each of a, p and n (each (T, 3, H, W)).
        image_size: S (H = W = S) or (H, W).
        num_classes: labels are in ``0..num_classes-1``; ``label_n != label_p``.
        seed: seed of the torch.Generator.
    """
    generator = torch.Generator().manual_seed(seed)
    height, width = image_hw(image_size)
    batches = []
    for _ in range(steps):
        a, p, n = (
            torch.randn(batch_size, 3, height, width, generator=generator)  # (T, 3, H, W)
            for _ in range(3)
        )
        label_p = torch.randint(0, num_classes, (batch_size,), generator=generator)
        offset = torch.randint(1, num_classes, (batch_size,), generator=generator)
        batches.append((a, p, n, label_p, (label_p + offset) % num_classes))
    return batches


def _as_pk_batch(batch: tuple[torch.Tensor, ...], identities: int) -> tuple[torch.Tensor, ...]:
    """The triplet batch's 3T images relabelled as P identities x K images."""
    images = torch.cat(batch[:3])  # (3T, 3, H, W)
    per_identity = images.shape[0] // identities
    return images, torch.arange(identities).repeat_interleave(per_identity)  # (3T,)


# --------------------------------------------------------------------------- measuring


def _measure_steps(
    run_step: Callable[[tuple], Any],
    batches: Sequence[tuple],
    meter: GraphMemoryMeter,
    device: torch.device,
    forwards: ForwardCounter,
) -> list[dict[str, float]]:
    """Run ``run_step`` on each batch under ``meter``; per step: graph and CUDA bytes (peaks of
    the step), seconds, images forwarded with and without grad (read from ``forwards``).

    The meter stays counting between steps, so graphs a step leaves behind are still seen (and
    their release is counted) during the next one.
    """
    per_step = []
    for batch in batches:
        with_grad, no_grad = forwards.with_grad, forwards.no_grad
        seconds, _ = metered_step(meter, device, lambda b=batch: run_step(b), reset_peaks=True)
        # Every variant shares this process: its peak RSS would mix them, so it is left out.
        step = {
            **memory_readings(meter, device, rss=False),
            "step_seconds": seconds,
            "images_forwarded_with_grad": forwards.with_grad - with_grad,
            "images_forwarded_no_grad": forwards.no_grad - no_grad,
        }
        per_step.append(step)
    return per_step


def _summarize(
    per_step: list[dict[str, float]],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    forwards: ForwardCounter,
    grads: GradBytesAtStep,
    selected: list[int],
) -> dict[str, Any]:
    """One variant's figures: peaks over the steps, what the last step left, model state bytes.

    ``step_seconds`` is the median over the steps after the first (which pays for lazy setup).
    """
    steps = len(per_step)
    for step, count in zip(per_step, selected):
        step["selected_triplets"] = count
    state = module_state_bytes(model, optimizer)
    summary: dict[str, Any] = {
        GRAPH_BYTES_ALIVE: per_step[-1][GRAPH_BYTES_ALIVE],  # what the last step left
        GRAPH_BYTES_PEAK: max(s[GRAPH_BYTES_PEAK] for s in per_step),
        "graph_bytes_peak_mean": statistics.mean(s[GRAPH_BYTES_PEAK] for s in per_step),
        "param_bytes": state["param_bytes"],
        "grad_bytes": state["grad_bytes"],  # gradients still allocated after the step
        "grad_bytes_at_optimizer_step": grads.peak,
        "buffer_bytes": state["buffer_bytes"],
        "optimizer_state_bytes": state["optimizer_state_bytes"],
        "step_seconds": statistics.median(s["step_seconds"] for s in per_step[1:]),
        "images_forwarded_with_grad": forwards.with_grad / steps,
        "images_forwarded_no_grad": forwards.no_grad / steps,
        "selected_triplets": statistics.mean(selected),
    }
    if CUDA_MAX_ALLOCATED in per_step[0]:  # peaks over the steps, the rest after the last
        summary[CUDA_MAX_ALLOCATED] = max(s[CUDA_MAX_ALLOCATED] for s in per_step)
        summary[CUDA_MAX_RESERVED] = max(s[CUDA_MAX_RESERVED] for s in per_step)
        summary[CUDA_ALLOCATED] = per_step[-1][CUDA_ALLOCATED]
        summary[CUDA_RESERVED] = per_step[-1][CUDA_RESERVED]
    summary["per_step"] = per_step
    return summary


# --------------------------------------------------------------------------- the seed loop


def _short_label(line: str) -> str:
    """A source line shortened for a chart axis: its assignment targets or its first words."""
    head = line.split(" = ")[0] if " = " in line else line.split("=")[0]
    head = head.strip()
    return head if len(head) <= 28 else head[:27] + "..."


def _timeline_rows(meter: GraphMemoryMeter) -> list[dict[str, Any]]:
    """The meter's timeline as rows: source line, graph bytes alive after it, change it made."""
    rows, previous = [], None
    for label, alive in meter.timeline:
        change = 0 if previous is None else alive - previous
        rows.append({"line": label, "alive_bytes": alive, "change_bytes": change})
        previous = alive
    return rows


def _graph_holders(state: dict[str, Any], model: torch.nn.Module) -> dict[str, int]:
    """Graph bytes reachable from each loop variable (and the module) that has a ``grad_fn``.

    0 means the variable still points into a graph whose saved tensors backward has freed.
    """
    variables = {
        name: value
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and value.grad_fn is not None
    }
    features = getattr(model, "features", None)
    if isinstance(features, torch.Tensor) and features.grad_fn is not None:
        # SeedModel.forward keeps its last output on the module, as the original did.
        variables["model.features"] = features
    return graph_bytes_by_variable(variables)


def measure_seed(
    args: argparse.Namespace, batches: Sequence[tuple]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the seed loop's port on ``batches`` with its loop variables carried between steps.

    Args:
        args: the parsed arguments (backbone, embedding_dim, classes, optimizer, lr, margin,
            seed, device; ``snapshot`` records the CUDA allocator's history).
        batches: triplet batches from :func:`make_triplet_batches`.

    Returns:
        ``(figures, timeline)``: the variant's figures, and the last step's timeline with the
        graph bytes each loop variable keeps alive after it.
    """
    torch.manual_seed(args.seed)
    net = EmbeddingNet(
        args.backbone, embedding_dim=args.embedding_dim, input_size=image_hw(args.image_size)
    )
    model = seed_loop.SeedModel(net, args.classes).to(args.device)
    optimizer = seed_loop.create_optimizer(model, name=args.optimizer, lr=args.lr)
    model.train()
    meter = GraphMemoryMeter(exclude=model)
    forwards, grads = ForwardCounter(net.backbone), GradBytesAtStep(optimizer)
    state: dict[str, Any] = {}  # the loop's local variables, alive from one iteration to the next
    selected: list[int] = []

    def run_step(batch: tuple) -> None:
        meter.clear_timeline()  # keep the last step's timeline only
        result = seed_loop.seed_train_step(
            model, optimizer, *batch, margin=args.margin, state=state, meter=meter
        )
        selected.append(result["n_selected"])

    if args.snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    per_step = _measure_steps(run_step, batches, meter, args.device, forwards)
    if args.snapshot:
        args.snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(args.snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    forwards.remove()
    grads.remove()
    figures = _summarize(per_step, model, optimizer, forwards, grads, selected)
    timeline = {
        "step": len(batches),
        "lines": _timeline_rows(meter),
        "held_by_variable": _graph_holders(state, model),
        "alive_after_step": meter.alive_bytes,
        "peak": meter.peak_bytes,
    }
    state.clear()  # the loop's variables go: their graphs die with them (no collector needed)
    figures["graph_bytes_after_loop_variables_deleted"] = meter.alive_bytes
    return figures, timeline


# --------------------------------------------------------------------------- the corrected steps


def measure_trainer(
    args: argparse.Namespace, batches: Sequence[tuple], passes: int, pk: bool = False
) -> dict[str, Any]:
    """Run the corrected ``Trainer`` step on ``batches``; the same model, classifier and optimizer
    as the seed loop, with cross-entropy weight 1 (the seed's ``loss = ce + triplet``).

    Args:
        args: the parsed arguments.
        batches: triplet batches from :func:`make_triplet_batches`.
        passes: 2 (no-grad mining pass + grad pass on the selected images) or 1.
        pk: feed each batch's 3T images as P x K identities (semi-hard mining) instead of
            triplets filtered by the seed's rule.
    """
    torch.manual_seed(args.seed)  # the same initial weights as the seed loop's model
    model = EmbeddingNet(
        args.backbone,
        embedding_dim=args.embedding_dim,
        num_classes=args.classes,
        input_size=image_hw(args.image_size),
    ).to(args.device)
    optimizer = seed_loop.create_optimizer(model, name=args.optimizer, lr=args.lr)
    miner, loss_fn = semihard_parts(args.margin, args.seed) if pk else seed_rule_parts(args.margin)
    trainer = Trainer(
        model,
        miner,
        loss_fn,
        optimizer,
        passes=passes,
        ce_weight=1.0,
        device=args.device,
        graph_memory=True,
    )
    model.train()
    forwards, grads = ForwardCounter(model.backbone), GradBytesAtStep(optimizer)
    results: list[dict] = []

    def run_step(batch: tuple) -> None:
        if pk:
            results.append(trainer.train_step(*_as_pk_batch(batch, args.identities)))
        else:
            results.append(trainer.train_triplet_step(*batch))

    per_step = _measure_steps(run_step, batches, trainer.meter, args.device, forwards)
    forwards.remove()
    grads.remove()
    selected = [int(r["num_triplets"].item()) if "num_triplets" in r else 0 for r in results]
    return _summarize(per_step, model, optimizer, forwards, grads, selected)


# --------------------------------------------------------------------------- graph lifecycle


def _sum_backward(out: torch.Tensor, retain_graph: bool = False) -> None:
    """Backpropagate ``out.sum()``: a stand-in for a loss on the forward's output."""
    out.sum().backward(retain_graph=retain_graph)


def _alive_after(meter: GraphMemoryMeter, action: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``action`` under ``meter``; return its result and the graph bytes alive after it."""
    with meter:
        result = action()
    return result, meter.alive_bytes


def graph_lifecycle(args: argparse.Namespace, images: torch.Tensor) -> dict[str, Any]:
    """Where a graph lives and what frees it, measured on one forward of ``images``.

    Args:
        args: the parsed arguments (backbone, embedding_dim, seed, device).
        images: (N, 3, H, W) images.

    Returns:
        Graph bytes after one grad forward, after its backward (output still referenced), after
        ``del`` of an un-backpropagated output, with ``retain_graph=True``, under ``no_grad`` and
        ``inference_mode``; the peak when a variable is rebound to a new forward's output
        before and after ``del``; the error a second backward raises.
    """
    torch.manual_seed(args.seed)
    model = EmbeddingNet(
        args.backbone, embedding_dim=args.embedding_dim, input_size=image_hw(args.image_size)
    )
    model = model.to(args.device).train()
    images = images.to(args.device)
    meter = GraphMemoryMeter(exclude=model)
    out, forward = _alive_after(meter, lambda: model(images))  # (N, D), graph attached
    _, after_backward = _alive_after(meter, functools.partial(_sum_backward, out))
    try:
        _sum_backward(out)
        second_backward = "no error"
    except RuntimeError as err:
        second_backward = str(err).split(".")[0]
    del out
    out, _ = _alive_after(meter, lambda: model(images))
    del out  # no backward: the last reference goes, and the graph with it
    after_del = meter.alive_bytes
    out, _ = _alive_after(meter, lambda: model(images))
    _, retained = _alive_after(meter, functools.partial(_sum_backward, out, retain_graph=True))
    del out
    with torch.no_grad():
        _, no_grad = _alive_after(meter, lambda: model(images))
    with torch.inference_mode():
        _, inference = _alive_after(meter, lambda: model(images))
    # A loop variable rebound to the next forward: the old graph lives until the new one exists.
    out, _ = _alive_after(meter, lambda: model(images))
    meter.reset_peak()
    out, _ = _alive_after(meter, lambda: model(images))
    rebind_peak = meter.peak_bytes
    del out
    meter.reset_peak()
    out, _ = _alive_after(meter, lambda: model(images))
    del out
    rebind_after_del_peak = meter.peak_bytes
    model.zero_grad(set_to_none=True)
    return {
        "images": int(images.shape[0]),
        "forward_with_grad": forward,
        "after_backward_output_still_referenced": after_backward,
        "second_backward_error": second_backward,
        "after_del_output_without_backward": after_del,
        "after_backward_retain_graph": retained,
        "after_retained_output_deleted": meter.alive_bytes,
        "forward_no_grad": no_grad,
        "forward_inference_mode": inference,
        "rebind_without_del_peak": rebind_peak,
        "rebind_after_del_peak": rebind_after_del_peak,
    }


# --------------------------------------------------------------------------- the report


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, for the JSON."""
    return {
        "backbone": args.backbone,
        "image_size": args.image_size,
        "batch_size": args.batch_size,
        "images_per_batch": 3 * args.batch_size,
        "pk": {"P": args.identities, "K": args.pk} if args.pk else None,
        "steps": args.steps,
        "device": str(args.device),
        "margin": args.margin,
        "seed": args.seed,
        "embedding_dim": args.embedding_dim,
        "num_classes": args.classes,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "torch": torch.__version__,
    }


def run_report(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every variant on the same batches; returns the report (see :func:`main`).

    Args:
        args: what :func:`parse_args` returned.
    """
    batches = make_triplet_batches(
        args.steps, args.batch_size, args.image_size, args.classes, args.seed
    )
    variants: dict[str, dict[str, Any]] = {}
    variants["seed"], timeline = measure_seed(args, batches)
    release_device_memory(args.device)
    for name, passes, pk in (
        ("two_pass", 2, False),
        ("one_pass", 1, False),
        ("two_pass_pk", 2, True),
        ("one_pass_pk", 1, True),
    ):
        if pk and not args.pk:
            continue
        variants[name] = measure_trainer(args, batches, passes=passes, pk=pk)
        release_device_memory(args.device)
    lifecycle = graph_lifecycle(args, batches[0][0])
    release_device_memory(args.device)
    return {
        "config": _config(args),
        "variants": variants,
        "seed_timeline": timeline,
        "graph_lifecycle": lifecycle,
    }


def format_table(variants: dict[str, dict[str, Any]]) -> str:
    """The variants side by side: one row each, bytes in KiB/MiB/GiB.

    Args:
        variants: name -> figures, as in the report's ``variants``.
    """
    columns = [
        ("graph peak", GRAPH_BYTES_PEAK),
        ("graph after", GRAPH_BYTES_ALIVE),
        ("params", "param_bytes"),
        ("grads after", "grad_bytes"),
        ("grads at step", "grad_bytes_at_optimizer_step"),
        ("optim state", "optimizer_state_bytes"),
    ]
    cuda = CUDA_MAX_ALLOCATED in next(iter(variants.values()))
    if cuda:
        columns += [
            ("cuda peak", CUDA_MAX_ALLOCATED),
            ("cuda alloc", CUDA_ALLOCATED),
            ("cuda reserved", CUDA_RESERVED),
        ]
    header = f"{'variant':<12} {'img grad':>8} {'img no-grad':>11} " + " ".join(
        f"{title:>13}" for title, _ in columns
    )
    lines = [header + f" {'step s':>8}", "-" * (len(header) + 9)]
    for name, figures in variants.items():
        cells = " ".join(f"{format_bytes(figures[key]):>13}" for _, key in columns)
        lines.append(
            f"{name:<12} {figures['images_forwarded_with_grad']:>8.1f} "
            f"{figures['images_forwarded_no_grad']:>11.1f} {cells} {figures['step_seconds']:>8.3f}"
        )
    return "\n".join(lines)


def format_timeline(timeline: dict[str, Any]) -> str:
    """The seed loop's step as text: graph bytes after each source line, what it allocated or
    freed, and which loop variable keeps which graph when the step ends.

    Args:
        timeline: the report's ``seed_timeline``.
    """
    lines = [
        f"Seed loop, step {timeline['step']}: graph bytes alive after each line "
        "(the previous step's graphs are still alive when it starts)",
        "",
    ]
    for row in timeline["lines"]:
        change = row["change_bytes"]
        verb = "allocates" if change > 0 else "frees" if change < 0 else ""
        delta = f"{'+' if change > 0 else ''}{format_bytes(change)}" if change else ""
        lines.append(f"{format_bytes(row['alive_bytes']):>11} {delta:>12} {verb:<9}  {row['line']}")
    lines += [
        "",
        f"peak during the step: {format_bytes(timeline['peak'])}; "
        f"alive when it ends: {format_bytes(timeline['alive_after_step'])}, held by "
        "(graph bytes reachable from each variable; shared parts repeat; 0: freed by backward):",
    ]
    for name, nbytes in timeline["held_by_variable"].items():
        lines.append(f"{format_bytes(nbytes):>11}  {name}")
    return "\n".join(lines)


def _format_lifecycle(lifecycle: dict[str, Any]) -> str:
    """The graph-lifecycle figures as text."""
    lines = [f"One forward of {lifecycle['images']} images, graph bytes:"]
    for key, value in lifecycle.items():
        if key != "images":
            shown = format_bytes(value) if isinstance(value, int) else value
            lines.append(f"  {key:<40} {shown}")
    return "\n".join(lines)


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Write the chart: memory per variant (bars) and the seed step's timeline (steps).

    Args:
        report: what :func:`run_report` returned.
        path: the PNG to write; its folder is created.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = report["variants"]
    keys = [
        ("graph peak", GRAPH_BYTES_PEAK),
        ("graph after step", GRAPH_BYTES_ALIVE),
        ("parameters", "param_bytes"),
        ("grads after step", "grad_bytes"),
        ("optimizer state", "optimizer_state_bytes"),
    ]
    if CUDA_MAX_ALLOCATED in next(iter(variants.values())):
        keys.append(("CUDA peak allocated", CUDA_MAX_ALLOCATED))
    mib = 2.0**20
    fig, (bars, steps) = plt.subplots(1, 2, figsize=(15, 5.5))
    try:
        width = 0.8 / len(keys)
        for i, (title, key) in enumerate(keys):
            xs = [j + i * width for j in range(len(variants))]
            bars.bar(xs, [v[key] / mib for v in variants.values()], width, label=title)
        bars.set_xticks([j + 0.4 - width / 2 for j in range(len(variants))])
        bars.set_xticklabels(list(variants), rotation=15)
        bars.set_ylabel("MiB")
        config = report["config"]
        bars.set_title(
            f"{config['backbone']}, {size_text(config['image_size'])} px, "
            f"{config['images_per_batch']} "
            f"images per batch, {config['device']}"
        )
        bars.legend(fontsize=8)
        rows = report["seed_timeline"]["lines"]
        steps.step(range(len(rows)), [r["alive_bytes"] / mib for r in rows], where="mid")
        steps.axhline(
            rows[0]["alive_bytes"] / mib,
            color="gray",
            linestyle="--",
            linewidth=0.8,
            label="left alive by the previous step",
        )
        steps.set_ylim(bottom=0)
        steps.legend(fontsize=8, loc="lower right")
        steps.set_xticks(range(len(rows)))
        steps.set_xticklabels([_short_label(r["line"]) for r in rows], rotation=90, fontsize=7)
        steps.set_ylabel("graph bytes alive (MiB)")
        steps.set_title(f"seed loop, step {report['seed_timeline']['step']}, after each line")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the report; print the table, the seed timeline and the graph lifecycle.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` if None).

    Returns:
        The report: ``config``, ``variants`` (name -> figures, every one with
        :data:`REQUIRED_KEYS`, and :data:`CUDA_KEYS` on CUDA), ``seed_timeline`` (``lines``
        with ``line``, ``alive_bytes``, ``change_bytes``; ``held_by_variable``), and
        ``graph_lifecycle``.
    """
    args = parse_args(argv)
    report = run_report(args)
    config = report["config"]
    print(
        f"Memory report: {config['backbone']}, {size_text(config['image_size'])} px, "
        f"batch {config['batch_size']} triplets = {config['images_per_batch']} images, "
        f"{config['steps']} steps, "
        f"{config['device']}, optimizer {config['optimizer']}\n"
    )
    print(format_table(report["variants"]))
    print("\n" + format_timeline(report["seed_timeline"]))
    print("\n" + _format_lifecycle(report["graph_lifecycle"]))
    if args.memory_summary:
        print("\n" + torch.cuda.memory_summary(args.device, abbreviated=True))
    if args.json:
        try:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.json, json.dumps(json_safe(report), indent=2) + "\n")
        except OSError as err:
            print(f"error: cannot write {args.json}: {err.strerror or err}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"\nwrote {args.json}")
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    if args.snapshot:
        print(f"wrote {args.snapshot} (open it at https://pytorch.org/memory_viz)")
    return report


if __name__ == "__main__":
    main()
