"""Face alignment (facenet.wings.align.aligner, facenet-align) on a real photograph that
scikit-image ships, and the evaluation preprocessing of the publishers' presets against
facenet-pytorch's own InceptionResnetV1 fed as its README and notebook feed it.

The template presets (arcface, sphereface) are checked against an independent computation: a
closed-form Umeyama fit in numpy and a warp by torch's grid_sample. Detection on a reduced
copy is checked by wrapping MTCNN (the size it is given) and against detection at full size."""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

facenet_pytorch = pytest.importorskip("facenet_pytorch")
skimage_data = pytest.importorskip("skimage.data")

from image_cases import BAD, GOOD  # noqa: E402  (tests/ is on the path: pyproject.toml)

from facenet import files  # noqa: E402
from facenet.cli import align as align_script  # noqa: E402
from facenet.data.pairs import read_pairs  # noqa: E402
from facenet.evaluation.embedding import embed_pair_list  # noqa: E402
from facenet.evaluation.presets import VerifySettings  # noqa: E402
from facenet.wings.after_training.loading import load_model  # noqa: E402
from facenet.wings.align import aligner as align_module  # noqa: E402
from facenet.wings.align.aligner import (  # noqa: E402
    SETTINGS_FILE,
    Aligner,
    AlignSettings,
    align_face,
    crop_box,
    detection_scale,
    select_face,
    similarity_matrix,
    to_full_image,
)
from facenet.wings.align.presets import TEMPLATES  # noqa: E402

ASTRONAUT = Path(skimage_data.__file__).parent / "astronaut.png"  # 512 x 512, one face


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """LFW-style folder: the astronaut, its mirror image, a blank image and a damaged JPEG."""
    src = tmp_path_factory.mktemp("raw")
    for name, image in (
        ("Astronaut", Image.open(ASTRONAUT).convert("RGB")),
        ("Mirror", Image.open(ASTRONAUT).convert("RGB").transpose(Image.FLIP_LEFT_RIGHT)),
        ("Blank", Image.new("RGB", (250, 250), (128, 128, 128))),
    ):
        (src / name).mkdir()
        image.save(src / name / f"{name}_0001.png")
    (src / "Damaged").mkdir()
    (src / "Damaged" / "Damaged_0001.jpg").write_bytes(b"\xff\xd8\xff\xe0" + b"\x00" * 64)
    return src


SANDBERG_182 = ("--image-size", "182", "--margin", "44")


def _align(src, dst, *flags) -> tuple[int, str]:
    return align_script.main([str(src), str(dst), "--no-progress", *flags])


@pytest.fixture(scope="module")
def aligned(source, tmp_path_factory) -> dict:
    """One alignment run per preset (MTCNN runs once per image and preset)."""
    out = {}
    for preset in ("facenet-pytorch", "sandberg", "arcface", "sphereface"):
        dst = tmp_path_factory.mktemp(preset)
        assert _align(source, dst, "--preset", preset) == 0
        out[preset] = dst
    # davidsandberg/facenet's training convention: 182 px, margin 44, centre 160 fed
    out["sandberg-182"] = tmp_path_factory.mktemp("sandberg-182")
    assert _align(source, out["sandberg-182"], "--preset", "sandberg", *SANDBERG_182) == 0
    return out


# --------------------------------------------------------------------------- alignment


def test_one_face_found_and_written_under_the_same_relative_path(aligned):
    dst = aligned["facenet-pytorch"]
    crop = Image.open(dst / "Astronaut" / "Astronaut_0001.png")
    assert crop.size == (160, 160)
    assert Image.open(aligned["sandberg"] / "Astronaut" / "Astronaut_0001.png").size == (160, 160)
    assert Image.open(aligned["sandberg-182"] / "Astronaut" / "Astronaut_0001.png").size == (
        182,
        182,
    )
    written = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*.png"))
    assert written == ["Astronaut/Astronaut_0001.png", "Mirror/Mirror_0001.png"]


def _sandberg_crop(image: Image.Image, box, size: int, margin: int) -> np.ndarray:
    """davidsandberg/facenet's align_dataset_mtcnn.py around ``box``: ``margin`` input px,
    int32 truncation, clipped, then scipy's imresize (PIL bilinear) to ``size``."""
    bb = np.zeros(4, dtype=np.int32)
    bb[:2] = np.maximum(np.asarray(box[:2]) - margin / 2, 0)
    bb[2:] = np.minimum(np.asarray(box[2:]) + margin / 2, image.size)
    cropped = np.asarray(image)[bb[1] : bb[3], bb[0] : bb[2], :]
    return np.asarray(Image.fromarray(cropped).resize((size, size), Image.BILINEAR))


