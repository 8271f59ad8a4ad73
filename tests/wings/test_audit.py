"""The audit wing on a set with planted faults: an image filed under the wrong identity, an
identity filed twice, an evaluation image copied into training. The network is one whose
embedding the test controls (each 4 x 4 block's mean colour), so each fault's distance is
known: every planted fault must be found and ranked first among its kind."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.functional import avg_pool2d, normalize
from torchvision.io import write_png

from facenet.cli import audit as audit_command
from facenet.cli import evaluate as evaluate_command
from facenet.data.folder import list_identities
from facenet.data.images import read_image
from facenet.data.pairs import generate_pairs, read_pairs, write_pairs
from facenet.evaluation.presets import VerifySettings
from facenet.wings.after_training.loading import TrainedModel
from facenet.wings.audit import neighbours
from facenet.wings.audit.embeddings import embed_images, embed_training
from facenet.wings.audit.findings import LabelNoise
from facenet.wings.audit.neighbours import nearest, nearest_other, unit_rows
from facenet.wings.audit.pair_errors import error_sheet, worst_errors
from facenet.wings.audit.report import audit_sets, pair_thresholds, tables_of

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SIZE, BLOCK = 16, 4  # 16 x 16 images; the network reads 4 x 4 blocks: (3, 4, 4) -> 48-D


class BlockMeans(nn.Module):
    """Each block's mean colour, L2-normalised: an image's embedding is its identity's block
    colours plus its own noise averaged over 16 pixels."""

    def __init__(self):
        super().__init__()
        self.images_seen = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 3, 16, 16) -> (B, 48)
        self.images_seen += len(images)
        return normalize(avg_pool2d(images, BLOCK).flatten(1), dim=1)


def block_model() -> TrainedModel:
    return TrainedModel(BlockMeans(), SIZE, "fixed", "test", "block-means", {})


def _face(base: np.ndarray, rng, noise: int = 20) -> torch.Tensor:
    """(3, 16, 16) uint8: the identity's (3, 4, 4) block colours, each pixel off by up to
    ``noise``."""
    image = base.repeat(BLOCK, 1).repeat(BLOCK, 2) + rng.integers(
        -noise, noise + 1, (3, SIZE, SIZE)
    )
    return torch.from_numpy(np.clip(image, 0, 255).astype(np.uint8))


def _save(image: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(image, str(path))


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict:
    """``{"train", "pairs", "root", "copied"}``: eight training identities of six faces,
    eight evaluation identities of four, and the faults (and two decoys) planted among them."""
    root = tmp_path_factory.mktemp("audit")
    rng = np.random.default_rng(0)
    bases = {f"id{j}": rng.integers(30, 226, (3, 4, 4)) for j in range(8)}
    bases["id5"] = np.clip(bases["id4"] + rng.integers(-3, 4, (3, 4, 4)), 0, 255)  # a look-alike
    train, evaluation = root / "train", root / "eval"
    for name, base in bases.items():
        for i in range(6):
            _save(_face(base, rng), train / name / f"{i}.png")
    _save(_face(bases["id1"], rng), train / "id0" / "wrong.png")  # id1's face under id0
    _save(_face(bases["id3"], rng, noise=70), train / "id3" / "poor.png")  # id3's, but blurred
    for i in range(6):  # id2's person filed again under id8
        _save(_face(bases["id2"], rng), train / "id8" / f"{i}.png")
    eval_bases = {f"e{j}": rng.integers(30, 226, (3, 4, 4)) for j in range(8)}
    for name, base in eval_bases.items():
        for i in range(1, 5):
            _save(_face(base, rng), evaluation / name / f"{name}_{i:04d}.png")
    pairs = evaluation / "pairs.txt"
    write_pairs(pairs, generate_pairs(list_identities(evaluation), 2, 8, seed=0))
    used = read_pairs(pairs).unique_paths()[0]
    copied, edited = [next(p for p in used if Path(p).parent.name == n) for n in ("e0", "e1")]
    for i in range(3):  # e0's person in training too, with one of its evaluation images copied
        _save(_face(eval_bases["e0"], rng), train / "e0_too" / f"{i}.png")
    shutil.copy(copied, train / "e0_too" / "copy.png")
    image = read_image(edited)
    image[0, 0, 0] ^= 1  # one pixel off by one: near, never the same pixels
    _save(image, train / "id7" / "e1_edited.png")
    return {"train": train, "pairs": pairs, "root": evaluation, "copied": copied}


SETTINGS = VerifySettings(preprocess="crop", n_folds=2, batch_size=5)


def _audit(planted, quantile=0.25):
    trained = block_model()
    pairs = read_pairs(planted["pairs"])
    train = embed_training(trained, planted["train"], SETTINGS, "cpu")
    paths, index1, index2 = pairs.unique_paths()
    evaluation = embed_images(trained, paths, SETTINGS, "cpu")
    unit = unit_rows(evaluation.embeddings)
    thresholds = pair_thresholds(unit, index1, index2, pairs.issame, quantile)
    return audit_sets(train, evaluation, thresholds)


def test_each_planted_fault_is_found_and_ranked_first_among_its_kind(planted):
    audit = _audit(planted)
    tables = tables_of(audit)
    name = lambda path: "/".join(Path(path).parts[-2:])
    first = tables["overlap_identities"][0]
    assert (first["evaluation_identity"], first["training_identity"]) == ("e0", "e0_too")
    assert first["matched"] >= 1 and first["images"] == 4  # the copy at least, of four
    duplicates = [
        (name(r["evaluation_image"]), name(r["training_image"])) for r in tables["duplicates"]
    ]
    assert duplicates == [(name(planted["copied"]), "e0_too/copy.png")]  # not the edited one
    edited = [r for r in tables["overlap"] if name(r["training_image"]) == "id7/e1_edited.png"]
    assert edited[0]["distance"] < 1e-3 and not edited[0]["same_pixels"]
    noise = tables["label_noise"]
    assert name(noise[0]["image"]) == "id0/wrong.png" and noise[0]["nearest_identity"] == "id1"
    assert noise[0]["reason"] == "closer to another identity"
    assert "id3/poor.png" not in [name(r["image"]) for r in noise]  # blurred, not misfiled
    twins = [r for r in noise if {r["identity"], r["nearest_identity"]} == {"id2", "id8"}]
    assert not twins  # id2's and id8's faces lie near both: the split explains them
    splits = [(r["identity_a"], r["identity_b"]) for r in tables["split_identities"]]
    assert splits == [("id2", "id8"), ("id4", "id5")]  # the planted one first, then the twin


def test_the_thresholds_are_a_quantile_of_the_same_pairs_and_the_median_of_the_others():
    unit = torch.eye(4)[[0, 0, 1, 1, 2, 3]]  # rows 0-1 and 2-3 equal; 4 and 5 apart
    unit[1] = normalize(unit[1] + torch.tensor([0, 0, 0, 0.5]), dim=0)
    index1, index2 = np.array([0, 2, 4, 0]), np.array([1, 3, 5, 2])
    same = np.array([True, True, True, False])
    genuine = [float((unit[1] - unit[0]).norm()), 0.0, 2**0.5]
    for quantile in (0.25, 0.5, 0.9):
        found, stranger = pair_thresholds(unit, index1, index2, same, quantile)
        assert found == pytest.approx(np.quantile(genuine, quantile))
        assert stranger == pytest.approx(2**0.5)


def test_a_suspect_is_nearer_another_identity_or_as_far_as_a_stranger():
    noise = LabelNoise(
        own=np.array([0.5, 1.5, np.nan, 0.3, 0.8]),
        other=np.zeros(5, dtype=int),
        distance=np.array([0.4, 1.6, 0.1, 0.9, 0.5]),
    )
    assert noise.suspects(stranger=1.2).tolist() == [4, 0, 1]  # margins 0.3, 0.1, -0.1
    assert noise.suspects(stranger=2.0).tolist() == [4, 0]  # a lone image (NaN) never


def test_nearest_is_exact_across_chunks(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    queries, reference = (
        torch.randn(37, 5, generator=generator),
        torch.randn(23, 5, generator=generator),
    )
    monkeypatch.setattr(neighbours, "CHUNK_BYTES", 4 * 23 * 4)  # four queries a chunk
    found, distances = nearest(queries, reference, 3)
    brute = torch.cdist(queries, reference).sort(dim=1)
    assert torch.equal(found, brute.indices[:, :3])
    assert torch.allclose(distances, brute.values[:, :3], atol=1e-5)
    other, distance = nearest_other(reference, reference, torch.arange(23))
    assert not torch.any(other == torch.arange(23))
    assert torch.equal(other, torch.cdist(reference, reference).fill_diagonal_(9e9).argmin(1))


def test_worst_errors_rank_each_kind_by_how_wrong():
    distances = np.array([0.1, 0.9, 0.7, 0.2, 0.3, 0.45, 0.5])
    issame = np.array([1, 1, 1, 0, 0, 0, 1], dtype=bool)
    rejects, accepts = worst_errors(distances, issame, threshold=0.5, count=2)
    assert rejects.tolist() == [1, 2]  # 0.5 is not below the threshold: rejected, third
    assert accepts.tolist() == [3, 4]


def test_the_error_sheet_shows_the_worst_pairs_with_their_lines(planted, tmp_path):
    evaluation = tmp_path / "eval"
    shutil.copytree(planted["root"], evaluation)
    original = read_pairs(planted["pairs"])
    first_same = int(np.flatnonzero(original.issame)[0])
    victim = Path(original.paths2[first_same]).relative_to(planted["root"])
    stranger = np.full((3, 4, 4), 128) + np.arange(16).reshape(4, 4) * 8  # nobody's face
    _save(_face(stranger, np.random.default_rng(1)), evaluation / victim)
    pairs = read_pairs(evaluation / "pairs.txt")
    model, transform = BlockMeans(), block_model().transform()
    with torch.no_grad():
        embed = lambda paths: model(torch.stack([transform(read_image(p)) for p in paths]))
        distances = (embed(pairs.paths1) - embed(pairs.paths2)).norm(dim=1).numpy()
    figure = error_sheet(pairs, distances, 0.5, 3, "euclidean")
    captions = [ax.get_title(loc="left") for ax in figure.axes if ax.get_title(loc="left")]
    named = [
        int(line)
        for line, same, path in zip(pairs.line_numbers, pairs.issame, pairs.paths2)
        if same and Path(path).name == victim.name
    ]
    assert 1 <= len(captions) <= len(named)  # only the stranger's same pairs are wrong
    lines = (evaluation / "pairs.txt").read_text().splitlines()
    for caption in captions:
        assert caption.startswith("false reject: euclidean")
        line = int(caption.split("line ")[1].split(":")[0])
        assert line in named and caption.endswith(" ".join(lines[line - 1].split()))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh, delimiter="\t"))


def test_the_command_reports_every_kind_and_reuses_its_cache(planted, tmp_path, monkeypatch):
    models = []
    monkeypatch.setattr(
        audit_command, "load_model", lambda path: models.append(block_model()) or models[-1]
    )
    out, cache = tmp_path / "out", tmp_path / "cache"
    argv = [
        "--checkpoint",
        "model.pt",
        "--train",
        str(planted["train"]),
        "--pairs",
        str(planted["pairs"]),
    ]
    argv += ["--preprocess", "crop", "--folds", "2", "--out", str(out), "--cache", str(cache)]
    assert audit_command.main(argv) == 0
    used = len(read_pairs(planted["pairs"]).unique_paths()[0])
    assert models[0].model.images_seen == 8 * 6 + 2 + 6 + 4 + 1 + used  # each image once
    assert _rows(out / "duplicates.tsv")[0]["training_image"].endswith("e0_too/copy.png")
    assert _rows(out / "label_noise.tsv")[0]["image"].endswith("id0/wrong.png")
    assert _rows(out / "split_identities.tsv")[0]["identity_b"] == "id8"
    assert _rows(out / "overlap_identities.tsv")[0]["training_identity"] == "e0_too"
    for name in ("overlap", "duplicates", "label_noise", "split_identities"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    figures = summary["verification"]
    assert figures["without_overlap"]["n_pairs"] < figures["all_pairs"]["n_pairs"] == 32
    assert summary["found"]["duplicates"] == 1 and summary["training"]["identities"] == 10
    first = {path.name: path.read_text() for path in out.glob("*.tsv")}
    assert audit_command.main(argv) == 2  # its own outputs are kept unless --overwrite
    assert audit_command.main([*argv, "--overwrite"]) == 0
    assert models[-1].model.images_seen == 0  # both sets read back from --cache
    assert {path.name: path.read_text() for path in out.glob("*.tsv")} == first


def _tamper(path: Path, how: str, trained, planted, cache: Path) -> None:
    """Make the cache file ``path`` hold what was not stored under its name."""
    arrays = dict(np.load(path))
    if how == "another set's file":  # the evaluation images' cache, renamed
        before = set(cache.glob("*.npz"))
        embed_images(
            trained, read_pairs(planted["pairs"]).unique_paths()[0], SETTINGS, "cpu", cache
        )
        [other] = set(cache.glob("*.npz")) - before
        other.replace(path)
        return
    if how == "NaN":
        arrays["embeddings"][:] = np.nan
    elif how == "a row cut":
        arrays["embeddings"] = arrays["embeddings"][:-1]
    elif how == "float64":
        arrays["embeddings"] = arrays["embeddings"].astype(np.float64)
    np.savez(path, **arrays)


@pytest.mark.parametrize("how", ["NaN", "a row cut", "float64", "another set's file"])
def test_a_cache_not_holding_these_embeddings_is_embedded_again_with_a_warning(
    planted, tmp_path, how
):
    trained, cache = block_model(), tmp_path / "cache"
    first = embed_training(trained, planted["train"], SETTINGS, "cpu", cache)
    [path] = cache.glob("*.npz")
    _tamper(path, how, trained, planted, cache)
    seen = trained.model.images_seen
    with pytest.warns(UserWarning, match=f"{path}: .*; embedding again and replacing it"):
        again = embed_training(trained, planted["train"], SETTINGS, "cpu", cache)
    assert trained.model.images_seen > seen  # embedded, not read back
    np.testing.assert_array_equal(again.embeddings, first.embeddings)
    assert again.paths == first.paths and again.labels == first.labels
    seen = trained.model.images_seen
    read_back = embed_training(trained, planted["train"], SETTINGS, "cpu", cache)
    assert trained.model.images_seen == seen  # the replaced cache holds them
    np.testing.assert_array_equal(read_back.embeddings, first.embeddings)
    assert read_back.paths == first.paths and read_back.unreadable == first.unreadable


def test_a_training_folder_of_loose_images_is_refused(planted, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(audit_command, "load_model", lambda path: block_model())
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(planted["train"] / "id0" / "0.png", loose / "a.png")
    argv = ["--checkpoint", "m", "--train", str(loose), "--pairs", str(planted["pairs"])]
    assert audit_command.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert "expected two or more identity folders" in capsys.readouterr().err


def test_evaluate_writes_the_errors_beside_metrics(planted, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate_command, "load_model", lambda path: block_model())
    monkeypatch.setattr(evaluate_command, "run_settings", lambda path: None)  # no run saved
    out = tmp_path / "out"
    argv = ["--checkpoint", "m", "--pairs", str(planted["pairs"]), "--folds", "2"]
    assert evaluate_command.main([*argv, "--show-errors", "2", "--out", str(out)]) == 0
    assert (out / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "metrics.json").is_file()
