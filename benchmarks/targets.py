"""The targets of the benchmark issues, as ratios measured in one run, met or missed.

Each function reads the sections of ``benchmarks/results.json`` (``{name: report}``, as the
runners of :mod:`benchmarks.runners` return them) and returns rows
``{"target", "wanted", "measured", "met", "where"}``; ``met`` is None when not measured.
"""

from __future__ import annotations

__all__ = [
    "target",
    "step_cases",
    "graph_targets",
    "throughput_targets",
    "overhead_targets",
    "chunk_targets",
    "miner_targets",
    "evaluation_targets",
    "all_targets",
    "status_text",
]

# The targets of the benchmark issues, as ratios measured in one run.
DENSE_GRAPH_RATIO = 0.5
SPARSE_GRAPH_RATIO = 0.15
CHUNK_GRAPH_TOLERANCE = 1.10  # chunked peak <= this x one chunk's grad-forward graph bytes
THROUGHPUT_RATIO = 1.5
OVERHEAD = 0.10
MINER_SPEEDUP = 3.0
MINER_MEMORY_RATIO = 3.0
EVALUATION_SPEEDUP = 100.0


def target(name: str, wanted: str, measured: float | None, met: bool | None, where: str) -> dict:
    """One row of the targets table."""
    return {"target": name, "wanted": wanted, "measured": measured, "met": met, "where": where}


def step_cases(sections: dict, batch: str) -> list[dict]:
    """The training-step cases of one batch kind ("triplets" or "pk") in ``sections``."""
    step = sections.get("training_step") or {}
    return [r for r in step.get("cases", []) if r["case"]["batch"] == batch]


def graph_targets(sections: dict) -> list[dict]:
    """Two-pass peak graph bytes vs the seed's: <= 0.5x dense, <= 0.15x sparse."""
    rows = []
    limits = {"dense": DENSE_GRAPH_RATIO, "sparse": SPARSE_GRAPH_RATIO}
    for result in step_cases(sections, "triplets"):
        case = result["case"]
        limit = limits.get(case["selection"])
        value = result.get("ratios", {}).get("graph_peak_two_pass_vs_seed")
        rows.append(
            target(
                f"peak graph bytes, two-pass / seed, {case['selection']}",
                f"<= {limit}",
                value,
                None if value is None else value <= limit,
                case["name"],
            )
        )
    return rows


def throughput_targets(sections: dict) -> list[dict]:
    """Two-pass images/s at least 1.5x the seed loop's."""
    rows = []
    for result in step_cases(sections, "triplets"):
        value = result.get("ratios", {}).get("throughput_two_pass_vs_seed")
        rows.append(
            target(
                "images/s, two-pass / seed",
                f">= {THROUGHPUT_RATIO}",
                value,
                None if value is None else value >= THROUGHPUT_RATIO,
                result["case"]["name"],
            )
        )
    return rows


def overhead_targets(sections: dict) -> list[dict]:
    """Two-pass step time at most 10% above the floor (training-step table)."""
    rows = []
    for result in step_cases(sections, "triplets"):
        value = result.get("ratios", {}).get("two_pass_overhead_above_floor")
        rows.append(
            target(
                "two-pass step above the floor",
                f"<= {OVERHEAD:.0%}",
                value,
                None if value is None else value <= OVERHEAD,
                result["case"]["name"],
            )
        )
    return rows


def chunk_targets(sections: dict) -> list[dict]:
    """Chunked peak graph bytes at most one chunk's worth whatever the batch."""
    rows = []
    for result in step_cases(sections, "pk"):
        if "two_pass_chunked" not in result["case"]["variants"]:
            continue
        value = result.get("ratios", {}).get("graph_peak_chunked_vs_one_chunk")
        chunked = result["variants"].get("two_pass_chunked") or {}
        rows.append(
            target(
                "peak graph bytes, chunked / one chunk's forward",
                f"<= {CHUNK_GRAPH_TOLERANCE:.2f}",
                value,
                None if value is None else value <= CHUNK_GRAPH_TOLERANCE,
                result["case"]["name"]
                + (" (chunking not available)" if chunked.get("not_available") else ""),
            )
        )
    return rows


def miner_targets(sections: dict) -> list[dict]:
    """B = 1024, 64 identities, "all" and "semihard": >= 3x faster, <= 1/3 of PML's memory;
    never slower than PML at any size."""
    miners = sections.get("miners") or {}
    rows_in = miners.get("rows", [])
    rows = []
    for miner in ("all", "semihard"):
        match = [
            r
            for r in rows_in
            if r["batch"] == 1024 and r["identities"] == 64 and r["miner"] == miner
        ]
        row = match[0] if match else {}
        where = f"B=1024, 64 ids, {miner}"
        speed, memory = row.get("speedup"), row.get("memory_ratio")
        rows.append(
            target(
                "miner speed, PML / ours",
                f">= {MINER_SPEEDUP:.0f}x",
                speed,
                None if speed is None else speed >= MINER_SPEEDUP,
                where,
            )
        )
        rows.append(
            target(
                "miner peak memory, PML / ours",
                f">= {MINER_MEMORY_RATIO:.0f}x",
                memory,
                None if memory is None else memory >= MINER_MEMORY_RATIO,
                where,
            )
        )
    speeds = [r["speedup"] for r in rows_in if r.get("speedup") is not None]
    slowest = min(speeds) if speeds else None
    rows.append(
        target(
            "miner never slower than PML (slowest case)",
            ">= 1x",
            slowest,
            None if slowest is None else slowest >= 1.0,
            f"{len(speeds)} cases with PML figures",
        )
    )
    return rows


def evaluation_targets(sections: dict) -> list[dict]:
    """The protocol at least 100x faster than the loops, with identical numbers."""
    rows = []
    for case in (sections.get("evaluation") or {}).get("cases", []):
        rows.append(
            target(
                "evaluation speed, loops / ours (identical numbers)",
                f">= {EVALUATION_SPEEDUP:.0f}x",
                case["speedup"],
                case["speedup"] >= EVALUATION_SPEEDUP and case["identical"],
                f"{case['n_pairs']} pairs" + ("" if case["identical"] else ", NUMBERS DIFFER"),
            )
        )
    return rows


def all_targets(sections: dict) -> list[dict]:
    """Every target row, in the order of the issues."""
    return (
        graph_targets(sections)
        + chunk_targets(sections)
        + throughput_targets(sections)
        + overhead_targets(sections)
        + miner_targets(sections)
        + evaluation_targets(sections)
    )


def status_text(met: bool | None) -> str:
    """met / MISSED / not measured."""
    return "not measured" if met is None else ("met" if met else "MISSED")
