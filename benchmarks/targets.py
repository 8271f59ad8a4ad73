"""The targets of the benchmark issues, as ratios measured in one run, met or missed.

:func:`all_targets` reads the sections of ``benchmarks/results.json`` (``{name: report}``) and
returns rows ``{"target", "wanted", "measured", "met", "where"}``; ``met`` is None when not
measured.
"""

from __future__ import annotations

import operator

# (ratio in a triplet case's "ratios", target, selection -> limit or one limit, "<=" / ">=")
STEP_TARGETS = {
    "graph": (
        "graph_peak_two_pass_vs_seed",
        "peak graph bytes, two-pass / seed, {}",
        {"dense": 0.5, "sparse": 0.15},
        "<=",
    ),
    "throughput": ("throughput_two_pass_vs_seed", "images/s, two-pass / seed", 1.5, ">="),
    "overhead": ("two_pass_overhead_above_floor", "two-pass step above the floor", 0.10, "<="),
}
CHUNK_GRAPH_TOLERANCE = 1.10  # chunked peak <= this x one chunk's grad-forward graph bytes
MINER_RATIO = 3.0  # PML / ours, in time and in peak memory
EVALUATION_SPEEDUP = 100.0
COMPARE = {"<=": operator.le, ">=": operator.ge}


def target(name: str, wanted: str, measured: float | None, limit: float, where: str) -> dict:
    """One row of the targets table; ``wanted`` is ``"<= ..."`` or ``">= ..."``."""
    met = None if measured is None else COMPARE[wanted[:2]](measured, limit)
    return {"target": name, "wanted": wanted, "measured": measured, "met": met, "where": where}


def step_cases(sections: dict, batch: str) -> list[dict]:
    """The training-step cases of one batch kind ("triplets" or "pk") in ``sections``."""
    step = sections.get("training_step") or {}
    return [r for r in step.get("cases", []) if r["case"]["batch"] == batch]


def step_targets(sections: dict, kind: str) -> list[dict]:
    """One of :data:`STEP_TARGETS` for every triplet case."""
    key, name, limit, sense = STEP_TARGETS[kind]
    rows = []
    for result in step_cases(sections, "triplets"):
        case = result["case"]
        case_limit = limit[case["selection"]] if isinstance(limit, dict) else limit
        value = result.get("ratios", {}).get(key)
        wanted = f"{sense} {case_limit}"
        rows.append(target(name.format(case["selection"]), wanted, value, case_limit, case["name"]))
    return rows


def chunk_targets(sections: dict) -> list[dict]:
    """Chunked peak graph bytes at most one chunk's worth whatever the batch."""
    rows = []
    for result in step_cases(sections, "pk"):
        if "two_pass_chunked" not in result["case"]["variants"]:
            continue
        chunked = result["variants"].get("two_pass_chunked") or {}
        absent = " (chunking not available)" if chunked.get("not_available") else ""
        rows.append(
            target(
                "peak graph bytes, chunked / one chunk's forward",
                f"<= {CHUNK_GRAPH_TOLERANCE:.2f}",
                result.get("ratios", {}).get("graph_peak_chunked_vs_one_chunk"),
                CHUNK_GRAPH_TOLERANCE,
                result["case"]["name"] + absent,
            )
        )
    return rows


def miner_targets(sections: dict) -> list[dict]:
    """B = 1024, 64 identities, "all" and "semihard": >= 3x faster, <= 1/3 of PML's memory;
    never slower than PML at any size."""
    rows_in = (sections.get("miners") or {}).get("rows", [])
    rows = []
    for miner in ("all", "semihard"):
        case = (1024, 64, miner)
        row = next((r for r in rows_in if (r["batch"], r["identities"], r["miner"]) == case), {})
        where, wanted = f"B=1024, 64 ids, {miner}", f">= {MINER_RATIO:.0f}x"
        for name, key in (("speed", "speedup"), ("peak memory", "memory_ratio")):
            rows.append(
                target(f"miner {name}, PML / ours", wanted, row.get(key), MINER_RATIO, where)
            )
    speeds = [r["speedup"] for r in rows_in if r.get("speedup") is not None]
    where = f"{len(speeds)} cases with PML figures"
    rows.append(
        target(
            "miner never slower than PML (slowest case)",
            ">= 1x",
            min(speeds, default=None),
            1.0,
            where,
        )
    )
    return rows


def evaluation_targets(sections: dict) -> list[dict]:
    """The protocol at least 100x faster than the loops, with identical numbers."""
    rows = []
    for case in (sections.get("evaluation") or {}).get("cases", []):
        differ = "" if case["identical"] else ", NUMBERS DIFFER"
        row = target(
            "evaluation speed, loops / ours (identical numbers)",
            f">= {EVALUATION_SPEEDUP:.0f}x",
            case["speedup"],
            EVALUATION_SPEEDUP,
            f"{case['n_pairs']} pairs{differ}",
        )
        rows.append(row | {"met": row["met"] and case["identical"]})
    return rows


def all_targets(sections: dict) -> list[dict]:
    """Every target row, in the order of the issues."""
    return [
        *step_targets(sections, "graph"),
        *chunk_targets(sections),
        *step_targets(sections, "throughput"),
        *step_targets(sections, "overhead"),
        *miner_targets(sections),
        *evaluation_targets(sections),
    ]
