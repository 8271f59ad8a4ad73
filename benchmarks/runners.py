"""One runner per benchmark: its name, its command line, and ``run(quick) -> report``.

A runner calls its benchmark module's ``main`` in this process (each benchmark forks its own
measurement children) with ``--json <workdir>/<name>.json`` and returns that JSON report, with
the exit status, the wall time and the arguments added. ``benchmarks.run_all`` runs them in
:data:`RUNNERS` order and gathers the reports in ``benchmarks/results.json``.
"""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path

__all__ = [
    "Runner",
    "TrainingStepRunner",
    "MinersRunner",
    "EvaluationRunner",
    "DataRunner",
    "StepPathsRunner",
    "PipelineRunner",
    "RUNNERS",
    "SECTIONS",
]


class Runner:
    """A benchmark run through its module's ``main``.

    Args:
        workdir: the folder its JSON report is written into (``<name>.json``).
        threads: torch intra-op threads (0: torch's default; for benchmarks that take it).

    Subclasses set :attr:`name` (the section of results.json), :attr:`module` (under
    ``benchmarks``) and :meth:`arguments`.
    """

    name = ""
    module = ""
    takes_threads = True  # whether the benchmark has a --threads flag

    def __init__(self, workdir: Path, threads: int = 1):
        self.workdir = Path(workdir)
        self.threads = threads

    @property
    def json_path(self) -> Path:
        """Where the benchmark writes its report."""
        return self.workdir / f"{self.name}.json"

    def arguments(self, quick: bool) -> list[str]:
        """The benchmark's own arguments (``--json`` is added by :meth:`run`).

        Args:
            quick: its quick mode (seconds instead of minutes).
        """
        return ["--quick"] if quick else []

    def extra_arguments(self) -> tuple[list[str], list[str]]:
        """Arguments naming this run's files: ``(as run, as shown in the command)``."""
        return [], []

    def _thread_args(self) -> list[str]:
        return ["--threads", str(self.threads)] if self.takes_threads and self.threads else []

    def command(self, quick: bool) -> str:
        """The command that repeats this benchmark alone, from the repository root.

        Args:
            quick: its quick mode.
        """
        shown = self.extra_arguments()[1]
        argv = [*self.arguments(quick), *self._thread_args(), *shown, "--json", f"{self.name}.json"]
        return " ".join(["python -m benchmarks." + self.module, *argv])

    def run(self, quick: bool) -> dict:
        """Run the benchmark; its JSON report plus ``exit_status``, ``seconds`` and ``argv``.

        Args:
            quick: its quick mode.

        Returns:
            The report, or ``{"error": ..., "seconds": ...}`` when it wrote none.
        """
        argv = [*self.arguments(quick), *self._thread_args(), *self.extra_arguments()[0]]
        print(f"\n######## {self.name}: {' '.join(argv)}", flush=True)
        started = time.perf_counter()
        main = importlib.import_module("benchmarks." + self.module).main
        try:
            code = main([*argv, "--json", str(self.json_path)])
        except SystemExit as stop:  # argparse or a refusal inside the benchmark
            code = stop.code if isinstance(stop.code, int) else 1
        seconds = time.perf_counter() - started
        if not self.json_path.is_file():
            error = f"{self.name} wrote no report (exit status {code})"
            return {"error": error, "seconds": seconds}
        report = json.loads(self.json_path.read_text(encoding="utf-8"))
        return {**report, "exit_status": code, "seconds": seconds, "argv": argv}


class TrainingStepRunner(Runner):
    """The seed's loop against the two-pass and one-pass steps, the floor, gradient caching."""

    name, module = "training_step", "bench_training_step"


class MinersRunner(Runner):
    """Our miners against pytorch-metric-learning 2.9.0 (imported only when run)."""

    name, module = "miners", "bench_miners"

    def arguments(self, quick: bool) -> list[str]:
        """Quick: a short time budget per case."""
        return ["--quick", "--time-budget", "0.2"] if quick else []


class EvaluationRunner(Runner):
    """The verification protocol against the classic loops."""

    name, module = "evaluation", "bench_evaluation"
    takes_threads = False

    def arguments(self, quick: bool) -> list[str]:
        """Quick: one size, few repeats."""
        return ["--sizes", "2000", "--repeats", "3", "--reference-repeats", "1"] if quick else []


class DataRunner(Runner):
    """IdentityFolder + transforms, 0 and 2 workers, against the step's consumption."""

    name, module = "data", "bench_data"

    def extra_arguments(self) -> tuple[list[str], list[str]]:
        """The training step's report of this run, when it ran first, for the comparison."""
        name = f"{TrainingStepRunner.name}.json"
        step_json = self.workdir / name
        return (["--step-json", str(step_json)] if step_json.is_file() else []), [
            "--step-json",
            name,
        ]


class StepPathsRunner(Runner):
    """The default step against the previous default and a plain loop; the graph meter."""

    name, module = "step_paths", "bench_step_paths"


class PipelineRunner(Runner):
    """Our loader against torchvision's, training end to end against the step alone, the
    folder index's build time."""

    name, module = "pipeline", "bench_pipeline"


# In this order: the data section reads the training step's report.
RUNNERS = (
    TrainingStepRunner,
    MinersRunner,
    EvaluationRunner,
    DataRunner,
    StepPathsRunner,
    PipelineRunner,
)
SECTIONS = tuple(runner.name for runner in RUNNERS)
