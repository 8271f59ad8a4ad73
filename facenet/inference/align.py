"""Face alignment: detect the face in every image of a folder with MTCNN and write its crop.

MTCNN is facenet-pytorch's (its wheel carries the P-, R- and O-net weights: nothing is
downloaded). It is imported when an :class:`Aligner` is built, not with this module, so the
rest of the package works without it. The crop around the chosen box follows one of the
publishers' conventions (:mod:`facenet.evaluation.presets`): the margin counted in output pixels
(facenet-pytorch's ``extract_face``) or in input pixels (davidsandberg/facenet), then the box
is clipped to the image and resized to S x S with PIL's bilinear filter, as both do.

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
from facenet.evaluation.presets import ALIGN_PRESETS
from facenet.files import write_atomic, write_text_atomic

__all__ = [
    "SELECTIONS",
    "SETTINGS_FILE",
    "AlignError",
    "AlignOutcome",
    "AlignSettings",
    "Aligner",
    "align_folder",
    "centre_box",
    "check_settings",
    "count",
    "crop_box",
    "load_mtcnn",
    "plan",
    "select_face",
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
    """

    image_size: int = 160
    margin: int = 14
    margin_in: str = "output"
    select: str = "center_weighted_size"
    extension: str | None = None
    fallback: bool = False
    preset: str = "facenet-pytorch"

    @classmethod
    def from_preset(cls, name: str, **overrides) -> AlignSettings:
        """A publisher's settings (``facenet.evaluation.presets.ALIGN_PRESETS``), ``overrides``
        (those not None) replacing any of them."""
        preset = ALIGN_PRESETS[name]
        settings = cls(**{f: getattr(preset, f) for f in preset.__dataclass_fields__}, preset=name)
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})


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


def centre_box(width: int, height: int) -> tuple[float, float, float, float]:
    """The face box a centre crop assumes: the centre square of half the shorter side."""
    half = min(width, height) * _FALLBACK_FRACTION / 2
    return (width / 2 - half, height / 2 - half, width / 2 + half, height / 2 + half)


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

    def detect(self, images: list[Image.Image]) -> list[tuple | None]:
        """``(box, probability)`` of the chosen face of each image, or None where none is found
        (or the image is too small to search: :meth:`too_small`)."""
        by_size = defaultdict(list)  # MTCNN batches only images of one size
        for i, image in enumerate(images):
            if not self.too_small(image):
                by_size[image.size].append(i)
        found: list[tuple | None] = [None] * len(images)
        for (width, height), indices in by_size.items():
            boxes, probs = self.mtcnn.detect([images[i] for i in indices])
            for i, b, p in zip(indices, boxes, probs):
                if b is not None:
                    b, p = np.asarray(b, dtype=np.float64), np.asarray(p, dtype=np.float64)
                    k = select_face(b, p, width, height, self.settings.select)
                    found[i] = (tuple(float(v) for v in b[k]), float(p[k]))
        return found

    def crop(self, image: Image.Image, box) -> Image.Image:
        """The S x S crop of ``box`` plus the margin (bilinear, as both publishers resize)."""
        region = crop_box(box, image.width, image.height, self.settings)
        size = (self.settings.image_size, self.settings.image_size)
        return image.crop(region).resize(size, Image.BILINEAR)

    def align(self, jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
        """Align ``(source, target)`` pairs: write each crop atomically, report the rest."""
        images, readable, outcomes = [], [], []
        for source, target in jobs:
            try:
                images.append(_to_pil(read_image(source)))
                readable.append((source, target))
            except CorruptImageError as err:
                outcomes.append(AlignOutcome(source, target, "unreadable", reason=err.reason))
        for image, (source, target), face in zip(images, readable, self.detect(images)):
            outcomes.append(self._write(image, source, target, face, self.too_small(image)))
        return outcomes

    def _write(self, image: Image.Image, source: str, target: str, face, reason: str):
        if face is None and not self.settings.fallback:
            return AlignOutcome(source, target, "no_face", reason=reason)
        box, prob = face if face is not None else (centre_box(image.width, image.height), None)
        data = _encode(self.crop(image, box), Path(target))
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, lambda fh: fh.write(data))
        status = "aligned" if face is not None else "centre_crop"
        return AlignOutcome(source, target, status, box, prob, reason)


# --------------------------------------------------------------------------- folders

_WORKER: Aligner | None = None  # one MTCNN per worker process


def _init_worker(settings: AlignSettings, device: str) -> None:
    global _WORKER
    torch.set_num_threads(1)  # N workers on N cores: one thread each
    _WORKER = Aligner(settings, device)


def _align_in_worker(jobs: list[tuple[str, str]]) -> list[AlignOutcome]:
    return _WORKER.align(jobs)


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
        if recorded.get(field.name) != wanted[field.name]:
            raise AlignError(
                f"{dst} was aligned with {field.name} = {recorded.get(field.name)!r}; this run "
                f"asks for {wanted[field.name]!r} ({path}): align into another folder, or "
                "give the same settings"
            )


def _batches(jobs, device, settings, batch_size: int, workers: int):
    """Outcome lists, batch by batch, in this process or in ``workers`` processes."""
    chunks = [jobs[i : i + batch_size] for i in range(0, len(jobs), batch_size)]
    if workers <= 1:
        aligner = Aligner(settings, device)
        yield from (aligner.align(chunk) for chunk in chunks)
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
