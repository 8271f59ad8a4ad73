"""How verification figures are written, wherever they are printed, and what a threshold was
chosen for (``ThresholdRecord``), so that a figure reads the same everywhere::

    test acc 0.9655±0.0147 VAL 0.5510 @ FAR 0.001 (achieved 0.0010) AUC 0.9960 EER 0.0400

Results are read by attribute: this module imports no other part of evaluation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The figures a run logs and a summary reports; per-fold arrays and curves stay in the result.
FIGURE_KEYS = ("accuracy_mean", "accuracy_std", "val", "val_std", "far", "auc", "eer")


def val_at_far_label(val: float | str, far_target: float, far: float) -> str:
    """``VAL 0.4680 @ FAR 0.001 (achieved 0.0030)``: the VAL, the FAR aimed at, the FAR
    achieved on the test folds; a VAL in words (a FAR the folds cannot resolve):
    ``VAL @ FAR 1e-05: not resolved (...)``."""
    if isinstance(val, str):
        return f"VAL @ FAR {far_target:g}: {val}"
    return f"VAL {val:.4f} @ FAR {far_target:g} (achieved {far:.4f})"


def figures(result) -> dict:
    """The reported figures of a ``VerificationResult``, with its threshold and distance, as
    its record has them (a VAL the folds cannot resolve in words)."""
    record = result.to_dict(curves=False)
    return {key: record[key] for key in (*FIGURE_KEYS, "far_target", "threshold", "distance")}


def figure_cells(values: Mapping) -> dict[str, str]:
    """:func:`figures` (or a run's record of them) as the text cells of lines and tables."""
    return {
        "accuracy": f"{values['accuracy_mean']:.4f}±{values['accuracy_std']:.4f}",
        "val": val_at_far_label(values["val"], values["far_target"], values["far"]),
        "auc": f"{values['auc']:.4f}",
        "eer": f"{values['eer']:.4f}",
    }


def figures_line(name: str, values: Mapping) -> str:
    """``name acc 0.9685±0.0123 VAL ... AUC 0.9947 EER 0.0400`` (an empty name: ``acc ...``)."""
    cells = figure_cells(values)
    words = ["acc", cells["accuracy"], cells["val"], "AUC", cells["auc"], "EER", cells["eer"]]
    return " ".join([name, *words] if name else words)


def result_table(name: str, result) -> str:
    """One row per fold (accuracy, the threshold chosen on the other folds, VAL and FAR; "-"
    for a VAL the folds cannot resolve), the figures line, the verification threshold and the
    pair count."""
    values = figures(result)
    vals = ["-" if isinstance(values["val"], str) else f"{v:.4f}" for v in result.val_per_fold]
    lines = [f"{'fold':>4}  {'accuracy':>8}  {'threshold':>9}  {'VAL':>6}  {'FAR':>7}"]
    for f in range(result.n_folds):
        lines.append(
            f"{f:>4}  {result.accuracy[f]:>8.4f}  {result.best_thresholds[f]:>9.4f}  "
            f"{vals[f]:>6}  {result.far_per_fold[f]:>7.5f}"
        )
    lines += [
        figures_line(name, values),
        f"threshold {result.threshold:.4f} ({result.distance} distance, mean over "
        "folds; identify's default)",
        f"pairs     {result.n_pairs} in {result.n_folds} folds ({result.distance} distance)",
    ]
    return "\n".join(lines)


def sets_table(results: Mapping) -> str:
    """One row per ``{set name: VerificationResult}``: figures, threshold, pair count."""
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


# A threshold applies only where all of these match (epoch and chosen_on are for messages).
PROVENANCE = ("weights_sha256", "flip", "subtract_mean", "preprocess", "features")
_IMPLIED = {"features": "unit"}  # records from before ``features`` were all on unit embeddings


@dataclass(frozen=True)
class ThresholdRecord:
    """A verification threshold ("same" below ``value``, in ``distance``) and what it was
    chosen for: the weights' content hash (``facenet.checkpoint.weights_digest``) and
    the preparation (``VerifySettings.provenance``); None where a record does not say."""

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
        """Plain values (JSON, ``weights_only`` pickles)."""
        out = {"threshold": float(self.value), "threshold_distance": self.distance}
        out.update({key: getattr(self, key) for key in (*PROVENANCE, "epoch", "chosen_on")})
        return out

    @classmethod
    def from_dict(cls, record: Mapping, source: str = "") -> ThresholdRecord | None:
        """The record of :meth:`to_dict`'s form (``metrics.json`` keeps the provenance under
        ``threshold_for``) or of a ``summary.json`` entry (``value``, ``distance``, ...); None
        when it holds no finite threshold."""
        value = record.get("value", record.get("threshold"))
        if not _is_number(value):  # NaN and inf are not numbers here
            return None
        distance = record.get("distance", record.get("threshold_distance", "squared"))
        given = record.get("threshold_for")  # metrics.json keeps the provenance apart
        fields = {**record, **(given if isinstance(given, Mapping) else {})}
        typed = {key: _typed(fields.get(key), kind) for key, kind in _KINDS.items()}
        typed["features"] = typed["features"] or _IMPLIED["features"]
        return cls(float(value), str(distance), source=source, **typed)

    def differences(self, at_hand: Mapping) -> list[str]:
        """What differs, in words, from ``at_hand`` (the :data:`PROVENANCE` keys, ``epoch``
        optional); a field unknown on either side differs: a threshold is used only where it
        is known to fit."""
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


_KINDS = {
    "weights_sha256": str,
    "epoch": int,
    "flip": bool,
    "subtract_mean": bool,
    "preprocess": str,
    "chosen_on": str,
    "features": str,
}
_NOUNS = {
    "weights_sha256": "weights",
    "flip": "flip setting",
    "subtract_mean": "mean subtraction",
    "preprocess": "preprocessing",
    "features": "features",
}


def _difference(key: str, ours, theirs, our_epoch, their_epoch) -> str:
    """``flip: chosen with flip, here without``."""
    if key == "weights_sha256":
        at = lambda digest, epoch: digest[:8] + ("" if epoch is None else f", epoch {epoch}")
        return f"weights: chosen for {at(ours, our_epoch)}, here {at(theirs, their_epoch)}"
    if key in ("flip", "subtract_mean"):
        word = _NOUNS[key] if key == "subtract_mean" else "flip"
        say = lambda on: "with" if on else "without"
        return f"{word}: chosen {say(ours)} {word}, here {say(theirs)}"
    return f"{_NOUNS[key]}: chosen with {ours!r}, here {theirs!r}"


def _is_number(value) -> bool:
    """A finite int or float (not a bool) within float's range: not NaN, inf or a 400-digit int."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and abs(value) < 1e300


def _typed(value, kind):
    """``value`` when it is a ``kind`` (ints for int, not bools), else None."""
    if kind is int:
        return int(value) if _is_number(value) and float(value).is_integer() else None
    return value if isinstance(value, kind) else None
