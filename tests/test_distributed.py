"""Multi-process training: 2 ranks equal autograd through their stated forward, in float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ddp_worker  # noqa: E402
from step_reference import reference_training  # noqa: E402

from facenet.distributed import all_gather_tensor, gather_variable_rows  # noqa: E402
from facenet.losses import TripletMarginLoss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def torchrun(nproc, *args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def write_pairs_folder(root):
    """Five identities of three 16 px images and an LFW-style pairs.txt (odd image count)."""
    from facenet.data.pairs import generate_pairs, write_pairs
    from facenet.data.synthetic import SyntheticIdentities

    written = SyntheticIdentities(5, 3, image_size=16, seed=1).write_to_disk(root)
    write_pairs(root / "pairs.txt", generate_pairs(written, n_folds=2, pairs_per_fold=3, seed=0))
    return root / "pairs.txt"


@pytest.fixture(scope="module")
def pairs_path(tmp_path_factory):
    return write_pairs_folder(tmp_path_factory.mktemp("pairs"))


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory, pairs_path):
    out = tmp_path_factory.mktemp("ddp") / "params.pt"
    proc = torchrun(2, "tests/ddp_worker.py", str(out), str(pairs_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("case", ddp_worker.CASES, ids=lambda case: "|".join(map(str, case)))
def test_two_ranks_equal_autograd_through_per_rank_forwards(two_rank_results, case):
    """Each rank is its own BatchNorm batch (standard DDP); the averaged update equals one
    process forwarding each rank's part separately with autograd end to end."""
    path, miner, ce, chunk = case
    initial = ddp_worker.initial_model(ce)
    start = {k: v.clone() for k, v in initial.state_dict().items()}
    want = reference_training(
        initial,
        ddp_worker.batches(),
        path,
        ddp_worker.MINERS[miner](),
        TripletMarginLoss(margin=ddp_worker.MARGIN),
        ddp_worker.LR,
        world=2,
        chunk=chunk,
        ce=ce,
    )
    got = two_rank_results["|".join(map(str, case))]
    # Relative to the largest update (a conv bias before BatchNorm has a zero gradient).
    update = max((want[name] - start[name]).abs().max() for name, _ in initial.named_parameters())
    assert update > 1e-3
    for name, _ in initial.named_parameters():
        error = (got[name] - want[name]).abs().max()
        assert error <= 1e-8 * update, f"{name}: {error:.3e} > 1e-8 x {update:.3e}"


@pytest.mark.parametrize("passes, chunk", ddp_worker.NAN_CASES)
def test_nan_images_on_one_rank_stop_every_rank(two_rank_results, passes, chunk):
    seen = two_rank_results["nan_on_rank_one"][f"{passes}|{chunk}"]
    assert seen == ["raised rows=[]", "raised rows=[3]"]


def test_sharded_evaluation_embeds_every_image_once_in_order(two_rank_results, pairs_path):
    emb1, emb2 = ddp_worker.embed_pairs(pairs_path)
    got1, got2 = two_rank_results["pairs"]
    assert got1.shape == emb1.shape and emb1.shape[0] == 12
    torch.testing.assert_close(got1, emb1)
    torch.testing.assert_close(got2, emb2)


def test_gathers_are_identity_for_one_process():
    x = torch.arange(6.0).reshape(3, 2)
    assert all_gather_tensor(x) is x
    assert gather_variable_rows(x)[0] is x


TINY_DEMO = [
    "data.synthetic_identities=8",
    "data.synthetic_images_per_identity=4",
    "data.synthetic_heldout_identities=10",
    "data.synthetic_pairs_per_fold=6",
    "data.image_size=32",
    "data.p=2",
    "data.k=2",
    "train.epochs=2",
    "train.steps_per_epoch=2",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def test_torchrun_demo_ends_cleanly_with_one_checkpoint_and_one_log(tmp_path):
    out = tmp_path / "run"
    settings = [*TINY_DEMO, f"data.root={tmp_path / 'data'}"]
    sets = [arg for item in settings for arg in ("--set", item)]
    proc = torchrun(
        2, "scripts/train.py", "--config", "configs/demo.yaml", "--out", str(out), *sets
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("run directory:") == 1  # rank 0 alone prints
    assert proc.stdout.count("test (last model") == 1
    assert sorted(p.name for p in out.glob("*.pt")) == ["best.pt", "last.pt"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    state = torch.load(out / "last.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])  # saved unwrapped
    assert not list(out.glob(".*.tmp"))


def test_triplet_list_batches_are_split_between_ranks():
    from facenet.builders import _batch_loader
    from facenet.config import load_config

    class Faces(torch.utils.data.Dataset):
        targets = [i // 3 for i in range(30)]

        def __len__(self):
            return 30

        def __getitem__(self, index):
            return torch.zeros(1), self.targets[index]

    cfg = load_config(
        None, ["data.dataset=triplets", "data.triplets_per_epoch=40", "data.triplet_batch_size=4"]
    )
    per_rank = [list(_batch_loader(cfg, Faces(), rank, 2)[0].batch_sampler) for rank in (0, 1)]
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    seen = [{i for batch in batches for i in batch} for batches in per_rank]
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 40
