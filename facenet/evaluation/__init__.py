"""Face verification: the LFW protocol (10-fold accuracy, VAL@FAR, AUC, EER, ROC), the
publishers' evaluation presets, embedding pairs lists in eval mode, the one verification path
(``facenet.evaluation.verify.verify``) and the one way its figures are written (``report``).

``verify`` is imported from its module, not re-exported here: a package attribute named like
the submodule would hide the module itself (``import facenet.evaluation.verify as m`` would
give the function).
"""

from facenet.evaluation.embedding import embed_dataset, embed_pair_list
from facenet.evaluation.plots import plot_roc
from facenet.evaluation.presets import ALIGN_PRESETS, EVAL_PRESETS, PRESET_NAMES
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
    "default_thresholds",
    "embed_dataset",
    "embed_pair_list",
    "evaluate_embeddings",
    "evaluate_verification",
    "figures",
    "figures_line",
    "pair_distances",
    "plot_roc",
    "val_at_far_label",
]
