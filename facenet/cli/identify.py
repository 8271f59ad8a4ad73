"""Identify probe faces against a gallery: ``--gallery G.npz --probes P.npz``.

Both files come from ``facenet-embed`` (the gallery from identity folders). The threshold is,
in order: ``--threshold`` (with ``--distance``), the one in ``--metrics`` (facenet-evaluate's
metrics.json, of set ``--set`` after ``--bin``, or its deployable threshold ``--threshold-at
far_1e-3``; or a run's summary.json), or the one recorded in the gallery file; a stored one is
used only when chosen for the gallery's weights, flip setting and preprocessing, without mean
subtraction. A gallery or probe file that does not say which weights embedded it (no
``weights_sha256``: an older facenet-embed's, or written by hand) is refused unless
``--allow-unverified``: nothing else shows that both files come from one model. Writes
``matches.csv`` and ``identification.json`` into ``--out``; prints rank-1,
detection-and-identification and open-set rejection rates for labelled probes.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from facenet.cli.common import (
    add_out_arguments,
    add_threads_argument,
    check_outputs,
    run_command,
)
from facenet.cli.embed import MADE_WITH, add_threshold_arguments, flag_threshold
from facenet.distributed import set_threads
from facenet.errors import DataError
from facenet.evaluation.report import ThresholdRecord
from facenet.files import json_safe, read_npz, write_text_atomic
from facenet.wings.after_training.identify import (
    Gallery,
    checked_threshold,
    identification_rates,
    match,
    non_finite_rows,
)

UNKNOWN = "unknown"
# each array's dtype kinds and ndim; those of one value say how the embeddings were made and
# the threshold recorded for them; labels may be (0,): a flat folder
_ARRAYS = {
    "embeddings": ("fiu", 2),
    "paths": ("U", 1),
    "labels": ("U", 1),
    "flip": ("b", 0),
    "preprocess": ("U", 0),
    "weights_sha256": ("U", 0),
    "threshold": ("f", 0),
    "threshold_distance": ("U", 0),
    "threshold_record": ("U", 0),
}
_SHAPES = ("single value", "(N,) array", "(N, D) array")


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-identify``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gallery", required=True, help="facenet-embed file of identity folders")
    parser.add_argument("--probes", required=True, help="facenet-embed file of the probe images")
    add_threshold_arguments(parser, recorded=False)
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        help="accept a gallery or probe file that does not say which weights embedded it",
    )
    add_out_arguments(parser, "folder for the results", "runs/identify")
    add_threads_argument(parser)
    return parser


def load_embeddings(path: str) -> dict:
    """The arrays of a facenet-embed file (no pickles), each checked: a DataError naming the
    file and the array otherwise (NaN or infinite embeddings included)."""
    arrays = read_npz(path, "an .npz file of facenet-embed")
    if "embeddings" not in arrays:
        raise DataError(f"{path}: no 'embeddings' array (write it with facenet-embed)")
    for key, (kinds, ndim) in _ARRAYS.items():  # embeddings first: n is known after it
        value = arrays.get(key)
        if value is None:
            continue
        if value.dtype.kind not in kinds or value.ndim != ndim or 0 in value.shape[1:]:
            raise DataError(
                f"{path}: '{key}' must be a {_SHAPES[ndim]} of kind {kinds!r}, got "
                f"{value.dtype} {value.shape}"
            )
        n = len(arrays["embeddings"])
        if ndim == 1 and len(value) != n and not (key == "labels" and len(value) == 0):
            # shorter would cut matches.csv short, longer misname the probes
            raise DataError(f"{path}: {len(value)} {key} for {n} embeddings")
    non_finite_rows(arrays["embeddings"], str(path), arrays.get("paths"))
    return arrays


def provenance(arrays: dict) -> dict:
    """How a facenet-embed file's embeddings were made; None where it does not say (files
    written before it recorded this). Nothing in it subtracts a mean embedding."""
    made = {k: arrays[k].item() if k in arrays else None for k in MADE_WITH}
    made["weights_sha256"] = made["weights_sha256"] or None  # '' says no more than no hash
    return {**made, "subtract_mean": False}


def check_same_making(gallery: dict, probes: dict, args) -> None:
    """Gallery and probes embedded by the same weights with the same flip setting, where
    both files say; each must say which weights, unless ``--allow-unverified``: distances
    between embeddings of different models mean nothing."""
    ours, theirs = provenance(gallery), provenance(probes)
    for flag, path, made in (("--gallery", args.gallery, ours), ("--probes", args.probes, theirs)):
        if not (made["weights_sha256"] or args.allow_unverified):
            raise DataError(
                f"{flag} {path} does not say which weights embedded it (no weights_sha256: an "
                "older facenet-embed's file, or one written by hand): embed it again with "
                "facenet-embed, or give --allow-unverified to match it anyway"
            )
    for key in MADE_WITH:  # load_embeddings checked their kinds
        if None not in (ours[key], theirs[key]) and ours[key] != theirs[key]:
            raise DataError(
                f"--gallery {args.gallery} and --probes {args.probes} were embedded with "
                f"different {key} ({ours[key]} vs {theirs[key]}): embed both the same way"
            )


def _gallery_threshold(gallery: dict, path: str) -> ThresholdRecord | None:
    """The threshold facenet-embed recorded in the gallery file, or None."""
    if "threshold_record" not in gallery:  # an older file: a value and its distance at most
        old = {k: gallery[k].item() for k in ("threshold", "threshold_distance") if k in gallery}
        return ThresholdRecord.from_dict(old, path)
    try:
        saved = json.loads(str(gallery["threshold_record"]))
    except (ValueError, RecursionError) as err:  # RecursionError: nested thousands deep
        raise DataError(f"{path}: 'threshold_record' is not JSON ({err})") from None
    record = ThresholdRecord.from_dict(saved if isinstance(saved, dict) else {}, path)
    if record is None:
        raise DataError(f"{path}: 'threshold_record' holds no threshold")
    return record


def choose_threshold(args, gallery: dict) -> ThresholdRecord:
    """The threshold, in the module's order; a DataError for none, or for a stored one chosen
    for other embeddings."""
    record = flag_threshold(args)  # --set / --threshold-at without --metrics refused there
    if args.threshold is not None:
        return record
    record = record or _gallery_threshold(gallery, args.gallery)
    if record is None:
        raise DataError(
            "no threshold: give --threshold, or --metrics with facenet-evaluate's metrics.json "
            "or a run's summary.json (the gallery file records none)"
        )
    what = f"the embeddings of --gallery {args.gallery}"
    return checked_threshold(record, provenance(gallery), what)


def matches_csv(probes: dict, matches) -> str:
    """One row per probe: path, label, answer, nearest identity, distance."""
    blank = [""] * len(matches.nearest)
    labels = probes.get("labels", [])
    columns = (probes.get("paths", blank), labels if len(labels) else blank, matches.identity)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["path", "label", "identity", "nearest", "distance"])
    for path, label, answer, nearest, d in zip(*columns, matches.nearest, matches.distance):
        writer.writerow([path, label, answer or UNKNOWN, nearest, f"{d:.6f}"])
    return out.getvalue()


def report(matches, rates: dict | None, source: str) -> str:
    """The lines printed at the end."""
    unknown = matches.identity.count(None)
    lines = [
        f"{len(matches.identity)} probes: {len(matches.identity) - unknown} matched, {unknown} "
        f"unknown at threshold {matches.threshold:.4f} ({matches.distance_name}; from {source})"
    ]
    if rates is not None:
        fmt = lambda rate: "n/a" if rate is None else f"{rate:.4f}"
        lines += [
            f"rank-1 accuracy                {fmt(rates['rank1'])} ({rates['n_known']} probes "
            "of enrolled identities)",
            f"detection and identification   {fmt(rates['detection_identification'])} "
            "(right identity and below the threshold)",
            f"open-set rejection rate        {fmt(rates['open_set_rejection'])} "
            f"({rates['n_unknown']} probes of identities not enrolled)",
        ]
    return "\n".join(lines)


def _identify(args: argparse.Namespace) -> None:
    """Match the probes, write the results and print the report."""
    set_threads(args.threads)
    if args.threshold is not None and args.metrics:  # one threshold: the other would be ignored
        raise DataError("--threshold and --metrics contradict each other")
    names = ("matches.csv", "identification.json")
    inputs = {"--gallery": args.gallery, "--probes": args.probes, "--metrics": args.metrics}
    check_outputs(args, *names, files=inputs)
    gallery_arrays, probes = load_embeddings(args.gallery), load_embeddings(args.probes)
    check_same_making(gallery_arrays, probes, args)
    gallery = Gallery(gallery_arrays["embeddings"], gallery_arrays.get("labels", []))
    chosen = choose_threshold(args, gallery_arrays)
    print(f"threshold: {chosen.describe()}")
    source = chosen.source or chosen.chosen_on
    matches = match(gallery, probes["embeddings"], chosen.value, chosen.distance)
    labelled = len(probes.get("labels", [])) == len(matches.identity)
    rates = identification_rates(matches, probes["labels"], gallery) if labelled else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "matches.csv", matches_csv(probes, matches))
    record = {"threshold": chosen.value, "threshold_distance": chosen.distance, "source": source}
    record |= rates or {}
    write_text_atomic(out / "identification.json", json.dumps(json_safe(record), indent=1))
    print(report(matches, rates, source))
    print(f"wrote {out / 'matches.csv'} and {out / 'identification.json'}")


def main(argv: list[str] | None = None) -> int:
    """Identify; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _identify(args))


if __name__ == "__main__":
    sys.exit(main())
