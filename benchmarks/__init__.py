"""The benchmarks: measurements of the training step, the miners, the evaluation protocol and
data loading against their baselines, and the memory report.

Run from the repository root as modules, e.g. ``python -m benchmarks.run_all`` or
``python -m benchmarks.memory_report``; benchmark modules import each other as
``from benchmarks.seed_loop import ...``. The installed ``facenet`` package never imports them.
"""
