"""Face alignment: MTCNN finds the face of every image of a folder and its crop is written.

MTCNN is facenet-pytorch's (weights in its wheel), imported when an :class:`Aligner` is built.
The crop follows a publisher's convention (:mod:`facenet.evaluation.presets`): the box plus a
margin resized to S x S (bilinear), or a warp onto a five-point template (:func:`align_face`).
MTCNN searches a copy reduced to ``detect_size`` px on its longer side; its boxes and landmarks
are mapped back to the full image. :func:`align_folder` keeps each image's relative path (LFW's
``pairs.txt`` still names the crops), resumes (atomic writes; crops already there are kept),
refuses a folder aligned with other settings and two images with one crop name, and holds a
bounded number of pixels at once.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from facenet.data.folder import list_images
from facenet.data.images import CorruptImageError, read_image
from facenet.errors import ConfigError, DataError, FacenetError
from facenet.files import read_json, write_atomic, write_text_atomic
from facenet.memory import (
    M_MMAP_THRESHOLD,
    glibc_call,
    keep_freed_memory,
    keeps_freed_memory,
)
from facenet.wings.align.presets import ALIGN_PRESETS, TEMPLATES, AlignPreset

SELECTIONS = ("center_weighted_size", "probability", "largest")
_CENTER_WEIGHT = 2.0  # of the squared offset from the image centre (both publishers)
# A centre crop's face box: the centre square of this fraction of the shorter side (LFW's
# 250 px images centre a face about 110-130 px wide).
_FALLBACK_FRACTION = 0.5
SETTINGS_FILE = "align_settings.json"
REPORT_HEADER = b"status\tsource\treason\n"
# 320 px keeps LFW's 250 px originals untouched and finds faces down to 20/320 of the longer
# side; docs/reproduce.md has the measured cost.
DEFAULT_DETECT_SIZE = 320
# A setting missing from an older record: those folders were searched at full size, box crops.
_RECORD_DEFAULTS = {"template": None, "detect_size": 0}
# facenet-pytorch's MTCNN counts pixels from 1, as the MATLAB original (its landmarks of an
# image and of its mirror image add up to width + 1).
_MTCNN_ORIGIN = 1.0
# Decoded pixels one Aligner holds at once (3 bytes each), whatever the photos' size
_HELD_PIXELS = 16_000_000


@dataclass(frozen=True)
class AlignSettings(AlignPreset):
    """What :class:`Aligner` writes: a preset's fields, its name, ``fallback`` (a centre crop for
    an image without a face) and ``detect_size`` (the longer side MTCNN searches; 0: the full
    image). Built by :meth:`from_preset`."""

    fallback: bool = False
    preset: str = "facenet-pytorch"
    detect_size: int = 0

    def __post_init__(self):
        for name, allowed in (("select", SELECTIONS), ("margin_in", ("output", "input"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected one of {allowed}")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> AlignSettings:
        """A publisher's settings, ``overrides`` that are not None replacing them. Box presets
        search the full image, as facenet-pytorch and davidsandberg/facenet do; template presets
        a ``DEFAULT_DETECT_SIZE`` copy, as insightface searches a reduced one (640 px)."""
        preset = ALIGN_PRESETS[name]
        size = DEFAULT_DETECT_SIZE if preset.template else 0
        settings = cls(**asdict(preset), preset=name, detect_size=size)
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def crop_size(self) -> tuple[int, int]:
        """(height, width) of the crop written."""
        template = TEMPLATES.get(self.template)
        return (self.image_size,) * 2 if template is None else (template.height, template.width)


@dataclass(frozen=True)
class Face:
    """One detected face in the full image's pixels: ``box`` (x0, y0, x1, y1) as MTCNN gives it;
    ``landmarks`` (5, 2) (x, y) of the eyes, nose tip and mouth corners (MTCNN's order), the
    top-left pixel's centre at (0, 0)."""

    box: tuple
    probability: float
    landmarks: np.ndarray


@dataclass
class AlignOutcome:
    """What happened to one image: ``status`` is "aligned", "centre_crop", "no_face" or
    "unreadable"; ``reason`` says why an image was unreadable or not searched."""

    source: str
    target: str
    status: str
    reason: str = ""


# --------------------------------------------------------------------------- geometry


def select_face(boxes: np.ndarray, probs: np.ndarray, width: int, height: int, method: str) -> int:
    """Index of the face to keep among K detections: ``boxes`` (K, 4), ``probs`` (K,)."""
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])  # (K,)
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2  # (K, 2)
    offset_sq = np.sum((centres - [width / 2, height / 2]) ** 2, axis=1)  # (K,)
    scores = {
        "largest": area,
        "probability": probs,
        "center_weighted_size": area - _CENTER_WEIGHT * offset_sq,
    }
    return int(np.argmax(scores[method]))


