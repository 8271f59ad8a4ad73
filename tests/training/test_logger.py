"""The run logger's CUDA figures: the maximum over the ranks."""

import json

import pytest
import torch
import torch.distributed as dist

from facenet.training import logger
from facenet.training.logger import RunLogger, max_over_ranks


@pytest.fixture
def two_ranks(monkeypatch):
    """A one-process gloo group taken for two; the other rank's CUDA peaks (7, 2) stood in
    for by the all-reduce."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(logger, "is_distributed", lambda: True)
    other = torch.tensor([7, 2])
    monkeypatch.setattr(dist, "all_reduce", lambda values, op: values.copy_(values.max(other)))
    yield
    dist.destroy_process_group()


def test_cuda_figures_are_the_maximum_over_ranks(two_ranks):
    mine = {"peak_rss_bytes": 1, "cuda_max_allocated": 3, "cuda_max_reserved": 4}
    want = {"peak_rss_bytes": 1, "cuda_max_allocated": 7, "cuda_max_reserved": 4}
    assert max_over_ranks(mine) == want  # RSS stays each process's own
    assert max_over_ranks({"peak_rss_bytes": 1}) == {"peak_rss_bytes": 1}


def test_the_epoch_line_carries_the_maximum(two_ranks, tmp_path):
    record = {"epoch": 1, "cuda_max_allocated": 3, "cuda_max_reserved": 4}
    RunLogger(tmp_path, tensorboard=False).log_epoch(record)
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["cuda_max_allocated"] == 7 and record["cuda_max_reserved"] == 4


def test_one_process_logs_its_own_figures(tmp_path):
    record = {"epoch": 1, "cuda_max_allocated": 3}
    RunLogger(tmp_path, tensorboard=False).log_epoch(record)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["cuda_max_allocated"] == 3
