"""The ROC figure of a verification result (matplotlib's object API on the Agg canvas)."""

from __future__ import annotations

from facenet.evaluation.protocol import VerificationResult
from facenet.evaluation.report import val_at_far_label


def plot_roc(result: VerificationResult, log_scale: bool = False, title: str | None = None):
    """The full ROC with its AUC, the EER point and the VAL @ FAR point: a
    ``matplotlib.figure.Figure`` (``savefig``, TensorBoard's ``add_figure``). Never registered
    with pyplot: no window opens, nothing stays open."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(result.roc_fpr, result.roc_tpr, lw=1.5, label=f"ROC (AUC = {result.auc:.4f})")
    ax.plot([result.eer], [1 - result.eer], "o", label=f"EER = {result.eer:.4f}")
    label = val_at_far_label(result.val, result.far_target, result.far)
    far = max(result.far, 1e-12) if log_scale else result.far  # a log axis has no 0
    ax.plot([far], [result.val], "s", label=label)
    if log_scale:
        positive = result.roc_fpr[result.roc_fpr > 0]
        ax.set_xscale("log")
        ax.set_xlim(min(positive.min() if len(positive) else 1e-4, result.far_target), 1.0)
    else:
        ax.plot([0, 1], [0, 1], ":", color="grey", lw=1)
        ax.set_xlim(0.0, 1.0)
    ax.set(ylim=(0.0, 1.01), xlabel="false accept rate (FAR)", ylabel="true accept rate (VAL)")
    ax.set_title(title or f"ROC ({result.n_pairs} pairs, {result.n_folds} folds)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    return fig
