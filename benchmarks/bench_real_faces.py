#!/usr/bin/env python
"""Real faces: the LFW accuracy training loops reach in one CPU budget, and fine-tuning.

Each method (``ours``: the Trainer as ``facenet-train`` builds it; ``seed``: the seed's loop;
``plain``: a one-pass loop; the peers' loops of benchmarks/peer_loops.py) trains the same
initial network on an aligned identity folder for ``--cpu-seconds`` of process CPU time (every
thread; the learning rate follows the schedule over the fraction spent), once per seed
(``--seeds``), then is evaluated on LFW's pairs and held-out identities. ``--weights``: a
published model before and after triplet fine-tuning. Figures and commands: docs/real_faces.md.

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
from dataclasses import asdict
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from torchvision.io import ImageReadMode, decode_image

from benchmarks.measure import (
    benchmark_parser,
    describe_machine,
    input_path,
    output_path,
    positive_float,
    run_benchmark,
    write_report,
)
from benchmarks.peer_loops import PEERS, PeerSettings, peer_setting
from benchmarks.seed_loop import SeedModel, seed_train_step
from facenet.cli.common import positive_int
from facenet.config import Config, config_to_dict, load_config
from facenet.data.batches import standardize
from facenet.data.images import build_transform
from facenet.evaluation.report import figures, figures_line
from facenet.evaluation.verify import verify
from facenet.metric import build_loss, build_miner
from facenet.models.embedding import build_model
from facenet.training.build import TrainingData, build_data, build_network, build_trainer
from facenet.training.optim import ScheduleShape, build_optimizer
from facenet.training.validation import verify_settings

REPO = Path(__file__).resolve().parents[1]  # the configurations' paths are relative to it
SCRATCH_CONFIG = "configs/real_faces.yaml"
FINETUNE_CONFIG = "configs/finetune_mobilefacenet.yaml"
PUBLISHER_CONFIG = "configs/lfw_mobilefacenet.yaml"
SCHEDULE_POINTS = 1000  # the budget's fraction spent, in thousandths, is the schedule's "step"
TRACE_POINTS = 40  # loss values kept per method (evenly over its steps)
SEED_FIGURES = ("accuracy_mean", "accuracy_std", "val", "auc", "eer")  # summarised over seeds


def budget_schedule(optimizer: torch.optim.Optimizer, cfg: Config, fraction) -> LambdaLR:
    """The configuration's learning-rate shape over the thousandths of the budget spent
    (``fraction()``, from 0 to 1), not over steps (a warm-up the same fraction of the run as in
    the config); ``step()`` after each step sets the next rates."""
    optim, epochs = cfg.optim, cfg.train.epochs
    shape = ScheduleShape(
        optim.schedule,
        SCHEDULE_POINTS,
        round(SCHEDULE_POINTS * optim.warmup_epochs / epochs),
        max(1, round(SCHEDULE_POINTS * optim.step_size / epochs)),
        optim.gamma,
        optim.min_lr_ratio,
    )
    return LambdaLR(optimizer, lambda _: shape.factor(int(min(1.0, fraction()) * SCHEDULE_POINTS)))


def train_for_budget(step, optimizer, cfg: Config, data, seconds: float) -> dict:
    """``step(batch) -> (loss or None when skipped, images)`` over epochs of ``data`` until
    ``seconds`` of process CPU time (every thread) are spent, the rates set by
    :func:`budget_schedule`; the method's training record."""
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    spent = lambda: time.process_time() - cpu_start  # noqa: E731
    schedule, losses = budget_schedule(optimizer, cfg, lambda: spent() / seconds), []
    steps = images = skipped = epochs = 0
    while spent() < seconds:
        epochs += 1
        data.sampler.set_epoch(epochs)
        for batch in data.loader:
            loss, count = step(batch)
            schedule.step()
            steps, images = steps + 1, images + count
            if loss is None or not math.isfinite(loss):
                skipped += 1
            else:
                losses.append((spent(), loss))
            if spent() >= seconds:
                break
    values = [loss for _, loss in losses]
    ends = max(1, min(10, len(values) // 4))  # mean of the first / last few steps
    keep = np.unique(np.linspace(0, len(values) - 1, TRACE_POINTS).astype(int))
    return {
        "steps": steps,
        "skipped_steps": skipped,
        "images": images,
        "epochs_started": epochs,
        "cpu_seconds": spent(),
        "wall_seconds": time.perf_counter() - wall_start,
        "images_per_cpu_second": images / max(spent(), 1e-9),
        "loss_first": float(np.mean(values[:ends])) if values else None,
        "loss_last": float(np.mean(values[-ends:])) if values else None,
        "loss_trace": [losses[i] for i in keep] if values else [],
    }


# --------------------------------------------------------------------------- our loops


def load_configs(args: argparse.Namespace, path: str, extra: list[str], run_dir: Path) -> Config:
    """The configuration at ``path`` on the benchmark's folders, with ``extra`` overrides."""
    overrides = [
        f"data.root={args.train_root}",
        f"eval.pairs={args.pairs}",
        f"eval.root={args.lfw_root}",
        "data.num_workers=0",  # loading counts in the process's CPU time
        "train.device=cpu",
        f"logging.out_dir={run_dir}",  # held-out pairs
        *extra,
    ]
    return load_config(REPO / path, overrides)


def setup_ours(cfg: Config, data: TrainingData, run_dir: Path, peer=None) -> tuple:
    """The Trainer of ``facenet-train`` (its default step) on our loader (P x K batches); the
    budget's schedule sets the rates, not the Trainer's."""
    trainer = build_trainer(cfg, data.num_classes, torch.device("cpu"), data.steps_per_epoch)
    trainer.scheduler = None

    def step(batch) -> tuple[float | None, int]:
        stats = trainer.train_step(*batch)
        return (None if "skipped" in stats else float(stats["loss"])), batch[0].shape[0]

    trainer.model.train()
    done = lambda: {"step_path": trainer.step.name}  # noqa: E731
    return trainer.core_model, trainer.optimizer, step, data, done


def setup_seed(cfg: Config, data: TrainingData, run_dir: Path, peer=None) -> tuple:
    """The seed's loop (``seed_train_step``, a faithful port: its triplet loss never reaches the
    model, so only its cross-entropy trains) on triplet batches of about P x K images from our
    loader.

    With a single hard triplet the seed's classifier forwards are batches of one image, which
    BatchNorm refuses in training mode (the original stops there): that step is skipped.
    """
    triplets = copy.deepcopy(cfg)
    triplets.data.dataset = "triplets"
    triplets.data.triplet_batch_size = max(1, cfg.data.p * cfg.data.k // 3)  # 3T ~ P x K
    data = build_data(triplets, run_dir)
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
    done = lambda: state.clear() or {}  # noqa: E731 (its variables keep the last graphs alive)
    return network, optimizer, step, data, done


def setup_plain(cfg: Config, data: TrainingData, run_dir: Path, peer=None) -> tuple:
    """The plain one-pass loop on the same P x K batches, each file decoded by torchvision and
    transformed alone as an ``ImageFolder`` does: one forward with grad, our miner on the
    detached embeddings, our triplet loss (+ the cross-entropy on the images the triplets use),
    backward, step."""
    d, ce_weight = cfg.data, cfg.loss.ce_weight
    folder = getattr(data.loader.dataset, "dataset", data.loader.dataset)  # under SeededSamples
    transform = build_transform(d.image_size, True, d.normalize, d.hflip, d.random_crop)

    def load(samples: list) -> tuple:  # each file decoded and transformed alone, every time
        images = [transform(decode_image(path, mode=ImageReadMode.RGB)) for path, _ in samples]
        return torch.stack(images), torch.tensor([label for _, label in samples])

    loader = DataLoader(folder.samples, batch_sampler=data.sampler, collate_fn=load)
    model = build_network(cfg, data.num_classes if ce_weight > 0 else None)  # loss.ce's head
    ce_loss = getattr(getattr(model, "classifier", None), "loss", None) or F.cross_entropy
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
                loss = loss + ce_weight * ce_loss(logits[used], labels[used], reduction="mean")
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (None if loss is None else loss.item()), images.shape[0]

    model.train()
    return model, optimizer, step, SimpleNamespace(loader=loader, sampler=data.sampler), dict


# Each setup: (cfg, data, run_dir, peer settings) -> (model, optimizer, step, data, done).
SETUPS = {"ours": setup_ours, "seed": setup_seed, "plain": setup_plain, **PEERS}


def train(method: str, cfg: Config, data, run_dir: Path, seconds: float, before=None, peer=None):
    """``(model in eval mode, training record)`` of one method from the seeded initial state;
    ``before(model)`` is called on the model before it trains (fine-tuning's first figures);
    ``peer``: the peers' :class:`PeerSettings` (default: theirs)."""
    torch.manual_seed(cfg.train.seed)  # every method starts from the same initial weights
    np.random.seed(cfg.train.seed)
    peer = peer or PeerSettings()
    model, optimizer, step, method_data, done = SETUPS[method](cfg, data, run_dir, peer)
    if before is not None:
        before(model.eval())
        model.train()
    print(f"{method}: training for {seconds:g} CPU seconds", flush=True)
    record = train_for_budget(step, optimizer, cfg, method_data, seconds)
    losses = record["loss_first"], record["loss_last"]
    print(f"{method}: {record['steps']} steps, loss %s -> %s" % losses, flush=True)
    return model.eval(), record | done()


# --------------------------------------------------------------------------- evaluation


def evaluate(model, pairs, eval_cfg: Config, image_size) -> dict:
    """The verification figures of ``model`` on ``pairs`` with ``eval_cfg``'s evaluation
    settings, and the CPU and wall seconds the evaluation took."""
    cpu, wall = time.process_time(), time.perf_counter()
    settings, normalize = verify_settings(eval_cfg), eval_cfg.data.normalize
    result = verify(model, pairs, image_size, settings, normalize=normalize, device="cpu")
    return figures(result) | {
        "pairs": len(pairs),
        "eval_cpu_seconds": time.process_time() - cpu,
        "eval_wall_seconds": time.perf_counter() - wall,
    }


def evaluate_sets(model, data: TrainingData, cfg: Config, name: str, publisher=None) -> dict:
    """LFW (the test pairs), the held-out identities (the validation pairs) and, given the
    ``publisher``'s configuration, LFW as it evaluates (at the model's input size), printed."""
    sets = {"lfw": (data.test_pairs, cfg), "heldout": (data.val_pairs, cfg)}
    if publisher is not None:
        sets["publisher_lfw"] = (data.test_pairs, publisher)
    out = {}
    for key, (pairs, eval_cfg) in sets.items():
        if key == "publisher_lfw" and evaluation_of(publisher) == evaluation_of(cfg):
            out[key] = out["lfw"]  # the same protocol: LFW's figure is the publisher's
        elif pairs is not None:
            out[key] = evaluate(model, pairs, eval_cfg, cfg.data.image_size)
            print(figures_line(f"{name} {key}", out[key]), flush=True)
    return out


def evaluation_of(cfg: Config) -> tuple:
    """What decides how a configuration evaluates: verify's settings and the standardisation."""
    return verify_settings(cfg), cfg.data.normalize


def describe(cfg: Config, data: TrainingData) -> dict:
    """The resolved sections that define the training (folders and logging left out), and what
    the methods trained on and were tested with."""
    resolved = config_to_dict(cfg)
    folder = getattr(data.loader.dataset, "dataset", data.loader.dataset)
    pairs = {"lfw_pairs": data.test_pairs, "heldout_pairs": data.val_pairs}
    counts = {key: None if p is None else len(p) for key, p in pairs.items()}
    skipped = None if data.test_pairs is None else len(data.test_pairs.skipped)
    return {
        "settings": {k: resolved[k] for k in ("data", "model", "mining", "loss", "optim", "eval")},
        "data": {"train_identities": data.num_classes, "train_images": len(folder), **counts}
        | {"lfw_pairs_skipped": skipped, "notes": data.notes},
    }


# --------------------------------------------------------------------------- the two parts


def from_scratch(args: argparse.Namespace, run_dir: Path, report: dict) -> None:
    """Train each method for the budget once per seed (``train.seed`` onwards) and evaluate
    it; the report, with each method's figures over its runs so far, is written after each."""
    part = report["scratch"] = {"config": SCRATCH_CONFIG, "overrides": args.overrides}
    first = load_configs(args, SCRATCH_CONFIG, args.overrides, run_dir).train.seed
    part |= {"seeds": [first + s for s in range(args.seeds)], "peers": asdict(args.peer)}
    for seed in part["seeds"]:
        # The held-out identities and pairs are read back from run_dir: the same for each seed.
        cfg = load_configs(args, SCRATCH_CONFIG, [*args.overrides, f"train.seed={seed}"], run_dir)
        data = build_data(cfg, run_dir)
        part |= describe(cfg, data)
        for method in args.methods:
            model, run = train(method, cfg, data, run_dir, args.cpu_seconds, peer=args.peer)
            runs = part.setdefault(method, {"runs": []})["runs"]
            runs.append(run | {"seed": seed} | evaluate_sets(model, data, cfg, method))
            part[method]["over_seeds"] = over_seeds(runs)
            for split in ("lfw", "heldout") if len(runs) > 1 else ():
                print(over_seeds_line(method, split, part[method]["over_seeds"]), flush=True)
            write_report(args.json, report)


def over_seeds(runs: list[dict]) -> dict:
    """Each split's figures (``accuracy_std``: the spread over the folds) and the images per
    CPU second: ``{"mean", "std"}`` over the runs (std with ddof 1; None for one run). A
    figure a run could not resolve (VAL at a FAR below its pairs' resolution: words, not a
    number) leaves that figure's mean None."""

    def spread(values: list) -> dict:
        if not all(isinstance(value, (int, float)) for value in values):
            return {"mean": None, "std": None}
        std = float(np.std(values, ddof=1)) if len(values) > 1 else None
        return {"mean": float(np.mean(values)), "std": std}

    out = {"runs": len(runs)}
    out["images_per_cpu_second"] = spread([run["images_per_cpu_second"] for run in runs])
    for split in ("lfw", "heldout"):
        if all(split in run for run in runs):
            out[split] = {key: spread([run[split][key] for run in runs]) for key in SEED_FIGURES}
    return out


def over_seeds_line(method: str, split: str, summary: dict) -> str:
    """``ours lfw over 3 seeds: acc 0.8300 ± 0.0050 (seeds), fold std 0.0163, AUC ...``."""
    figure = summary[split]
    acc, auc, speed = figure["accuracy_mean"], figure["auc"], summary["images_per_cpu_second"]
    return (
        f"{method} {split} over {summary['runs']} seeds: acc {acc['mean']:.4f} ± "
        f"{acc['std']:.4f} (seeds), fold std {figure['accuracy_std']['mean']:.4f}, AUC "
        f"{auc['mean']:.4f} ± {auc['std']:.4f}, {speed['mean']:.0f} images / CPU s"
    )


def finetune(args: argparse.Namespace, run_dir: Path, report: dict) -> None:
    """The published model on LFW (two evaluations) before and after triplet fine-tuning."""
    extra = [f"model.weights={args.weights}", *args.finetune_overrides]
    cfg = load_configs(args, FINETUNE_CONFIG, extra, run_dir)
    publisher_overrides = ["data.num_workers=0", *args.publisher_overrides]
    publisher = load_config(REPO / PUBLISHER_CONFIG, publisher_overrides)
    data = build_data(cfg, run_dir)
    part = report["finetune"] = {"config": FINETUNE_CONFIG, "weights": args.weights}
    part |= describe(cfg, data)

    def before(model) -> None:
        part["before"] = evaluate_sets(model, data, cfg, "before:", publisher)
        write_report(args.json, report)

    seconds = args.finetune_cpu_seconds
    model, part["training"] = train("ours", cfg, data, run_dir, seconds, before)
    part["after"] = evaluate_sets(model, data, cfg, "after:", publisher)
    write_report(args.json, report)


# --------------------------------------------------------------------------- command line


def measure(args: argparse.Namespace) -> dict:
    """Run the measurements; the JSON report is rewritten after each one."""
    args.finetune_cpu_seconds = args.finetune_cpu_seconds or args.cpu_seconds
    args.peer = PeerSettings(**dict(args.peer))
    report = {
        "benchmark": "real faces: LFW after the same CPU budget; fine-tuning a published model",
        "command": " ".join(["python -m benchmarks.bench_real_faces", *sys.argv[1:]]),
        "cpu_seconds_per_method": args.cpu_seconds,
        "finetune_cpu_seconds": args.finetune_cpu_seconds if args.weights else None,
        "machine": describe_machine("cpu"),
    }
    with tempfile.TemporaryDirectory() as temporary:
        run_dir = args.out or Path(temporary)
        run_dir.mkdir(parents=True, exist_ok=True)
        if args.methods:
            from_scratch(args, run_dir, report)
        if args.weights:
            finetune(args, run_dir, report)
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--json``: rewritten after each measurement)."""
    parser = benchmark_parser(__doc__, quick=False)
    add = parser.add_argument
    folder = partial(input_path, folder=True)
    add("--train-root", type=folder, required=True, help="aligned root/<identity>/<image>")
    add("--lfw-root", type=folder, required=True, help="aligned LFW: Name/Name_NNNN.jpg")
    add("--pairs", type=input_path, required=True, help="LFW's pairs.txt (View 2)")
    add("--weights", type=input_path, help="a published model to fine-tune")
    add("--cpu-seconds", type=positive_float, default=360.0, help="budget per method")
    add("--finetune-cpu-seconds", type=positive_float, help="default: --cpu-seconds")
    add("--seeds", type=positive_int, default=1, help="runs of each method: train.seed onwards")
    add("--peer", type=peer_setting, action="append", default=[], metavar="K=V")
    add("--methods", nargs="*", default=list(SETUPS), choices=SETUPS)
    for part in ("", "finetune-", "publisher-"):  # overrides of each configuration
        dest = part.replace("-", "_") + "overrides"
        add(f"--{part}set", dest=dest, action="append", default=[], metavar="K=V")
    add("--out", type=partial(output_path, folder=True), help="run folder; default: temporary")
    return run_benchmark(parser, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
