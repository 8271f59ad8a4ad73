"""Write an LFW-format pairs file for a root/<identity>/<image> folder: ``facenet-make-pairs ROOT``.

Folds of same and different pairs are drawn with a seed, no identity in two folds (as in LFW),
so any held-out set can be evaluated like LFW with ``facenet-evaluate`` or ``eval.pairs``.
Only the output file is written, never over an existing one; the image folders are never touched.
A file written outside ROOT records ROOT, relative to itself, as its header's third field, so
``facenet-evaluate --pairs`` finds the images without ``--root``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from facenet.cli.common import int_in, positive_int, run_command
from facenet.config import RANGES
from facenet.data.images import IMAGE_EXTENSIONS
from facenet.data.pairs import generate_pairs, scan_identities, write_pairs
from facenet.errors import DataError
from facenet.files import check_not_inputs


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-make-pairs``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="image folder holding one sub-folder per identity")
    parser.add_argument("--out", type=Path, help="pairs file (default: <root>/pairs.txt)")
    parser.add_argument(
        "--folds", type=positive_int, default=10, help="number of folds (default 10)"
    )
    parser.add_argument(
        "--pairs-per-fold",
        type=positive_int,
        default=300,
        help="same and different pairs per fold",
    )
    parser.add_argument(
        "--seed",
        type=int_in(0, RANGES["train.seed"].high),
        default=0,
        help="random seed (default 0)",
    )
    parser.add_argument(
        "--shared-identities",
        action="store_true",
        help="let folds share identities (for sets too small for identity-disjoint folds)",
    )
    return parser


def _make_pairs(args: argparse.Namespace) -> int:
    """Draw the folds, write the file and say what it holds; returns the exit code."""
    root = args.root
    out = args.out or root / "pairs.txt"
    check_not_inputs([out], {"ROOT": root})  # its default lies inside ROOT: a folder, not read
    if os.path.lexists(out):  # LFW's own pairs.txt, or a user's file: never replaced
        raise DataError(f"{out} exists: remove it or give another --out")
    if out.suffix.lower() in IMAGE_EXTENSIONS:  # in an identity folder it would be an image
        raise DataError(f"--out {out}: a pairs file named like an image")
    images = scan_identities(root)
    try:
        folds = generate_pairs(
            images,
            n_folds=args.folds,
            pairs_per_fold=args.pairs_per_fold,
            seed=args.seed,
            disjoint_folds=not args.shared_identities,
        )
    except DataError as err:  # name the flags that would help
        hint = "" if args.shared_identities else "; --shared-identities lets folds share them"
        raise DataError(
            f"{err} (--folds {args.folds}, --pairs-per-fold {args.pairs_per_fold}: lower "
            f"them{hint})"
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    # Outside ROOT, the header records it (relative to the file) so that readers find the images.
    recorded = os.path.relpath(root, out.parent)
    write_pairs(out, folds, None if recorded == "." else recorded)
    used = sum(1 for files in images.values() if files)  # empty folders: ignored, warned
    print(
        f"wrote {out}: {args.folds} folds x ({args.pairs_per_fold} same + "
        f"{args.pairs_per_fold} different) pairs from {used} identities under {root}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the pairs file; returns the exit code (2 for bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _make_pairs(args))


if __name__ == "__main__":
    sys.exit(main())
