"""RecordIO without mxnet: records and their continuation parts, both layouts, the format's
reference vector, the dataset's interface, and every kind of bad input refused in one line
naming the file, key or byte before a declared length is read."""

from __future__ import annotations

import os
import pickle
import struct
from pathlib import Path

import pytest
import torch

from facenet.cli.common import run_command
from facenet.data import recordio
from facenet.data.images import CorruptImageError, decode_image_bytes
from facenet.data.loading import make_loader
from facenet.data.recordio import (
    HEADER,
    MAGIC_BYTES,
    RecordIODataset,
    encode_record,
    image_payload,
    labels_payload,
    open_recordio,
    write_insightface,
)
from facenet.data.samplers import PKSampler
from facenet.errors import DataError
from tests.image_cases import BAD, GOOD

# The format's reference vector (what mxnet 1.9.1's recordio writes): key 0 of a set of 5
# images and 2 identities.
META_5_2 = bytes.fromhex(
    "0a23d7ce 20000000 02000000 00000000 0000000000000000 0000000000000000 0000c040 00000041"
)
JPEG = GOOD["jpeg"].data


def write_set(root: Path, payloads: list[bytes], keys=None) -> list[int]:
    """``root/train.rec`` of ``payloads`` in order and its index (keys 0, 1, ... unless
    given); the byte offset of each record."""
    rec, offsets = b"", []
    for payload in payloads:
        offsets.append(len(rec))
        rec += encode_record(payload)
    root.mkdir(exist_ok=True)
    (root / "train.rec").write_bytes(rec)
    keys = range(len(payloads)) if keys is None else keys
    (root / "train.idx").write_text("".join(f"{k}\t{o}\n" for k, o in zip(keys, offsets)))
    return offsets


def identity_files(tmp_path: Path, images: list[list[bytes]]) -> list[list[Path]]:
    """The encoded images written as files, one list per identity."""
    files = []
    for label, encoded in enumerate(images):
        files.append([tmp_path / f"{label}_{i}.img" for i in range(len(encoded))])
        for path, data in zip(files[-1], encoded):
            path.write_bytes(data)
    return files


def parts(rec: bytes, offset: int) -> list[tuple[int, int]]:
    """``(cflag, length)`` of each part of the record at ``offset``."""
    found = []
    while not found or found[-1][0] in (1, 2):
        magic, lrec = struct.unpack_from("<4sI", rec, offset)
        assert magic == MAGIC_BYTES
        found.append((lrec >> 29, lrec & (2**29 - 1)))
        offset += 8 + found[-1][1] + -found[-1][1] % 4
    return found


@pytest.fixture
def packed(tmp_path) -> tuple[Path, list[list[Path]]]:
    """insightface's layout of 2 identities x 3 images (every GOOD format among them)."""
    formats = [case.data for case in GOOD.values()]
    files = identity_files(tmp_path, [formats[:3], formats[3:6]])
    write_insightface(tmp_path / "set", files, (24, 24))
    return tmp_path / "set", files


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("chunk", [2, 2**16])
def test_every_image_comes_back_byte_for_byte_with_its_identity(packed, chunk, monkeypatch):
    monkeypatch.setattr(recordio, "_CHUNK_RECORDS", chunk)  # records checked per gather
    root, files = packed
    dataset = RecordIODataset(root)
    assert dataset.layout == "insightface" and dataset.classes == ["0", "1"]
    assert dataset.targets.tolist() == [0, 0, 0, 1, 1, 1]
    flat = [path for paths in files for path in paths]
    assert [dataset.read_image_bytes(i) for i in range(6)] == [p.read_bytes() for p in flat]
    assert (root / "property").read_text() == "2,24,24\n"


def test_images_of_every_format_decode_as_the_checked_decoder_decodes_them(tmp_path):
    cases = list(GOOD.values())
    write_set(tmp_path, [image_payload(c.data, i % 2, i) for i, c in enumerate(cases)])
    dataset = RecordIODataset(tmp_path)
    for i, case in enumerate(cases):
        image, label = dataset[i]
        assert torch.equal(image, case.expected) and label == i % 2, i


def test_the_meta_record_of_five_images_and_two_identities_is_the_reference_vector(tmp_path):
    files = identity_files(tmp_path, [[JPEG] * 3, [JPEG] * 2])
    rec, index, _ = write_insightface(tmp_path / "set", files, (24, 24))
    assert rec.read_bytes()[:40] == META_5_2
    assert index.read_text().splitlines()[:2] == ["0\t0", "1\t40"]
    images = open_recordio(tmp_path / "set")
    assert images.keys.tolist() == [1, 2, 3, 4, 5] and images.labels.tolist() == [0, 0, 0, 1, 1]


