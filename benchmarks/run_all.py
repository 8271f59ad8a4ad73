#!/usr/bin/env python
"""Every benchmark in one run: writes BENCHMARKS.md and benchmarks/results.json.

Runs, in this order, each in this process through its own ``main`` (each forks its own
measurement children):

1. ``bench_training_step.py``: the seed's loop vs the two-pass and one-pass steps, the floor,
   and the gradient-caching rows;
2. ``bench_miners.py``: our miners vs pytorch-metric-learning 2.9.0;
3. ``bench_evaluation.py``: the verification protocol vs the classic loops;
4. ``bench_data.py``: IdentityFolder + transforms, 0 and 2 workers, vs the step's consumption;
5. ``bench_step_paths.py``: the default step (``passes="auto"``) vs the previous default
   (``passes=2``) and a plain loop, graph meter on vs off, on the demo config and resnet18.

Then it checks the targets (ratios measured in this run) and writes the report.

    python benchmarks/run_all.py                  # make bench: BENCHMARKS.md, results.json
    python benchmarks/run_all.py --quick          # seconds; writes into runs/bench_quick/
    python benchmarks/run_all.py --gpu-json gpu_check.json   # add gpu_check.sh's figures
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import bench_data  # noqa: E402
import bench_evaluation  # noqa: E402
import bench_step_paths  # noqa: E402
import bench_training_step  # noqa: E402

from facenet.files import write_text_atomic  # noqa: E402

SECTIONS = ("training_step", "miners", "evaluation", "data", "step_paths")
QUICK_OUT = REPO / "runs" / "bench_quick"

# The targets of the benchmark issues, as ratios measured in one run.
DENSE_GRAPH_RATIO = 0.5
SPARSE_GRAPH_RATIO = 0.15
CHUNK_GRAPH_TOLERANCE = 1.10  # chunked peak <= this x one chunk's grad-forward graph bytes
THROUGHPUT_RATIO = 1.5
OVERHEAD = 0.10
MINER_SPEEDUP = 3.0
MINER_MEMORY_RATIO = 3.0
EVALUATION_SPEEDUP = 100.0


# --------------------------------------------------------------------------- running


def section_commands(quick: bool, threads: int) -> dict[str, list[str]]:
    """The arguments each benchmark's ``main`` gets (its JSON path is added when run)."""
    thread_args = ["--threads", str(threads)] if threads else []
    if quick:
        return {
            "training_step": ["--quick", *thread_args],
            "miners": ["--quick", "--time-budget", "0.2", *thread_args],
            "evaluation": ["--sizes", "2000", "--repeats", "3", "--reference-repeats", "1"],
            "data": ["--quick", *thread_args],
            "step_paths": ["--quick", *thread_args],
        }
    return {
        "training_step": [*thread_args],
        "miners": [*thread_args],
        "evaluation": [],
        "data": [*thread_args],
        "step_paths": [*thread_args],
    }


def run_section(name: str, argv: list[str], json_path: Path) -> dict:
    """Run one benchmark's ``main`` with ``--json``; return its report plus wall time."""
    print(f"\n######## {name}: {' '.join(argv)}", flush=True)
    started = time.perf_counter()
    main = _section_main(name)
    try:
        code = main([*argv, "--json", str(json_path)])
    except SystemExit as stop:  # argparse or a refusal inside the benchmark
        code = stop.code if isinstance(stop.code, int) else 1
    seconds = time.perf_counter() - started
    if not json_path.is_file():
        return {"error": f"{name} wrote no report (exit status {code})", "seconds": seconds}
    report = json.loads(json_path.read_text(encoding="utf-8"))
    return {**report, "exit_status": code, "seconds": seconds, "argv": argv}


def _section_main(name: str):
    """The ``main`` of a section's benchmark module (miners needs pytorch-metric-learning)."""
    if name == "training_step":
        return bench_training_step.main
    if name == "evaluation":
        return bench_evaluation.main
    if name == "data":
        return bench_data.main
    if name == "step_paths":
        return bench_step_paths.main
    import bench_miners  # imports pytorch-metric-learning, a dev dependency

    return bench_miners.main


def script_command(name: str, argv: list[str]) -> str:
    """The command that reproduces one section alone."""
    script = {
        "training_step": "bench_training_step.py",
        "miners": "bench_miners.py",
        "evaluation": "bench_evaluation.py",
        "data": "bench_data.py",
        "step_paths": "bench_step_paths.py",
    }[name]
    extra = " --step-json training_step.json" if name == "data" else ""
    return f"python benchmarks/{script} {' '.join(argv)}{extra} --json {name}.json".replace(
        "  ", " "
    )


# --------------------------------------------------------------------------- targets