@pytest.mark.parametrize(
    "preset, flags",
    [("facenet-pytorch", ()), ("sandberg", ()), ("sandberg", SANDBERG_182)],
)
def test_each_box_preset_gives_its_publishers_crop_with_the_default_command_line(
    source, tmp_path, preset, flags
):
    # facenet-pytorch's notebook call (examples/lfw_evaluate.ipynb), saving the crop itself;
    # sandberg's crop around facenet-pytorch's box (its MTCNN is the same network, ported).
    image = Image.open(ASTRONAUT).convert("RGB")
    kwargs = {"image_size": 160, "margin": 14, "selection_method": "center_weighted_size"}
    mtcnn = facenet_pytorch.MTCNN(**kwargs)
    if preset == "facenet-pytorch":
        mtcnn(image, save_path=str(tmp_path / "theirs.png"))
        theirs = np.asarray(Image.open(tmp_path / "theirs.png"))
    else:
        boxes, _ = mtcnn.detect(image)
        size, margin = (182, 44) if flags else (160, 32)  # its two conventions
        theirs = _sandberg_crop(image, boxes[0], size, margin)
    src = tmp_path / "src" / "Astronaut"
    src.mkdir(parents=True)
    (src / "Astronaut_0001.png").write_bytes(
        (source / "Astronaut" / "Astronaut_0001.png").read_bytes()
    )
    assert _align(tmp_path / "src", tmp_path / "dst", "--preset", preset, *flags) == 0
    ours = np.asarray(Image.open(tmp_path / "dst" / "Astronaut" / "Astronaut_0001.png"))
    assert np.array_equal(ours, theirs)
    assert json.loads((tmp_path / "dst" / SETTINGS_FILE).read_text())["detect_size"] == 0


def test_help_lists_each_presets_defaults(capsys):
    with pytest.raises(SystemExit):
        align_script.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in ("facenet-pytorch", "sandberg", "arcface", "sphereface"):
        settings = AlignSettings.from_preset(name)
        assert f"{name}: image_size {settings.image_size}, margin {settings.margin}," in out
        assert f"select {settings.select}," in out
    assert "template None, detect_size 0;" in out and "template arcface, detect_size 320;" in out


def test_the_face_box_lies_inside_the_image_and_the_crop_holds_a_face(aligned):
    mtcnn = facenet_pytorch.MTCNN()
    boxes, _ = mtcnn.detect(Image.open(ASTRONAUT).convert("RGB"))
    assert len(boxes) == 1
    x0, y0, x1, y1 = boxes[0]
    assert 0 <= x0 < x1 <= 512 and 0 <= y0 < y1 <= 512
    crop = Image.open(aligned["facenet-pytorch"] / "Astronaut" / "Astronaut_0001.png")
    in_crop, _ = mtcnn.detect(crop)
    assert len(in_crop) == 1
    cx0, cy0, cx1, cy1 = in_crop[0]
    # the face fills the crop but for the margin: its box lies about within it (MTCNN's box
    # on the crop is not exactly the first box scaled)
    assert -10 <= cx0 < cx1 <= 175 and -10 <= cy0 < cy1 <= 175 and cx1 - cx0 > 100


def test_no_face_and_damaged_images_are_reported_and_counted(source, tmp_path, capsys):
    assert _align(source, tmp_path / "dst") == 0
    captured = capsys.readouterr()
    assert "aligned 2, centre crops 0, no face 1, unreadable 1, already there 0" in captured.out
    assert f"skipped {source / 'Damaged' / 'Damaged_0001.jpg'}:" in captured.err
    report = (tmp_path / "dst" / "align_report.tsv").read_text().splitlines()
    assert report[0] == "status\tsource\treason"
    assert f"no_face\t{source / 'Blank' / 'Blank_0001.png'}\t" in report
    assert any(line.startswith(f"unreadable\t{source / 'Damaged'}") for line in report)
    assert not (tmp_path / "dst" / "Blank").exists()


def test_a_second_run_writes_nothing_new(aligned, source, capsys):
    dst = aligned["facenet-pytorch"]
    before = {p: p.stat().st_mtime_ns for p in dst.rglob("*.png")}
    assert _align(source, dst, "--preset", "facenet-pytorch") == 0
    assert "aligned 0, centre crops 0, no face 1, unreadable 1, already there 2" in (
        capsys.readouterr().out
    )
    assert {p: p.stat().st_mtime_ns for p in dst.rglob("*.png")} == before


def test_centre_crop_fallback_and_workers(aligned, source, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert _align(source, dst, "--preset", "sandberg", "--centre-crop", "--workers", "2") == 0
    assert "aligned 2, centre crops 1, no face 0, unreadable 1" in capsys.readouterr().out
    assert Image.open(dst / "Blank" / "Blank_0001.png").size == (160, 160)
    assert "centre_crop\t" in (dst / "align_report.tsv").read_text()
    for name in ("Astronaut/Astronaut_0001.png", "Mirror/Mirror_0001.png"):  # same as 1 worker
        assert (dst / name).read_bytes() == (aligned["sandberg"] / name).read_bytes()


def test_user_errors_are_one_line(source, tmp_path, capsys, monkeypatch):
    assert _align(tmp_path / "missing", tmp_path / "dst") == 2
    assert _align(source, source / "inside") == 2
    assert _align(source, tmp_path / "dst", "--device", "nonsense") == 2
    monkeypatch.setitem(sys.modules, "facenet_pytorch", None)  # as if it were not installed
    assert _align(source, tmp_path / "dst") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines)
    assert "source folder not found" in lines[0] and "inside" in lines[1]
    assert "pip install --no-deps facenet-pytorch==2.6.0" in lines[3]