def test_a_set_written_by_hand_from_the_test_vector_reads_as_insightfaces_layout(tmp_path):
    images = [image_payload(JPEG, label, key) for key, label in enumerate([0, 0, 0, 1, 1], 1)]
    identities = [labels_payload([1, 4]), labels_payload([4, 6])]
    rec, offsets = META_5_2, [0]
    for payload in images + identities:
        offsets.append(len(rec))
        rec += encode_record(payload)
    (tmp_path / "train.rec").write_bytes(rec)
    (tmp_path / "train.idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets)))
    found = open_recordio(tmp_path)
    assert found.layout == "insightface" and found.labels.tolist() == [0, 0, 0, 1, 1]
    assert found.offsets.tolist() == offsets[1:6]


def jpeg_holding_magic(count: int) -> bytes:
    """A valid JPEG whose comment segment holds the magic ``count`` times in a row, from the
    payload's byte 32 (a 4-aligned offset: the 24-byte header, then SOI, COM, its length)."""
    comment = b"ab" + MAGIC_BYTES * count + b"cd"
    return JPEG[:2] + b"\xff\xfe" + struct.pack(">H", len(comment) + 2) + comment + JPEG[2:]


@pytest.mark.parametrize("count, flags", [(1, [1, 3]), (2, [1, 2, 3])])
def test_a_record_holding_the_magic_is_cut_there_and_read_back_whole(tmp_path, count, flags):
    image = jpeg_holding_magic(count)
    files = identity_files(tmp_path, [[image, JPEG], [JPEG, image]])
    rec, _, _ = write_insightface(tmp_path / "set", files, (24, 24))
    dataset = RecordIODataset(tmp_path / "set")
    written = rec.read_bytes()
    assert [c for c, _ in parts(written, int(dataset.offsets[0]))] == flags
    assert [c for c, _ in parts(written, int(dataset.offsets[1]))] == [0]
    assert dataset.read_image_bytes(0) == image and dataset.read_image_bytes(3) == image
    assert torch.equal(dataset[0][0], decode_image_bytes(JPEG, "jpeg"))


def test_im2rec_layout_reads_every_key_as_an_image_with_scalar_or_stored_labels(tmp_path):
    stored = HEADER.pack(2, 0.0, 0, 0) + struct.pack("<2f", 1.0, 7.0)  # label 1, and another
    payloads = [stored + JPEG, image_payload(JPEG, 0, 1), image_payload(JPEG, 1, 2)]
    write_set(tmp_path, [payloads[1], payloads[0], payloads[2]], keys=[5, 10, 7])
    images = open_recordio(tmp_path)  # key 0 is absent; a packed label at a key is an image
    assert images.layout == "im2rec" and images.keys.tolist() == [5, 7, 10]
    assert images.labels.tolist() == [0, 1, 1]
    write_set(tmp_path, payloads)  # flag > 0 at key 0, with an image: still im2rec's
    assert open_recordio(tmp_path).layout == "im2rec"


# --------------------------------------------------------------------------- the dataset


def test_the_sampler_and_loader_draw_from_it_each_worker_opening_the_file(packed):
    root, files = packed
    dataset = RecordIODataset(root)
    sampler = PKSampler(dataset.triplet_labels, p=2, k=2, seed=0)
    loader = make_loader(dataset, sampler, num_workers=2, persistent_workers=False)
    for images, labels in loader:
        assert images.shape[0] == 4 and sorted(labels.tolist()) == [0, 0, 1, 1]
    assert dataset._file is None  # the workers read; this process never opened train.rec
    dataset.read_image_bytes(0)
    assert pickle.loads(pickle.dumps(dataset))._file is None  # spawn: the worker opens its own


def test_the_per_image_state_is_arrays_of_at_most_64_bytes_an_image(packed):
    dataset = RecordIODataset(packed[0])
    per_image = [v for v in vars(dataset).values() if getattr(v, "shape", None) == (6,)]
    assert sum(v.nbytes for v in per_image) / len(dataset) <= 64
    assert not [v for v in vars(dataset).values() if isinstance(v, list) and len(v) == 6]


def test_held_out_and_small_identities_as_the_folder_leaves_them(tmp_path):
    files = identity_files(tmp_path, [[JPEG] * 2, [JPEG], [JPEG] * 3])
    write_insightface(tmp_path / "set", files, (24, 24))
    with pytest.warns(UserWarning, match="1 identities with fewer than 2 images"):
        dataset = RecordIODataset(tmp_path / "set")
    assert dataset.triplet_labels.tolist() == [0, 0, -1, 2, 2, 2]
    dataset = RecordIODataset(tmp_path / "set", exclude=["1"])
    assert dataset.classes == ["0", "2"] and dataset.targets.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(DataError, match="1 identities with usable images; need 2"):
        RecordIODataset(tmp_path / "set", exclude=["0", "1"])
    with pytest.raises(ValueError, match="on_corrupt='ignore'"):
        RecordIODataset(tmp_path / "set", on_corrupt="ignore")


# --------------------------------------------------------------------------- bad input


def test_a_record_that_is_no_image_is_skipped_with_a_warning_or_refused(tmp_path):
    files = identity_files(tmp_path, [[JPEG, b"plain text, no image", JPEG], [JPEG, b"", JPEG]])
    write_insightface(tmp_path / "set", files, (24, 24))
    with pytest.warns(UserWarning, match=r"skipped 2 record\(s\) empty, or not a .*: key 2, key 5"):
        dataset = RecordIODataset(tmp_path / "set")
    assert dataset.keys.tolist() == [1, 3, 4, 6] and dataset.skipped == ["key 2", "key 5"]
    with pytest.raises(CorruptImageError, match=r"train.rec key 2 at byte \d+: .*1 more"):
        RecordIODataset(tmp_path / "set", on_corrupt="error")


@pytest.mark.parametrize("name", sorted(BAD))
def test_an_image_that_does_not_decode_names_its_key_and_byte_when_loaded(tmp_path, name):
    case = BAD[name]
    write_set(tmp_path, [image_payload(case.data, 0, 0)] + [image_payload(JPEG, 1, 1)] * 2)
    if name == "not_an_image":  # refused at opening by its first bytes
        with pytest.raises(CorruptImageError, match="key 0 at byte 0"):
            RecordIODataset(tmp_path, min_images=1, on_corrupt="error")
        return
    dataset = RecordIODataset(tmp_path, min_images=1, on_corrupt="error")
    with pytest.raises(CorruptImageError, match=f"train.rec key 0 at byte 0: .*{case.reason}"):
        dataset[0]


def edit(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def set_index(root: Path, key: int, offset: int | str) -> None:
    lines = (root / "train.idx").read_text().splitlines()
    lines[key] = f"{key}\t{offset}"
    (root / "train.idx").write_text("\n".join(lines) + "\n")


def f32(value: float) -> bytes:
    return struct.pack("<f", value)


# name -> (what breaks the 2 x 3 set, a phrase of the error). Keys: 0 meta, 1-6 images (labels
# 0, 0, 0, 1, 1, 1), 7-8 identity records; ``at[k]``: where key k's record starts.
BREAKAGES = {
    "truncated record": (
        lambda root, at: os.truncate(root / "train.rec", at[8] + 4),
        "key 8: the file ends inside the record header at byte {8}",
    ),
    "record shorter than its header": (
        lambda root, at: edit(root / "train.rec", at[3] + 4, struct.pack("<I", 20)),
        "key 3: a record of 20 bytes, shorter than its 24-byte header",
    ),
    "wrong magic": (
        lambda root, at: edit(root / "train.rec", at[2], b"\x0a\x23\xd7\xcf"),
        "key 2: no record magic at byte {2} (found 0a23d7cf)",
    ),
    "length past the end": (
        lambda root, at: edit(root / "train.rec", at[8] + 4, struct.pack("<I", 2**29 - 1)),
        "key 8: the record at byte {8} declares 536870911 bytes, past the end of the file",
    ),
    "labels past the record": (
        lambda root, at: edit(root / "train.rec", at[8] + 8, struct.pack("<I", 2**32 - 1)),
        "key 8: 4294967295 labels declared, past the record's 32 bytes",
    ),
    "a 3 without a 1": (
        lambda root, at: edit(root / "train.rec", at[4] + 7, bytes([3 << 5])),
        "key 4: broken continuation: cflag 3 at byte {4}, expected 0 or 1",
    ),
    "a 1 followed by a 0": (
        lambda root, at: edit(root / "train.rec", at[4] + 7, bytes([1 << 5])),
        "key 4: broken continuation: cflag 0 at byte {5}, expected 2 or 3",
    ),
    "an index offset outside the file": (
        lambda root, at: set_index(root, 3, 10**9),
        "train.idx: key 3: byte 1000000000 is outside train.rec",
    ),
    "a negative index offset": (
        lambda root, at: set_index(root, 3, -8),
        "train.idx: key 3: byte -8 is outside train.rec",
    ),
    "an index offset not at a magic": (
        lambda root, at: set_index(root, 3, at[3] + 4),
        "key 3: no record magic at byte {3+4}",
    ),
    "an index line that is not two integers": (
        lambda root, at: set_index(root, 3, "x"),
        "train.idx: not lines of key<TAB>byte offset (could not convert string 'x'",
    ),
    "an empty index": (
        lambda root, at: (root / "train.idx").write_text("\n"),
        "train.idx: no records",
    ),
    "duplicate keys": (
        lambda root, at: set_index(root, 3, f"{at[3]}\n3\t{at[4]}"),
        "train.idx: key 3 appears more than once",
    ),
    "label NaN": (
        lambda root, at: edit(root / "train.rec", at[2] + 12, f32(float("nan"))),
        "key 2 at byte {2}: label nan is not a whole number in [0, 16777216)",
    ),
    "label infinite": (
        lambda root, at: edit(root / "train.rec", at[2] + 12, f32(float("inf"))),
        "key 2 at byte {2}: label inf is not a whole number",
    ),
    "label negative": (
        lambda root, at: edit(root / "train.rec", at[2] + 12, f32(-1.0)),
        "key 2 at byte {2}: label -1.0 is not a whole number",
    ),
    "label fractional": (
        lambda root, at: edit(root / "train.rec", at[2] + 12, f32(1.5)),
        "key 2 at byte {2}: label 1.5 is not a whole number",
    ),
    "label past float32's integers": (
        lambda root, at: edit(root / "train.rec", at[2] + 12, f32(2.0**24)),
        "key 2 at byte {2}: label 16777216.0 is not a whole number",
    ),
    "identity range outside the images": (
        lambda root, at: edit(root / "train.rec", at[8] + 36, f32(9.0)),
        "key 8 at byte {8}: identity range [4, 9) is outside the images 1 .. 6",
    ),
    "identity range overlapping another": (
        lambda root, at: edit(root / "train.rec", at[8] + 32, f32(3.0)),
        "key 8 at byte {8}: its identity range overlaps that of key 7",
    ),
    "an image where key 0 puts identities": (
        lambda root, at: edit(root / "train.rec", at[0] + 32, f32(6.0)),
        "key 6 at byte {6}: not an identity record",
    ),
    "a meta record that disagrees with the index": (
        lambda root, at: (root / "train.idx").write_text(
            "".join(f"{k}\t{o}\n" for k, o in enumerate(at[:8]))
        ),
        "key 0: images 1 .. 6 and identities 7 .. 8, but",
    ),
    "a property that disagrees with the labels": (
        lambda root, at: (root / "property").write_text("3,24,24\n"),
        "property: 3 classes, but the images' labels run up to 1",
    ),
    "a property that is not three numbers": (
        lambda root, at: (root / "property").write_text("two,24\n"),
        "property: expected 'classes,height,width', found 'two,24'",
    ),
    "an image that is not one": (
        lambda root, at: edit(root / "train.rec", at[5] + 32, b"text"),
        "train.rec key 5 at byte {5}: empty, or not a JPEG",
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_bad_input_is_one_line_naming_the_file_and_key_or_byte_and_exit_2(
    name, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(recordio, "_CHUNK_RECORDS", 4)  # records checked in three gathers
    files = identity_files(tmp_path, [[JPEG] * 3, [JPEG] * 3])
    root = tmp_path / "set"
    write_insightface(root, files, (24, 24))
    at = [int(line.split("\t")[1]) for line in (root / "train.idx").read_text().splitlines()]
    breakage, phrase = BREAKAGES[name]
    breakage(root, at)
    expected = phrase.replace("{3+4}", str(at[3] + 4))
    expected = expected.format(*at)
    assert run_command(lambda: RecordIODataset(root, on_corrupt="error")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert expected in err and str(root) in err, err


def test_no_read_asks_for_more_than_the_file_holds(tmp_path, monkeypatch):
    write_set(tmp_path, [image_payload(JPEG, 0, 0)] * 3)
    size = (tmp_path / "train.rec").stat().st_size
    # The last record declares the longest length there is, at cflag 1 to take the slow path.
    edit(
        tmp_path / "train.rec",
        size - len(encode_record(image_payload(JPEG, 0, 0))) + 4,
        struct.pack("<I", 1 << 29 | 2**29 - 1),
    )
    asked = []
    pread = os.pread
    monkeypatch.setattr(recordio.os, "pread", lambda fd, n, at: asked.append(n) or pread(fd, n, at))
    with pytest.raises(DataError, match="declares 536870911 bytes, past the end"):
        open_recordio(tmp_path)
    assert asked and max(asked) <= size
