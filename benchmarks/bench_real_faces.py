#!/usr/bin/env python
"""Real faces: the LFW accuracy three training loops reach in one CPU budget, and fine-tuning.

Each method (``ours``: the Trainer as ``facenet-train`` builds it; ``seed``: the seed's loop;
``plain``: the one-pass loop people write) trains the same network from the same initial
weights on an aligned identity folder until it has used ``--cpu-seconds`` of process CPU time
(every thread, loading in the process, so other jobs do not change what a method gets; the
learning rate follows the schedule over the fraction spent), then is evaluated on LFW's pairs
and the held-out identities. With ``--weights``, a published model is measured before and
after triplet fine-tuning. Figures and commands: docs/real_faces.md.

    python -m benchmarks.bench_real_faces --train-root celeba_sphereface \\
        --lfw-root lfw_sphereface --pairs pairs.txt [--weights 068.ckpt] --json real_faces.json
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_image

from benchmarks.bench_training_step import describe_machine
from benchmarks.measure import write_report
from benchmarks.seed_loop import SeedModel, seed_train_step
from facenet.config import Config, config_to_dict, load_config
from facenet.data import PKSampler
from facenet.data.batches import standardize
from facenet.data.images import build_transform
from facenet.evaluation.report import figures, figures_line
from facenet.evaluation.verify import verify
from facenet.metric.losses import build_loss
from facenet.metric.miners import build_miner
from facenet.models.embedding import build_model
from facenet.training.build import TrainingData, build_data, build_trainer
from facenet.training.optim import ScheduleShape, build_optimizer
from facenet.training.validation import verify_options

METHODS = ("ours", "seed", "plain")
SCHEDULE_POINTS = 1000  # the budget's fraction spent, in thousandths, is the schedule's "step"
TRACE_POINTS = 40  # loss values kept per method (evenly over its steps)


class CpuBudget:
    """Process CPU seconds (every thread) spent since the start, against a limit."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.cpu_start, self.wall_start = time.process_time(), time.perf_counter()

    def spent(self) -> float:
        """CPU seconds used since the start."""
        return time.process_time() - self.cpu_start

    def done(self) -> bool:
        """The budget is used up."""
        return self.spent() >= self.seconds


class BudgetSchedule:
    """The configuration's learning-rate shape over the budget's fraction spent, not steps.

    Each group's rate is its starting rate (its ``lr`` now) times ``ScheduleShape.factor`` at
    the thousandth of the budget used (warm-up, if any, as the same fraction of the run as in
    the config).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: Config, budget: CpuBudget):
        self.optimizer, self.budget = optimizer, budget
        self.base = [group["lr"] for group in optimizer.param_groups]
        warmup = cfg.optim.warmup_epochs / cfg.train.epochs if cfg.optim.warmup_epochs else 0.0
        self.shape = ScheduleShape(
            kind=cfg.optim.schedule,
            total_steps=SCHEDULE_POINTS,
            warmup_steps=round(warmup * SCHEDULE_POINTS),
            decay_every=max(1, round(SCHEDULE_POINTS * cfg.optim.step_size / cfg.train.epochs)),
            gamma=cfg.optim.gamma,
            floor=cfg.optim.min_lr_ratio,
        )

    def apply(self) -> float:
        """Set every group's rate for the next step; returns the factor."""
        fraction = min(1.0, self.budget.spent() / self.budget.seconds)
        factor = self.shape.factor(int(fraction * SCHEDULE_POINTS))
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * factor
        return factor


