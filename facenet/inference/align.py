"""Face alignment: detect the face in every image of a folder with MTCNN and write its crop.

MTCNN is facenet-pytorch's (its wheel carries the P-, R- and O-net weights: nothing is
downloaded). It is imported when an :class:`Aligner` is built, not with this module, so the
rest of the package works without it. The crop around the chosen box follows one of the
publishers' conventions (:mod:`facenet.evaluation.presets`): the margin counted in output pixels
(facenet-pytorch's ``extract_face``) or in input pixels (davidsandberg/facenet), then the box
is clipped to the image and resized to S x S with PIL's bilinear filter, as both do. The
template presets (``arcface``, ``sphereface``) warp the face instead: a similarity transform
fitted by least squares from MTCNN's five landmarks to the publisher's five points
(:func:`align_face`, usable on its own for one image), then a bilinear warp.

MTCNN searches a reduced copy of a large image (``detect_size``: the copy's longer side) and
its boxes and landmarks are mapped back to the full image, which the crop or warp then reads:
MTCNN's cost and memory grow with the pixels it searches (its image pyramid starts at 0.6 of
the image), while a face dataset's face is large enough to be found on a few hundred pixels.

:func:`align_folder` keeps the relative path of every image (``Name/Name_0001.jpg`` stays
``Name/Name_0001.jpg``, or ``.png`` when the preset writes PNG), so LFW's ``pairs.txt`` still
names the crops. Two images that would be written to one crop (``x.jpg`` and ``x.png`` with a
preset writing PNG, or names differing only in case) are refused before anything is written,
naming both: renaming them is the user's choice, and a crop name derived on the fly would no
longer be the one ``pairs.txt`` names.

It is resumable: a crop already written is not redone, and every crop is written atomically,
so an interrupted run leaves no half-written file. The settings are recorded in the output
folder (``align_settings.json``) before the first crop is written, and a run with other
settings refuses to continue that folder, naming the setting that differs: crops of two sizes
or margins would be mixed silently otherwise.

Images without a face and images that cannot be decoded are reported, not written
(optionally, a face-less image is written as a centre crop). An image smaller than MTCNN's
smallest face (20 px on its shorter side) has no face to find: it is reported as such (MTCNN
itself would stop on it).
"""

from __future__ import annotations

import ctypes
import io
import json
import os
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from facenet.data.folder import list_images
from facenet.data.images import CorruptImageError, read_image
from facenet.errors import FacenetError
from facenet.evaluation.presets import ALIGN_PRESETS, TEMPLATES, LandmarkTemplate
from facenet.files import write_atomic, write_text_atomic

__all__ = [
    "DEFAULT_DETECT_SIZE",
    "SELECTIONS",
    "SETTINGS_FILE",
    "AlignError",
    "AlignOutcome",
    "AlignSettings",
    "Aligner",
    "Face",
    "align_face",
    "align_folder",
    "centre_box",
    "check_settings",
    "count",
    "crop_box",
    "detection_copy",
    "detection_scale",
    "load_mtcnn",
    "plan",
    "select_face",
    "similarity_matrix",
    "to_full_image",
    "warp_affine",
    "write_report",
]

SELECTIONS = ("center_weighted_size", "probability", "largest")
# Weight of the squared offset from the image centre in "center_weighted_size" (both
# publishers use 2.0).
_CENTER_WEIGHT = 2.0
# The centre-crop fallback treats the centre square of this fraction of the shorter side as
# the face box: LFW's 250 px images centre a face about 110-130 px wide.
_FALLBACK_FRACTION = 0.5
# Where align_folder records its settings, in the output folder.
SETTINGS_FILE = "align_settings.json"
# The longer side of the copy MTCNN searches (0: the full image). 320 px keeps LFW's 250 px
# originals and 150 px crops untouched, brings a CelebA photo (about 400 x 500) to 256 x 320
# and finds faces down to 20/320 of the longer side (about 31 px on a 500 px photo):
# docs/reproduce.md has the measured cost.
DEFAULT_DETECT_SIZE = 320
# The value of a setting missing from a record written before it existed: folders aligned then
# were searched at full resolution with box crops.
_RECORD_DEFAULTS = {"template": None, "detect_size": 0}
# facenet-pytorch's MTCNN gives coordinates that count pixels from 1, as the MATLAB original it
# was ported from (its boxes go through MATLAB's 1-based arithmetic, and its landmarks of an
# image and of its mirror image add up to width + 1, not width - 1: measured on the astronaut).
_MTCNN_ORIGIN = 1.0
# glibc's M_MMAP_THRESHOLD (mallopt): allocations above it are mapped and unmapped one by one.
_M_MMAP_THRESHOLD = -3
# Decoded images one Aligner holds at once, in pixels (about 3 bytes each): a batch of large
# photos is detected a few at a time, so a worker's memory does not grow with the photos' size.
_HELD_PIXELS = 16_000_000


