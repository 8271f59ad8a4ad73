"""Training: the step paths (``step``) <- the engine (``engine.Trainer``: the update, the
non-finite policy, one epoch) <- the loop (``loop.Run``: epochs, evaluation, checkpoints,
signals) <- ``run`` (exit codes). Beside them: ``build`` (configuration to objects), ``state``
(checkpoints and resuming), ``validation``, ``logger``, ``run_dir``, ``optim``.

Nothing outside this package imports it (the command-line layer excepted).
"""
