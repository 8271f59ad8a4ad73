"""A training set audited against an evaluation's images: the findings
(:mod:`facenet.wings.audit.findings`), a TSV of every row of each kind and a contact sheet of
its first rows, and the verification figures without the identities the two sets share."""

from __future__ import annotations

import csv
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from facenet.data.images import read_image
from facenet.evaluation.presets import VerifySettings
from facenet.evaluation.protocol import evaluate_embeddings
from facenet.files import write_text_atomic
from facenet.wings.audit.embeddings import EmbeddedSet
from facenet.wings.audit.findings import (
    Identities,
    LabelNoise,
    label_noise,
    overlap,
    split_identities,
)
from facenet.wings.audit.neighbours import unit_rows
from facenet.wings.audit.sheets import contact_sheet, write_png

# The same pixels give the same embedding up to float rounding (about 1e-6, with the batch):
# rows closer than this are decoded and compared.
DUPLICATE_DISTANCE = 1e-3
TYPICAL_FACES = 3  # of an identity, beside a suspect or a twin identity


def pair_thresholds(unit: torch.Tensor, index1, index2, issame, quantile: float):
    """``(same, stranger)`` from the distances of the evaluation's pairs, rows ``index1`` and
    ``index2`` of its unit embeddings ``unit``: ``same`` the ``quantile`` of its same-identity
    pairs' (two faces closer than this are as close as that share of its genuine pairs, or
    closer), ``stranger`` the median of its different pairs'."""
    same = np.asarray(issame, dtype=bool)
    distances = (unit[index1] - unit[index2]).norm(dim=1).numpy()  # (P,)
    return float(np.quantile(distances[same], quantile)), float(np.median(distances[~same]))


@dataclass
class Audit:
    """The findings on ``train`` against ``evaluation`` at ``threshold`` (a training image
    is a suspect beyond ``stranger`` of its own identity's centre): ``unit`` (N, D)
    training rows and their ``identities``; per evaluation row (M,) its ``nearest`` training
    row and its ``distance``; the evaluation rows with a training image of the same pixels
    (``duplicates``); ``noise`` per training row; ``splits`` as ``split_identities`` gives."""

    train: EmbeddedSet
    evaluation: EmbeddedSet
    threshold: float
    stranger: float
    unit: torch.Tensor
    identities: Identities
    nearest: np.ndarray
    distance: np.ndarray
    duplicates: list
    noise: LabelNoise
    splits: list


def audit_sets(train: EmbeddedSet, evaluation: EmbeddedSet, thresholds: tuple) -> Audit:
    """Every finding of :mod:`facenet.wings.audit.findings` (two identities at least) at the
    ``(same, stranger)`` thresholds of :func:`pair_thresholds`."""
    unit = unit_rows(train.embeddings)  # (N, D)
    identities = Identities.of(unit, train.labels)
    nearest, distance = overlap(unit, unit_rows(evaluation.embeddings))
    duplicates = [
        i
        for i in np.flatnonzero(distance < DUPLICATE_DISTANCE).tolist()
        if torch.equal(read_image(evaluation.paths[i]), read_image(train.paths[nearest[i]]))
    ]
    noise = label_noise(unit, identities)
    splits = split_identities(identities, thresholds[0])
    found = (nearest, distance, duplicates, noise, splits)
    return Audit(train, evaluation, *thresholds, unit, identities, *found)


def overlap_rows(audit: Audit) -> list[dict]:
    """Every evaluation image with a training image closer than the threshold, closest first."""
    matched = np.flatnonzero(audit.distance < audit.threshold)
    rows = []
    for i in matched[np.argsort(audit.distance[matched], kind="stable")].tolist():
        j = audit.nearest[i]
        rows.append(
            {
                "evaluation_image": audit.evaluation.paths[i],
                "evaluation_identity": audit.evaluation.labels[i],
                "training_image": audit.train.paths[j],
                "training_identity": audit.train.labels[j],
                "distance": round(float(audit.distance[i]), 4),
                "same_pixels": i in audit.duplicates,
                "row": i,
            }
        )
    return rows


