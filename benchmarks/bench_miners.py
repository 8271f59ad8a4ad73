"""Triplet mining on CPU: facenet.metric.miners against pytorch-metric-learning (PML) 2.9.0.

For B in {256, ..., 2048} embeddings (D = 128, L2-normalised identity centres plus noise of norm
~2: ~21% of valid triplets inside the 0.2 margin, an early-training regime) from 16 or 64
identities, and each triplet type, the median time and peak memory of one mining call of each
library, same inputs, squared Euclidean distance; the triplet counts are compared. Peak memory:
each (library, case) runs in a fresh forked child, which warms up on a 32-image slice, resets
the kernel's high-water mark (/proc/self/clear_refs) and reports VmHWM - VmRSS around one
call. PML cases estimated above 8 GB (or 70% of the memory available) are skipped.

    python -m benchmarks.bench_miners [--quick] [--json miners.json]
"""

from __future__ import annotations

import re
import statistics
import sys

import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import miners as pml_miners

from benchmarks.forking import run_forked
from benchmarks.measure import benchmark_parser, run_benchmark, show, timed
from facenet.errors import FacenetError
from facenet.metric.batch_hard_miner import BatchHardMiner
from facenet.metric.miners import SemiHardNegativeMiner
from facenet.metric.triplet_margin_miner import TripletMarginMiner

MARGIN = 0.2
DIM = 128
MINERS = ("all", "semihard", "hard", "batch_hard", "facenet_semihard")
NOISE = 2.0
MAX_PML_BYTES = 8e9


