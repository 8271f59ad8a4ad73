"""Verification sets in insightface's ``.bin`` format (lfw, cfp_fp, agedb_30, calfw, cplfw).

A ``.bin`` file is a pickle of ``(bins, issame_list)``: ``bins`` a list of 2N encoded images
(JPEG or PNG bytes, 112 x 112 aligned faces), pair i being ``bins[2i]`` and ``bins[2i + 1]``,
and ``issame_list`` N booleans. Files written by Python 2 hold the images as ``str``, read back
as bytes (``encoding="bytes"``, as insightface reads them).

A pickle can name any Python callable and run it while loading. These files are read with
:class:`BinUnpickler`, which admits no global at all: the only objects it builds are the
containers, bytes, strings, numbers and booleans the pickle opcodes make by themselves, so a
crafted file runs nothing and is refused with :class:`BinFormatError` naming the file and the
global it asked for. The contents are then checked to be exactly that layout.

Images are decoded when a batch needs them and resized to the model's input side (no crop:
they are aligned already), then standardised as in training.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2

from facenet.data.images import _normalize_steps
from facenet.errors import DataError

__all__ = ["BinFormatError", "BinPairs", "BinImages", "BinUnpickler", "read_bin"]


class BinFormatError(DataError):
    """A ``.bin`` file that is refused or does not hold ``(images, issame)``; names the file."""


class BinUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global: nothing named in the file can be called.

    Every opcode that brings in a callable or a class (GLOBAL, STACK_GLOBAL, INST, OBJ, the
    copyreg extension codes, and through them REDUCE, NEWOBJ and BUILD) goes through
    ``find_class``; persistent ids go through ``persistent_load``. Both refuse.

    Args:
        file: the binary file.
        source: the file's name, for the error message.
    """

    def __init__(self, file, source: str):
        super().__init__(file, encoding="bytes")
        self.source = source

    def find_class(self, module: str, name: str):
        raise BinFormatError(
            f"refused to load {self.source}: its pickle asks for the global {module}.{name}; "
            "an insightface .bin file holds only a list of image bytes and a list of booleans"
        )

    def persistent_load(self, pid):
        raise BinFormatError(f"refused to load {self.source}: its pickle uses persistent ids")


@dataclass
class BinPairs:
    """The contents of a ``.bin`` file.

    Args:
        images: 2N encoded images; pair i is ``images[2i]``, ``images[2i + 1]``.
        issame: (N,) bool.
        name: the file's stem ("lfw", "cfp_fp", ...).
    """

    images: list
    issame: np.ndarray
    name: str

    def __len__(self) -> int:
        return len(self.issame)


def _check_layout(obj, source: str) -> tuple[list, list]:
    """``obj`` as (images, flags), or a BinFormatError saying what is wrong."""
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise BinFormatError(f"{source}: expected a pickled (images, issame) pair")
    images, flags = obj
    if not isinstance(images, (list, tuple)) or not all(
        isinstance(b, (bytes, bytearray)) for b in images
    ):
        raise BinFormatError(f"{source}: the first item must be a list of encoded images (bytes)")
    if not isinstance(flags, (list, tuple)) or not all(isinstance(f, bool) for f in flags):
        raise BinFormatError(f"{source}: the second item must be a list of booleans (issame)")
    if len(images) != 2 * len(flags) or not flags:
        raise BinFormatError(
            f"{source}: {len(images)} images for {len(flags)} pairs; expected two per pair"
        )
    return list(images), list(flags)


def read_bin(path: str | os.PathLike) -> BinPairs:
    """Read an insightface ``.bin`` verification file without running anything in it.

    Args:
        path: the file.

    Raises:
        BinFormatError: a refused pickle, a damaged file, or contents of another layout.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            obj = BinUnpickler(fh, str(path)).load()
    except BinFormatError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as err:
        raise BinFormatError(f"{path}: not a readable pickle ({err})") from None
    images, flags = _check_layout(obj, str(path))
    return BinPairs(images, np.array(flags, dtype=bool), path.stem)


def bin_transform(image_size: int, normalize: str = "fixed") -> v2.Compose:
    """uint8 (3, h, w) aligned face -> float (3, S, S): resized whole, then standardised."""
    return v2.Compose(
        [v2.Resize((image_size, image_size), antialias=True), *_normalize_steps(normalize)]
    )


class BinImages(torch.utils.data.Dataset):
    """The images of a ``.bin`` file, decoded one by one into the model's input.

    Args:
        pairs: what :func:`read_bin` returned.
        image_size: the model's input side S.
        normalize: the pixel standardisation the model was trained with.
    """

    def __init__(self, pairs: BinPairs, image_size: int, normalize: str = "fixed"):
        self.pairs = pairs
        self.transform = bin_transform(image_size, normalize)

    def __len__(self) -> int:
        return len(self.pairs.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(self.pairs.images[index]), dtype=torch.uint8)
        try:
            image = decode_image(raw, mode=ImageReadMode.RGB)  # (3, h, w) uint8
        except RuntimeError as err:
            reason = str(err).strip().splitlines()[-1] if str(err).strip() else "undecodable"
            raise BinFormatError(
                f"{self.pairs.name}.bin: image {index} (pair {index // 2}) cannot be decoded: "
                f"{reason}"
            ) from None
        return self.transform(image)