def target(name: str, wanted: str, measured: float | None, met: bool | None, where: str) -> dict:
    """One row of the targets table."""
    return {"target": name, "wanted": wanted, "measured": measured, "met": met, "where": where}


def _step_cases(sections: dict, batch: str) -> list[dict]:
    step = sections.get("training_step") or {}
    return [r for r in step.get("cases", []) if r["case"]["batch"] == batch]


def graph_targets(sections: dict) -> list[dict]:
    """Two-pass peak graph bytes vs the seed's: <= 0.5x dense, <= 0.15x sparse."""
    rows = []
    limits = {"dense": DENSE_GRAPH_RATIO, "sparse": SPARSE_GRAPH_RATIO}
    for result in _step_cases(sections, "triplets"):
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
    for result in _step_cases(sections, "triplets"):
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
    for result in _step_cases(sections, "triplets"):
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
    for result in _step_cases(sections, "pk"):
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


# --------------------------------------------------------------------------- markdown


def md_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub markdown table; numbers right-aligned."""

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
    try:
        float(str(text).rstrip("x%").replace(",", ""))
        return True
    except ValueError:
        return False


def mib(value) -> str | None:
    """Bytes as MiB with one decimal."""
    return None if value is None else f"{value / 2**20:.1f}"


def num(value, spec: str = ".2f", suffix: str = "") -> str | None:
    """A formatted number, or None."""
    return None if value is None else f"{format(value, spec)}{suffix}"


def machine_lines(machine: dict, load_after: float | None) -> list[str]:
    """The machine description."""
    lines = [
        f"- CPU: {machine.get('cpu_model')}, {machine.get('cpu_count')} cores; "
        f"torch {machine.get('torch')} with {machine.get('torch_threads')} intra-op thread(s); "
        f"Python {machine.get('python')}; {machine.get('platform')}",
        f"- Load average (1 min) at the start: {machine.get('load_average', 0):.2f}"
        + ("" if load_after is None else f"; at the end: {load_after:.2f}"),
    ]
    if machine.get("gpu"):
        lines.append(f"- GPU: {machine['gpu']}")
    return lines


def targets_section(targets: list[dict]) -> str:
    """The targets table."""
    rows = []
    for row in targets:
        measured = row["measured"]
        if measured is not None and "above the floor" in row["target"]:
            shown = f"{measured:+.1%}"
        elif measured is not None:
            shown = f"{measured:.3f}" if measured < 10 else f"{measured:.0f}"
        else:
            shown = None
        rows.append([row["target"], row["where"], row["wanted"], shown, status_text(row["met"])])
    return md_table(["target", "where", "wanted", "measured", "status"], rows)


def step_case_table(result: dict) -> str:
    """One training-step case: a row per variant."""
    rows = []
    for name, row in result["variants"].items():
        if "error" in row:
            rows.append([name, row["error"][:120], *[None] * 9])
            continue
        fraction = row.get("selected_fraction")
        rows.append(
            [
                name,
                num(row.get("rounds_step_s"), ".3f"),
                num(row.get("rounds_images_per_s"), ".1f"),
                num(row["median_step_s"], ".3f"),
                num(fraction, ".0%")
                if fraction is not None
                else num(row["selected_images_mean"], ".0f"),
                mib(row["graph_peak_bytes"]),
                mib(row["graph_alive_after_bytes"]),
                mib(row["rss_peak_bytes"]),
                mib(row["rss_peak_bytes"] - row["rss_before_bytes"]),
                mib(row.get("cuda_peak_allocated_bytes")),
            ]
        )
    headers = [
        "variant",
        "step s (rounds)",
        "images/s (rounds)",
        "step s (alone)",
        "selected",
        "peak graph MiB",
        "graph MiB alive after",
        "peak RSS MiB",
        "RSS rise MiB",
        "CUDA peak MiB",
    ]
    return md_table(headers, rows)


def floor_table(results: list[dict]) -> str:
    """The floor of every case with a two-pass row."""
    rows = []
    for result in results:
        floor = result.get("rounds") or {}
        if "floor_s" not in floor:
            continue
        ratios = result.get("ratios", {})
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
    headers = [
        "case",
        "no-grad forward s",
        "fwd+bwd on selected s (images)",
        "floor s",
        "two-pass step s",
        "overhead",
        "optimizer step s",
        "miner s",
        "grad forward on batch s",
        "seed's arithmetic s",
        "seed step / floor",
    ]
    return md_table(headers, rows)


def chunk_table(results: list[dict]) -> str:
    """Gradient caching: peak graph bytes and images/s against the batch size."""
    rows = []
    for result in results:
        case, floor = result["case"], result.get("rounds") or {}
        for name in ("two_pass", "two_pass_chunked"):
            row = result["variants"].get(name) or {}
            chunked = name != "two_pass"
            if "error" in row:
                rows.append([case["p"] * case["k"], name, row["error"][:100], *[None] * 6])
                continue
            rows.append(
                [
                    case["p"] * case["k"],
                    f"{name} ({case['chunk_size']})" if chunked else name,
                    num(row.get("rounds_images_per_s"), ".1f"),
                    mib(row.get("graph_peak_bytes")),
                    mib(floor.get("chunk_forward_graph_bytes")) if chunked else None,
                    mib(floor.get("loss_graph_bytes")) if chunked else None,
                    num(result["ratios"].get("graph_peak_chunked_vs_one_chunk"), ".2f")
                    if chunked
                    else None,
                    num(result["ratios"].get("graph_peak_chunked_vs_two_pass"), ".3f")
                    if chunked
                    else None,
                    num(result["ratios"].get("throughput_chunked_vs_two_pass"), ".2f", "x")
                    if chunked
                    else None,
                ]
            )
    headers = [
        "P x K",
        "variant (chunk)",
        "images/s (rounds)",
        "peak graph MiB",
        "one chunk's forward MiB",
        "loss graph MiB",
        "chunked / one chunk",
        "chunked / unchunked graph",
        "chunked / unchunked images/s",
    ]
    return md_table(headers, rows)


def training_section(step: dict, command: str) -> str:
    """Section 1: the training step, the floor, gradient caching."""
    if "error" in step:
        return f"## 1. Training step\n\n{step['error']}\n"
    triplet_cases = [r for r in step.get("cases", []) if r["case"]["batch"] == "triplets"]
    pk_cases = [r for r in step.get("cases", []) if r["case"]["batch"] == "pk"]
    parts = [
        "## 1. Training step: the seed's loop, two-pass, one-pass",
        f"Command: `{command}`",
        "Each variant runs in its own forked process (its own peak RSS) on the same batches "
        "from the same initial weights (SGD, lr 1e-4, momentum 0.9); one warm-up step, then "
        "the median of the timed steps (*step s (alone)*). Processes run at different moments "
        "of the machine's load, so the time ratios come from one more process that times one "
        "step of every variant (each on its own model) in rounds, in a rotating order, on the "
        "same batch: *step s (rounds)* and *images/s (rounds)*, from each variant's fastest "
        "round (other jobs only ever add time; medians are in results.json). "
        "Triplet batches: T random anchors; an easy triplet has the anchor plus 0.3 x noise "
        "as its positive and a random image as its negative, a hard one (about 20% of each "
        "batch, at random places) the other way round. The seed's filter "
        "`d(a,n) - d(a,p) < margin` selects (ours: the same filter on the device), then "
        "triplet loss + cross-entropy on the selected images. *sparse*: a margin between the "
        "hard and the easy triplets, so exactly the hard ones are selected, one margin for the "
        "seed and one for our steps (the seed's BatchNorm sees a, p and n as three batches, "
        "ours as one, so their distances differ); *dense*: margin 10, every triplet. Peak "
        "graph bytes: tensors saved for backward (GraphMemoryMeter), over all steps; *alive "
        "after*: what the last step left behind.",
    ]
    for result in triplet_cases:
        calibration = result.get("calibration") or {}
        ratios = result.get("ratios", {})
        parts.append(
            f"### {result['case']['name']}\n\n"
            f"Margins: seed {num(calibration.get('margin_seed'), '.4g')} (passes "
            f"{num(calibration.get('pass_fraction_seed'), '.1%')}), ours "
            f"{num(calibration.get('margin_ours'), '.4g')} (passes "
            f"{num(calibration.get('pass_fraction_ours'), '.1%')}) of "
            f"{calibration.get('candidates')} candidates on the initial network. "
            f"Two-pass / seed: peak graph {num(ratios.get('graph_peak_two_pass_vs_seed'), '.3f')}"
            f"x, images/s {num(ratios.get('throughput_two_pass_vs_seed'), '.2f')}x. "
            f"One-pass / seed: peak graph {num(ratios.get('graph_peak_one_pass_vs_seed'), '.3f')}"
            f"x, images/s {num(ratios.get('throughput_one_pass_vs_seed'), '.2f')}x.\n\n"
            + step_case_table(result)
        )
    parts.append(
        "### The floor\n\nTimed in rounds in one process (see above): each round runs one "
        "step of every variant and each part of the two-pass step alone; fastest round of "
        "each. Floor = a no-grad forward on the batch + a forward and backward "
        "on as many images as the step selected. Overhead = two-pass step / floor - 1: the "
        "miner, the index bookkeeping, the loss and the optimizer step (the miner and the "
        "optimizer step also timed alone). "
        "*grad forward on batch*: the one-pass step's forward. *seed's arithmetic*: the "
        "seed's passes alone (grad forwards on a, p and n apart, forward and backward on the "
        "selected images in three parts); floor / seed's arithmetic is the most two-pass can "
        "gain over the seed in images/s on this machine.\n\n" + floor_table(step.get("cases", []))
    )
    if pk_cases:
        chunking = step.get("chunking", {})
        note = (
            ""
            if chunking.get("available")
            else f"\n\nGradient caching was not available in this run: {chunking.get('reason')}."
        )
        first = pk_cases[0]["case"]
        parts.append(
            "### Gradient caching: batch size\n\n"
            f"`{first['backbone']}` at {first['image_size']} px, P x K batches of random images "
            f"(K = {first['k']}), FaceNet's semi-hard mining (every anchor-positive pair, so "
            "every image is selected), triplet loss only; two-pass with and without "
            "`Trainer(chunk_size=N)`. Measured alone: *one chunk's forward*, the graph bytes of "
            "one grad forward on N images; *loss graph*, those of the triplet loss on the "
            "cached (U, D) embeddings (its (U, U) distance matrix grows with the batch)."
            + note
            + "\n\n"
            + chunk_table(pk_cases)
        )
    return "\n\n".join(parts)


def miners_section(miners: dict, command: str) -> str:
    """Section 2: miners vs pytorch-metric-learning."""
    if "error" in miners or not miners:
        return "## 2. Miners vs pytorch-metric-learning 2.9.0\n\n" + miners.get("error", "not run")
    rows = [
        [
            r["batch"],
            r["identities"],
            r["miner"],
            f"{(r['ours'] or {}).get('triplets', 0):,}",
            num((r["ours"] or {}).get("seconds"), ".4f"),
            num((r["pml"] or {}).get("seconds"), ".4f"),
            num(r.get("speedup"), ".1f", "x"),
            mib((r["ours"] or {}).get("peak_bytes")),
            mib((r["pml"] or {}).get("peak_bytes")),
            num(r.get("memory_ratio"), ".1f", "x"),
            r.get("note") or "",
        ]
        for r in miners.get("rows", [])
    ]
    headers = [
        "B",
        "ids",
        "miner",
        "triplets",
        "ours s",
        "PML s",
        "speedup",
        "ours MiB",
        "PML MiB",
        "PML / ours memory",
        "note",
    ]
    return (
        "## 2. Miners vs pytorch-metric-learning 2.9.0\n\n"
        f"Command: `{command}`\n\n"
        f"D = {miners.get('dim')}, margin {miners.get('margin')}, squared distance, embedding "
        f"noise {miners.get('noise')}; median time; peak memory: {miners.get('memory_method')}; "
        f"torch threads: {miners.get('threads')}.\n\n" + md_table(headers, rows)
    )


def evaluation_section(evaluation: dict, command: str) -> str:
    """Section 3: the verification protocol vs the loops."""
    if "error" in evaluation or not evaluation:
        return "## 3. Evaluation vs the classic loops\n\n" + evaluation.get("error", "not run")
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
    return (
        "## 3. Evaluation vs the classic loops\n\n"
        f"Command: `{command}`\n\n"
        "10 folds, grids `arange(0, 4, 0.01)` (accuracy) and `arange(0, 4, 0.001)` (VAL at "
        "FAR = 1e-3); median time; every number compared.\n\n" + md_table(headers, rows)
    )


def data_section(data: dict, command: str) -> str:
    """Section 4: the loader against the step's consumption."""
    if "error" in data or not data:
        return "## 4. Data loading\n\n" + data.get("error", "not run")
    rows = []
    for row in data.get("rows", []):
        consumers = row.get("step_consumption") or [{}]
        for consumer in consumers:
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
    headers = [
        "image px",
        "workers",
        "loader images/s",
        "training step (two-pass)",
        "step images/s",
        "loader / step",
    ]
    return (
        "## 4. Data loading vs the training step\n\n"
        f"Command: `{command}`\n\n"
        f"{data.get('images')} synthetic identity images stored as {data.get('stored_size')} px "
        f"PNG files; `IdentityFolder` + the training transform, `PKSampler` batches of "
        f"{data.get('batch')}, {data.get('batches_read')} batches read (the first, worker "
        "start-up, not timed). A loader / step ratio of at least 1 means the loader keeps "
        "up. On this 2-core machine the workers share the cores with the training process, "
        "which these figures (measured alone) do not show.\n\n" + md_table(headers, rows)
    )


