"""One set of names for the memory figures: the trainer's epoch record (metrics.jsonl), the
memory report's JSON and the training-step benchmark's JSON name the same figure the same way."""

import contextlib
import io
import json

import pytest
import torch

from benchmarks import bench_training_step, memory_report
from facenet.memory import (
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    MEMORY_KEYS,
    PEAK_RSS_BYTES,
)
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.losses import TripletMarginLoss
from facenet.models.embedding import EmbeddingNet
from facenet.training import logger
from facenet.training.engine import Trainer, TrainerSettings
from facenet.training.step import build_step

# The names the report and the benchmarks used before they took the trainer's.
LEGACY = {
    "graph_peak_bytes",
    "graph_alive_after_bytes",
    "graph_bytes_alive_after_step",
    "rss_peak_bytes",
    "cuda_peak_allocated",
    "cuda_peak_reserved",
    "cuda_peak_allocated_bytes",
    "cuda_peak_reserved_bytes",
}


def all_keys(value) -> set[str]:
    """Every dict key anywhere inside ``value`` (nested dicts and lists)."""
    if isinstance(value, dict):
        return set(value).union(*(all_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(all_keys(v) for v in value))
    return set()


@pytest.fixture(scope="module")
def epoch_record():
    """One epoch of the trainer on two tiny P x K batches, the graph meter on."""
    torch.manual_seed(0)
    model = EmbeddingNet("tiny", embedding_dim=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = build_step(model, BatchHardMiner(), TripletMarginLoss(0.2))
    trainer = Trainer(step, optimizer, settings=TrainerSettings(graph_memory=True))
    labels = torch.arange(4).repeat_interleave(2)  # (8,): P = 4 identities x K = 2
    loader = [(torch.randn(8, 3, 16, 16), labels) for _ in range(2)]  # (8, 3, 16, 16)
    return trainer.train_one_epoch(loader, epoch=0, progress=False)


@pytest.fixture(scope="module")
def report_variant():
    """The two-pass variant of a memory report on a tiny model (no P x K case)."""
    argv = ["--backbone", "tiny", "--image-size", "16", "--batch-size", "2", "--steps", "2"]
    with contextlib.redirect_stdout(io.StringIO()):
        report = memory_report.main([*argv, "--device", "cpu", "--pk", "0"])
    return json.loads(json.dumps(report))["variants"]["two_pass"]  # as the JSON file has it


@pytest.fixture(scope="module")
def benchmark_variant():
    """The two-pass variant of the training-step benchmark, one tiny case, as its JSON has it."""
    case = bench_training_step.Case("tiny", 32, "pk", "semihard", p=4, k=2, repeats=1)
    result = bench_training_step.measure_trainer(case, "two_pass", bench_training_step.PK_MARGIN)
    return json.loads(json.dumps(result))


def test_the_names_are_defined_once_and_the_logger_uses_them():
    assert logger.MEMORY_KEYS is MEMORY_KEYS
    assert len(set(MEMORY_KEYS)) == len(MEMORY_KEYS)


def test_trainer_report_and_benchmark_name_the_graph_figures_alike(
    epoch_record, report_variant, benchmark_variant
):
    for figures in (epoch_record, report_variant, benchmark_variant):
        assert {GRAPH_BYTES_PEAK, GRAPH_BYTES_ALIVE} <= set(figures)
        assert figures[GRAPH_BYTES_ALIVE] == 0  # a corrected step leaves no graph alive
        assert figures[GRAPH_BYTES_PEAK] > 0
    # Peak RSS: in the trainer's record and the benchmark's (a forked child there), not in the
    # report, whose variants share one process.
    assert PEAK_RSS_BYTES in epoch_record and PEAK_RSS_BYTES in benchmark_variant
    assert PEAK_RSS_BYTES not in report_variant


def test_no_memory_figure_goes_by_another_name(epoch_record, report_variant, benchmark_variant):
    for figures in (epoch_record, report_variant, benchmark_variant):
        assert not all_keys(figures) & LEGACY
    memory = {key for key in epoch_record if key in MEMORY_KEYS}
    assert memory <= set(report_variant) | {PEAK_RSS_BYTES}
    assert memory <= set(benchmark_variant)