class AlignError(FacenetError, RuntimeError):
    """Alignment cannot run: facenet-pytorch is missing, or the folders do not fit."""


@dataclass(frozen=True)
class AlignSettings:
    """What :class:`Aligner` writes; see :class:`facenet.evaluation.presets.AlignPreset`.

    Args:
        image_size: side of the square crop.
        margin: pixels added around the detected box.
        margin_in: "output" (crop pixels, facenet-pytorch) or "input" (input pixels, sandberg).
        select: one of ``SELECTIONS``.
        extension: the file type written (".png"), or None to keep the input's.
        fallback: write a centre crop for an image without a detected face.
        preset: the publisher's convention the others came from (recorded with them).
        template: a five-point template (``facenet.evaluation.presets.TEMPLATES``) to warp
            the face onto, or None for a box crop; ``image_size`` is then its height.
        detect_size: the longer side of the copy MTCNN searches; 0 searches the full image.
    """

    image_size: int = 160
    margin: int = 14
    margin_in: str = "output"
    select: str = "center_weighted_size"
    extension: str | None = None
    fallback: bool = False
    preset: str = "facenet-pytorch"
    template: str | None = None
    detect_size: int = DEFAULT_DETECT_SIZE

    @classmethod
    def from_preset(cls, name: str, **overrides) -> AlignSettings:
        """A publisher's settings (``facenet.evaluation.presets.ALIGN_PRESETS``), ``overrides``
        (those not None) replacing any of them."""
        preset = ALIGN_PRESETS[name]
        settings = cls(**{f: getattr(preset, f) for f in preset.__dataclass_fields__}, preset=name)
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def crop_size(self) -> tuple[int, int]:
        """(height, width) of the crop written."""
        if self.template is not None:
            return TEMPLATES[self.template].height, TEMPLATES[self.template].width
        return self.image_size, self.image_size


@dataclass(frozen=True)
class Face:
    """One detected face, in the pixel coordinates of the full image.

    Args:
        box: (x0, y0, x1, y1), as MTCNN gives it (facenet-pytorch's crops use it as it is).
        probability: MTCNN's probability.
        landmarks: (5, 2) (x, y) of the left eye, right eye, nose tip, left and right mouth
            corners (left as seen in the image: MTCNN's order and the templates'), with the
            top-left pixel's centre at (0, 0) (MTCNN's own numbers minus 1).
    """

    box: tuple
    probability: float
    landmarks: np.ndarray


@dataclass
class AlignOutcome:
    """What happened to one image.

    Args:
        source: the input image.
        target: the crop's path (written when ``status`` is "aligned" or "centre_crop").
        status: "aligned", "centre_crop", "no_face" or "unreadable".
        box: the face box in the input (x0, y0, x1, y1), or the centre box of a centre crop.
        probability: MTCNN's probability of the chosen face.
        reason: why an unreadable image could not be decoded, or why no face was searched for.
    """

    source: str
    target: str
    status: str
    box: tuple | None = None
    probability: float | None = None
    reason: str = ""


# --------------------------------------------------------------------------- geometry


