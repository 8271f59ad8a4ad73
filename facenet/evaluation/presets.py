"""The publishers' conventions: how their published LFW figures were aligned and evaluated.

Each preset states what the publisher's own code does, so that a model converted from it is
fed what it was trained on and measured the way its figure was:

- ``facenet-pytorch`` (its LFW notebook, ``examples/lfw_evaluate.ipynb``): MTCNN with
  ``image_size=160, margin=14, selection_method="center_weighted_size"``, the margin counted in
  output pixels (its ``extract_face``), each crop saved under the input's own path (a JPEG
  stays a JPEG); the crop is embedded as it is, with ``fixed_image_standardization``; squared
  L2 distance, no flipped images, no mean subtraction; the threshold grids
  ``arange(0, 4, 0.01)`` (accuracy) and ``arange(0, 4, 0.001)`` (VAL).
- ``sandberg`` (davidsandberg/facenet: ``src/align/align_dataset_mtcnn.py`` with its defaults,
  ``src/validate_on_lfw.py`` with the options its published figures name): 182 px crops, the
  margin (44 px) added in input pixels before a bilinear resize, the largest box weighted
  towards the image centre, PNG files; evaluation takes the centre 160 x 160 without
  resizing (TensorFlow's ``resize_image_with_crop_or_pad``), the fixed standardisation,
  embeddings of each image and its flip concatenated, the training folds' mean subtracted, the
  angular distance ``arccos(cos) / pi`` (its ``distance_metric=1``), and the same two grids.
- ``mobilefacenet`` (Xiaoccer/MobileFaceNet_Pytorch, ``lfw_eval.py``): 112 x 96 SphereFace
  crops (``align.py --preset sphereface``) fed whole, ``(x - 127.5) / 128``, each image's
  features concatenated with its flip's, the training folds' mean subtracted, cosine
  similarity (``cosine`` here: 1 - cos). Its grid, similarities ``arange(-10000, 10001) /
  10000``, is :func:`mobilefacenet_thresholds` as cosine distances; the preset keeps the
  default cosine grid (steps of 0.005) until the evaluate command can name that grid. Two more
  differences from its code remain: it concatenates the raw network outputs, ours unit-norm
  halves, and it takes the mean of every threshold of best training accuracy, ours the first
  (docs/models.md).

Neither publisher wrote anything for an image without a detected face: its pairs were skipped
at evaluation (``evaluate.py --skip-missing``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ALIGN_PRESETS",
    "EVAL_PRESETS",
    "PRESET_NAMES",
    "AlignPreset",
    "EvalPreset",
    "classic_thresholds",
    "mobilefacenet_thresholds",
]


@dataclass(frozen=True)
class AlignPreset:
    """How faces are cropped.

    Args:
        image_size: side of the square crop written.
        margin: pixels added around the detected box (half on each side).
        margin_in: "output": ``margin`` is in crop pixels (facenet-pytorch's ``extract_face``);
            "input": in the input image's pixels, before resizing (davidsandberg/facenet).
        select: which face of several: "center_weighted_size" (box area minus twice the
            squared distance of its centre from the image centre), "probability" or "largest".
        extension: the file type written (".png"), or None to keep the input's.
    """

    image_size: int
    margin: int
    margin_in: str
    select: str
    extension: str | None


@dataclass(frozen=True)
class EvalPreset:
    """How aligned crops are embedded and the pairs measured.

    Args:
        distance: the pair distance (a name in ``facenet.evaluation.protocol.DISTANCES``).
        flip: concatenate the embedding of each image with that of its horizontal flip.
        subtract_mean: subtract the training folds' mean embedding before measuring.
        preprocess: the evaluation transform (``facenet.data.images.EVAL_PREPROCESS``).
        grid: "classic" (:func:`classic_thresholds` for every distance) or "default".
    """

    distance: str
    flip: bool
    subtract_mean: bool
    preprocess: str
    grid: str


ALIGN_PRESETS = {
    "facenet-pytorch": AlignPreset(160, 14, "output", "center_weighted_size", None),
    "sandberg": AlignPreset(182, 44, "input", "center_weighted_size", ".png"),
}

EVAL_PRESETS = {
    "facenet-pytorch": EvalPreset("squared", False, False, "crop", "classic"),
    "sandberg": EvalPreset("angular", True, True, "crop", "classic"),
    "mobilefacenet": EvalPreset("cosine", True, True, "crop", "default"),
}

PRESET_NAMES = tuple(ALIGN_PRESETS)


def classic_thresholds(fine: bool = False) -> np.ndarray:
    """Both publishers' grids, whatever the distance: ``arange(0, 4, 0.01)``, or with ``fine``
    the VAL grid ``arange(0, 4, 0.001)``.

    Angular distances lie in [0, 1], so only the first quarter of these grids falls among them:
    where those thresholds fall is part of the published figure.

    Args:
        fine: the VAL grid.
    """
    return np.arange(0, 4, 0.001 if fine else 0.01)


def mobilefacenet_thresholds() -> np.ndarray:
    """Xiaoccer/MobileFaceNet_Pytorch's grid as cosine distances, increasing: its similarity
    thresholds ``arange(-10000, 10001) / 10000`` mapped by ``1 - t`` (20,001 values in [0, 2],
    steps of 1e-4).

    Its code counts a pair as "same" when the similarity is above the threshold, which is the
    protocol's ``distance < 1 - threshold``.
    """
    similarities = np.arange(-10000, 10001) / 10000  # its getThreshold's grid
    return 1.0 - similarities[::-1]
