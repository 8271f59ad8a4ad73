"""Built-in data: procedurally drawn face-like identities.

An identity is a seeded face geometry (head, eyes, brows, nose, mouth, hair, ears, moles, maybe
glasses or a beard); every image of it redraws the nuisance: colours, lighting, noise,
expression, a moderate pose and sometimes an occluding patch. Identities thus differ only in
geometry: an untrained network scores near chance on held-out identities and a short training
learns them (``tests/data/test_synthetic.py`` measures both). Image ``i`` of identity ``j`` is a
pure function of ``(seed, identity_offset + j, i)``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, make_dataclass, replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import encode_png

from facenet.data.folder import INDEX_FILE_NAME
from facenet.data.images import looks_like_image
from facenet.data.pairs import draw_folds, pairs_text
from facenet.data.samplers import check_positive
from facenet.errors import ConfigError, DataError
from facenet.files import TEMPORARY_NAME, read_json, write_text_atomic
from facenet.sizes import image_hw

MANIFEST_NAME = "manifest.json"
_NOT_OURS = "not written by prepare_synthetic_data; choose another data.root for the synthetic data"
GENERATOR_VERSION = 3  # bump whenever the rendering changes: regenerates old folders
PAIRS_FOLDS = 10  # held-out pairs.txt: folds, as in LFW
_PAIRS_FILES = ["val_pairs.txt", "test_pairs.txt"]  # identity-disjoint halves
_PART_KEYS = ("identities", "images_per_identity", "identity_offset")  # a manifest's part
_OWN_FILES = {*_PAIRS_FILES, INDEX_FILE_NAME}  # and identity folders, in train/ or heldout/

# Pose nuisance in canonical units (the image spans [-1, 1]): what an aligned crop leaves over.
# Twice this pose made the demo's tiny CNN need far more than its few CPU minutes to generalise.
ROTATION_STD = 0.05  # radians, clipped at MAX_ROTATION
MAX_ROTATION = 0.125
SCALE_RANGE = (1.2, 1.3)  # face zoom: > 1 crops the face tightly
MAX_SHIFT = 0.03
MAX_YAW = 0.1  # turn of the head
OCCLUDER_PROBABILITY = 0.2  # a random coloured patch over part of the image

# An identity's geometry in canonical coordinates (x right, y down), each value drawn uniformly
# from (low, high) in this order; with a third number p, only with probability p, else 0. Bald
# identities (12 %) have no hair_top and a hairline drawn from (-0.9, -0.78).
_TEMPLATE_RANGES = {
    "head_w": (0.50, 0.62),  # half-width
    "head_h": (0.68, 0.80),
    "head_power": (1.8, 3.0),  # superellipse exponent: 2 an ellipse, larger a squarer face
    "eye_y": (-0.16, -0.02),
    "eye_dx": (0.19, 0.30),  # half the distance between the eye centres
    "eye_rx": (0.075, 0.115),
    "eye_ry": (0.035, 0.06),
    "eye_tilt": (-0.25, 0.25),  # radians, outer corners up when positive
    "iris_r": (0.028, 0.042),
    "brow_gap": (0.08, 0.15),
    "brow_len": (0.10, 0.17),
    "brow_thick": (0.014, 0.032),
    "brow_angle": (-0.35, 0.3),
    "nose_len": (0.12, 0.25),
    "nose_w": (0.035, 0.075),
    "mouth_y": (0.30, 0.46),
    "mouth_w": (0.11, 0.22),
    "mouth_curve": (-0.06, 0.06),
    "mouth_thick": (0.014, 0.032),
    "hair_top": (0.80, 0.98),
    "hair_volume": (0.03, 0.14),
    "hair_length": (0.2, 0.8, 0.4),  # below the centre; 0: short hair
    "hairline_y": (-0.62, -0.38),
    "hairline_slope": (-0.25, 0.25),
    "hairline_curve": (-0.15, 0.35),
    "ear_size": (0.07, 0.12),
    "glasses": (0.012, 0.022, 0.3),  # frame half-width
    "beard": (0.02, 0.14, 0.3),  # how far above the mouth it reaches
}
# One field per range, and moles: ((x, y, radius), ...).
FaceTemplate = make_dataclass("FaceTemplate", [*_TEMPLATE_RANGES, "moles"], frozen=True)


# What changes between images of one identity, as sample_nuisance draws it.
Nuisance = make_dataclass(
    "Nuisance",
    "rotation scale shift yaw eye_open gaze smile brow_raise skin hair iris background "
    "background_slope clutter light gain contrast brightness occluder noise_std".split(),
    frozen=True,
)


def _u(rng: np.random.Generator, low: float, high: float) -> float:
    return float(rng.uniform(low, high))


def _uniforms(rng: np.random.Generator, low: float, high: float, n: int = 3) -> tuple[float, ...]:
    """``n`` draws of :func:`_u` (an RGB colour by default)."""
    return tuple(rng.uniform(low, high, n).tolist())


def _sample_template(rng: np.random.Generator) -> FaceTemplate:
    bald = rng.random() < 0.12
    n_moles = int(rng.integers(0, 4))
    moles = tuple(
        (_u(rng, -0.38, 0.38), _u(rng, -0.25, 0.5), _u(rng, 0.02, 0.038)) for _ in range(n_moles)
    )
    values = {}
    for name, (low, high, *p) in _TEMPLATE_RANGES.items():
        if bald and name == "hair_top":
            values[name] = 0.0
        elif bald and name == "hairline_y":
            values[name] = _u(rng, -0.9, -0.78)
        else:
            values[name] = 0.0 if p and rng.random() >= p[0] else _u(rng, low, high)
    return FaceTemplate(**values, moles=moles)


def sample_nuisance(rng: np.random.Generator) -> Nuisance:
    """Draw one image's nuisance from its own random stream ``rng``; colours RGB in [0, 1]."""
    clutter = tuple(  # (x, y, rx, ry, r, g, b) background blobs
        _uniforms(rng, -1, 1, 2) + _uniforms(rng, 0.1, 0.5, 2) + _uniforms(rng, 0, 1)
        for _ in range(int(rng.integers(1, 5)))
    )
    occluder = None  # or (x0, y0, x1, y1, r, g, b) in image coordinates
    if rng.random() < OCCLUDER_PROBABILITY:
        w, h = _uniforms(rng, 0.25, 0.6, 2)
        x0, y0 = _u(rng, -1, 1 - w), _u(rng, -1, 1 - h)
        occluder = (x0, y0, x0 + w, y0 + h) + _uniforms(rng, 0, 1)
    return Nuisance(
        rotation=float(np.clip(rng.normal(0, ROTATION_STD), -MAX_ROTATION, MAX_ROTATION)),
        scale=_u(rng, *SCALE_RANGE),
        shift=_uniforms(rng, -MAX_SHIFT, MAX_SHIFT, 2),
        yaw=_u(rng, -MAX_YAW, MAX_YAW),  # turn of the head
        eye_open=_u(rng, 0.55, 1.15),
        gaze=(_u(rng, -0.35, 0.35), _u(rng, -0.2, 0.2)),
        smile=float(rng.normal(0, 0.02)),
        brow_raise=float(rng.normal(0, 0.012)),
        # Light to dark, with a random cast.
        skin=tuple(
            np.clip(
                rng.uniform(0.3, 0.95) * np.array([1.0, 0.78, 0.62]) + rng.uniform(-0.08, 0.08, 3),
                0,
                1,
            ).tolist()
        ),
        hair=_uniforms(rng, 0.02, 0.55),
        iris=_uniforms(rng, 0.0, 0.5),
        background=_uniforms(rng, 0, 1),
        background_slope=_uniforms(rng, -0.3, 0.3),
        clutter=clutter,
        light=_uniforms(rng, -0.35, 0.35, 2),  # lighting gradient (x, y)
        gain=_uniforms(rng, 0.8, 1.2),  # colour cast
        contrast=_u(rng, 0.7, 1.3),
        brightness=_u(rng, -0.12, 0.12),
        occluder=occluder,
        noise_std=_u(rng, 0.01, 0.06),
    )