def select_face(boxes: np.ndarray, probs: np.ndarray, width: int, height: int, method: str) -> int:
    """Index of the face to keep among K detections.

    Args:
        boxes: (K, 4) boxes (x0, y0, x1, y1) in input pixels.
        probs: (K,) detection probabilities.
        width: the image's width.
        height: the image's height.
        method: one of ``SELECTIONS``.
    """
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])  # (K,)
    if method == "largest":
        return int(np.argmax(area))
    if method == "probability":
        return int(np.argmax(probs))
    if method == "center_weighted_size":
        centres = (boxes[:, :2] + boxes[:, 2:]) / 2  # (K, 2) box centres
        offset_sq = np.sum((centres - [width / 2, height / 2]) ** 2, axis=1)  # (K,)
        return int(np.argmax(area - _CENTER_WEIGHT * offset_sq))
    raise ValueError(f"select={method!r}: expected one of {SELECTIONS}")


def crop_box(box, width: int, height: int, settings: AlignSettings) -> tuple[int, int, int, int]:
    """The integer crop (x0, y0, x1, y1): ``box`` plus the margin, clipped to the image.

    Args:
        box: (x0, y0, x1, y1) detected face box, float input pixels.
        width: the image's width.
        height: the image's height.
        settings: ``margin``, ``margin_in`` and ``image_size``.
    """
    x0, y0, x1, y1 = (float(v) for v in box)
    m = settings.margin
    if settings.margin_in == "output":
        # m pixels of an S-pixel crop: the box spans S - m of them (facenet-pytorch).
        half_x = m * (x1 - x0) / (settings.image_size - m) / 2
        half_y = m * (y1 - y0) / (settings.image_size - m) / 2
    elif settings.margin_in == "input":
        half_x = half_y = m / 2  # davidsandberg/facenet
    else:
        raise ValueError(f"margin_in={settings.margin_in!r}: expected 'output' or 'input'")
    # int() truncates towards zero, as both publishers' conversions do
    return (
        int(max(x0 - half_x, 0)),
        int(max(y0 - half_y, 0)),
        int(min(x1 + half_x, width)),
        int(min(y1 + half_y, height)),
    )


def centre_box(width: int, height: int, aspect: float = 1.0) -> tuple[float, float, float, float]:
    """The face box a centre crop assumes: centred, half the shorter side high.

    Args:
        width: the image's width.
        height: the image's height.
        aspect: the box's width / height (the crop's, so that it is not stretched).
    """
    half = min(width, height) * _FALLBACK_FRACTION / 2
    half_x = half * aspect
    return (width / 2 - half_x, height / 2 - half, width / 2 + half_x, height / 2 + half)


def detection_scale(width: int, height: int, detect_size: int, smallest: int = 20) -> float:
    """The factor (at most 1) of the copy MTCNN searches.

    Args:
        width: the image's width.
        height: the image's height.
        detect_size: the copy's longer side; 0 for the full image.
        smallest: MTCNN's smallest face: the copy's shorter side is kept at least this long,
            so that a long strip still has a scale to search.
    """
    if detect_size <= 0 or max(width, height) <= detect_size:
        return 1.0
    return min(1.0, max(detect_size / max(width, height), smallest / min(width, height)))


def detection_copy(
    image: Image.Image, detect_size: int, smallest: int = 20
) -> tuple[Image.Image, tuple[float, float]]:
    """The copy of ``image`` MTCNN searches, and the (x, y) factors from its pixels to the
    image's (``image`` itself and (1, 1) when it is small enough).

    Args:
        image: the full image.
        detect_size: the copy's longer side (:func:`detection_scale`).
        smallest: MTCNN's smallest face.
    """
    scale = detection_scale(image.width, image.height, detect_size, smallest)
    if scale >= 1.0:
        return image, (1.0, 1.0)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    # PIL's resize averages over the whole footprint (no aliasing); reducing_gap first box-
    # reduces a very large photo by an integer factor, which is much faster and as smooth.
    copy = image.resize(size, Image.BILINEAR, reducing_gap=3.0)
    return copy, (image.width / size[0], image.height / size[1])


def to_full_image(points, factors, origin: float = 0.0) -> np.ndarray:
    """Coordinates on a reduced copy mapped to the full image.

    The image's edge is half a pixel before the first pixel's centre on both, so the centre of
    a copy pixel goes to the centre of the block of pixels it was averaged from.

    Args:
        points: (..., 2) (x, y) on the copy.
        factors: the (x, y) factors from :func:`detection_copy`.
        origin: the coordinate of the first pixel's centre (1 for MTCNN's output).
    """
    edge = origin - 0.5
    return (np.asarray(points, dtype=np.float64) - edge) * np.asarray(factors) + edge


