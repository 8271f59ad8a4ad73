"""Identification: match probe embeddings against a gallery, "unknown" above a threshold.

A gallery holds one or more embeddings per identity. A probe takes the identity of its
nearest gallery embedding, and is answered "unknown" (None) when that distance is not below
the threshold: the rule of the verification protocol, where a pair is "same" when
``distance < threshold``. The default threshold is the one the protocol chose (the mean over
folds of each fold's best threshold, with the distance it applies to), read by
:func:`read_threshold` from ``metrics.json`` (facenet-evaluate) or a run's ``summary.json``,
or saved with the model. A stored threshold records what it was chosen for (the weights'
content hash, flip, mean subtraction, preprocessing); :func:`checked_threshold` lets it
through only where all of these match the embeddings it would apply to.

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
from facenet.evaluation.report import PROVENANCE, ThresholdRecord
from facenet.metric.distances import pairwise_distance

__all__ = [
    "Gallery",
    "Matches",
    "checked_threshold",
    "identification_rates",
    "match",
    "non_finite_rows",
    "read_threshold",
]

# Probes compared per block: the (block, G) distance matrix stays small for large galleries.
_PROBE_BLOCK = 4096
# Rows named in a message about non-finite embeddings: the first few.
_NAMED_ROWS = 5


def non_finite_rows(embeddings: np.ndarray, what: str, names=None) -> None:
    """Refuse (N, D) embeddings with NaN or infinite rows, naming the rows (and their files).

    One NaN gallery row is never any probe's nearest (every comparison with NaN is false), so
    without this check it would silently make probes "unknown"; a NaN probe likewise.

    Args:
        embeddings: (N, D) array.
        what: whose embeddings (a file name), for the message.
        names: optional (N,) names of the rows (image paths).

    Raises:
        DataError: naming the count and the first rows.
    """
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1)) if embeddings.size else []
    if len(bad) == 0:
        return
    shown = [
        f"{i} ({names[i]})" if names is not None and i < len(names) else str(i)
        for i in bad[:_NAMED_ROWS]
    ]
    more = " ..." if len(bad) > _NAMED_ROWS else ""
    raise DataError(
        f"{what}: {len(bad)} embedding row(s) hold NaN or infinite values: rows "
        f"{', '.join(shown)}{more}"
    )


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
        non_finite_rows(self.embeddings, "gallery")

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
    non_finite_rows(probes.numpy(), "probes")
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


def read_threshold(path: str | os.PathLike) -> ThresholdRecord | None:
    """The verification threshold saved in a JSON file, with what it was chosen for.

    Args:
        path: ``metrics.json`` of facenet-evaluate (``threshold``, ``threshold_distance``,
            ``threshold_for``) or a run's ``summary.json`` (``threshold: {"value",
            "distance", "epoch", "weights_sha256", "flip", ...}``; null when nothing was
            evaluated).

    Returns:
        The record (provenance fields None where an older file lacks them), or None.

    Raises:
        DataError: the file is not JSON.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a JSON file ({err})") from None
    if not isinstance(record, dict):
        return None
    found = record.get("threshold")
    if isinstance(found, dict):  # summary.json
        return ThresholdRecord.from_dict(found, str(path))
    return ThresholdRecord.from_dict(record, str(path))


def checked_threshold(
    record: ThresholdRecord,
    at_hand: dict,
    what: str,
    remedy: str = "give --threshold (and --distance) chosen for them",
) -> ThresholdRecord:
    """``record`` when it was chosen for ``at_hand``; else an error saying what differs.

    Args:
        record: a stored threshold.
        at_hand: the model and preparation it would apply to
            (:meth:`facenet.inference.loading.TrainedModel.preparation`, or a facenet-embed
            file's provenance).
        what: the embeddings it would apply to, for the message (e.g. "these embeddings").
        remedy: how to go on, ending the message.

    Raises:
        DataError: one line: the stored threshold, what differs, and how to go on.
    """
    differences = record.differences(at_hand)
    if not differences:
        return record
    raise DataError(
        f"the stored threshold {record.describe()} does not apply to {what}: "
        f"{'; '.join(differences)}; {remedy}"
    )


def model_threshold(
    trained,
    at_hand: dict,
    threshold: float | None = None,
    distance: str | None = None,
    none: bool = False,
) -> tuple[ThresholdRecord | None, str]:
    """The threshold to record with a model's embeddings or export, and a line saying which.

    In order: ``threshold`` (given by the user: recorded as chosen for ``at_hand``), none
    (``none``), the one saved with the model when it was chosen for ``at_hand``
    (:func:`checked_threshold`: otherwise an error saying what differs), or none when the
    model has none saved.

    Args:
        trained: what :func:`facenet.inference.loading.load_model` returned.
        at_hand: :meth:`TrainedModel.preparation` of the embeddings to be made.
        threshold: ``--threshold``, or None.
        distance: ``--distance`` (with ``threshold``; default "squared").
        none: ``--no-threshold``: record none.

    Raises:
        DataError: contradictory options, or a saved threshold chosen for something else.
    """
    if threshold is not None and none:
        raise DataError("--threshold and --no-threshold contradict each other")
    if distance is not None and threshold is None:
        raise DataError("--distance goes with --threshold (a saved threshold has its own)")
    if threshold is not None:
        if not math.isfinite(threshold):
            raise DataError(f"--threshold {threshold!r} is not a finite number")
        given = {k: at_hand.get(k) for k in PROVENANCE}
        record = ThresholdRecord(
            threshold,
            distance or "squared",
            **given,
            epoch=at_hand.get("epoch"),
            chosen_on="--threshold",
        )
        return record, f"threshold: {record.describe()}"
    if none:
        return None, "threshold: none recorded (--no-threshold)"
    stored = trained.threshold_record()
    if stored is None:
        return None, f"threshold: none saved with {trained.path} (identify will need --threshold)"
    what = f"the embeddings of {trained.path} made here"
    remedy = "give --threshold (and --distance) chosen for them, or --no-threshold"
    record = checked_threshold(stored, at_hand, what, remedy)
    return record, f"threshold: {record.describe()}"
