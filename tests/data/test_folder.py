"""IdentityFolder on a generated folder: formats, corrupt files, small identities, index cache;
the walks of IdentityFolder and list_images through symbolic links."""

import json
import os
import pickle
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.io import encode_jpeg, write_png

import facenet.data.images as images_module
from facenet.data.folder import INDEX_FILE_NAME, IdentityFolder, list_images, prepare_index
from facenet.data.images import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    CorruptImageError,
    build_transform,
)
from facenet.wings.after_training.embed import embed_folder

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def pixels(channels, seed, size=12):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (channels, size, size), dtype=torch.uint8, generator=gen)


def jpeg_bytes(image):
    return encode_jpeg(image, quality=90).numpy().tobytes()


def make_folder(root):
    """alice: 2 PNG + 1 JPEG + a truncated JPEG; bob: gray PNG, RGBA PNG, gray JPEG;
    carol: one image; empty: no image (a text file only); dave: only a corrupt file."""
    pil_image = pytest.importorskip("PIL.Image")  # write_png writes 1 or 3 channels only
    for name in ("alice", "bob", "carol", "empty", "dave"):
        (root / name).mkdir(parents=True)
    write_png(pixels(3, 0), str(root / "alice" / "a1.png"))
    write_png(pixels(3, 1), str(root / "alice" / "a2.png"))
    (root / "alice" / "a3.jpg").write_bytes(jpeg_bytes(pixels(3, 2)))
    good = jpeg_bytes(pixels(3, 3))
    (root / "alice" / "a4_truncated.jpg").write_bytes(good[: len(good) // 2])
    write_png(pixels(1, 4), str(root / "bob" / "b1_gray.png"))
    rgba = pixels(4, 5).permute(1, 2, 0).numpy()
    pil_image.fromarray(rgba, mode="RGBA").save(root / "bob" / "b2_rgba.png")
    (root / "bob" / "b3_gray.jpg").write_bytes(jpeg_bytes(pixels(1, 6)))
    write_png(pixels(3, 7), str(root / "carol" / "c1.png"))
    (root / "empty" / "notes.txt").write_text("not an image")
    (root / "dave" / "d1.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (root / "README.txt").write_text("top-level files are not identities")
    return root


@pytest.fixture
def root(tmp_path):
    return make_folder(tmp_path / "faces")


def build(root, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = IdentityFolder(root, **kwargs)
    return dataset, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_index_holds_usable_images_by_identity(root):
    ds, _ = build(root)
    assert ds.classes == ["alice", "bob", "carol"]
    assert ds.class_to_idx == {"alice": 0, "bob": 1, "carol": 2}
    names = [(os.path.basename(path), label) for path, label in ds.samples]
    assert names == [
        ("a1.png", 0),
        ("a2.png", 0),
        ("a3.jpg", 0),
        ("b1_gray.png", 1),
        ("b2_rgba.png", 1),
        ("b3_gray.jpg", 1),
        ("c1.png", 2),
    ]
    assert list(ds.targets) == [label for _, label in names]
    assert len(ds) == 7


def test_corrupt_files_are_skipped_with_one_warning_naming_them(root):
    ds, messages = build(root)
    assert sorted(os.path.basename(p) for p in ds.skipped) == ["a4_truncated.jpg", "d1.png"]
    corrupt_warnings = [m for m in messages if "corrupt or unreadable" in m]
    assert len(corrupt_warnings) == 1
    assert "a4_truncated.jpg" in corrupt_warnings[0] and "d1.png" in corrupt_warnings[0]
    assert "skipped 2" in corrupt_warnings[0]


def test_on_corrupt_error_raises_naming_the_file(root):
    with pytest.raises(CorruptImageError, match="a4_truncated.jpg|d1.png"):
        IdentityFolder(root, on_corrupt="error")


def test_identities_without_usable_images_are_ignored_with_a_warning(root):
    ds, messages = build(root)
    assert "empty" not in ds.classes and "dave" not in ds.classes
    ignored = [m for m in messages if "without usable images" in m]
    assert len(ignored) == 1 and "empty" in ignored[0] and "dave" in ignored[0]


def test_one_image_identity_stays_in_samples_but_not_in_triplet_sampling(root):
    ds, messages = build(root)
    carol = ds.class_to_idx["carol"]
    assert carol in ds.targets
    expected = np.where(np.asarray(ds.targets) == carol, -1, ds.targets)
    assert np.array_equal(ds.triplet_labels, expected)
    left_out = [m for m in messages if "left out of triplet sampling" in m]
    assert len(left_out) == 1 and "carol" in left_out[0] and "alice" not in left_out[0]


def test_min_images_moves_the_threshold(root):
    ds, _ = build(root, min_images=1)
    assert (ds.triplet_labels >= 0).all()
    ds, _ = build(root, min_images=4)
    assert (ds.triplet_labels == -1).all()


def test_items_are_rgb_uint8_whatever_the_file(root):
    ds, _ = build(root)
    for i in range(len(ds)):
        image, label = ds[i]
        assert image.dtype == torch.uint8 and image.shape == (3, 12, 12)
        assert label == ds.targets[i]
    gray = ds[ds.samples.index((str(root / "bob" / "b1_gray.png"), 1))][0]
    assert torch.equal(gray[0], pixels(1, 4)[0]) and torch.equal(gray[1], gray[2])
    rgba = ds[ds.samples.index((str(root / "bob" / "b2_rgba.png"), 1))][0]
    assert torch.equal(rgba, pixels(4, 5)[:3])


def test_transform_is_applied(root):
    ds, _ = build(root, transform=build_transform(8, train=False))
    image, _ = ds[0]
    assert image.dtype == torch.float32 and image.shape == (3, 8, 8)


def test_file_corrupt_past_its_header_raises_at_load_naming_it(root):
    # A valid frame header (8 x 8, 3 components) and end marker around garbage: passes the
    # checks short of decoding, fails to decode.
    sof = b"\xff\xc0\x00\x11\x08\x00\x08\x00\x08\x03" + b"\x01\x11\x00" * 3
    garbage = b"\xff\xd8" + sof + b"\x00" * 64 + b"\xff\xd9"
    (root / "bob" / "b4_garbage.jpg").write_bytes(garbage)
    ds, _ = build(root)
    index = [os.path.basename(p) for p, _ in ds.samples].index("b4_garbage.jpg")
    with pytest.raises(CorruptImageError, match="b4_garbage.jpg"):
        ds[index]


def count_header_checks(monkeypatch):
    calls = []
    original = images_module.inspect_image

    def counting(path, **limits):
        calls.append(path)
        return original(path, **limits)

    monkeypatch.setattr(images_module, "inspect_image", counting)
    return calls


def test_index_is_cached_next_to_the_data_and_reused(root, monkeypatch):
    calls = count_header_checks(monkeypatch)
    first, _ = build(root)
    assert (root / INDEX_FILE_NAME).is_file() and not first.index_reused
    assert len(calls) == 9  # every image file once
    second, _ = build(root)
    assert second.index_reused and len(calls) == 9  # no file opened again
    assert list(second.samples) == list(first.samples) and second.skipped == first.skipped


@pytest.mark.parametrize("change", ["add", "remove", "modify", "new_identity"])
def test_index_is_rebuilt_when_the_folder_changes(root, change):
    first, _ = build(root)
    if change == "add":
        write_png(pixels(3, 9), str(root / "carol" / "c2.png"))
    elif change == "remove":
        (root / "alice" / "a2.png").unlink()
    elif change == "modify":  # a repaired file copied over the broken one (by a rename)
        repaired = root / "alice" / ".a4_truncated.jpg.part"
        repaired.write_bytes(jpeg_bytes(pixels(3, 3)))
        os.replace(repaired, root / "alice" / "a4_truncated.jpg")
    else:
        (root / "erin").mkdir()
        write_png(pixels(3, 10), str(root / "erin" / "e1.png"))
    second, _ = build(root)
    assert not second.index_reused
    if change == "add":
        assert np.count_nonzero(second.targets == second.class_to_idx["carol"]) == 2
        assert (second.triplet_labels >= 0).all()
    elif change == "remove":
        assert len(second) == len(first) - 1
    elif change == "modify":
        assert len(second) == len(first) + 1 and len(second.skipped) == 1
    elif change == "new_identity":
        assert second.classes[-1] == "erin"


def test_a_file_rewritten_in_place_escapes_the_key_until_its_folder_is_touched(root):
    """The documented limit of the key: the files themselves are not stat-ed."""
    first, _ = build(root)
    (root / "alice" / "a4_truncated.jpg").write_bytes(jpeg_bytes(pixels(3, 3)))
    folder_stamp = os.stat(root / "alice").st_mtime_ns
    os.utime(root / "alice", ns=(folder_stamp, folder_stamp))  # as when written in the same tick
    second, _ = build(root)
    assert second.index_reused and len(second) == len(first)
    stamp = time.time() + 5
    os.utime(root / "alice", (stamp, stamp))
    third, _ = build(root)
    assert not third.index_reused and len(third) == len(first) + 1


def test_index_in_cache_dir_leaves_the_data_folder_untouched(root, tmp_path):
    cache = tmp_path / "cache"
    first, _ = build(root, cache_dir=cache)
    assert not (root / INDEX_FILE_NAME).exists()
    files = list(cache.glob("*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["root"] == str(root.resolve())
    second, _ = build(root, cache_dir=cache)
    assert second.index_reused and list(second.samples) == list(first.samples)


@pytest.mark.parametrize("damage", ["{ not json", "[" * 100_000, "fifo"])
def test_corrupt_cache_file_is_rebuilt(root, damage):
    build(root)
    (root / INDEX_FILE_NAME).unlink()
    if damage == "fifo":  # must not block
        os.mkfifo(root / INDEX_FILE_NAME)
    else:
        (root / INDEX_FILE_NAME).write_text(damage)
    ds, _ = build(root)
    assert not ds.index_reused and len(ds) == 7


@pytest.mark.parametrize(
    "forged",
    [
        {"identities": {"alice": ["../../outside.png"]}},  # a file the listing does not hold
        {"identities": {"alice": 5}},
        {"identities": []},
        {"corrupt": 5},
        {"corrupt": [["alice", "a1.png"]]},
        {"corrupt": [["alice", "a1.png", None]]},
        {"identities": {"alice": [1, "a"]}},
    ],
)
def test_a_forged_index_with_the_right_signature_is_rebuilt(root, forged):
    """The signature hashes the listing, which anyone can recompute: the contents are checked."""
    build(root)
    index = json.loads((root / INDEX_FILE_NAME).read_text())
    (root / INDEX_FILE_NAME).write_text(json.dumps({**index, **forged}))
    ds, _ = build(root)
    assert not ds.index_reused and len(ds) == 7
    assert all(root in Path(path).parents for path, _ in ds.samples)


def test_fewer_than_two_identities_is_an_error_naming_the_root(tmp_path):
    root = tmp_path / "lonely"
    (root / "only").mkdir(parents=True)
    write_png(pixels(3, 0), str(root / "only" / "x.png"))
    with pytest.raises(ValueError, match="lonely"):
        build(root)


def test_bad_arguments_are_named(root, tmp_path):
    with pytest.raises(ValueError, match="on_corrupt='ignore'"):
        IdentityFolder(root, on_corrupt="ignore")
    with pytest.raises(ValueError, match="no_such_folder"):
        IdentityFolder(tmp_path / "no_such_folder")


def test_damaged_and_oversized_pngs_are_found_at_index_time_with_the_reason(root):
    data = bytearray((root / "alice" / "a1.png").read_bytes())
    middle = len(data) // 2
    data[middle : middle + 5] = b"\x00\xff\x00\xff\x00"
    (root / "alice" / "a5_damaged.png").write_bytes(bytes(data))  # header and IEND intact
    write_png(torch.zeros(3, 1, 200, dtype=torch.uint8), str(root / "bob" / "b5_strip.png"))
    ds, messages = build(root, limits=(DEFAULT_MAX_PIXELS, 20.0))
    assert str(root / "alice" / "a5_damaged.png") in ds.skipped
    assert str(root / "bob" / "b5_strip.png") in ds.skipped
    assert any("a5_damaged.png" in m and "b5_strip.png" in m for m in messages)
    os.remove(root / "alice" / "a4_truncated.jpg")  # the error names the first corrupt file
    with pytest.raises(CorruptImageError, match="a5_damaged.png: PNG chunk 'IDAT' .* CRC"):
        IdentityFolder(root, on_corrupt="error")
    os.remove(root / "alice" / "a5_damaged.png")
    with pytest.raises(
        CorruptImageError, match=r"b5_strip.png: 200 x 1 .*\(data.max_aspect_ratio\)"
    ):
        IdentityFolder(root, on_corrupt="error")


def test_other_limits_rebuild_the_index(root):
    assert build(root)[1] and build(root)[0].index_reused
    again, _ = build(
        root, limits=(144, DEFAULT_MAX_ASPECT_RATIO)
    )  # 12 x 12 = 144 pixels: every image within it
    assert not again.index_reused
    assert build(root, limits=(144, DEFAULT_MAX_ASPECT_RATIO))[0].index_reused


# --------------------------------------------------------------------------- links


def linked_tree(tmp_path: Path) -> Path:
    """root/A (2 images), root/B (1), root/ext -> a folder outside root (1 image), and links
    that would loop or list an image twice: A/up -> .., B/up -> .., up -> .. (above root),
    self -> ., A/sibling -> ../B, Bcopy -> B, A/b.jpg -> ../B/b1.jpg, A/outside.jpg -> a file
    outside root (listed: it is nowhere else)."""
    store = tmp_path / "store"
    (store / "C").mkdir(parents=True)
    (store / "C" / "c1.jpg").write_bytes(jpeg_bytes(pixels(3, 5)))
    (store / "lone.jpg").write_bytes(jpeg_bytes(pixels(3, 6)))
    root = tmp_path / "root"
    for identity, n in (("A", 2), ("B", 1)):
        (root / identity).mkdir(parents=True)
        for i in range(n):
            (root / identity / f"{identity.lower()}{i + 1}.jpg").write_bytes(
                jpeg_bytes(pixels(3, i))
            )
    links = {
        "A/up": "..",
        "B/up": "..",
        "up": "..",
        "self": ".",
        "A/sibling": "../B",
        "Bcopy": "B",
        "ext": "../store/C",
        "A/b.jpg": "../B/b1.jpg",
        "A/outside.jpg": "../../store/lone.jpg",
    }
    for name, target in links.items():
        os.symlink(target, root / name)
    return root


def test_list_images_visits_every_real_folder_once(tmp_path):
    root = linked_tree(tmp_path)
    with pytest.warns(UserWarning, match="skipped") as caught:
        paths, labels = list_images(root)
    relative = [Path(p).relative_to(root).as_posix() for p in paths]
    assert relative == ["A/a1.jpg", "A/a2.jpg", "A/outside.jpg", "B/b1.jpg", "ext/c1.jpg"]
    assert labels == ["A", "A", "A", "B", "ext"]
    message = str(caught[0].message)
    for name in ("A/up", "B/up", "up", "self", "A/sibling", "Bcopy", "A/b.jpg"):
        assert name in message


@pytest.mark.parametrize("link", ["loop", "sibling", "file"])
def test_list_images_one_link_of_each_kind(tmp_path, link):
    root = tmp_path / "root"
    (root / "A").mkdir(parents=True)
    (root / "B").mkdir()
    (root / "A" / "a.jpg").write_bytes(jpeg_bytes(pixels(3, 0)))
    (root / "B" / "b.jpg").write_bytes(jpeg_bytes(pixels(3, 1)))
    target = {"loop": "..", "sibling": "../B", "file": "../B/b.jpg"}[link]
    os.symlink(target, root / "A" / ("link.jpg" if link == "file" else "link"))
    with pytest.warns(UserWarning, match="A/link"):
        paths, _ = list_images(root)
    assert [Path(p).relative_to(root).as_posix() for p in paths] == ["A/a.jpg", "B/b.jpg"]


def test_identity_folder_lists_each_real_folder_and_image_once(tmp_path):
    root = linked_tree(tmp_path)
    (root / "A" / "up").unlink()  # inside an identity, folders are not walked anyway
    with pytest.warns(UserWarning, match="skipped") as caught:
        folder = IdentityFolder(root, cache_dir=tmp_path / "cache", min_images=1)
    assert folder.classes == ["A", "B", "ext"]
    by_identity = {
        k: sorted(Path(p).name for p, label in folder.samples if folder.classes[label] == k)
        for k in folder.classes
    }
    assert by_identity == {
        "A": ["a1.jpg", "a2.jpg", "outside.jpg"],
        "B": ["b1.jpg"],
        "ext": ["c1.jpg"],
    }
    message = " ".join(str(w.message) for w in caught)
    for name in ("Bcopy", "self", "up", "A/b.jpg"):
        assert name in message


def test_embed_lists_each_image_once_through_looping_links(tmp_path):
    root = linked_tree(tmp_path)
    with pytest.warns(UserWarning, match="skipped"):
        result = embed_folder(torch.nn.Flatten(), root, 12)
    assert len(result.paths) == len(set(result.paths)) == 5 and not result.unreadable


def test_two_processes_check_halves_and_make_the_index_one_makes(root, tmp_path, monkeypatch):
    """prepare_index's parts (rank, ranks) with a gather, as two ranks run it: each image is
    checked once, by one of them, and the folder built after reads nothing again."""
    alone, _ = build(root, cache_dir=tmp_path / "alone")
    calls = count_header_checks(monkeypatch)
    meeting, parts = threading.Barrier(2), [None, None]

    def gather_objects(rank):
        def gather(mine):  # every part in rank order, as facenet.distributed.gather_objects
            parts[rank] = mine
            meeting.wait(timeout=60)
            return list(parts)

        return gather

    def rank_run(rank):
        prepare_index(root, tmp_path / "shared", part=(rank, 2), gather=gather_objects(rank))

    threads = [threading.Thread(target=rank_run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(map(str, calls)) == sorted({str(path) for path in calls})  # none twice
    assert len(calls) == 9 and not parts[0].keys() & parts[1].keys()  # identities per part
    assert {Path(p).parent.name for p in calls} == {"alice", "bob", "carol", "dave"}
    shared, _ = build(root, cache_dir=tmp_path / "shared")
    assert shared.index_reused and len(calls) == 9
    assert list(shared.samples) == list(alone.samples) and shared.skipped == alone.skipped


def test_dataset_holds_about_its_file_names_per_image(tmp_path):
    """No Python object per image: pickled (as a spawned DataLoader worker gets it), the
    dataset of 3,000 images takes its names' bytes plus 24 bytes an image, plus a constant."""
    root = tmp_path / "many"
    image = jpeg_bytes(pixels(3, 0))
    for identity in range(30):
        (root / f"{identity:03d}").mkdir(parents=True)
        for i in range(100):
            (root / f"{identity:03d}" / f"{i:04d}.jpg").write_bytes(image)
    ds, _ = build(root)
    names = len(ds) * len("0000.jpg\0")
    assert len(ds) == 3000 and ds.names.nbytes == names
    assert len(pickle.dumps(ds)) < names + 24 * len(ds) + 20_000
    assert ds.samples[1234] == (str(root / "012" / "0034.jpg"), 12)


def threads_start_at_most(count, monkeypatch):
    """Thread.start raising as CPython does under a tight ulimit after ``count`` starts."""
    original = threading.Thread.start
    started = []

    def start(thread):
        if len(started) >= count:
            raise RuntimeError("can't start new thread")
        started.append(thread)
        original(thread)

    monkeypatch.setattr(threading.Thread, "start", start)


@pytest.mark.parametrize("threads", [0, 1])
def test_the_index_is_the_same_when_checking_threads_cannot_start(root, tmp_path, threads):
    expected, _ = build(root, cache_dir=tmp_path / "threaded")
    with pytest.MonkeyPatch.context() as monkeypatch:
        threads_start_at_most(threads, monkeypatch)
        checked, messages = build(root, cache_dir=tmp_path / "in_one_thread")
    assert not checked.index_reused
    assert list(checked.samples) == list(expected.samples)
    assert checked.skipped == expected.skipped
    assert any("skipped 2" in m for m in messages)
