#!/usr/bin/env python
"""Write an LFW-format pairs.txt for a root/<identity>/ image folder: ``make_pairs.py ROOT``.

Folds x (same + different) pairs are drawn with a seed, no identity in two folds (as in LFW),
so any held-out set can be evaluated like LFW with ``scripts/evaluate.py`` or ``eval.pairs``.
Images must be named ``<identity>_<NNNN>.<ext>``; for other names, ``--link-dir DIR`` first
builds an LFW-named view of the folder (symbolic links, or copies where links fail) and writes
the pairs there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from facenet.data.pairs import generate_pairs, scan_identities, write_pairs  # noqa: E402
from facenet.errors import FacenetError  # noqa: E402


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: expected an integer >= 1")
    return value


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``make_pairs.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="image folder holding one sub-folder per identity")
    parser.add_argument("--out", default=None, help="pairs file (default: <root>/pairs.txt)")
    parser.add_argument(
        "--folds", type=_positive_int, default=10, help="number of folds (default 10)"
    )
    parser.add_argument(
        "--pairs-per-fold",
        type=_positive_int,
        default=300,
        help="same and different pairs per fold",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--shared-identities",
        action="store_true",
        help="let folds share identities (for sets too small for identity-disjoint folds)",
    )
    parser.add_argument(
        "--link-dir",
        default=None,
        help="build DIR/<identity>/<identity>_<NNNN>.<ext> links to the sorted images first "
        "(for folders not named like LFW); the pairs then refer to DIR",
    )
    return parser


def _link_or_copy(source: Path, target: Path) -> None:
    """A symbolic link to ``source`` at ``target``, or a copy where links are not allowed."""
    if target.exists() or target.is_symlink():
        target.unlink()
    try:
        os.symlink(source.resolve(), target)
    except OSError:
        shutil.copy2(source, target)


def build_lfw_view(root: Path, view: Path) -> dict[str, list[str]]:
    """Link ``root/<identity>/<k-th image>`` as ``view/<identity>/<identity>_<k:04d><ext>``.

    Args:
        root: the source image folder.
        view: the folder to fill (created if absent).

    Returns:
        ``{identity: [linked file name, ...]}`` for :func:`generate_pairs`.
    """
    listing = scan_identities(root)
    renamed = {}
    for identity, files in listing.items():
        (view / identity).mkdir(parents=True, exist_ok=True)
        renamed[identity] = []
        for k, name in enumerate(files, start=1):
            new_name = f"{identity}_{k:04d}{Path(name).suffix.lower()}"
            _link_or_copy(root / identity / name, view / identity / new_name)
            renamed[identity].append(new_name)
    return renamed


def main(argv: list[str] | None = None) -> int:
    """Write the pairs file; returns the exit code (2 for bad input)."""
    args = get_args_parser().parse_args(argv)
    root = Path(args.root)
    try:
        if args.link_dir is not None:
            images = build_lfw_view(root, Path(args.link_dir))
            root = Path(args.link_dir)
        else:
            images = scan_identities(root)
        folds = generate_pairs(
            images,
            n_folds=args.folds,
            pairs_per_fold=args.pairs_per_fold,
            seed=args.seed,
            disjoint_folds=not args.shared_identities,
        )
        out = Path(args.out) if args.out else root / "pairs.txt"
        write_pairs(out, folds)
    except (FacenetError, OSError) as err:  # anything else is a bug: keep its traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: {args.folds} folds x ({args.pairs_per_fold} same + "
        f"{args.pairs_per_fold} different) pairs from {len(images)} identities under {root}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
