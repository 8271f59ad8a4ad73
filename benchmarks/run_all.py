"""Every benchmark in one run: benchmarks/results.json and the tables of BENCHMARKS.md.

Runs the runners of :mod:`benchmarks.runners` in order (training step, miners, evaluation, data,
step paths), checks the targets (:mod:`benchmarks.targets`), writes results.json, then rewrites
the tables of BENCHMARKS.md between their ``<!-- table:NAME -->`` markers
(:mod:`benchmarks.tables`). The prose around them is written by hand and left alone.

    python -m benchmarks.run_all                  # make bench: results.json, BENCHMARKS.md
    python -m benchmarks.run_all --quick          # seconds; writes into runs/bench_quick/
    python -m benchmarks.run_all --tables-only    # the tables again from results.json
    python -m benchmarks.run_all --gpu-json gpu_check.json gpu_search.json  # gpu_check.sh's
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

from benchmarks.runners import RUNNERS, SECTIONS
from benchmarks.tables import fill_tables, render_tables, targets_table
from benchmarks.targets import all_targets
from facenet.files import write_text_atomic

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TEMPLATE = REPO / "BENCHMARKS.md"  # the hand-written document whose tables are filled
QUICK_OUT = REPO / "runs" / "bench_quick"


def run_sections(quick: bool, threads: int, skip: list[str]) -> tuple[dict, dict]:
    """Run every runner not in ``skip``; ``(sections, commands)`` by section name.

    Args:
        quick: every benchmark's quick mode.
        threads: torch intra-op threads of the timed processes.
        skip: section names not to run.
    """
    sections, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="facenet_bench_") as tmp:
        for runner_class in RUNNERS:
            runner = runner_class(Path(tmp), threads)
            commands[runner.name] = runner.command(quick)
            if runner.name not in skip:
                sections[runner.name] = runner.run(quick)
    return sections, commands


def write_markdown(results: dict, template: Path, path: Path) -> list[str]:
    """``template`` with its tables filled from ``results``, written to ``path``.

    Args:
        results: the combined results (as in results.json).
        template: the hand-written BENCHMARKS.md with table markers.
        path: where the filled document goes.

    Returns:
        The markers that got no table (not measured in this run).
    """
    markdown, missing = fill_tables(template.read_text(encoding="utf-8"), render_tables(results))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, markdown)
    return missing


def write_json(results: dict, path: Path) -> None:
    """results.json, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(results, indent=1) + "\n")


def read_gpu_reports(paths: list[Path]) -> dict | str | None:
    """gpu_check.sh's reports merged (cases from each, the P x K search from any); an error
    message naming the file when one cannot be read; None without files.

    Args:
        paths: gpu_check.json and gpu_search.json, or either.
    """
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
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="not to run")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in the timed processes (default 1: on a shared machine an "
        "op split over threads waits for descheduled siblings); 0: torch's default",
    )
    parser.add_argument(
        "--gpu-json", type=Path, nargs="+", default=None, help="gpu_check.sh's JSON reports"
    )
    parser.add_argument(
        "--tables-only",
        action="store_true",
        help="run nothing: fill BENCHMARKS.md's tables from the existing results.json "
        "(with --gpu-json, add gpu_check.sh's figures to it first)",
    )
    return parser


def output_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """(BENCHMARKS.md, results.json) for these arguments."""
    if args.out_dir is not None:
        return args.out_dir / "BENCHMARKS.md", args.out_dir / "results.json"
    if args.quick:
        return QUICK_OUT / "BENCHMARKS.md", QUICK_OUT / "results.json"
    return TEMPLATE, HERE / "results.json"


def measure(args: argparse.Namespace, argv: list[str], gpu: dict | None) -> dict:
    """Run the benchmarks and check the targets: the combined results."""
    started = time.perf_counter()
    sections, commands = run_sections(args.quick, args.threads, args.skip)
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


def main(argv: list[str] | None = None) -> int:
    """Run every section (or none, with --tables-only), write results.json and the tables."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = get_args_parser().parse_args(argv)
    gpu = read_gpu_reports(args.gpu_json or [])
    if isinstance(gpu, str):
        print(gpu, file=sys.stderr)
        return 2
    markdown_path, json_path = output_paths(args)
    if args.tables_only:
        results = json.loads(json_path.read_text(encoding="utf-8"))
        results["gpu"] = gpu or results.get("gpu")
    else:
        results = measure(args, argv, gpu)
    write_json(results, json_path)
    missing = write_markdown(results, TEMPLATE, markdown_path)
    print("\n" + targets_table(results))
    if missing:
        print(f"\nnot measured in this run: {', '.join(missing)}")
    print(f"\nwrote {markdown_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
