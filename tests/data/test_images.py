"""Image decoding (RGB conversion, corrupt files) and the train/eval transforms."""

import io
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from image_cases import BAD, GOOD, SIDE, png16  # tests/ is on the path (pyproject.toml)
from torchvision.io import encode_jpeg, encode_png, write_png

from facenet.data.folder import IdentityFolder
from facenet.data.image_headers import ImageHeader, read_header
from facenet.data.images import (
    NORMALIZATIONS,
    CorruptImageError,
    build_transform,
    decode_image_bytes,
    inspect_image,
    looks_like_image,
    read_image,
)
from facenet.data.pairs import PairList
from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.presets import VerifySettings
from facenet.wings.after_training.embed import embed_folder
from facenet.wings.publishers.insightface_bin import BinFormatError, BinImages, BinPairs

# torchvision 0.29 announces the move of its decoders to TorchCodec on every call.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def random_image(channels=3, h=12, w=10, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (channels, h, w), dtype=torch.uint8, generator=gen)


def write_jpeg_file(path, image):
    path.write_bytes(encode_jpeg(image, quality=95).numpy().tobytes())


def test_png_rgb_round_trip_is_exact(tmp_path):
    image = random_image()
    write_png(image, str(tmp_path / "a.png"))
    out = read_image(tmp_path / "a.png")
    assert out.dtype == torch.uint8
    assert torch.equal(out, image)


def test_grayscale_png_becomes_three_equal_channels(tmp_path):
    gray = random_image(channels=1)
    write_png(gray, str(tmp_path / "g.png"))
    out = read_image(tmp_path / "g.png")
    assert out.shape == (3, 12, 10)
    for c in range(3):
        assert torch.equal(out[c], gray[0])


def test_rgba_png_drops_alpha_and_keeps_colour(tmp_path):
    pil_image = pytest.importorskip("PIL.Image")  # write_png writes 1 or 3 channels only
    rgba = random_image(channels=4)
    pil_image.fromarray(rgba.permute(1, 2, 0).numpy(), mode="RGBA").save(tmp_path / "rgba.png")
    out = read_image(tmp_path / "rgba.png")
    assert out.shape == (3, 12, 10)
    assert torch.equal(out, rgba[:3])


def test_jpeg_decodes_close_to_the_original(tmp_path):
    image = torch.full((3, 16, 16), 100, dtype=torch.uint8)
    image[0] = 200
    write_jpeg_file(tmp_path / "a.jpg", image)
    out = read_image(tmp_path / "a.jpg")
    assert out.shape == (3, 16, 16)
    assert (out.int() - image.int()).abs().max() <= 8  # JPEG is lossy, not by much here


@pytest.mark.parametrize(
    "content",
    [b"", b"not an image at all", b"\xff\xd8\xff\xe0" + b"\x00" * 40 + b"\xff\xd9"],
    ids=["empty", "text", "jpeg-markers-only"],
)
def test_undecodable_file_raises_corrupt_image_error_naming_it(tmp_path, content):
    path = tmp_path / "broken.jpg"
    path.write_bytes(content)
    with pytest.raises(CorruptImageError, match="broken.jpg") as info:
        read_image(path)
    assert info.value.path == str(path)
    assert isinstance(info.value, ValueError)


def test_missing_file_raises_corrupt_image_error(tmp_path):
    with pytest.raises(CorruptImageError, match="nowhere.png"):
        read_image(tmp_path / "nowhere.png")


