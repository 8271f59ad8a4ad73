"""Export a trained model: ``--checkpoint CKPT --format onnx|pt2|weights --out FILE``.

``onnx`` and ``pt2`` are checked against the eager model on a batch of another size and written
only within ``--tolerance``. The threshold carried is ``--threshold``, or the model's saved
threshold when it was chosen for these weights as exported (no flip, no mean subtraction,
``resize`` preprocessing); a threshold chosen otherwise is an error naming what differs.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from facenet.cli.common import (
    add_out_arguments,
    add_threads_argument,
    check_outputs,
    run_command,
)
from facenet.cli.embed import add_threshold_arguments, model_threshold
from facenet.distributed import set_threads
from facenet.errors import DataError
from facenet.sizes import image_hw
from facenet.wings.after_training.export import (
    CHECK_BATCH,
    FORMATS,
    ONNX_NAMES,
    PARITY_TOLERANCE,
    export_model,
)
from facenet.wings.after_training.loading import load_model


def _tolerance(text: str) -> float:
    """An argparse ``type``: a finite number >= 0. NaN fails every comparison, so the parity
    check would only complain after the whole export."""
    value = float(text)  # not a number: argparse's "invalid _tolerance value" line
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-export``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint, model.pt or port file")
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    add_out_arguments(parser, "the file to write")
    parser.add_argument(
        "--tolerance",
        type=_tolerance,
        help=f"largest |exported - eager| (onnx, pt2; default {PARITY_TOLERANCE:g})",
    )
    add_threshold_arguments(parser)
    add_threads_argument(parser)
    return parser


def _export(args: argparse.Namespace) -> None:
    if args.format == "weights" and args.tolerance is not None:  # no parity check to bound
        raise DataError("--tolerance goes with --format onnx or pt2: weights are not re-run")
    args.tolerance = PARITY_TOLERANCE if args.tolerance is None else args.tolerance
    set_threads(args.threads)
    check_outputs(args, files={"--checkpoint": args.checkpoint, "--metrics": args.metrics})
    trained = load_model(args.checkpoint)
    threshold, line = model_threshold(trained, trained.preparation(), args)
    trained.verification = {} if threshold is None else threshold.to_dict()
    diff = export_model(trained, args.format, args.out, args.tolerance)
    height, width = image_hw(trained.image_size)
    images, embeddings = ONNX_NAMES  # the ONNX graph's names; the other formats' positions
    print(
        f"wrote {Path(args.out)} ({args.format}: {images} (B, 3, {height}, {width}) -> "
        f"{embeddings} (B, {trained.embedding_dim}))"
    )
    print(line)
    if args.format != "weights":
        print(
            f"parity: max |exported - eager| = {diff:.3g} on a batch of {CHECK_BATCH}, traced "
            f"at another size: the batch is dynamic (limit {args.tolerance:g})"
        )


def main(argv: list[str] | None = None) -> int:
    """Export; returns the exit code (2: bad input or a parity failure)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _export(args))


if __name__ == "__main__":
    sys.exit(main())
