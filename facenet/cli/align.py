"""Align faces: detect the face in every image under SRC with MTCNN, write its crop under DST.

Crops keep their image's relative path and are resumable; DST/align_settings.json records the
settings and a run with others is refused; DST/align_report.tsv lists the images without a
face or unreadable. Presets follow the publishers' code: ``facenet-pytorch`` and ``sandberg``
crop the box, ``arcface`` and ``sphereface`` warp onto their template (which fixes the size:
``--image-size`` and ``--margin`` are refused with it). Box presets search the full image, as
their publishers did; ``--detect-size N`` searches a copy N px on its longer side (the template
presets' default, 320): faces under 20/N of the longer side are then missed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from facenet.cli.common import (
    add_device_argument,
    add_threads_argument,
    int_in,
    parse_device,
    positive_int,
    run_command,
)
from facenet.distributed import set_threads
from facenet.errors import FacenetError
from facenet.files import check_no_links_below, check_not_inputs, open_regular
from facenet.wings.align.aligner import (
    REPORT_HEADER,
    SELECTIONS,
    AlignSettings,
    align_folder,
    write_report,
)
from facenet.wings.align.presets import ALIGN_PRESETS, PRESET_NAMES

# The largest crop side: a crop is resized from the face's box, and 4096 px is already 50 MB.
MAX_IMAGE_SIZE = 4096
# MTCNN searches a copy resized to --detect-size on its longer side: an (S, S, 3) float copy
# of 8192 px is 800 MB, already past any photo's own side; more only exhausts memory
MAX_DETECT_SIZE = 8192


def _preset_help() -> str:
    settings = (AlignSettings.from_preset(name) for name in PRESET_NAMES)
    skip = ("preset", "fallback")
    return "; ".join(
        f"{s.preset}: " + ", ".join(f"{k} {v}" for k, v in asdict(s).items() if k not in skip)
        for s in settings
    )


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-align``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="folder of images")
    parser.add_argument("dst", help="folder for the crops")
    parser.add_argument(
        "--preset", choices=PRESET_NAMES, default="facenet-pytorch", help=_preset_help()
    )
    parser.add_argument(
        "--image-size", type=int_in(8, MAX_IMAGE_SIZE), help="crop side (box presets)"
    )
    parser.add_argument(
        "--detect-size",
        type=int_in(20, MAX_DETECT_SIZE, zero=True),  # MTCNN's smallest face is 20 px
        help="longer side MTCNN searches; 0: the full image (default: the preset's)",
    )
    parser.add_argument("--margin", type=int_in(0), help="margin (box presets)")
    parser.add_argument("--select", choices=SELECTIONS, help="which face of several")
    parser.add_argument(
        "--centre-crop", dest="fallback", action="store_true", help="crop where no face is found"
    )
    add_device_argument(parser, "cpu")  # where MTCNN runs
    add_threads_argument(parser)  # --workers > 1: one thread each
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per MTCNN call")
    parser.add_argument("--workers", type=positive_int, default=1, help="processes")
    parser.add_argument("--report", help="default DST/align_report.tsv")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def _settings(args: argparse.Namespace) -> AlignSettings:
    if ALIGN_PRESETS[args.preset].template is not None:
        for flag, value in (("--image-size", args.image_size), ("--margin", args.margin)):
            if value is not None:  # the template's points are in its own crop's pixels
                raise FacenetError(
                    f"{flag} {value}: the {args.preset} preset warps onto a template of a "
                    "fixed size; give no size or margin with it"
                )
    settings = AlignSettings.from_preset(
        args.preset,
        image_size=args.image_size,
        margin=args.margin,
        select=args.select,
        fallback=args.fallback or None,
        detect_size=args.detect_size,
    )
    if settings.margin >= settings.image_size:  # the preset's size when none is given
        raise FacenetError(
            f"--margin {settings.margin}: expected a margin below the image size "
            f"{settings.image_size}"
        )
    return settings


def _report_path(args: argparse.Namespace) -> Path:
    """--report, refused inside SRC or DST (but for the default) and where it would replace a
    file this command did not write."""
    default = Path(args.dst) / "align_report.tsv"
    report = Path(args.report or default)
    real = report.resolve()
    trees = {Path(args.src).resolve(), Path(args.dst).resolve()}
    if real != default.resolve() and trees & {real, *real.parents}:
        raise FacenetError(
            f"--report {report} lies inside {args.src} or {args.dst}: give a path outside them"
        )
    refused = FacenetError(
        f"--report {report} exists and is not an alignment report: not replacing it"
    )
    if os.path.lexists(report):  # a FIFO, device or folder is not opened
        with open_regular(report, sys.maxsize, lambda _: refused) as fh:
            if fh.read(len(REPORT_HEADER)) != REPORT_HEADER:
                raise refused
    return report


def _align(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    report = _report_path(args)
    check_not_inputs([args.dst, report], {}, {"SRC": args.src})
    check_no_links_below(args.dst)  # DST/<identity> a link: crops would land where it points
    start = time.perf_counter()
    settings, device = _settings(args), parse_device(args.device)
    outcomes, already = align_folder(
        args.src, args.dst, settings, device, args.batch_size, args.workers, args.progress
    )
    write_report(outcomes, report)
    for o in outcomes:
        if o.status == "unreadable":
            print(f"skipped {o.source}: {o.reason}", file=sys.stderr)
    n = Counter(o.status for o in outcomes)  # 0 for a status none has
    print(
        f"aligned {n['aligned']}, centre crops {n['centre_crop']}, no face {n['no_face']}, "
        f"unreadable {n['unreadable']}, already there {already} "
        f"({time.perf_counter() - start:.1f} s); report: {report}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Align; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _align(args))


if __name__ == "__main__":
    sys.exit(main())
