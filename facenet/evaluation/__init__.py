"""Face verification: the LFW protocol (10-fold accuracy, VAL@FAR, AUC, EER, ROC), the
publishers' evaluation presets, and embedding pairs lists in eval mode.
"""

from facenet.evaluation.embedding import embed_dataset, embed_pair_list
from facenet.evaluation.presets import ALIGN_PRESETS, EVAL_PRESETS, PRESET_NAMES
from facenet.evaluation.protocol import (
    VerificationResult,
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
    plot_roc,
)

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
    "pair_distances",
    "plot_roc",
]
