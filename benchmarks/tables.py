"""The tables of BENCHMARKS.md, rendered from ``benchmarks/results.json``, and their markers.

BENCHMARKS.md is written by hand except for its tables: each sits between
``<!-- table:NAME -->`` and ``<!-- /table -->``, and :func:`fill_tables` replaces what is between
the two with ``render_tables(results)[NAME]``. A section's table shows chosen keys of its
report's rows as they are (dotted keys reach into nested records; byte counts in MiB), so a
column's name is the key in results.json. A table this run did not measure says so.
"""

from __future__ import annotations

import re

from benchmarks.measure import RSS_BEFORE_BYTES
from facenet.memory import (
    CUDA_MAX_ALLOCATED,
    GRAPH_BYTES_ALIVE,
    GRAPH_BYTES_PEAK,
    MEMORY_KEYS,
    PEAK_RSS_BYTES,
)

# <!-- table:NAME --> ... <!-- /table -->; NAME is group 2, the old table between them group 3.
MARKER = re.compile(r"(<!-- table:([a-z0-9_]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
NOT_MEASURED = "*Not measured in this run.*"

STEP = ["case", "variant", "rounds_step_s", "rounds_images_per_s", "median_step_s"]
STEP += ["selected_fraction", "selected_images_mean", GRAPH_BYTES_PEAK, GRAPH_BYTES_ALIVE]
STEP += [PEAK_RSS_BYTES, RSS_BEFORE_BYTES, CUDA_MAX_ALLOCATED]
CALIBRATION = ["case.name", "calibration.margin_seed", "calibration.pass_fraction_seed"]
CALIBRATION += ["calibration.margin_ours", "calibration.pass_fraction_ours"]
CALIBRATION += ["calibration.candidates", "ratios.graph_peak_two_pass_vs_seed"]
CALIBRATION += ["ratios.throughput_two_pass_vs_seed", "ratios.graph_peak_one_pass_vs_seed"]
CALIBRATION += ["ratios.throughput_one_pass_vs_seed"]
FLOOR = ["case.name", "rounds.nograd_forward_s", "rounds.selected_forward_backward_s"]
FLOOR += ["rounds.selected_images", "rounds.floor_s", "rounds.two_pass_step_s"]
FLOOR += ["ratios.two_pass_overhead_above_floor", "rounds.optimizer_step_s", "rounds.miner_s"]
FLOOR += ["rounds.grad_forward_s", "rounds.seed_parts_s", "ratios.seed_step_vs_floor"]
CHUNKS = ["case.name", "case.chunk_size", "variants.two_pass.rounds_images_per_s"]
CHUNKS += ["variants.two_pass_chunked.rounds_images_per_s", "variants.two_pass.graph_bytes_peak"]
CHUNKS += ["variants.two_pass_chunked.graph_bytes_peak", "rounds.chunk_forward_graph_bytes"]
CHUNKS += ["rounds.loss_graph_bytes", "ratios.graph_peak_chunked_vs_one_chunk"]
CHUNKS += ["ratios.graph_peak_chunked_vs_two_pass", "ratios.throughput_chunked_vs_two_pass"]
MINERS = ["batch", "identities", "miner", "ours.triplets", "ours.seconds", "pml.seconds"]
MINERS += ["speedup", "ours.peak_bytes", "pml.peak_bytes", "memory_ratio", "note"]
DEFAULT = ["case.name", "variants.auto.step", "rounds.auto_step_s", "rounds.two_pass_step_s"]
DEFAULT += ["rounds.auto_metered_step_s", "variants.auto.rounds_images_per_s"]
DEFAULT += ["variants.auto.graph_bytes_peak", "ratios.two_pass_vs_auto", "ratios.meter_on_vs_off"]
DEFAULT += ["rounds.medians.auto_step_s", "rounds.medians.two_pass_step_s"]
RUN = ["command", "date", "seconds_total", "load_average_after", "machine.load_average"]
RUN += ["machine.cpu_model", "machine.cpu_count", "machine.torch", "machine.torch_threads"]
RUN += ["machine.python", "machine.platform", "machine.gpu"]


def cell(value, spec: str | None = None) -> str:
    """None is ``-``, a bool yes / NO, an int with thousands separators, a float in ``spec``
    (default: four significant digits, whole numbers from 1,000 up)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    return format(value, spec or (".0f" if abs(value) >= 1000 else ".4g"))


def is_bytes(key: str) -> bool:
    """A byte count: a ``facenet.memory`` figure or a key with a ``bytes`` word."""
    return key in MEMORY_KEYS or "bytes" in key.split("_")


def _is_number(text: str) -> bool:
    """True for ``1.5``, ``1.5x``, ``+4.5%``, ``1,024``."""
    try:
        float(text.rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return False


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; a column whose filled cells are all numbers is right-aligned."""
    rows = [[cell(value) for value in row] for row in rows]
    align = []
    for column in range(len(headers)):
        filled = [row[column] for row in rows if row[column] not in ("-", "")]
        align.append("---:" if filled and all(map(_is_number, filled)) else "---")
    lines = [headers, align, *rows]
    return "\n".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in lines
    )


