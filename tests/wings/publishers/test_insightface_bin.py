"""insightface .bin verification sets: the restricted reader, and evaluate.py --bin end to end."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from image_cases import BAD, GOOD, SIDE  # tests/ is on the path (pyproject.toml)
from torchvision.io import decode_image, encode_png
from torchvision.transforms.v2 import functional as TF

from benchmarks import reference_evaluation as ref
from facenet.cli import evaluate as evaluate_script
from facenet.data.folder import list_images
from facenet.data.images import read_image
from facenet.evaluation.protocol import default_thresholds
from facenet.wings.after_training.loading import load_model
from facenet.wings.publishers import insightface_bin
from facenet.wings.publishers.insightface_bin import BinFormatError, BinImages, read_bin

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def write_bin(path: Path, tiny_run, n_pairs: int, seed: int) -> tuple[list, list]:
    """A .bin of held-out faces as 112 px PNGs: same pairs (one identity) and different ones,
    alternating so that each of the 10 contiguous folds holds both."""
    paths, labels = list_images(tiny_run["heldout"])
    rng = np.random.default_rng(seed)
    by_id = {name: [p for p, lab in zip(paths, labels) if lab == name] for name in set(labels)}
    names = sorted(by_id)
    images, issame = [], []
    for i in range(n_pairs):
        same = i % 2 == 0
        a, b = rng.choice(len(names), size=2, replace=False)
        first, second = (names[a], names[a]) if same else (names[a], names[b])
        for name, index in ((first, 0), (second, 1 if same else 0)):
            face = TF.resize(read_image(by_id[name][index]), [112, 112], antialias=True)
            images.append(encode_png(face).numpy().tobytes())
        issame.append(same)
    path.write_bytes(pickle.dumps((images, issame), protocol=pickle.HIGHEST_PROTOCOL))
    return images, issame


def test_a_written_bin_reads_back(tiny_run, tmp_path):
    images, issame = write_bin(tmp_path / "lfw.bin", tiny_run, 10, seed=0)
    pairs = read_bin(tmp_path / "lfw.bin")
    assert pairs.name == "lfw" and pairs.images == images and pairs.issame.tolist() == issame


def test_a_python2_file_reads_its_str_images_as_bytes(tmp_path):
    # Protocol 2 as Python 2 wrote it: SHORT_BINSTRING ('U') for str, NEWTRUE/NEWFALSE.
    raw = b"\x80\x02]q\x00(U\x03abcU\x03defe]q\x01\x88a\x86q\x02."
    (tmp_path / "py2.bin").write_bytes(raw)
    pairs = read_bin(tmp_path / "py2.bin")
    assert pairs.images == [b"abc", b"def"] and pairs.issame.tolist() == [True]


def test_a_crafted_bin_that_would_run_code_is_refused_by_name(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "agedb_30.bin").write_bytes(pickle.dumps(([Evil(), b"x"], [True])))
    with pytest.raises(BinFormatError) as caught:
        read_bin(tmp_path / "agedb_30.bin")
    assert "refused to load" in str(caught.value) and "agedb_30.bin" in str(caught.value)
    assert "io.open" in str(caught.value)  # the global the pickle asked for
    assert not marker.exists()


@pytest.mark.parametrize(
    ("contents", "message"),
    [
        ([b"a"], "(images, issame) pair"),
        (([b"a", "text"], [True]), "list of encoded images"),
        (([b"a", b"b"], [1]), "list of booleans"),
        (([b"a", b"b", b"c"], [True]), "3 images for 1 pairs"),
    ],
)
def test_other_layouts_are_named(tmp_path, contents, message):
    (tmp_path / "x.bin").write_bytes(pickle.dumps(contents))
    with pytest.raises(BinFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_bin(tmp_path / "x.bin")


def brute_force_embeddings(trained, images: list) -> np.ndarray:
    """Each image decoded, resized to S x S, standardised and embedded on its own."""
    rows = []
    for raw in images:
        face = read_image_bytes(raw)
        face = TF.resize(face, [trained.image_size] * 2, antialias=True).float()
        with torch.no_grad():
            rows.append(trained.model(((face - 127.5) / 128)[None])[0].numpy())
    return np.stack(rows)


def read_image_bytes(raw: bytes) -> torch.Tensor:
    return decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def test_evaluate_bin_rows_match_the_classic_loops(tiny_run, tmp_path, capsys):
    sets = {
        name: write_bin(tmp_path / f"{name}.bin", tiny_run, 40, s)
        for s, name in enumerate(("lfw", "cfp_fp"))
    }
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--out", str(tmp_path / "out")]
    for name in sets:
        argv += ["--bin", str(tmp_path / f"{name}.bin")]
    assert evaluate_script.main(argv) == 0
    settings_line, *printed = capsys.readouterr().out.splitlines()
    assert settings_line.startswith("evaluation settings: ")
    assert printed[0].split()[:3] == ["set", "accuracy", "VAL"]
    assert [line.split()[0] for line in printed[1:3]] == ["lfw", "cfp_fp"]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["sets"]
    assert (tmp_path / "out" / "roc_cfp_fp.png").is_file()
    trained = load_model(tiny_run["checkpoint"])
    for name, (images, issame) in sets.items():
        emb = brute_force_embeddings(trained, images)
        _, _, accuracy, best = ref.calculate_roc(
            default_thresholds(), emb[0::2], emb[1::2], np.array(issame), 10
        )
        assert metrics[name]["accuracy"] == pytest.approx(accuracy.tolist())
        assert metrics[name]["threshold"] == pytest.approx(best.mean())
        assert metrics[name]["threshold_distance"] == "squared"


def test_evaluate_refuses_a_crafted_bin_on_one_line(tiny_run, tmp_path, capsys):
    (tmp_path / "evil.bin").write_bytes(b"\x80\x04cos\nsystem\n(Vtouch x\ntR.")
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--bin", str(tmp_path / "evil.bin")]
    assert evaluate_script.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refused to load") and "os.system" in err
    assert len(err.splitlines()) == 1


# --------------------------------------------------------------------------- hostile files

# Pickles declaring more than they hold: the unpickler would allocate the declared length (or
# grow its memo to the index) before finding the file too short.
HUGE_DECLARATIONS = {
    "bytes8": b"\x80\x04\x8e" + (2**62).to_bytes(8, "little"),
    "unicode8": b"\x80\x04\x8d" + (2**40).to_bytes(8, "little"),
    "binbytes": b"\x80\x03B" + (2**31 - 1).to_bytes(4, "little"),
    "long4": b"\x80\x02\x8b" + (2**31 - 1).to_bytes(4, "little"),
    "memo index": b"\x80\x04Nr" + (2**31).to_bytes(4, "little") + b".",
    "frame": b"\x80\x04\x95" + (2**50).to_bytes(8, "little") + b"N.",
    "no stop": b"\x80\x04N",
}


@pytest.mark.parametrize("name", sorted(HUGE_DECLARATIONS))
def test_a_pickle_declaring_more_than_it_holds_is_refused_before_loading(tmp_path, name):
    (tmp_path / "x.bin").write_bytes(HUGE_DECLARATIONS[name])
    with pytest.raises(BinFormatError, match="not a readable pickle") as caught:
        read_bin(tmp_path / "x.bin")
    assert str(tmp_path / "x.bin") in str(caught.value)


def test_a_fifo_named_bin_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "lfw.bin")
    with pytest.raises(BinFormatError, match="not a regular file"):
        read_bin(tmp_path / "lfw.bin")


def test_a_bin_of_animated_gifs_reads_their_first_frames(tmp_path):
    data, first = GOOD["gif_animated"].data, GOOD["gif_animated"].expected
    copy = bytes(bytearray(data))  # another object: pickle stores it, not a reference
    (tmp_path / "gifs.bin").write_bytes(pickle.dumps(([data, copy], [True])))
    images = BinImages(read_bin(tmp_path / "gifs.bin"), SIDE)
    assert torch.equal((images[1] * 128 + 127.5).round().to(torch.uint8), first)


def hostile_bins(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """.bin files that must end in one error line: the file and a phrase of the message."""
    out = {}
    for name in ("png_crc_damaged", "jpeg_huge", "png_bad_filter", "gif_huge_frame"):
        # 10 folds of both kinds; pickle stores each copy whole, not a reference
        copies = [bytes(bytearray(GOOD["png"].data)) for _ in range(38)]
        images = [GOOD["png"].data, BAD[name].data, *copies]
        path = tmp_path / f"{name}.bin"
        path.write_bytes(pickle.dumps((images, [False, True] * 10)))
        out[name] = (path, f"{path}: image 1 (pair 0) cannot be decoded")
    for name, raw in (
        ("huge length", HUGE_DECLARATIONS["bytes8"]),
        ("gif", GOOD["gif_animated"].data),
    ):
        path = tmp_path / f"{name.replace(' ', '_')}.bin"
        path.write_bytes(raw)
        out[name] = (path, f"{path}: not a readable pickle")
    return out


def test_evaluate_reports_every_hostile_bin_on_one_line(tiny_run, tmp_path, capsys):
    # In process: a segmentation fault (the damaged PNG, before) would take pytest down with it.
    for name, (path, message) in hostile_bins(tmp_path).items():
        argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--bin", str(path)]
        assert evaluate_script.main([*argv, "--out", str(tmp_path / "out")]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (name, err)
        assert len(err.splitlines()) == 1, (name, err)


def test_bin_images_are_resized_whole_to_height_by_width(tiny_run, tmp_path):
    write_bin(tmp_path / "lfw.bin", tiny_run, 2, seed=0)
    images = BinImages(read_bin(tmp_path / "lfw.bin"), [24, 20])
    assert images[0].shape == (3, 24, 20)  # 112 x 112 faces squeezed to (H, W)


# ------------------------------------------------------------ structure before any decoding


def test_images_repeated_by_reference_are_refused_before_decoding(tmp_path):
    image, other = GOOD["png"].data, GOOD["jpeg"].data  # pickle writes a repeat as a reference
    for name, images in (("one", [image] * 2000), ("two", [image, other] * 1000)):
        (tmp_path / f"{name}.bin").write_bytes(pickle.dumps((images, [True, False] * 500)))
        with pytest.raises(BinFormatError, match="more than the file's .* by reference"):
            read_bin(tmp_path / f"{name}.bin")


def test_more_pairs_than_allowed_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(insightface_bin, "MAX_BIN_PAIRS", 10)
    images = [bytes([i % 256]) * 3 for i in range(22)]
    (tmp_path / "x.bin").write_bytes(pickle.dumps((images, [True, False] * 5 + [True])))
    with pytest.raises(BinFormatError, match="22 images for 11 pairs.*at most 10 pairs"):
        read_bin(tmp_path / "x.bin")


@pytest.mark.parametrize(
    ("issame", "folds", "bad"),
    [
        ([True] * 20, 10, 0),  # one kind only
        ([True, False] * 9 + [False, False], 10, 9),  # the last fold
        ([True, False] * 2, 10, 0),  # fewer pairs than folds
        ([True] * 10 + [False] * 10, 2, 0),  # sorted by kind
    ],
)
def test_folds_without_both_kinds_are_refused_before_decoding(tmp_path, issame, folds, bad):
    images = [f"not an image {i}".encode() for i in range(2 * len(issame))]
    (tmp_path / "x.bin").write_bytes(pickle.dumps((images, issame)))
    assert len(read_bin(tmp_path / "x.bin")) == len(issame)  # no folds asked: no check
    with pytest.raises(BinFormatError, match=f"fold {bad} of {folds} .* lacks same or different"):
        read_bin(tmp_path / "x.bin", folds)


def test_evaluate_refuses_bad_folds_before_embedding_and_honours_the_pixel_limit(
    tiny_run, tmp_path, capsys
):
    images = [f"not an image {i}".encode() for i in range(40)]
    (tmp_path / "same.bin").write_bytes(pickle.dumps((images, [True] * 20)))
    write_bin(tmp_path / "lfw.bin", tiny_run, 20, seed=0)  # 112 x 112 faces
    (tmp_path / "run.yaml").write_text("data:\n  max_image_pixels: 10000\n")
    argv = ["--checkpoint", str(tiny_run["checkpoint"]), "--out", str(tmp_path / "out")]
    for extra, message in (
        (["--bin", str(tmp_path / "same.bin")], "same.bin: fold 0 of 10 (2 pairs) lacks"),
        (["--bin", str(tmp_path / "same.bin"), "--folds", "2"], "fold 0 of 2 (10 pairs)"),
        (
            ["--bin", str(tmp_path / "lfw.bin"), "--config", str(tmp_path / "run.yaml")],
            "lfw.bin: image 0 (pair 0) cannot be decoded",
        ),
    ):
        assert evaluate_script.main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    assert "data.max_image_pixels" in err
    assert not (tmp_path / "out").exists()
