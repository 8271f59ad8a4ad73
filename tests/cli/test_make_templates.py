"""facenet-make-templates: the IJB layout, grouping and pairs (detector patched), MTCNN's
landmarks on moved faces, and the refusals."""

from __future__ import annotations

import os
import re
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from facenet.cli import make_templates as mt
from facenet.wings.align.aligner import AlignOutcome, Face

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

NUMBER = r"-?\d+\.\d{3}"
FIVE_POINTS = re.compile(rf"(\S+)((?: {NUMBER}){{10}}) ({NUMBER})")


def touch(root: Path, *names: str) -> None:
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(name.encode())


def fake_detect(src, names, args):
    """A face for every image whose name lacks "noface", landmarks from its name's length."""
    found = {}
    for name in names:
        if "noface" in name:
            found[name] = AlignOutcome(str(src / name), "", "no_face", "")
        else:
            points = np.arange(10, dtype=float).reshape(5, 2) + len(name) + 0.12345
            found[name] = Face((0, 0, 1, 1), 0.99951, points)
    return found


@pytest.fixture
def patched(monkeypatch):
    monkeypatch.setattr(mt, "detect", fake_detect)


def read_set(dst: Path, name: str = "templates") -> list[list[list[str]]]:
    return [
        [line.split(" ") for line in (dst / path).read_text().splitlines()]
        for path in mt.meta_files(name).values()
    ]


def make_folder(root: Path) -> None:
    # a: media folders v1..v3 and a loose image (its own media); b: three images; c: one image
    touch(root, "a/v1/1.jpg", "a/v1/2.jpg", "a/v2/1.jpg", "a/v3/x/1.png", "a/4.jpg")
    touch(root, "b/1.jpg", "b/2.jpg", "b/3.jpg", "b/noface.jpg", "c/1.jpg", "top.jpg")


def test_layout_groups_and_pairs(patched, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_folder(src)
    assert mt.main([str(src), str(dst), "--impostor-pairs", "100", "--name", "own"]) == 0
    tid_mid, points, pairs = read_set(dst, "own")
    names = [row[0] for row in tid_mid]
    assert names == [row[0] for row in points]  # side by side, as insightface reads them
    assert sorted(names) == sorted(
        ["a/v1/1.jpg", "a/v1/2.jpg", "a/v2/1.jpg", "a/v3/x/1.png", "a/4.jpg", "b/1.jpg"]
        + ["b/2.jpg", "b/3.jpg"]
    )
    for row in (" ".join(r) for r in points):
        assert FIVE_POINTS.fullmatch(row), row
    assert points[0][-1] == "1.000" and points[0][1] == f"{len(names[0]) + 0.12345:.3f}"
    template = {n: int(t) for n, t, _ in tid_mid}
    media = {n: int(m) for n, _, m in tid_mid}
    assert sorted(set(template.values())) == [1, 2, 3, 4]  # a and b, two each; c too few
    # a media never split: v1's two images share media and template
    assert (
        media["a/v1/1.jpg"] == media["a/v1/2.jpg"]
        and template["a/v1/1.jpg"] == template["a/v1/2.jpg"]
    )
    assert len(set(media.values())) == 4 + 3  # a: v1, v2, v3, 4.jpg; b: three images
    identity = {t: n.split("/")[0] for n, t in template.items()}
    rows = [tuple(map(int, row)) for row in pairs]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)
    genuine = {(a, b) for a, b, label in rows if label == 1}
    assert genuine == {(1, 2), (3, 4)}
    impostors = {(a, b) for a, b, label in rows if label == 0}
    assert impostors == {
        (a, b) for a, b in combinations(range(1, 5), 2) if identity[a] != identity[b]
    }
    # loose_crop: hard links to the photos
    for name in names:
        assert os.path.samefile(dst / "loose_crop" / name, src / name)
    report = (dst / mt.REPORT).read_text().splitlines()
    assert report[0] == "status\tsource\treason"
    assert sorted(line.split("\t")[0] for line in report[1:]) == [
        "left_out",
        "no_face",
        "too_few_media",
    ]
    out = capsys.readouterr().out
    assert "2 identities, 4 templates, 8 images; 2 genuine and 4 impostor pairs" in out


