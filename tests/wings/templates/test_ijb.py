"""The IJB layout reader: a good set read right, each kind of bad input refused with one line
naming the file, the line and the value."""

import os

import numpy as np
import pytest
from PIL import Image

from facenet.errors import DataError
from facenet.wings.templates import ijb
from facenet.wings.templates.ijb import read_face, read_template_set, set_name

FACES = "a/1.jpg 1 10\na/2.png 1 11\n\nb/3.png 2 20\n"  # a blank line: skipped, still counted
MARKS = (
    "b/3.png 1 2 3 4 5 6 7 8 9 10 0.5\n"
    "a/1.jpg 0 1 2 3 4 5 6 7 8 9 0.9\n"
    "a/2.png 10 11 12 13 14 15 16 17 18 19 1e-1\n"
)
PAIRS = "1 2 0\n2 1 1\n"


def write_layout(root, faces=FACES, marks=MARKS, pairs=PAIRS, name="ijbx"):
    """A set in insightface's layout whose images are small photos of one colour."""
    meta = root / "meta"
    meta.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("face_tid_mid", faces), ("name_5pts_score", marks),
                         ("template_pair_label", pairs)):  # fmt: skip
        if text is not None:
            (meta / f"{name}_{suffix}.txt").write_text(text)
    for line in faces.splitlines():
        if line.split() and ".." not in line and not line.startswith("/"):
            path = root / "loose_crop" / line.split()[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (24, 20), (200, 100, 50)).save(path)
    return root