# --------------------------------------------------------------------------- templates


def _skimage_transform():
    """scikit-image's transform module (imported when a template alignment runs)."""
    try:
        from skimage import transform
    except ImportError as err:
        raise AlignError(
            f"template alignment needs scikit-image ({err}); install it with "
            "`pip install -e '.[align]'`"
        ) from None
    return transform


def similarity_matrix(landmarks, points) -> np.ndarray:
    """The (2, 3) similarity transform (rotation, uniform scale, translation) taking
    ``landmarks`` closest to ``points`` in least squares, as insightface fits it
    (scikit-image's ``SimilarityTransform``: Umeyama's closed form).

    Args:
        landmarks: (N, 2) (x, y) in the image, N >= 2.
        points: (N, 2) (x, y) where they should go in the crop.

    Raises:
        ValueError: the shapes differ, a value is not finite, or the landmarks coincide.
    """
    src = np.asarray(landmarks, dtype=np.float64)
    dst = np.asarray(points, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or len(src) < 2:
        raise ValueError(f"landmarks {src.shape} and points {dst.shape}: expected (N, 2) each")
    if not (np.isfinite(src).all() and np.isfinite(dst).all()):
        raise ValueError("landmarks and points must be finite")
    similarity = _skimage_transform().SimilarityTransform
    if hasattr(similarity, "from_estimate"):  # scikit-image >= 0.26 (estimate is deprecated)
        fitted = similarity.from_estimate(src, dst)
        ok = bool(fitted)
    else:
        fitted = similarity()
        ok = fitted.estimate(src, dst)
    if not ok or not np.isfinite(fitted.params).all() or abs(np.linalg.det(fitted.params)) < 1e-12:
        raise ValueError(f"no similarity transform fits landmarks {src.tolist()}")
    return np.asarray(fitted.params[:2], dtype=np.float64)


def _source_region(matrix: np.ndarray, height: int, width: int, shape) -> tuple[int, ...]:
    """(x0, y0, x1, y1): the part of an image of ``shape`` that a warp by ``matrix`` to
    ``height`` x ``width`` reads (each output pixel centre's preimage and its bilinear
    neighbours), clipped to the image; empty (x1 <= x0) when it reads none of it."""
    inverse = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))
    corners = np.array(
        [[0, 0, 1], [width - 1, 0, 1], [0, height - 1, 1], [width - 1, height - 1, 1]]
    )
    xy = corners @ inverse[:2].T  # (4, 2) input coordinates
    low = np.floor(xy.min(axis=0)).astype(np.int64) - 1
    high = np.floor(xy.max(axis=0)).astype(np.int64) + 2  # exclusive; + 1 for the neighbour
    x0, y0 = (int(np.clip(v, 0, n)) for v, n in zip(low, (shape[1], shape[0])))
    x1, y1 = (int(np.clip(v, 0, n)) for v, n in zip(high, (shape[1], shape[0])))
    return x0, y0, x1, y1


def warp_affine(image: np.ndarray, matrix, height: int, width: int) -> np.ndarray:
    """``image`` warped by ``matrix`` into ``height`` x ``width``: bilinear, 0 outside the
    image (as OpenCV's ``warpAffine`` with a constant border, which insightface calls).

    Only the part of the image the warp reads is converted to floating point, so a large
    photo costs no more than a small one.

    Args:
        image: (H, W) or (H, W, C) uint8 array.
        matrix: (2, 3) from image pixel (x, y) to crop pixel, centres at integers.
        height: the crop's height.
        width: the crop's width.

    Returns:
        (height, width[, C]) uint8.
    """
    image = np.asarray(image)
    matrix = np.asarray(matrix, dtype=np.float64)
    out_shape = (height, width, *image.shape[2:])
    x0, y0, x1, y1 = _source_region(matrix, height, width, image.shape)
    if x1 <= x0 or y1 <= y0:
        return np.zeros(out_shape, dtype=np.uint8)
    shifted = matrix.copy()
    shifted[:, 2] += matrix[:, :2] @ [x0, y0]  # the same map, from the region's pixels
    inverse = np.linalg.inv(np.vstack([shifted, [0.0, 0.0, 1.0]]))  # crop -> region
    warped = _skimage_transform().warp(
        image[y0:y1, x0:x1],
        inverse,
        output_shape=out_shape[:2],
        order=1,
        mode="constant",
        cval=0.0,
        preserve_range=True,
    )
    return np.clip(np.rint(warped), 0, 255).astype(np.uint8)