def test_header_check_accepts_complete_and_rejects_truncated_files(tmp_path):
    image = random_image(h=32, w=32)
    jpeg = encode_jpeg(image).numpy().tobytes()
    write_png(image, str(tmp_path / "ok.png"))
    png = (tmp_path / "ok.png").read_bytes()
    cases = {
        "ok.jpg": (jpeg, True),
        "ok2.png": (png, True),
        "trailing.jpg": (jpeg + b"\x00" * 100, True),  # data after the end marker is common
        "cut.jpg": (jpeg[: len(jpeg) // 2], False),
        "cut.png": (png[: len(png) - 20], False),
        "empty.png": (b"", False),
        "text.jpg": (b"hello", False),
        "ok.bmp": (GOOD["bmp"].data, True),
        "cut.bmp": (GOOD["bmp"].data[:-30], False),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        assert looks_like_image(tmp_path / name) is expected, name
    assert looks_like_image(tmp_path / "absent.png") is False


# S = 16 resizes the shorter side to 18 = 1.125 x 16, so an 18 x 18 image keeps its pixels and
# the centre crop is rows and columns 1..16.
CENTRE = (slice(None), slice(1, 17), slice(1, 17))


def test_fixed_normalisation_is_facenet_standardisation():
    image = random_image(h=18, w=18)
    out = build_transform(16, train=False, normalize="fixed")(image)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (image[CENTRE].float() - 127.5) / 128.0)
    extremes = torch.tensor([[0, 255], [255, 0]], dtype=torch.uint8).expand(3, 2, 2)
    out = build_transform(2, train=False)(extremes.contiguous())
    assert out.min().item() == pytest.approx(-127.5 / 128)
    assert out.max().item() == pytest.approx(127.5 / 128)


def test_imagenet_normalisation_uses_mean_and_std():
    image = random_image(h=18, w=18)
    out = build_transform(16, train=False, normalize="imagenet")(image)
    _, mean, std = NORMALIZATIONS["imagenet"]
    mean = torch.tensor(mean).view(3, 1, 1)
    std = torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(out, (image[CENTRE].float() / 255 - mean) / std)


def test_eval_transform_resizes_shorter_side_and_centre_crops():
    image = random_image(h=18, w=34)  # already 1.125 x S high: the resize is the identity
    out = build_transform(16, train=False)(image)
    assert out.shape == (3, 16, 16)
    torch.testing.assert_close(out, (image[:, 1:17, 9:25].float() - 127.5) / 128)
    big = build_transform(5, train=False)(random_image(h=40, w=30))
    assert big.shape == (3, 5, 5)


def test_eval_transform_is_deterministic():
    image = random_image(h=20, w=20)
    transform = build_transform(16, train=False)
    assert torch.equal(transform(image), transform(image))


def test_train_transform_crops_at_random_places():
    torch.manual_seed(0)
    image = random_image(h=32, w=32)
    transform = build_transform(16, train=True, hflip=False)
    outs = [transform(image) for _ in range(8)]
    assert all(o.shape == (3, 16, 16) for o in outs)
    assert len({o.sum().item() for o in outs}) > 1


def test_train_flip_only_gives_the_image_or_its_mirror():
    torch.manual_seed(0)
    image = random_image(h=18, w=18)
    transform = build_transform(16, train=True, random_crop=False, hflip=True)
    plain = (image[CENTRE].float() - 127.5) / 128
    seen = set()
    for _ in range(20):
        out = transform(image)
        if torch.equal(out, plain):
            seen.add("plain")
        elif torch.equal(out, plain.flip(-1)):
            seen.add("flipped")
        else:
            pytest.fail("output is neither the image nor its mirror")
    assert seen == {"plain", "flipped"}


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'unit'"):
        build_transform(8, train=False, normalize="unit")
    with pytest.raises(ValueError, match="image_size=0"):
        build_transform(0, train=False)


def test_training_and_evaluation_see_faces_at_the_same_scale():
    image = random_image(h=40, w=30)
    train = build_transform(16, train=True, random_crop=False, hflip=False)
    torch.testing.assert_close(train(image), build_transform(16, train=False)(image))


# --------------------------------------------------------------------------- hostile files


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height (8-bit RGB); its data is a stub."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + png_chunk(b"IEND", b"")
    )


def png_bytes(image) -> bytes:
    return encode_png(image).numpy().tobytes()


def test_png_damaged_in_the_middle_is_refused_by_name_not_a_crash(tmp_path):
    # torchvision's decoder ended the process with SIGSEGV on this file (libpng's "bad adaptive
    # filter value" longjmp); the CRC check now names the damaged chunk.
    data = bytearray(png_bytes(random_image(h=32, w=32)))
    middle = len(data) // 2
    data[middle : middle + 50] = bytes(b ^ 0xFF for b in data[middle : middle + 50])
    path = tmp_path / "damaged.png"
    path.write_bytes(bytes(data))
    assert looks_like_image(path)  # header and IEND intact: the cheap check passes
    with pytest.raises(CorruptImageError, match=r"damaged.png: PNG chunk 'IDAT' .* CRC"):
        read_image(path)
    assert "CRC" in inspect_image(path)


def test_png_with_bad_filter_bytes_and_valid_checksums_is_refused_not_a_crash(tmp_path):
    # A crafted file: every CRC right, the first row's filter type 7 (valid: 0..4). libpng
    # reports it from inside torchvision's decoder, which crashed; Pillow raises.
    rows = b"".join(b"\x07" + bytes(range(12)) for _ in range(4))  # 4 rows of 4 RGB pixels
    ihdr = struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )
    path = tmp_path / "filter.png"
    path.write_bytes(data)
    with pytest.raises(CorruptImageError, match="filter.png"):
        read_image(path)