def step_paths_workload_text(work: dict) -> str:
    """One workload's setup in words."""
    loss = (
        f"cross-entropy (weight {work['ce_weight']:g}) over {work['num_classes']} classes"
        if work["ce_weight"] > 0
        else "no cross-entropy"
    )
    optimizer = "Adam" if work["optimizer"] == "adam" else "SGD (momentum 0.9)"
    return (
        f"*{work['name']}*: `{work['backbone']}` at {work['image_size']} px, P x K = "
        f"{work['p']} x {work['k']} ({work['images']} images), {loss}, {optimizer} lr "
        f"{work['lr']:g}; {work['rounds']} timed rounds after {work['warmup']} warm-up "
        + ("round" if work["warmup"] == 1 else "rounds")
    )


def step_paths_tables(results: list[dict]) -> tuple[str, str]:
    """(every variant's step time, the ratios) for the step-paths workloads."""
    rows, ratio_rows = [], []
    for result in results:
        name = result["workload"]["name"]
        if "error" in result:
            rows.append([name, result["error"][:120], *[None] * 6])
            continue
        variants = result["variants"]
        auto = (variants.get("auto") or {}).get("fastest_s")
        for row in variants.values():
            rows.append(
                [
                    name,
                    row["label"],
                    row["step"],
                    num(row.get("fastest_s"), ".3f"),
                    num(row.get("median_s"), ".3f"),
                    num(row.get("images_per_s"), ".1f"),
                    num(bench_training_step.ratio(row.get("fastest_s"), auto), ".2f", "x"),
                    mib(row.get("graph_peak_bytes")),
                ]
            )
        ratios = result["ratios"]
        ratio_rows.append(
            [
                name,
                num(ratios.get("two_pass_vs_auto"), ".2f", "x"),
                num(ratios.get("auto_overhead_vs_plain"), "+.1%"),
                num(ratios.get("meter_on_vs_off"), ".2f", "x"),
                num(ratios.get("two_pass_vs_auto_median"), ".2f", "x"),
                num(ratios.get("auto_overhead_vs_plain_median"), "+.1%"),
                num(ratios.get("meter_on_vs_off_median"), ".2f", "x"),
            ]
        )
    headers = [
        "workload",
        "variant",
        "step",
        "step s (fastest)",
        "step s (median)",
        "images/s (fastest)",
        "/ auto",
        "peak graph MiB",
    ]
    ratio_headers = [
        "workload",
        "two-pass / auto",
        "auto over plain",
        "meter on / off",
        "two-pass / auto (medians)",
        "auto over plain (medians)",
        "meter on / off (medians)",
    ]
    return md_table(headers, rows), md_table(ratio_headers, ratio_rows)


