"""benchmarks.bench_finetune: the people split in two disjoint, seeded halves with the test
pairs drawn from the test half only, and a person's face found once, in the reference image,
placing every image of that person."""

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks import bench_finetune as bench
from facenet.data.pairs import read_pairs

pytest.importorskip("facenet_pytorch")


def _faces(root: Path, people: int, images: int, size=(24, 28)) -> None:
    rng = np.random.default_rng(0)
    for p in range(people):
        for i in range(images):
            path = root / f"p{p:02d}" / f"p{p:02d}_{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)).save(path)


def _args(tmp_path, split_seed=0):
    class Args:
        work = tmp_path / "work"
        data = tmp_path / "data"

    Args.split_seed = split_seed
    return Args


def test_the_people_split_in_disjoint_seeded_halves_and_pairs_name_test_people(tmp_path):
    model, domain = bench.MODELS["mobilefacenet"], bench.Domain("tiny", 6, test_people=20)
    crops = tmp_path / "work" / model.preset / "tiny" / "all"  # as if aligned already
    _faces(crops, people=26, images=3)
    folder = bench.prepare(_args(tmp_path), model, domain)
    train = {p.name for p in (folder / "train").iterdir()}
    test = {p.name for p in (folder / "test").iterdir()}
    assert len(train) == 6 and len(test) == 20 and not train & test
    assert train | test == {p.name for p in crops.iterdir()}
    pairs = read_pairs(folder / "test_pairs.txt", folder / "test")
    named = {Path(path).parent.name for path in pairs.paths1 + pairs.paths2}
    assert named == test
    other = tmp_path / "seed1" / "work" / model.preset / "tiny" / "all"
    _faces(other, people=26, images=3)
    drawn = bench.prepare(_args(tmp_path / "seed1", split_seed=1), model, domain)
    assert {p.name for p in (drawn / "train").iterdir()} != train


def test_the_reference_images_face_places_every_image_of_its_person(tmp_path, monkeypatch):
    from facenet.wings.align import aligner as aligner_module

    _faces(tmp_path / "src", people=2, images=3)
    for person in ("p00", "p01"):  # each person's image 1 is the reference
        ref = tmp_path / "src" / person / f"{person}_1.png"
        ref.rename(ref.with_name(f"{person}_1_REF.png"))
    searched, landmarks = [], np.array([[20, 24], [32, 24], [26, 30], [21, 36], [31, 36.0]])

    def detect(self, images):
        searched.append(np.asarray(images[0]))
        return [aligner_module.Face((0, 0, 1, 1), 0.99, landmarks + len(searched))]

    monkeypatch.setattr(aligner_module.Aligner, "detect", detect)
    bench.align_by_reference(tmp_path / "src", tmp_path / "dst", "sphereface", "_REF")
    assert len(searched) == 2  # once a person, on the padded reference image
    for k, person in enumerate(("p00", "p01"), start=1):
        reference = bench._padded(tmp_path / "src" / person / f"{person}_1_REF.png")
        np.testing.assert_array_equal(searched[k - 1], np.asarray(reference))
        for source in sorted((tmp_path / "src" / person).iterdir()):
            crop = np.asarray(Image.open(tmp_path / "dst" / person / f"{source.stem}.png"))
            expected = aligner_module.align_face(bench._padded(source), landmarks + k, "sphereface")
            np.testing.assert_array_equal(crop, expected)


@pytest.mark.parametrize("name", sorted(bench.MODELS))
def test_each_recipe_tests_with_its_models_evaluation(name):
    """The "after" figures are the run's own test: its protocol must be the "before" one."""
    from facenet.config import load_config
    from facenet.evaluation.presets import VerifySettings

    model = bench.MODELS[name]
    recipe, evaluation = (
        load_config(bench.REPO / path) for path in (model.recipe, model.evaluation)
    )
    ignore = {"batch_size", "num_workers", "skip_missing"}  # how, not what, it measures
    recipe_s, evaluation_s = (
        {k: v for k, v in vars(VerifySettings.of(cfg.eval)).items() if k not in ignore}
        for cfg in (recipe, evaluation)
    )
    assert recipe_s == evaluation_s
    assert recipe.data.image_size == evaluation.data.image_size
