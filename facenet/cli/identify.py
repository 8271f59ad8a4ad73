"""Identify probe faces against a gallery: ``--gallery G.npz --probes P.npz``.

Both files come from ``facenet-embed`` (the gallery from identity folders: one or more
images per identity). Each probe gets the identity of its nearest gallery embedding, or
"unknown" when that distance is not below the threshold. The threshold is, in order:
``--threshold`` (with ``--distance``), the one in ``--metrics`` (facenet-evaluate's
metrics.json or a run's summary.json), or the one facenet-embed recorded in the gallery file
from the model's run.
Writes ``matches.csv`` and ``identification.json`` into ``--out``; when the probes are labelled
it prints rank-1 accuracy, the detection-and-identification rate at the threshold and the
open-set rejection rate (probes whose identity is not in the gallery, answered "unknown").
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import zipfile
from pathlib import Path

import numpy as np

from facenet.cli.common import run_command
from facenet.errors import DataError
from facenet.evaluation.protocol import DISTANCES
from facenet.files import json_safe, write_text_atomic
from facenet.inference.identify import Gallery, identification_rates, match, read_threshold

UNKNOWN = "unknown"


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-identify``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gallery", required=True, help="facenet-embed file of identity folders")
    parser.add_argument("--probes", required=True, help="facenet-embed file of the probe images")
    parser.add_argument("--threshold", type=float, help="accept a match below this distance")
    parser.add_argument("--distance", choices=DISTANCES, help="with --threshold (squared)")
    parser.add_argument("--metrics", help="metrics.json or summary.json holding the threshold")
    parser.add_argument("--out", default="runs/identify", help="folder for the results")
    return parser


def load_embeddings(path: str) -> dict:
    """The arrays of a facenet-embed file (no pickle allowed)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (zipfile.BadZipFile, EOFError, ValueError) as err:
        raise DataError(f"{path}: not an .npz file of facenet-embed ({err})") from None
    if "embeddings" not in arrays:
        raise DataError(f"{path}: no 'embeddings' array (write it with facenet-embed)")
    return arrays


def choose_threshold(args, gallery: dict) -> tuple[float, str, str]:
    """(threshold, distance, where it came from), by the order the module docstring gives."""
    if args.threshold is not None:
        return args.threshold, args.distance or "squared", "--threshold"
    if args.distance:
        raise DataError("--distance goes with --threshold (a saved threshold has its own)")
    if args.metrics:
        found = read_threshold(args.metrics)
        if found is None:
            raise DataError(f"{args.metrics}: holds no threshold and threshold_distance")
        return found[0], found[1], args.metrics
    if "threshold" in gallery:
        return float(gallery["threshold"]), str(gallery["threshold_distance"]), args.gallery
    raise DataError(
        "no threshold: give --threshold, or --metrics with facenet-evaluate's metrics.json or a "
        "run's summary.json (the model's run saved none next to it)"
    )


def matches_csv(probes: dict, matches) -> str:
    """One row per probe: path, label, answer, nearest identity, distance."""
    labels = probes.get("labels", np.array([]))
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["path", "label", "identity", "nearest", "distance"])
    for i, path in enumerate(probes.get("paths", [""] * len(matches.nearest))):
        label = labels[i] if len(labels) else ""
        answer = matches.identity[i] if matches.identity[i] is not None else UNKNOWN
        writer.writerow([path, label, answer, matches.nearest[i], f"{matches.distance[i]:.6f}"])
    return out.getvalue()


def report(matches, rates: dict | None, source: str) -> str:
    """The lines printed at the end."""
    unknown = sum(name is None for name in matches.identity)
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


def _identify(args: argparse.Namespace) -> int:
    """Match the probes, write the results and print the report; returns the exit code."""
    gallery_arrays, probes = load_embeddings(args.gallery), load_embeddings(args.probes)
    gallery = Gallery(gallery_arrays["embeddings"], gallery_arrays.get("labels", []))
    threshold, distance, source = choose_threshold(args, gallery_arrays)
    matches = match(gallery, probes["embeddings"], threshold, distance)
    labelled = len(probes.get("labels", [])) == len(matches.identity)
    rates = identification_rates(matches, probes["labels"], gallery) if labelled else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "matches.csv", matches_csv(probes, matches))
    record = {"threshold": threshold, "threshold_distance": distance, "source": source}
    record.update(rates or {})
    write_text_atomic(out / "identification.json", json.dumps(json_safe(record), indent=1))
    print(report(matches, rates, source))
    print(f"wrote {out / 'matches.csv'} and {out / 'identification.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Identify; returns the exit code (2: bad input).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _identify(args))


if __name__ == "__main__":
    sys.exit(main())
