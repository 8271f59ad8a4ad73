"""MXNet RecordIO without mxnet: ``train.rec`` + ``train.idx`` (+ ``property``), read and written.

The format, as dmlc-core and mxnet's ``recordio.py`` define it:

- a record is the u32 magic 0xCED7230A, a u32 ``cflag << 29 | length``, then ``length`` bytes
  zero-padded to a multiple of 4. Where the payload holds the magic at a 4-aligned offset, the
  writer cuts it there and drops those 4 bytes: parts with cflag 1 (first), 2 (middle) and 3
  (last); cflag 0 is a whole record. A reader joins the parts and puts the magic back.
- ``train.idx``: text, one ``key<TAB>byte offset of the record's magic`` line per record.
- a payload: the header ``<IfQQ`` (flag, label, id, id2); when flag > 0, ``flag`` float32
  labels follow (the header's label is then 0); then the encoded image.
- insightface's layout: key 0 (the meta record) holds labels [first identity key, end) and no
  image; the images are keys 1 .. first - 1, the identity records keys first .. end - 1, each
  holding [first image key, end) and no image. im2rec's layout: every key is an image (a
  packed-label im2rec file also has flag > 0 at key 0, but an image there). An image's label
  is its scalar label or the first of its labels, a float32 holding an integer.
- ``property``: ``classes,height,width`` on its first line.

Opening checks every record the index names before anything is decoded, from a memory map of
``train.rec`` (numpy gathers of each record's first words, no Python loop over the images);
records this fast path cannot vouch for (continuations, and anything broken) are read whole by
:func:`read_record`, which names what is wrong. No read is larger than what the file holds.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from facenet.data.batches import DecodedCache
from facenet.data.image_headers import image_format
from facenet.data.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    CorruptImageError,
    decode_image_bytes,
)
from facenet.errors import DataError, shown, some_names
from facenet.files import open_regular, write_atomic, write_text_atomic

MAGIC = 0xCED7230A
MAGIC_BYTES = struct.pack("<I", MAGIC)  # 0a 23 d7 ce
_CFLAG_SHIFT = 29
MAX_LENGTH = (1 << _CFLAG_SHIFT) - 1  # a part's length field
HEADER = struct.Struct("<IfQQ")  # flag, label, id, id2
# float32 labels hold every integer up to 2**24 exactly: class numbers and keys stay below.
MAX_LABEL = 2**24
REC_FILE, INDEX_FILE, PROPERTY_FILE = "train.rec", "train.idx", "property"
_MAX_INDEX_BYTES = 2**32  # Glint360K's index: about 350 MB
_MAX_PROPERTY_BYTES = 4096
_HEAD_BYTES = 12  # what image_format reads of an image
_CHUNK_RECORDS = 2**13  # records checked per gather: bounds the memory that opening takes
_NAMES_IN_WARNING = 10
_NOT_AN_IMAGE = "empty, or not a JPEG, PNG, GIF, WebP or BMP image"


# --------------------------------------------------------------------------- records


def read_record(fd: int, offset: int, size: int, where: str) -> bytes:
    """The payload of the record whose first part starts at byte ``offset`` of the file ``fd``
    (``size`` bytes long), its parts joined with the magic put back. A DataError naming
    ``where`` and the byte for a part cut short, without its magic, running past ``size`` or
    out of the continuation order (1, 2 ..., 3)."""
    parts: list[bytes] = []
    while True:
        if offset + 8 > size or len(head := os.pread(fd, 8, offset)) < 8:
            raise DataError(f"{where}: the file ends inside the record header at byte {offset}")
        magic, lrec = struct.unpack("<II", head)
        if magic != MAGIC or offset % 4:
            raise DataError(f"{where}: no record magic at byte {offset} (found {head[:4].hex()})")
        cflag, length = lrec >> _CFLAG_SHIFT, lrec & MAX_LENGTH
        if (cflag in (0, 1)) != (not parts):
            expected = "2 or 3 after a first part" if parts else "0 or 1 at a record's start"
            raise DataError(
                f"{where}: broken continuation: cflag {cflag} at byte {offset}, expected {expected}"
            )
        # The length is checked against the file before a buffer of that size is asked for.
        if offset + 8 + length > size or len(part := os.pread(fd, length, offset + 8)) < length:
            raise DataError(
                f"{where}: the record at byte {offset} declares {length} bytes, past the end "
                f"of the file ({size} bytes)"
            )
        parts.append(part)
        if cflag in (0, 3):
            return MAGIC_BYTES.join(parts)
        offset += 8 + length + -length % 4


def split_payload(payload: bytes, where: str) -> tuple[int, float, np.ndarray, bytes]:
    """``(flag, header label, float32 labels (flag,), image bytes)`` of a record's payload."""
    if len(payload) < HEADER.size:
        raise DataError(
            f"{where}: a record of {len(payload)} bytes, shorter than its {HEADER.size}-byte header"
        )
    flag, label, _, _ = HEADER.unpack_from(payload)
    end = HEADER.size + 4 * flag
    if end > len(payload):
        raise DataError(f"{where}: {flag} labels declared, past the record's {len(payload)} bytes")
    return flag, label, np.frombuffer(payload, "<f4", flag, HEADER.size), payload[end:]