def test_seeded_and_more_templates(patched, tmp_path):
    src = tmp_path / "src"
    for i in range(6):
        touch(src, *(f"id{i}/m{j}/{k}.jpg" for j in range(5) for k in range(2)))
    argv = ["--templates-per-identity", "3", "--impostor-pairs", "20"]
    runs = {}
    for run, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        assert mt.main([str(src), str(tmp_path / run), *argv, "--seed", seed]) == 0
        runs[run] = [(tmp_path / run / p).read_bytes() for p in mt.meta_files("templates").values()]
    assert runs["a"] == runs["b"] and runs["a"] != runs["c"]
    tid_mid, _, pairs = read_set(tmp_path / "a")
    by_template = {}
    for name, t, _ in tid_mid:
        by_template.setdefault(int(t), set()).add(name.split("/")[1])
        assert {name.split("/")[0]} == {n.split("/")[0] for n, t2, _ in tid_mid if t2 == t}
    assert len(by_template) == 18 and all(len(v) in (1, 2) for v in by_template.values())
    labels = [int(label) for _, _, label in pairs]
    assert labels.count(1) == 6 * 3 and labels.count(0) == 20


@pytest.mark.parametrize("count", [1, 30, 200, 10_000])
def test_impostor_pairs_are_distinct_pairs_of_two_identities(count):
    identity_of = np.repeat(np.arange(7), [1, 2, 3, 2, 2, 5, 3])
    n = len(identity_of)
    every = {(a, b) for a, b in combinations(range(n), 2) if identity_of[a] != identity_of[b]}
    got = mt.impostor_pairs(identity_of, count, np.random.default_rng(0))
    pairs = [tuple(p) for p in got.tolist()]
    assert pairs == sorted(set(pairs)) and set(pairs) <= every
    assert len(pairs) == min(count, len(every))
    again = mt.impostor_pairs(identity_of, count, np.random.default_rng(0))
    np.testing.assert_array_equal(got, again)


def test_pairs_are_drawn_evenly():
    # rejection branch (count well under the 190 - 10 available): each pair about equally often
    identity_of = np.repeat(np.arange(10), 2)
    rng = np.random.default_rng(1)
    counts = {}
    for _ in range(400):
        for pair in mt.impostor_pairs(identity_of, 20, rng).tolist():
            counts[tuple(pair)] = counts.get(tuple(pair), 0) + 1
    values = np.array(list(counts.values()))
    assert len(counts) == 180 and abs(values.mean() - 400 * 20 / 180) < 1e-9
    assert values.std() < 4 * np.sqrt(400 * 20 / 180)


def test_refusals_are_one_line_and_write_nothing(patched, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_folder(src)
    (dst / "meta").mkdir(parents=True)
    (dst / "mine.txt").write_text("keep")
    (tmp_path / "empty").mkdir()
    lone = tmp_path / "lone"
    touch(lone, "a/1.jpg", "b/1.jpg")
    cases = [
        ([str(src), str(dst)], "is not empty: --overwrite"),
        ([str(src), str(src / "a" / "out")], "overlap"),
        ([str(src), str(tmp_path / "n"), "--name", "Own"], "--name 'Own'"),
        ([str(src), str(tmp_path / "n"), "--name", "n" * 300], "expected 1 to 64 lower-case"),
        ([str(tmp_path / "none"), str(tmp_path / "n")], "source folder not found"),
        ([str(lone), str(tmp_path / "n")], "0 of 2 identities have 2 media"),
        # one identity alone: a set without impostor pairs
        ([str(src), str(tmp_path / "n"), "--templates-per-identity", "4"], "1 of 3 identities"),
        ([str(tmp_path / "empty"), str(tmp_path / "n")], "the most any has is 0"),
        ([str(src), str(tmp_path / "n"), "--templates-per-identity", "5"], "the most any has is 4"),
    ]
    for argv, message in cases:
        assert mt.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "n").exists() and not (src / "a" / "out").exists()
    # --overwrite replaces regular files it would write, leaves the rest, refuses a folder there
    assert mt.main([str(src), str(dst), "--overwrite"]) == 0
    assert (dst / "mine.txt").read_text() == "keep"
    (dst / "loose_crop" / "b" / "1.jpg").unlink()
    (dst / "loose_crop" / "b" / "1.jpg").mkdir()
    assert mt.main([str(src), str(dst), "--overwrite"]) == 2
    assert "is not a regular file" in capsys.readouterr().err


