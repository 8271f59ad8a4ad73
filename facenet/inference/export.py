"""Exporting a trained network for deployment, with a parity check against the eager model.

Formats (each with a dynamic batch dimension, images (B, 3, S, S) -> embeddings (B, D)):

- ``onnx``: through ``torch.onnx.export(dynamo=True)``; checked with onnxruntime. Needs the
  ``export`` extra (onnx, onnxruntime, onnxscript).
- ``pt2``: a ``torch.export`` program, loadable with ``torch.export.load(path).module()``
  (``torch.export`` replaces TorchScript, which this torch deprecates).
- ``weights``: ``model.pt``, a ``weights_only`` state-dict file (see
  :mod:`facenet.inference.loading`).

Each exported file carries the preprocessing it expects (``image_size``, ``normalize``) and,
when known, the verification threshold: ONNX metadata properties, a ``facenet.json`` extra
file in the ``.pt2`` archive. The file is exported into memory, run on a batch of a size other
than the one it was traced with, compared with the eager model, and written (atomically) only
when the largest absolute difference is within the tolerance.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from facenet.errors import FacenetError
from facenet.files import write_atomic
from facenet.inference.loading import TrainedModel, save_weights
from facenet.sizes import image_hw, plain_size

try:  # the export extra: pip install 'facenet-triplet[export]'
    import onnxruntime
except ImportError:  # pragma: no cover - the test environment installs it
    onnxruntime = None

__all__ = ["FORMATS", "ExportError", "ExportReport", "export_model"]

FORMATS = ("onnx", "pt2", "weights")
# The batch sizes the program is traced with and checked at: different, so a program that
# had frozen the batch size would fail the check instead of passing it.
_TRACE_BATCH, _CHECK_BATCH = 2, 3
PARITY_TOLERANCE = 1e-4
EXTRA_FILE = "facenet.json"


class ExportError(FacenetError):
    """An export that cannot be made, or whose outputs differ from the eager model's."""


@dataclass
class ExportReport:
    """What was written and how closely it reproduces the eager model.

    Args:
        path: the file written.
        format: "onnx", "pt2" or "weights".
        max_abs_diff: largest |exported - eager| over the check batch (0 for weights).
        batch: the check batch's size.
    """

    path: Path
    format: str
    max_abs_diff: float
    batch: int


def _metadata(trained: TrainedModel) -> dict:
    """What a deployment needs to know besides the graph, as strings."""
    meta = {
        # "64" for a square input, "[112, 96]" (H, W; JSON) otherwise
        "image_size": json.dumps(plain_size(trained.image_size)),
        "normalize": trained.normalize,
        "embedding_dim": str(trained.embedding_dim),
        "backbone": str(trained.architecture.get("backbone")),
    }
    meta.update({k: str(v) for k, v in trained.verification.items() if v is not None})
    return meta


def _example(trained: TrainedModel, batch: int, seed: int) -> torch.Tensor:
    """(batch, 3, H, W) standardised-looking random images, at the model's input size."""
    generator = torch.Generator().manual_seed(seed)
    height, width = image_hw(trained.image_size)
    return torch.randn(batch, 3, height, width, generator=generator)


def _dynamic_batch() -> tuple:
    return ({0: torch.export.Dim("batch", min=1)},)


def _export_onnx(trained: TrainedModel, example: torch.Tensor) -> bytes:
    if onnxruntime is None:
        raise ExportError(
            "ONNX export needs the export extra: pip install 'facenet-triplet[export]'"
        )
    program = torch.onnx.export(
        trained.model, (example,), dynamo=True, dynamic_shapes=_dynamic_batch(), verbose=False
    )
    proto = program.model_proto
    for key, value in _metadata(trained).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    return proto.SerializeToString()


def _run_onnx(data: bytes, images: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: images.numpy()}
    return torch.from_numpy(np.asarray(session.run(None, feed)[0]))


def _export_pt2(trained: TrainedModel, example: torch.Tensor) -> bytes:
    program = torch.export.export(trained.model, (example,), dynamic_shapes=_dynamic_batch())
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={EXTRA_FILE: json.dumps(_metadata(trained))})
    return buffer.getvalue()


def _run_pt2(data: bytes, images: torch.Tensor) -> torch.Tensor:
    program = torch.export.load(io.BytesIO(data))
    with torch.inference_mode():
        return program.module()(images)


def export_model(
    trained: TrainedModel,
    fmt: str,
    path: str | os.PathLike,
    tolerance: float = PARITY_TOLERANCE,
) -> ExportReport:
    """Export ``trained.model`` as ``fmt`` to ``path`` after checking it against eager.

    Args:
        trained: what :func:`facenet.inference.loading.load_model` returned (eval mode, on the CPU).
        fmt: "onnx", "pt2" or "weights".
        path: the file to write.
        tolerance: the largest absolute difference from the eager embeddings accepted.

    Raises:
        ExportError: an unknown format, a missing export extra, or a parity failure (then
            nothing is written).
    """
    path = Path(path)
    if fmt == "weights":
        save_weights(trained, path)
        return ExportReport(path, fmt, 0.0, 0)
    exporters = {"onnx": (_export_onnx, _run_onnx), "pt2": (_export_pt2, _run_pt2)}
    if fmt not in exporters:
        raise ExportError(f"--format {fmt!r}: valid formats: {', '.join(FORMATS)}")
    export, run = exporters[fmt]
    model = trained.model.eval().cpu()
    data = export(trained, _example(trained, _TRACE_BATCH, seed=0))
    images = _example(trained, _CHECK_BATCH, seed=1)
    with torch.inference_mode():
        eager = model(images)  # (B, D)
    diff = float((run(data, images).float() - eager).abs().max())
    if not diff <= tolerance:  # NaN fails too
        raise ExportError(
            f"{fmt} export differs from the eager model by {diff:.3g} (> {tolerance:g}) on a "
            f"batch of {_CHECK_BATCH}; {path} was not written"
        )
    write_atomic(path, lambda fh: fh.write(data))
    return ExportReport(path, fmt, diff, _CHECK_BATCH)