def align_face(image, landmarks, template: str | LandmarkTemplate = "arcface") -> np.ndarray:
    """One face warped onto a five-point template: the similarity transform fitted by least
    squares from ``landmarks`` to the template's points, then a bilinear warp.

    Args:
        image: (H, W, 3) uint8 array (any channel order: it is kept), or a PIL image.
        landmarks: (5, 2) (x, y) of the left eye, right eye, nose tip, left and right mouth
            corners, with the top-left pixel's centre at (0, 0) (``Face.landmarks``,
            insightface's detectors; facenet-pytorch's ``MTCNN.detect`` counts from 1:
            subtract 1 from its numbers).
        template: "arcface" (112 x 112), "sphereface" (112 x 96, height x width) or a
            :class:`facenet.evaluation.presets.LandmarkTemplate`.

    Returns:
        The (height, width, 3) uint8 crop.
    """
    if isinstance(template, str):
        if template not in TEMPLATES:
            raise ValueError(f"template={template!r}: expected one of {tuple(TEMPLATES)}")
        template = TEMPLATES[template]
    matrix = similarity_matrix(landmarks, template.pixel_points())
    return warp_affine(np.asarray(image), matrix, template.height, template.width)


# --------------------------------------------------------------------------- the aligner


def load_mtcnn(device: str | torch.device = "cpu"):
    """facenet-pytorch's MTCNN (weights from its wheel), on ``device``.

    Raises:
        AlignError: facenet-pytorch (or what it imports) is not installed.
    """
    try:
        # Optional third-party package, imported only when alignment runs.
        from facenet_pytorch import MTCNN
    except ImportError as err:
        raise AlignError(
            f"alignment needs facenet-pytorch ({err}); install it with "
            "`pip install --no-deps facenet-pytorch==2.6.0 requests` (make install does)"
        ) from None
    return MTCNN(device=torch.device(device))


def _to_pil(image: torch.Tensor) -> Image.Image:
    """A uint8 RGB tensor (3, H, W) as a PIL image."""
    return Image.fromarray(image.permute(1, 2, 0).numpy())


def _encode(image: Image.Image, target: Path) -> bytes:
    """The crop in the format of ``target``'s extension (PIL's defaults: JPEG quality 75, as
    facenet-pytorch's ``save_img`` wrote them)."""
    buffer = io.BytesIO()
    image.save(buffer, format=Image.registered_extensions()[target.suffix.lower()])
    return buffer.getvalue()


