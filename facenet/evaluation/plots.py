"""The ROC figures of verification results (matplotlib's object API on the Agg canvas)."""

from __future__ import annotations

from facenet.evaluation.protocol import VerificationResult
from facenet.evaluation.report import figures, val_at_far_label


def _roc_axes(fpr, tpr, auc: float, rate: str):
    """A ``matplotlib.figure.Figure`` (``savefig``, TensorBoard's ``add_figure``) and its axes
    holding the ROC with its AUC, true accept ``rate`` against FAR. Never registered with
    pyplot: no window opens, nothing stays open."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(fpr, tpr, lw=1.5, label=f"ROC (AUC = {auc:.4f})")
    ax.set(ylim=(0.0, 1.01), xlabel="false accept rate (FAR)", ylabel=f"true accept rate ({rate})")
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_roc(result: VerificationResult, log_scale: bool = False, title: str | None = None):
    """The full ROC with its AUC, the EER point and the VAL @ FAR point: a Figure. The VAL
    point is the mean over the test folds, each at the threshold its training folds chose, so
    it can lie off the curve of all pairs; its legend entry says so."""
    fig, ax = _roc_axes(result.roc_fpr, result.roc_tpr, result.auc, "VAL")
    ax.plot([result.eer], [1 - result.eer], "o", label=f"EER = {result.eer:.4f}")
    val = figures(result)["val"]  # words where the FAR target is not resolved
    if isinstance(val, str):  # no point to mark: a VAL the folds cannot measure
        ax.plot([], [], " ", label=f"VAL @ FAR {result.far_target:g}: {val}")
    else:
        folds = f"mean of {result.n_folds} test folds at their own thresholds"
        label = f"{val_at_far_label(val, result.far_target, result.far)}:\n{folds}"
        far = max(result.far, 1e-12) if log_scale else result.far  # a log axis has no 0
        ax.plot([far], [val], "s", label=label)
    if log_scale:
        positive = result.roc_fpr[result.roc_fpr > 0]
        ax.set_xscale("log")
        ax.set_xlim(min(positive.min() if len(positive) else 1e-4, result.far_target), 1.0)
    else:
        ax.plot([0, 1], [0, 1], ":", color="grey", lw=1)
        ax.set_xlim(0.0, 1.0)
    ax.set_title(title or f"ROC ({result.n_pairs} pairs, {result.n_folds} folds)")
    ax.legend(loc="lower right")
    return fig


def plot_tar(result, title: str):
    """A ``TemplateResult``'s ROC, on a log FAR axis, with the TAR read at each FAR its impostor
    pairs resolve: a Figure."""
    fig, ax = _roc_axes(result.fpr, result.tpr, result.auc, "TAR")
    resolved, n = result.resolved(), result.impostor_pairs
    label = f"TAR read at each FAR >= 1/{n} ({n} impostor pairs)"
    ax.plot(list(resolved), list(resolved.values()), "s", label=label)
    ax.set_xscale("log")
    ax.set(xlim=(min(result.tar) / 2, 1.0), title=title)
    ax.legend(loc="upper left")
    return fig