def test_links_out_of_src_and_spaced_names_are_left_out(patched, tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside.jpg"
    touch(src, "a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg", "b/3 x.jpg")
    outside.write_bytes(b"x")
    os.symlink(outside, src / "a" / "3.jpg")
    assert mt.main([str(src), str(tmp_path / "dst")]) == 0
    names = [row[0] for row in read_set(tmp_path / "dst")[0]]
    assert sorted(names) == ["a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg"]
    report = (tmp_path / "dst" / mt.REPORT).read_text()
    assert "a link out of" in report and "white space" in report


def test_an_undecodable_name_is_left_out_not_a_traceback(patched, tmp_path):
    src = tmp_path / "src"
    touch(src, "a/1.jpg", "a/2.jpg", "b/1.jpg", "b/2.jpg")
    os.mkdir(os.fsencode(src / "c"))
    with open(os.fsencode(src / "c") + b"/\xff.jpg", "wb") as fh:
        fh.write(b"x")
    assert mt.main([str(src), str(tmp_path / "dst"), "--no-progress"]) == 0
    assert len(read_set(tmp_path / "dst")[0]) == 4
    assert (
        "c/\\xff.jpg\tthe name is not printable UTF-8" in (tmp_path / "dst" / mt.REPORT).read_text()
    )


def astronaut_canvas(offset, scale=1.0) -> Image.Image:
    """scikit-image's astronaut's head on a grey 400 x 400 canvas at (x, y) ``offset``."""
    skimage_data = pytest.importorskip("skimage.data")
    head = Image.fromarray(skimage_data.astronaut()[0:260, 90:350])  # 260 x 260
    head = head.resize((round(260 * scale),) * 2, Image.BILINEAR)
    canvas = Image.new("RGB", (400, 400), (128, 128, 128))
    canvas.paste(head, offset)
    return canvas


def test_mtcnn_landmarks_follow_the_face(tmp_path):
    pytest.importorskip("facenet_pytorch")
    src = tmp_path / "src"
    for name, offset, scale in (
        ("a/0.png", (0, 0), 1.0),
        ("a/1.png", (100, 60), 1.0),
        ("b/0.png", (40, 40), 0.5),
        ("b/1.png", (240, 200), 0.5),
    ):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        astronaut_canvas(offset, scale).save(src / name)
    Image.new("RGB", (400, 400), (128, 128, 128)).save(src / "b" / "blank.png")
    (src / "b" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    assert mt.main([str(src), str(tmp_path / "dst"), "--no-progress", "--batch-size", "2"]) == 0
    _, points, _ = read_set(tmp_path / "dst")
    found = {row[0]: np.array(row[1:11], dtype=float).reshape(5, 2) for row in points}
    assert sorted(found) == ["a/0.png", "a/1.png", "b/0.png", "b/1.png"]
    # moved by the paste's offset, scaled by its scale: each point within MTCNN's own spread
    # (its pyramid samples a moved face differently: up to 2 px measured), their mean closer
    for moved, still, shift in (
        ("a/1.png", "a/0.png", [100, 60]),
        ("b/1.png", "b/0.png", [200, 160]),
    ):
        np.testing.assert_allclose(found[moved] - found[still], [shift] * 5, atol=2.5)
        np.testing.assert_allclose((found[moved] - found[still]).mean(axis=0), shift, atol=1)
    np.testing.assert_allclose(found["b/0.png"] - 40, found["a/0.png"] * 0.5, atol=3)
    left_eye, right_eye = found["a/0.png"][:2]  # MTCNN's order: the image's left eye first
    assert left_eye[0] < right_eye[0]
    report = (tmp_path / "dst" / mt.REPORT).read_text()
    assert re.search(r"no_face\t\S+blank.png", report) and re.search(
        r"unreadable\t\S+broken.jpg", report
    )