def step_paths_section(report: dict, command: str) -> str:
    """Section 5: the default step vs the previous default and a plain loop; the graph meter."""
    head = "## 5. Step paths: the default against the previous default"
    if "error" in report or not report:
        return f"{head}\n\n" + report.get("error", "not run")
    results = report.get("workloads", [])
    works = "; ".join(step_paths_workload_text(r["workload"]) for r in results)
    table, ratios = step_paths_tables(results)
    return (
        f"{head}\n\nCommand: `{command}`\n\n"
        "P x K batches of random images (seeded), FaceNet's semi-hard mining (margin 0.2, "
        "squared distance, the hardest negative when the band is empty, so every image is "
        "selected), triplet loss with margin 0.2. " + works + ". *demo* is `configs/demo.yaml`'s "
        'model, loss and optimizer. Variants: `Trainer(passes="auto")`, the new default (with '
        "this miner the one-pass step: *step* is `trainer.step.name`); `Trainer(passes=2)`, the "
        "previous default (a no-grad mining forward on the batch, then a grad forward on the "
        "selected images); a plain loop without a Trainer as pytorch-metric-learning's examples "
        "write it (`emb = model(x)`, the miner on `emb.detach()`, the loss on `emb` (+ "
        "cross-entropy), `backward`, `optimizer.step`, `zero_grad`); and the default with the "
        "graph meter on (`graph_memory=True`, each step inside `with trainer.meter:`). Every "
        "variant of a workload starts from the same initial network and trains on the same "
        "batches, in one process, in rounds: each round runs one step of every variant, in a "
        "rotating order, on the same batch, so the ratios are taken side by side. *fastest*: a "
        "variant's fastest round (the ratios use it: other jobs only ever add time); *median*: "
        "its median round; *auto over plain*: auto / plain - 1, the step's overhead over the "
        "plain loop; *peak graph MiB*: what the meter measured. These figures are from a shared "
        "2-core CPU (see the load averages above): absolute times move between runs, the "
        "ratios of one run less so.\n\n" + table + "\n\n" + ratios
    )


