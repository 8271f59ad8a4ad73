"""How faces are cropped, per publisher, as data: ``ALIGN_PRESETS`` (a box with a margin, or
five landmarks warped onto one of the ``TEMPLATES``). docs/reproduce.md and docs/models.md cite
the publishers' code for each value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AlignPreset:
    """How faces are cropped.

    ``margin_in``: "output" (crop pixels, facenet-pytorch's ``extract_face``) or "input"
    (input pixels before resizing, davidsandberg/facenet); ``select``: "center_weighted_size"
    (box area minus twice the squared distance of its centre from the image centre),
    "probability" or "largest"; ``extension``: None keeps the input's; ``template``: a name in
    :data:`TEMPLATES` to warp onto (``image_size`` is then its height), None for a box crop.
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

    ``points``: (x, y) of the left eye, right eye, nose tip, left and right mouth corners (as
    seen in the image), as the publisher wrote them; ``origin``: the coordinate of the top-left
    pixel's centre in the publisher's code (0: OpenCV's ``warpAffine``; 1: MATLAB's
    ``imtransform`` with ``'XData', [1 96]``).
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
# ``SimilarityTransform`` and warped with ``cv2.warpAffine``, ``norm_crop``): SphereFace's
# template with 8.0 added to every x (recognition/arcface_torch/eval_ijbc.py: ``src[:, 0] += 8.0``),
# its published digits exactly in float64.
_ARCFACE_POINTS = tuple((x + 8.0, y) for x, y in _SPHEREFACE_POINTS)

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


ALIGN_PRESETS = {
    "facenet-pytorch": AlignPreset(160, 14, "output", "center_weighted_size", None),
    # davidsandberg/facenet's LFW convention (its wiki's align_dataset_mtcnn.py call, which the
    # published figures were measured on); its training sets were aligned at 182, margin 44.
    "sandberg": AlignPreset(160, 32, "input", "center_weighted_size", ".png"),
    # Template presets: no margin (the template places the face); the input's file type, as
    # with facenet-pytorch's preset. insightface keeps the face of highest detector score
    # (FaceAnalysis.get). SphereFace's face_detect_demo.m keeps the largest, but its published
    # LFW crops came from landmarks of the labelled person, whom LFW centres: of LFW's 7,701
    # pair images the largest face is another person's in 7, and MobileFaceNet's 068.ckpt
    # scores 0.9848 on such crops against 0.9862 with the centre-weighted choice
    # (docs/reproduce.md; benchmarks/bench_published.py reruns it).
    "arcface": AlignPreset(112, 0, "output", "probability", None, "arcface"),
    "sphereface": AlignPreset(112, 0, "output", "center_weighted_size", None, "sphereface"),
}

PRESET_NAMES = tuple(ALIGN_PRESETS)
