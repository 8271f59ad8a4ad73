"""Exporting a trained network (images (B, 3, H, W) -> embeddings (B, D), batch dynamic).

``onnx`` (``torch.onnx.export(dynamo=True)``, checked with onnxruntime: the ``export`` extra;
the graph's input is named ``images`` and its output ``embeddings``, :data:`ONNX_NAMES`),
``pt2`` (``torch.export``: ``torch.export.load(path).module()``) or ``weights`` (``model.pt``,
:mod:`facenet.wings.after_training.loading`). Each carries the preprocessing and the threshold (ONNX
metadata, a ``facenet.json`` extra file in the ``.pt2``). The file is built in memory, run on a
batch of another size than the traced one, and written only when it matches the eager model.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import torch

from facenet.errors import FacenetError
from facenet.files import write_atomic
from facenet.sizes import image_hw, plain_size
from facenet.wings.after_training.loading import TrainedModel, save_weights

try:  # the export extra: pip install 'facenet-triplet[export]'
    import onnxruntime
except ImportError:  # pragma: no cover - the test environment installs it
    onnxruntime = None


FORMATS = ("onnx", "pt2", "weights")
# Different, so a program that had frozen the batch size fails the check.
_TRACE_BATCH, CHECK_BATCH = 2, 3
PARITY_TOLERANCE = 1e-4
EXTRA_FILE = "facenet.json"
_DYNAMIC_BATCH = ({0: torch.export.Dim("batch", min=1)},)  # of the images, argument 0
# The ONNX graph's (input, output) names: what facenet-export prints and a runtime feeds.
ONNX_NAMES = ("images", "embeddings")


class ExportError(FacenetError):
    """An export that cannot be made, or whose outputs differ from the eager model's."""


def _metadata(trained: TrainedModel) -> dict:
    return {
        # "64" for a square input, "[112, 96]" (H, W; JSON) otherwise
        "image_size": json.dumps(plain_size(trained.image_size)),
        "normalize": trained.normalize,
        "embedding_dim": str(trained.embedding_dim),
        "backbone": str(trained.architecture.get("backbone")),
        **{k: str(v) for k, v in trained.verification.items() if v is not None},
    }


def _export_onnx(trained: TrainedModel, example: torch.Tensor) -> bytes:
    if onnxruntime is None:
        raise ExportError(
            "ONNX export needs the export extra: pip install 'facenet-triplet[export]'"
        )
    program = torch.onnx.export(
        trained.model,
        (example,),
        dynamo=True,
        dynamic_shapes=_DYNAMIC_BATCH,
        input_names=ONNX_NAMES[:1],
        output_names=ONNX_NAMES[1:],
        verbose=False,
    )
    proto = program.model_proto
    for key, value in _metadata(trained).items():
        proto.metadata_props.add(key=key, value=value)
    return proto.SerializeToString()


def _run_onnx(data: bytes, images: torch.Tensor) -> torch.Tensor:
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    feed = {ONNX_NAMES[0]: images.numpy()}
    return torch.from_numpy(np.asarray(session.run([ONNX_NAMES[1]], feed)[0]))


def _export_pt2(trained: TrainedModel, example: torch.Tensor) -> bytes:
    program = torch.export.export(trained.model, (example,), dynamic_shapes=_DYNAMIC_BATCH)
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
) -> float:
    """Export ``trained.model`` as ``fmt`` to ``path`` if its embeddings are within
    ``tolerance`` (largest absolute difference) of the eager model's on a batch of
    ``CHECK_BATCH``; returns that difference (0.0 for weights).

    Raises:
        ExportError: an unknown format, a missing export extra, or a parity failure (then
            nothing is written).
    """
    if fmt == "weights":
        save_weights(trained, path)
        return 0.0
    exporters = {"onnx": (_export_onnx, _run_onnx), "pt2": (_export_pt2, _run_pt2)}
    if fmt not in exporters:
        raise ExportError(f"--format {fmt!r}: valid formats: {', '.join(FORMATS)}")
    export, run = exporters[fmt]
    model = trained.model.eval().cpu()
    trace, images = (
        torch.randn(
            n, 3, *image_hw(trained.image_size), generator=torch.Generator().manual_seed(seed)
        )
        for n, seed in ((_TRACE_BATCH, 0), (CHECK_BATCH, 1))
    )
    data = export(trained, trace)
    with torch.inference_mode():
        eager = model(images)  # (B, D)
    diff = float((run(data, images).float() - eager).abs().max())
    if not diff <= tolerance:  # NaN fails too
        raise ExportError(
            f"{fmt} export differs from the eager model by {diff:.3g} (> {tolerance:g}) on a "
            f"batch of {CHECK_BATCH}; {path} was not written"
        )
    write_atomic(path, lambda fh: fh.write(data))
    return diff