def gpu_section(gpu: dict | None) -> str:
    """The GPU figures of gpu_check.sh, or what to run to get them."""
    head = "## GPU: resnet50 at 160 px\n\n"
    if not gpu:
        return (
            head + "No GPU was available when these figures were taken. "
            "`bash benchmarks/gpu_check.sh` (at most 8 minutes on one GPU) measures the CUDA "
            "peak allocated memory and images/s of the seed loop, two-pass and one-pass on "
            "resnet50 at 160 px (triplet batch 3 x 128, and P x K = 256), with and without "
            "bf16 autocast, then the largest P x K that fits with and without gradient caching; "
            "it prints a table and writes `gpu_check.json` and `gpu_search.json` into "
            "`${OUT:-.}`. `python benchmarks/run_all.py --gpu-json gpu_check.json "
            "gpu_search.json` adds them here."
        )
    machine = gpu.get("machine", {})
    parts = [
        head + f"Device: {machine.get('gpu')}; date {gpu.get('date')}; command "
        f"`{gpu.get('command')}`."
    ]
    for result in gpu.get("cases", []):
        ratios = result.get("ratios", {})
        parts.append(
            f"### {result['case']['name']}\n\n"
            f"two-pass / seed images/s {num(ratios.get('throughput_two_pass_vs_seed'), '.2f')}x"
            f"; overhead above the floor "
            f"{num(ratios.get('two_pass_overhead_above_floor'), '+.1%')}.\n\n"
            + step_case_table(result)
        )
    if gpu.get("pk_search"):
        rows = [
            [
                r["batch"],
                r["chunk_size"],
                "fits" if "error" not in r else r["error"][:80],
                mib(r.get("cuda_peak_allocated_bytes")),
            ]
            for r in gpu["pk_search"]
        ]
        parts.append(
            "### Largest P x K\n\n" + md_table(["P x K", "chunk", "outcome", "CUDA peak MiB"], rows)
        )
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- closing notes