@pytest.mark.parametrize(
    "width, height, limit",
    [(60000, 60000, "pixels"), (20000, 20000, "pixels"), (1, 200000, "aspect ratio")],
)
def test_declared_size_over_the_limits_is_refused_before_decoding(tmp_path, width, height, limit):
    path = tmp_path / "huge.png"
    path.write_bytes(png_declaring(width, height))  # a few bytes; nothing is allocated
    with pytest.raises(CorruptImageError, match=f"huge.png: {width} x {height} .*{limit}"):
        read_image(path)
    assert limit in inspect_image(path)


def test_size_limits_are_parameters(tmp_path):
    path = tmp_path / "small.png"
    path.write_bytes(png_bytes(random_image(h=8, w=16)))
    assert read_image(path).shape == (3, 8, 16)
    with pytest.raises(CorruptImageError, match="data.max_image_pixels"):
        read_image(path, max_pixels=100)
    with pytest.raises(CorruptImageError, match="data.max_aspect_ratio"):
        read_image(path, max_aspect_ratio=1.5)


def test_header_sizes_of_every_format(tmp_path):
    image = random_image(h=12, w=10)
    jpeg = encode_jpeg(image).numpy().tobytes()
    assert read_header(io.BytesIO(jpeg)) == ImageHeader("jpeg", 10, 12)
    assert read_header(io.BytesIO(png_bytes(image))) == ImageHeader("png", 10, 12)
    gif = b"GIF89a" + struct.pack("<HH", 300, 7) + b"\x00" * 8
    assert read_header(io.BytesIO(gif)) == ImageHeader("gif", 300, 7)
    vp8l_bits = (640 - 1) | ((480 - 1) << 14)
    webp = b"RIFF\x00\x00\x00\x00WEBPVP8L\x00\x00\x00\x00\x2f" + vp8l_bits.to_bytes(4, "little")
    assert read_header(io.BytesIO(webp + b"\x00" * 8)) == ImageHeader("webp", 640, 480)
    bmp = b"BM" + bytes(12) + struct.pack("<Iii", 40, 33, -21) + bytes(28)  # top-down rows
    assert read_header(io.BytesIO(bmp)) == ImageHeader("bmp", 33, 21)
    core = b"BM" + bytes(12) + struct.pack("<IHH", 12, 5, 6)  # BITMAPCOREHEADER
    assert read_header(io.BytesIO(core)) == ImageHeader("bmp", 5, 6)
    with pytest.raises(ValueError, match="not a JPEG"):
        read_header(io.BytesIO(b"hello world!"))


def test_jpeg_header_declaring_a_huge_frame_is_refused(tmp_path):
    sof = b"\xff\xc0\x00\x11\x08" + struct.pack(">HH", 60000, 60000) + b"\x03" + b"\x01\x11\x00" * 3
    path = tmp_path / "huge.jpg"
    path.write_bytes(b"\xff\xd8\xff\xe0\x00\x04ab" + sof + b"\xff\xd9")
    with pytest.raises(CorruptImageError, match="60000 x 60000"):
        read_image(path)


def test_a_fifo_or_device_named_like_an_image_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # opening it for reading the usual way would wait for a writer forever
    for path in (fifo, "/dev/zero"):
        with pytest.raises(CorruptImageError, match="not a regular file"):
            read_image(path)
        assert looks_like_image(path) is False
        assert inspect_image(path) is not None


# --------------------------------------------------------------------------- every decoder path
# Each kind of image (tests/image_cases.py) from a file and from bytes, then through every
# caller of the checked decoder: folders, pairs, embedding and .bin sets (alignment: in
# tests/inference/test_align.py).


