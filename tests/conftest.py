"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one intra-op thread.

    Two threads on two shared cores spin-wait: a tiny model runs ~20x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TINY_RUN_SETTINGS = [
    "data.synthetic_identities=8",
    "data.synthetic_images_per_identity=4",
    "data.synthetic_heldout_identities=10",
    "data.synthetic_pairs_per_fold=6",
    "data.image_size=32",
    "data.p=2",
    "data.k=2",
    "train.epochs=1",
    "train.steps_per_epoch=2",
    "train.device=cpu",
    "logging.progress=false",
    "logging.tensorboard=false",
]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A run of configs/demo.yaml cut to two steps: its checkpoint and held-out identities.

    Returns ``{"run", "checkpoint", "heldout", "pairs"}`` (paths); about 4 s on 2 cores.
    """
    from pathlib import Path

    from facenet.cli import train as train_script

    root = Path(__file__).resolve().parents[1]

    base = tmp_path_factory.mktemp("tiny_run")
    argv = ["--config", str(root / "configs" / "demo.yaml"), "--out", str(base / "run")]
    for setting in [*TINY_RUN_SETTINGS, f"data.root={base / 'data'}"]:
        argv += ["--set", setting]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_script.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    heldout = base / "data" / "heldout"
    return {
        "run": base / "run",
        "checkpoint": base / "run" / "best.pt",
        "heldout": heldout,
        "pairs": sorted(heldout.glob("*pairs.txt"))[-1],  # test_pairs.txt, or pairs.txt
    }
