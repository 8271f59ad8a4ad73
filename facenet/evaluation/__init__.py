"""Face verification: the LFW protocol, the settings and publishers' presets it runs under,
embedding pairs in eval mode, and the way its figures are written.

``verify`` is imported from its module (``facenet.evaluation.verify``), not re-exported here:
a package attribute of the submodule's name would hide the module.
"""

from facenet.evaluation.embedding import embed_pair_list
from facenet.evaluation.plots import plot_roc
from facenet.evaluation.presets import ALIGN_PRESETS, EVAL_PRESETS, PRESET_NAMES, VerifySettings
from facenet.evaluation.protocol import (
    VerificationResult,
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)
from facenet.evaluation.report import figures, figures_line, val_at_far_label

__all__ = [
    "ALIGN_PRESETS",
    "EVAL_PRESETS",
    "PRESET_NAMES",
    "VerificationResult",
    "VerifySettings",
    "default_thresholds",
    "embed_pair_list",
    "evaluate_embeddings",
    "evaluate_verification",
    "figures",
    "figures_line",
    "pair_distances",
    "plot_roc",
    "val_at_far_label",
]
