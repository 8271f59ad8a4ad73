"""Every benchmark in one run: benchmarks/results.json and the tables of BENCHMARKS.md.

Runs the benchmarks of :data:`RUNNERS` in order, each through its module's ``main`` with
``--json <tmp>/<name>.json`` (each forks its own measurement children), checks the targets
(:mod:`benchmarks.targets`), writes results.json, then rewrites the tables of BENCHMARKS.md
between their markers (:mod:`benchmarks.tables`); the prose around them is left alone.

    python -m benchmarks.run_all                  # make bench: results.json, BENCHMARKS.md
    python -m benchmarks.run_all --quick          # seconds; writes into runs/bench_quick/
    python -m benchmarks.run_all --tables-only    # the tables again from results.json
    python -m benchmarks.run_all --tables-only --gpu-json gpu_check.json gpu_search.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from benchmarks.measure import (
    OneLineParser,
    input_path,
    output_path,
    read_report,
    write_report,
)
from benchmarks.tables import fill_tables, render_tables, targets_table
from benchmarks.targets import all_targets
from facenet.cli.common import positive_int
from facenet.errors import FacenetError
from facenet.files import write_text_atomic

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE.parent / "BENCHMARKS.md"  # the hand-written document whose tables are filled
QUICK_OUT = HERE.parent / "runs" / "bench_quick"

# (section of results.json, module under benchmarks), in the order of BENCHMARKS.md
RUNNERS = (
    ("training_step", "bench_training_step"),
    ("miners", "bench_miners"),
    ("evaluation", "bench_evaluation"),
    ("pipeline", "bench_pipeline"),
)
SECTIONS = tuple(name for name, _ in RUNNERS)


def command(name: str, module: str, argv: list[str]) -> str:
    """The command that repeats one benchmark alone, from the repository root."""
    return " ".join(["python -m benchmarks." + module, *argv, "--json", f"{name}.json"])


def run_one(name: str, module: str, argv: list[str], workdir: Path) -> dict:
    """One benchmark's report plus ``exit_status``, ``seconds`` and ``argv``, or
    ``{"error", "seconds"}`` when it wrote none."""
    print(f"\n######## {name}: {' '.join(argv)}", flush=True)
    path, started = workdir / f"{name}.json", time.perf_counter()
    try:
        code = importlib.import_module("benchmarks." + module).main([*argv, "--json", str(path)])
    except SystemExit as stop:  # argparse or a refusal inside the benchmark
        code = stop.code if isinstance(stop.code, int) else 1
    seconds = time.perf_counter() - started
    if not path.is_file():
        return {"error": f"{name} wrote no report (exit status {code})", "seconds": seconds}
    return {
        **read_report(path, name),
        "exit_status": code,
        "seconds": seconds,
        "argv": argv,
    }


def measure(args: argparse.Namespace, argv: list[str], gpu: dict | None) -> dict:
    """Run the benchmarks not skipped and check the targets: the combined results."""
    started = time.perf_counter()
    sections, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="facenet_bench_") as tmp:
        bench_argv = ["--quick"] * args.quick + ["--threads", str(args.threads)]
        for name, module in RUNNERS:
            commands[name] = command(name, module, bench_argv)
            if name not in args.skip:
                sections[name] = run_one(name, module, bench_argv, Path(tmp))
    return {
        "command": " ".join(["python -m benchmarks.run_all", *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seconds_total": time.perf_counter() - started,
        "load_average_after": os.getloadavg()[0],
        "commands": commands,
        "targets": all_targets(sections),
        "sections": sections,
        "gpu": gpu,
    }


def read_gpu_reports(paths: list[Path]) -> dict | None:
    """gpu_check.sh's reports merged (the cases of each, other keys from the first that has
    them); None without files."""
    merged = None
    for path in paths:
        report = read_report(path, "--gpu-json")
        cases = [*(merged or {}).get("cases", []), *report.get("cases", [])]
        merged = {**report, **(merged or {}), "cases": cases}
    return merged


def get_args_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="every benchmark's quick mode")
    add("--out-dir", type=partial(output_path, folder=True), help="where BENCHMARKS.md and "
        "results.json go (default: the repository, or runs/bench_quick with --quick)")  # fmt: skip
    add("--skip", nargs="*", default=[], choices=SECTIONS, help="not to run")
    add("--threads", type=positive_int, default=1, help="torch intra-op threads in the timed "
        "processes (default 1: on a shared machine an op split over threads waits for "
        "descheduled siblings)")  # fmt: skip
    add("--gpu-json", type=input_path, nargs="+", default=[], help="gpu_check.sh's reports")
    add(
        "--tables-only",
        action="store_true",
        help="run nothing: fill BENCHMARKS.md's tables "
        "from the existing results.json (with --gpu-json, add gpu_check.sh's figures first)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run every section (or none, with --tables-only), write results.json and the tables."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    out = args.out_dir or (QUICK_OUT if args.quick else None)
    markdown_path = out / "BENCHMARKS.md" if out else TEMPLATE
    json_path = out / "results.json" if out else HERE / "results.json"
    try:
        gpu = read_gpu_reports(args.gpu_json)
        if args.tables_only:
            results = read_report(json_path, "--tables-only")
            results["gpu"] = gpu or results.get("gpu")
        else:
            results = measure(args, argv, gpu)
        write_report(json_path, results)
        template = TEMPLATE.read_text(encoding="utf-8")
        markdown, missing = fill_tables(template, render_tables(results))
        write_text_atomic(markdown_path, markdown)
    except (FacenetError, OSError) as err:  # OSError: the markdown, read or written
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n" + targets_table(results))
    if missing:
        print(f"\nnot measured in this run: {', '.join(missing)}")
    print(f"\nwrote {markdown_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
