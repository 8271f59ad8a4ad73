"""The bounded readers of user files: regular files only, sizes, JSON depth, .npz headers; the
writers: atomic, never through a link."""

import io
import os
import zipfile

import numpy as np
import pytest

from facenet.errors import DataError
from facenet.files import check_no_links_below, open_regular, read_json, read_npz, write_atomic


def _npy_bytes(shape, dtype="<f8", payload=b""):
    """An .npy file whose header declares ``shape`` but which holds only ``payload``."""
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode("latin1")
    header += b" " * (63 - (len(header) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + payload


def _npz(path, members, compression=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, raw in members.items():
            archive.writestr(name, raw)
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("reader", [read_json, lambda p: read_npz(p, "arrays")])
def test_a_fifo_is_refused_without_blocking(tmp_path, reader):
    fifo = tmp_path / "metrics.json"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):
        reader(fifo)


def test_folders_missing_and_oversized_files_are_refused(tmp_path):
    with pytest.raises(DataError, match="not a regular file"):
        open_regular(tmp_path, 10)
    with pytest.raises(DataError, match="missing.json"):
        read_json(tmp_path / "missing.json")
    big = tmp_path / "big.json"
    big.write_text("[" + "0," * 50 + "0]")
    with pytest.raises(DataError, match="larger than the 20 allowed"):
        read_json(big, max_bytes=20)
    with pytest.raises(KeyError, match="mine"):
        open_regular(big, 1, lambda reason: KeyError(f"mine: {reason}"))


@pytest.mark.parametrize("depth", [5_000, 200_000])
def test_json_nested_thousands_deep_is_one_error(tmp_path, depth):
    path = tmp_path / "metrics.json"
    path.write_text("[" * depth + "]" * depth)
    with pytest.raises(DataError, match="nested too deeply"):
        read_json(path)


def test_json_reads_plain_values_and_names_broken_ones(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"a": [1, 2.5, null]}')
    assert read_json(path) == {"a": [1, 2.5, None]}
    path.write_text('{"a": ')
    with pytest.raises(DataError, match="m.json: not readable JSON"):
        read_json(path)


def test_npz_round_trip(tmp_path):
    path = tmp_path / "e.npz"
    np.savez_compressed(path, embeddings=np.eye(3, dtype=np.float32), names=np.array(["a", "b"]))
    arrays = read_npz(path, "embeddings")
    np.testing.assert_array_equal(arrays["embeddings"], np.eye(3))
    assert arrays["names"].tolist() == ["a", "b"]


@pytest.mark.parametrize("shape", [(10**12,), (2**31, 2**31), (4, 2**40), (10**8,)])
def test_npz_declaring_a_huge_shape_is_refused_before_allocation(tmp_path, shape):
    path = _npz(tmp_path / "g.npz", {"embeddings.npy": _npy_bytes(shape, payload=b"\0" * 64)})
    with pytest.raises(DataError, match=r"g.npz: not a gallery .*declares"):
        read_npz(path, "a gallery")


def test_npz_budget_counts_every_array(tmp_path):
    members = {f"a{i}.npy": _npy_bytes((100,), payload=b"\0" * 800) for i in range(3)}
    path = _npz(tmp_path / "d.npz", members, zipfile.ZIP_DEFLATED)
    assert os.path.getsize(path) < 1_000
    assert len(read_npz(path, "d", max_bytes=2_400)) == 3
    with pytest.raises(DataError, match="past its size"):
        read_npz(path, "d", max_bytes=2_000)


def test_npz_compressed_far_past_any_real_array_is_refused(tmp_path):
    raw = _npy_bytes((2**21,), payload=b"\0" * 8 * 2**21)  # 16 MiB of zeros, ~16 KiB deflated
    path = _npz(tmp_path / "bomb.npz", {"distances.npy": raw}, zipfile.ZIP_DEFLATED)
    assert os.path.getsize(path) < 100_000
    with pytest.raises(DataError, match="inflates .* B"):
        read_npz(path, "distances")


@pytest.mark.parametrize(
    "members, reason",
    [
        ({"x.npy": _npy_bytes((2,), "|O", b"\0" * 16)}, "Python objects"),
        ({"x.txt": b"hello"}, "not an array"),
        ({"x.npy": b"not an npy"}, ""),
        ({"x.npy": _npy_bytes((4,), payload=b"\0" * 8)}, ""),  # truncated data
    ],
)
def test_npz_with_objects_strangers_or_damage_is_one_error(tmp_path, members, reason):
    path = _npz(tmp_path / "x.npz", members)
    with pytest.raises(DataError, match=f"x.npz: not arrays .*{reason}"):
        read_npz(path, "arrays")


def test_a_single_npy_or_garbage_is_not_an_npz(tmp_path):
    path = tmp_path / "one.npz"
    buffer = io.BytesIO()
    np.save(buffer, np.zeros(3))
    path.write_bytes(buffer.getvalue())
    with pytest.raises(DataError, match="one.npz: not arrays"):
        read_npz(path, "arrays")


def test_write_atomic_never_writes_through_a_planted_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    target = tmp_path / "out.json"
    (tmp_path / f".out.json.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(target, lambda fh: fh.write(b"new"))
    assert victim.read_text() == "keep" and target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim.txt"]


def test_a_link_among_the_folders_below_an_output_root_is_refused(tmp_path):
    photos, out = tmp_path / "photos", tmp_path / "out"
    photos.mkdir()
    (out / "meta").mkdir(parents=True)
    (out / "loose_crop").symlink_to(photos, target_is_directory=True)
    check_no_links_below(out, [out / "meta" / "a.txt", out / "report.tsv"])
    with pytest.raises(DataError, match=r"out/loose_crop is a symbolic link inside .*out"):
        check_no_links_below(out, [out / "loose_crop" / "anna" / "a.png"])
    with pytest.raises(DataError, match="loose_crop is a symbolic link"):
        check_no_links_below(out)  # every folder below
    alias = tmp_path / "alias"
    alias.symlink_to(out / "meta", target_is_directory=True)
    check_no_links_below(alias)  # the root itself: the user named it
    check_no_links_below(alias, [alias / "a.txt"])


def test_write_atomic_replaces_a_hard_link_and_keeps_the_other_name(tmp_path):
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"the user's own")
    os.link(photo, tmp_path / "crop.png")
    write_atomic(tmp_path / "crop.png", lambda fh: fh.write(b"crop"))
    assert photo.read_bytes() == b"the user's own"
    assert (tmp_path / "crop.png").read_bytes() == b"crop"