def throughput_note(step: dict) -> str | None:
    """Why two-pass is not 1.5x the seed: the arithmetic of each, timed alone, bounds it."""
    lines, cheaper = [], False
    for result in _step_cases({"training_step": step}, "triplets"):
        floor = result.get("rounds") or {}
        ratios = result.get("ratios", {})
        measured = ratios.get("throughput_two_pass_vs_seed")
        if "seed_parts_s" not in floor or measured is None or measured >= THROUGHPUT_RATIO:
            continue
        bound = ratios["seed_parts_vs_floor"]
        cheaper = cheaper or bound < 0.95  # a few percent is within the timing noise
        overhead = bench_training_step.ratio(floor.get("seed_step_s"), floor["seed_parts_s"])
        lines.append(
            f"{result['case']['name']}: measured {measured:.2f}x; the arithmetic alone: seed "
            f"{floor['seed_parts_s']:.3f} s, two-pass {floor['floor_s']:.3f} s, so at most "
            f"{bound:.2f}x; the seed's step took {num(overhead, '.2f')}x its arithmetic"
        )
    if not lines:
        return None
    smaller = (
        " In some cases here the seed's arithmetic is even cheaper than ours: it runs smaller "
        "batches (a, p and n apart, the selected images in three parts)."
        if cheaper
        else ""
    )
    return (
        "**Throughput (two-pass >= 1.5x the seed) missed.** Both steps do the same "
        "arithmetic: a forward on the whole batch (the seed's with grad, ours without) and a "
        "forward + backward on the selected images. On a CPU a forward without a graph costs "
        "about what one with a graph costs (*grad forward on batch* against *no-grad forward* "
        "in the floor table) and host copies cost nothing, so the seed's waste shows in memory, "
        "not in time." + smaller + " On a GPU the seed also pays a device-to-host copy of every "
        "batch and a sync per step; gpu_check.sh measures that. " + "; ".join(lines) + "."
    )


def overhead_note(step: dict) -> str | None:
    """Why the two-pass step is more than 10% above its floor: the parts outside it."""
    lines = []
    for result in _step_cases({"training_step": step}, "triplets"):
        rounds = result.get("rounds") or {}
        value = result.get("ratios", {}).get("two_pass_overhead_above_floor")
        if "floor_s" not in rounds or value is None or value <= OVERHEAD:
            continue
        floor = rounds["floor_s"]
        lines.append(
            f"{result['case']['name']}: {value:+.1%}, of which the optimizer step "
            f"{rounds['optimizer_step_s'] / floor:.1%} and the miner "
            f"{rounds.get('miner_s', 0.0) / floor:.1%} of the floor, timed alone"
        )
    if not lines:
        return None
    return (
        "**Overhead above the floor exceeds 10% in some cases.** The floor leaves out the "
        "optimizer step, the miner, the index bookkeeping and the loss; what the parts timed "
        "alone do not explain is Python and allocator time between the parts, and the timing "
        "noise of a shared machine. " + "; ".join(lines) + "."
    )


