"""The benchmarks: measurements of the training step, the miners, the evaluation protocol and
data loading against their baselines, and the memory report.

Run from the repository root as modules, e.g. ``python -m benchmarks.run_all``; each benchmark's
``main(argv)`` takes ``--quick``, ``--threads N`` and ``--json PATH`` (``benchmarks.measure``
holds the harness they share). The installed ``facenet`` package never imports them.
"""
