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
from benchmarks.targets import status_text
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
CHUNKS = ["batch", "variant", "chunk_size", "rounds_images_per_s", GRAPH_BYTES_PEAK]
CHUNKS += ["chunk_forward_graph_bytes", "loss_graph_bytes", "graph_peak_chunked_vs_one_chunk"]
CHUNKS += ["graph_peak_chunked_vs_two_pass", "throughput_chunked_vs_two_pass"]
MINERS = ["batch", "identities", "miner", "ours.triplets", "ours.seconds", "pml.seconds"]
MINERS += ["speedup", "ours.peak_bytes", "pml.peak_bytes", "memory_ratio", "note"]
EVALUATION = ["n_pairs", "ours_median_s", "reference_median_s", "speedup", "identical"]
EVALUATION += ["accuracy_mean", "val", "auc"]
DATA = ["image_size", "workers", "images_per_s", "step.case", "step.images_per_s"]
DATA += ["step.loader_vs_step"]
LOADER = ["image_size", "workers", "ours_first_pass", "ours", "torchvision", "ours_vs_torchvision"]
TRAINING = ["workload", "workers", "workers_setting", "step_images_per_s"]
TRAINING += ["end_to_end_images_per_s", "end_to_end_vs_step", "end_to_end_vs_step_paired_median"]
TRAINING += ["step_images_per_s_median", "end_to_end_images_per_s_median"]
INDEX = ["format", "files", "megabytes", "build_s", "build_s_per_10k", "build_s_vggface2"]
INDEX += ["reuse_s_per_10k"]
STEP_PATHS = ["workload", "label", "step", "fastest_s", "median_s", "images_per_s"]
STEP_PATHS += [GRAPH_BYTES_PEAK]
STEP_PATH_RATIOS = ["workload.name", "ratios.two_pass_vs_auto", "ratios.auto_overhead_vs_plain"]
STEP_PATH_RATIOS += ["ratios.meter_on_vs_off", "ratios.two_pass_vs_auto_median"]
STEP_PATH_RATIOS += ["ratios.auto_overhead_vs_plain_median", "ratios.meter_on_vs_off_median"]
SEARCH = ["batch", "chunk_size", "error", CUDA_MAX_ALLOCATED]


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


