"""Training: the step paths (``step``: two-pass and one-pass; ``chunked``: gradient caching,
loaded when ``train.chunk_size`` asks for it) <- the engine (``engine.Trainer``: the update, the
non-finite policy, one epoch) <- the loop (``loop.fit``: epochs, evaluation, checkpoints) <-
``run`` (exit codes). Beside them: ``build`` (configuration to objects), ``state`` (checkpoints
and resuming), ``validation``, ``console`` (what a run prints, stop signals), ``logger``,
``run_dir``, ``optim``, ``cache`` (the frozen stages' outputs).

Nothing outside this package imports it (the command-line layer excepted).
"""