class Aligner:
    """Detects the face of each image and writes its S x S crop.

    Args:
        settings: what to crop and write.
        device: where MTCNN runs.
    """

    def __init__(self, settings: AlignSettings, device: str | torch.device = "cpu"):
        if settings.select not in SELECTIONS:
            raise ValueError(f"select={settings.select!r}: expected one of {SELECTIONS}")
        self.settings = settings
        self.mtcnn = load_mtcnn(device)

    def too_small(self, image: Image.Image) -> str:
        """Why MTCNN cannot search ``image`` (its shorter side under the smallest face), or "".

        MTCNN scales the image so that its smallest face becomes 12 px; a shorter side below
        that face leaves no scale to search, and facenet-pytorch stops on an empty list.
        """
        smallest = int(getattr(self.mtcnn, "min_face_size", 20))
        if min(image.size) >= smallest:
            return ""
        return (
            f"{image.width} x {image.height} px is smaller than the smallest face MTCNN "
            f"searches for ({smallest} px)"
        )

    def detect(self, images: list[Image.Image]) -> list[Face | None]:
        """The chosen face of each image, in its own pixels, or None where none is found (or
        the image is too small to search: :meth:`too_small`).

        MTCNN searches each image's reduced copy (:func:`detection_copy`, ``detect_size``);
        the boxes and landmarks are mapped back to the image.
        """
        smallest = int(getattr(self.mtcnn, "min_face_size", 20))
        copies = [detection_copy(image, self.settings.detect_size, smallest) for image in images]
        by_size = defaultdict(list)  # MTCNN batches only images of one size
        for i, image in enumerate(images):
            if not self.too_small(image):
                by_size[copies[i][0].size].append(i)
        found: list[Face | None] = [None] * len(images)
        for indices in by_size.values():
            boxes, probs, points = self.mtcnn.detect(
                [copies[i][0] for i in indices], landmarks=True
            )
            for i, b, p, lm in zip(indices, boxes, probs, points):
                if b is not None:
                    found[i] = self._choose(images[i], copies[i][1], b, p, lm)
        return found

    def _choose(self, image: Image.Image, factors, boxes, probs, points) -> Face:
        """The face ``settings.select`` keeps, its detections mapped to ``image``'s pixels."""
        boxes = np.asarray(boxes).reshape(-1, 2, 2)
        boxes = to_full_image(boxes, factors, _MTCNN_ORIGIN).reshape(-1, 4)
        # landmarks counted from 0 from here on, as align_face and insightface count
        points = to_full_image(np.asarray(points).reshape(-1, 5, 2), factors, _MTCNN_ORIGIN) - 1
        probs = np.asarray(probs, dtype=np.float64)
        k = select_face(boxes, probs, image.width, image.height, self.settings.select)
        return Face(tuple(float(v) for v in boxes[k]), float(probs[k]), points[k])

    def crop(self, image: Image.Image, face: Face | tuple) -> Image.Image:
        """The crop of a face: warped onto the template (a :class:`Face` with a template
        preset), else its box plus the margin resized to the crop size (bilinear, as the
        publishers resize).

        Args:
            image: the full image.
            face: a :class:`Face`, or a box (x0, y0, x1, y1).
        """
        height, width = self.settings.crop_size
        if isinstance(face, Face) and self.settings.template is not None:
            return self._warp(image, face.landmarks)
        box = face.box if isinstance(face, Face) else face
        region = crop_box(box, image.width, image.height, self.settings)
        return image.crop(region).resize((width, height), Image.BILINEAR)

    def _warp(self, image: Image.Image, landmarks: np.ndarray) -> Image.Image:
        """The template warp, reading only the part of ``image`` around the face (the whole
        of a large photo would be copied into an array otherwise)."""
        template = TEMPLATES[self.settings.template]
        matrix = similarity_matrix(landmarks, template.pixel_points())
        x0, y0, x1, y1 = _source_region(matrix, template.height, template.width, image.size[::-1])
        if x1 <= x0 or y1 <= y0:
            return Image.new("RGB", (template.width, template.height))
        region = np.asarray(image.crop((x0, y0, x1, y1)))
        return Image.fromarray(align_face(region, landmarks - [x0, y0], template))

    def align(self, jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
        """Align ``(source, target)`` pairs: write each crop atomically, report the rest.

        Images are decoded and detected in groups of at most ``_HELD_PIXELS`` pixels, so that
        a batch of large photos is never held at once.
        """
        outcomes, held, pixels = [], [], 0
        for source, target in jobs:
            try:
                image = _to_pil(read_image(source))
            except CorruptImageError as err:
                outcomes.append(AlignOutcome(source, target, "unreadable", reason=err.reason))
                continue
            held.append((image, source, target))
            pixels += image.width * image.height
            if pixels >= _HELD_PIXELS:
                outcomes += self._align_held(held)
                held, pixels = [], 0
        return outcomes + self._align_held(held)

    def _align_held(self, held: list[tuple[Image.Image, str, str]]) -> list[AlignOutcome]:
        if not held:
            return []
        faces = self.detect([image for image, _, _ in held])
        return [
            self._write(image, source, target, face, self.too_small(image))
            for (image, source, target), face in zip(held, faces)
        ]

    def _write(self, image: Image.Image, source: str, target: str, face, reason: str):
        if face is None and not self.settings.fallback:
            return AlignOutcome(source, target, "no_face", reason=reason)
        if face is None:  # a centre box of the crop's shape
            height, width = self.settings.crop_size
            box, prob = centre_box(image.width, image.height, width / height), None
            data = _encode(self.crop(image, box), Path(target))
        else:
            box, prob = face.box, face.probability
            data = _encode(self.crop(image, face), Path(target))
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda fh: fh.write(data))
        status = "aligned" if face is not None else "centre_crop"
        return AlignOutcome(source, target, status, box, prob, reason)


