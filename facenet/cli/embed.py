"""Embed every image under a folder with a trained model: ``--checkpoint CKPT --images DIR``.

DIR holds identity folders (the folder name is the label) or images directly; unreadable files
are named on stderr and left out. ``--out FILE.npz`` holds ``embeddings`` (N, D) float32,
``paths``, ``labels`` ((0,) for a flat folder), how they were made (``flip``, ``preprocess``,
``weights_sha256``) and the threshold recorded for them (``--threshold``, or the one saved
with the model, or facenet-evaluate's in ``--metrics``, e.g. ``--threshold-at far_1e-3``, when
chosen for these weights and this preparation; otherwise an error saying what differs).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import numpy as np

from facenet.cli.common import (
    add_device_argument,
    add_out_arguments,
    add_threads_argument,
    check_outputs,
    parse_device,
    positive_int,
    run_command,
)
from facenet.distributed import set_threads
from facenet.errors import DataError, FacenetError
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.report import PROVENANCE, ThresholdRecord
from facenet.files import write_atomic
from facenet.metric.distances import DISTANCE_NAMES
from facenet.wings.after_training.embed import FolderEmbeddings, embed_folder
from facenet.wings.after_training.identify import (
    check_threshold,
    checked_threshold,
    read_threshold,
)
from facenet.wings.after_training.loading import load_model

MADE_WITH = ("weights_sha256", "flip", "preprocess")  # how the file's embeddings were made


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-embed``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint, model.pt or port file")
    parser.add_argument("--images", required=True, help="identity folders or a flat folder")
    add_out_arguments(parser, "the .npz file to write")
    parser.add_argument("--flip", action="store_true", help="concatenate flipped-image embeddings")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="images per forward")
    add_threshold_arguments(parser)
    add_device_argument(parser, "cpu")
    add_threads_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def add_threshold_arguments(parser: argparse.ArgumentParser, recorded: bool = True) -> None:
    """``--threshold``, ``--distance``, ``--metrics`` (``--set``, ``--threshold-at``) and, for
    a threshold ``recorded`` with the output, ``--no-threshold``."""
    parser.add_argument("--threshold", type=float, help="this threshold, not a stored one")
    parser.add_argument("--distance", choices=DISTANCE_NAMES, help="with --threshold (squared)")
    if recorded:
        parser.add_argument("--no-threshold", action="store_true", help="record no threshold")
    parser.add_argument("--metrics", help="metrics.json or summary.json holding the threshold")
    parser.add_argument("--set", dest="set_name", help="the --bin set of --metrics to take")
    parser.add_argument(
        "--threshold-at",
        metavar="KEY",
        help="a deployable threshold of --metrics: accuracy, far_1e-3, far_1e-4 (metrics.json's "
        "deployable_thresholds; default: its threshold, the mean of the folds')",
    )


def flag_threshold(args) -> ThresholdRecord | None:
    """``--threshold`` (squared unless ``--distance``), else the threshold of ``--metrics``, else
    None; a DataError for a flag without the one it goes with."""
    for flag, value in (("--set", args.set_name), ("--threshold-at", args.threshold_at)):
        if value and not args.metrics:
            raise DataError(f"{flag} goes with --metrics (the file whose threshold to take)")
    if args.distance is not None and args.threshold is None:
        raise DataError("--distance goes with --threshold (a saved threshold has its own)")
    if args.threshold is not None:
        distance = args.distance or "squared"
        check_threshold(args.threshold, distance, "--threshold")
        return ThresholdRecord(args.threshold, distance, chosen_on="--threshold")
    if not args.metrics:
        return None
    record = read_threshold(args.metrics, args.set_name, args.threshold_at)
    if record is None:
        raise DataError(f"{args.metrics}: holds no threshold and threshold_distance")
    return record


def model_threshold(trained, at_hand: dict, args) -> tuple[ThresholdRecord | None, str]:
    """The threshold to record with a model's embeddings or export (``--threshold`` as chosen
    for ``at_hand``; else one of ``--metrics`` or ``trained`` that fits it), and a line on it."""
    on = {"--threshold": args.threshold is not None, "--no-threshold": args.no_threshold}
    given = [flag for flag, value in {**on, "--metrics": args.metrics}.items() if value]
    if len(given) > 1:
        raise DataError(f"{' and '.join(given)} contradict each other")
    record = flag_threshold(args)
    if args.no_threshold:
        return None, "threshold: none recorded (--no-threshold)"
    if args.threshold is not None:
        record = replace(record, **{k: at_hand.get(k) for k in (*PROVENANCE, "epoch")})
        return record, f"threshold: {record.describe()}"
    remedy = "give another --metrics or --threshold"
    if record is None:
        remedy = "give --threshold (and --distance) chosen for them, or --no-threshold"
        record = trained.threshold_record()
    if record is None:
        return None, f"threshold: none saved with {trained.path} (identify will need --threshold)"
    what = f"the embeddings of {trained.path} made here"
    record = checked_threshold(record, at_hand, what, remedy)
    return record, f"threshold: {record.describe()}"


def npz_arrays(result: FolderEmbeddings, at_hand: dict, threshold: ThresholdRecord | None) -> dict:
    """The output file's arrays (strings as numpy unicode: read without pickles); ``at_hand``:
    ``TrainedModel.preparation``."""
    labelled = any(result.labels)
    arrays = {
        "embeddings": result.embeddings.numpy(),
        "paths": np.array(result.paths, dtype=str),
        "labels": np.array(result.labels if labelled else [], dtype=str),
        **{key: np.array(at_hand[key]) for key in MADE_WITH},
    }
    if threshold is not None:
        arrays["threshold"] = np.array(threshold.value)
        arrays["threshold_distance"] = np.array(threshold.distance)
        arrays["threshold_record"] = np.array(json.dumps(threshold.to_dict()))
    return arrays


def _embed(args: argparse.Namespace) -> None:
    """Embed the folder and write the file."""
    set_threads(args.threads)
    inputs = {"--checkpoint": args.checkpoint, "--metrics": args.metrics}
    check_outputs(args, files=inputs, folders={"--images": args.images})
    trained = load_model(args.checkpoint)
    device = parse_device(args.device)
    at_hand = trained.preparation(flip=args.flip)
    # before the work: a saved threshold that does not fit stops here
    threshold, line = model_threshold(trained, at_hand, args)
    settings = VerifySettings(flip=args.flip, batch_size=args.batch_size)
    result = embed_folder(
        trained.model.to(device),
        args.images,
        trained.image_size,
        settings,
        trained.normalize,
        device,
        not args.no_progress,
    )
    for path, reason in result.unreadable:
        print(f"warning: unreadable image left out: {path}: {reason}", file=sys.stderr)
    if not result.paths:
        raise FacenetError(f"{args.images}: no readable image")
    write_atomic(args.out, lambda fh: np.savez(fh, **npz_arrays(result, at_hand, threshold)))
    n, dim = result.embeddings.shape
    print(
        f"embedded {n} images ({dim}-D) from {args.images} into {args.out}; "
        f"{len(result.unreadable)} unreadable files left out"
    )
    print(line)


def main(argv: list[str] | None = None) -> int:
    """Embed a folder; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _embed(args))


if __name__ == "__main__":
    sys.exit(main())