def table(keys: list[str], rows: list[dict]) -> str:
    """``keys`` of ``rows``, bytes in MiB; a row's ``"error"`` goes in its first empty cell."""
    lines = []
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
    """When, where and how long: the run's date, machine, load and duration."""
    step = results["sections"].get("training_step") or {}
    machine = step.get("machine") or results.get("machine") or {}
    seconds = results["seconds_total"]
    loads = [machine.get("load_average"), results.get("load_average_after")]
    rows = [
        ["command", f"`{results['command']}`"],
        ["date", results["date"]],
        ["duration", f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"],
        ["CPU", f"{machine.get('cpu_model')}, {machine.get('cpu_count')} cores"],
        ["torch", f"{machine.get('torch')}, {machine.get('torch_threads')} intra-op thread(s)"],
        ["Python", f"{machine.get('python')}; {machine.get('platform')}"],
        ["load average (1 min), start / end", " / ".join(cell(x, ".2f") for x in loads)],
        *([["GPU", machine["gpu"]]] if machine.get("gpu") else []),
    ]
    return md_table(["", "this run"], rows)


def commands_table(results: dict) -> str:
    """The command that repeats each section alone, and how long the section took."""
    rows = []
    for name, command in results["commands"].items():
        section = results["sections"].get(name)
        seconds = "not run" if section is None else cell(section.get("seconds"), ".0f")
        rows.append([name, f"`{command}`", seconds])
    return md_table(["section", "command", "seconds"], rows)


def targets_table(results: dict) -> str:
    """Every target: where, wanted, measured, met or missed."""
    rows = []
    for row in results["targets"]:
        measured = row["measured"]
        if measured is None or "above the floor" in row["target"]:
            shown = cell(measured, "+.1%")
        else:
            shown = cell(measured, ".3f" if measured < 10 else ".0f")
        rows.append([row["target"], row["where"], row["wanted"], shown, status_text(row["met"])])
    return md_table(["target", "where", "wanted", "measured", "status"], rows)


# --------------------------------------------------------------------------- the sections


def step_rows(cases: list[dict]) -> list[dict]:
    """A row per (training-step case, variant)."""
    return [
        {"case": result["case"]["name"], "variant": variant, **row}
        for result in cases
        for variant, row in result["variants"].items()
    ]


def chunk_rows(cases: list[dict]) -> list[dict]:
    """Gradient caching: the two-pass step without and with chunks, a row each per batch."""
    rows = []
    for result in cases:
        variants, batch = result["variants"], result["case"]["p"] * result["case"]["k"]
        rows.append({"batch": batch, "variant": "two_pass", **(variants.get("two_pass") or {})})
        chunked = {**(variants.get("two_pass_chunked") or {}), **(result.get("rounds") or {})}
        chunked |= {"chunk_size": result["case"]["chunk_size"], **result["ratios"]}
        rows.append({"batch": batch, "variant": "two_pass_chunked", **chunked})
    return rows


def floor_table(cases: list[dict]) -> str:
    """The floor of every case timed in rounds, and the parts outside it."""
    return table(FLOOR, [r for r in cases if pick(r, "rounds.floor_s") is not None])


def section_tables(name: str, report: dict | None) -> dict[str, str]:
    """The tables of one section's report ({} when it did not run or failed)."""
    if not report or "error" in report:
        return {}
    if name == "training_step":
        cases = report.get("cases", [])
        triplets = [r for r in cases if r["case"]["batch"] == "triplets"]
        pk = [r for r in cases if r["case"]["batch"] == "pk"]
        tables = {
            "training_step_cases": table(STEP, step_rows(triplets)),
            "training_step_calibration": table(CALIBRATION, triplets),
            "training_step_floor": floor_table(cases),
        }
        return tables | ({"training_step_chunks": table(CHUNKS, chunk_rows(pk))} if pk else {})
    if name == "step_paths":
        workloads = report.get("workloads", [])
        rows = []
        for result in workloads:  # its variants, or the workload's error
            variants = [result] if "error" in result else result["variants"].values()
            rows += [{**row, "workload": result["workload"]["name"]} for row in variants]
        return {
            "step_paths": table(STEP_PATHS, rows),
            "step_paths_ratios": table(
                STEP_PATH_RATIOS, [w for w in workloads if "error" not in w]
            ),
        }
    if name == "pipeline":
        return {
            "pipeline_loader": table(LOADER, report.get("loader", [])),
            "pipeline_training": table(TRAINING, report.get("training", [])),
            "pipeline_index": table(INDEX, report.get("index", [])),
        }
    if name == "data":  # a row per (loader row, training-step case)
        rows = report.get("rows", [])
        rows = [{**r, "step": s} for r in rows for s in r.get("step_consumption") or [{}]]
        return {"data": table(DATA, rows)}
    if name == "evaluation":
        return {"evaluation": table(EVALUATION, report.get("cases", []))}
    return {"miners": table(MINERS, report.get("rows", []))}


def gpu_tables(gpu: dict | None) -> dict[str, str]:
    """gpu_check.sh's figures (``--gpu-json``): its cases and the largest P x K, when given."""
    if not gpu:
        return {}
    cases = gpu.get("cases", [])
    where = [[pick(gpu, "machine.gpu"), gpu.get("date"), gpu.get("command")]]
    tables = {
        "gpu_cases": md_table(["GPU", "date", "command"], where)
        + "\n\n"
        + table(STEP, step_rows(cases)),
        "gpu_floor": floor_table(cases),
    }
    if gpu.get("pk_search"):
        tables["gpu_search"] = table(SEARCH, gpu["pk_search"])
    return tables


# --------------------------------------------------------------------------- the document


def render_tables(results: dict) -> dict[str, str]:
    """Every table of BENCHMARKS.md by marker name, from what ``run_all`` writes to results.json."""
    tables = {
        "run": run_table(results),
        "commands": commands_table(results),
        "targets": targets_table(results),
    }
    for name, report in results["sections"].items():
        tables.update(section_tables(name, report))
    return tables | gpu_tables(results.get("gpu"))


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