@pytest.mark.parametrize("name", sorted(GOOD))
def test_every_kind_decodes_alike_from_a_file_and_from_bytes(tmp_path, name):
    case = GOOD[name]
    path = tmp_path / f"{name}{case.suffix}"
    path.write_bytes(case.data)
    assert inspect_image(path) is None
    from_file, from_bytes = read_image(path), decode_image_bytes(case.data, name)
    assert from_file.dtype == torch.uint8 and from_file.shape == (3, SIDE, SIDE)
    assert torch.equal(from_file, case.expected) and torch.equal(from_bytes, case.expected)


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_refused_kind_is_named_from_a_file_and_from_bytes(tmp_path, name):
    case = BAD[name]
    path = tmp_path / f"{name}{case.suffix}"
    path.write_bytes(case.data)
    with pytest.raises(CorruptImageError, match=case.reason) as from_file:
        read_image(path)
    assert from_file.value.path == str(path) and str(path) in str(from_file.value)
    with pytest.raises(CorruptImageError, match=case.reason) as from_bytes:
        decode_image_bytes(case.data, "lfw.bin: image 3 (pair 1)")
    assert "lfw.bin: image 3 (pair 1)" in str(from_bytes.value)


def test_sixteen_bit_samples_are_scaled_not_clipped():
    # 0, 255, 256, 65535 -> 0, 0, 1, 255 (the high byte); a cast would clip 256 and up to 255
    samples = np.array([[0, 255, 256, 65535]] * 4, dtype=np.uint16)
    for array in (samples, np.dstack([samples] * 3)):
        out = decode_image_bytes(png16(array), "x.png")
        assert out[:, 0].tolist() == [[0, 0, 1, 255]] * 3


def test_bytes_over_the_size_limit_are_refused_unread():
    with pytest.raises(CorruptImageError, match="larger than any image allowed"):
        decode_image_bytes(GOOD["png"].data + bytes(17 * 2**20), "x.png", max_pixels=1000)
    with pytest.raises(CorruptImageError, match="empty"):
        decode_image_bytes(b"", "x.png")


def flat_model() -> torch.nn.Module:
    """A "network" whose embedding is its input, flattened: the decoded pixels come back."""
    return torch.nn.Flatten()


def decoded_by_folder(paths, tmp_path):
    """Through IdentityFolder: each file in an identity folder of its own (and one more
    identity). A bad file is refused when the folder is indexed, or when it is loaded if only
    decoding finds it."""
    root = tmp_path / "folder"
    for i, path in enumerate(paths):
        (root / f"id{i}").mkdir(parents=True)
        (root / f"id{i}" / path.name).write_bytes(path.read_bytes())
    (root / "other").mkdir()
    (root / "other" / "x.png").write_bytes(GOOD["png"].data)
    folder = IdentityFolder(root, on_corrupt="error", min_images=1)
    items = {Path(p).parent.name: i for i, (p, _) in enumerate(folder.samples)}
    return [folder[items[f"id{i}"]][0] for i in range(len(paths))]


def decoded_by_pairs(paths, tmp_path):
    """Through embed_pair_list (evaluate.py's image path), preprocess "crop": no resize."""
    names = [str(p) for p in paths]
    pairs = PairList(names, names, np.ones(len(names), bool), 1, 1, np.zeros(len(names)), None)
    emb, _ = embed_pair_list(flat_model(), pairs, SIDE, VerifySettings(preprocess="crop"))
    return [(row.reshape(3, SIDE, SIDE) * 128 + 127.5).round().to(torch.uint8) for row in emb]


def decoded_by_embed(paths, tmp_path):
    """Through embed_folder (embed.py): the evaluation transform, compared undone below."""
    root = tmp_path / "embed"
    root.mkdir()
    for path in paths:
        (root / path.name).write_bytes(path.read_bytes())
    result = embed_folder(flat_model(), root, SIDE)
    if result.unreadable:
        raise CorruptImageError(*result.unreadable[0])
    return [row.reshape(3, SIDE, SIDE) for row in result.embeddings]