def test_crop_box_margins_hand_computed():
    # sandberg: 32 input px, half on each side, clipped to the 100 x 80 image, truncated.
    sandberg = AlignSettings.from_preset("sandberg")
    assert crop_box((10.7, 20.2, 50.9, 70.5), 100, 80, sandberg) == (0, 4, 66, 80)
    assert crop_box((30.0, 30.0, 50.0, 50.0), 100, 80, sandberg) == (14, 14, 66, 66)
    # facenet-pytorch: 14 of 160 output px: a 146 px box gets 14 px, 7 on each side.
    ours = AlignSettings.from_preset("facenet-pytorch")
    assert crop_box((100.0, 100.0, 246.0, 392.0), 500, 500, ours) == (93, 86, 253, 406)


def test_select_face_hand_computed():
    boxes = np.array([[0.0, 0.0, 40.0, 40.0], [40.0, 40.0, 70.0, 70.0], [0.0, 0.0, 10.0, 10.0]])
    probs = np.array([0.95, 0.90, 0.99])
    assert select_face(boxes, probs, 100, 100, "largest") == 0
    assert select_face(boxes, probs, 100, 100, "probability") == 2
    # area - 2 x offset^2: 1600 - 2 x 1800 = -2000; 900 - 2 x 50 = 800; 100 - 2 x 4050 < 0
    assert select_face(boxes, probs, 100, 100, "center_weighted_size") == 1


# --------------------------------------------------------------------------- preprocessing


