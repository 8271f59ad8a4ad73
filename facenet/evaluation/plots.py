"""The ROC figure of a verification result (matplotlib's object API on the Agg canvas)."""

from __future__ import annotations

from typing import Any

from facenet.evaluation.protocol import VerificationResult
from facenet.evaluation.report import val_at_far_label


def plot_roc(
    result: VerificationResult,
    path: Any = None,
    log_scale: bool = False,
    title: str | None = None,
):
    """Plot the full ROC with its AUC, the EER point and the VAL @ FAR point.

    The figure is built with matplotlib's object API on the Agg canvas: it is never registered
    with pyplot, so no window opens and nothing stays open after saving.

    Args:
        result: a :class:`VerificationResult`.
        path: where to save a PNG; the figure is then released and None returned.
        log_scale: logarithmic FAR (x) axis, to read the low-FAR end.
        title: the plot title; default "ROC (N pairs, F folds)".

    Returns:
        The ``matplotlib.figure.Figure`` when ``path`` is None (e.g. for TensorBoard's
        ``add_figure``), else None.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(result.roc_fpr, result.roc_tpr, lw=1.5, label=f"ROC (AUC = {result.auc:.4f})")
    ax.plot([result.eer], [1 - result.eer], "o", label=f"EER = {result.eer:.4f}")
    ax.plot(
        [max(result.far, 1e-12) if log_scale else result.far],
        [result.val],
        "s",
        label=val_at_far_label(result.val, result.far_target, result.far),
    )
    _style_roc_axes(ax, result, log_scale)
    ax.set_title(title or f"ROC ({result.n_pairs} pairs, {result.n_folds} folds)")
    if path is None:
        return fig
    fig.savefig(path, format="png")
    return None


def _style_roc_axes(ax, result: VerificationResult, log_scale: bool) -> None:
    """Axis labels, limits, grid and legend of the ROC plot."""
    if log_scale:
        positive = result.roc_fpr[result.roc_fpr > 0]
        ax.set_xscale("log")
        ax.set_xlim(min(positive.min() if len(positive) else 1e-4, result.far_target), 1.0)
    else:
        ax.plot([0, 1], [0, 1], ":", color="grey", lw=1)
        ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.01)
    ax.set_xlabel("false accept rate (FAR)")
    ax.set_ylabel("true accept rate (VAL)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