# --------------------------------------------------------------------------- folders


def _libc():
    """glibc, or None elsewhere (the calls below are then skipped)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _bound_heap() -> None:
    """Serve allocations of 1 MiB and more (images, MTCNN's feature maps) by their own
    mappings, returned to the system when freed.

    glibc raises its threshold after such blocks are freed and then serves the next ones from
    the heap, where images of ever other sizes fragment it: a worker's memory grew with the
    folder (measured: +150 MB over 900 CelebA photos).
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def _release_memory() -> None:
    """Give the heap's free pages back to the system after a batch (glibc's malloc_trim)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


_WORKER: Aligner | None = None  # one MTCNN per worker process


def _init_worker(settings: AlignSettings, device: str) -> None:
    global _WORKER
    torch.set_num_threads(1)  # N workers on N cores: one thread each
    _bound_heap()
    _WORKER = Aligner(settings, device)


def _align_in_worker(jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
    outcomes = _WORKER.align(jobs)
    _release_memory()
    return outcomes


def _target(path: str, src: Path, dst: Path, settings: AlignSettings) -> Path:
    """Where the crop of ``path`` goes: its path relative to ``src``, under ``dst``."""
    target = dst / Path(path).relative_to(src)
    return target.with_suffix(settings.extension) if settings.extension else target


def _refuse_collisions(pairs: list[tuple[str, Path]]) -> None:
    """Refuse two sources whose crops would have one name (compared case-insensitively, as a
    copy to a case-insensitive file system would)."""
    first: dict[str, str] = {}
    for source, target in pairs:
        key = str(target).casefold()
        if key in first:
            raise AlignError(
                f"{first[key]} and {source} would both be written to {target}: rename one of "
                "them (or keep the input's file type: the preset writes one type for all)"
            )
        first[key] = source


def plan(src, dst, settings: AlignSettings) -> tuple[list[tuple[str, str]], int]:
    """``(source, target)`` for every image under ``src`` whose crop is not yet written, and
    the number already written.

    Images reached through a link into ``dst`` are left out (they are crops already).

    Raises:
        AlignError: ``src`` is not a folder, ``dst`` lies inside it, or two images would be
            written to one crop.
    """
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise AlignError(f"source folder not found: {src}")
    dst_real = dst.resolve()
    if dst_real == src.resolve() or src.resolve() in dst_real.parents:
        raise AlignError(f"{dst} lies inside {src}: the crops would be aligned again")
    paths, _ = list_images(src)
    paths = [p for p in paths if dst_real not in Path(os.path.realpath(p)).parents]
    pairs = [(path, _target(path, src, dst, settings)) for path in paths]
    _refuse_collisions(pairs)
    jobs = [(path, str(target)) for path, target in pairs if not target.is_file()]
    return jobs, len(pairs) - len(jobs)


def _recorded(path: Path) -> dict:
    """The settings recorded in ``path``, or an AlignError saying why they cannot be read."""
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise AlignError(f"cannot read the alignment settings {path}: {err}") from None
    if not isinstance(recorded, dict):
        raise AlignError(f"{path}: expected the alignment settings as a JSON object")
    return recorded


def check_settings(dst, settings: AlignSettings, already: int) -> None:
    """Refuse to continue ``dst`` with other settings than those it was aligned with; record
    them in ``dst/align_settings.json`` when it has none.

    Args:
        dst: the output folder.
        settings: this run's settings.
        already: crops of this run's images already in ``dst``.

    Raises:
        AlignError: a setting differs from the one recorded (named, both values given), or
            ``dst`` holds crops but no record (their settings are unknown).
    """
    path = Path(dst) / SETTINGS_FILE
    wanted = asdict(settings)
    if not path.exists():
        if already:
            raise AlignError(
                f"{dst} holds {already} crops but no {SETTINGS_FILE}: the settings they were "
                "made with are unknown; align into a new folder"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(wanted, indent=2) + "\n")
        return
    recorded = _recorded(path)
    for field in fields(settings):
        # a record written before a setting existed holds what was done then
        value = recorded.get(field.name, _RECORD_DEFAULTS.get(field.name))
        if value != wanted[field.name]:
            hint = (
                " (--detect-size; 0 searches the full image)" if field.name == "detect_size" else ""
            )
            raise AlignError(
                f"{dst} was aligned with {field.name} = {value!r}; this run "
                f"asks for {wanted[field.name]!r}{hint} ({path}): align into another folder, or "
                "give the same settings"
            )


def _batches(jobs, device, settings, batch_size: int, workers: int):
    """Outcome lists, batch by batch, in this process or in ``workers`` processes."""
    chunks = [jobs[i : i + batch_size] for i in range(0, len(jobs), batch_size)]
    if workers <= 1:
        _bound_heap()
        aligner = Aligner(settings, device)
        for chunk in chunks:
            yield aligner.align(chunk)
            _release_memory()
        return
    # spawn: a CUDA context (and the parent's threads) must not be forked into the workers
    with ProcessPoolExecutor(
        workers, get_context("spawn"), initializer=_init_worker, initargs=(settings, str(device))
    ) as pool:
        futures = [pool.submit(_align_in_worker, chunk) for chunk in chunks]
        yield from (future.result() for future in as_completed(futures))


def align_folder(
    src,
    dst,
    settings: AlignSettings,
    device: str | torch.device = "cpu",
    batch_size: int = 32,
    workers: int = 1,
    progress: bool = True,
) -> tuple[list[AlignOutcome], int]:
    """Align every image under ``src`` into ``dst`` (same relative paths), skipping crops
    already written; refuses a ``dst`` aligned with other settings (:func:`check_settings`)
    and two images with one crop name (:func:`plan`).

    Args:
        src: a folder of images (``Name/Name_0001.jpg``, any depth).
        dst: where the crops go; created as needed.
        settings: what to crop and write.
        device: where MTCNN runs.
        batch_size: images per MTCNN call (images of one size are detected together).
        workers: processes, each with its own MTCNN and one thread; 1 aligns in this process.
            The aligning process has glibc serve blocks of 1 MiB and more by their own
            mappings and trims its heap after each batch (:func:`_bound_heap`).
        progress: a progress bar on stderr.

    Returns:
        ``(outcomes, already)``: one :class:`AlignOutcome` per image processed, sorted by
        source, and the number of crops that were already there.
    """
    if batch_size < 1 or workers < 1:
        raise AlignError(f"batch size {batch_size} and workers {workers} must be at least 1")
    jobs, already = plan(src, dst, settings)
    check_settings(dst, settings, already)
    outcomes: list[AlignOutcome] = []
    with tqdm(total=len(jobs), desc="aligning", unit="img", disable=not progress) as bar:
        for chunk in _batches(jobs, device, settings, batch_size, workers):
            outcomes += chunk
            bar.update(len(chunk))
    return sorted(outcomes, key=lambda o: o.source), already


def write_report(outcomes: list[AlignOutcome], path) -> Path:
    """A tab-separated list of the images not aligned from a face: ``status  source  reason``
    (no_face, unreadable, centre_crop), written atomically."""
    lines = ["status\tsource\treason"]
    for o in outcomes:
        if o.status != "aligned":
            lines.append(f"{o.status}\t{o.source}\t{o.reason}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, "\n".join(lines) + "\n")


def count(outcomes: list[AlignOutcome]) -> dict[str, int]:
    """Number of images of each status."""
    counts = dict.fromkeys(("aligned", "centre_crop", "no_face", "unreadable"), 0)
    for o in outcomes:
        counts[o.status] += 1
    return counts
