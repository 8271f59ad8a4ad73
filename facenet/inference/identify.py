"""Identification: match probe embeddings against a gallery, "unknown" above a threshold.

A gallery holds one or more embeddings per identity. A probe takes the identity of its
nearest gallery embedding, and is answered "unknown" (None) when that distance is not below
the threshold: the rule of the verification protocol, where a pair is "same" when
``distance < threshold``. The default threshold is the one the protocol chose (the mean over
folds of each fold's best threshold, with the distance it applies to), read by
:func:`read_threshold` from ``metrics.json`` (scripts/evaluate.py), a run's ``summary.json``
or a weights export.

Figures (:func:`identification_rates`): rank-1 accuracy (closed set: probes whose identity is
in the gallery, nearest neighbour, threshold ignored), the detection-and-identification rate
at the threshold (those probes matched to the right identity and accepted) and the open-set
rejection rate (probes whose identity is not in the gallery, answered "unknown").
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from facenet.errors import DataError
from facenet.evaluation.protocol import DISTANCES
from facenet.inference.loading import TrainedModel
from facenet.metric.distances import pairwise_distance

__all__ = [
    "Gallery",
    "Matches",
    "identification_rates",
    "match",
    "model_threshold",
    "read_threshold",
]

# Probes compared per block: the (block, G) distance matrix stays small for large galleries.
_PROBE_BLOCK = 4096


@dataclass
class Gallery:
    """Enrolled embeddings and the identity of each.

    Args:
        embeddings: (G, D) float array, one row per enrolled image (several per identity).
        labels: (G,) identity names.
    """

    embeddings: np.ndarray
    labels: np.ndarray

    def __post_init__(self):
        self.embeddings = np.asarray(self.embeddings, dtype=np.float32)
        self.labels = np.asarray(self.labels).astype(str)
        if self.embeddings.ndim != 2 or len(self.embeddings) == 0:
            raise DataError(f"gallery embeddings must be (G, D) with G >= 1, got {self.shape}")
        if self.labels.shape != (len(self.embeddings),):
            raise DataError(
                f"gallery: {len(self.embeddings)} embeddings but {self.labels.shape[0]} labels "
                "(embed the gallery from identity folders)"
            )
        if (self.labels == "").any():
            raise DataError("gallery: every embedding needs an identity (a folder name)")

    @property
    def shape(self) -> tuple:
        return tuple(np.shape(self.embeddings))

    @property
    def identities(self) -> list[str]:
        """The distinct identities, sorted."""
        return sorted(set(self.labels.tolist()))


@dataclass
class Matches:
    """The answer for each of P probes.

    Args:
        identity: (P,) the nearest gallery embedding's identity, or None ("unknown").
        nearest: (P,) that identity whether accepted or not.
        distance: (P,) the distance to the nearest gallery embedding.
        index: (P,) the row of that gallery embedding.
        threshold: the threshold used.
        distance_name: the distance ("squared", "euclidean", "cosine").
    """

    identity: list
    nearest: list
    distance: np.ndarray
    index: np.ndarray
    threshold: float
    distance_name: str


def match(gallery: Gallery, probes, threshold: float, distance: str = "squared") -> Matches:
    """The nearest gallery identity of every probe; None where it is not below ``threshold``.

    Args:
        gallery: the enrolled embeddings.
        probes: (P, D) probe embeddings (numpy or torch).
        threshold: accept a match when its distance is below this.
        distance: "squared", "euclidean", "cosine" (1 - cos) or "angular" (arccos(cos) / pi),
            as in the evaluation.
    """
    if distance not in DISTANCES:
        raise DataError(f"distance {distance!r}: valid options: {', '.join(DISTANCES)}")
    if not math.isfinite(threshold):
        raise DataError(f"threshold {threshold!r} is not a finite number")
    probes = torch.as_tensor(np.asarray(probes, dtype=np.float64))  # (P, D)
    if probes.ndim != 2 or probes.shape[1] != gallery.embeddings.shape[1]:
        raise DataError(
            f"probe embeddings {tuple(probes.shape)} do not fit the gallery's {gallery.shape} "
            "(embed both with the same model and --flip setting)"
        )
    enrolled = torch.as_tensor(gallery.embeddings, dtype=torch.float64)  # (G, D)
    best_d, best_i = [], []
    # angular = arccos(1 - cosine) / pi rises with the cosine distance: the same nearest
    # embedding, so measure cosine and convert the nearest distances below.
    measured = "cosine" if distance == "angular" else distance
    for start in range(0, len(probes), _PROBE_BLOCK):
        block = pairwise_distance(probes[start : start + _PROBE_BLOCK], enrolled, measured)
        d, i = block.min(dim=1)  # (b,), (b,): the first nearest on ties
        best_d.append(d)
        best_i.append(i)
    dist = torch.cat(best_d).numpy() if best_d else np.zeros(0)
    index = torch.cat(best_i).numpy() if best_i else np.zeros(0, dtype=np.int64)
    if distance == "angular":
        dist = np.arccos(np.clip(1.0 - dist, -1.0, 1.0)) / np.pi
    nearest = gallery.labels[index].tolist()
    identity = [name if d < threshold else None for name, d in zip(nearest, dist)]
    return Matches(identity, nearest, dist, index, float(threshold), distance)


def identification_rates(matches: Matches, probe_labels, gallery: Gallery) -> dict:
    """Rank-1 accuracy, detection-and-identification rate and open-set rejection rate.

    Args:
        matches: what :func:`match` returned for the probes.
        probe_labels: (P,) each probe's true identity.
        gallery: the gallery the probes were matched against.

    Returns:
        ``{"rank1", "detection_identification", "n_known", "open_set_rejection",
        "n_unknown"}``; a rate is None when its probe set is empty.
    """
    labels = np.asarray(probe_labels).astype(str)
    if labels.shape != (len(matches.nearest),):
        raise DataError(f"{len(labels)} probe labels for {len(matches.nearest)} probes")
    enrolled = set(gallery.labels.tolist())
    known = np.array([name in enrolled for name in labels], dtype=bool)
    nearest = np.asarray(matches.nearest, dtype=str)
    accepted = np.array([name is not None for name in matches.identity], dtype=bool)
    correct = nearest == labels
    rate = lambda hits, among: float(hits[among].mean()) if among.any() else None
    return {
        "rank1": rate(correct, known),
        "detection_identification": rate(correct & accepted, known),
        "n_known": int(known.sum()),
        "open_set_rejection": rate(~accepted, ~known),
        "n_unknown": int((~known).sum()),
    }


def _threshold_in(record: dict) -> tuple[float, str] | None:
    """(threshold, distance) from an evaluation record or a run summary, if it holds one.

    ``metrics.json``: top-level ``threshold`` and ``threshold_distance``; a run's
    ``summary.json``: ``threshold: {"value", "distance"}`` (null when nothing was evaluated).
    """
    found = record.get("threshold")
    if isinstance(found, dict) and isinstance(found.get("value"), (int, float)):
        return float(found["value"]), str(found.get("distance", "squared"))
    if isinstance(found, (int, float)) and not isinstance(found, bool):
        return float(found), str(record.get("threshold_distance", "squared"))
    return None


def read_threshold(path: str | os.PathLike) -> tuple[float, str] | None:
    """The verification threshold and its distance saved in a JSON file, if it holds one.

    Args:
        path: ``metrics.json`` of scripts/evaluate.py (``threshold``, ``threshold_distance``)
            or a run's ``summary.json`` (``threshold: {"value", "distance"}``).

    Raises:
        DataError: the file is not JSON.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a JSON file ({err})") from None
    return _threshold_in(record) if isinstance(record, dict) else None


def model_threshold(trained: TrainedModel) -> tuple[float, str] | None:
    """The threshold that belongs to a loaded model, if one was saved.

    A weights export carries its own; for a training checkpoint it is the ``summary.json`` of
    the run folder the checkpoint lies in.

    Args:
        trained: what :func:`facenet.inference.loading.load_model` returned.
    """
    found = _threshold_in(trained.verification)
    if found is None and trained.kind == "checkpoint":
        summary = Path(trained.path).parent / "summary.json"
        found = read_threshold(summary) if summary.is_file() else None
    return found
