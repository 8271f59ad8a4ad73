"""Triplet mining on CPU: facenet.metric.miners against pytorch-metric-learning (PML) 2.9.0.

For B in {256, 512, 1024, 2048} images of D = 128 dimensions from 16 or 64 identities, and
for the triplet types "all", "semihard", "hard" (TripletMarginMiner) and batch-hard, this
measures the median wall time and the peak memory of one mining call of each library, and
prints their ratios. Both libraries see the same embeddings, the same labels and the squared
Euclidean distance (PML: LpDistance(normalize_embeddings=False, power=2)), and the benchmark
checks they return the same number of triplets.

Embeddings: L2-normalised identity centres plus Gaussian noise of norm ~``--noise``, then
normalised again. The default (2.0) gives ~21% of valid triplets inside the 0.2 margin, an
early-training regime; the output of "all" then holds millions of triplets.

Peak memory, the method: every (library, case) runs in a fresh process forked from this one
(libraries imported, no tensor work done yet). The child builds the inputs, reads its
resident set size (VmRSS), resets the kernel's high-water mark (writing 5 to
/proc/self/clear_refs), runs the miner once, and reads the high-water mark (VmHWM). Peak =
VmHWM - VmRSS before the call: every page the call made resident, whatever allocated it. A
fresh process per case means no memory freed by an earlier case is silently reused; only what
the child freed while building its inputs (a few MB) could be. The timed repetitions follow
in the same child; the measured first call is not among them. Each child first mines a
32-image slice, so one-time library setup (thread pool, BLAS buffers) is not counted.

A PML case whose estimated peak exceeds ``--max-pml-gb`` (default 8) or 70% of the memory
available is skipped, and the table says so.

    python -m benchmarks.bench_miners --quick          # seconds
    python -m benchmarks.bench_miners --json out.json  # the full table, ~3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from pytorch_metric_learning import distances as pml_distances
from pytorch_metric_learning import miners as pml_miners

from benchmarks import forking
from benchmarks.measure import write_report
from facenet.metric.miners import BatchHardMiner, SemiHardNegativeMiner, TripletMarginMiner

MARGIN = 0.2
DIM = 128
MINERS = ("all", "semihard", "hard", "batch_hard", "facenet_semihard")


# --------------------------------------------------------------------------- inputs, miners


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


def pml_peak_estimate(batch_size: int, identities: int) -> float:
    """Bytes PML's TripletMarginMiner needs, from its algorithm (get_all_triplets_indices).

    Below 2^31 mask elements it builds a B x B x B uint8 mask and lists its non-zeros (24 bytes
    per valid triplet); above, it lists them anchor by anchor and concatenates (48 bytes per
    triplet during torch.cat). Distances and conditions add ~13 bytes per triplet.
    """
    per_identity = batch_size // identities
    valid = batch_size * (per_identity - 1) * (batch_size - per_identity)
    if batch_size**3 < 2**31 - 1:
        return batch_size**3 + 24 * valid
    return 48 * valid + 13 * valid


# --------------------------------------------------------------------------- measurement


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        match = re.search(field + r":\s+(\d+) kB", fh.read())
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def measure_in_child(library: str, miner: str, case: dict, time_budget: float) -> dict:
    """Run one (library, case) in this (forked) process: peak memory, then timed repeats."""
    embeddings, labels = make_batch(case["batch"], case["identities"], case["noise"])
    mine = build(library, miner)
    # Warm up on a slice: libraries' one-time setup (thread pool, BLAS buffers) is not mining.
    mine(embeddings[:32], labels[:32])
    before = _status_bytes("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    triplets = mine(embeddings, labels)
    cold = time.perf_counter() - start
    peak = _status_bytes("VmHWM") - before
    count = len(triplets[0])
    del triplets
    times = []
    while not times or (sum(times) + cold < time_budget and len(times) < 5):
        start = time.perf_counter()
        mine(embeddings, labels)
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "runs": len(times),
        "first_call_seconds": cold,
        "peak_bytes": peak,
        "triplets": count,
        "index_bytes": 24 * count,  # the returned (a, p, n) int64 tensors
        "working_bytes": peak - 24 * count,  # peak beside the returned indices
    }


def run_forked(library: str, miner: str, case: dict, time_budget: float) -> dict:
    """``measure_in_child`` in a fresh forked process; its result comes back through a pipe."""
    return forking.run_forked(measure_in_child, library, miner, case, time_budget)


def available_bytes() -> int:
    with open("/proc/meminfo") as fh:
        return int(re.search(r"MemAvailable:\s+(\d+) kB", fh.read()).group(1)) * 1024


# --------------------------------------------------------------------------- table


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_row(row: dict) -> None:
    ours, pml = row["ours"], row.get("pml") or {}
    print(
        f"{row['batch']:>5} {row['identities']:>4} {row['miner']:<17}"
        f"{ours.get('triplets', 0):>11,} "
        f"{fmt(ours.get('seconds'), '.4f'):>9} {fmt(pml.get('seconds'), '.4f'):>9} "
        f"{fmt(row['speedup'], '.1f'):>8}x "
        f"{fmt(ours.get('peak_bytes', 0) / 2**20, '.1f'):>9} "
        f"{fmt(pml.get('peak_bytes') and pml['peak_bytes'] / 2**20, '.1f'):>9} "
        f"{fmt(row['memory_ratio'], '.1f'):>7}x "
        f"{24 * ours.get('triplets', 0) / 2**20:>8.1f}  {row['note']}",
        flush=True,
    )


HEADER = (
    f"{'B':>5} {'ids':>4} {'miner':<17}{'triplets':>11} {'ours s':>9} {'PML s':>9} "
    f"{'speedup':>9} {'ours MiB':>9} {'PML MiB':>9} {'mem':>8} {'idx MiB':>8}  note"
)


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


def run_case(case: dict, miner: str, args, pml_limit: float) -> dict:
    ours = run_forked("ours", miner, case, args.time_budget)
    row = {**case, "miner": miner, "ours": ours, "pml": None, "note": ""}
    if "error" in ours:
        row["note"] = "ours failed: " + ours["error"]
    if miner == "facenet_semihard":
        row["note"] = row["note"] or "one negative per pair; PML has no such miner"
    else:
        estimate = (
            3 * case["batch"] ** 2 * 8
            if miner == "batch_hard"
            else pml_peak_estimate(case["batch"], case["identities"])
        )
        if estimate > pml_limit:
            row["note"] = f"PML skipped: needs ~{estimate / 1e9:.1f} GB > {pml_limit / 1e9:.1f} GB"
            row["pml_skipped_estimate_bytes"] = estimate
        else:
            row["pml"] = run_forked("pml", miner, case, args.time_budget)
            if "error" in row["pml"]:
                row["note"] = "PML failed: " + row["pml"]["error"]
            else:
                row["note"] = compare_counts(ours.get("triplets", 0), row["pml"]["triplets"])
    pml = row["pml"] or {}
    row["speedup"] = ratio(pml.get("seconds"), ours.get("seconds"))
    row["memory_ratio"] = ratio(pml.get("peak_bytes"), ours.get("peak_bytes"))
    return row


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B in {256, 512}, 16 identities")
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--noise", type=float, default=2.0, help="embedding noise (see top)")
    parser.add_argument("--max-pml-gb", type=float, default=8.0, help="skip PML cases above")
    parser.add_argument(
        "--time-budget", type=float, default=2.0, help="seconds of timed repeats per case"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        _reset_peak()
    except OSError:
        print("cannot reset the peak RSS (/proc/self/clear_refs): Linux only", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = (256, 512) if args.quick else (256, 512, 1024, 2048)
    identity_counts = (16,) if args.quick else (16, 64)
    pml_limit = min(args.max_pml_gb * 1e9, 0.7 * available_bytes())
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print(
            f"warning: load average {load_before[0]:.1f} on {os.cpu_count()} CPUs; with "
            f"{torch.get_num_threads()} threads per op, time goes to waiting for descheduled "
            "threads. --threads 1 gives steadier figures on a busy machine.",
            file=sys.stderr,
        )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load {load_before[0]:.2f}; D={DIM}, margin={MARGIN}, "
        f"squared distance, noise={args.noise}"
    )
    print("speedup = PML time / ours; mem = PML peak / ours; idx = returned indices (24 B each)")
    print(HEADER)
    rows = []
    started = time.perf_counter()
    for batch in batches:
        for identities in identity_counts:
            case = {"batch": batch, "identities": identities, "noise": args.noise}
            for miner in MINERS:
                row = run_case(case, miner, args, pml_limit)
                print_row(row)
                rows.append(row)
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s, load average now {os.getloadavg()[0]:.2f}")
    if args.json:
        report = {
            "benchmark": "bench_miners",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(),
            "load_average_before": load_before[0],
            "load_average_after": os.getloadavg()[0],
            "dim": DIM,
            "margin": MARGIN,
            "noise": args.noise,
            "memory_method": "forked process per case; VmHWM after clear_refs minus VmRSS",
            "seconds_total": elapsed,
            "rows": rows,
        }
        write_report(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
