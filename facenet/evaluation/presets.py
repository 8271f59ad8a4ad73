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
  crops (``align.py --preset sphereface``) fed whole, ``(x - 127.5) / 128``; the RAW network
  outputs of each image and of its flip concatenated (``features="raw"``); per fold, the
  training folds' mean subtracted from those, each side divided by its norm and the pair
  scored by the dot product, in float32 with its numpy operations (``scoring="mobilefacenet"``;
  ``cosine`` here: 1 - that score); its grid, similarities ``arange(-10000, 10001) / 10000``
  (:func:`mobilefacenet_thresholds`, as cosine distances); the threshold the mean of every
  grid threshold of best training accuracy, a pair exactly at it wrong for either kind
  (``threshold_rule="mean"``). Nothing of its computation differs (docs/models.md).

Neither publisher wrote anything for an image without a detected face: its pairs were skipped
at evaluation (``evaluate.py --skip-missing``).

Two alignment presets warp the face onto a five-point template instead of cropping a box: a
similarity transform (rotation, uniform scale, translation) fitted by least squares from MTCNN's
five landmarks (eyes, nose tip, mouth corners) to the template's points, then a bilinear warp
(:data:`TEMPLATES`):

- ``arcface``: 112 x 112, insightface's template (ArcFace and the models trained with its
  code: most ArcFace-family and MobileFaceNet weights downloaded today).
- ``sphereface``: 112 x 96 (height x width), SphereFace's template (CASIA-WebFace models aligned
  as SphereFace did, e.g. Xiaoccer/MobileFaceNet_Pytorch). insightface's template is this one
  moved 8 px to the right, to centre it in a 112 px wide crop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ALIGN_PRESETS",
    "EVAL_PRESETS",
    "PRESET_NAMES",
    "TEMPLATES",
    "AlignPreset",
    "EvalPreset",
    "LandmarkTemplate",
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
        template: the name of a five-point template in :data:`TEMPLATES` (the crop is warped
            onto it, and ``image_size`` is its height), or None for a box crop.
    """

    image_size: int
    margin: int
    margin_in: str
    select: str
    extension: str | None
    template: str | None = None


@dataclass(frozen=True)
class LandmarkTemplate:
    """Where a similarity alignment puts the five landmarks in the crop.

    Args:
        height: the crop's height in pixels.
        width: the crop's width in pixels.
        points: (x, y) of the left eye, right eye, nose tip, left and right mouth corners (left
            and right as seen in the image), in the crop's pixel coordinates as the publisher
            wrote them.
        source: where the numbers come from.
        origin: the coordinate of the top-left pixel's centre in the publisher's code: 0 for
            insightface (OpenCV's ``warpAffine``), 1 for SphereFace (MATLAB's ``imtransform``
            with ``'XData', [1 96]``).
    """

    height: int
    width: int
    points: tuple[tuple[float, float], ...]
    source: str
    origin: float = 0.0

    def array(self) -> np.ndarray:
        """The publisher's points as a (5, 2) float64 array of (x, y)."""
        return np.asarray(self.points, dtype=np.float64)

    def pixel_points(self) -> np.ndarray:
        """The points with the top-left pixel's centre at (0, 0), as the warp counts."""
        return self.array() - self.origin


# The publishers' numbers, copied digit for digit.
# SphereFace: wy1iu/sphereface, preprocess/code/face_align_demo.m (``imgSize = [112, 96]``,
# ``coord5point``; fitted with MATLAB's ``cp2tform(..., 'similarity')``, from the landmarks of
# the MATLAB MTCNN, which count pixels from 1, and warped by ``imtransform`` with ``'XData',
# [1 96]``: the first pixel's centre is at (1, 1) on both sides, hence origin 1).
_SPHEREFACE_POINTS = (
    (30.2946, 51.6963),
    (65.5318, 51.5014),
    (48.0252, 71.7366),
    (33.5493, 92.3655),
    (62.7299, 92.2041),
)
# insightface: deepinsight/insightface, python-package/insightface/utils/face_align.py
# (``arcface_src``, ``arcface_dst`` in later versions; fitted with skimage's
# ``SimilarityTransform`` and warped with ``cv2.warpAffine``, ``norm_crop``). It is SphereFace's
# template with 8.0 added to every x (recognition/arcface_torch/eval_ijbc.py: ``src[:, 0] += 8.0``).
_ARCFACE_POINTS = (
    (38.2946, 51.6963),
    (73.5318, 51.5014),
    (56.0252, 71.7366),
    (41.5493, 92.3655),
    (70.7299, 92.2041),
)

TEMPLATES = {
    "arcface": LandmarkTemplate(
        112,
        112,
        _ARCFACE_POINTS,
        "deepinsight/insightface python-package/insightface/utils/face_align.py",
    ),
    "sphereface": LandmarkTemplate(
        112, 96, _SPHEREFACE_POINTS, "wy1iu/sphereface preprocess/code/face_align_demo.m", 1.0
    ),
}


@dataclass(frozen=True)
class EvalPreset:
    """How aligned crops are embedded and the pairs measured.

    Args:
        distance: the pair distance (a name in ``facenet.evaluation.protocol.DISTANCES``).
        flip: concatenate the embedding of each image with that of its horizontal flip.
        subtract_mean: subtract the training folds' mean embedding before measuring.
        preprocess: the evaluation transform (``facenet.data.images.EVAL_PREPROCESS``).
        grid: "classic" (:func:`classic_thresholds` for every distance), "mobilefacenet"
            (:func:`mobilefacenet_thresholds`) or "default".
        features: "unit" (the network's unit embeddings) or "raw" (before L2 normalisation).
        threshold_rule: "first" (the classic code's first best threshold) or "mean"
            (``facenet.evaluation.protocol.THRESHOLD_RULES``).
        scoring: "float64" or "mobilefacenet" (``facenet.evaluation.protocol.SCORINGS``).
    """

    distance: str
    flip: bool
    subtract_mean: bool
    preprocess: str
    grid: str
    features: str = "unit"
    threshold_rule: str = "first"
    scoring: str = "float64"


ALIGN_PRESETS = {
    "facenet-pytorch": AlignPreset(160, 14, "output", "center_weighted_size", None),
    "sandberg": AlignPreset(182, 44, "input", "center_weighted_size", ".png"),
    # Template presets: no margin (the template places the face); the input's file type, as
    # with facenet-pytorch's preset. insightface's own detector (RetinaFace/SCRFD) keeps the
    # face with the highest score, but MTCNN's pick follows the other presets here.
    "arcface": AlignPreset(112, 0, "output", "center_weighted_size", None, "arcface"),
    "sphereface": AlignPreset(112, 0, "output", "center_weighted_size", None, "sphereface"),
}

EVAL_PRESETS = {
    "facenet-pytorch": EvalPreset("squared", False, False, "crop", "classic"),
    "sandberg": EvalPreset("angular", True, True, "crop", "classic"),
    "mobilefacenet": EvalPreset(
        "cosine", True, True, "crop", "mobilefacenet", "raw", "mean", "mobilefacenet"
    ),
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