def _rotated(dx: np.ndarray, dy: np.ndarray, angle: float) -> tuple[np.ndarray, np.ndarray]:
    """Offsets ``dx``, ``dy`` in a frame turned by ``angle`` radians."""
    c, s = math.cos(angle), math.sin(angle)
    return dx * c + dy * s, -dx * s + dy * c


@dataclass(eq=False)
class _Painter:
    """Paints shapes given by signed distances (< 0 inside) onto ``canvas`` (S, S, 3), whose
    pixels lie at ``x``, ``y`` (S, S); ``pixel`` is a pixel's side in those units."""

    canvas: np.ndarray
    x: np.ndarray
    y: np.ndarray
    pixel: float

    def paint(self, sd: np.ndarray, colour, opacity: float = 1.0) -> None:
        """Composite ``colour`` over the canvas with the shape's anti-aliased coverage."""
        alpha = np.clip(0.5 - sd / self.pixel, 0.0, 1.0) * opacity  # (S, S)
        colour = np.asarray(colour, dtype=self.canvas.dtype)
        self.canvas += alpha[..., None] * (colour - self.canvas)

    def ellipse(self, cx, cy, rx, ry, angle=0.0, power=2.0) -> np.ndarray:
        """Approximate signed distance to a (super)ellipse."""
        qx, qy = _rotated(self.x - cx, self.y - cy, angle)
        k = (np.abs(qx / rx) ** power + np.abs(qy / ry) ** power) ** (1.0 / power)
        return (k - 1.0) * min(rx, ry)

    def stroke(self, points: list, radius: float) -> np.ndarray:
        """Signed distance to a polyline of round-capped segments of half-width ``radius``."""
        x, y, best = self.x, self.y, np.full_like(self.x, np.inf)
        for (x0, y0), (x1, y1) in pairwise(points):
            dx, dy = x1 - x0, y1 - y0
            t = np.clip(((x - x0) * dx + (y - y0) * dy) / max(dx * dx + dy * dy, 1e-12), 0, 1)
            best = np.minimum(best, np.hypot(x - x0 - t * dx, y - y0 - t * dy))
        return best - radius


