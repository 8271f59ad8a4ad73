"""facenet-make-rec: an identity folder into insightface's RecordIO, images byte for byte; bad
input and outputs it did not write refused in one line, exit 2, before anything is written."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from facenet.cli.make_rec import main
from facenet.data.recordio import RecordIODataset
from tests.image_cases import BAD, GOOD


@pytest.fixture
def src(tmp_path) -> Path:
    """bob: 3 images, alice: 2 (one of each format in turn), an empty identity folder."""
    root = tmp_path / "faces"
    formats = list(GOOD.values())
    for identity, count in (("bob", 3), ("alice", 2), ("nobody", 0)):
        (root / identity).mkdir(parents=True)
        for i in range(count):
            case = formats[(i + count) % len(formats)]
            (root / identity / f"{i}{case.suffix}").write_bytes(case.data)
    return root


def tree(root: Path) -> dict:
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def refused(argv, tmp_path, capsys, says: str) -> None:
    before = tree(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and len(err.splitlines()) == 1, err
    assert tree(tmp_path) == before  # nothing written, nothing replaced


def test_a_folder_is_packed_byte_for_byte_labelled_in_identity_name_order(src, tmp_path, capsys):
    dst = tmp_path / "rec"
    assert main([str(src), str(dst)]) == 0
    out, err = capsys.readouterr()
    assert "(5 images of 2 identities)" in out
    assert err == f"warning: {src}: left out 1 identities without usable images: nobody\n"
    dataset = RecordIODataset(dst)
    files = sorted((src / "alice").iterdir()) + sorted((src / "bob").iterdir())
    assert [dataset.read_image_bytes(i) for i in range(5)] == [p.read_bytes() for p in files]
    assert dataset.targets.tolist() == [0, 0, 1, 1, 1]
    assert (dst / "property").read_text() == "2,24,24\n"
    assert not list(dst.glob(".*.tmp"))


def test_an_unusable_image_is_left_out_with_one_warning(src, tmp_path, capsys):
    (src / "bob" / "broken.png").write_bytes(BAD["png_crc_damaged"].data)
    assert main([str(src), str(tmp_path / "rec")]) == 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "left out 1 unusable image(s): " in err, err
    assert f"{src / 'bob' / 'broken.png'}; left out 1 identities" in err, err
    assert len(RecordIODataset(tmp_path / "rec")) == 5


def test_a_dst_inside_src_is_refused(src, tmp_path, capsys):
    refused([str(src), str(src / "bob" / "rec")], tmp_path, capsys, "lies inside")
    refused([str(src), str(src)], tmp_path, capsys, "lies inside")


def test_a_missing_src_or_one_without_images_is_refused(tmp_path, capsys):
    refused([str(tmp_path / "absent"), str(tmp_path / "rec")], tmp_path, capsys, "not found")
    (tmp_path / "empty" / "someone").mkdir(parents=True)
    refused([str(tmp_path / "empty"), str(tmp_path / "rec")], tmp_path, capsys, "no usable")


@pytest.mark.parametrize("name", ["train.rec", "train.idx", "property"])
def test_existing_outputs_are_replaced_only_with_overwrite_and_only_files(
    name, src, tmp_path, capsys
):
    dst = tmp_path / "rec"
    dst.mkdir()
    (dst / name).write_bytes(b"the user's own")
    says = f"{dst / name} exists: --overwrite replaces it"
    refused([str(src), str(dst)], tmp_path, capsys, says)
    assert main([str(src), str(dst), "--overwrite"]) == 0
    capsys.readouterr()  # its warning of the empty identity folder
    assert len(RecordIODataset(dst)) == 5
    (dst / name).unlink()
    os.symlink(src / "bob" / "0.png", dst / name)
    refused([str(src), str(dst), "--overwrite"], tmp_path, capsys, "is not a regular file")


@pytest.mark.parametrize("threads", [0, 1])
def test_the_pack_is_the_same_when_checking_threads_cannot_start(src, tmp_path, threads):
    """Under a tight ulimit a pool thread cannot start: the images are checked in the calling
    thread instead, not lost in a traceback."""
    assert main([str(src), str(tmp_path / "threaded")]) == 0
    original, started = threading.Thread.start, []

    def start(thread):  # as CPython raises when no thread can be made
        if len(started) >= threads:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        original(thread)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(threading.Thread, "start", start)
        assert main([str(src), str(tmp_path / "in_one_thread")]) == 0
    packed = [tree(tmp_path / name) for name in ("threaded", "in_one_thread")]
    assert list(packed[0].values()) == list(packed[1].values())