def decoded_by_bin(paths, tmp_path):
    """Through BinImages (evaluate.py --bin): resized to S = 24, so left as it is."""
    pairs = BinPairs([p.read_bytes() for p in paths], np.ones(len(paths) // 2, bool), "lfw")
    images = BinImages(pairs, SIDE)
    return [(images[i] * 128 + 127.5).round().to(torch.uint8) for i in range(len(paths))]


CALLERS = {
    "folder": decoded_by_folder,
    "pairs": decoded_by_pairs,
    "embed": decoded_by_embed,
    "bin": decoded_by_bin,
}


def expected_by(caller: str, image: torch.Tensor) -> torch.Tensor:
    """What ``caller`` gives for a decoded ``image``."""
    if caller == "embed":  # the evaluation transform, applied to the expected pixels
        return build_transform(SIDE, train=False)(image).reshape(3, SIDE, SIDE)
    return image


@pytest.mark.parametrize("caller", sorted(CALLERS))
def test_every_caller_decodes_every_kind_with_the_checked_decoder(tmp_path, caller):
    names = sorted(GOOD)
    paths = []
    for name in names:
        paths.append(tmp_path / f"{name}{GOOD[name].suffix}")
        paths[-1].write_bytes(GOOD[name].data)
    paths += paths[:1] if len(paths) % 2 else []  # .bin sets hold pairs
    decoded = CALLERS[caller](paths, tmp_path)
    for name, image in zip(names, decoded):
        expected = expected_by(caller, GOOD[name].expected)
        assert torch.allclose(image.float(), expected.float(), atol=1e-4), (caller, name)


@pytest.mark.parametrize("caller", sorted(CALLERS))
@pytest.mark.parametrize("name", sorted(BAD))
def test_every_caller_refuses_every_bad_kind_by_name(tmp_path, caller, name):
    case = BAD[name]
    path = tmp_path / f"{name}{case.suffix}"
    path.write_bytes(case.data)
    error = BinFormatError if caller == "bin" else CorruptImageError
    with pytest.raises(error, match=case.reason) as caught:
        CALLERS[caller]([path, path], tmp_path)
    where = "lfw.bin: image 0 (pair 0)" if caller == "bin" else path.name
    assert where in str(caught.value)


def test_non_square_evaluation_transforms_give_height_by_width():
    from facenet.data.images import build_transform, crop_or_pad

    image = torch.randint(0, 256, (3, 30, 50), dtype=torch.uint8)  # (3, h, w)
    for preprocess in ("resize", "crop"):
        out = build_transform([24, 20], False, preprocess=preprocess)(image)
        assert out.shape == (3, 24, 20)
    # crop: TensorFlow's offsets ((30 - 24) // 2, (50 - 20) // 2), no resize
    assert torch.equal(crop_or_pad(image, (24, 20)), image[:, 3:27, 15:35])
    padded = crop_or_pad(image, (40, 20))  # rows padded 5 above and below
    assert padded.shape == (3, 40, 20) and not padded[:, :5].any()
    assert torch.equal(build_transform(16, False)(image), build_transform((16, 16), False)(image))
    with pytest.raises(ValueError, match="height, width"):
        build_transform([24, 20, 3], False)


def test_build_transform_refuses_an_unknown_preprocess():
    with pytest.raises(ValueError, match=r"preprocess='stretch': expected one of"):
        build_transform(16, train=False, preprocess="stretch")


_READ_UNDER_A_MEMORY_LIMIT = """
import resource, sys
from facenet.data.images import inspect_image, read_image

with open("/proc/self/status") as status:  # the address space already mapped, in KiB
    mapped = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
room = mapped * 1024 + 256 * 2**20  # far below the 528 MiB a read of the largest image takes
resource.setrlimit(resource.RLIMIT_AS, (room, room))
for path in sys.argv[1:]:
    assert inspect_image(path) is None, path
    print(tuple(read_image(path).shape))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_a_small_image_is_read_within_a_small_address_space(tmp_path):
    """A read asks for the file's size, not the largest size allowed, so a tight ulimit -v
    still reads small images."""
    write_png(random_image(), str(tmp_path / "a.png"))
    write_jpeg_file(tmp_path / "a.jpg", random_image())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = [sys.executable, "-c", _READ_UNDER_A_MEMORY_LIMIT]
    done = subprocess.run(
        script + [str(tmp_path / "a.png"), str(tmp_path / "a.jpg")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["(3, 12, 10)", "(3, 12, 10)"]