def test_a_set_is_read_in_the_face_lists_order(tmp_path):
    faces = read_template_set(write_layout(tmp_path))
    assert faces.name == "ijbx" and faces.images.tolist() == ["a/1.jpg", "a/2.png", "b/3.png"]
    assert faces.templates.tolist() == [1, 1, 2] and faces.media.tolist() == [10, 11, 20]
    assert faces.landmarks[0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert faces.landmarks[2, 4].tolist() == [9, 10] and faces.scores.tolist() == [0.9, 0.1, 0.5]
    assert faces.pairs.tolist() == [[1, 2], [2, 1]] and faces.labels.tolist() == [0, 1]
    assert read_face(faces, 1).shape == (3, 20, 24)


def test_windows_text_reads_the_same(tmp_path):
    want = read_template_set(write_layout(tmp_path))
    for path in (tmp_path / "meta").iterdir():  # a BOM and CRLF line ends, as Notepad saves
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n"))
    faces = read_template_set(tmp_path)
    assert faces.images.tolist() == want.images.tolist()
    assert np.array_equal(faces.landmarks, want.landmarks)
    assert np.array_equal(faces.pairs, want.pairs) and np.array_equal(faces.labels, want.labels)
    with open(tmp_path / "meta" / "ijbx_template_pair_label.txt", "ab") as fh:
        fh.write(b"2 7 0\r\n")
    with pytest.raises(DataError, match="label.txt:3: template 7 has no image"):
        read_template_set(tmp_path)


def test_a_meta_file_of_too_many_lines_is_refused_before_splitting(tmp_path, monkeypatch):
    monkeypatch.setattr(ijb, "MAX_META_ROWS", 4)  # blank lines count: each would be a string
    with pytest.raises(DataError, match="face_tid_mid.txt: more than 4 lines"):
        read_template_set(write_layout(tmp_path, faces=FACES + "\n\n"))


@pytest.mark.parametrize(
    "which, file, line",
    [("faces", "face_tid_mid", 5), ("marks", "name_5pts_score", 4), ("pairs", "pair_label", 3)],
)
def test_a_line_past_the_bound_is_refused_before_splitting(tmp_path, which, file, line):
    # one 240 MB line of fields took gigabytes as Python strings: a MemoryError traceback
    long_line = "c/4.jpg" + " 1" * (ijb.MAX_LINE_BYTES // 2)
    text = {"faces": FACES, "marks": MARKS, "pairs": PAIRS}[which] + long_line + "\n"
    message = _error(tmp_path, **{which: text})
    assert f"{file}.txt:{line}: a line of {len(long_line)} bytes, more than 4096" in message


def test_the_set_name_is_found_or_chosen(tmp_path):
    write_layout(tmp_path, name="one")
    assert set_name(tmp_path) == "one"
    write_layout(tmp_path, name="two")
    with pytest.raises(DataError, match="sets one, two: choose one"):
        set_name(tmp_path)
    assert read_template_set(tmp_path, "two").name == "two"
    with pytest.raises(DataError, match="no <name>_face_tid_mid.txt"):
        set_name(tmp_path / "elsewhere")
    with pytest.raises(DataError, match="set name '../one': expected the <name> of"):
        set_name(tmp_path, "../one")


def _error(tmp_path, **texts) -> str:
    with pytest.raises(DataError) as caught:
        read_template_set(write_layout(tmp_path, **texts))
    message = str(caught.value)
    assert "\n" not in message
    return message


BAD = {
    "missing meta file": ({"pairs": None}, "ijbx_template_pair_label.txt: missing meta file"),
    "columns": (
        {"faces": "a/1.jpg 1 10\na/2.png 1\n"},
        "face_tid_mid.txt:2: 2 columns, expected 3",
    ),
    "template id": ({"faces": "a/1.jpg 1.5 10\n"}, "face_tid_mid.txt:1: '1.5' is not an integer"),
    "int64 overflow": (
        {"faces": "a/1.jpg 99999999999999999999 10\n"},
        "face_tid_mid.txt:1: '99999999999999999999' is past int64's range",
    ),
    "underscore id": ({"faces": "a/1.jpg 1_0 10\n"}, "face_tid_mid.txt:1: '1_0' is not an integer"),
    "underscore pair": ({"pairs": PAIRS + "1_0 2 0\n"}, "label.txt:3: '1_0' is not an integer"),
    "landmark": (
        {"marks": MARKS.replace(" 8 9 0.9", " 8 x 0.9")},
        "name_5pts_score.txt:2: 'x' is not a finite number",
    ),
    "nan landmark": (
        {"marks": MARKS.replace(" 1 2 3", " nan 2 3")},
        "name_5pts_score.txt:1: 'nan' is not a finite number",
    ),
    "inf score": (
        {"marks": MARKS.replace("1e-1", "inf")},
        "name_5pts_score.txt:3: 'inf' is not a finite number",
    ),
    "one point": (
        {"marks": MARKS.replace("0 1 2 3 4 5 6 7 8 9", "0 0 0 0 0 0 0 0 0 0")},
        "name_5pts_score.txt:2: the five landmarks are one point (0 0)",
    ),
    "negative score": (
        {"marks": MARKS.replace("0.9", "-0.9")},
        "name_5pts_score.txt:2: detector score -0.9 < 0",
    ),
    "duplicate": (
        {"faces": FACES + "a/1.jpg 3 30\n"},
        "face_tid_mid.txt:5: image 'a/1.jpg' again (line 1)",
    ),
    "duplicate spelt otherwise": (
        {"faces": FACES + "./a//1.jpg 3 30\n"},
        "face_tid_mid.txt:5: image './a//1.jpg' again (line 1)",
    ),
    "duplicate mark": (
        {"marks": MARKS + MARKS.splitlines()[0] + "\n"},
        "name_5pts_score.txt:4: image 'b/3.png' again (line 1)",
    ),
    "no landmarks": (
        {"faces": FACES + "c/4.png 3 30\n"},
        "face_tid_mid.txt:5: image 'c/4.png' is not in ",
    ),
    "no face": (
        {"marks": MARKS + "c/4.png 1 2 3 4 5 6 7 8 9 10 1\n"},
        "name_5pts_score.txt:4: image 'c/4.png' is not in ",
    ),
    "absolute": ({"faces": "/etc/passwd 1 1\n"}, "image '/etc/passwd' is not a path inside"),
    "dots": ({"faces": "a/../../x.png 1 1\n"}, ":1: image 'a/../../x.png' is not a path inside"),
    "unknown template": ({"pairs": PAIRS + "2 7 0\n"}, "label.txt:3: template 7 has no image"),
    "self pair": ({"pairs": PAIRS + "2 2 1\n"}, "label.txt:3: template 2 paired with itself"),
    "label": ({"pairs": PAIRS + "2 1 2\n"}, "label.txt:3: label 2, expected 0 or 1"),
    "pair columns": ({"pairs": "1 2 0 5\n"}, "label.txt:1: 4 columns, expected 3"),
    "no genuine": ({"pairs": "1 2 0\n"}, "label.txt: no genuine pair (label 1)"),
    "no impostor": ({"pairs": "1 2 1\n2 1 1\n"}, "label.txt: no impostor pair (label 0)"),
    "empty pairs": ({"pairs": "\n"}, "label.txt: no genuine pair"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_naming_file_line_and_value(tmp_path, case):
    texts, expected = BAD[case]
    assert expected in _error(tmp_path, **texts)


def test_missing_images_and_links_leaving_the_root_are_refused(tmp_path):
    root = write_layout(tmp_path / "set")
    os.remove(root / "loose_crop" / "a" / "2.png")
    with pytest.raises(DataError, match=r"face_tid_mid.txt:2: image .*a/2.png not found"):
        read_template_set(root)
    (tmp_path / "outside.png").write_bytes((root / "loose_crop" / "b" / "3.png").read_bytes())
    os.symlink(tmp_path / "outside.png", root / "loose_crop" / "a" / "2.png")
    with pytest.raises(DataError, match=r":2: image 'a/2.png' leaves .* \(a link\)"):
        read_template_set(root)
    os.remove(root / "loose_crop" / "a" / "2.png")
    os.mkfifo(root / "loose_crop" / "a" / "2.png")  # never opened: no wait for a writer
    with pytest.raises(DataError, match=r":2: image .*a/2.png is not a regular file"):
        read_template_set(root)


def test_an_undecodable_image_names_the_face_list_and_the_image(tmp_path):
    root = write_layout(tmp_path)
    (root / "loose_crop" / "b" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    faces = read_template_set(root)
    with pytest.raises(DataError, match=r"face_tid_mid.txt: corrupt or unreadable image .*3.png"):
        read_face(faces, 2)


def test_a_large_pair_list_parses_fast_and_its_bad_line_is_found(tmp_path):
    pairs = np.tile([[1, 2, 0], [2, 1, 1], [1, 2, 1]], (20_000, 1))
    text = "\n".join(f"{a} {b} {c}" for a, b, c in pairs.tolist()) + "\n"
    faces = read_template_set(write_layout(tmp_path / "good", pairs=text))
    assert np.array_equal(faces.pairs, pairs[:, :2]) and np.array_equal(faces.labels, pairs[:, 2])
    assert "label.txt:60001: template 3 has no image" in _error(
        tmp_path / "bad", pairs=text + "1 3 0\n"
    )