def overlap_groups(rows: list[dict], evaluation: EmbeddedSet) -> list[dict]:
    """``rows`` grouped by (evaluation identity, training identity), the closest first: how
    many of the evaluation identity's images matched, and its closest pair."""
    sizes = Counter(evaluation.labels)
    groups = {}
    for row in rows:
        key = (row["evaluation_identity"], row["training_identity"])
        if key not in groups:
            groups[key] = {"evaluation_identity": key[0], "training_identity": key[1]}
            groups[key] |= {"matched": 0, "images": sizes[key[0]], "distance": row["distance"]}
            groups[key]["closest"] = row
        groups[key]["matched"] += 1
    return list(groups.values())


def noise_rows(audit: Audit) -> list[dict]:
    """The label-noise suspects, the largest margin first; an image nearer the identity its
    own is split from is left to the split identities."""
    names, noise = audit.identities.names, audit.noise
    twins = {frozenset((a, b)) for a, b, _ in audit.splits}
    rows = []
    for i in audit.noise.suspects(audit.stranger).tolist():
        if frozenset((int(audit.identities.index[i]), int(noise.other[i]))) in twins:
            continue
        closer = noise.margin[i] > 0
        rows.append(
            {
                "image": audit.train.paths[i],
                "identity": audit.train.labels[i],
                "own_distance": round(float(noise.own[i]), 4),
                "nearest_identity": names[noise.other[i]],
                "nearest_distance": round(float(noise.distance[i]), 4),
                "margin": round(float(noise.margin[i]), 4),
                "reason": "closer to another identity" if closer else "far from its own",
                "row": i,
            }
        )
    return rows


def split_rows(audit: Audit) -> list[dict]:
    """Identities whose centres lie closer than the threshold, the closest first."""
    names, counts = audit.identities.names, audit.identities.counts.tolist()
    return [
        {
            "identity_a": names[a],
            "images_a": counts[a],
            "identity_b": names[b],
            "images_b": counts[b],
            "centre_distance": round(d, 4),
            "rows": (a, b),
        }
        for a, b, d in audit.splits
    ]


def _typical(audit: Audit, identity: int, count: int = TYPICAL_FACES) -> list[torch.Tensor]:
    rows = audit.identities.typical(int(identity), audit.unit, count)
    return [read_image(audit.train.paths[r]) for r in rows]


def _overlap_faces(audit: Audit, group: dict) -> tuple[list, str]:
    """The group's closest pair and two more faces of its training identity."""
    closest = group["closest"]
    faces = [read_image(closest["evaluation_image"]), read_image(closest["training_image"])]
    identity = audit.identities.index[audit.nearest[closest["row"]]]
    caption = (
        f"{group['evaluation_identity']} ~ {group['training_identity']}: "
        f"{group['matched']} of {group['images']} images, d {group['distance']}"
    )
    return faces + _typical(audit, identity, 2), caption


def _duplicate_faces(audit: Audit, row: dict) -> tuple[list, str]:
    faces = [read_image(row["evaluation_image"]), read_image(row["training_image"])]
    return faces, f"{Path(row['evaluation_image']).name} = {row['training_image']}"


def _suspect_faces(audit: Audit, row: dict) -> tuple[list, str]:
    """The suspect, its identity's typical faces, two of the nearest other identity's."""
    i = row["row"]
    faces = [read_image(audit.train.paths[i]), *_typical(audit, audit.identities.index[i])]
    caption = (
        f"{Path(row['image']).name} in {row['identity']}: own {row['own_distance']}, "
        f"{row['nearest_identity']} {row['nearest_distance']} (last two faces)"
    )
    return faces + _typical(audit, audit.noise.other[i], 2), caption


def _twin_faces(audit: Audit, row: dict) -> tuple[list, str]:
    a, b = row["rows"]
    caption = (
        f"{row['identity_a']} ({row['images_a']}) and {row['identity_b']} ({row['images_b']}): "
        f"d {row['centre_distance']}"
    )
    return _typical(audit, a) + _typical(audit, b), caption


