"""The harness every benchmark shares.

Each benchmark is a module with ``main(argv)`` built on :func:`run_benchmark`: ``--quick``,
``--threads N`` and ``--json PATH`` (its report, written atomically); its arguments are checked
by the types here before anything runs, and a bad one is one line, exit 2. Memory figures carry the
names of ``facenet.memory.MEMORY_KEYS``, the names of the trainer's epoch records in
``metrics.jsonl``, so that one figure has one definition and one name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.forking import run_forked
from facenet.cli.common import positive_int
from facenet.errors import FacenetError
from facenet.files import json_safe, write_text_atomic

# Benchmark-only: the process's RSS before its steps (peak RSS minus this = what they added).
RSS_BEFORE_BYTES = "rss_before_bytes"


class OneLineParser(argparse.ArgumentParser):
    """Every bad argument (a type refused, a check of the benchmark) in one line, exit 2; an
    output (an :func:`output_path` argument) that is also another path argument is refused."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        flagged = [(a, getattr(parsed, a.dest, None)) for a in self._actions if a.option_strings]
        paths = {a.option_strings[0]: p.resolve() for a, p in flagged if isinstance(p, Path)}
        for action, path in flagged:
            flag = action.option_strings[0]
            if getattr(action.type, "func", action.type) is output_path and flag in paths:
                for other in paths:
                    if other != flag and paths[other] == paths[flag]:
                        self.error(f"{flag} {path}: also given as {other}")
        return parsed


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0 (NaN, inf and 0 never end a budget)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text}: must be a finite number > 0")
    return value


def input_path(text: str, folder: bool = False) -> Path:
    """An argparse ``type``: an existing regular file (no FIFO to block on), or ``folder``."""
    kind = "folder" if folder else "regular file"
    if not (Path(text).is_dir() if folder else Path(text).is_file()):
        raise argparse.ArgumentTypeError(f"{text}: no such {kind}")
    return Path(text)


def output_path(text: str, folder: bool = False) -> Path:
    """An argparse ``type``: a file (``folder``: a folder) this process can write; the folders
    missing on its way are created when it is written, not now."""
    path = Path(text)
    if path.exists() and path.is_dir() != folder:
        raise argparse.ArgumentTypeError(f"{text}: is {'not ' if folder else ''}a folder")
    where = path.absolute() if folder else path.absolute().parent
    nearest = next(p for p in (where, *where.parents) if p.exists())
    if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {nearest}")
    return path


def device_name(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N``, checked without touching CUDA."""
    try:
        measured = torch.device(text).type in ("cpu", "cuda")
    except RuntimeError:
        measured = False
    if not measured:
        raise argparse.ArgumentTypeError(f"{text}: not a device measured here (cpu, cuda:N)")
    return text


def benchmark_parser(doc: str, quick: bool = True) -> OneLineParser:
    """``--json PATH``, ``--threads N`` and (``quick``) ``--quick``; ``doc``'s first line
    describes the benchmark."""
    parser = OneLineParser(description=doc.splitlines()[0])
    if quick:
        parser.add_argument("--quick", action="store_true", help="seconds instead of minutes")
    parser.add_argument("--json", type=output_path, help="write the report here")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    return parser


def run_benchmark(parser: argparse.ArgumentParser, argv: list[str] | None, measure) -> int:
    """Parse ``argv``, set the torch threads, write ``measure(args)`` (a dict; its ``machine``
    by default this CPU machine as it was at the start) to ``--json``; a :class:`FacenetError`
    is printed in one line: exit status 2."""
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = describe_machine("cpu")
    try:
        report = measure(args)
        report.setdefault("machine", machine)["load_average_after"] = os.getloadavg()[0]
        write_report(args.json, report)
    except FacenetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(f"wrote {args.json}")
    return report.get("exit_status", 0)


def time_rounds(tasks: dict, batches: list, rounds: int, device: str) -> dict:
    """Each task ``task(batch)`` once per round on the round's batch, in an order rotated by
    the round (no task always runs right after the same one); after a warm-up round,
    ``{name: [seconds, ...]}``."""
    runs: dict[str, list] = {name: [] for name in tasks}
    for index in range(1 + rounds):
        shift = index % len(tasks)
        for name in list(tasks)[shift:] + list(tasks)[:shift]:
            seconds, _ = timed(device, partial(tasks[name], batches[index % len(batches)]))
            if index:
                runs[name].append(seconds)
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
    if path is None:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(json_safe(report), indent=1, default=str) + "\n")
    except OSError as err:
        raise FacenetError(f"--json {path}: cannot write it ({err.strerror or err})") from None


def read_report(path: Path, what: str) -> dict:
    """A JSON report (a dict), or a :class:`FacenetError` naming ``what`` and ``path``."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise FacenetError(f"{what} {path}: cannot read it ({err})") from None
    if not isinstance(report, dict):
        raise FacenetError(f"{what} {path}: not a JSON object")
    return report


def stop_workers(loader) -> None:
    """Stop a DataLoader's persistent workers now (they otherwise live until it is collected)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
