"""Verification settings and the publishers' conventions, as data.

``VerifySettings`` holds how pairs are embedded and measured; ``EVAL_PRESETS`` holds, per
publisher, the settings its published LFW figure was computed with (how its crops were made is
the alignment wing's: ``facenet.wings.align.presets``; docs/reproduce.md and docs/models.md
cite the publishers' code for each value). A publisher's variant of the protocol is a row
here, never a branch elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


class FromAttributes:
    """``cls.of(source)``: a dataclass's settings read by attribute from ``source`` (a config
    section, parsed arguments); attributes it lacks keep their defaults."""

    @classmethod
    def of(cls, source):
        names = [f.name for f in fields(cls) if hasattr(source, f.name)]
        return cls(**{name: getattr(source, name) for name in names})


@dataclass(frozen=True)
class VerifySettings(FromAttributes):
    """How pairs are embedded and measured (the config's ``eval`` keys of the same names).

    ``grid``: "default" (from the distance), "classic" ([0, 4) whatever the distance) or
    "mobilefacenet" (its similarity grid); ``features``: "unit" or "raw" (before L2
    normalisation); ``threshold_rule``: "first" (classic) or "mean"; ``scoring``: "float64" or
    "mobilefacenet" (lfw_eval.py's float32 cosine, operation for operation).
    """

    distance: str = "squared"
    flip: bool = False
    subtract_mean: bool = False
    preprocess: str = "resize"
    grid: str = "default"
    features: str = "unit"
    threshold_rule: str = "first"
    scoring: str = "float64"
    n_folds: int = 10
    far_target: float = 1e-3
    batch_size: int = 128
    num_workers: int = 0
    skip_missing: bool = False

    def provenance(self) -> dict:
        """What a threshold chosen under these settings applies to, besides the weights."""
        return {
            "flip": bool(self.flip),
            "subtract_mean": bool(self.subtract_mean),
            "preprocess": self.preprocess,
            "features": self.features,
        }


CLASSIC = VerifySettings()  # the classic protocol: squared L2 on unit embeddings, 10 folds

# The settings a publisher's preset fixes; the others (folds, FAR target, batch) stay the user's.
PUBLISHER_FIELDS = (
    "distance",
    "flip",
    "subtract_mean",
    "preprocess",
    "grid",
    "features",
    "threshold_rule",
    "scoring",
)

EVAL_PRESETS = {
    # facenet-pytorch's examples/lfw_evaluate.ipynb
    "facenet-pytorch": VerifySettings("squared", False, False, "crop", "classic"),
    # davidsandberg/facenet's validate_on_lfw.py with its published options (distance_metric=1)
    "sandberg": VerifySettings("angular", True, True, "crop", "classic"),
    # Xiaoccer/MobileFaceNet_Pytorch's lfw_eval.py
    "mobilefacenet": VerifySettings(
        "cosine", True, True, "crop", "mobilefacenet", "raw", "mean", "mobilefacenet"
    ),
}


def classic_thresholds(fine: bool = False) -> np.ndarray:
    """Both publishers' grids whatever the distance: ``arange(0, 4, 0.01)``, or the VAL grid
    ``arange(0, 4, 0.001)`` with ``fine`` (angular distances use only their first quarter)."""
    return np.arange(0, 4, 0.001 if fine else 0.01)


def mobilefacenet_thresholds() -> np.ndarray:
    """Xiaoccer/MobileFaceNet_Pytorch's similarity grid ``arange(-10000, 10001) / 10000`` as
    increasing cosine distances ``1 - t``: its "similarity > t" is "distance < 1 - t"."""
    similarities = np.arange(-10000, 10001) / 10000  # its getThreshold's grid
    return 1.0 - similarities[::-1]


def mobilefacenet_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N,) 1 - lfw_eval.py's ``evaluation_10_fold`` score of (N, D) mean-subtracted features:
    its operations in its order, in the features' own dtype, so the scores are its scores bit
    for bit (1 - s is exact in float64 for a float32 s: "1 - s < 1 - t" decides as "s > t")."""
    unit = lambda x: x / np.expand_dims(np.sqrt(np.sum(np.power(x, 2), 1)), 1)
    return 1.0 - np.sum(np.multiply(unit(a), unit(b)), 1).astype(np.float64)


# Grid name: () -> (accuracy grid, VAL grid); mobilefacenet has no VAL: its one grid serves both.
PUBLISHER_GRIDS = {
    "classic": lambda: (classic_thresholds(), classic_thresholds(fine=True)),
    "mobilefacenet": lambda: (mobilefacenet_thresholds(), mobilefacenet_thresholds()),
}
# Scoring name: (the distance it measures, (a, b) -> (N,) distances in the features' dtype).
PUBLISHER_SCORINGS = {"mobilefacenet": ("cosine", mobilefacenet_distances)}
