"""Verification sets in insightface's ``.bin`` format (lfw, cfp_fp, agedb_30, calfw, cplfw).

A ``.bin`` file is a pickle of ``(bins, issame_list)``: 2N encoded images (112 x 112 aligned
faces; pair i is ``bins[2i]``, ``bins[2i + 1]``) and N booleans; Python 2 files hold the images
as ``str``, read back as bytes as insightface reads them. A pickle can run any callable while
loading, so these files are read by :class:`BinUnpickler`, which admits no global at all, after
:func:`check_pickle_lengths` has refused lengths the file cannot hold; the counts, the folds
and images repeated by reference are refused before any image is decoded. Images are decoded
when a batch needs them by :func:`facenet.data.images.decode_image_bytes` (a damaged one is a
:class:`BinFormatError` naming the set, image and pair), resized whole and standardised: the
preparation :data:`BIN_PREPROCESS`, which a threshold chosen on a set records.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2

from facenet.data.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    CorruptImageError,
    decode_image_bytes,
    normalize_steps,
)
from facenet.errors import DataError
from facenet.files import open_regular
from facenet.sizes import ImageSize, image_hw

# The largest .bin file read (the public sets are 50-400 MB); it is held in memory whole.
MAX_BIN_BYTES = 8 * 2**30
# 14 times the largest public set (cfp_fp, 7000 pairs): bounds the images a file makes us embed.
MAX_BIN_PAIRS = 100_000
# The preparation of a set's images (resized whole, no crop), as a threshold record names it:
# not facenet-embed's "resize" (cover 1.125 x the input, centre crop), so facenet-identify
# refuses a set's threshold for a folder's embeddings.
BIN_PREPROCESS = "resize-whole"
# Opcodes storing into the memo at the index they name (the unpickler grows its memo to it).
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


class BinFormatError(DataError):
    """A ``.bin`` file that is refused or does not hold ``(images, issame)``; names the file."""


class BinUnpickler(pickle.Unpickler):
    """An unpickler that refuses every global, so nothing named in the file can be called.

    Every opcode that brings in a callable or a class (GLOBAL, STACK_GLOBAL, INST, OBJ, the
    copyreg extension codes, and through them REDUCE, NEWOBJ and BUILD) goes through
    ``find_class``, persistent ids through ``persistent_load``: both refuse. The only objects
    built are the containers, bytes, strings, numbers and booleans the opcodes make themselves.
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
    """The contents of a ``.bin`` file: 2N encoded images (pair i is ``images[2i]``,
    ``images[2i + 1]``), (N,) bool ``issame``, the file's stem and path (None: name + ".bin"),
    and the (max_pixels, max_aspect_ratio) an image may declare."""

    images: list
    issame: np.ndarray
    name: str
    path: str | None = None
    limits: tuple[int, float] = (DEFAULT_MAX_PIXELS, DEFAULT_MAX_ASPECT_RATIO)

    def __len__(self) -> int:
        return len(self.issame)

    def images_for(self, image_size: ImageSize, normalize: str = "fixed") -> BinImages:
        """The images as a model's input: what :func:`facenet.evaluation.verify.verify` embeds."""
        return BinImages(self, image_size, normalize)


def _check_layout(obj, source: str, file_bytes: int, n_folds: int | None) -> tuple[list, list]:
    """``obj`` as (images, flags), or a BinFormatError saying what is wrong; all before an
    image is decoded."""
    if not isinstance(obj, (tuple, list)) or len(obj) != 2:
        raise BinFormatError(f"{source}: expected a pickled (images, issame) pair")
    images, flags = obj
    for items, kinds, what in (
        (images, (bytes, bytearray), "first item must be a list of encoded images (bytes)"),
        (flags, bool, "second item must be a list of booleans (issame)"),
    ):
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, kinds) for i in items):
            raise BinFormatError(f"{source}: the {what}")
    if len(images) != 2 * len(flags) or not flags or len(flags) > MAX_BIN_PAIRS:
        raise BinFormatError(
            f"{source}: {len(images)} images for {len(flags)} pairs; expected two per pair, "
            f"at most {MAX_BIN_PAIRS} pairs"
        )
    # A pickle may name one image many times: images need not fit in the file otherwise.
    if (total := sum(map(len, images))) > file_bytes:
        raise BinFormatError(
            f"{source}: its images total {total} bytes, more than the file's {file_bytes}: "
            "they repeat one another by reference"
        )
    for fold, same in enumerate(np.array_split(flags, n_folds) if n_folds else []):
        if same.all() or not same.any():  # contiguous folds, as the evaluation cuts them
            raise BinFormatError(
                f"{source}: fold {fold} of {n_folds} ({len(same)} pairs) lacks same or "
                "different pairs; the folds are contiguous, each needs both"
            )
    return list(images), list(flags)


