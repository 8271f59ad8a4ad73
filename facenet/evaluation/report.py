"""The one way verification figures are written, wherever they are printed.

Training's console lines, the evaluate command's tables and ``VerificationResult.summary`` all
write a result through these functions, so a figure reads the same everywhere::

    test acc 0.9655±0.0147 VAL 0.5510 @ FAR 0.001 (achieved 0.0010) AUC 0.9960 EER 0.0400

The functions read a result by attribute (any ``VerificationResult``) and never import the
protocol module: the protocol imports this one (for ``summary`` and the ROC legend).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "FIGURE_KEYS",
    "PROVENANCE",
    "ThresholdRecord",
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


# What a threshold was chosen for, besides its distance: the weights (a content hash of the
# embedding network's state dict) and how the images became distances. A threshold applies
# only where all of these are the same; epoch and chosen_on are for the messages.
PROVENANCE = ("weights_sha256", "flip", "subtract_mean", "preprocess", "features")
# Records from before ``features`` existed were all chosen on unit embeddings.
_IMPLIED = {"features": "unit"}


@dataclass(frozen=True)
class ThresholdRecord:
    """A verification threshold and what it was chosen for.

    Args:
        value: the threshold ("same" when the distance is below it).
        distance: the distance it applies to.
        weights_sha256: content hash of the network's weights
            (:func:`facenet.inference.loading.weights_digest`), None when unknown.
        epoch: the training epoch of those weights, when known (messages only).
        flip: whether the embeddings concatenated the flipped image's, None when unknown.
        subtract_mean: whether the mean embedding was subtracted, None when unknown.
        preprocess: the evaluation preprocessing ("resize" or "crop"), None when unknown.
        features: "unit" (the network's unit embeddings; also what a record that does not
            say means) or "raw" (before L2 normalisation: ``eval.features``).
        chosen_on: what chose it (e.g. "validation pairs"), for messages.
        source: the file it was read from, for messages.
    """

    value: float
    distance: str
    weights_sha256: str | None = None
    epoch: int | None = None
    flip: bool | None = None
    subtract_mean: bool | None = None
    preprocess: str | None = None
    chosen_on: str | None = None
    source: str = ""
    features: str = "unit"

    def to_dict(self) -> dict:
        """The record as plain values (JSON, ``weights_only`` pickles): ``threshold``,
        ``threshold_distance`` and the provenance keys."""
        out = {"threshold": float(self.value), "threshold_distance": self.distance}
        out.update({key: getattr(self, key) for key in (*PROVENANCE, "epoch", "chosen_on")})
        return out

    @classmethod
    def from_dict(cls, record: Mapping, source: str = "") -> ThresholdRecord | None:
        """The record in ``record``, or None when it holds no threshold.

        Reads the form of :meth:`to_dict` (``metrics.json``, weights exports, a run's
        ``summary.json`` ``threshold`` entry written as ``{"value", "distance", ...}``), and
        older records without provenance (then the provenance fields are None).

        Args:
            record: a mapping holding ``threshold``/``threshold_distance`` or
                ``value``/``distance``, optionally with ``threshold_for`` (``metrics.json``).
            source: the file it came from, for messages.
        """
        value = record.get("value", record.get("threshold"))
        if not _is_number(value):
            return None
        distance = record.get("distance", record.get("threshold_distance", "squared"))
        fields = dict(record)
        fields.update(record.get("threshold_for") or {})  # metrics.json keeps them apart
        return cls(
            value=float(value),
            distance=str(distance),
            weights_sha256=_typed(fields.get("weights_sha256"), str),
            epoch=_typed(fields.get("epoch"), int),
            flip=_typed(fields.get("flip"), bool),
            subtract_mean=_typed(fields.get("subtract_mean"), bool),
            preprocess=_typed(fields.get("preprocess"), str),
            chosen_on=_typed(fields.get("chosen_on"), str),
            source=source,
            features=_typed(fields.get("features"), str) or _IMPLIED["features"],
        )

    def differences(self, at_hand: Mapping) -> list[str]:
        """What differs between what this threshold was chosen for and ``at_hand``.

        A field missing on either side counts as differing (an older record, or a file that
        does not say how it was made): a threshold is used only where it is known to fit.

        Args:
            at_hand: ``{"weights_sha256", "flip", "subtract_mean", "preprocess"}`` of the
                model and the preparation the threshold would be applied to (``epoch``
                optional, for the message).
        """
        found = []
        for key in PROVENANCE:
            ours, theirs = getattr(self, key), at_hand.get(key, _IMPLIED.get(key))
            if ours is None:
                found.append(f"the record does not say which {_NOUNS[key]} it was chosen for")
            elif theirs is None:
                found.append(f"{_NOUNS[key]} here unknown")
            elif ours != theirs:
                found.append(_difference(key, ours, theirs, self.epoch, at_hand.get("epoch")))
        return found

    def describe(self) -> str:
        """``0.9300 (squared distance; validation pairs, epoch 5, weights 1a2b3c4d, no flip,
        no mean subtraction, resize)`` from ``source``."""
        parts = [f"{self.distance} distance"]
        if self.chosen_on:  # "--threshold" reads as itself
            given = self.chosen_on.startswith("--")
            parts.append(self.chosen_on if given else f"chosen on {self.chosen_on}")
        if self.epoch is not None:
            parts.append(f"epoch {self.epoch}")
        if self.weights_sha256:
            parts.append(f"weights {self.weights_sha256[:8]}")
        if self.flip is not None:
            parts.append("flip" if self.flip else "no flip")
        if self.subtract_mean is not None:
            parts.append("mean subtraction" if self.subtract_mean else "no mean subtraction")
        if self.preprocess is not None:
            parts.append(f"{self.preprocess} preprocessing")
        if self.features != _IMPLIED["features"]:
            parts.append(f"{self.features} features")
        where = f" from {self.source}" if self.source else ""
        return f"{self.value:.4f} ({'; '.join(parts)}){where}"


_NOUNS = {
    "weights_sha256": "weights",
    "flip": "flip setting",
    "subtract_mean": "mean subtraction",
    "preprocess": "preprocessing",
    "features": "features",
}


def _difference(key: str, ours, theirs, our_epoch, their_epoch) -> str:
    """One difference, in words: ``flip: chosen with flip, here without``."""
    if key == "weights_sha256":
        at = lambda digest, epoch: digest[:8] + ("" if epoch is None else f", epoch {epoch}")
        return f"weights: chosen for {at(ours, our_epoch)}, here {at(theirs, their_epoch)}"
    if key in ("flip", "subtract_mean"):
        word = _NOUNS[key] if key == "subtract_mean" else "flip"
        say = lambda on: "with" if on else "without"
        return f"{word}: chosen {say(ours)} {word}, here {say(theirs)}"
    return f"{_NOUNS[key]}: chosen with {ours!r}, here {theirs!r}"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _typed(value, kind):
    """``value`` when it is a ``kind`` (ints for int, not bools), else None."""
    if kind is int:
        return int(value) if _is_number(value) and float(value).is_integer() else None
    return value if isinstance(value, kind) else None