def graph_note(step: dict) -> str | None:
    """Why a peak-graph target is missed: what the two-pass peak holds, measured alone."""
    lines = []
    for result in _step_cases({"training_step": step}, "triplets"):
        selection = result["case"]["selection"]
        limit = DENSE_GRAPH_RATIO if selection == "dense" else SPARSE_GRAPH_RATIO
        value = result.get("ratios", {}).get("graph_peak_two_pass_vs_seed")
        if value is None or value <= limit:
            continue
        peak = (result["variants"].get("two_pass") or {}).get("graph_peak_bytes")
        seed = (result["variants"].get("seed") or {}).get("graph_peak_bytes")
        forward = (result.get("rounds") or {}).get("selected_forward_graph_bytes")
        rest = None if peak is None or forward is None else (peak - forward) / 1024
        lines.append(
            f"{result['case']['name']}: {value:.4f}x; two-pass peak {mib(peak)} MiB = one grad "
            f"forward on the selected images {mib(forward)} MiB (measured alone) + "
            f"{num(rest, '.0f')} KiB; the seed's peak {mib(seed)} MiB"
        )
    if not lines:
        return None
    return (
        "**Peak graph memory target missed, narrowly.** With every triplet selected the "
        "two-pass step must hold one grad forward on the whole batch, and the seed's peak is "
        "two of them (the previous step's graphs, kept alive by its loop variables, and the "
        "current step's): 0.5x is where the design stands, and the loss graphs on top of the "
        "forward tip it over. The one-pass step is in the same place. " + "; ".join(lines) + "."
    )


def chunk_note(step: dict) -> str | None:
    """Why the chunked peak is above one chunk's forward: the loss graph, measured alone."""
    lines = []
    for result in _step_cases({"training_step": step}, "pk"):
        value = result.get("ratios", {}).get("graph_peak_chunked_vs_one_chunk")
        if value is None or value <= CHUNK_GRAPH_TOLERANCE:
            continue
        floor = result.get("rounds") or {}
        peak = (result["variants"].get("two_pass_chunked") or {}).get("graph_peak_bytes")
        lines.append(
            f"{result['case']['name']}: peak {mib(peak)} MiB, one chunk's forward "
            f"{mib(floor.get('chunk_forward_graph_bytes'))} MiB, the loss graph "
            f"{mib(floor.get('loss_graph_bytes'))} MiB"
        )
    if not lines:
        return None
    return (
        "**Chunked peak above one chunk's worth at the largest batch.** Before the chunks, "
        "the chunked step computes the triplet loss on the cached (U, D) embeddings; its "
        "graph holds the (U, U) distance matrix, which grows with the batch, not the chunk. "
        "With `tiny` at 32 px a chunk's forward is small enough for that matrix to be the "
        "peak" + real_chunk_text(step) + ". " + "; ".join(lines) + "."
    )


def real_chunk_text(step: dict) -> str:
    """What a chunk of a real backbone holds, from the per-image graph bytes of section 1."""
    for result in _step_cases({"training_step": step}, "triplets"):
        floor, case = result.get("rounds") or {}, result["case"]
        if case["backbone"] != "tiny" and floor.get("selected_forward_graph_bytes"):
            per_image = floor["selected_forward_graph_bytes"] / floor["selected_images"]
            return (
                f"; a chunk of 64 images of {case['backbone']} at {case['image_size']} px holds "
                f"about {mib(64 * per_image)} MiB (per image as measured in section 1)"
            )
    return ""


def closing_notes(sections: dict, targets: list[dict]) -> str:
    """Why each missed target was missed, and what was not measured."""
    step = sections.get("training_step") or {}
    notes = [
        note
        for note in (
            graph_note(step),
            chunk_note(step),
            throughput_note(step),
            overhead_note(step),
        )
        if note
    ]
    missed_other = [
        t
        for t in targets
        if t["met"] is False and (t["target"].startswith("miner") or "evaluation" in t["target"])
    ]
    for row in missed_other:
        notes.append(
            f"**{row['target']} ({row['where']}) missed: {num(row['measured'], '.2f')}.** See "
            "the table above; timings of a shared machine move between runs."
        )
    not_measured = [t for t in targets if t["met"] is None]
    if not_measured:
        notes.append(
            "Not measured in this run: "
            + "; ".join(f"{t['target']} ({t['where']})" for t in not_measured)
            + "."
        )
    if not notes:
        notes.append("Every target was met in this run.")
    return "## Closing notes\n\n" + "\n\n".join(f"- {n}" for n in notes)


