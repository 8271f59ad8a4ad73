"""After training: load a trained model in one call (``loading``), embed a folder (``embed``),
match probes against a gallery (``identify``), export with a parity check (``export``), and the
thresholds to deploy (``thresholds``). Import from the submodules: a name has one home."""
