"""Identification: match probe embeddings against a gallery, "unknown" above a threshold.

A probe takes the identity of its nearest gallery embedding, or "unknown" (None) when that
distance is not below the threshold: the verification protocol's rule ("same" when
``distance < threshold``). A stored threshold records what it was chosen for (weights,
flip, mean subtraction, preprocessing, features); :func:`checked_threshold` lets it through
only where all of these match the embeddings it would apply to.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from facenet.errors import DataError
from facenet.evaluation.report import ThresholdRecord
from facenet.files import read_json
from facenet.metric.distances import DISTANCE_NAMES, pairwise_distance
from facenet.wings.publishers.insightface_bin import BIN_PREPROCESS

_PROBE_BLOCK = 4096  # probes per (block, G) distance matrix: bounded memory for large galleries
_NAMED_ROWS = 5  # rows named in a message about non-finite embeddings
# The largest each distance (facenet.metric.distances) reaches between unit embeddings, all
# that facenet-embed writes: "same" is distance < threshold, so a threshold outside [0, largest]
# accepts every probe or none.
_LARGEST_DISTANCE = {
    "squared": 4.0,
    "euclidean": 2.0,
    "cosine": 2.0,
    "angular": 1.0,
    "seed_l2": math.sqrt(4 + 1e-4),  # sqrt(||x - y||^2 + 1e-4 / D), D >= 1
}


def check_threshold(value: float, distance: str, what: str = "threshold") -> None:
    """Refuse, in one line naming ``what``, a threshold that is not a number in the range of
    ``distance`` (one of ``DISTANCE_NAMES``) between unit embeddings."""
    largest = _LARGEST_DISTANCE[distance]
    if not 0 <= value <= largest:  # NaN compares false
        raise DataError(
            f"{what} {float(value)!r} is not a number in [0, {largest:g}], the {distance} "
            "distance's range between unit embeddings"
        )


def non_finite_rows(embeddings: np.ndarray, what: str, names=None) -> None:
    """Refuse (N, D) embeddings with NaN or infinite rows, naming the first rows (and their
    ``names``): a NaN row is never nearest, so it would silently make probes "unknown"."""
    bad = np.flatnonzero(~np.isfinite(embeddings).all(axis=1))
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
    """(G, D) enrolled embeddings (one or more per identity) and their (G,) identities."""

    embeddings: np.ndarray
    labels: np.ndarray

    def __post_init__(self):
        self.embeddings = np.asarray(self.embeddings, dtype=np.float32)
        self.labels = np.asarray(self.labels).astype(str)
        if self.embeddings.ndim != 2 or len(self.embeddings) == 0:
            raise DataError(
                f"gallery embeddings must be (G, D) with G >= 1, got {self.embeddings.shape}"
            )
        if self.labels.shape != (len(self.embeddings),):
            raise DataError(
                f"gallery: {len(self.embeddings)} embeddings but {self.labels.shape[0]} labels "
                "(embed the gallery from identity folders)"
            )
        if (self.labels == "").any():
            raise DataError("gallery: every embedding needs an identity (a folder name)")
        non_finite_rows(self.embeddings, "gallery")


@dataclass
class Matches:
    """Per probe (P,): ``identity`` (the nearest's, None when not accepted), ``nearest``
    (whether accepted or not), its ``distance`` and gallery row ``index``."""

    identity: list
    nearest: list
    distance: np.ndarray
    index: np.ndarray
    threshold: float
    distance_name: str


def match(gallery: Gallery, probes, threshold: float, distance: str = "squared") -> Matches:
    """The nearest gallery identity of each (P, D) probe; None where its distance (one of
    ``DISTANCE_NAMES``, as in the evaluation) is not below ``threshold``."""
    if distance not in DISTANCE_NAMES:
        raise DataError(f"distance {distance!r}: valid options: {', '.join(DISTANCE_NAMES)}")
    check_threshold(threshold, distance)
    probes = torch.as_tensor(np.asarray(probes, dtype=np.float64))  # (P, D)
    if probes.ndim != 2 or probes.shape[1] != gallery.embeddings.shape[1]:
        raise DataError(
            f"probe embeddings {tuple(probes.shape)} do not fit the gallery's "
            f"{gallery.embeddings.shape} (embed both with the same model and --flip setting)"
        )
    non_finite_rows(probes.numpy(), "probes")
    enrolled = torch.as_tensor(gallery.embeddings, dtype=torch.float64)  # (G, D)
    # angular = arccos(1 - cosine) / pi rises with cosine: the same nearest, converted below
    measured = "cosine" if distance == "angular" else distance
    # (b,) nearest distance and index per block (the first on ties)
    blocks = [
        pairwise_distance(p, enrolled, measured).min(dim=1) for p in probes.split(_PROBE_BLOCK)
    ]
    dist, index = (torch.cat(column).numpy() for column in zip(*blocks))
    if distance == "angular":
        dist = np.arccos(np.clip(1.0 - dist, -1.0, 1.0)) / np.pi
    nearest = gallery.labels[index].tolist()
    identity = [name if d < threshold else None for name, d in zip(nearest, dist)]
    return Matches(identity, nearest, dist, index, float(threshold), distance)


def identification_rates(matches: Matches, probe_labels, gallery: Gallery) -> dict:
    """Rank-1 accuracy (probes of enrolled identities, threshold ignored), the
    detection-and-identification rate (those matched rightly and accepted) and the open-set
    rejection rate (probes of identities not enrolled, answered "unknown"); None for a rate
    whose probe set is empty."""
    labels = np.asarray(probe_labels).astype(str)
    if labels.shape != (len(matches.nearest),):
        raise DataError(f"{len(labels)} probe labels for {len(matches.nearest)} probes")
    known = np.isin(labels, gallery.labels)
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


def read_threshold(
    path: str | os.PathLike, set_name: str | None = None, at: str | None = None
) -> ThresholdRecord | None:
    """The threshold record of facenet-evaluate's ``metrics.json`` (of set ``set_name`` when it
    evaluated ``--bin`` sets; a lone set needs no name; with ``at``, its deployable threshold of
    that name, e.g. "far_1e-3") or a run's ``summary.json`` (its ``threshold`` entry), or None
    when it holds none."""
    record = read_json(path)
    sets = record.get("sets") if isinstance(record, dict) else None
    if isinstance(sets, dict):  # evaluate --bin: a threshold per set, one threshold_for
        name = set_name or (next(iter(sets)) if len(sets) == 1 else None)
        if not isinstance(sets.get(name), dict):
            raise DataError(f"{path}: name one of its sets ({', '.join(sets)}) with --set")
        given = record.get("threshold_for")
        # a set's images were resized whole, also where a file written before said "resize"
        given = {**given, "preprocess": BIN_PREPROCESS} if isinstance(given, dict) else given
        record = {**sets[name], "threshold_for": given}
    elif set_name is not None:
        raise DataError(f"{path}: --set {set_name}, but it holds no sets (evaluate --bin's)")
    if not isinstance(record, dict):
        return None
    if at is not None:
        record = _deployable(record, at, path)
    found = record.get("threshold")  # a dict in summary.json
    return ThresholdRecord.from_dict(found if isinstance(found, dict) else record, str(path))


def _deployable(record: dict, at: str, path) -> dict:
    """The record of deployable threshold ``at``: its value, the evaluation's distance and
    provenance, and the block's own ``subtract_mean`` (measured without, whatever the flag)."""
    block = record.get("deployable_thresholds")
    block = block if isinstance(block, dict) else {}
    if not isinstance(block.get(at), dict):
        names = ", ".join(k for k, v in block.items() if isinstance(v, dict))
        held = f"it holds {names}" if names else "it holds none (facenet-evaluate writes them)"
        raise DataError(f"{path}: no deployable threshold {at!r}; {held}")
    given = record.get("threshold_for")
    own = {k: block[k] for k in ("subtract_mean",) if k in block}
    return {
        **(given if isinstance(given, dict) else {}),
        **own,
        "threshold": block[at].get("threshold"),
        "threshold_distance": record.get("threshold_distance", record.get("distance")),
        "chosen_on": f"{at} over all pairs",
    }


def checked_threshold(
    record: ThresholdRecord,
    at_hand: dict,
    what: str,
    remedy: str = "give --threshold (and --distance) chosen for them",
) -> ThresholdRecord:
    """``record`` when it was chosen for ``at_hand`` (``TrainedModel.preparation`` or a
    facenet-embed file's provenance); else a one-line DataError: the record, what differs in
    ``what``, and ``remedy``."""
    differences = record.differences(at_hand)
    if not differences:
        return record
    raise DataError(
        f"the stored threshold {record.describe()} does not apply to {what}: "
        f"{'; '.join(differences)}; {remedy}"
    )
