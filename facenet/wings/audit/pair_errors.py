"""A verification's worst errors as a picture: the same-identity pairs farthest beyond the
threshold (false rejects) and the different pairs closest below it (false accepts), each with
both faces, its distance and its line of the pairs file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from facenet.data.images import read_image
from facenet.wings.audit.sheets import contact_sheet


def worst_errors(distances, issame, threshold: float, count: int):
    """``(false rejects, false accepts)``: pair indices, at most ``count`` each, the worst
    first; "same" when the distance is below ``threshold``, as the protocol decides."""
    d, same = np.asarray(distances), np.asarray(issame, dtype=bool)
    rejects = np.flatnonzero(same & (d >= threshold))
    accepts = np.flatnonzero(~same & (d < threshold))
    rejects = rejects[np.argsort(-d[rejects], kind="stable")]
    return rejects[:count], accepts[np.argsort(d[accepts], kind="stable")][:count]


def error_sheet(pairs, distances, threshold: float, count: int, distance: str):
    """The contact sheet of :func:`worst_errors` of a ``PairList`` whose (N,) ``distances``
    were measured in ``distance``: a ``matplotlib.figure.Figure``."""
    # as read_pairs numbers them: universal newlines, counted from 1
    lines = Path(pairs.source).read_text(encoding="utf-8").split("\n")
    rejects, accepts = worst_errors(distances, pairs.issame, threshold, count)
    rows = []
    for kind, chosen in (("false reject", rejects), ("false accept", accepts)):
        for i in chosen.tolist():
            number = int(pairs.line_numbers[i])
            caption = f"{kind}: {distance} {distances[i]:.4f}, line {number}: " + " ".join(
                lines[number - 1].split()
            )
            rows.append(([read_image(pairs.paths1[i]), read_image(pairs.paths2[i])], caption))
    title = (
        f"the {len(rejects)} worst false rejects and {len(accepts)} worst false accepts at "
        f"{distance} threshold {threshold:.4f}"
    )
    return contact_sheet(rows, title)
