"""The tables of BENCHMARKS.md, rendered from ``benchmarks/results.json``, and their markers.

BENCHMARKS.md is written by hand except for its tables: each sits between
``<!-- table:NAME -->`` and ``<!-- /table -->``, and :func:`fill_tables` replaces what is between
the two with ``render_tables(results)[NAME]``. A table this run did not measure says so, so no
figure of an older run stays next to the new ones.
"""

from __future__ import annotations

import re

from benchmarks.bench_training_step import ratio
from benchmarks.measure import RSS_BEFORE_BYTES
from benchmarks.targets import status_text
from facenet.memory import CUDA_MAX_ALLOCATED, GRAPH_BYTES_ALIVE, GRAPH_BYTES_PEAK, PEAK_RSS_BYTES

__all__ = ["md_table", "mib", "num", "render_tables", "fill_tables", "MARKER", "NOT_MEASURED"]

# <!-- table:NAME --> ... <!-- /table -->; NAME is group 1, the old table between them group 2.
MARKER = re.compile(r"(<!-- table:([a-z0-9_]+) -->\n)(.*?)(<!-- /table -->)", re.DOTALL)
NOT_MEASURED = "*Not measured in this run.*"


# --------------------------------------------------------------------------- cells


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; a column whose filled cells are all numbers is right-aligned.

    Args:
        headers: the column titles.
        rows: the cells, row by row; None is shown as ``-``.
    """

    def cell(value) -> str:
        return "-" if value is None else str(value).replace("|", "\\|")

    def numeric(column: int) -> bool:  # every filled cell of the column is a number
        filled = [row[column] for row in rows if row[column] not in (None, "")]
        return bool(filled) and all(_is_number(value) for value in filled)

    align = ["---:" if numeric(i) else "---" for i in range(len(headers))]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _is_number(text) -> bool:
    """True for ``1.5``, ``1.5x``, ``+4.5%``, ``1,024``."""
    try:
        float(str(text).rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return False


def mib(value) -> str | None:
    """Bytes as MiB with one decimal, or None."""
    return None if value is None else f"{value / 2**20:.1f}"


def num(value, spec: str = ".2f", suffix: str = "") -> str | None:
    """A formatted number, or None."""
    return None if value is None else f"{format(value, spec)}{suffix}"


# --------------------------------------------------------------------------- the run


def run_table(results: dict) -> str:
    """When, where and how long: the run's date, machine, load and duration."""
    step = results["sections"].get("training_step") or {}
    machine = step.get("machine") or results.get("machine") or {}
    seconds = results["seconds_total"]
    rows = [
        ["command", f"`{results['command']}`"],
        ["date", results["date"]],
        ["duration", f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"],
        ["CPU", f"{machine.get('cpu_model')}, {machine.get('cpu_count')} cores"],
        ["torch", f"{machine.get('torch')}, {machine.get('torch_threads')} intra-op thread(s)"],
        ["Python", f"{machine.get('python')}; {machine.get('platform')}"],
        ["load average (1 min), start / end", _loads(machine, results)],
    ]
    if machine.get("gpu"):
        rows.append(["GPU", machine["gpu"]])
    return md_table(["", "this run"], rows)


def _loads(machine: dict, results: dict) -> str:
    """``1.23 / 1.02``: the load at the start of the run and at its end."""
    after = results.get("load_average_after")
    return f"{machine.get('load_average', 0):.2f} / " + ("-" if after is None else f"{after:.2f}")


def commands_table(results: dict) -> str:
    """The command that repeats each section alone, and how long the section took."""
    rows = []
    for name, command in results["commands"].items():
        section = results["sections"].get(name)
        seconds = None if section is None else num(section.get("seconds"), ".0f")
        rows.append([name, f"`{command}`", "not run" if section is None else seconds])
    return md_table(["section", "command", "seconds"], rows)


def targets_table(results: dict) -> str:
    """Every target: where, wanted, measured, met or missed."""
    rows = []
    for row in results["targets"]:
        measured = row["measured"]
        if measured is not None and "above the floor" in row["target"]:
            shown = f"{measured:+.1%}"
        elif measured is not None:
            shown = f"{measured:.3f}" if measured < 10 else f"{measured:.0f}"
        else:
            shown = None
        rows.append([row["target"], row["where"], row["wanted"], shown, status_text(row["met"])])
    return md_table(["target", "where", "wanted", "measured", "status"], rows)


# --------------------------------------------------------------------------- training step


def _cases(report: dict, batch: str) -> list[dict]:
    """The cases of one batch kind ("triplets" or "pk") in a training-step report."""
    return [r for r in report.get("cases", []) if r["case"]["batch"] == batch]


def step_cases_table(cases: list[dict]) -> str:
    """Each case's variants: times, selection, graph bytes, RSS, CUDA peak (a row each)."""
    rows = []
    for result in cases:
        name = result["case"]["name"]
        for variant, row in result["variants"].items():
            if "error" in row:
                rows.append([name, variant, row["error"][:120], *[None] * 9])
                continue
            fraction = row.get("selected_fraction")
            selected = num(fraction, ".0%") if fraction is not None else None
            rows.append(
                [
                    name,
                    variant,
                    num(row.get("rounds_step_s"), ".3f"),
                    num(row.get("rounds_images_per_s"), ".1f"),
                    num(row["median_step_s"], ".3f"),
                    selected or num(row["selected_images_mean"], ".0f"),
                    mib(row[GRAPH_BYTES_PEAK]),
                    mib(row[GRAPH_BYTES_ALIVE]),
                    mib(row[PEAK_RSS_BYTES]),
                    mib(row[PEAK_RSS_BYTES] - row[RSS_BEFORE_BYTES]),
                    mib(row.get(CUDA_MAX_ALLOCATED)),
                ]
            )
    headers = ["case", "variant", "step s (rounds)", "images/s (rounds)", "step s (alone)"]
    headers += ["selected", "peak graph MiB", "graph MiB alive after", "peak RSS MiB"]
    return md_table(headers + ["RSS rise MiB", "CUDA peak MiB"], rows)


def calibration_table(cases: list[dict]) -> str:
    """Each triplet case's margins (share of candidates each lets through) and its ratios."""
    rows = []
    for result in cases:
        calibration, ratios = result.get("calibration") or {}, result.get("ratios", {})
        rows.append(
            [
                result["case"]["name"],
                f"{num(calibration.get('margin_seed'), '.4g')} "
                f"({num(calibration.get('pass_fraction_seed'), '.1%')})",
                f"{num(calibration.get('margin_ours'), '.4g')} "
                f"({num(calibration.get('pass_fraction_ours'), '.1%')})",
                calibration.get("candidates"),
                num(ratios.get("graph_peak_two_pass_vs_seed"), ".3f", "x"),
                num(ratios.get("throughput_two_pass_vs_seed"), ".2f", "x"),
                num(ratios.get("graph_peak_one_pass_vs_seed"), ".3f", "x"),
                num(ratios.get("throughput_one_pass_vs_seed"), ".2f", "x"),
            ]
        )
    headers = ["case", "seed margin (passes)", "our margin (passes)", "candidates"]
    headers += ["two-pass / seed peak graph", "two-pass / seed images/s"]
    return md_table(headers + ["one-pass / seed peak graph", "one-pass / seed images/s"], rows)


def floor_table(cases: list[dict]) -> str:
    """The floor of every case timed in rounds, and the parts outside it."""
    rows = []
    for result in cases:
        floor, ratios = result.get("rounds") or {}, result.get("ratios", {})
        if "floor_s" not in floor:
            continue
        rows.append(
            [
                result["case"]["name"],
                num(floor["nograd_forward_s"], ".3f"),
                f"{num(floor['selected_forward_backward_s'], '.3f')} ({floor['selected_images']})",
                num(floor["floor_s"], ".3f"),
                num(floor.get("two_pass_step_s"), ".3f"),
                num(ratios.get("two_pass_overhead_above_floor"), "+.1%"),
                num(floor["optimizer_step_s"], ".3f"),
                num(floor.get("miner_s"), ".3f"),
                num(floor["grad_forward_s"], ".3f"),
                num(floor.get("seed_parts_s"), ".3f"),
                num(ratios.get("seed_step_vs_floor"), ".2f", "x"),
            ]
        )
    headers = ["case", "no-grad forward s", "fwd+bwd on selected s (images)", "floor s"]
    headers += ["two-pass step s", "overhead", "optimizer step s", "miner s"]
    headers += ["grad forward on batch s", "seed's arithmetic s", "seed step / floor"]
    return md_table(headers, rows)


def chunk_table(cases: list[dict]) -> str:
    """Gradient caching: peak graph bytes and images/s against the batch size."""
    rows = []
    for result in cases:
        case, floor, ratios = result["case"], result.get("rounds") or {}, result["ratios"]
        for name in ("two_pass", "two_pass_chunked"):
            row = result["variants"].get(name) or {}
            batch = case["p"] * case["k"]
            if "error" in row:
                rows.append([batch, name, row["error"][:100], *[None] * 6])
                continue
            chunked = name != "two_pass"
            only = (lambda value: value) if chunked else (lambda value: None)
            rows.append(
                [
                    batch,
                    f"{name} ({case['chunk_size']})" if chunked else name,
                    num(row.get("rounds_images_per_s"), ".1f"),
                    mib(row.get(GRAPH_BYTES_PEAK)),
                    only(mib(floor.get("chunk_forward_graph_bytes"))),
                    only(mib(floor.get("loss_graph_bytes"))),
                    only(num(ratios.get("graph_peak_chunked_vs_one_chunk"), ".2f")),
                    only(num(ratios.get("graph_peak_chunked_vs_two_pass"), ".3f")),
                    only(num(ratios.get("throughput_chunked_vs_two_pass"), ".2f", "x")),
                ]
            )
    headers = ["P x K", "variant (chunk)", "images/s (rounds)", "peak graph MiB"]
    headers += ["one chunk's forward MiB", "loss graph MiB", "chunked / one chunk"]
    return md_table(headers + ["chunked / unchunked graph", "chunked / unchunked images/s"], rows)


def training_step_tables(step: dict) -> dict[str, str]:
    """Section 1's tables: the cases, their calibration, the floor, gradient caching."""
    triplets, pk = _cases(step, "triplets"), _cases(step, "pk")
    tables = {
        "training_step_cases": step_cases_table(triplets),
        "training_step_calibration": calibration_table(triplets),
        "training_step_floor": floor_table(step.get("cases", [])),
    }
    if pk:
        tables["training_step_chunks"] = chunk_table(pk)
    return tables


# --------------------------------------------------------------------------- other sections


def miners_table(miners: dict) -> str:
    """Section 2: our miners against pytorch-metric-learning's, a row per (B, ids, miner)."""
    rows = []
    for r in miners.get("rows", []):
        ours, pml = r["ours"] or {}, r["pml"] or {}
        rows.append(
            [
                r["batch"],
                r["identities"],
                r["miner"],
                f"{ours.get('triplets', 0):,}",
                num(ours.get("seconds"), ".4f"),
                num(pml.get("seconds"), ".4f"),
                num(r.get("speedup"), ".1f", "x"),
                mib(ours.get("peak_bytes")),
                mib(pml.get("peak_bytes")),
                num(r.get("memory_ratio"), ".1f", "x"),
                r.get("note") or "",
            ]
        )
    headers = ["B", "ids", "miner", "triplets", "ours s", "PML s", "speedup", "ours MiB"]
    return md_table(headers + ["PML MiB", "PML / ours memory", "note"], rows)


def evaluation_table(evaluation: dict) -> str:
    """Section 3: the protocol against the loops, a row per pair count."""
    rows = [
        [
            f"{c['n_pairs']:,}",
            num(c["ours_median_s"] * 1e3, ".2f"),
            num(c["reference_median_s"], ".2f"),
            num(c["speedup"], ".0f", "x"),
            "yes" if c["identical"] else "NO",
            num(c["accuracy_mean"], ".4f"),
            num(c["val"], ".4f"),
            num(c["auc"], ".4f"),
        ]
        for c in evaluation.get("cases", [])
    ]
    headers = ["pairs", "ours ms", "loops s", "speedup", "identical", "accuracy", "VAL", "AUC"]
    return md_table(headers, rows)


def data_table(data: dict) -> str:
    """Section 4: the loader's images/s against the two-pass step's at the same image size."""
    rows = []
    for row in data.get("rows", []):
        for consumer in row.get("step_consumption") or [{}]:
            rows.append(
                [
                    row["image_size"],
                    row["workers"],
                    num(row["images_per_s"], ".0f"),
                    consumer.get("case"),
                    num(consumer.get("images_per_s"), ".1f"),
                    num(consumer.get("loader_vs_step"), ".1f", "x"),
                ]
            )
    headers = ["image px", "workers", "loader images/s", "training step (two-pass)"]
    return md_table(headers + ["step images/s", "loader / step"], rows)


def pipeline_tables(report: dict) -> dict[str, str]:
    """Section 6: the loaders side by side, training against the step alone, the index."""
    loader = [
        [
            r["image_size"],
            r["workers"],
            num(r["ours_first_pass"], ".0f"),
            num(r["ours"], ".0f"),
            num(r["torchvision"], ".0f"),
            num(r["ours_vs_torchvision"], ".1f", "x"),
        ]
        for r in report.get("loader", [])
    ]
    training = [
        [
            r["workload"],
            f"{r['workers']} ({r['workers_setting']})",
            num(r["step_images_per_s"], ".0f"),
            num(r["end_to_end_images_per_s"], ".0f"),
            num(r["end_to_end_vs_step"], ".0%"),
            num(r.get("end_to_end_vs_step_paired_median"), ".0%"),
            num(r["step_images_per_s_median"], ".0f"),
            num(r["end_to_end_images_per_s_median"], ".0f"),
        ]
        for r in report.get("training", [])
    ]
    index = [
        [
            r["format"],
            f"{r['files']:,}",
            num(r["megabytes"], ".0f"),
            num(r["build_s"], ".2f"),
            num(r["build_s_per_10k"], ".1f"),
            num(r["build_s_vggface2"] / 60, ".0f"),
            num(r["reuse_s_per_10k"], ".2f"),
        ]
        for r in report.get("index", [])
    ]
    loader_headers = ["image px", "workers", "ours, first pass images/s", "ours images/s"]
    training_headers = ["workload", "workers (setting)", "step alone images/s"]
    training_headers += ["end to end images/s", "end to end / step", "per round (median)"]
    training_headers += ["step alone (median)", "end to end (median)"]
    index_headers = ["format", "files", "MiB", "build s", "build s per 10k"]
    index_headers += ["3.3 M files, minutes", "reuse s per 10k"]
    return {
        "pipeline_loader": md_table(
            loader_headers + ["torchvision images/s", "ours / torchvision"], loader
        ),
        "pipeline_training": md_table(training_headers, training),
        "pipeline_index": md_table(index_headers, index),
    }


def step_paths_tables(report: dict) -> dict[str, str]:
    """Section 5: every variant's step time, and the ratios of each workload."""
    rows, ratio_rows = [], []
    for result in report.get("workloads", []):
        name = result["workload"]["name"]
        if "error" in result:
            rows.append([name, result["error"][:120], *[None] * 6])
            continue
        auto = (result["variants"].get("auto") or {}).get("fastest_s")
        for row in result["variants"].values():
            rows.append(
                [
                    name,
                    row["label"],
                    row["step"],
                    num(row.get("fastest_s"), ".3f"),
                    num(row.get("median_s"), ".3f"),
                    num(row.get("images_per_s"), ".1f"),
                    num(ratio(row.get("fastest_s"), auto), ".2f", "x"),
                    mib(row.get(GRAPH_BYTES_PEAK)),
                ]
            )
        ratio_rows.append([name, *_step_path_ratios(result["ratios"])])
    headers = ["workload", "variant", "step", "step s (fastest)", "step s (median)"]
    headers += ["images/s (fastest)", "/ auto", "peak graph MiB"]
    ratio_headers = ["workload", "two-pass / auto", "auto over plain", "meter on / off"]
    ratio_headers += ["two-pass / auto (medians)", "auto over plain (medians)"]
    ratio_headers += ["meter on / off (medians)"]
    return {
        "step_paths": md_table(headers, rows),
        "step_paths_ratios": md_table(ratio_headers, ratio_rows),
    }


def _step_path_ratios(ratios: dict) -> list[str | None]:
    """One workload's ratios, fastest rounds then medians, formatted."""
    cells = []
    for suffix in ("", "_median"):
        cells += [
            num(ratios.get("two_pass_vs_auto" + suffix), ".2f", "x"),
            num(ratios.get("auto_overhead_vs_plain" + suffix), "+.1%"),
            num(ratios.get("meter_on_vs_off" + suffix), ".2f", "x"),
        ]
    return cells


def gpu_tables(gpu: dict | None) -> dict[str, str]:
    """gpu_check.sh's figures (``--gpu-json``): its cases and the largest P x K, when given."""
    if not gpu:
        return {}
    machine = gpu.get("machine", {})
    where = md_table(
        ["GPU", "date", "command"], [[machine.get("gpu"), gpu.get("date"), gpu.get("command")]]
    )
    tables = {"gpu_cases": where + "\n\n" + step_cases_table(gpu.get("cases", []))}
    tables["gpu_floor"] = floor_table(gpu.get("cases", []))
    if gpu.get("pk_search"):
        rows = [
            [
                r["batch"],
                r["chunk_size"],
                "fits" if "error" not in r else r["error"][:80],
                mib(r.get(CUDA_MAX_ALLOCATED)),
            ]
            for r in gpu["pk_search"]
        ]
        tables["gpu_search"] = md_table(["P x K", "chunk", "outcome", "CUDA peak MiB"], rows)
    return tables


# --------------------------------------------------------------------------- the document


def _section_tables(name: str, report: dict | None) -> dict[str, str]:
    """The tables of one section's report ({} when it did not run or failed)."""
    if not report or "error" in report:
        return {}
    if name == "training_step":
        return training_step_tables(report)
    if name == "step_paths":
        return step_paths_tables(report)
    if name == "pipeline":
        return pipeline_tables(report)
    render = {"miners": miners_table, "evaluation": evaluation_table, "data": data_table}
    return {name: render[name](report)}


def render_tables(results: dict) -> dict[str, str]:
    """Every table of BENCHMARKS.md by marker name, from the combined results.

    Args:
        results: what ``run_all`` writes to results.json.
    """
    tables = {
        "run": run_table(results),
        "commands": commands_table(results),
        "targets": targets_table(results),
    }
    for name, report in results["sections"].items():
        tables.update(_section_tables(name, report))
    tables.update(gpu_tables(results.get("gpu")))
    return tables


def fill_tables(markdown: str, tables: dict[str, str]) -> tuple[str, list[str]]:
    """``markdown`` with the text between each marker pair replaced by its table.

    Args:
        markdown: BENCHMARKS.md's text.
        tables: marker name -> table; a marker without one gets :data:`NOT_MEASURED`.

    Returns:
        ``(new text, names of the markers that got no table)``.
    """
    missing: list[str] = []

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in tables:
            missing.append(name)
        return f"{match.group(1)}{tables.get(name, NOT_MEASURED)}\n{match.group(4)}"

    return MARKER.sub(replace, markdown), missing