def crop_box(box, width: int, height: int, settings: AlignSettings) -> tuple[int, int, int, int]:
    """The integer crop (x0, y0, x1, y1): the float ``box`` plus the margin, clipped."""
    start, end = np.asarray(box, dtype=np.float64).reshape(2, 2)  # (x, y) each
    m = settings.margin
    if settings.margin_in == "input":
        half = m / 2  # davidsandberg/facenet
    else:  # m pixels of an S-pixel crop: the box spans S - m of them (facenet-pytorch)
        half = m * (end - start) / (settings.image_size - m) / 2  # (x, y)
    # int() truncates towards zero, as both publishers' conversions do
    corners = [*np.maximum(start - half, 0), *np.minimum(end + half, [width, height])]
    return tuple(int(v) for v in corners)


def detection_scale(width: int, height: int, detect_size: int, smallest: int = 20) -> float:
    """The factor (at most 1) of the copy MTCNN searches; its shorter side stays at least
    ``smallest`` (MTCNN's smallest face), so that a long strip still has a scale to search."""
    if detect_size <= 0:
        return 1.0
    return min(1.0, max(detect_size / max(width, height), smallest / min(width, height)))


def _detection_copy(image: Image.Image, detect_size: int, smallest: int):
    """The copy MTCNN searches and the (x, y) factors from its pixels to the image's."""
    scale = detection_scale(*image.size, detect_size, smallest)
    if scale >= 1.0:
        return image, (1.0, 1.0)
    size = tuple(max(1, round(side * scale)) for side in image.size)  # (width, height)
    # PIL's resize averages the whole footprint (no aliasing); reducing_gap first box-reduces
    # a very large photo by an integer factor, much faster and as smooth.
    copy = image.resize(size, Image.BILINEAR, reducing_gap=3.0)
    return copy, np.divide(image.size, size)  # (x, y)


def to_full_image(points, factors, origin: float = 0.0) -> np.ndarray:
    """(..., 2) (x, y) on a reduced copy mapped to the full image; ``origin`` is the first
    pixel's centre (1 for MTCNN). The edge is half a pixel before it on both images, so a copy
    pixel's centre goes to the centre of the block it was averaged from."""
    edge = origin - 0.5
    return (np.asarray(points, dtype=np.float64) - edge) * np.asarray(factors) + edge


# --------------------------------------------------------------------------- templates


