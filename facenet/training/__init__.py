"""Training: the step paths (``step``) <- the engine (``engine.Trainer``: optimizer, scaler,
clipping, the non-finite policy, one epoch) <- the run (``run``: epochs, evaluation schedule,
signals, exit codes). Beside them: ``build`` (every mapping from a configuration to objects),
``state`` (checkpoint contents and resuming), ``validation``, ``logger``, ``run_dir``, ``optim``.

Nothing outside this package imports it (the command-line layer excepted).
"""
