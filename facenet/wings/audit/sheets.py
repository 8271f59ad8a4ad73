"""Contact sheets: rows of faces, each row a finding with its caption above it, as a PNG."""

from __future__ import annotations

import os

import torch

from facenet.files import write_atomic

FACE_INCHES = 0.8  # each face's box; a 112 x 96 crop is drawn at about its own pixel size
CAPTION_INCHES = 0.2  # above each row
TITLE_INCHES = 0.35
DPI = 100
MIN_COLUMNS = 8  # room for a caption above a row of two faces


def contact_sheet(rows: list[tuple[list[torch.Tensor], str]], title: str):
    """A ``matplotlib.figure.Figure`` of ``rows``: each (faces as uint8 (3, H, W), caption).
    Never registered with pyplot: no window opens, nothing stays open."""
    # imported here as facenet.evaluation.plots does: matplotlib costs a second to import
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = max([len(faces) for faces, _ in rows] + [MIN_COLUMNS])  # short rows left-aligned
    height = TITLE_INCHES + len(rows) * (CAPTION_INCHES + FACE_INCHES) + 0.05
    fig = Figure(figsize=(columns * FACE_INCHES, height), dpi=DPI)
    FigureCanvasAgg(fig)
    fig.suptitle(
        title if rows else f"{title}: none", fontsize=8, x=0.01, y=1 - 0.1 / height, ha="left"
    )
    if not rows:
        return fig
    layout = {"wspace": 0.05, "hspace": CAPTION_INCHES / FACE_INCHES, "left": 0.01, "right": 0.99}
    layout |= {"top": 1 - (TITLE_INCHES + CAPTION_INCHES) / height, "bottom": 0.05 / height}
    axes = fig.subplots(len(rows), columns, squeeze=False, gridspec_kw=layout)
    for (faces, caption), line in zip(rows, axes):
        for face, ax in zip(faces, line):
            ax.imshow(face.permute(1, 2, 0).numpy())  # (H, W, 3)
        line[0].set_title(caption, loc="left", fontsize=6, pad=2)
    for ax in axes.flat:
        ax.set_axis_off()
    return fig


def write_png(path: str | os.PathLike, figure) -> None:
    """``figure`` as a PNG at ``path``, replaced whole."""
    write_atomic(path, lambda fh: figure.savefig(fh, format="png"))