def _port_model(path: Path) -> torch.nn.Module:
    """facenet-pytorch's InceptionResnetV1 with random weights and BatchNorm statistics,
    saved as its published state dicts are (our loader reads that layout)."""
    torch.manual_seed(0)
    port = facenet_pytorch.InceptionResnetV1(pretrained=None, classify=False).eval()
    with torch.no_grad():
        for module in port.modules():
            if isinstance(module, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    torch.save(port.state_dict(), path)
    return port


def _ours(model_path: Path, root: Path, tmp_path: Path, preprocess: str) -> torch.Tensor:
    """The astronaut's embedding by evaluate.py's image path (load_model, embed_pair_list)."""
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("1\t1\nAstronaut\t1\t1\nAstronaut\t1\tMirror\t1\n")
    trained = load_model(model_path)
    pair_list = read_pairs(pairs, root=root)
    settings = VerifySettings(preprocess=preprocess)
    emb1, _ = embed_pair_list(trained.model, pair_list, trained.image_size, settings)
    return emb1[0]


def _theirs(port, crop: np.ndarray) -> torch.Tensor:
    """As facenet-pytorch's notebook feeds a crop: np.float32, ToTensor, fixed standardisation."""
    image = torch.from_numpy(crop.astype(np.float32)).permute(2, 0, 1)  # (3, S, S), 0..255
    with torch.no_grad():
        return port(facenet_pytorch.fixed_image_standardization(image)[None])[0]


def test_facenet_pytorch_preset_embeds_as_facenet_pytorch_does(aligned, tmp_path):
    port = _port_model(tmp_path / "port.pt")
    root = aligned["facenet-pytorch"]
    crop = np.asarray(Image.open(root / "Astronaut" / "Astronaut_0001.png"))  # (160, 160, 3)
    ours = _ours(tmp_path / "port.pt", root, tmp_path, "crop")
    theirs = _theirs(port, crop)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    # the default resizes to 180 and cuts 10 px of margin off each side: even a random-weights
    # network (measured: 3e-8 with "crop", 2e-4 with "resize") tells it apart at this tolerance
    assert (_ours(tmp_path / "port.pt", root, tmp_path, "resize") - theirs).abs().max() > 1e-5


def test_sandberg_preset_takes_the_centre_160_of_the_182_crop(aligned, tmp_path):
    port = _port_model(tmp_path / "port.pt")
    root = aligned["sandberg-182"]
    crop = np.asarray(Image.open(root / "Astronaut" / "Astronaut_0001.png"))  # (182, 182, 3)
    theirs = _theirs(port, crop[11:171, 11:171])  # resize_image_with_crop_or_pad: (182-160)/2
    ours = _ours(tmp_path / "port.pt", root, tmp_path, "crop")
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    assert (_ours(tmp_path / "port.pt", root, tmp_path, "resize") - theirs).abs().max() > 1e-5


def test_the_blank_and_damaged_images_are_left_out_of_the_crops(aligned):
    for dst in aligned.values():
        assert not (dst / "Blank").exists() and not (dst / "Damaged").exists()
        assert (dst / "align_report.tsv").is_file()
        assert not any(p.name.startswith(".") for p in dst.rglob("*"))  # no temporary left


# --------------------------------------------------------------------------- hostile folders


@pytest.mark.parametrize("size", [(5, 5), (19, 19), (100, 15), (15, 100), (10, 150)])
def test_an_image_too_small_for_mtcnn_is_reported_as_no_face(tmp_path, capsys, size):
    src = tmp_path / "src"
    (src / "Tiny").mkdir(parents=True)
    Image.new("RGB", size, (90, 90, 90)).save(src / "Tiny" / "Tiny_0001.png")
    Image.open(ASTRONAUT).convert("RGB").save(src / "Tiny" / "Tiny_0002.png")
    assert _align(src, tmp_path / "dst", "--batch-size", "1") == 0
    assert "aligned 1, centre crops 0, no face 1" in capsys.readouterr().out
    report = (tmp_path / "dst" / "align_report.tsv").read_text()
    assert "no_face\t" in report and "smaller than the smallest face" in report
    assert _align(src, tmp_path / "centred", "--centre-crop") == 0  # and the fallback crops it
    assert Image.open(tmp_path / "centred" / "Tiny" / "Tiny_0001.png").size == (160, 160)


def test_every_decoder_case_is_aligned_or_reported_by_name(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "Case").mkdir(parents=True)
    for name, case in [*GOOD.items(), *BAD.items()]:
        (src / "Case" / f"{name}{case.suffix}").write_bytes(case.data)
    assert _align(src, tmp_path / "dst") == 0
    lines = (tmp_path / "dst" / "align_report.tsv").read_text().splitlines()[1:]
    status = {Path(line.split("\t")[1]).stem: line.split("\t")[0] for line in lines}
    assert {k: v for k, v in status.items() if k in GOOD} == dict.fromkeys(GOOD, "no_face")
    assert {k: v for k, v in status.items() if k in BAD} == dict.fromkeys(BAD, "unreadable")
    for name, case in BAD.items():
        line = next(line for line in lines if f"/{name}{case.suffix}\t" in line)
        assert re.search(case.reason, line), line


@pytest.mark.parametrize(
    "flags",
    [
        ("--image-size", "150"),
        ("--margin", "20"),
        ("--select", "largest"),
        ("--centre-crop",),
        ("--preset", "sandberg"),
    ],
)
def test_a_folder_aligned_with_other_settings_is_refused_naming_the_setting(
    aligned, source, capsys, flags
):
    dst = aligned["facenet-pytorch"]
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))
    assert _align(source, dst, *flags) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "was aligned with" in err[0]
    setting = {"--image-size": "image_size", "--margin": "margin", "--select": "select"}
    # --preset sandberg: 160 px as well, margin 32 (input pixels) against 14
    name = setting.get(flags[0], "fallback" if flags[0] == "--centre-crop" else "margin")
    assert f"{name} = " in err[0]
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
    recorded = json.loads((dst / SETTINGS_FILE).read_text())
    assert recorded["image_size"] == 160 and recorded["preset"] == "facenet-pytorch"


def test_a_folder_of_crops_from_before_the_record_is_continued_if_the_sizes_agree(
    aligned, source, tmp_path, capsys
):
    dst = tmp_path / "old"
    (dst / "Astronaut").mkdir(parents=True)
    crop = aligned["facenet-pytorch"] / "Astronaut" / "Astronaut_0001.png"
    (dst / "Astronaut" / "Astronaut_0001.png").write_bytes(crop.read_bytes())
    for flags, wrong in [
        (("--image-size", "150"), "is not (150, 150)"),
        (("--preset", "arcface"), "template = None"),
        (("--detect-size", "320"), "detect_size = 0"),
    ]:
        assert _align(source, dst, *flags) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and wrong in err[0], err
        assert not (dst / SETTINGS_FILE).exists()
    assert _align(source, dst) == 0
    captured = capsys.readouterr()
    assert f"no {SETTINGS_FILE}" in captured.err and "already there 1" in captured.out
    assert json.loads((dst / SETTINGS_FILE).read_text())["image_size"] == 160
    (dst / "Astronaut" / "Astronaut_0001.png").write_bytes(b"not an image")
    (dst / SETTINGS_FILE).unlink()
    assert _align(source, dst) == 2  # a crop that cannot be read has no size to agree
    assert "Astronaut_0001.png is not (160, 160)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("names", "preset"),
    [
        (("x.jpg", "x.png"), "sandberg"),  # the preset writes PNG for both
        (("x.gif", "x.webp"), "sandberg"),
        (("x.png", "X.png"), "facenet-pytorch"),  # one name on a case-insensitive disk
    ],
)
def test_two_images_with_one_crop_name_are_refused_before_anything_is_written(
    tmp_path, capsys, names, preset
):
    src = tmp_path / "src"
    (src / "Who").mkdir(parents=True)
    for name in names:
        (src / "Who" / name).write_bytes(GOOD["gif_animated" if "gif" in name else "png"].data)
    if names[1].endswith(".webp"):
        (src / "Who" / names[1]).write_bytes(GOOD["webp_lossless"].data)
    if names[0].endswith(".jpg"):
        (src / "Who" / names[0]).write_bytes(GOOD["jpeg"].data)
    assert _align(src, tmp_path / "dst", "--preset", preset) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "would both be written to" in err[0]
    assert all(name in err[0] for name in names)
    assert not (tmp_path / "dst").exists()