# Each contact sheet: the table it draws and how it draws one of its rows.
SHEETS = {
    "overlap": ("overlap_identities", _overlap_faces),
    "duplicates": ("duplicates", _duplicate_faces),
    "label_noise": ("label_noise", _suspect_faces),
    "split_identities": ("split_identities", _twin_faces),
}


def sheet_rows(audit: Audit, tables: dict, top: int) -> dict[str, list]:
    """The first ``top`` rows of each table as a contact sheet's (faces, caption) rows."""
    sheets = {}
    for name, (table, draw) in SHEETS.items():
        drawn = [draw(audit, row) for row in tables[table][:top]]
        sheets[name] = [(faces, f"{n}. {caption}") for n, (faces, caption) in enumerate(drawn, 1)]
    return sheets


def tables_of(audit: Audit) -> dict[str, list[dict]]:
    """Every row of each kind, ranked."""
    overlap = overlap_rows(audit)
    return {
        "overlap": overlap,
        "overlap_identities": overlap_groups(overlap, audit.evaluation),
        "duplicates": [row for row in overlap if row["same_pixels"]],
        "label_noise": noise_rows(audit),
        "split_identities": split_rows(audit),
    }


def tsv(rows: list[dict], columns: list[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, delimiter="\t", lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([row[c] for c in columns] for row in rows)
    return out.getvalue()


def verification_without(
    evaluation: EmbeddedSet, pairs, index1, index2, left_out: set, settings: VerifySettings
) -> dict:
    """The protocol's figures on all the pairs and on those naming no identity of
    ``left_out``, from the evaluation's embeddings as ``settings`` made them."""
    labels = np.asarray(evaluation.labels, dtype=str)
    folds = pairs.folds_for(settings.n_folds)
    keep = ~np.isin(labels[index1], list(left_out)) & ~np.isin(labels[index2], list(left_out))
    figures = {}
    for name, rows in (("all_pairs", slice(None)), ("without_overlap", keep)):
        emb1, emb2 = evaluation.embeddings[index1[rows]], evaluation.embeddings[index2[rows]]
        subset = None if folds is None else folds[rows]
        try:
            result = evaluate_embeddings(emb1, emb2, pairs.issame[rows], settings, subset)
        except ValueError as err:  # too few pairs left, a fold without a kind
            figures[name] = {"not_measured": str(err)}
            continue
        figures[name] = {
            key: result.to_dict(curves=False)[key]
            for key in ("n_pairs", "accuracy_mean", "accuracy_std", "auc", "eer", "val", "far")
        }
    return figures


COLUMNS = {
    "overlap": [
        "evaluation_image",
        "evaluation_identity",
        "training_image",
        "training_identity",
        "distance",
        "same_pixels",
    ],
    "overlap_identities": [
        "evaluation_identity",
        "training_identity",
        "matched",
        "images",
        "distance",
    ],
    "duplicates": ["evaluation_image", "training_image"],
    "label_noise": [
        "image",
        "identity",
        "own_distance",
        "nearest_identity",
        "nearest_distance",
        "margin",
        "reason",
    ],
    "split_identities": ["identity_a", "images_a", "identity_b", "images_b", "centre_distance"],
}
TITLES = {
    "overlap": "evaluation face, its nearest training face, two typical faces of that identity",
    "duplicates": "evaluation images whose pixels are a training image's",
    "label_noise": "suspect, its identity's typical faces, the nearest other identity's",
    "split_identities": "identities that look like one person: three typical faces of each",
}


def write_report(out: str | Path, audit: Audit, top: int) -> dict[str, list[dict]]:
    """``<kind>.tsv`` (every row) and ``<kind>.png`` (the first ``top``) of each kind in
    ``out``, and ``overlap_identities.tsv``; returns the tables."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = tables_of(audit)
    for name, columns in COLUMNS.items():
        write_text_atomic(out / f"{name}.tsv", tsv(tables[name], columns))
    for name, rows in sheet_rows(audit, tables, top).items():
        write_png(out / f"{name}.png", contact_sheet(rows, TITLES[name]))
    return tables
