"""Face alignment (facenet.inference.align, facenet-align) on a real photograph that scikit-image
ships, and the evaluation preprocessing of the publishers' presets against facenet-pytorch's
own InceptionResnetV1 fed as its README and notebook feed it."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

facenet_pytorch = pytest.importorskip("facenet_pytorch")
skimage_data = pytest.importorskip("skimage.data")

from facenet.cli import align as align_script  # noqa: E402
from facenet.data.pairs import read_pairs  # noqa: E402
from facenet.evaluation.embedding import embed_pair_list  # noqa: E402
from facenet.inference.align import AlignSettings, crop_box, select_face  # noqa: E402
from facenet.inference.loading import load_model  # noqa: E402

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


def _align(src, dst, *flags) -> tuple[int, str]:
    return align_script.main([str(src), str(dst), "--no-progress", *flags])


@pytest.fixture(scope="module")
def aligned(source, tmp_path_factory) -> dict:
    """One alignment run per preset (MTCNN runs once per image and preset)."""
    out = {}
    for preset in ("facenet-pytorch", "sandberg"):
        dst = tmp_path_factory.mktemp(preset)
        assert _align(source, dst, "--preset", preset) == 0
        out[preset] = dst
    return out


# --------------------------------------------------------------------------- alignment


def test_one_face_found_and_written_under_the_same_relative_path(aligned):
    dst = aligned["facenet-pytorch"]
    crop = Image.open(dst / "Astronaut" / "Astronaut_0001.png")
    assert crop.size == (160, 160)
    assert Image.open(aligned["sandberg"] / "Astronaut" / "Astronaut_0001.png").size == (182, 182)
    written = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*.png"))
    assert written == ["Astronaut/Astronaut_0001.png", "Mirror/Mirror_0001.png"]


def test_the_crop_equals_facenet_pytorchs_own_mtcnn_output(aligned, tmp_path):
    # The notebook's call (examples/lfw_evaluate.ipynb), saving the crop itself.
    mtcnn = facenet_pytorch.MTCNN(
        image_size=160, margin=14, selection_method="center_weighted_size"
    )
    mtcnn(Image.open(ASTRONAUT).convert("RGB"), save_path=str(tmp_path / "theirs.png"))
    ours = np.asarray(Image.open(aligned["facenet-pytorch"] / "Astronaut" / "Astronaut_0001.png"))
    assert np.array_equal(ours, np.asarray(Image.open(tmp_path / "theirs.png")))


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
    assert -10 <= cx0 < cx1 <= 170 and -10 <= cy0 < cy1 <= 170 and cx1 - cx0 > 100


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
    assert Image.open(dst / "Blank" / "Blank_0001.png").size == (182, 182)
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
    # sandberg: 44 input px, half on each side, clipped to the 100 x 80 image, truncated.
    sandberg = AlignSettings.from_preset("sandberg")
    assert crop_box((10.7, 20.2, 50.9, 70.5), 100, 80, sandberg) == (0, 0, 72, 80)
    assert crop_box((30.0, 30.0, 50.0, 50.0), 100, 80, sandberg) == (8, 8, 72, 72)
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
    emb1, _ = embed_pair_list(
        trained.model, read_pairs(pairs, root=root), trained.image_size, preprocess=preprocess
    )
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
    root = aligned["sandberg"]
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