def test_a_source_with_looping_links_is_aligned_once(tmp_path, capsys):
    src = tmp_path / "src"
    for name in ("A", "B"):
        (src / name).mkdir(parents=True)
        Image.new("RGB", (30, 30), (128, 128, 128)).save(src / name / f"{name}_0001.png")
        os.symlink("..", src / name / "up")
    os.symlink("../dst", src / "crops")  # a link into the output folder: not aligned again
    (tmp_path / "dst").mkdir()
    assert _align(src, tmp_path / "dst") == 0
    assert "no face 2, unreadable 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [
        ("--batch-size", "0"),
        ("--workers", "0"),
        ("--batch-size", "-3"),
        ("--workers", "two"),
        ("--image-size", "4"),
        ("--margin", "-1"),
        ("--detect-size", "100000000"),
    ],
)
def test_nonsense_counts_are_argparse_errors(source, tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as caught:
        _align(source, tmp_path / "dst", *flags)
    assert caught.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("facenet-align: error: argument") or "error: argument" in err[-1]
    assert flags[0] in err[-1]
    assert not (tmp_path / "dst").exists()


def test_a_margin_not_below_the_image_size_is_one_error_line(source, tmp_path, capsys):
    assert _align(source, tmp_path / "dst", "--preset", "sandberg", "--margin", "160") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--margin 160" in err[0]


# --------------------------------------------------------------------------- five-point templates


def _astronaut() -> np.ndarray:
    return np.asarray(Image.open(ASTRONAUT).convert("RGB"))


@pytest.fixture(scope="module")
def landmarks() -> np.ndarray:
    """MTCNN's five landmarks of the astronaut, searched at full size, counted from 0."""
    _, _, points = facenet_pytorch.MTCNN().detect(Image.fromarray(_astronaut()), landmarks=True)
    return np.asarray(points[0], dtype=np.float64) - 1  # (5, 2)


def _umeyama(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Least-squares similarity src -> dst in closed form (Umeyama 1991), written out here."""
    mu_s, mu_d = src.mean(0), dst.mean(0)
    a, b = src - mu_s, dst - mu_d
    u, sig, vt = np.linalg.svd(b.T @ a / len(src))
    d = np.diag([1.0, np.sign(np.linalg.det(u) * np.linalg.det(vt))])
    rotation = u @ d @ vt
    scale = np.trace(np.diag(sig) @ d) / a.var(0).sum()
    return np.hstack([scale * rotation, (mu_d - scale * rotation @ mu_s)[:, None]])


def _grid_sample_warp(image: np.ndarray, matrix: np.ndarray, height: int, width: int):
    """Bilinear warp with torch's grid_sample (zeros outside): each crop pixel centre's
    preimage, normalised so that -1 and 1 are the centres of the first and last pixels."""
    inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))[:2]
    ys, xs = np.mgrid[0:height, 0:width]
    xy = np.stack([xs, ys, np.ones_like(xs)], -1).reshape(-1, 3) @ inverse.T  # (HW, 2)
    h, w = image.shape[:2]
    grid = torch.from_numpy(xy / [(w - 1) / 2, (h - 1) / 2] - 1).reshape(1, height, width, 2)
    pixels = torch.from_numpy(image.astype(np.float64)).permute(2, 0, 1)[None]
    out = torch.nn.functional.grid_sample(
        pixels, grid, mode="bilinear", padding_mode="zeros", align_corners=True
    )
    return out[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("name", ["arcface", "sphereface"])
def test_align_face_equals_an_independent_fit_and_warp(landmarks, name):
    template = TEMPLATES[name]
    matrix = _umeyama(landmarks, template.pixel_points())
    assert np.allclose(similarity_matrix(landmarks, template.pixel_points()), matrix, atol=1e-9)
    ours = align_face(_astronaut(), landmarks, name)
    assert ours.shape == (template.height, template.width, 3) and ours.dtype == np.uint8
    theirs = _grid_sample_warp(_astronaut(), matrix, template.height, template.width)
    diff = np.abs(ours.astype(np.float64) - theirs)
    assert diff.mean() < 1.0, diff.mean()  # within a grey level on average (rounding: ~0.25)
    assert diff.max() <= 1.0 + 1e-6


def test_a_warp_reaching_past_the_image_border_reads_zeros(landmarks):
    # the face moved to the top-left corner: part of the crop lies outside the image
    image = _astronaut()[150:, 170:]
    moved = landmarks - [170, 150]
    matrix = _umeyama(moved, TEMPLATES["arcface"].pixel_points())
    ours = align_face(image, moved, "arcface").astype(np.float64)
    theirs = _grid_sample_warp(image, matrix, 112, 112)
    assert (theirs == 0).all(axis=2).any()  # some of the crop is outside
    assert np.abs(ours - theirs).mean() < 1.0 and np.abs(ours - theirs).max() <= 1.0 + 1e-6


def test_the_templates_are_the_publishers_numbers():
    sphereface = TEMPLATES["sphereface"].array()
    assert (TEMPLATES["sphereface"].height, TEMPLATES["sphereface"].width) == (112, 96)
    assert (TEMPLATES["arcface"].height, TEMPLATES["arcface"].width) == (112, 112)
    assert sphereface[0].tolist() == [30.2946, 51.6963]
    assert sphereface[4].tolist() == [62.7299, 92.2041]
    # SphereFace's MATLAB counts pixels from 1, insightface's OpenCV from 0
    assert (TEMPLATES["sphereface"].origin, TEMPLATES["arcface"].origin) == (1.0, 0.0)
    # insightface's template is SphereFace's moved 8 px right (arcface_torch/eval_ijbc.py)
    assert np.allclose(TEMPLATES["arcface"].array(), sphereface + [8.0, 0.0], atol=1e-12)


@pytest.mark.parametrize(("name", "size"), [("arcface", (112, 112)), ("sphereface", (96, 112))])
def test_the_template_presets_write_the_warp_of_the_detected_landmarks(
    aligned, landmarks, name, size
):
    crop = Image.open(aligned[name] / "Astronaut" / "Astronaut_0001.png")
    assert crop.size == size
    # MTCNN finds the landmarks in the crop where the fitted transform put them (on a canvas
    # around the crop: a face cut at the crop's edges is found less precisely). The fit leaves
    # the astronaut's smile about 7 px wider than the template's mouth.
    canvas = Image.new("RGB", (size[0] + 112, size[1] + 112))
    canvas.paste(crop, (56, 56))
    _, _, points = facenet_pytorch.MTCNN().detect(canvas, landmarks=True)
    found = np.asarray(points[0], dtype=float) - 1 - 56
    matrix = similarity_matrix(landmarks, TEMPLATES[name].pixel_points())
    placed = landmarks @ matrix[:, :2].T + matrix[:, 2]
    error = np.linalg.norm(found - placed, axis=1)
    assert error.max() < 3.0, error
    recorded = json.loads((aligned[name] / SETTINGS_FILE).read_text())
    assert recorded["template"] == name and recorded["detect_size"] == 320


def test_a_template_preset_refuses_a_size_or_margin(source, tmp_path, capsys):
    assert _align(source, tmp_path / "dst", "--preset", "arcface", "--image-size", "128") == 2
    assert _align(source, tmp_path / "dst", "--preset", "sphereface", "--margin", "10") == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--image-size 128" in err[0] and "--margin 10" in err[1]
    assert not (tmp_path / "dst").exists()


def test_the_centre_crop_of_a_template_preset_has_its_shape(source, tmp_path, capsys):
    src = tmp_path / "src" / "Blank"
    src.mkdir(parents=True)
    (src / "Blank_0001.png").write_bytes((source / "Blank" / "Blank_0001.png").read_bytes())
    assert (
        _align(tmp_path / "src", tmp_path / "dst", "--preset", "sphereface", "--centre-crop") == 0
    )
    assert "centre crops 1" in capsys.readouterr().out
    assert Image.open(tmp_path / "dst" / "Blank" / "Blank_0001.png").size == (96, 112)


# --------------------------------------------------------------------------- reduced copies


def test_detection_scale_and_mapping_hand_computed():
    assert detection_scale(500, 400, 320) == 0.64
    assert detection_scale(250, 250, 320) == 1.0 and detection_scale(5000, 4000, 0) == 1.0
    assert detection_scale(2000, 40, 320) == 0.5  # the shorter side stays at 20 px
    # a copy pixel's centre goes to the centre of the block it came from: 0 -> 0.5 at x2
    assert to_full_image([[0.0, 0.0], [1.0, 2.0]], (2.0, 4.0)).tolist() == [[0.5, 1.5], [2.5, 9.5]]


class _Recording:
    """Wraps MTCNN's detect, recording the size of every image it is given."""

    def __init__(self, mtcnn):
        self.mtcnn, self.sizes = mtcnn, []

    def __getattr__(self, name):
        return getattr(self.mtcnn, name)

    def detect(self, images, landmarks=False):
        self.sizes += [image.size for image in images]
        return self.mtcnn.detect(images, landmarks=landmarks)


def _detect(image: Image.Image, detect_size: int, preset: str = "arcface"):
    aligner = Aligner(AlignSettings.from_preset(preset, detect_size=detect_size))
    aligner.mtcnn = _Recording(aligner.mtcnn)
    (face,) = aligner.detect([image])
    return aligner, face


def test_a_large_photo_is_searched_on_its_reduced_copy_and_cropped_at_full_size():
    big = Image.open(ASTRONAUT).convert("RGB").resize((4000, 4000), Image.BICUBIC)
    aligner, face = _detect(big, 320)
    assert aligner.mtcnn.sizes == [(320, 320)]  # MTCNN never saw the 16 MP image
    moderate, at_full = _detect(big.resize((1024, 1024), Image.BILINEAR), 0)
    assert moderate.mtcnn.sizes == [(1024, 1024)]
    # the same face, mapped back to the full image (compared at 1024 px)
    landmarks = face.landmarks * 1024 / 4000
    eyes = np.linalg.norm(at_full.landmarks[1] - at_full.landmarks[0])  # about 140 px here
    assert np.linalg.norm(landmarks - at_full.landmarks, axis=1).max() < 0.05 * eyes
    # O-net's box regression moves more with the scale than its landmarks do
    side = at_full.box[3] - at_full.box[1]
    assert np.abs(np.asarray(face.box) * 1024 / 4000 - at_full.box).max() < 0.1 * side
    # the warp reads the full image: it equals align_face on the 4000 px array
    crop = np.asarray(aligner.crop(big, face))
    assert np.array_equal(crop, align_face(np.asarray(big), face.landmarks, "arcface"))


def test_a_moderate_photo_reduced_and_at_full_size_gives_the_same_face(landmarks):
    image = Image.fromarray(_astronaut())
    aligner, face = _detect(image, 320, "facenet-pytorch")
    assert aligner.mtcnn.sizes == [(320, 320)]
    eyes = np.linalg.norm(landmarks[1] - landmarks[0])
    assert np.linalg.norm(face.landmarks - landmarks, axis=1).max() < 0.05 * eyes
    crop = aligner.crop(image, face)  # a box crop from the full image, at the preset's size
    assert crop.size == (160, 160)


def test_large_photos_are_detected_a_few_at_a_time(tmp_path, monkeypatch):
    for i in range(3):
        Image.open(ASTRONAUT).convert("RGB").save(tmp_path / f"a{i}.png")
    monkeypatch.setattr(align_module, "_HELD_PIXELS", 200_000)  # under one 512 x 512 image
    aligner = Aligner(AlignSettings.from_preset("facenet-pytorch"))
    aligner.mtcnn = _Recording(aligner.mtcnn)
    calls = []
    detect = aligner.detect
    monkeypatch.setattr(
        aligner, "detect", lambda images: calls.append(len(images)) or detect(images)
    )
    jobs = [(str(tmp_path / f"a{i}.png"), str(tmp_path / "out" / f"a{i}.png")) for i in range(3)]
    assert [o.status for o in aligner.align(jobs)] == ["aligned"] * 3
    assert calls == [1, 1, 1]


def test_detect_size_is_recorded_and_a_folder_searched_otherwise_is_refused(
    source, tmp_path, capsys
):
    dst = tmp_path / "dst"
    assert _align(source, dst, "--detect-size", "320") == 0
    assert json.loads((dst / SETTINGS_FILE).read_text())["detect_size"] == 320
    capsys.readouterr()
    assert _align(source, dst) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "detect_size = 320" in err[0] and "asks for 0" in err[0]


def test_a_record_from_before_detect_size_counts_as_full_size(aligned, source, tmp_path, capsys):
    dst = tmp_path / "old"
    (dst / "Astronaut").mkdir(parents=True)
    crop = aligned["facenet-pytorch"] / "Astronaut" / "Astronaut_0001.png"
    (dst / "Astronaut" / "Astronaut_0001.png").write_bytes(crop.read_bytes())
    recorded = json.loads((aligned["facenet-pytorch"] / SETTINGS_FILE).read_text())
    del recorded["detect_size"], recorded["template"]
    (dst / SETTINGS_FILE).write_text(json.dumps(recorded))
    assert _align(source, dst, "--detect-size", "320") == 2
    assert "detect_size = 0" in capsys.readouterr().err
    assert _align(source, dst) == 0
    assert "already there 1" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["-1", "5", "19", "big"])
def test_a_nonsense_detect_size_is_an_argparse_error(source, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as caught:
        _align(source, tmp_path / "dst", "--detect-size", value)
    assert caught.value.code == 2
    assert "--detect-size" in capsys.readouterr().err.splitlines()[-1]


# --------------------------------------------------------------------------- hostile arguments


def _report_cases(source: Path, tmp_path: Path) -> dict:
    """--report paths that must be refused: what this command did not write, or inside a tree."""
    dst = tmp_path / "dst"
    outside = tmp_path / "notes.txt"
    outside.write_text("a user's notes\n")
    link = tmp_path / "link.tsv"
    link.symlink_to(source / "Astronaut" / "Astronaut_0001.png")
    fifo = tmp_path / "fifo.tsv"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    return {
        "source photo": (source / "Astronaut" / "Astronaut_0001.png", "inside"),
        "new file in SRC": (source / "report.tsv", "inside"),
        "crop": (dst / "Astronaut" / "Astronaut_0001.png", "inside"),
        "settings": (dst / SETTINGS_FILE, "inside"),
        "link to a photo": (link, "inside"),
        "user file": (outside, "not an alignment report"),
        "FIFO": (fifo, "not an alignment report"),
        "folder": (tmp_path / "folder", "not an alignment report"),
        "dangling link": (tmp_path / "gone.tsv", "not an alignment report"),
    }


def test_a_report_path_the_command_did_not_write_is_refused(aligned, source, tmp_path, capsys):
    dst = tmp_path / "dst"
    assert _align(source, dst, "--preset", "sandberg") == 0
    (tmp_path / "gone.tsv").symlink_to(tmp_path / "nowhere")
    before = {p: p.read_bytes() for p in [*source.rglob("*.*"), *dst.rglob("*.*")]}
    capsys.readouterr()
    for name, (path, why) in _report_cases(source, tmp_path).items():
        assert _align(source, dst, "--preset", "sandberg", "--report", str(path)) == 2, name
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and why in err[0] and str(path) in err[0], (name, err)
    assert {p: p.read_bytes() for p in [*source.rglob("*.*"), *dst.rglob("*.*")]} == before
    assert (tmp_path / "notes.txt").read_text() == "a user's notes\n"
    # its own reports are replaced: the default, and one written outside the trees
    report = tmp_path / "out" / "report.tsv"
    for _ in range(2):
        assert _align(source, dst, "--preset", "sandberg", "--report", str(report)) == 0
        assert _align(source, dst, "--preset", "sandberg") == 0
    assert report.read_bytes() == (dst / "align_report.tsv").read_bytes()


@pytest.mark.parametrize("size", ["4097", "40000", "100000", "9" * 5000])
def test_an_image_size_past_the_bound_is_an_argparse_error(source, tmp_path, capsys, size):
    with pytest.raises(SystemExit) as caught:
        _align(source, tmp_path / "dst", "--image-size", size)
    assert caught.value.code == 2
    assert "--image-size" in capsys.readouterr().err.splitlines()[-1]
    assert not (tmp_path / "dst").exists()


def test_more_workers_than_cores_is_one_error_line(source, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for workers in ("3", "8", "1000000"):
        assert _align(source, tmp_path / "dst", "--workers", workers) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and f"workers {workers}" in err[0] and "at most 2" in err[0]
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("kind", ["fifo", "folder", "deep", "list", "huge"])
def test_a_hostile_settings_record_is_one_error_line(source, tmp_path, capsys, monkeypatch, kind):
    dst = tmp_path / "dst"
    dst.mkdir()
    path = dst / SETTINGS_FILE
    if kind == "fifo":  # would block a plain open() forever
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "list":
        path.write_text("[1, 2]")
    else:
        monkeypatch.setattr(files.read_json, "__defaults__", (100,))  # the bound, made small
        path.write_text(json.dumps({"pad": "x" * 200}))
    assert _align(source, dst) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and SETTINGS_FILE in err[0], err
    assert sorted(p.name for p in dst.iterdir()) == [SETTINGS_FILE]


@pytest.mark.parametrize(
    ("preset", "rule"),
    [
        ("facenet-pytorch", "center_weighted_size"),  # facenet-pytorch's selection_method
        ("sandberg", "center_weighted_size"),  # align_dataset_mtcnn.py, detect_multiple_faces off
        ("arcface", "probability"),  # insightface: FaceAnalysis.get's faces sorted by det_score
        # Not face_detect_demo.m's largest face: the published LFW crops are of the labelled,
        # centred person (the largest face is someone else's in 7 of LFW's pair images).
        ("sphereface", "center_weighted_size"),
    ],
)
def test_each_preset_chooses_among_faces_by_its_publishers_rule(preset, rule):
    assert AlignSettings.from_preset(preset).select == rule


@pytest.mark.parametrize("preset", ["facenet-pytorch", "sandberg", "sphereface"])
def test_a_larger_face_at_the_edge_does_not_displace_the_centred_person(preset):
    # A 150 px LFW-style crop: the labelled person centred (60 px box), a bystander's larger
    # face (80 px) cut by the right edge. The centre-weighted rule keeps the centred face.
    boxes = np.array([[45.0, 45.0, 105.0, 105.0], [110.0, 20.0, 190.0, 100.0]])
    probs = np.array([0.99, 0.99])
    assert select_face(boxes, probs, 150, 150, "largest") == 1  # the rule the preset left
    assert select_face(boxes, probs, 150, 150, AlignSettings.from_preset(preset).select) == 0


@pytest.mark.parametrize("key", ["select", "margin_in"])
def test_settings_refuse_an_unknown_rule_naming_it(key):
    with pytest.raises(ValueError, match=rf"{key}='sideways': expected one of"):
        AlignSettings.from_preset("facenet-pytorch", **{key: "sideways"})
