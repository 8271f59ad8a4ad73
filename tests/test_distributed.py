"""Multi-process training: 2 ranks equal autograd through their stated forward, in float64."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ddp_worker
import pytest
import torch
from step_reference import reference_training

from facenet.cli import train as train_script
from facenet.distributed import all_gather_tensor, gather_variable_rows
from facenet.metric.losses import TripletMarginLoss

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict:
    """The environment of a worker process: one intra-op thread, and the repository root and
    tests/ importable (tests/ddp_*.py import the package and tests' helpers without sys.path
    edits; pytest's own pythonpath setting does not reach a subprocess)."""
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    pythonpath = os.pathsep.join(path for path in paths if path)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, **extra}


def torchrun(nproc, *args, timeout=240, env=None):
    env = subprocess_env(**(env or {}))
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
    from facenet.wings.demo.synthetic import SyntheticIdentities

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
    assert proc.stdout.count("run directory:") == proc.stdout.count("validation: accuracy") == 1
    assert sorted(p.name for p in out.glob("*.pt")) == ["best.pt", "last.pt"]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    state = torch.load(out / "last.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])  # saved unwrapped
    assert not list(out.glob(".*.tmp"))


def test_triplet_list_batches_are_split_between_ranks():
    from facenet.config import load_config
    from facenet.training.build import _batch_loader

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


# --------------------------------------------------------------------------- resume, faults

RESUME_RUN = [
    "data.synthetic_identities=8",
    "data.synthetic_images_per_identity=4",
    "data.synthetic_heldout_identities=10",
    "data.synthetic_pairs_per_fold=6",
    "data.image_size=16",
    "data.p=2",
    "data.k=2",
    "train.epochs=2",
    "train.steps_per_epoch=4",
    "train.deterministic=true",
    "model.dropout=0.2",  # the model draws random numbers too
    "eval.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def train_ranks(out, data_root, *settings, fault=None, flags=(), nproc=2):
    sets = [
        arg
        for item in [*RESUME_RUN, f"data.root={data_root}", *settings]
        for arg in ("--set", item)
    ]
    env = {"FACENET_TEST_FAULT": fault} if fault else {}
    return torchrun(
        nproc,
        "tests/ddp_train.py",
        "--config",
        "configs/demo.yaml",
        "--out",
        str(out),
        *sets,
        *flags,
        env=env,
    )


def parameters(run_dir):
    return torch.load(run_dir / "last.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp_resume")
    runs = {}
    for workers in (0, 2):
        proc = train_ranks(base / f"run{workers}", base / "data", f"data.num_workers={workers}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[workers] = parameters(base / f"run{workers}")
    return base, runs


@pytest.mark.parametrize(
    "workers, stop_after",
    [
        (0, 6),
        pytest.param(2, 4, marks=pytest.mark.slow),
        pytest.param(0, 4, marks=pytest.mark.slow),
    ],
    ids=["no-workers-mid-epoch", "2-workers-epoch-boundary", "no-workers-epoch-boundary"],
)
def test_sigterm_to_one_worker_then_resume_is_bit_exact(
    uninterrupted, tmp_path, workers, stop_after
):
    base, runs = uninterrupted
    out = tmp_path / "run"
    setting = f"data.num_workers={workers}"
    proc = train_ranks(out, base / "data", setting, fault=f"1:{stop_after}:sigterm")
    assert proc.returncode != 0  # the agent reports the workers' 143
    assert proc.stderr.count("stopped by SIGTERM") == 1  # rank 0 alone reports it
    state = torch.load(out / "last.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    proc = train_ranks(out, base / "data", setting, flags=["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = parameters(out)
    for name, value in runs[workers].items():
        assert torch.equal(resumed[name], value), name


def test_a_corrupt_image_on_one_rank_stops_both_with_one_message(uninterrupted, tmp_path):
    base, _ = uninterrupted
    out = tmp_path / "run"
    proc = train_ranks(out, base / "data", fault="1:9:corrupt", nproc=2)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]  # rank 0 alone reports it
    assert "rank 1: corrupt or unreadable image faces/injected.png" in errors[0]
    assert "checkpoint written to" in errors[0] and "--resume continues with step" in errors[0]
    # No worker traceback (torchrun's agent prints its own ChildFailedError summary).
    assert not [line for line in proc.stderr.splitlines() if "facenet" in line and "File" in line]
    assert torch.load(out / "last.pt", weights_only=True)["partial"] is not None


def test_resuming_with_another_world_size_is_refused(uninterrupted, tmp_path, capsys):
    import shutil

    base, _ = uninterrupted
    out = tmp_path / "run"
    shutil.copytree(base / "run0", out)
    sets = [arg for item in [*RESUME_RUN, f"data.root={base / 'data'}"] for arg in ("--set", item)]
    argv = ["--config", "configs/demo.yaml", "--out", str(out), *sets, "--resume"]
    code = train_script.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "written by a run of 2 process(es) and this run has 1" in err


def start_agents(out, data_root, *settings, nodes=2, port=29617, flags=()):
    """``nodes`` torchrun agents of one process each, meeting by c10d on localhost."""
    sets = [
        arg
        for item in [*RESUME_RUN, f"data.root={data_root}", *settings]
        for arg in ("--set", item)
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=localhost:{port}",
        f"--rdzv_id={out.name}",
        "tests/ddp_train.py",
        "--config",
        "configs/demo.yaml",
        "--out",
        str(out),
        *sets,
        *flags,
    ]
    env = subprocess_env()
    return [
        subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(nodes)
    ]


@pytest.mark.slow
def test_two_agents_on_one_machine_train_and_resume(uninterrupted, tmp_path):
    base, _ = uninterrupted
    out = tmp_path / "run"
    agents = start_agents(out, base / "data", "train.epochs=1", "optim.schedule=none")
    assert [agent.wait(timeout=300) for agent in agents] == [0, 0]
    assert torch.load(out / "last.pt", weights_only=True)["world_size"] == 2
    agents = start_agents(
        out,
        base / "data",
        "train.epochs=2",
        "optim.schedule=none",
        port=29618,
        flags=["--resume"],
    )
    assert [agent.wait(timeout=300) for agent in agents] == [0, 0]
    resumed = torch.load(out / "last.pt", weights_only=True)
    assert resumed["epoch"] == 2 and resumed["world_size"] == 2


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_after_the_step(uninterrupted, tmp_path):
    import signal
    import time

    base, runs = uninterrupted
    out = tmp_path / "run"
    sets = [
        arg
        for item in [
            *RESUME_RUN,
            f"data.root={base / 'data'}",
            "train.epochs=200",
            "optim.schedule=none",
        ]
        for arg in ("--set", item)
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "tests/ddp_train.py",
        "--config",
        "configs/demo.yaml",
        "--out",
        str(out),
        *sets,
    ]
    agent = subprocess.Popen(
        command,
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not (out / "last.pt").exists():
        time.sleep(0.2)
    started = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    _, err = agent.communicate(timeout=120)
    assert time.monotonic() - started < 30
    assert agent.returncode == 1  # torchrun's own code on SIGTERM; the workers exit 143
    assert err.count("stopped by SIGTERM") == 1
    state = torch.load(out / "last.pt", weights_only=True)
    assert state["world_size"] == 2 and 1 <= state["epoch"] < 200


def test_sharded_validation_reports_best_pt_as_one_process_would(uninterrupted, tmp_path):
    """Ranks' BatchNorm running statistics drift apart; evaluation uses rank 0's (best.pt's)."""
    from facenet.config import load_config
    from facenet.data.pairs import read_pairs
    from facenet.evaluation.embedding import embed_pair_list
    from facenet.evaluation.protocol import evaluate_embeddings
    from facenet.models.embedding import build_model

    base, _ = uninterrupted
    out = tmp_path / "run"
    proc = train_ranks(out, base / "data", "eval.every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    cfg = load_config(out / "config.yaml")
    state = torch.load(out / "best.pt", weights_only=True)
    model = build_model(cfg.model, num_classes=state["model"]["classifier.weight"].shape[0])
    model.load_state_dict(state["model"])
    pairs = read_pairs(base / "data" / "heldout" / "val_pairs.txt")
    emb1, emb2 = embed_pair_list(model, pairs, image_size=16)
    result = evaluate_embeddings(emb1.numpy(), emb2.numpy(), pairs.issame, folds=pairs.fold_ids)
    best = summary["best_validation"]
    assert best["accuracy_mean"] == pytest.approx(result.accuracy_mean, abs=1e-9)
    assert best["threshold"] == pytest.approx(result.threshold, abs=1e-9)


def test_a_name_the_run_may_not_write_stops_every_rank_with_one_message(tmp_path):
    """Rank 0 refuses the name before anything is written; no rank waits for it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("mine")
    settings = [*TINY_DEMO, f"data.root={tmp_path / 'data'}"]
    sets = [arg for item in settings for arg in ("--set", item)]
    proc = torchrun(
        2, "scripts/train.py", "--config", "configs/demo.yaml", "--out", str(out), *sets
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "summary.json exists" in errors[0], proc.stderr[-3000:]
    assert (out / "summary.json").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def _stand_in_gpus(monkeypatch, count: int) -> list:
    """torch.cuda as a machine with ``count`` GPUs; returns the devices set_device was given."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_a_device_past_the_visible_ones_is_refused_at_start(monkeypatch):
    from facenet.distributed import resolve_device
    from facenet.errors import FacenetError

    _stand_in_gpus(monkeypatch, 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(FacenetError, match=r"'cuda:2': 2 CUDA device\(s\) visible \(cuda:0..1\)"):
        resolve_device("cuda:2")


def test_one_process_on_a_gpu_makes_it_the_current_device(monkeypatch):
    from facenet.distributed import init_distributed

    chosen = _stand_in_gpus(monkeypatch, 4)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    info = init_distributed("cuda:3")
    assert info.device == torch.device("cuda", 3) and chosen == [torch.device("cuda", 3)]
