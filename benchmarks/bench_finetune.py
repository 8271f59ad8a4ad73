#!/usr/bin/env python
"""Fine-tuning a published model on faces it did not see, measured before and after.

For each domain of the shared data (AT&T/ORL, Extended Yale B) and one published model, the
command prepares the faces with the model's alignment preset, splits the people in two with a
seeded draw (20 to test, two a fold: ``test_pairs.txt`` from ``facenet-make-pairs``; the rest
to fine-tune on), evaluates the published model on the test pairs with its publisher's
protocol, fine-tunes it with the model's recipe (``configs/finetune_*.yaml``, plus ``--set``
overrides) and evaluates ``best.pt`` the same way; with ``--lfw`` LFW's 6,000 pairs before
and after as well. Crops, splits and the "before" figures are kept in ``--work`` and reused.

    python -m benchmarks.bench_finetune --data ~/realdata --work ~/finetune \\
        --model mobilefacenet --domain orl --domain yaleb [--lfw] [--set KEY=VALUE ...] \\
        --json finetune.json

Extended Yale B's crops are its authors' (168 x 192, the face filling the frame), under 64
lightings of one pose per person: MTCNN finds no face in most of the darker ones, so each
person's face is found once, in the frontally lit image (``*_P00A+000E+00``, the frame padded
by half its side so that MTCNN sees the face whole), and that face places all 64 images.
docs/finetuning.md reports the figures.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from PIL import Image, ImageOps

from benchmarks.bench_published import REPO, run_command
from benchmarks.measure import benchmark_parser, input_path, output_path, run_benchmark
from facenet.cli import align, evaluate, make_pairs, train
from facenet.data.folder import list_images

FIGURES = ("accuracy_mean", "accuracy_std", "auc", "eer", "val")


@dataclass(frozen=True)
class Model:
    """A published model to fine-tune: its weights (relative to ``--data``; None: the
    ``--sandberg-pt`` conversion), alignment preset, evaluation and recipe configurations."""

    weights: str | None
    preset: str
    evaluation: str
    recipe: str


@dataclass(frozen=True)
class Domain:
    """A folder of ``<person>/<image>`` in the shared data; ``pairs_per_fold`` same and as
    many different pairs in each of 10 person-disjoint folds; ``reference``: the suffix of the
    image whose face places all of a person's images (None: each image's own face)."""

    folder: str
    pairs_per_fold: int
    reference: str | None = None
    test_people: int = 20  # 2 a fold: each fold has pairs of both kinds


MODELS = {
    "mobilefacenet": Model(
        "models/mobilefacenet_068.ckpt",
        "sphereface",
        "configs/lfw_mobilefacenet.yaml",
        "configs/finetune_own_faces.yaml",
    ),
    "sandberg": Model(
        None, "sandberg", "configs/lfw_sandberg.yaml", "configs/finetune_sandberg.yaml"
    ),
}
DOMAINS = {
    # 2 test people a fold, 45 same pairs each: every same pair is used
    "orl": Domain("att_faces_orl", 90),
    "yaleb": Domain("extended_yale_b_cropped", 1000, reference="_P00A+000E+00"),
}


def align_by_reference(src: Path, dst: Path, preset: str, reference: str) -> None:
    """Each person's images cropped with the face found in its ``reference`` image, the frames
    padded with black by half their longer side (see the module's docstring)."""
    from facenet.wings.align.aligner import Aligner, AlignSettings

    aligner = Aligner(AlignSettings.from_preset(preset, detect_size=0))
    people = defaultdict(list)
    for path, person in zip(*list_images(src)):
        people[person].append(Path(path))
    for person, paths in sorted(people.items()):
        images = {path: _padded(path) for path in paths}
        ref = next(path for path in paths if path.stem.endswith(reference))
        (face,) = aligner.detect([images[ref]])
        if face is None:
            raise SystemExit(f"{ref}: no face found in the reference image")
        for path, image in images.items():
            target = dst / person / path.with_suffix(".png").name
            target.parent.mkdir(parents=True, exist_ok=True)
            aligner.crop(image, face).save(target)


def _padded(path: Path) -> Image.Image:
    image = Image.open(path).convert("RGB")
    return ImageOps.expand(image, border=max(image.size) // 2, fill=0)


def prepare(args, model: Model, domain: Domain) -> Path:
    """``work/<preset>/<domain>/`` with ``train/`` and ``test/`` (``domain.test_people``
    drawn with ``--split-seed``) and ``test_pairs.txt``; made once."""
    folder = args.work / model.preset / Path(domain.folder).name
    if (folder / "test_pairs.txt").is_file():  # written last
        return folder
    crops = folder / "all"
    src = args.data / domain.folder
    if not crops.is_dir():
        if domain.reference:
            align_by_reference(src, crops, model.preset, domain.reference)
        else:
            run_command(
                align.main, [str(src), str(crops), "--preset", model.preset, "--no-progress"]
            )
    people = sorted(p.name for p in crops.iterdir() if p.is_dir())
    random.Random(args.split_seed).shuffle(people)
    cut = len(people) - domain.test_people
    for part, chosen in (("train", people[:cut]), ("test", people[cut:])):
        for person in chosen:
            shutil.copytree(crops / person, folder / part / person, dirs_exist_ok=True)
    pairs = folder / "test_pairs.txt"
    per_fold = str(domain.pairs_per_fold)
    run_command(
        make_pairs.main, [str(folder / "test"), "--out", str(pairs), "--pairs-per-fold", per_fold]
    )
    return folder


def measure_pairs(
    args, model: Model, checkpoint: Path, pairs: Path, root: Path, out: Path, reuse: bool = False
) -> dict:
    """The publisher's protocol on ``pairs``: accuracy, its fold std, AUC, EER, VAL
    (``reuse``: an earlier evaluation in ``out``, as the published weights' are)."""
    if not (reuse and (out / "metrics.json").is_file()):
        argv = ["--config", str(REPO / model.evaluation), "--checkpoint", str(checkpoint)]
        argv += ["--pairs", str(pairs), "--root", str(root), "--threads", str(args.threads)]
        run_command(evaluate.main, argv + ["--out", str(out), "--overwrite"])
    metrics = json.loads((out / "metrics.json").read_text())
    return {key: metrics[key] for key in FIGURES if key in metrics}


def fine_tune(args, model: Model, weights: Path, folder: Path, out: Path) -> dict:
    """The recipe with ``--set`` overrides, as docs/finetuning.md runs it: the held-out
    people of ``train/`` validate (``best.pt``), the test pairs are evaluated at the end."""
    argv = ["--config", str(REPO / model.recipe), "--set", f"model.weights={weights}"]
    data = {"data.root": "train", "eval.pairs": "test_pairs.txt", "eval.root": "test"}
    for key, value in data.items():
        argv += ["--set", f"{key}={folder / value}"]
    for override in (f"train.seed={args.seed}", *args.set):
        argv += ["--set", override]
    cpu = time.process_time()
    run_command(
        train.main, argv + ["--out", str(out), "--overwrite", "--threads", str(args.threads)]
    )
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "train_cpu_seconds": time.process_time() - cpu}


def lfw(args, model: Model, checkpoint: Path, out: Path, reuse: bool = False) -> dict:
    """LFW's 6,000 pairs on crops of the model's preset (aligned once in ``--work``)."""
    crops = args.work / f"lfw_{model.preset}"
    if not (crops / "align_report.tsv").is_file():
        src = str(args.data / "lfw_pairs_150")
        run_command(align.main, [src, str(crops), "--preset", model.preset, "--no-progress"])
    return measure_pairs(args, model, checkpoint, args.data / "lfw_pairs.txt", crops, out, reuse)


def measure(args) -> dict:
    model = MODELS[args.model]
    weights = args.data / model.weights if model.weights else args.sandberg_pt
    if weights is None:
        raise SystemExit("--model sandberg needs --sandberg-pt (facenet-convert's output)")
    report = {"benchmark": "fine-tuning before and after", "model": args.model, "domains": {}}
    report["set"], report["seed"], report["split_seed"] = args.set, args.seed, args.split_seed
    run = args.work / args.model / (args.name or "run")
    for name in args.domain:
        folder = prepare(args, model, DOMAINS[name])
        pairs, people = folder / "test_pairs.txt", folder / "test"
        before = run.parent / f"before_{name}"
        row = {"before": measure_pairs(args, model, weights, pairs, people, before, reuse=True)}
        row |= fine_tune(args, model, weights, folder, run / name)
        # The run's own test of best.pt (the last model without validation): the recipe's
        # evaluation is the model's (tests/test_bench_finetune.py), as the "before" figures.
        test = row["summary"]["test"]
        chosen = "best" if "best" in test else "last"
        row["after"] = {key: test[chosen][key] for key in FIGURES if key in test[chosen]}
        best = run / name / ("best.pt" if chosen == "best" else "last.pt")
        if args.lfw:
            row["lfw_before"] = lfw(args, model, weights, run.parent / "before_lfw", reuse=True)
            row["lfw_after"] = lfw(args, model, best, run / f"{name}_lfw")
        error = [1 - row[k]["accuracy_mean"] for k in ("before", "after")]
        row["error_cut"] = 1 - error[1] / error[0] if error[0] else None
        print(f"{name}: error {error[0]:.4f} -> {error[1]:.4f}", flush=True)
        report["domains"][name] = row
    return report


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser(__doc__, quick=False)
    add = parser.add_argument
    add("--data", type=partial(input_path, folder=True), required=True, help="the real data")
    add("--work", type=partial(output_path, folder=True), required=True, help="crops, runs")
    add("--model", choices=sorted(MODELS), required=True)
    add("--domain", choices=sorted(DOMAINS), action="append", required=True)
    add("--sandberg-pt", type=input_path, help="20180408-102900 converted by facenet-convert")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    add("--name", help="the run's folder under WORK/MODEL (default: run)")
    add("--seed", type=int, default=0, help="train.seed")
    add("--split-seed", type=int, default=0, help="which people train and which test")
    add("--lfw", action="store_true", help="LFW before and after too")
    return run_benchmark(parser, argv, measure)


if __name__ == "__main__":
    sys.exit(main())
