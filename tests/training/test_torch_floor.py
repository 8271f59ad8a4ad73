"""The code runs on the torch floor pyproject.toml declares: where an API is newer than the
floor, the older signature's stand-in (monkeypatched) gives the same result."""

import re
from pathlib import Path

import pytest
import torch

from facenet.config import load_config
from facenet.errors import FacenetError
from facenet.training import build, run
from facenet.training.engine import total_norm

ROOT = Path(__file__).resolve().parents[2]


def declared_floor(name: str) -> tuple[int, int]:
    """(major, minor) of ``"name>=X.Y"`` in pyproject.toml's dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    ((major, minor),) = re.findall(rf'"{name}>=(\d+)\.(\d+)', text)
    return int(major), int(minor)


def test_the_floor_includes_the_torch_clusters_run():
    # Clusters run 2.4 .. 2.12, the GPU machines that measure 2.11. The floor is 2.5:
    # facenet.checkpoint reads torch.serialization.get_unsafe_globals_in_checkpoint (2.5).
    # torch.amp.GradScaler(device) needs 2.3: below the floor, no stand-in.
    assert (2, 3) <= declared_floor("torch") <= (2, 5)
    assert hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint")
    assert declared_floor("torchvision") <= (0, 20)  # torchvision 0.20 pairs with torch 2.5


def test_total_norm_without_get_total_norm_matches_it(monkeypatch):
    tensors = [torch.randn(3, 4), torch.randn(7), torch.tensor([float("inf")])]
    want = [torch.nn.utils.get_total_norm(t) for t in (tensors[:2], tensors)]
    monkeypatch.delattr(torch.nn.utils, "get_total_norm")  # torch < 2.6
    got = [total_norm(t) for t in (tensors[:2], tensors)]
    torch.testing.assert_close(got[0], want[0])
    assert got[1].isinf() and want[1].isinf()


class DDPBefore213:
    """DistributedDataParallel's keywords before torch 2.13 (no forward_sync_buffers)."""

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True):
        self.module, self.broadcast_buffers = module, broadcast_buffers

    def __getattr__(self, name):
        return getattr(self.__dict__["module"], name)

    def parameters(self):
        return self.module.parameters()


def test_ddp_is_built_with_keywords_older_torch_accepts(monkeypatch):
    synced = []
    monkeypatch.setattr(build, "DistributedDataParallel", DDPBefore213)
    monkeypatch.setattr(build, "is_distributed", lambda: True)
    monkeypatch.setattr(build, "broadcast_buffers", lambda module: synced.append(module))
    cfg = load_config(None, ["model.backbone=tiny", "train.device=cpu"])
    trainer = build.build_trainer(cfg, None, torch.device("cpu"), steps_per_epoch=1)
    assert isinstance(trainer.model, DDPBefore213)
    # Buffers synced once before wrapping, never in DDP's forward.
    assert synced == [trainer.model.module] and trainer.model.broadcast_buffers is False


def test_the_process_group_timeout_comes_from_the_configuration(monkeypatch, tmp_path):
    seen = []

    def init_distributed(device, timeout_minutes):
        seen.append((device, timeout_minutes))
        raise FacenetError("no CUDA here")

    monkeypatch.setattr(run, "init_distributed", init_distributed)
    cfg = load_config(None, ["train.dist_timeout_minutes=90", f"logging.out_dir={tmp_path}"])
    assert run.run_training(cfg) == run.EXIT_BAD_INPUT
    assert seen == [("auto", 90.0)]


@pytest.mark.parametrize("value", ["0", "20000"])
def test_the_timeout_range_is_checked_once(value):
    with pytest.raises(FacenetError, match="train.dist_timeout_minutes"):
        load_config(None, [f"train.dist_timeout_minutes={value}"])