def encode_record(payload: bytes) -> bytes:
    """The bytes dmlc's writer puts in a ``.rec`` for ``payload`` (under 2**29 bytes): cut
    where it holds the magic at a 4-aligned offset, the last part zero-padded."""
    words = np.frombuffer(payload, "<u4", len(payload) // 4)
    cuts = (4 * np.flatnonzero(words == MAGIC)).tolist()
    starts, ends = [0, *(c + 4 for c in cuts)], [*cuts, len(payload)]
    flags = [0] if not cuts else [1] + [2] * (len(cuts) - 1) + [3]
    parts = [
        MAGIC_BYTES + struct.pack("<I", flag << _CFLAG_SHIFT | end - start) + payload[start:end]
        for flag, start, end in zip(flags, starts, ends)
    ]
    return b"".join(parts) + bytes(-len(payload) % 4)  # cut parts are whole words already


def labels_payload(labels: Sequence[float]) -> bytes:
    """A payload of ``labels`` and no image: insightface's meta and identity records."""
    return HEADER.pack(len(labels), 0.0, 0, 0) + struct.pack(f"<{len(labels)}f", *labels)


def image_payload(image: bytes, label: int, key: int) -> bytes:
    """An image record's payload: its scalar label and key in the header, the image as it is."""
    return HEADER.pack(0, float(label), key, 0) + image


# --------------------------------------------------------------------------- opening a set


def read_index(path: Path, rec_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, byte offsets)`` int64 (R,) of an index file, sorted by key; a DataError naming
    the file for a line that is not two integers, a duplicate key or an offset outside a
    ``rec_size``-byte file."""
    with open_regular(path, _MAX_INDEX_BYTES) as fh:
        try:
            with warnings.catch_warnings():  # an empty file: refused below, by name
                warnings.simplefilter("ignore", UserWarning)
                table = np.loadtxt(fh, np.int64, delimiter="\t", comments=None, ndmin=2)
        except ValueError as err:  # loadtxt's rows count from 0
            raise DataError(f"{path}: not lines of key<TAB>byte offset ({err})") from None
    if len(table) == 0:
        raise DataError(f"{path}: no records")
    if len(table) > rec_size // 8:  # a record is at least its magic and length words
        raise DataError(
            f"{path}: {len(table)} records, more than {REC_FILE}'s {rec_size} bytes can hold"
        )
    order = np.argsort(table[:, 0], kind="stable")
    keys, offsets = table[order, 0], table[order, 1]
    duplicate = np.flatnonzero(keys[1:] == keys[:-1])
    if duplicate.size:
        raise DataError(f"{path}: key {keys[duplicate[0]]} appears more than once")
    outside = np.flatnonzero((offsets < 0) | (offsets >= rec_size))
    if outside.size:
        i = outside[0]
        raise DataError(
            f"{path}: key {keys[i]}: byte {offsets[i]} is outside {REC_FILE} ({rec_size} bytes)"
        )
    return keys, offsets


@dataclass
class _Records:
    """What opening needs of every record the index names, in key order (R records)."""

    keys: np.ndarray  # int64 (R,)
    offsets: np.ndarray  # int64 (R,) of each first part's magic
    flags: np.ndarray  # int64 (R,) labels stored after the header
    labels: np.ndarray  # float32 (R, 3): the header's label, the first two stored (NaN: none)
    image_bytes: np.ndarray  # int64 (R,)
    heads: np.ndarray  # uint8 (R, 12): each image's first bytes, zeros past its end


def _gather(words: np.ndarray, at: np.ndarray) -> np.ndarray:
    """``words[at]`` with positions past either end clamped (their records are refused)."""
    return words[np.clip(at, 0, len(words) - 1)]


def _fast_records(words: np.ndarray, size: int, offsets: np.ndarray) -> tuple[np.ndarray, ...]:
    """``(flags, labels, image_bytes, heads, trusted)`` (see :class:`_Records`) of the records
    at ``offsets``, read from the file's words; ``trusted`` (R,): where that reading holds, a
    whole record (cflag 0) at a magic, within the file, its labels inside it."""
    at = offsets // 4  # (R,) word of each magic
    lrec = _gather(words, at + 1)
    length = (lrec & MAX_LENGTH).astype(np.int64)
    flags = _gather(words, at + 2).astype(np.int64)
    image_bytes = length - HEADER.size - 4 * flags
    trusted = (
        (offsets % 4 == 0)
        & (offsets + 8 + length <= size)
        & (_gather(words, at) == MAGIC)
        & (lrec >> _CFLAG_SHIFT == 0)
        & (image_bytes >= 0)
    )
    labels = _gather(words, at[:, None] + [3, 8, 9]).view("<f4")  # (R, 3)
    labels[:, 1:][flags[:, None] <= [0, 1]] = np.nan
    image_at = at + 2 + HEADER.size // 4 + flags  # (R,) word where each image starts
    heads = _gather(words, image_at[:, None] + np.arange(_HEAD_BYTES // 4)).view(np.uint8)
    heads[np.arange(_HEAD_BYTES) >= image_bytes[:, None]] = 0  # (R, 12)
    return flags, labels, image_bytes, heads, trusted


def _read_records(rec: Path, fh, size: int, keys, offsets) -> _Records:
    """The records of ``rec``, open as ``fh`` (``size`` bytes), at ``offsets``; those the fast
    path cannot vouch for are read whole (a DataError names the first broken one)."""
    mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size >= 8 else None
    words = np.frombuffer(mapped, "<u4", size // 4) if mapped else np.zeros(1, "<u4")
    n = len(offsets)
    records = _Records(
        keys,
        offsets,
        np.empty(n, np.int64),
        np.empty((n, 3), "<f4"),
        np.empty(n, np.int64),
        np.empty((n, _HEAD_BYTES), np.uint8),
    )
    trusted = np.empty(n, bool)
    for start in range(0, n, _CHUNK_RECORDS):
        rows = slice(start, start + _CHUNK_RECORDS)
        fields = (records.flags, records.labels, records.image_bytes, records.heads, trusted)
        for field, value in zip(fields, _fast_records(words, size, offsets[rows])):
            field[rows] = value
        if mapped:  # the pages read stay in the page cache, out of this process's memory
            mapped.madvise(mmap.MADV_DONTNEED)
    for i in np.flatnonzero(~trusted):
        where = f"{rec} key {keys[i]}"
        flag, label, stored, image = split_payload(
            read_record(fh.fileno(), int(offsets[i]), size, where), where
        )
        records.flags[i], records.image_bytes[i] = flag, len(image)
        records.labels[i] = np.concatenate([[label], stored[:2], [np.nan, np.nan]])[:3]
        records.heads[i] = np.frombuffer(image[:_HEAD_BYTES].ljust(_HEAD_BYTES, b"\0"), np.uint8)
    return records


def _record_error(records: _Records, row: int, rec: Path, reason: str) -> DataError:
    return DataError(f"{rec} key {records.keys[row]} at byte {records.offsets[row]}: {reason}")


def _insightface_images(records: _Records, rec: Path, index: Path) -> slice:
    """The rows of the images, after checking key 0 against the index and the identity records
    (each a [first, end) range of image keys inside the images, overlapping no other)."""
    first, end = (float(v) for v in records.labels[0, 1:])
    n = len(records.keys)
    if not (1 <= first <= end == n == records.keys[-1] + 1 and first.is_integer()):
        raise DataError(
            f"{rec} key 0: images 1 .. {first - 1:g} and identities {first:g} .. {end - 1:g}, "
            f"but {index} holds {n} keys from {records.keys[0]} to {records.keys[-1]}"
        )
    base = int(first)  # rows (= keys) from here on are identity records
    flags, image_bytes = records.flags[base:], records.image_bytes[base:]
    bad = np.flatnonzero((flags < 2) | (image_bytes > 0))
    if bad.size:
        reason = "not an identity record ([first, end) and no image), where key 0 puts them"
        raise _record_error(records, base + bad[0], rec, reason)
    starts, ends = records.labels[base:, 1], records.labels[base:, 2]  # (I,) float32
    bad = np.flatnonzero(~((starts >= 1) & (starts <= ends) & (ends <= first)))  # NaN: bad
    if bad.size:
        i = bad[0]
        reason = (
            f"identity range [{starts[i]:g}, {ends[i]:g}) is outside the images 1 .. {first - 1:g}"
        )
        raise _record_error(records, base + i, rec, reason)
    order = np.argsort(starts, kind="stable")
    bad = np.flatnonzero(starts[order[1:]] < ends[order[:-1]])  # starts inside the previous
    if bad.size:
        row, other = base + order[bad[0] + 1], base + order[bad[0]]
        reason = f"its identity range overlaps that of key {records.keys[other]}"
        raise _record_error(records, row, rec, reason)
    return slice(1, base)


def _image_labels(records: _Records, rec: Path) -> np.ndarray:
    """int64 (N,): each image's scalar label or first stored label, a whole number in
    [0, 2**24)."""
    label = np.where(records.flags == 0, records.labels[:, 0], records.labels[:, 1])
    bad = np.flatnonzero(~((label >= 0) & (label < MAX_LABEL) & (label == np.floor(label))))
    if bad.size:  # NaN compares False: bad
        reason = f"label {float(label[bad[0]])} is not a whole number in [0, {MAX_LABEL})"
        raise _record_error(records, bad[0], rec, reason)
    return label.astype(np.int64)


def _check_property(path: Path, labels: np.ndarray) -> None:
    """``property``'s class count equals the labels' (the file is optional: im2rec writes none)."""
    if not path.exists():
        return
    with open_regular(path, _MAX_PROPERTY_BYTES) as fh:
        line = fh.read().decode("utf-8", "replace").split("\n")[0].strip()
    fields = line.split(",")
    if len(fields) != 3 or not all(f.strip().isdigit() for f in fields):
        raise DataError(f"{path}: expected 'classes,height,width', found {shown(line)}")
    if int(fields[0]) != labels.max() + 1:
        raise DataError(
            f"{path}: {int(fields[0])} classes, but the images' labels run up to {labels.max()}"
        )


@dataclass
class RecordImages:
    """The images of a RecordIO set, in key order (N images): no Python object per image."""

    rec: Path
    size: int  # bytes of the .rec when opened
    layout: str  # "insightface" or "im2rec"
    keys: np.ndarray  # int64 (N,)
    offsets: np.ndarray  # int64 (N,) of each record's first magic
    labels: np.ndarray  # int64 (N,)
    readable: np.ndarray  # bool (N,): non-empty and starting as an image format does


def _readable(images: _Records) -> np.ndarray:
    """bool (N,): which images are non-empty and start as an image format does; image_format
    runs once per distinct head (the JPEGs of one encoder share theirs)."""
    heads = images.heads.view(f"V{_HEAD_BYTES}").ravel()  # (N,)
    distinct, inverse = np.unique(heads, return_inverse=True)
    known = np.array([image_format(head.tobytes()) is not None for head in distinct])
    return known[inverse.ravel()] & (images.image_bytes > 0)


def open_recordio(root: str | os.PathLike) -> RecordImages:
    """The images of ``root/train.rec`` through ``root/train.idx``, every record checked (see
    the module's notes), and ``root/property``, where there is one, checked against them."""
    root = Path(root)
    rec, index = root / REC_FILE, root / INDEX_FILE
    with open_regular(rec, sys.maxsize) as fh:
        size = os.fstat(fh.fileno()).st_size
        keys, offsets = read_index(index, size)
        records = _read_records(rec, fh, size, keys, offsets)
    insightface = keys[0] == 0 and records.flags[0] > 0 and records.image_bytes[0] == 0
    rows = _insightface_images(records, rec, index) if insightface else slice(None)
    images = _Records(*(value[rows] for value in vars(records).values()))
    if len(images.keys) == 0:
        raise DataError(f"{rec}: no images")
    labels = _image_labels(images, rec)
    _check_property(root / PROPERTY_FILE, labels)
    layout = "insightface" if insightface else "im2rec"
    return RecordImages(rec, size, layout, images.keys, images.offsets, labels, _readable(images))


# --------------------------------------------------------------------------- the dataset


class RecordIODataset(Dataset):
    """Face images of a RecordIO set (``root/train.rec``, ``train.idx``, ``property``), either
    layout, labelled by their records' labels; what :class:`IdentityFolder` gives the sampler
    and the loop: ``classes`` (each label kept, as a string, in label order), ``targets``
    (int64 (N,) positions in ``classes``), ``triplet_labels`` (-1 for identities with fewer
    than ``min_images``) and items ``(transform(image), label)``, the image uint8 (3, H, W).

    A record whose image is empty or does not start as an image format does is left out with
    one warning (``on_corrupt="skip"``) or raises :class:`CorruptImageError` (``"error"``);
    one that passes but cannot be decoded raises when loaded, naming its key and byte.
    ``exclude`` names identities left out entirely (held out); ``limits`` and ``cache_bytes``
    as for the folder. The per-image state is numpy arrays, shared by forked workers; each
    process opens ``train.rec`` itself at its first read and reads records by offset.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_corrupt: str = "skip",
        min_images: int = 2,
        exclude: Collection[str] = (),
        limits: tuple[int, float] = (DEFAULT_MAX_PIXELS, DEFAULT_MAX_ASPECT_RATIO),
        cache_bytes: int = 0,
    ):
        if on_corrupt not in ("skip", "error"):
            raise ValueError(f"on_corrupt={on_corrupt!r}: expected 'skip' or 'error'")
        self.root = Path(root)
        images = open_recordio(self.root)
        self.rec, self.size, self.layout = images.rec, images.size, images.layout
        self.skipped = self._apply_corrupt_policy(images, on_corrupt)
        kept = images.readable & ~np.isin(images.labels, [int(name) for name in exclude])
        self.keys, self.offsets = images.keys[kept], images.offsets[kept]  # (N,) int64
        classes, self.targets = np.unique(images.labels[kept], return_inverse=True)
        if len(classes) < 2:
            raise DataError(f"{self.rec}: {len(classes)} identities with usable images; need 2")
        self.classes = [str(label) for label in classes.tolist()]
        self.transform, self.limits = transform, (int(limits[0]), float(limits[1]))
        self.decoded = DecodedCache(cache_bytes)
        self.triplet_labels = self._triplet_labels(min_images)  # (N,) int64
        self._file, self._pid = None, None

    def _apply_corrupt_policy(self, images: RecordImages, on_corrupt: str) -> list[str]:
        bad = [f"key {key}" for key in images.keys[~images.readable].tolist()]
        if bad and on_corrupt == "error":
            where = f"{self.rec} {bad[0]} at byte {images.offsets[~images.readable][0]}"
            more = f" ({len(bad) - 1} more such records)" if len(bad) > 1 else ""
            raise CorruptImageError(where, _NOT_AN_IMAGE + more)
        if bad:
            names = some_names(bad, _NAMES_IN_WARNING)
            skipped = f"skipped {len(bad)} record(s) {_NOT_AN_IMAGE}"
            warnings.warn(f"{self.rec}: {skipped}: {names}", stacklevel=3)
        return bad

    def _triplet_labels(self, min_images: int) -> np.ndarray:
        counts = np.bincount(self.targets, minlength=len(self.classes))  # (C,)
        too_few = counts < min_images
        if too_few.any():
            names = [self.classes[c] for c in np.flatnonzero(too_few)]
            warnings.warn(
                f"{self.rec}: {too_few.sum()} identities with fewer than {min_images} images "
                f"left out of triplet sampling: {some_names(names, _NAMES_IN_WARNING)}",
                stacklevel=3,
            )
        return np.where(too_few[self.targets], -1, self.targets)

    def __getstate__(self):
        # A worker started with spawn opens the file itself.
        return {**self.__dict__, "_file": None, "_pid": None}

    def __len__(self):
        return len(self.targets)

    def read_image_bytes(self, index: int) -> bytes:
        """The encoded image of item ``index``, as it is stored."""
        if self._pid != os.getpid():  # first read in this process (a forked worker too)
            self._file, self._pid = open_regular(self.rec, sys.maxsize), os.getpid()
        where = self._where(index)
        payload = read_record(self._file.fileno(), int(self.offsets[index]), self.size, where)
        return split_payload(payload, where)[3]

    def _where(self, index: int) -> str:
        return f"{self.rec} key {self.keys[index]} at byte {self.offsets[index]}"

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        raw = self.read_image_bytes  # read and named only on a cache miss
        decode = lambda: decode_image_bytes(raw(index), self._where(index), *self.limits)
        return self.decoded.item(index, decode, self.transform), int(self.targets[index])


# --------------------------------------------------------------------------- writing


def write_insightface(
    folder: str | os.PathLike,
    identities: Sequence[Sequence[str | os.PathLike]],
    height_width: tuple[int, int],
) -> tuple[Path, Path, Path]:
    """Write insightface's layout into ``folder``: the meta record (key 0), identity i's image
    files (label i) stored as they are, then one identity record per identity; ``property``
    gives ``height_width``. The folder is made if need be; each file is written atomically
    (``train.rec`` first)."""
    folder = Path(folder)
    counts = [len(paths) for paths in identities]
    first = sum(counts) + 1  # the first identity record's key
    end = first + len(identities)
    if end > MAX_LABEL:
        raise DataError(f"{folder}: {end} records; float32 labels count keys up to {MAX_LABEL}")
    starts = np.cumsum([1, *counts]).tolist()  # (I + 1,) each identity's first image key
    offsets = []

    def put(fh, payload):
        offsets.append(fh.tell())
        fh.write(encode_record(payload))

    def write_records(fh):
        put(fh, labels_payload([first, end]))
        key = 1
        for label, paths in enumerate(identities):
            for path in paths:
                with open_regular(path, MAX_LENGTH - HEADER.size) as image:
                    put(fh, image_payload(image.read(), label, key))
                key += 1
        for start, stop in zip(starts[:-1], starts[1:]):
            put(fh, labels_payload([start, stop]))

    folder.mkdir(parents=True, exist_ok=True)
    rec = write_atomic(folder / REC_FILE, write_records)
    lines = "".join(f"{key}\t{offset}\n" for key, offset in enumerate(offsets))
    index = write_text_atomic(folder / INDEX_FILE, lines)
    height, width = height_width
    prop = write_text_atomic(folder / PROPERTY_FILE, f"{len(identities)},{height},{width}\n")
    return rec, index, prop