# The face's parts, back to front: methods of _FaceDrawer.
_PARTS = "hair_back ears head hair_front beard eyes brows nose mouth moles glasses".split()


@dataclass(eq=False)
class _FaceDrawer(_Painter):
    """Draws one face, back to front, at canonical face coordinates ``x``, ``y``."""

    t: FaceTemplate
    n: Nuisance

    def __post_init__(self) -> None:
        self.feature_dx = 0.18 * self.n.yaw
        self.narrow = 1.0 - 0.25 * abs(self.n.yaw)
        self.skin = np.asarray(self.n.skin)
        self.shadow = self.skin * 0.72

    def fx(self, value: float) -> float:
        """The x of a face feature after the head's turn."""
        return value * self.narrow + self.feature_dx

    def draw(self) -> None:
        for part in _PARTS:
            getattr(self, part)()

    def hair_back(self):
        t = self.t
        if t.hair_top <= 0:
            return
        half_width = t.head_w * self.narrow + t.hair_volume
        top_cy = (t.hair_top - t.head_h) * -0.5 - 0.05
        sd = self.ellipse(0, top_cy, half_width, (t.hair_top + t.head_h) * 0.5 * 0.9)
        if t.hair_length > 0:  # long hair: a band behind the head down to hair_length
            below = np.maximum(-self.y, self.y - t.hair_length)
            sd = np.minimum(sd, np.maximum(np.abs(self.x) - half_width, below))
        self.paint(sd, self.n.hair)

    def ears(self):
        t = self.t
        for side in (-1, 1):
            cx = self.fx(side * t.head_w * 0.98)
            self.paint(self.ellipse(cx, t.eye_y + 0.08, t.ear_size * 0.6, t.ear_size), self.shadow)

    def head(self):
        t = self.t
        self.head_sd = self.ellipse(
            self.feature_dx * 0.5, 0.0, t.head_w * self.narrow, t.head_h, power=t.head_power
        )
        self.paint(self.head_sd, self.n.skin)

    def hair_front(self):
        t = self.t
        u = self.x - self.feature_dx
        line = t.hairline_y + t.hairline_slope * u + t.hairline_curve * u * u
        self.paint(np.maximum(self.y - line, self.head_sd), self.n.hair)  # above it, in the head

    def eyes(self):
        t, n = self.t, self.n
        ry = t.eye_ry * n.eye_open
        for side in (-1, 1):
            cx = self.fx(side * t.eye_dx)
            eye = self.ellipse(cx, t.eye_y, t.eye_rx * self.narrow, ry, angle=-side * t.eye_tilt)
            self.paint(eye, (0.93, 0.92, 0.9))
            iris = self.ellipse(
                cx + n.gaze[0] * t.eye_rx, t.eye_y + n.gaze[1] * ry, t.iris_r, t.iris_r
            )
            self.paint(np.maximum(iris, eye), n.iris)

    def brows(self):
        t, n = self.t, self.n
        y = t.eye_y - t.brow_gap - n.brow_raise
        for side in (-1, 1):
            inner = self.fx(side * (t.eye_dx - t.brow_len * 0.5))
            outer = self.fx(side * (t.eye_dx + t.brow_len * 0.5))
            rise = math.tan(t.brow_angle) * t.brow_len
            points = [(inner, y + rise * 0.5), (outer, y - rise * 0.5)]
            self.paint(self.stroke(points, t.brow_thick), n.hair)

    def nose(self):
        t = self.t
        cx, top, tip = self.fx(0.0), t.eye_y + 0.03, t.eye_y + t.nose_len
        self.paint(self.stroke([(cx, top), (cx + t.nose_w * 0.3, tip)], 0.012), self.shadow, 0.6)
        for side in (-1, 1):
            nostril = self.ellipse(cx + side * t.nose_w, tip, 0.022, 0.014)
            self.paint(nostril, self.skin * 0.45)

    def mouth(self):
        t, n = self.t, self.n
        cx, w = self.fx(0.0), t.mouth_w * self.narrow
        curve = t.mouth_curve + n.smile
        points = [(cx + w * s, t.mouth_y - curve * s * s) for s in np.linspace(-1, 1, 7)]
        lips = self.skin * np.array([0.75, 0.45, 0.45])
        self.paint(self.stroke(points, t.mouth_thick), lips)

    def beard(self):
        t = self.t
        if t.beard > 0:  # below the beard line, inside the head
            self.paint(np.maximum(t.mouth_y - t.beard - self.y, self.head_sd), self.n.hair, 0.85)

    def glasses(self):
        t = self.t
        if t.glasses <= 0:
            return
        frame = np.asarray(self.n.hair) * 0.5
        radius = t.eye_rx * 1.35
        for side in (-1, 1):
            cx = self.fx(side * t.eye_dx)
            ring = self.ellipse(cx, t.eye_y, radius * self.narrow, radius * 0.8)
            self.paint(np.abs(ring) - t.glasses, frame)
        bridge = [(self.fx(-t.eye_dx + radius), t.eye_y), (self.fx(t.eye_dx - radius), t.eye_y)]
        self.paint(self.stroke(bridge, t.glasses), frame)

    def moles(self):
        for mx, my, r in self.t.moles:
            mole = np.maximum(self.ellipse(self.fx(mx), my, r, r), self.head_sd)
            self.paint(mole, self.skin * 0.35)