def _optional(module: str, needs: str, install: str):
    """An optional dependency, imported when first used."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise FacenetError(f"{needs} ({err}); install it with {install}") from None


def _skimage_transform():
    return _optional(
        "skimage.transform",
        "template alignment needs scikit-image",
        "`pip install -e '.[align]'`",
    )


def similarity_matrix(landmarks, points) -> np.ndarray:
    """The (2, 3) similarity transform taking ``landmarks`` (N, 2) closest to ``points`` (N, 2)
    in least squares, as insightface fits it (scikit-image's Umeyama ``SimilarityTransform``).

    Raises:
        ValueError: the shapes differ, a value is not finite, or the landmarks coincide.
    """
    src = np.asarray(landmarks, dtype=np.float64)
    dst = np.asarray(points, dtype=np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or len(src) < 2:
        raise ValueError(f"landmarks {src.shape} and points {dst.shape}: expected (N, 2) each")
    if not np.isfinite([src, dst]).all():
        raise ValueError("landmarks and points must be finite")
    # a failed fit has no params (scikit-image >= 0.26) or NaN ones (before)
    params = getattr(
        _skimage_transform().estimate_transform("similarity", src, dst), "params", None
    )
    if params is None or not np.isfinite(params).all() or abs(np.linalg.det(params)) < 1e-12:
        raise ValueError(f"no similarity transform fits landmarks {src.tolist()}")
    return np.asarray(params[:2], dtype=np.float64)


def _warp_affine(image: Image.Image, matrix: np.ndarray, height: int, width: int) -> np.ndarray:
    """``image`` warped by the (2, 3) ``matrix`` into a (height, width, C) uint8 array: bilinear,
    0 outside (OpenCV's ``warpAffine``, as insightface calls it). Only the region the warp reads
    is taken from the image, so a large photo costs no more."""
    inverse = np.linalg.inv(np.vstack([matrix, [0.0, 0.0, 1.0]]))  # crop -> image
    corners = np.array([[x, y, 1] for y in (0, height - 1) for x in (0, width - 1)])
    xy = corners @ inverse[:2].T  # (4, 2)
    # (x0, y0, x1, y1): x1 and y1 exclusive, + 1 for the bilinear neighbour
    region = np.floor([*xy.min(axis=0) - 1, *xy.max(axis=0) + 2])
    x0, y0, x1, y1 = np.clip(region, 0, [*image.size] * 2).astype(int)
    if x1 <= x0 or y1 <= y0:
        return np.zeros((height, width, len(image.getbands())), dtype=np.uint8)
    inverse[:2, 2] -= [x0, y0]  # crop -> region
    warped = _skimage_transform().warp(
        np.asarray(image.crop((x0, y0, x1, y1))),
        inverse,
        output_shape=(height, width),
        order=1,
        preserve_range=True,  # mode "constant", cval 0: OpenCV's border
    )
    return np.clip(np.rint(warped), 0, 255).astype(np.uint8)


def align_face(image, landmarks, template: str = "arcface") -> np.ndarray:
    """One face warped onto a five-point template: a least-squares similarity fit, then a
    bilinear warp; returns the (height, width, 3) uint8 crop.

    Args:
        image: (H, W, 3) uint8 array (its channel order is kept) or a PIL image (only the
            region around the face is read).
        landmarks: (5, 2) as ``Face.landmarks``, counted from 0 (insightface's detectors;
            subtract 1 from facenet-pytorch's ``MTCNN.detect``).
        template: "arcface" (112 x 112) or "sphereface" (112 x 96, H x W).
    """
    if template not in TEMPLATES:
        raise ValueError(f"template={template!r}: expected one of {tuple(TEMPLATES)}")
    template = TEMPLATES[template]
    matrix = similarity_matrix(landmarks, template.pixel_points())
    image = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    return _warp_affine(image, matrix, template.height, template.width)


# --------------------------------------------------------------------------- the aligner


class Aligner:
    """Detects the face of each image (MTCNN on ``device``) and writes its crop."""

    def __init__(self, settings: AlignSettings, device: str | torch.device = "cpu"):
        self.settings = settings
        self.mtcnn = _optional(
            "facenet_pytorch",
            "alignment needs facenet-pytorch",
            "`pip install --no-deps facenet-pytorch==2.6.0 requests` (make install does)",
        ).MTCNN(device=torch.device(device))
        self.smallest = int(self.mtcnn.min_face_size)  # MTCNN's smallest face, in pixels
        # Blocks of 1 MiB and more in their own mappings, returned when freed: glibc's raised
        # threshold otherwise lets images of ever other sizes fragment the heap (measured:
        # +150 MB over 900 CelebA photos). Moot in a command, whose malloc maps no block of
        # its own (facenet.memory): there MTCNN's buffers stay in the heap, 1.5x faster
        # for 1.2x the peak RSS (BENCHMARKS.md).
        glibc_call("mallopt", M_MMAP_THRESHOLD, 1 << 20)

    def too_small(self, image: Image.Image) -> str:
        """Why MTCNN cannot search ``image``, or "": a shorter side under its smallest face
        leaves no scale to search (facenet-pytorch stops on an empty list)."""
        if min(image.size) >= self.smallest:
            return ""
        return (
            f"{image.width} x {image.height} px is smaller than the smallest face MTCNN "
            f"searches for ({self.smallest} px)"
        )

    def detect(self, images: list[Image.Image]) -> list[Face | None]:
        """The chosen face of each image, searched on its reduced copy, in the image's own
        pixels; None where none is found or the image is too small."""
        by_size = defaultdict(list)  # MTCNN batches only images of one size
        for i, image in enumerate(images):
            if not self.too_small(image):
                copy, factors = _detection_copy(image, self.settings.detect_size, self.smallest)
                by_size[copy.size].append((i, copy, factors))
        found: list[Face | None] = [None] * len(images)
        for group in by_size.values():
            indices, copies, factors = zip(*group)
            boxes, probs, points = self.mtcnn.detect(list(copies), landmarks=True)
            for i, f, b, p, lm in zip(indices, factors, boxes, probs, points):
                if b is None:
                    continue
                # (K, 7, 2): the boxes' two corners, then the five landmarks
                xy = to_full_image(
                    np.concatenate([np.reshape(b, (-1, 2, 2)), lm], 1), f, _MTCNN_ORIGIN
                )
                k = select_face(xy[:, :2].reshape(-1, 4), p, *images[i].size, self.settings.select)
                # landmarks counted from 0 from here on, as align_face and insightface count
                found[i] = Face(tuple(xy[k, :2].ravel().tolist()), float(p[k]), xy[k, 2:] - 1)
        return found

    def crop(self, image: Image.Image, face: Face | tuple) -> Image.Image:
        """The crop of a :class:`Face` (a template warp with a template preset) or of a box
        (x0, y0, x1, y1): box plus margin, resized bilinearly as the publishers resize."""
        if isinstance(face, Face) and self.settings.template is not None:
            return Image.fromarray(align_face(image, face.landmarks, self.settings.template))
        box = face.box if isinstance(face, Face) else face
        region = crop_box(box, *image.size, self.settings)
        return image.crop(region).resize(self.settings.crop_size[::-1], Image.BILINEAR)

    def _decoded(self, sources):
        """Lists of ``(source, image or CorruptImageError)``, each holding at most
        ``_HELD_PIXELS`` decoded pixels (one image more)."""
        held, pixels = [], 0
        for source in sources:
            try:
                image = Image.fromarray(read_image(source).permute(1, 2, 0).numpy())
                pixels += image.width * image.height
            except CorruptImageError as err:
                image = err
            held.append((source, image))
            if pixels >= _HELD_PIXELS:
                yield held
                held, pixels = [], 0
        if held:
            yield held
        # A command's malloc keeps freed memory (facenet.memory): trimming would hand it
        # to the kernel, and the next photos fault it back in (18% of alignment's CPU time).
        if not keeps_freed_memory():
            glibc_call("malloc_trim", 0)

    def _found(self, sources):
        """``(source, image or CorruptImageError, face or None)`` of each file, in order."""
        for held in self._decoded(sources):
            faces = iter(self.detect([i for _, i in held if isinstance(i, Image.Image)]))
            for source, image in held:
                yield source, image, next(faces) if isinstance(image, Image.Image) else None

    def align(self, jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
        """Align ``(source, target)`` pairs, decoding at most ``_HELD_PIXELS`` at a time; each
        crop is written atomically."""
        targets = dict(jobs)
        return [self._write(s, targets[s], image, face) for s, image, face in self._found(targets)]

    def detect_files(self, sources: list[str]) -> list[Face | AlignOutcome]:
        """The chosen face of each image file, or an "unreadable" or "no_face" outcome saying
        why there is none, decoding at most ``_HELD_PIXELS`` at a time."""
        return [
            AlignOutcome(s, "", "unreadable", image.reason)
            if isinstance(image, CorruptImageError)
            else face or AlignOutcome(s, "", "no_face", self.too_small(image))
            for s, image, face in self._found(sources)
        ]

    def _write(self, source: str, target: str, image, face) -> AlignOutcome:
        if isinstance(image, CorruptImageError):
            return AlignOutcome(source, target, "unreadable", image.reason)
        reason = self.too_small(image)
        if face is None and not self.settings.fallback:
            return AlignOutcome(source, target, "no_face", reason)
        status = "centre_crop" if face is None else "aligned"
        if face is None:
            height, width = self.settings.crop_size  # the box has the crop's aspect
            half = min(image.size) * _FALLBACK_FRACTION / 2 * np.array([width / height, 1])
            centre = np.array(image.size) / 2  # (x, y)
            face = (*(centre - half), *(centre + half))
        crop = self.crop(image, face)
        # PIL's defaults: JPEG quality 75, as facenet-pytorch's save_img
        form = Image.registered_extensions()[Path(target).suffix.lower()]
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda fh: crop.save(fh, format=form))
        return AlignOutcome(source, target, status, reason)


# --------------------------------------------------------------------------- folders


_WORKER: Aligner | None = None  # one MTCNN per worker process


def _init_worker(settings: AlignSettings, device: str, keep_memory: bool) -> None:
    global _WORKER
    torch.set_num_threads(1)  # N workers on N cores: one thread each
    if keep_memory:  # as the command that spawned this worker set its own malloc up
        keep_freed_memory()
    _WORKER = Aligner(settings, device)


def _align_in_worker(jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
    return _WORKER.align(jobs)


def _plan(src, dst, settings: AlignSettings) -> tuple[list[tuple[str, str]], list[Path]]:
    """``(source, target)`` of every image under ``src`` not yet aligned (images reached
    through a link into ``dst`` left out), and the crops already there."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise DataError(f"source folder not found: {src}")
    dst_real = dst.resolve()
    if src.resolve() in (dst_real, *dst_real.parents):
        raise DataError(f"{dst} lies inside {src}: the crops would be aligned again")
    paths, _ = list_images(src)
    paths = [p for p in paths if dst_real not in Path(os.path.realpath(p)).parents]
    targets = [dst / Path(path).relative_to(src) for path in paths]
    pairs = [(p, t.with_suffix(settings.extension or t.suffix)) for p, t in zip(paths, targets)]
    # Crop names compared case-insensitively, as a copy to such a file system would
    first: dict[str, str] = {}
    for source, target in pairs:
        if (other := first.setdefault(str(target).casefold(), source)) != source:
            raise DataError(
                f"{other} and {source} would both be written to {target}: rename one of "
                "them (or keep the input's file type: the preset writes one type for all)"
            )
    done = {target for _, target in pairs if target.is_file()}
    return [(path, str(target)) for path, target in pairs if target not in done], sorted(done)


def _check_settings(dst, settings: AlignSettings, done: list[Path]) -> None:
    """Refuse to continue ``dst`` with other settings than those recorded in it; record them
    when it has none. A folder of crops made before the record (box crops searched at full
    size, ``_RECORD_DEFAULTS``) continues with the settings given if every crop has their size."""
    path = Path(dst) / SETTINGS_FILE
    wanted, recorded = asdict(settings), path.exists()
    old = read_json(path) if recorded else {**wanted, **_RECORD_DEFAULTS} if done else wanted
    if not isinstance(old, dict):
        raise DataError(f"{path}: expected the alignment settings as a JSON object")
    for name, want in wanted.items():
        if (have := old.get(name, _RECORD_DEFAULTS.get(name))) != want:
            hint = " (--detect-size; 0 searches the full image)" * (name == "detect_size")
            raise DataError(
                f"{dst} was aligned with {name} = {have!r}; "
                f"this run asks for {want!r}{hint} ({path}): align into another folder, or give "
                "the same settings"
            )
    if recorded:
        return
    odd = next((t for t in done if _image_size(t) != settings.crop_size), None)
    if odd is not None:
        raise DataError(
            f"{dst} has no {SETTINGS_FILE} and its crop {odd} is not {settings.crop_size} "
            "(height, width) as these settings make: align into a new folder"
        )
    if done:
        warnings.warn(
            f"{dst} had no {SETTINGS_FILE}: its {len(done)} crops have the size of "
            "the settings given, which it is continued with and now records",
            stacklevel=2,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(wanted, indent=2) + "\n")


def _image_size(path) -> tuple[int, int] | None:
    """(height, width) from an image's header; None where it cannot be read."""
    try:
        with Image.open(path) as image:
            return image.height, image.width
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


def _batches(jobs, device, settings, batch_size: int, workers: int):
    """Outcome lists, batch by batch, in this process or in ``workers`` processes."""
    chunks = [jobs[i : i + batch_size] for i in range(0, len(jobs), batch_size)]
    if workers <= 1:
        yield from map(Aligner(settings, device).align, chunks)
        return
    # spawn: a CUDA context (and the parent's threads) must not be forked into the workers
    with ProcessPoolExecutor(
        workers,
        get_context("spawn"),
        initializer=_init_worker,
        initargs=(settings, str(device), keeps_freed_memory()),
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
    """Align every image under ``src`` into ``dst`` under the same relative paths, skipping
    crops already written.

    Args:
        batch_size: images per MTCNN call (images of one size are detected together).
        workers: processes, each with its own MTCNN and one thread; 1 aligns in this process.

    Returns:
        One :class:`AlignOutcome` per image processed, sorted by source, and the number of
        crops that were already there.

    Raises:
        DataError: ``dst`` was aligned with other settings, lies inside ``src``, or two images
            would be written to one crop.
    """
    cores = os.cpu_count() or 1
    if batch_size < 1 or not 1 <= workers <= cores:
        raise ConfigError(
            f"batch size {batch_size}, workers {workers}: expected at least 1, and at most "
            f"{cores} workers (the CPU cores here; each holds its own MTCNN, about 0.5 GB)"
        )
    jobs, done = _plan(src, dst, settings)
    _check_settings(dst, settings, done)
    outcomes: list[AlignOutcome] = []
    with tqdm(total=len(jobs), desc="aligning", unit="img", disable=not progress) as bar:
        for chunk in _batches(jobs, device, settings, batch_size, workers):
            outcomes += chunk
            bar.update(len(chunk))
    return sorted(outcomes, key=lambda o: o.source), len(done)


def write_report(outcomes: list[AlignOutcome], path) -> Path:
    """A tab-separated ``status  source  reason`` line per image not aligned from a face,
    written atomically."""
    lines = [f"{o.status}\t{o.source}\t{o.reason}\n" for o in outcomes if o.status != "aligned"]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, REPORT_HEADER.decode() + "".join(lines))
