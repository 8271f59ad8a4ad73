#!/usr/bin/env python
"""Embed every image under a folder with a trained model: ``--checkpoint CKPT --images DIR``.

DIR holds identity folders (``DIR/<identity>/<image>``; the folder name is the label) or images
directly. Each image is prepared as the evaluation does (resize, centre crop, the model's
standardisation). Unreadable files are named on stderr and left out. ``--out FILE.npz`` holds
``embeddings`` (N, D) float32, ``paths`` (N,) and ``labels`` (N,) or (0,) for a flat folder;
plus ``threshold`` and ``threshold_distance`` when the model's run saved one, and ``flip``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from facenet.distributed import resolve_device  # noqa: E402
from facenet.errors import FacenetError  # noqa: E402
from facenet.files import write_atomic  # noqa: E402
from facenet.inference.embed import FolderEmbeddings, embed_folder  # noqa: E402
from facenet.inference.identify import model_threshold  # noqa: E402
from facenet.inference.loading import load_model  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface of ``embed.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint, model.pt or port file")
    parser.add_argument("--images", required=True, help="identity folders or a flat folder")
    parser.add_argument("--out", required=True, help="the .npz file to write")
    parser.add_argument("--flip", action="store_true", help="concatenate flipped-image embeddings")
    parser.add_argument("--batch-size", type=int, default=128, help="images per forward")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_device(name: str):
    """The torch device of ``--device``; a name torch cannot parse is a user error."""
    try:
        return resolve_device(name)
    except RuntimeError as err:
        raise FacenetError(f"--device {name!r}: {str(err).splitlines()[0]}") from None


def npz_arrays(result: FolderEmbeddings, flip: bool, threshold) -> dict:
    """The arrays of the output file (strings as numpy unicode: no pickle needed to read)."""
    labelled = any(result.labels)
    arrays = {
        "embeddings": result.embeddings.numpy().astype(np.float32),
        "paths": np.array(result.paths, dtype=str),
        "labels": np.array(result.labels if labelled else [], dtype=str),
        "flip": np.array(flip),
    }
    if threshold is not None:
        arrays["threshold"] = np.array(threshold[0])
        arrays["threshold_distance"] = np.array(threshold[1])
    return arrays


def main(argv: list[str] | None = None) -> int:
    """Embed a folder; returns the exit code (2: bad input)."""
    args = get_args_parser().parse_args(argv)
    try:
        trained = load_model(args.checkpoint)
        device = parse_device(args.device)
        result = embed_folder(
            trained.model.to(device),
            args.images,
            trained.image_size,
            trained.normalize,
            args.batch_size,
            device,
            args.flip,
            progress=not args.no_progress,
        )
        for path, reason in result.unreadable:
            print(f"warning: unreadable image left out: {path}: {reason}", file=sys.stderr)
        if not result.paths:
            raise FacenetError(f"{args.images}: no readable image")
        buffer = io.BytesIO()
        np.savez(buffer, **npz_arrays(result, args.flip, model_threshold(trained)))
        write_atomic(args.out, lambda fh: fh.write(buffer.getvalue()))
    except (FacenetError, OSError) as err:  # anything else is a bug: keep its traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    n, dim = result.embeddings.shape
    print(
        f"embedded {n} images ({dim}-D) from {args.images} into {args.out}; "
        f"{len(result.unreadable)} unreadable files left out"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