def render_face(
    template: FaceTemplate, nuisance: Nuisance, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Render one image: uint8 (S, S, 3) of side ``size``; ``rng`` draws the pixel noise."""
    n = nuisance
    centres = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1  # pixel centres
    y, x = np.meshgrid(centres, centres, indexing="ij")  # (S, S) each: x right, y down
    pixel = 2.0 / size
    canvas = (
        np.asarray(n.background, np.float32)
        + np.asarray(n.background_slope, np.float32) * ((x + y) * 0.5)[..., None]
    )
    background = _Painter(canvas, x, y, pixel)
    for cx, cy, rx, ry, *colour in n.clutter:
        background.paint(background.ellipse(cx, cy, rx, ry), colour)
    # Image -> canonical face coordinates: undo the shift, rotation and scale.
    fx, fy = _rotated(x - n.shift[0], y - n.shift[1], n.rotation)
    _FaceDrawer(canvas, fx / n.scale, fy / n.scale, pixel / n.scale, template, n).draw()
    canvas *= (1.0 + n.light[0] * x + n.light[1] * y)[..., None]  # lighting gradient
    if n.occluder is not None:
        x0, y0, x1, y1, *colour = n.occluder
        canvas[(x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)] = colour
    canvas = (canvas - 0.5) * n.contrast + 0.5 + n.brightness
    canvas = canvas * np.asarray(n.gain, np.float32)
    canvas = canvas + rng.normal(0.0, n.noise_std, canvas.shape).astype(np.float32)
    return (np.clip(canvas, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


class SyntheticIdentities(Dataset):
    """Procedurally drawn face-like identities: item ``index`` is ``(uint8 (3, S, S), label)``,
    image ``index % images_per_identity`` of identity ``index // images_per_identity``.

    ``classes`` names the identities ``id00000`` style by their global number, which starts at
    ``identity_offset``: give held-out data an offset past the training identities.
    """

    def __init__(
        self,
        num_identities: int,
        images_per_identity: int,
        image_size: int = 64,
        seed: int = 0,
        identity_offset: int = 0,
    ):
        check_positive(
            num_identities=num_identities,
            images_per_identity=images_per_identity,
            image_size=image_size,
        )
        if identity_offset < 0 or seed < 0:
            raise ValueError(f"seed={seed}, identity_offset={identity_offset}: expected >= 0")
        self.num_identities, self.images_per_identity = num_identities, images_per_identity
        self.image_size, self.seed, self.identity_offset = image_size, seed, identity_offset
        self.targets = [j for j in range(num_identities) for _ in range(images_per_identity)]
        self.classes = [f"id{identity_offset + j:05d}" for j in range(num_identities)]

    def _rng(self, label: int, *stream: int) -> np.random.Generator:
        """An independent stream for ``(seed, global identity, *stream)``."""
        if not 0 <= label < self.num_identities:
            raise IndexError(f"identity {label} out of range [0, {self.num_identities})")
        key = (self.identity_offset + label, *stream)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=key))

    def template(self, label: int) -> FaceTemplate:
        return _sample_template(self._rng(label, 0))

    def image(self, label: int, image_index: int, aligned: bool = False) -> torch.Tensor:
        """Image ``image_index`` (any index >= 0) of identity ``label``: uint8 (3, S, S).

        ``aligned`` draws it without the pose nuisance, as a perfect aligner would (diagnostics).
        """
        if image_index < 0:
            raise ValueError(f"image_index={image_index}: expected >= 0")
        rng = self._rng(label, 1, image_index)
        nuisance = sample_nuisance(rng)
        if aligned:
            nuisance = replace(nuisance, rotation=0.0, scale=1.0, shift=(0.0, 0.0), yaw=0.0)
        pixels = render_face(self.template(label), nuisance, self.image_size, rng)  # (S, S, 3)
        return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()

    def __len__(self) -> int:
        return self.num_identities * self.images_per_identity

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        # An index out of range gives a label out of range: _rng raises the IndexError.
        label, image_index = divmod(index, self.images_per_identity)
        return self.image(label, image_index), label

    def file_names(self) -> dict[str, list[str]]:
        """``{identity: [file name, ...]}`` as :meth:`write_to_disk` names the images:
        ``<identity>_<0001>.png``, numbered from 1 as in LFW."""
        count = self.images_per_identity
        return {name: [f"{name}_{i + 1:04d}.png" for i in range(count)] for name in self.classes}

    def write_to_disk(self, root: str | Path, progress: bool = False) -> dict[str, list[str]]:
        """Write every image as ``root/<identity>/<file name>``; returns :meth:`file_names`.
        ``progress``: a line on stderr after each tenth of the identities (generating the
        demo's 800 takes about a minute on a slow CPU).

        Raises:
            OSError: a file could not be written whole or reads back different.
        """
        written = self.file_names()
        total = len(written)
        report_after = {total * tenth // 10 for tenth in range(1, 11)} if progress else set()
        for label, (name, file_names) in enumerate(written.items()):
            folder = Path(root) / name
            folder.mkdir(parents=True, exist_ok=True)
            for i, file_name in enumerate(file_names):
                png = encode_png(self.image(label, i)).numpy().tobytes()
                _write_verified(folder / file_name, png)
            if label + 1 in report_after:
                print(
                    f"{root}: {label + 1}/{total} identities written", file=sys.stderr, flush=True
                )
        return written


def _write_verified(path: Path, data: bytes) -> None:
    """Write ``data`` and read it back: a short or failed write raises OSError naming the file
    (torchvision's ``write_png`` ignores write errors: a full disk left 0-byte files)."""
    try:
        path.write_bytes(data)
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(path)) from None
    if path.read_bytes() != data:
        raise OSError(f"{path}: the file reads back different from what was written")


def drawn_side(image_size) -> int:
    """The side faces are drawn at for an input of ``image_size`` (S or (H, W)): max(H, W);
    the transforms resize and crop them to H x W as any photo of another shape."""
    return max(image_hw(image_size))


def _parts(cfg) -> dict[str, SyntheticIdentities]:
    """The training and held-out identities of a DataConfig, held-out numbered after training."""
    side, seed, n_train = drawn_side(cfg.image_size), cfg.synthetic_seed, cfg.synthetic_identities
    return {
        "train": SyntheticIdentities(n_train, cfg.synthetic_images_per_identity, side, seed),
        "heldout": SyntheticIdentities(
            cfg.synthetic_heldout_identities,
            cfg.synthetic_heldout_images_per_identity,
            side,
            seed,
            identity_offset=n_train,
        ),
    }


def _manifest(parts: dict[str, SyntheticIdentities], pairs_per_fold: int) -> dict:
    """What the folders written by :func:`prepare_synthetic_data` are made from."""
    return {
        "generator_version": GENERATOR_VERSION,
        "seed": parts["train"].seed,
        "image_size": parts["train"].image_size,
        **{
            name: dict(
                zip(_PART_KEYS, (d.num_identities, d.images_per_identity, d.identity_offset))
            )
            for name, d in parts.items()
        },
        "pairs": {"n_folds": PAIRS_FOLDS, "pairs_per_fold": pairs_per_fold, "files": _PAIRS_FILES},
    }


def _folder_complete(folder: Path, part: SyntheticIdentities) -> bool:
    """``part.num_identities`` identity folders of ``part.images_per_identity`` PNGs each."""
    identities = [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []
    return len(identities) == part.num_identities and all(
        len(images) == part.images_per_identity and all(map(looks_like_image, images))
        for images in (list(identity.glob("*.png")) for identity in identities)
    )  # looks_like_image: e.g. no 0-byte files


def _read_manifest(path: Path) -> dict:
    """The manifest at ``path`` ({}: there is none); a DataError if this module did not write
    it (its train and heldout parts do not hold the counts)."""
    if not os.path.lexists(path):
        return {}
    try:
        found = read_json(path)
    except DataError:
        found = None
    specs = [found.get(part) if isinstance(found, dict) else None for part in ("train", "heldout")]
    if not all(
        isinstance(s, dict) and all(type(s.get(k)) is int for k in _PART_KEYS) for s in specs
    ):
        raise DataError(f"{path}: {_NOT_OURS}")
    return found


def _numbered(name: str, template: str, first: int, count: int) -> bool:
    """Whether ``name`` is ``template.format(n)`` for some n in [first, first + count)."""
    match = re.search(r"\d{1,12}(?=\D*$)", name)  # the last number in the name
    return (
        bool(match)
        and 0 <= int(match[0]) - first < count
        and template.format(int(match[0])) == name
    )


def _listed(path: Path, parts: tuple, spec: dict | None) -> bool:
    """Whether ``path`` (``parts`` below train/ or heldout/) is what a manifest's ``spec``
    of that folder lists: its identity folders and their PNGs, the pairs files or a training
    index; never a link."""
    if path.is_symlink():
        return False
    if len(parts) == 1 and TEMPORARY_NAME.sub(r"\g<target>", parts[0]) in _OWN_FILES:
        return path.is_file()
    if not spec or not _numbered(parts[0], "id{:05d}", spec["identity_offset"], spec["identities"]):
        return False
    template, count = parts[0] + "_{:04d}.png", spec["images_per_identity"]
    return (
        path.is_dir()
        if len(parts) == 1
        else len(parts) == 2 and path.is_file() and _numbered(parts[1], template, 1, count)
    )


def _clear_previous(root: Path, found: dict) -> None:
    """Remove ``root/train`` and ``root/heldout`` when they hold only what the manifest
    ``found`` lists, else refuse with a DataError naming the first thing it does not list."""
    folders = [root / "train", root / "heldout"]
    for folder in folders:
        if folder.is_symlink() or folder.exists() and not folder.is_dir():
            raise DataError(f"{folder}: {_NOT_OURS}")
        for path in folder.rglob("*"):  # links are not followed
            if not _listed(path, path.relative_to(folder).parts, found.get(folder.name)):
                raise DataError(f"{path}: {_NOT_OURS}")
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _heldout_pairs(heldout: SyntheticIdentities, pairs_per_fold: int) -> list[str]:
    """The texts of ``val_pairs.txt`` and ``test_pairs.txt``: pairs of the two
    identity-disjoint halves of the held-out identities."""
    files = heldout.file_names()
    names = sorted(files)
    halves = (names[: len(names) // 2], names[len(names) // 2 :])
    try:
        return [
            pairs_text(
                draw_folds({n: files[n] for n in half}, PAIRS_FOLDS, pairs_per_fold, heldout.seed)
            )
            for half in halves
        ]
    except DataError as problem:
        raise ConfigError(
            "data.synthetic_heldout_identities, data.synthetic_heldout_images_per_identity "
            f"and data.synthetic_pairs_per_fold: too small for the held-out pairs (half of "
            f"the held-out identities each for validation and test): {problem}"
        ) from None


def prepare_synthetic_data(root: str | Path, cfg) -> dict:
    """Write the built-in data set once: training identities, held-out identities and pairs.

    ``root/train/`` and ``root/heldout/`` (identities numbered after the training ones) get
    the ``synthetic_*`` sizes of ``cfg`` (a DataConfig); the held-out identities' two
    identity-disjoint halves get ``heldout/val_pairs.txt`` (model selection) and
    ``heldout/test_pairs.txt`` (reported once), each 10 folds. ``root/manifest.json`` records
    the settings: a later call with the same settings finds the folders complete and writes
    nothing, else each part says on stderr how far its writing is. Call it from one process
    only (rank 0).

    Returns:
        ``{"train_root", "heldout_root", "val_pairs", "test_pairs"}`` as path strings.

    Raises:
        ConfigError: sizes too small for the held-out pairs (load_config checks each one).
        DataError: ``root`` holds a ``manifest.json``, ``train`` or ``heldout`` this function
            did not write; nothing is then removed.
    """
    root, parts = Path(root), _parts(cfg)
    wanted = _manifest(parts, cfg.synthetic_pairs_per_fold)
    pairs = {file[:-4]: root / "heldout" / file for file in _PAIRS_FILES}
    paths = {f"{name}_root": str(root / name) for name in parts} | {
        k: str(p) for k, p in pairs.items()
    }
    manifest_path = root / MANIFEST_NAME
    found = _read_manifest(manifest_path)
    if (
        found == {**wanted, "complete": True}
        and all(path.is_file() for path in pairs.values())
        and all(_folder_complete(root / name, part) for name, part in parts.items())
    ):
        return paths
    # Every check that can refuse the call comes before anything is removed.
    texts = _heldout_pairs(parts["heldout"], cfg.synthetic_pairs_per_fold)
    _clear_previous(root, found)
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(manifest_path, json.dumps({**wanted, "complete": False}, indent=2))
    for name, part in parts.items():
        part.write_to_disk(root / name, progress=True)
    for path, text in zip(pairs.values(), texts):
        write_text_atomic(path, text)
    write_text_atomic(manifest_path, json.dumps({**wanted, "complete": True}, indent=2))
    return paths
