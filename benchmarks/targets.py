"""The targets of the benchmark issues, as ratios measured in one run, met or missed.

:func:`all_targets` reads the sections of ``benchmarks/results.json`` (``{name: report}``) and
returns rows ``{"target", "wanted", "measured", "met", "where"}``; ``met`` is None when not
measured.
"""

from __future__ import annotations

import operator

from benchmarks.tables import pick

GRAPH_LIMITS = {"dense": 0.5, "sparse": 0.15}  # peak graph bytes, two-pass / seed
# (target, ratio of every triplet case, wanted) after the graph and chunk targets
STEP_TARGETS = (
    ("images/s, two-pass / seed", "throughput_two_pass_vs_seed", ">= 1.5"),
    ("two-pass step above the floor", "two_pass_overhead_above_floor", "<= 0.1"),
)


def target(name: str, wanted: str, measured: float | None, where: str) -> dict:
    """One row of the targets table; ``wanted`` is ``"<= limit"`` or ``">= limit"`` (``x``
    after the limit: a ratio)."""
    limit = float(wanted[3:].rstrip("x"))
    compare = operator.le if wanted.startswith("<=") else operator.ge
    met = None if measured is None else compare(measured, limit)
    return {"target": name, "wanted": wanted, "measured": measured, "met": met, "where": where}


def step_targets(cases: list[dict]) -> list[dict]:
    """The training step's targets, from its cases."""
    triplets = [r for r in cases if r["case"]["batch"] == "triplets"]
    rows = []
    for r in triplets:
        selection, measured = r["case"]["selection"], pick(r, "ratios.graph_peak_two_pass_vs_seed")
        wanted = f"<= {GRAPH_LIMITS[selection]}"
        rows.append(
            target(
                f"peak graph bytes, two-pass / seed, {selection}",
                wanted,
                measured,
                r["case"]["name"],
            )
        )
    for r in cases:  # chunked peak at most one chunk's grad-forward graph, whatever the batch
        if r["case"]["batch"] == "pk" and "two_pass_chunked" in r["case"]["variants"]:
            absent = pick(r, "variants.two_pass_chunked.not_available")
            where = r["case"]["name"] + (" (chunking not available)" if absent else "")
            measured = pick(r, "ratios.graph_peak_chunked_vs_one_chunk")
            rows.append(
                target(
                    "peak graph bytes, chunked / one chunk's forward", "<= 1.10", measured, where
                )
            )
    for name, key, wanted in STEP_TARGETS:
        rows += [
            target(name, wanted, pick(r, "ratios." + key), r["case"]["name"]) for r in triplets
        ]
    return rows


def all_targets(sections: dict) -> list[dict]:
    """Every target row, in the order of the issues."""
    rows = step_targets(pick(sections, "training_step.cases") or [])
    miners = pick(sections, "miners.rows") or []
    for miner in ("all", "semihard"):  # B = 1024, 64 identities: 3x faster, 1/3 of the memory
        row = next(
            (r for r in miners if (r["batch"], r["identities"], r["miner"]) == (1024, 64, miner)),
            {},
        )
        for name, key in (("speed", "speedup"), ("peak memory", "memory_ratio")):
            rows.append(
                target(
                    f"miner {name}, PML / ours", ">= 3x", row.get(key), f"B=1024, 64 ids, {miner}"
                )
            )
    speeds = [r["speedup"] for r in miners if r.get("speedup") is not None]
    where = f"{len(speeds)} cases with PML figures"
    rows.append(
        target(
            "miner never slower than PML (slowest case)", ">= 1x", min(speeds, default=None), where
        )
    )
    for case in pick(sections, "evaluation.cases") or []:  # met only with identical numbers
        where = f"{case['n_pairs']} pairs" + ("" if case["identical"] else ", NUMBERS DIFFER")
        row = target(
            "evaluation speed, loops / ours (identical numbers)", ">= 100x", case["speedup"], where
        )
        rows.append(row | {"met": row["met"] and case["identical"]})
    return rows
