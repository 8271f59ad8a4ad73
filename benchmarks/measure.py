"""The harness every benchmark shares.

Each benchmark is a module with ``main(argv)`` built on :func:`run_benchmark`: ``--quick``,
``--threads N`` and ``--json PATH`` (its report, written atomically). Memory figures carry the
names of ``facenet.memory.MEMORY_KEYS``, the names of the trainer's epoch records in
``metrics.jsonl``, so that one figure has one definition and one name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.forking import run_forked
from facenet.errors import FacenetError
from facenet.files import write_text_atomic

# Benchmark-only: the process's RSS before its steps (peak RSS minus this = what they added).
RSS_BEFORE_BYTES = "rss_before_bytes"


def run_benchmark(
    doc: str,
    argv: list[str] | None,
    measure: Callable[..., dict],
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> int:
    """Parse ``argv`` (``--quick``, ``--json PATH``, ``--threads N`` and what ``add_options``
    adds; ``doc``'s first line describes the benchmark), set the torch threads, write
    ``measure(args)`` to ``--json``.

    A :class:`FacenetError` raised by ``measure`` is printed in one line: exit status 2.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seconds instead of minutes")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    if add_options:
        add_options(parser)
    args = parser.parse_args(argv)
    try:
        if args.threads < 0:
            raise FacenetError(f"--threads must be >= 0, got {args.threads}")
        if args.threads:
            torch.set_num_threads(args.threads)
        report = measure(args)
    except FacenetError as err:
        print(err, file=sys.stderr)
        return 2
    write_report(args.json, report)
    if args.json:
        print(f"wrote {args.json}")
    return report.get("exit_status", 0)


def time_rounds(tasks: dict, batches: list, rounds: int, device: str) -> dict:
    """Each task ``task(batch)`` once per round on the round's batch, in an order rotated by
    the round (no task always runs right after the same one); after a warm-up round,
    ``{name: [(seconds, output), ...]}``."""
    runs: dict[str, list] = {name: [] for name in tasks}
    for index in range(1 + rounds):
        batch = batches[index % len(batches)]
        shift = index % len(tasks)
        for name in list(tasks)[shift:] + list(tasks)[:shift]:
            seconds, output = timed(device, lambda t=tasks[name], b=batch: t(b))
            if index:
                runs[name].append((seconds, output))
    return runs


def describe_machine(device: str) -> dict:
    """CPU model, cores, torch and its threads, Python, the load, and the GPU when used."""
    cpu_model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        names = [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")]
        cpu_model = names[0] if names else cpu_model
    machine = {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": os.getloadavg()[0],
    }
    if torch.device(device).type == "cuda":  # in a child: this process must not touch CUDA
        gpu = run_forked(lambda: {"name": torch.cuda.get_device_name(0)})
        machine["gpu"] = gpu.get("name", "unknown")
    return machine


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is not positive."""
    return None if num is None or den is None or den <= 0 else num / den


def show(row: dict) -> None:
    """One measured row on the console, as it goes into the report."""
    print(json.dumps(row, default=str), flush=True)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work, so that timings and allocator figures are complete."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device | str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(seconds, fn())``, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def write_report(path: Path | None, report: dict) -> None:
    """Write a benchmark's JSON report atomically (``path`` None: nowhere); a timed-out run
    keeps what was written last."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(report, indent=1) + "\n")


def stop_workers(loader) -> None:
    """Stop a DataLoader's persistent workers now (they otherwise live until it is collected)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
