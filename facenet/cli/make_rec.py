"""Pack a folder of aligned faces into insightface's RecordIO: ``facenet-make-rec SRC DST``.

SRC is ``SRC/<identity>/<image>``; DST receives ``train.rec``, ``train.idx`` and ``property``
(insightface's layout: labels 0 .. C-1 in identity-name order, a meta record at key 0, one
identity record per identity), which ``data.dataset: recordio`` and insightface's trainers read.
Images are stored byte for byte as they are, not re-encoded. A file that training's folder
index would leave out (damaged, cut short, past the size limits) is left out with one warning,
and so is an identity without a usable image. ``property`` gives the first image's size. Each
file is written atomically; a DST inside SRC, or over files this command did not write
(without ``--overwrite``), is refused before any work.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from facenet.cli.common import check_outputs, run_command
from facenet.data.folder import list_identities
from facenet.data.images import inspect_images, read_image
from facenet.data.recordio import INDEX_FILE, PROPERTY_FILE, REC_FILE, write_insightface
from facenet.errors import DataError, some_names

_NAMES_IN_WARNING = 10


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-make-rec``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", metavar="SRC", help="folder holding one sub-folder per identity")
    parser.add_argument("out", metavar="DST", help="folder for train.rec, train.idx, property")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace this command's earlier outputs"
    )
    return parser


def usable_identities(src: Path) -> list[list[Path]]:
    """The image files of each identity folder with any usable, in name order; one warning
    names the files left out (as training's folder index leaves them out) and the identities
    left without images."""
    listing = list_identities(src)
    paths = [src / identity / name for identity, names in listing.items() for name in names]
    reasons = dict(zip(paths, inspect_images(paths)))
    bad = [str(path) for path, reason in reasons.items() if reason is not None]
    kept = {
        identity: [src / identity / n for n in names if reasons[src / identity / n] is None]
        for identity, names in listing.items()
    }
    empty = [identity for identity, files in kept.items() if not files]
    if len(empty) == len(kept):
        raise DataError(f"{src}: no usable images in SRC/<identity>/<image>")
    parts = [
        f"left out {len(names)} {what}: {some_names(names, _NAMES_IN_WARNING)}"
        for what, names in (("unusable image(s)", bad), ("identities without usable images", empty))
        if names
    ]
    if parts:
        warnings.warn(f"{src}: " + "; ".join(parts), stacklevel=2)
    return [files for files in kept.values() if files]


def _make_rec(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise DataError(f"source folder not found: {src}")
    names = (REC_FILE, INDEX_FILE, PROPERTY_FILE)
    check_outputs(args, *names, folders={"SRC": src})
    identities = usable_identities(src)
    height_width = tuple(read_image(identities[0][0]).shape[1:])
    rec, _, _ = write_insightface(dst, identities, height_width)
    images = sum(map(len, identities))
    print(f"wrote {rec} ({images} images of {len(identities)} identities), its index, property")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Pack the folder; returns the exit code (2 for bad input)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _make_rec(args))


if __name__ == "__main__":
    sys.exit(main())