def train_for_budget(step, optimizer, cfg: Config, data, budget: CpuBudget) -> dict:
    """``step(batch) -> (loss or None when skipped, images)`` over epochs of ``data`` until the
    budget is spent, the rates set by :class:`BudgetSchedule`; the method's training record."""
    schedule, losses = BudgetSchedule(optimizer, cfg, budget), []
    steps = images = skipped = epochs = 0
    while not budget.done():
        epochs += 1
        data.sampler.set_epoch(epochs)
        for batch in data.loader:
            schedule.apply()
            loss, count = step(batch)
            steps, images = steps + 1, images + count
            if loss is None or not math.isfinite(loss):
                skipped += 1
            else:
                losses.append((budget.spent(), loss))
            if budget.done():
                break
    values = [loss for _, loss in losses]
    ends = max(1, min(10, len(values) // 4))  # mean of the first / last few steps
    keep = np.unique(np.linspace(0, len(values) - 1, TRACE_POINTS).astype(int))
    return {
        "steps": steps,
        "skipped_steps": skipped,
        "images": images,
        "epochs_started": epochs,
        "cpu_seconds": budget.spent(),
        "wall_seconds": time.perf_counter() - budget.wall_start,
        "images_per_cpu_second": images / max(budget.spent(), 1e-9),
        "loss_first": float(np.mean(values[:ends])) if values else None,
        "loss_last": float(np.mean(values[-ends:])) if values else None,
        "loss_trace": [losses[i] for i in keep] if values else [],
    }


# --------------------------------------------------------------------------- configurations


def load_configs(args: argparse.Namespace, path: str, extra: list[str], run_dir: Path) -> Config:
    """The configuration at ``path`` with the benchmark's folders, ``extra`` overrides, and
    ``run_dir`` for held-out pairs."""
    overrides = [
        f"data.root={args.train_root}",
        f"eval.pairs={args.pairs}",
        f"eval.root={args.lfw_root}",
        "data.num_workers=0",  # loading counts in the process's CPU time
        "train.device=cpu",
        f"logging.out_dir={run_dir}",
        *extra,
    ]
    return load_config(path, overrides)


def seed_style(cfg: Config) -> Config:
    """The configuration of the seed's data: triplet batches of about P x K images."""
    triplets = copy.deepcopy(cfg)
    triplets.data.dataset = "triplets"
    triplets.data.triplet_batch_size = max(1, cfg.data.p * cfg.data.k // 3)  # 3T ~ P x K
    return triplets


def seeded(cfg: Config) -> None:
    """Every method starts from the same random state (the same initial weights)."""
    torch.manual_seed(cfg.train.seed)
    np.random.seed(cfg.train.seed)


# --------------------------------------------------------------------------- the three loops


def train_ours(cfg: Config, data: TrainingData, budget: CpuBudget) -> tuple[torch.nn.Module, dict]:
    """The Trainer of ``facenet-train`` (its default step) on our loader (P x K batches)."""
    seeded(cfg)
    trainer = build_trainer(cfg, data.num_classes, torch.device("cpu"), data.steps_per_epoch)
    return trainer.core_model, train_trainer(trainer, cfg, data, budget)


def train_trainer(trainer, cfg: Config, data: TrainingData, budget: CpuBudget) -> dict:
    """The Trainer's steps on our loader until the budget (from scratch or fine-tuning); the
    budget's schedule sets the rates, not the Trainer's."""
    trainer.scheduler = None

    def step(batch) -> tuple[float | None, int]:
        stats = trainer.train_step(*batch)
        return (None if "skipped" in stats else float(stats["loss"])), batch[0].shape[0]

    trainer.model.train()
    record = train_for_budget(step, trainer.optimizer, cfg, data, budget)
    return record | {"step_path": trainer.step.name}


def train_seed(cfg: Config, data: TrainingData, budget: CpuBudget) -> tuple[torch.nn.Module, dict]:
    """The seed's loop (``seed_train_step``, a faithful port: its triplet loss never reaches the
    model, so only its cross-entropy trains) on triplet batches of our loader.

    With a single hard triplet the seed's classifier forwards are batches of one image, which
    BatchNorm refuses in training mode (the original stops there): that step is skipped.
    """
    seeded(cfg)
    network = build_model(cfg.model, num_classes=None, image_size=cfg.data.image_size)
    model = SeedModel(network, data.num_classes)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    state, epoch = {}, None  # the loop's variables, carried from step to step

    def step(batch) -> tuple[float | None, int]:
        nonlocal epoch
        data_a, data_p, data_n, label_p, label_n = batch
        if epoch != data.sampler.epoch:  # a new epoch's lists, as seed_epoch makes them
            epoch = data.sampler.epoch
            state.update(labels=[], distances=[])
        images = [standardize(x, cfg.data.normalize) for x in (data_a, data_p, data_n)]
        try:
            out = seed_train_step(
                model, optimizer, *images, label_p, label_n, margin=cfg.mining.margin, state=state
            )
        except ValueError as err:
            if "more than 1 value per channel" not in str(err):
                raise
            optimizer.zero_grad()
            return None, 3 * data_a.shape[0]
        return (None if out["skipped"] else out["total_loss"]), 3 * data_a.shape[0]

    model.train()
    record = train_for_budget(step, optimizer, cfg, data, budget)
    state.clear()  # the loop variables keep the last step's graphs alive
    return network, record


class PlainFolder(Dataset):
    """``(image, label)``: the file decoded by torchvision and transformed alone, every time,
    as a torchvision ``ImageFolder`` does; ``samples`` are ``[(path, label), ...]``."""

    def __init__(self, samples: list, transform):
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(decode_image(path, mode=ImageReadMode.RGB)), label


def plain_data(cfg: Config, data: TrainingData) -> SimpleNamespace:
    """The plain loop's data: the same training images and P x K sampling, loaded plainly."""
    folder = getattr(data.loader.dataset, "dataset", data.loader.dataset)  # under SeededSamples
    d = cfg.data
    transform = build_transform(d.image_size, True, d.normalize, d.hflip, d.random_crop)
    replace = d.sample_with_replacement
    sampler = PKSampler(folder.triplet_labels, d.p, d.k, cfg.train.seed, with_replacement=replace)
    loader = DataLoader(PlainFolder(folder.samples, transform), batch_sampler=sampler)
    return SimpleNamespace(loader=loader, sampler=sampler)


def train_plain(cfg: Config, data: TrainingData, budget: CpuBudget) -> tuple[torch.nn.Module, dict]:
    """The plain one-pass loop: one forward with grad, our miner on the detached embeddings,
    our triplet loss (+ the cross-entropy on the images the triplets use), backward, step."""
    seeded(cfg)
    ce_weight = cfg.loss.ce_weight
    model = build_model(cfg.model, data.num_classes if ce_weight > 0 else None, cfg.data.image_size)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    miner = build_miner(cfg.mining, torch.Generator().manual_seed(cfg.train.seed))
    loss_fn = build_loss(cfg.loss)

    def step(batch) -> tuple[float | None, int]:
        images, labels = batch
        if ce_weight > 0:
            embeddings, logits = model(images, return_logits=True)  # (B, D), (B, C)
        else:
            embeddings, logits = model(images), None
        triplets = miner(embeddings.detach(), labels)
        loss = None
        if triplets.anchor.numel():
            loss = loss_fn(embeddings, triplets)
            if logits is not None:
                used = torch.unique(torch.cat(list(triplets)))  # (U,) images the triplets use
                loss = loss + ce_weight * F.cross_entropy(logits[used], labels[used])
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (None if loss is None else float(loss)), images.shape[0]

    model.train()
    return model, train_for_budget(step, optimizer, cfg, plain_data(cfg, data), budget)


TRAINERS = {"ours": train_ours, "seed": train_seed, "plain": train_plain}


# --------------------------------------------------------------------------- evaluation


def evaluate(model, pairs, cfg: Config, image_size=None) -> dict:
    """The verification figures of ``model`` on ``pairs`` with ``cfg``'s evaluation settings
    (input ``image_size``, default ``cfg.data.image_size``), and the CPU and wall seconds the
    evaluation took."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = verify(
        model,
        pairs,
        image_size or cfg.data.image_size,
        normalize=cfg.data.normalize,
        device="cpu",
        **verify_options(cfg),
    )
    values = figures(result)
    values["pairs"] = len(pairs)
    values["eval_cpu_seconds"] = time.process_time() - cpu
    values["eval_wall_seconds"] = time.perf_counter() - wall
    return values


def evaluate_sets(model, data: TrainingData, cfg: Config, name: str) -> dict:
    """LFW (the test pairs) and the held-out identities (the validation pairs), printed."""
    out = {}
    for key, pairs in (("lfw", data.test_pairs), ("heldout", data.val_pairs)):
        if pairs is not None:
            out[key] = evaluate(model, pairs, cfg)
            print(figures_line(f"{name} {key}", out[key]), flush=True)
    return out


def data_record(data: TrainingData) -> dict:
    """What the methods trained on and were tested with."""
    folder = getattr(data.loader.dataset, "dataset", data.loader.dataset)
    return {
        "train_identities": data.num_classes,
        "train_images": len(folder),
        "lfw_pairs": None if data.test_pairs is None else len(data.test_pairs),
        "lfw_pairs_skipped": None if data.test_pairs is None else len(data.test_pairs.skipped),
        "heldout_pairs": None if data.val_pairs is None else len(data.val_pairs),
        "notes": data.notes,
    }


def settings(cfg: Config) -> dict:
    """The resolved sections that define the training (folders and logging left out)."""
    resolved = config_to_dict(cfg)
    return {name: resolved[name] for name in ("data", "model", "mining", "loss", "optim", "eval")}


# --------------------------------------------------------------------------- the two parts


def from_scratch(args: argparse.Namespace, run_dir: Path, report: dict) -> None:
    """Train each method for the budget and evaluate it; the report is written after each."""
    cfg = load_configs(args, args.config, args.overrides, run_dir)
    data = build_data(cfg, run_dir)
    report["scratch"] = {"config": args.config, "overrides": args.overrides}
    report["scratch"] |= {"settings": settings(cfg), "data": data_record(data)}
    for method in args.methods:
        method_cfg = seed_style(cfg) if method == "seed" else cfg
        method_data = build_data(method_cfg, run_dir) if method == "seed" else data
        print(f"{method}: training for {args.cpu_seconds:g} CPU seconds", flush=True)
        budget = CpuBudget(args.cpu_seconds)
        model, record = TRAINERS[method](method_cfg, method_data, budget)
        print(
            f"{method}: {record['steps']} steps, loss",
            record["loss_first"],
            "->",
            record["loss_last"],
        )
        record.update(evaluate_sets(model.eval(), data, cfg, method))
        report["scratch"][method] = record
        write_report(args.json, report)


def finetune(args: argparse.Namespace, run_dir: Path, report: dict) -> None:
    """The published model on LFW (two evaluations) before and after triplet fine-tuning."""
    extra = [f"model.weights={args.weights}", *args.finetune_overrides]
    cfg = load_configs(args, args.finetune_config, extra, run_dir)
    publisher = load_config(
        args.publisher_config, ["data.num_workers=0", *args.publisher_overrides]
    )
    data = build_data(cfg, run_dir)
    seeded(cfg)
    trainer = build_trainer(cfg, data.num_classes, torch.device("cpu"), data.steps_per_epoch)
    part = report["finetune"] = {"config": args.finetune_config, "weights": args.weights}
    part |= {"settings": settings(cfg), "data": data_record(data)}
    for when in ("before", "after"):
        if when == "after":
            print(f"fine-tuning for {args.finetune_cpu_seconds:g} CPU seconds", flush=True)
            budget = CpuBudget(args.finetune_cpu_seconds)
            part["training"] = train_trainer(trainer, cfg, data, budget)
        model = trainer.core_model.eval()
        part[when] = evaluate_sets(model, data, cfg, f"{when}:")
        if evaluation_of(publisher) == evaluation_of(cfg):  # its LFW figure is the publisher's
            part[when]["publisher_lfw"] = part[when]["lfw"]
        else:  # the model's input size (the publisher's: the same 112 x 96)
            lfw = evaluate(model, data.test_pairs, publisher, cfg.data.image_size)
            part[when]["publisher_lfw"] = lfw
            print(figures_line(f"{when}: publisher lfw", lfw), flush=True)
        write_report(args.json, report)


def evaluation_of(cfg: Config) -> tuple:
    """What decides how a configuration evaluates: verify's settings and the standardisation."""
    return verify_options(cfg), cfg.data.normalize


# --------------------------------------------------------------------------- command line


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-root", required=True, help="aligned root/<identity>/<image>")
    parser.add_argument("--lfw-root", required=True, help="aligned LFW: Name/Name_NNNN.jpg")
    parser.add_argument("--pairs", required=True, help="LFW's pairs.txt (View 2)")
    parser.add_argument("--weights", default=None, help="a published model to fine-tune")
    parser.add_argument("--cpu-seconds", type=float, default=360.0, help="budget per method")
    parser.add_argument("--finetune-cpu-seconds", type=float, default=None, help="default: same")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--config", default="configs/real_faces.yaml")
    parser.add_argument("--finetune-config", default="configs/finetune_mobilefacenet.yaml")
    parser.add_argument("--publisher-config", default="configs/lfw_mobilefacenet.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument(
        "--finetune-set", dest="finetune_overrides", action="append", default=[], metavar="K=V"
    )
    parser.add_argument(
        "--publisher-set", dest="publisher_overrides", action="append", default=[], metavar="K=V"
    )
    parser.add_argument("--out", default=None, help="run folder (held-out pairs); default: temp")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", default=None, help="write the report here")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the measurements; the JSON report is rewritten after each one."""
    args = get_args_parser().parse_args(argv)
    if args.finetune_cpu_seconds is None:
        args.finetune_cpu_seconds = args.cpu_seconds
    torch.set_num_threads(args.threads)
    report = {
        "benchmark": "real faces: LFW after the same CPU budget; fine-tuning a published model",
        "command": " ".join(["python -m benchmarks.bench_real_faces", *sys.argv[1:]]),
        "cpu_seconds_per_method": args.cpu_seconds,
        "finetune_cpu_seconds": args.finetune_cpu_seconds if args.weights else None,
        "machine": describe_machine("cpu"),
    }
    with tempfile.TemporaryDirectory() as temporary:
        run_dir = Path(args.out or temporary)
        if args.methods:
            from_scratch(args, run_dir, report)
        if args.weights:
            finetune(args, run_dir, report)
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
