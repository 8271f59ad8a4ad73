"""Image decoding (RGB conversion, corrupt files) and the train/eval transforms."""

import pytest
import torch
from torchvision.io import encode_jpeg, write_png

from facenet.data.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CorruptImageError,
    build_transform,
    looks_like_image,
    read_image,
)

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
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
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
