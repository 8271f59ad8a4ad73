"""Audit a training set against an evaluation: ``--checkpoint C --train ROOT --pairs P``.

Embeds the training folder (identity folders) and the images of the pairs file with the
checkpoint's preparation, then writes into ``--out`` a TSV of every row and a contact sheet of
the first ``--top`` of each finding: evaluation images with a training image closer than the
threshold (``overlap``, grouped by identity pair in ``overlap_identities.tsv``), those whose
pixels are a training image's (``duplicates``), training images nearer another identity's
centre than their own or far from it (``label_noise``), identities that look like one person
(``split_identities``); and ``summary.json``, with the verification figures on the pairs
without the overlapping identities. The threshold is the ``--quantile`` of the distances of
the evaluation's own same-identity pairs (docs/audit.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from facenet.cli.common import (
    add_device_argument,
    add_out_arguments,
    add_threads_argument,
    check_outputs,
    parse_device,
    positive_int,
    read_pairs_of,
    run_command,
)
from facenet.data.images import EVAL_PREPROCESS
from facenet.distributed import set_threads
from facenet.errors import DataError
from facenet.evaluation.embedding import FEATURES
from facenet.evaluation.presets import CLASSIC, EVAL_PRESETS, PUBLISHER_FIELDS, VerifySettings
from facenet.files import check_not_inputs, json_safe, write_text_atomic
from facenet.wings.after_training.loading import load_model
from facenet.wings.audit.embeddings import embed_images, embed_training
from facenet.wings.audit.neighbours import unit_rows
from facenet.wings.audit.report import (
    COLUMNS,
    SHEETS,
    audit_sets,
    pair_thresholds,
    verification_without,
    write_report,
)

OUTPUTS = [f"{name}.tsv" for name in COLUMNS] + [f"{name}.png" for name in SHEETS]


def _quantile(text: str) -> float:
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1)")
    return value


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-audit``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint, model.pt or port file")
    parser.add_argument("--train", required=True, help="the training set's identity folders")
    parser.add_argument("--pairs", required=True, help="the evaluation's pairs.txt")
    parser.add_argument("--root", help="image folder of --pairs (default: its folder)")
    parser.add_argument("--skip-missing", action="store_true", help="skip pairs missing images")
    parser.add_argument(
        "--quantile",
        type=_quantile,
        default=0.25,
        help="the threshold: this quantile of the evaluation's same-pair distances (0.25)",
    )
    parser.add_argument("--top", type=positive_int, default=12, help="rows of each sheet (12)")
    parser.add_argument("--cache", help="folder keeping the embeddings for the next audit")
    add_out_arguments(parser, "folder for the report", "runs/audit")
    embed = parser.add_argument_group("embedding (as facenet-evaluate's)")
    embed.add_argument("--preset", choices=tuple(EVAL_PRESETS), help="a publisher's evaluation")
    embed.add_argument("--flip", action="store_true", help="concatenate flipped-image embeddings")
    embed.add_argument("--preprocess", choices=EVAL_PREPROCESS, help="resize (default) or crop")
    embed.add_argument("--features", choices=FEATURES, help="unit (default) or raw")
    embed.add_argument("--folds", dest="n_folds", type=positive_int, help="folds (10)")
    embed.add_argument("--batch-size", type=positive_int, help="images per forward (128)")
    add_device_argument(embed, "cpu")
    add_threads_argument(parser)
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, the settings' defaults first, then ``--preset``'s; flags still win."""
    parser = get_args_parser()
    parser.set_defaults(**vars(CLASSIC))
    known, _ = parser.parse_known_args(argv)
    if known.preset:
        preset = EVAL_PRESETS[known.preset]
        parser.set_defaults(**{key: getattr(preset, key) for key in PUBLISHER_FIELDS})
    return parser.parse_args(argv)


def _embed(args: argparse.Namespace, trained, settings: VerifySettings, pairs) -> tuple:
    """(training set, evaluation images) embedded, or read back from ``--cache``."""
    device = parse_device(args.device)
    trained.model.to(device)
    train = embed_training(
        trained, args.train, settings, device, args.cache, progress=sys.stderr.isatty()
    )
    if "" in train.labels or len(set(train.labels)) < 2:
        raise DataError(f"--train {args.train}: expected two or more identity folders of images")
    evaluation = embed_images(trained, pairs.unique_paths()[0], settings, device, args.cache)
    return train, evaluation