def make_batch(batch_size: int, identities: int, noise: float, seed: int = 0):
    """Normalised embeddings (B, D) of ``identities`` clusters, and their labels (B,)."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.nn.functional.normalize(torch.randn(identities, DIM, generator=gen), dim=1)
    labels = torch.arange(batch_size) % identities
    jitter = noise * torch.randn(batch_size, DIM, generator=gen) / DIM**0.5
    return torch.nn.functional.normalize(centers[labels] + jitter, dim=1), labels


def build(library: str, miner: str):
    """The miner of one library for one row of the table."""
    if library == "ours":
        if miner == "batch_hard":
            return BatchHardMiner(distance="squared")
        if miner == "facenet_semihard":
            return SemiHardNegativeMiner(MARGIN, "squared", generator=torch.Generator())
        return TripletMarginMiner(MARGIN, miner, distance="squared")
    distance = pml_distances.LpDistance(normalize_embeddings=False, power=2)
    if miner == "batch_hard":
        return pml_miners.BatchHardMiner(distance=distance)
    return pml_miners.TripletMarginMiner(MARGIN, miner, distance=distance)


def pml_peak_estimate(batch_size: int, identities: int, miner: str) -> float:
    """Bytes PML's miner needs, from its algorithm (get_all_triplets_indices).

    Batch-hard: three B x B float64 matrices. Below 2^31 mask elements it builds a B x B x B
    uint8 mask and lists its non-zeros (24 bytes per valid triplet); above, it lists them
    anchor by anchor and concatenates (48 bytes per triplet during torch.cat). Distances and
    conditions add ~13 bytes per triplet.
    """
    if miner == "batch_hard":
        return 3 * batch_size**2 * 8
    per_identity = batch_size // identities
    valid = batch_size * (per_identity - 1) * (batch_size - per_identity)
    if batch_size**3 < 2**31 - 1:
        return batch_size**3 + 24 * valid
    return 48 * valid + 13 * valid


def _proc_bytes(path: str, field: str) -> int:
    with open(path) as fh:
        return int(re.search(field + r":\s+(\d+) kB", fh.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure_in_child(library: str, miner: str, case: dict, time_budget: float) -> dict:
    """Run one (library, case) in this (forked) process: peak memory, then timed repeats."""
    embeddings, labels = make_batch(case["batch"], case["identities"], case["noise"])
    mine = build(library, miner)
    # Warm up on a slice: libraries' one-time setup (thread pool, BLAS buffers) is not mining.
    mine(embeddings[:32], labels[:32])
    before = _proc_bytes("/proc/self/status", "VmRSS")
    _reset_peak()
    cold, triplets = timed("cpu", lambda: mine(embeddings, labels))
    count = len(triplets[0])
    peak = _proc_bytes("/proc/self/status", "VmHWM") - before
    times = []
    while not times or (sum(times) + cold < time_budget and len(times) < 5):
        times.append(timed("cpu", lambda: mine(embeddings, labels))[0])
    return {
        "seconds": statistics.median(times),
        "runs": len(times),
        "first_call_seconds": cold,
        "peak_bytes": peak,
        "triplets": count,
        "index_bytes": 24 * count,  # the returned (a, p, n) int64 tensors
        "working_bytes": peak - 24 * count,  # peak beside the returned indices
    }


def compare_counts(ours: int, pml: int) -> str:
    """A note when the two libraries mined different numbers of triplets.

    In float32 the two compute distances with different rounding (Gram expansion vs
    cdist then squaring), so a few triplets within ~1e-6 of the margin can fall either way;
    on float64 inputs the sets are equal (tests/metric/test_miners.py).
    """
    if ours == pml:
        return ""
    if abs(ours - pml) <= max(10, 1e-4 * pml):
        return f"counts differ by {ours - pml:+d} (float32 rounding at the margin)"
    return f"TRIPLET COUNTS DIFFER: ours {ours}, PML {pml}"


def run_case(case: dict, miner: str, time_budget: float, pml_limit: float) -> dict:
    """One row: ours and, where it fits in memory, PML, each in a forked child."""
    ours = run_forked(measure_in_child, "ours", miner, case, time_budget)
    row, pml = {**case, "miner": miner, "ours": ours, "pml": None, "note": ""}, {}
    estimate = pml_peak_estimate(case["batch"], case["identities"], miner)
    if "error" in ours:
        row["note"] = "ours failed: " + ours["error"]
    elif miner == "facenet_semihard":
        row["note"] = "one negative per pair; PML has no such miner"
    elif estimate > pml_limit:
        row["note"] = f"PML skipped: needs ~{estimate / 1e9:.1f} GB > {pml_limit / 1e9:.1f} GB"
        row["pml_skipped_estimate_bytes"] = estimate
    else:
        pml = row["pml"] = run_forked(measure_in_child, "pml", miner, case, time_budget)
        if "error" in pml:
            row["note"] = "PML failed: " + pml["error"]
        else:
            row["note"] = compare_counts(ours["triplets"], pml["triplets"])
    for key, figure in (("speedup", "seconds"), ("memory_ratio", "peak_bytes")):
        mine, theirs = ours.get(figure), pml.get(figure)
        row[key] = theirs / mine if mine and theirs is not None else None
    return row


def measure(args) -> dict:
    """Every (B, identities, miner) row."""
    try:
        _reset_peak()
    except OSError as err:
        raise FacenetError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only") from err
    batches = (256, 512) if args.quick else (256, 512, 1024, 2048)
    identity_counts = (16,) if args.quick else (16, 64)
    available = _proc_bytes("/proc/meminfo", "MemAvailable")
    pml_limit = min(MAX_PML_BYTES, 0.7 * available)
    time_budget = 0.2 if args.quick else 2.0  # seconds of timed repeats per case
    report = {"dim": DIM, "margin": MARGIN, "noise": NOISE}
    report["memory_method"] = "forked process per case; VmHWM after clear_refs minus VmRSS"
    rows = report["rows"] = []
    for batch in batches:
        for identities in identity_counts:
            case = {"batch": batch, "identities": identities, "noise": NOISE}
            for miner in MINERS:
                rows.append(run_case(case, miner, time_budget, pml_limit))
                show(rows[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--quick``: B in {256, 512}, 16 identities)."""
    return run_benchmark(benchmark_parser(__doc__), argv, measure)


if __name__ == "__main__":
    sys.exit(main())
