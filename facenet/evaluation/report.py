"""The one way verification figures are written, wherever they are printed.

Training's console lines, the evaluate command's tables and ``VerificationResult.summary`` all
write a result through these functions, so a figure reads the same everywhere::

    test acc 0.9655±0.0147 VAL 0.5510 @ FAR 0.001 (achieved 0.0010) AUC 0.9960 EER 0.0400

The functions read a result by attribute (any ``VerificationResult``) and never import the
protocol module: the protocol imports this one (for ``summary`` and the ROC legend).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "FIGURE_KEYS",
    "figure_cells",
    "figures",
    "figures_line",
    "fold_table",
    "result_table",
    "sets_table",
    "val_at_far_label",
]

# The figures a run logs and a summary reports; per-fold arrays and curves stay in the result.
FIGURE_KEYS = ("accuracy_mean", "accuracy_std", "val", "val_std", "far", "auc", "eer")


def val_at_far_label(val: float, far_target: float, far: float) -> str:
    """The one way VAL at FAR is written: ``VAL 0.4680 @ FAR 0.001 (achieved 0.0030)``.

    Args:
        val: the VAL (true accept rate) measured.
        far_target: the FAR the thresholds aimed at.
        far: the FAR achieved on the test folds at those thresholds.
    """
    return f"VAL {val:.4f} @ FAR {far_target:g} (achieved {far:.4f})"


def figures(result) -> dict:
    """The reported figures of a VerificationResult, the threshold and its distance included.

    ``threshold`` is the mean over folds of the accuracy threshold each fold chose; a pair is
    called "same" when its ``distance`` is below it.

    Args:
        result: a ``VerificationResult``.
    """
    out = {key: float(getattr(result, key)) for key in FIGURE_KEYS}
    out["far_target"] = float(result.far_target)
    out["threshold"] = float(result.threshold)
    out["distance"] = result.threshold_distance
    return out


def figure_cells(values: Mapping) -> dict[str, str]:
    """Each reported figure as text: ``accuracy`` (mean±std), ``val`` (the VAL@FAR label),
    ``auc`` and ``eer``; the line and the table rows are built from these cells.

    Args:
        values: :func:`figures` of a result (or a record of them, e.g. a run's summary).
    """
    return {
        "accuracy": f"{values['accuracy_mean']:.4f}±{values['accuracy_std']:.4f}",
        "val": val_at_far_label(values["val"], values["far_target"], values["far"]),
        "auc": f"{values['auc']:.4f}",
        "eer": f"{values['eer']:.4f}",
    }


def figures_line(name: str, values: Mapping) -> str:
    """``name acc 0.9685±0.0123 VAL 0.4680 @ FAR 0.001 (achieved 0.0030) AUC 0.9947 EER 0.0400``.

    Args:
        name: what was evaluated (may be empty: the line then starts with ``acc``).
        values: :func:`figures` of a result.
    """
    cells = figure_cells(values)
    words = ["acc", cells["accuracy"], cells["val"], "AUC", cells["auc"], "EER", cells["eer"]]
    return " ".join([name, *words] if name else words)


def fold_table(result) -> str:
    """One row per fold: accuracy, the threshold chosen on the other folds, VAL and FAR.

    Args:
        result: a ``VerificationResult``.
    """
    lines = [f"{'fold':>4}  {'accuracy':>8}  {'threshold':>9}  {'VAL':>6}  {'FAR':>7}"]
    for f in range(result.n_folds):
        lines.append(
            f"{f:>4}  {result.accuracy[f]:>8.4f}  {result.best_thresholds[f]:>9.4f}  "
            f"{result.val_per_fold[f]:>6.4f}  {result.far_per_fold[f]:>7.5f}"
        )
    return "\n".join(lines)


def result_table(name: str, result) -> str:
    """The fold table, the figures line, the verification threshold and the pair count.

    Args:
        name: what was evaluated (starts the figures line).
        result: a ``VerificationResult``.
    """
    return "\n".join(
        [
            fold_table(result),
            figures_line(name, figures(result)),
            f"threshold {result.threshold:.4f} ({result.threshold_distance} distance, mean over "
            "folds; identify's default)",
            f"pairs     {result.n_pairs} in {result.n_folds} folds ({result.distance} distance)",
        ]
    )


def sets_table(results: Mapping) -> str:
    """One row per verification set: the figure cells, the threshold and the pair count.

    Args:
        results: ``{set name: VerificationResult}``, in the order to print.
    """
    lines = [
        f"{'set':<12} {'accuracy':>13}  {'VAL @ FAR target (achieved)':>36}  {'AUC':>6}  "
        f"{'EER':>6}  {'threshold':>9}  {'pairs':>6}"
    ]
    for name, result in results.items():
        cells = figure_cells(figures(result))
        lines.append(
            f"{name:<12} {cells['accuracy']:>13}  {cells['val']:>36}  {cells['auc']:>6}  "
            f"{cells['eer']:>6}  {result.threshold:>9.4f}  {result.n_pairs:>6}"
        )
    return "\n".join(lines)