# --------------------------------------------------------------------------- the report


def render_markdown(results: dict) -> str:
    """BENCHMARKS.md from the combined results."""
    sections = results["sections"]
    step = sections.get("training_step") or {}
    machine = step.get("machine") or results.get("machine") or {}
    commands = results["commands"]
    seconds = results["seconds_total"]
    took = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} minutes"
    head = [
        "# Benchmarks",
        f"Written by `{results['command']}` on {results['date']} ({took}). "
        "Every ratio below was measured in this one run, on this machine:",
        "\n".join(machine_lines(machine, results.get("load_average_after"))),
        "CPU timings were taken on a shared 2-core machine, with other jobs running at the "
        "same time (see the load averages): absolute times are pessimistic and move between "
        "runs by tens of percent; memory figures (graph bytes, RSS) do not depend on the load.",
        "## Targets\n\n" + targets_section(results["targets"]),
    ]
    body = [
        training_section(step, commands.get("training_step", "")),
        miners_section(sections.get("miners") or {}, commands.get("miners", "")),
        evaluation_section(sections.get("evaluation") or {}, commands.get("evaluation", "")),
        data_section(sections.get("data") or {}, commands.get("data", "")),
        step_paths_section(sections.get("step_paths") or {}, commands.get("step_paths", "")),
        gpu_section(results.get("gpu")),
        closing_notes(sections, results["targets"]),
    ]
    return "\n\n".join(head + body) + "\n"


def write_outputs(results: dict, markdown_path: Path, json_path: Path) -> None:
    """Write results.json and BENCHMARKS.md atomically."""
    for path, text in (
        (json_path, json.dumps(results, indent=1) + "\n"),
        (markdown_path, render_markdown(results)),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's quick mode")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where BENCHMARKS.md and results.json go (default: the repository, or "
        "runs/bench_quick with --quick)",
    )
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=SECTIONS, help="sections not to run"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in the timed processes (default 1: on a shared machine an "
        "op split over threads waits for descheduled siblings); 0: torch's default",
    )
    parser.add_argument(
        "--gpu-json",
        type=Path,
        nargs="+",
        default=None,
        help="gpu_check.sh's gpu_check.json (and gpu_search.json)",
    )
    return parser


def read_gpu_reports(paths: list[Path]) -> dict | str | None:
    """gpu_check.sh's reports merged (cases from each, the P x K search from any); an error
    message naming the file when one cannot be read; None without files."""
    merged: dict | None = None
    for path in paths:
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            return f"--gpu-json {path}: cannot read it ({err})"
        if merged is None:
            merged = {**report, "cases": list(report.get("cases", []))}
        else:
            merged["cases"] += report.get("cases", [])
        if report.get("pk_search"):
            merged["pk_search"] = report["pk_search"]
    return merged


def output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(BENCHMARKS.md, results.json) for these arguments."""
    if args.out_dir is not None:
        return args.out_dir / "BENCHMARKS.md", args.out_dir / "results.json"
    if args.quick:
        return QUICK_OUT / "BENCHMARKS.md", QUICK_OUT / "results.json"
    return REPO / "BENCHMARKS.md", HERE / "results.json"


def main(argv: list[str] | None = None) -> int:
    """Run every section, check the targets, write the report."""
    args = get_args_parser().parse_args(argv)
    gpu = read_gpu_reports(args.gpu_json or [])
    if isinstance(gpu, str):
        print(gpu, file=sys.stderr)
        return 2
    markdown_path, json_path = output_paths(args)
    commands_args = section_commands(args.quick, args.threads)
    started = time.perf_counter()
    sections: dict = {}
    with tempfile.TemporaryDirectory(prefix="facenet_bench_") as tmp:
        for name in SECTIONS:
            if name in args.skip:
                continue
            argv_section = list(commands_args[name])
            if name == "data" and (Path(tmp) / "training_step.json").is_file():
                argv_section += ["--step-json", str(Path(tmp) / "training_step.json")]
            sections[name] = run_section(name, argv_section, Path(tmp) / f"{name}.json")
    targets = all_targets(sections)
    results = {
        "command": " ".join(["python benchmarks/run_all.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seconds_total": time.perf_counter() - started,
        "load_average_after": os.getloadavg()[0],
        "commands": {name: script_command(name, commands_args[name]) for name in SECTIONS},
        "targets": targets,
        "sections": sections,
        "gpu": gpu,
    }
    write_outputs(results, markdown_path, json_path)
    print("\n" + targets_section(targets))
    print(f"\nwrote {markdown_path} and {json_path} in {results['seconds_total'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