def pick(row: dict, key: str):
    """``row[key]`` through dots (``"ours.seconds"``); None where any part is missing."""
    for part in key.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def table(keys: list[str] | None, rows: list[dict]) -> str:
    """``keys`` of ``rows`` (None: every key with a scalar value), bytes in MiB; a row's
    ``"error"`` goes in its first empty cell."""
    scalar = (k for row in rows for k, v in row.items() if not isinstance(v, (dict, list)))
    keys, lines = keys or list(dict.fromkeys(scalar)), []
    for row in rows:
        values = [pick(row, key) for key in keys]
        values = [
            cell(v / 2**20, ".1f") if is_bytes(k) and v is not None else v
            for k, v in zip(keys, values)
        ]
        if "error" in row and "error" not in keys and None in values:
            values[values.index(None)] = row["error"][:120]
        lines.append(values)
    return md_table([f"{key} (MiB)" if is_bytes(key) else key for key in keys], lines)


# --------------------------------------------------------------------------- the run


def run_table(results: dict) -> str:
    """When, where and how long: keys of the run and of its machine (the training step's)."""
    run = {**results, "machine": pick(results, "sections.training_step.machine")}
    return md_table(["", "this run"], [[key, pick(run, key)] for key in RUN])


def commands_table(results: dict) -> str:
    """The command that repeats each section alone, and how long the section took."""
    rows = [
        {**(results["sections"].get(name) or {}), "section": name, "command": f"`{command}`"}
        for name, command in results["commands"].items()
    ]
    return table(["section", "command", "seconds"], rows)


def targets_table(results: dict) -> str:
    """Every target: where, wanted, measured, met (yes / NO / ``-``: not measured)."""
    return table(["target", "where", "wanted", "measured", "met"], results["targets"])


# --------------------------------------------------------------------------- the sections


def step_rows(cases: list[dict]) -> list[dict]:
    """A row per (training-step case, variant)."""
    return [
        {"case": result["case"]["name"], "variant": variant, **row}
        for result in cases
        for variant, row in result["variants"].items()
    ]


def triplet_cases(step: dict) -> list[dict]:
    """The training-step cases on triplet batches."""
    return [r for r in step.get("cases", []) if r["case"]["batch"] == "triplets"]


def floor_cases(report: dict) -> list[dict]:
    """The cases timed in rounds (they have a floor)."""
    return [r for r in report.get("cases", []) if pick(r, "rounds.floor_s") is not None]


def pk_cases(report: dict) -> list[dict]:
    """The training-step cases on P x K batches."""
    return [r for r in report.get("cases", []) if r["case"]["batch"] == "pk"]


# marker: (section, its rows: a key of the report or a function of it, the keys shown or None)
TABLES = {
    "training_step_cases": ("training_step", lambda r: step_rows(triplet_cases(r)), STEP),
    "training_step_calibration": ("training_step", triplet_cases, CALIBRATION),
    "training_step_floor": ("training_step", floor_cases, FLOOR),
    "training_step_chunks": ("training_step", pk_cases, CHUNKS),
    "training_step_default": (
        "training_step",
        lambda r: [c for c in pk_cases(r) if "auto" in c["variants"]],
        DEFAULT,
    ),
    "miners": ("miners", "rows", MINERS),
    "evaluation": ("evaluation", "cases", None),
    "pipeline_loader": ("pipeline", "loader", None),
    "pipeline_training": ("pipeline", "training", None),
    "pipeline_index": ("pipeline", "index", None),
    # gpu_check.sh's figures (run_all --gpu-json): its cases on the GPU named, their floor, the
    # largest P x K
    "gpu_cases": (
        "gpu",
        lambda r: [{**row, "gpu": pick(r, "machine.gpu")} for row in step_rows(r.get("cases", []))],
        ["gpu", *STEP],
    ),
    "gpu_floor": ("gpu", floor_cases, FLOOR),
    "gpu_search": ("gpu", "pk_search", None),
}


# --------------------------------------------------------------------------- the document


def render_tables(results: dict) -> dict[str, str]:
    """Every table of BENCHMARKS.md by marker name, from what ``run_all`` writes to results.json."""
    tables = {
        "run": run_table(results),
        "commands": commands_table(results),
        "targets": targets_table(results),
    }
    sections = {**results["sections"], "gpu": results.get("gpu")}
    for marker, (section, rows, keys) in TABLES.items():
        report = sections.get(section)
        if report and "error" not in report:
            rows = rows(report) if callable(rows) else report.get(rows, [])
            if rows:
                tables[marker] = table(keys, rows)
    return tables


def fill_tables(markdown: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``(markdown with each marker pair's content replaced by its table, the markers that got
    none)``; a marker without a table gets :data:`NOT_MEASURED`."""
    missing: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in tables:
            missing.append(name)
        return f"{match.group(1)}{tables.get(name, NOT_MEASURED)}\n{match.group(4)}"

    return MARKER.sub(replace, markdown), missing
