"""Verification with the LFW protocol: accuracy, VAL@FAR, AUC, EER and the ROC curve.

Two sources of pair distances:

- ``--distances FILE``: an ``.npz`` with arrays ``distances`` and ``issame``, or a ``.csv`` with
  rows ``distance,issame`` (issame 0/1 or true/false; an optional header row).
- ``--checkpoint PATH --pairs FILE``: a trained model (training checkpoint, ``model.pt`` weights
  export or facenet-pytorch file) embeds the images a pairs.txt names.
- ``--checkpoint PATH --bin FILE.bin [--bin ...]``: insightface verification sets (lfw, cfp_fp,
  agedb_30, calfw, cplfw), read without running anything in the pickle; one table row each.

Prints a table and writes ``metrics.json`` (with the verification threshold: the mean over
folds and the distance it applies to) and ``roc.png`` (``roc_<name>.png`` per ``--bin``) into
``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import zipfile
from pathlib import Path

import numpy as np

from facenet.config import load_config
from facenet.data.images import EVAL_PREPROCESS
from facenet.data.insightface_bin import BinImages, read_bin
from facenet.data.pairs import read_pairs
from facenet.distributed import resolve_device
from facenet.errors import DataError, FacenetError
from facenet.evaluation.embedding import embed_dataset, embed_pair_list
from facenet.evaluation.presets import EVAL_PRESETS, classic_thresholds
from facenet.evaluation.protocol import (
    DISTANCES,
    VerificationResult,
    evaluate_embeddings,
    evaluate_verification,
    plot_roc,
    val_at_far_label,
)
from facenet.files import write_text_atomic
from facenet.inference.loading import TrainedModel, load_model


class InputError(DataError):
    """A distances file or option that cannot be used; the message names it."""


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``evaluate.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--distances", help=".npz (distances, issame) or .csv (distance,issame)")
    source.add_argument(
        "--checkpoint", help="a checkpoint, model.pt or facenet-pytorch file to embed with"
    )
    parser.add_argument(
        "--config", help="a run configuration whose eval section gives the defaults below"
    )
    parser.add_argument("--pairs", help="pairs.txt (with --checkpoint)")
    parser.add_argument(
        "--bin",
        action="append",
        default=[],
        help="an insightface .bin verification set (with --checkpoint); repeatable",
    )
    parser.add_argument("--root", help="image folder of --pairs (default: its folder)")
    parser.add_argument("--out", default="runs/evaluate", help="where metrics.json and roc.png go")
    parser.add_argument("--folds", type=int, default=10, help="number of folds (default 10)")
    parser.add_argument("--far-target", type=float, default=1e-3, help="FAR for VAL (1e-3)")
    parser.add_argument(
        "--distance",
        choices=DISTANCES,
        default="squared",
        help="metric of the distances (chooses the threshold grids) or to measure embeddings",
    )
    parser.add_argument(
        "--preset",
        choices=tuple(EVAL_PRESETS),
        help="a publisher's evaluation (distance, flip, mean subtraction, preprocessing, grids; "
        "docs/reproduce.md); flags given still win",
    )
    parser.add_argument(
        "--grid",
        choices=("default", "classic"),
        default="default",
        help="threshold grids: from the distance, or the publishers' [0, 4) for any distance",
    )
    parser.add_argument(
        "--linear-far",
        dest="log_scale",
        action="store_false",
        help="linear FAR axis in the ROC (default: logarithmic, where VAL is read)",
    )
    parser.add_argument("--title", default=None, help="ROC plot title")
    embed = parser.add_argument_group("checkpoint mode")
    embed.add_argument("--flip", action="store_true", help="concatenate flipped-image embeddings")
    embed.add_argument(
        "--preprocess",
        choices=EVAL_PREPROCESS,
        default="resize",
        help="resize: 1.125 S then the centre S; crop: no resize, the centre S of aligned crops",
    )
    embed.add_argument("--subtract-mean", action="store_true", help="classic mean subtraction")
    embed.add_argument("--batch-size", type=int, default=128, help="images per forward")
    embed.add_argument("--device", default="cpu", help="torch device (default cpu)")
    embed.add_argument("--skip-missing", action="store_true", help="skip pairs missing images")
    return parser


# --------------------------------------------------------------------------- distances mode


def _load_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    # ValueError here is numpy's refusal of a pickle or of a damaged array header.
    damaged = (zipfile.BadZipFile, EOFError, ValueError)
    try:
        data = np.load(path, allow_pickle=False)
    except damaged as err:
        raise InputError(f"{path}: not a readable .npz archive ({err})") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise InputError(f"{path}: a single .npy array, not an .npz archive")
    with data:
        for key in ("distances", "issame"):
            if key not in data.files:
                raise InputError(f"{path}: no array '{key}' (found: {', '.join(data.files)})")
        try:
            return data["distances"], data["issame"]
        except damaged as err:
            raise InputError(f"{path}: not a readable .npz archive ({err})") from None


_TRUE, _FALSE = {"1", "true", "yes", "same"}, {"0", "false", "no", "different"}


def _parse_csv_row(row: list[str], path: Path, line_no: int) -> tuple[float, bool]:
    if len(row) != 2:
        raise InputError(f"{path}:{line_no}: expected 'distance,issame', got {row}")
    label = row[1].strip().lower()
    if label not in _TRUE | _FALSE:
        raise InputError(f"{path}:{line_no}: issame must be 0/1 or true/false, got {row[1]!r}")
    try:
        return float(row[0]), label in _TRUE
    except ValueError:
        raise InputError(f"{path}:{line_no}: distance {row[0]!r} is not a number") from None


def _load_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = [(n, row) for n, row in enumerate(csv.reader(fh), start=1) if any(row)]
    except UnicodeDecodeError:
        raise InputError(f"{path}: not a UTF-8 text file") from None
    if rows and rows[0][1] and not _is_number(rows[0][1][0]):
        rows = rows[1:]  # a header row
    if not rows:
        raise InputError(f"{path}: no rows")
    values = [_parse_csv_row(row, path, n) for n, row in rows]
    return np.array([v[0] for v in values]), np.array([v[1] for v in values])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def load_distances(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(distances, issame) from an ``.npz`` or a ``.csv`` file.

    Args:
        path: the file; the suffix decides the format.

    Raises:
        InputError: an unknown suffix, a missing array, a malformed row.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"distances file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        return _load_npz(path)
    if suffix in (".csv", ".txt"):
        return _load_csv(path)
    raise InputError(f"{path}: unknown format {suffix!r}; use .npz or .csv")


# --------------------------------------------------------------------------- checkpoint mode


def _device(name: str):
    try:
        return resolve_device(name)
    except RuntimeError as err:  # torch's refusal of a device string it cannot parse
        raise InputError(f"--device {name!r}: {str(err).splitlines()[0]}") from None


def _grids(args: argparse.Namespace) -> dict:
    """The threshold grids ``--grid`` asks for (None: the distance's defaults)."""
    if args.grid == "classic":  # the publishers' grids, whatever the distance
        return {"thresholds": classic_thresholds(), "val_thresholds": classic_thresholds(True)}
    return {"thresholds": None, "val_thresholds": None}


def _protocol(emb1, emb2, issame, args, what: str, folds=None) -> VerificationResult:
    """The verification protocol on embedded pairs, with the command line's options."""
    try:
        return evaluate_embeddings(
            emb1,
            emb2,
            issame,
            metric=args.distance,
            subtract_mean=args.subtract_mean,
            n_folds=args.folds,
            far_target=args.far_target,
            folds=folds,
            **_grids(args),
        )
    except ValueError as err:  # the options were checked: the pairs (or embeddings) do not fit
        raise InputError(f"{what}: {err}") from None


def evaluate_checkpoint(args: argparse.Namespace, trained: TrainedModel) -> VerificationResult:
    """Embed the images of ``--pairs`` with the model and evaluate.

    Raises:
        FacenetError: a damaged pairs file, missing images, an unusable device.
    """
    device = _device(args.device)
    pair_list = read_pairs(args.pairs, root=args.root, skip_missing=args.skip_missing)
    emb1, emb2 = embed_pair_list(
        trained.model.to(device),
        pair_list,
        trained.image_size,
        args.batch_size,
        device,
        args.flip,
        normalize=trained.normalize,  # the pixel standardisation the network was trained with
        preprocess=args.preprocess,
    )
    # The file's own folds (they differ from contiguous blocks once pairs were skipped), or
    # folds that each hold both kinds of pair (a one-fold file lists one kind, then the other).
    folds = pair_list.folds_for(args.folds)
    what = f"{args.pairs} embedded by {args.checkpoint}"
    return _protocol(emb1, emb2, pair_list.issame, args, what, folds)


def evaluate_bin(args: argparse.Namespace, trained: TrainedModel, path: str) -> VerificationResult:
    """One insightface ``.bin`` set: 2N images embedded, pairs (2i, 2i + 1), contiguous folds.

    Raises:
        FacenetError: a refused or damaged file, an undecodable image, an unusable device.
    """
    device = _device(args.device)
    pairs = read_bin(path)
    images = BinImages(pairs, trained.image_size, trained.normalize)
    embeddings = embed_dataset(trained.model.to(device), images, args.batch_size, device, args.flip)
    what = f"{path} embedded by {args.checkpoint}"
    return _protocol(embeddings[0::2], embeddings[1::2], pairs.issame, args, what)


# --------------------------------------------------------------------------- output


def format_table(result: VerificationResult) -> str:
    """Per-fold accuracy, thresholds, VAL and FAR, then the summary lines."""
    lines = [f"{'fold':>4}  {'accuracy':>8}  {'threshold':>9}  {'VAL':>6}  {'FAR':>7}"]
    for f in range(result.n_folds):
        lines.append(
            f"{f:>4}  {result.accuracy[f]:>8.4f}  {result.best_thresholds[f]:>9.4f}  "
            f"{result.val_per_fold[f]:>6.4f}  {result.far_per_fold[f]:>7.5f}"
        )
    lines += [
        f"accuracy  {result.accuracy_mean:.4f} ± {result.accuracy_std:.4f}",
        f"{val_at_far_label(result.val, result.far_target, result.far)}, VAL ± "
        f"{result.val_std:.4f}",
        f"AUC       {result.auc:.4f}",
        f"EER       {result.eer:.4f}",
        f"threshold {result.threshold:.4f} ({result.threshold_distance} distance, mean over "
        "folds; identify.py's default)",
        f"pairs     {result.n_pairs} in {result.n_folds} folds ({result.distance} distance)",
    ]
    return "\n".join(lines)


def format_bin_table(results: dict[str, VerificationResult]) -> str:
    """One row per ``.bin`` set: accuracy ± std, VAL @ FAR, AUC, EER, threshold, pairs."""
    lines = [
        f"{'set':<12} {'accuracy':>16}  {'VAL @ FAR target (achieved)':>36}  {'AUC':>6}  "
        f"{'EER':>6}  {'threshold':>9}  {'pairs':>6}"
    ]
    for name, r in results.items():
        label = val_at_far_label(r.val, r.far_target, r.far)
        lines.append(
            f"{name:<12} {r.accuracy_mean:>7.4f} ± {r.accuracy_std:<6.4f}  {label:>36}  "
            f"{r.auc:>6.4f}  {r.eer:>6.4f}  {r.threshold:>9.4f}  {r.n_pairs:>6}"
        )
    return "\n".join(lines)


def write_bin_outputs(results: dict[str, VerificationResult], out: Path, source: str, args):
    """``metrics.json`` with one entry per set, and ``roc_<name>.png`` for each."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = {"source": source, "sets": {n: r.to_dict(curves=False) for n, r in results.items()}}
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    for name, result in results.items():
        title = args.title or f"{name} ({result.n_pairs} pairs)"
        plot_roc(result, out / f"roc_{name}.png", log_scale=args.log_scale, title=title)


def check_out(out: Path) -> None:
    """Check, before any evaluation, that ``--out`` can be created or written (nothing is
    created here: a failing evaluation leaves no empty folder).

    Raises:
        InputError: ``--out`` or its nearest existing parent is not a writable folder.
    """
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"--out {out}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {existing} cannot be written")


def write_outputs(result: VerificationResult, out: Path, source: str, args) -> None:
    """``metrics.json`` (the result plus where it came from) and ``roc.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = {"source": source, **result.to_dict()}
    write_text_atomic(out / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    plot_roc(result, out / "roc.png", log_scale=args.log_scale, title=args.title)


def config_defaults(path: str) -> dict:
    """Defaults for the command line from a run configuration's ``eval`` section."""
    cfg = load_config(path)
    e = cfg.eval
    return {
        "pairs": e.pairs,
        "root": e.root,
        "folds": e.n_folds,
        "far_target": e.far_target,
        "distance": e.distance,
        "flip": e.flip,
        "subtract_mean": e.subtract_mean,
        "preprocess": e.preprocess,
        "grid": e.grid,
        "batch_size": e.batch_size,
        "skip_missing": e.skip_missing,
        "log_scale": e.log_scale_roc,
        "out": cfg.logging.out_dir,
    }


def _check_options(args: argparse.Namespace) -> None:
    """Reject fold counts and FAR targets the protocol cannot use (from flags or --config)."""
    if args.folds < 2:
        raise InputError(f"--folds {args.folds} (eval.n_folds): expected an integer >= 2")
    if not 0.0 < args.far_target <= 1.0:
        raise InputError(f"--far-target {args.far_target} (eval.far_target): must lie in (0, 1]")


def _distances_mode(args) -> VerificationResult:
    distances, issame = load_distances(args.distances)
    try:
        return evaluate_verification(
            distances, issame, args.folds, args.far_target, distance=args.distance, **_grids(args)
        )
    except ValueError as err:  # the options were checked: the file's contents do not fit
        raise InputError(f"{args.distances}: {err}") from None


def _bin_mode(args) -> int:
    """Every ``--bin`` set: a table row each, metrics.json and a ROC per set."""
    try:
        _check_options(args)
        trained = load_model(args.checkpoint)
        results = {}
        for path in args.bin:
            name = Path(path).stem
            if name in results:
                raise InputError(f"--bin {path}: a second set named {name!r}")
            results[name] = evaluate_bin(args, trained, path)
        print(format_bin_table(results))
        write_bin_outputs(results, Path(args.out), str(args.checkpoint), args)
    except (FacenetError, OSError) as err:  # anything else is a bug: keep its traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'metrics.json'} and a roc_<set>.png for each set")
    return 0


def _parse(argv: list[str] | None):
    """The arguments, with defaults from ``--config``; None after reporting a bad config."""
    parser = get_args_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:  # the file gives defaults; flags on the command line still win
        try:
            parser.set_defaults(**config_defaults(known.config))
        except FacenetError as err:
            print(f"error: {err}", file=sys.stderr)
            return None
    if known.preset:  # after --config: the preset names the publisher's whole evaluation
        parser.set_defaults(**vars(EVAL_PRESETS[known.preset]))
    args = parser.parse_args(argv)
    if args.bin and not args.checkpoint:
        parser.error("--bin needs --checkpoint")
    if args.checkpoint and not (args.pairs or args.bin):
        parser.error("--checkpoint needs --pairs or --bin")
    return args


def main(argv: list[str] | None = None) -> int:
    """Evaluate; returns the exit code (2: bad input)."""
    args = _parse(argv)
    if args is None:
        return 2
    if args.bin:
        return _bin_mode(args)
    try:
        _check_options(args)
        check_out(Path(args.out))  # before the work, not after it
        if args.distances:
            result, source = _distances_mode(args), str(args.distances)
        else:
            result = evaluate_checkpoint(args, load_model(args.checkpoint))
            source = f"{args.checkpoint} on {args.pairs}"
    except (FacenetError, OSError) as err:  # anything else is a bug: keep its traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    try:
        write_outputs(result, Path(args.out), source, args)
    except OSError as err:  # an unwritable --out
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {Path(args.out) / 'metrics.json'} and {Path(args.out) / 'roc.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
