"""Write the built-in synthetic face data set: ``facenet-make-synthetic OUT``.

OUT receives ``train/<identity>/*.png``, ``heldout/<identity>/*.png``, the held-out
``val_pairs.txt`` and ``test_pairs.txt``, and ``manifest.json``. Sizes come from the ``data``
section of a run configuration (``--config``, ``--set data.synthetic_identities=100``); running
again with the same settings writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torchvision.io import encode_png
from torchvision.utils import make_grid

from facenet.cli.common import add_threads_argument, check_outputs, run_command
from facenet.config import add_override_argument, load_config
from facenet.distributed import set_threads
from facenet.errors import DataError, FacenetError
from facenet.files import check_not_inputs, write_atomic
from facenet.wings.demo.synthetic import SyntheticIdentities, drawn_side, prepare_synthetic_data


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``facenet-make-synthetic``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder to write the data set into")
    parser.add_argument("--config", default=None, help="YAML run configuration (data section)")
    add_override_argument(parser)
    parser.add_argument(
        "--preview",
        default=None,
        metavar="PNG",
        help="also write a grid of 8 training identities x 8 images (one identity per row), "
        "outside OUT",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --preview")
    add_threads_argument(parser)
    return parser


def write_preview(path: str, image_size: int, seed: int) -> None:
    """A PNG grid of the first 8 training identities (one a row), 8 images of side
    ``image_size`` each."""
    data = SyntheticIdentities(8, 8, image_size=image_size, seed=seed)
    images = torch.stack([image for image, _ in data])  # (64, 3, S, S) uint8
    png = encode_png(make_grid(images, nrow=8, padding=2)).numpy()
    write_atomic(path, lambda fh: fh.write(png))  # raises OSError (torchvision's did not)


def check_preview(args: argparse.Namespace) -> None:
    """Refuse, before any work, a ``--preview`` that replaces anything but a regular file given
    ``--overwrite``, is ``--config`` or lies inside OUT (it would become a training image)."""
    if Path(args.preview).resolve().is_relative_to(Path(args.out).resolve()):  # links resolved
        raise DataError(f"--preview {args.preview} lies inside OUT {args.out}: choose another")
    preview = argparse.Namespace(out=args.preview, overwrite=args.overwrite)
    check_outputs(preview, files={"--config": args.config})


def _make_synthetic(args: argparse.Namespace) -> int:
    """Write the data set (and the preview) and say where; returns the exit code."""
    set_threads(args.threads)
    outputs = [path for path in (args.out, args.preview) if path is not None]
    check_not_inputs(outputs, {"--config": args.config})  # first: "is the input" before "exists"
    if args.preview:
        check_preview(args)
    data = load_config(args.config, args.overrides).data
    paths = prepare_synthetic_data(args.out, data)
    print(
        f"train:   {paths['train_root']} ({data.synthetic_identities} identities x "
        f"{data.synthetic_images_per_identity} images, {data.image_size} px)\n"
        f"heldout: {paths['heldout_root']} ({data.synthetic_heldout_identities} identities x "
        f"{data.synthetic_heldout_images_per_identity} images)\n"
        f"pairs:   {paths['val_pairs']} (validation) and {paths['test_pairs']} (test), "
        f"identity-disjoint halves, each 10 folds x {data.synthetic_pairs_per_fold} same and "
        "different pairs"
    )
    if args.preview:
        try:
            write_preview(args.preview, drawn_side(data.image_size), data.synthetic_seed)
        except OSError as err:  # named as the preview: the data set itself was written
            reason = err.strerror or err
            raise FacenetError(f"cannot write the preview {args.preview}: {reason}") from None
        print(f"preview: {args.preview}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the data set; returns the exit code (2 for bad configuration or an unwritable OUT)."""
    args = get_args_parser().parse_args(argv)
    return run_command(lambda: _make_synthetic(args))


if __name__ == "__main__":
    sys.exit(main())