def _summary(args, trained, settings, audit, tables: dict, verification: dict) -> dict:
    """summary.json: what was audited, how, and how much of each kind was found."""
    matched = {row["evaluation_identity"] for row in tables["overlap"]}
    return {
        "checkpoint": str(args.checkpoint),
        "weights_sha256": trained.weights_sha256(),
        "preparation": settings.provenance(),
        "training": {
            "root": str(args.train),
            "images": len(audit.train.paths),
            "identities": len(audit.identities.names),
            "lone_images": int((audit.identities.counts == 1).sum()),
            "unreadable": len(audit.train.unreadable),
        },
        "evaluation": {
            "pairs": str(args.pairs),
            "images": len(audit.evaluation.paths),
            "identities": len(set(audit.evaluation.labels)),
        },
        "threshold": {
            "value": audit.threshold,
            "quantile": args.quantile,
            "of": "the distances of the evaluation's same-identity pairs",
            "stranger": audit.stranger,
            "stranger_of": "the median distance of the evaluation's different pairs",
            "distance": "euclidean between unit embeddings",
        },
        "found": {name: len(rows) for name, rows in tables.items()}
        | {"evaluation_identities_matched": len(matched)},
        "verification": verification,
    }


def _lines(summary: dict) -> list[str]:
    """What the command prints of ``summary.json``."""
    sets, threshold = summary["training"], summary["threshold"]
    lines = [
        f"training: {sets['images']} images of {sets['identities']} identities "
        f"({sets['unreadable']} unreadable left out); evaluation: "
        f"{summary['evaluation']['images']} images",
        f"threshold {threshold['value']:.4f} (the {threshold['quantile']:g} quantile of the same "
        f"pairs' distances); a stranger's distance {threshold['stranger']:.4f} (the different "
        "pairs' median)",
    ]
    lines += [f"{name}: {count}" for name, count in summary["found"].items()]
    for name, figures in summary["verification"].items():
        if "not_measured" in figures:
            lines.append(f"{name}: not measured: {figures['not_measured']}")
        else:
            lines.append(
                f"{name}: accuracy {figures['accuracy_mean']:.4f}, {figures['n_pairs']} pairs"
            )
    return lines


def _audit(args: argparse.Namespace) -> None:
    """Embed both sets, find, write the report and print what was found."""
    set_threads(args.threads)
    files = {"--checkpoint": args.checkpoint, "--pairs": args.pairs}
    folders = {"--train": args.train, "--root": args.root}
    check_outputs(args, "summary.json", *OUTPUTS, files=files, folders=folders)
    check_not_inputs([args.cache] if args.cache else [], files, folders)  # --cache: written too
    settings = VerifySettings.of(args)
    trained = load_model(args.checkpoint)
    pairs = read_pairs_of(args)
    started = time.process_time()
    train, evaluation = _embed(args, trained, settings, pairs)
    embedded = time.process_time()
    _, index1, index2 = pairs.unique_paths()
    eval_unit = unit_rows(evaluation.embeddings)
    thresholds = pair_thresholds(eval_unit, index1, index2, pairs.issame, args.quantile)
    audit = audit_sets(train, evaluation, thresholds)
    tables = write_report(args.out, audit, args.top)
    matched = {row["evaluation_identity"] for row in tables["overlap"]}
    verification = verification_without(evaluation, pairs, index1, index2, matched, settings)
    summary = _summary(args, trained, settings, audit, tables, verification)
    summary["cpu_seconds"] = {
        "embedding": round(embedded - started, 1),
        "audit": round(time.process_time() - embedded, 1),
    }
    write_text_atomic(Path(args.out, "summary.json"), json.dumps(json_safe(summary), indent=1))
    print("\n".join(_lines(summary)))
    print(f"wrote {args.out}/summary.json, a .tsv and a .png of each finding")


def main(argv: list[str] | None = None) -> int:
    """Audit; returns the exit code (2: bad input)."""
    return run_command(lambda: _audit(_parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