def check_pickle_lengths(raw: bytes, source: str) -> None:
    """Refuse a pickle whose opcodes declare more than the file holds, before it is loaded.

    The unpickler allocates a byte string of the declared length before reading it (an
    8-exabyte one, say) and grows its memo to the index a PUT names; ``pickletools.genops``
    reads from the byte buffer instead, so a length past the end costs nothing here.

    Raises:
        BinFormatError: an opcode runs past the end, no STOP, or a memo index larger than the
            file could hold.
    """
    size = len(raw)
    try:
        for opcode, arg, _ in pickletools.genops(io.BytesIO(raw)):
            if opcode.name in _MEMO_PUTS and not 0 <= int(arg) <= size:
                raise ValueError(f"memo index {arg} in a {size}-byte file")
            if opcode.name == "FRAME" and arg > size:
                raise ValueError(f"a frame of {arg} bytes in a {size}-byte file")
    except ValueError as err:  # genops': a declared length past the end, an unknown opcode, no STOP
        raise BinFormatError(f"{source}: not a readable pickle ({err})") from None


def read_bin(
    path: str | os.PathLike,
    n_folds: int | None = None,
    limits: tuple[int, float] = (DEFAULT_MAX_PIXELS, DEFAULT_MAX_ASPECT_RATIO),
) -> BinPairs:
    """Read an insightface ``.bin`` verification file without running anything in it.

    Args:
        n_folds: refuse the file unless each of that many contiguous folds of pairs holds both
            kinds (None: no check).
        limits: ``(max_pixels, max_aspect_ratio)`` for the images, checked when decoded.

    Raises:
        BinFormatError: a refused pickle, a damaged file, or contents of another layout.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    with open_regular(path, MAX_BIN_BYTES, lambda why: BinFormatError(f"{path}: {why}")) as fh:
        raw = fh.read()
    check_pickle_lengths(raw, str(path))
    try:
        obj = BinUnpickler(io.BytesIO(raw), str(path)).load()
    except BinFormatError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as err:
        raise BinFormatError(f"{path}: not a readable pickle ({err})") from None
    except MemoryError:  # a shape the length check cannot see; never expected
        message = f"{path}: not a readable pickle (it asks for too much memory)"
        raise BinFormatError(message) from None
    images, flags = _check_layout(obj, str(path), len(raw), n_folds)
    return BinPairs(images, np.array(flags, dtype=bool), path.stem, str(path), limits)


class BinImages(torch.utils.data.Dataset):
    """The images of a ``.bin`` file, each decoded (within ``pairs.limits``) into the model's
    input (3, S_h, S_w), prepared as :data:`BIN_PREPROCESS` names."""

    def __init__(self, pairs: BinPairs, image_size: ImageSize, normalize: str = "fixed"):
        self.pairs = pairs
        # Aligned already: resized whole (no crop), then standardised as in training.
        resize = v2.Resize(image_hw(image_size), antialias=True)
        self.transform = v2.Compose([resize, *normalize_steps(normalize)])

    def __len__(self) -> int:
        return len(self.pairs.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        source = f"{self.pairs.path or self.pairs.name + '.bin'}: image {index} (pair {index // 2})"
        try:
            image = decode_image_bytes(self.pairs.images[index], source, *self.pairs.limits)
        except CorruptImageError as err:
            raise BinFormatError(f"{source} cannot be decoded: {err.reason}") from None
        return self.transform(image)
