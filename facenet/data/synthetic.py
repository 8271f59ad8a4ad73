"""Built-in data: procedurally generated face-like identities.

Each identity is a seeded random face template: the shape of the head, the place, size and tilt
of the eyes and brows, the length of the nose, the width and curve of the mouth, the hairline
and hairstyle, a few moles, and for some identities glasses or a beard. Every image of an
identity redraws the nuisance: every colour (skin, hair, eyes, background clutter), lighting,
noise, expression (eye openness, gaze, smile), a moderate pose (rotation, shift, scale and a
turn of the head, as an aligned crop leaves) and sometimes an occluding patch. Identities
therefore differ only in consistent geometry, not in colour: an untrained network sees mostly
nuisance and scores near chance on held-out identities (AUC about 0.5), while a short training
learns the geometry (``tests/data/test_synthetic.py`` measures both).

Image ``i`` of identity ``j`` is a pure function of ``(seed, identity_offset + j, i)``: the same
whatever the order of access, and identities with different global numbers (another
``identity_offset``) are different identities.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import encode_png

from facenet.data.images import looks_like_image
from facenet.data.pairs import generate_pairs, write_pairs
from facenet.errors import ConfigError, DataError
from facenet.files import write_text_atomic
from facenet.sizes import image_hw

__all__ = [
    "FaceTemplate",
    "Nuisance",
    "SyntheticIdentities",
    "prepare_synthetic_data",
    "render_face",
    "sample_nuisance",
    "sample_template",
]

MANIFEST_NAME = "manifest.json"
GENERATOR_VERSION = 3  # bump whenever the rendering changes: regenerates old folders
PAIRS_FOLDS = 10  # held-out pairs.txt: folds, as in LFW

# Pose nuisance, in canonical units (the image spans [-1, 1]): what a face detector's aligned
# crop leaves over. Twice this pose and a patch on half the images (version 2) made the demo's
# tiny CNN need far more than its few minutes of CPU to generalise to unseen identities; colour,
# lighting, clutter and noise are what keep an untrained network near chance, and are unchanged.
ROTATION_STD = 0.05  # radians, clipped at MAX_ROTATION
MAX_ROTATION = 0.125
SCALE_RANGE = (1.2, 1.3)  # face zoom: > 1 crops the face tightly
MAX_SHIFT = 0.03
MAX_YAW = 0.1  # turn of the head
OCCLUDER_PROBABILITY = 0.2  # a random coloured patch over part of the image


@dataclass(frozen=True)
class FaceTemplate:
    """The identity: face geometry in canonical coordinates (x right, y down, image = [-1, 1]²)."""

    head_w: float  # half-width of the head
    head_h: float  # half-height of the head
    head_power: float  # superellipse exponent: 2 an ellipse, larger a squarer face
    eye_y: float
    eye_dx: float  # half the distance between the eye centres
    eye_rx: float
    eye_ry: float
    eye_tilt: float  # radians, outer corners up when positive
    iris_r: float
    brow_gap: float  # brow height above the eye centre
    brow_len: float
    brow_thick: float
    brow_angle: float  # radians, outer end up when positive
    nose_len: float  # from the eye line down
    nose_w: float
    mouth_y: float
    mouth_w: float  # half-width
    mouth_curve: float  # smile (> 0) or frown (< 0) at the corners
    mouth_thick: float
    hair_top: float  # top of the hair above the centre
    hair_volume: float  # how far the hair stands out at the sides
    hair_length: float  # how far below the centre long hair falls; 0 for short hair
    hairline_y: float
    hairline_slope: float  # a side parting
    hairline_curve: float
    ear_size: float
    glasses: float  # frame half-width; 0 for none
    beard: float  # how far above the mouth a beard reaches; 0 for none
    moles: tuple[tuple[float, float, float], ...]  # (x, y, radius)


@dataclass(frozen=True)
class Nuisance:
    """Everything that changes between images of one identity."""

    rotation: float  # radians
    scale: float
    shift: tuple[float, float]
    yaw: float  # turn of the head: features shift sideways and the face narrows
    eye_open: float
    gaze: tuple[float, float]
    smile: float
    brow_raise: float
    skin: tuple[float, float, float]  # colours, RGB in [0, 1]
    hair: tuple[float, float, float]
    iris: tuple[float, float, float]
    background: tuple[float, float, float]
    background_slope: tuple[float, float, float]
    clutter: tuple[tuple[float, ...], ...]  # (x, y, rx, ry, r, g, b) background blobs
    light: tuple[float, float]  # lighting gradient (x, y)
    gain: tuple[float, float, float]  # colour cast
    contrast: float
    brightness: float
    occluder: tuple[float, ...] | None  # (x0, y0, x1, y1, r, g, b) in image coordinates
    noise_std: float


def _u(rng: np.random.Generator, low: float, high: float) -> float:
    return float(rng.uniform(low, high))


def _colour(rng: np.random.Generator, low: float, high: float) -> tuple[float, float, float]:
    return tuple(float(c) for c in rng.uniform(low, high, 3))


def _skin_tone(rng: np.random.Generator) -> tuple[float, float, float]:
    """A skin-like colour, light to dark, with a random cast."""
    tone = rng.uniform(0.3, 0.95) * np.array([1.0, 0.78, 0.62]) + rng.uniform(-0.08, 0.08, 3)
    return tuple(float(c) for c in np.clip(tone, 0, 1))


def sample_template(rng: np.random.Generator) -> FaceTemplate:
    """Draw an identity's face template.

    Args:
        rng: the identity's own random stream.
    """
    bald = rng.random() < 0.12
    n_moles = int(rng.integers(0, 4))
    moles = tuple(
        (_u(rng, -0.38, 0.38), _u(rng, -0.25, 0.5), _u(rng, 0.02, 0.038)) for _ in range(n_moles)
    )
    return FaceTemplate(
        head_w=_u(rng, 0.50, 0.62),
        head_h=_u(rng, 0.68, 0.80),
        head_power=_u(rng, 1.8, 3.0),
        eye_y=_u(rng, -0.16, -0.02),
        eye_dx=_u(rng, 0.19, 0.30),
        eye_rx=_u(rng, 0.075, 0.115),
        eye_ry=_u(rng, 0.035, 0.06),
        eye_tilt=_u(rng, -0.25, 0.25),
        iris_r=_u(rng, 0.028, 0.042),
        brow_gap=_u(rng, 0.08, 0.15),
        brow_len=_u(rng, 0.10, 0.17),
        brow_thick=_u(rng, 0.014, 0.032),
        brow_angle=_u(rng, -0.35, 0.3),
        nose_len=_u(rng, 0.12, 0.25),
        nose_w=_u(rng, 0.035, 0.075),
        mouth_y=_u(rng, 0.30, 0.46),
        mouth_w=_u(rng, 0.11, 0.22),
        mouth_curve=_u(rng, -0.06, 0.06),
        mouth_thick=_u(rng, 0.014, 0.032),
        hair_top=_u(rng, 0.80, 0.98) if not bald else 0.0,
        hair_volume=_u(rng, 0.03, 0.14),
        hair_length=_u(rng, 0.2, 0.8) if rng.random() < 0.4 else 0.0,
        hairline_y=_u(rng, -0.62, -0.38) if not bald else _u(rng, -0.9, -0.78),
        hairline_slope=_u(rng, -0.25, 0.25),
        hairline_curve=_u(rng, -0.15, 0.35),
        ear_size=_u(rng, 0.07, 0.12),
        glasses=_u(rng, 0.012, 0.022) if rng.random() < 0.3 else 0.0,
        beard=_u(rng, 0.02, 0.14) if rng.random() < 0.3 else 0.0,
        moles=moles,
    )


def sample_nuisance(rng: np.random.Generator) -> Nuisance:
    """Draw one image's nuisance: pose, expression, colours, lighting, occlusion, noise.

    Args:
        rng: the image's own random stream.
    """
    clutter = tuple(
        (_u(rng, -1, 1), _u(rng, -1, 1), _u(rng, 0.1, 0.5), _u(rng, 0.1, 0.5)) + _colour(rng, 0, 1)
        for _ in range(int(rng.integers(1, 5)))
    )
    occluder = None
    if rng.random() < OCCLUDER_PROBABILITY:
        w, h = _u(rng, 0.25, 0.6), _u(rng, 0.25, 0.6)
        x0, y0 = _u(rng, -1, 1 - w), _u(rng, -1, 1 - h)
        occluder = (x0, y0, x0 + w, y0 + h) + _colour(rng, 0, 1)
    return Nuisance(
        rotation=float(np.clip(rng.normal(0, ROTATION_STD), -MAX_ROTATION, MAX_ROTATION)),
        scale=_u(rng, *SCALE_RANGE),
        shift=(_u(rng, -MAX_SHIFT, MAX_SHIFT), _u(rng, -MAX_SHIFT, MAX_SHIFT)),
        yaw=_u(rng, -MAX_YAW, MAX_YAW),
        eye_open=_u(rng, 0.55, 1.15),
        gaze=(_u(rng, -0.35, 0.35), _u(rng, -0.2, 0.2)),
        smile=float(rng.normal(0, 0.02)),
        brow_raise=float(rng.normal(0, 0.012)),
        skin=_skin_tone(rng),
        hair=_colour(rng, 0.02, 0.55),
        iris=_colour(rng, 0.0, 0.5),
        background=_colour(rng, 0, 1),
        background_slope=_colour(rng, -0.3, 0.3),
        clutter=clutter,
        light=(_u(rng, -0.35, 0.35), _u(rng, -0.35, 0.35)),
        gain=_colour(rng, 0.8, 1.2),
        contrast=_u(rng, 0.7, 1.3),
        brightness=_u(rng, -0.12, 0.12),
        occluder=occluder,
        noise_std=_u(rng, 0.01, 0.06),
    )


# ----------------------------------------------------------------------------- drawing


def _ellipse_sd(x, y, cx, cy, rx, ry, angle=0.0, power=2.0):
    """Approximate signed distance to a (super)ellipse: < 0 inside. x, y: (S, S)."""
    c, s = math.cos(angle), math.sin(angle)
    qx = (x - cx) * c + (y - cy) * s
    qy = -(x - cx) * s + (y - cy) * c
    k = (np.abs(qx / rx) ** power + np.abs(qy / ry) ** power) ** (1.0 / power)
    return (k - 1.0) * min(rx, ry)


def _stroke_sd(x, y, points, radius):
    """Signed distance to a polyline of round-capped segments of half-width ``radius``."""
    best = np.full_like(x, np.inf)
    for (x0, y0), (x1, y1) in zip(points[:-1], points[1:]):
        dx, dy = x1 - x0, y1 - y0
        t = np.clip(((x - x0) * dx + (y - y0) * dy) / max(dx * dx + dy * dy, 1e-12), 0, 1)
        best = np.minimum(best, np.hypot(x - x0 - t * dx, y - y0 - t * dy))
    return best - radius


def _coverage(sd, pixel):
    """Anti-aliased coverage (S, S) in [0, 1] from a signed distance and the pixel size."""
    return np.clip(0.5 - sd / pixel, 0.0, 1.0)


def _paint(canvas, alpha, colour):
    """Composite ``colour`` over ``canvas`` (S, S, 3) with coverage ``alpha`` (S, S)."""
    canvas += alpha[..., None] * (np.asarray(colour, dtype=canvas.dtype) - canvas)


class _FaceDrawer:
    """Draws one face onto a canvas, in canonical coordinates x, y (S, S)."""

    def __init__(self, t: FaceTemplate, n: Nuisance, x, y, pixel: float):
        self.t, self.n, self.x, self.y, self.pixel = t, n, x, y, pixel
        # A turn of the head: inner features slide sideways and the face narrows.
        self.feature_dx = 0.18 * n.yaw
        self.narrow = 1.0 - 0.25 * abs(n.yaw)
        skin = np.asarray(n.skin)
        self.skin = skin
        self.shadow = tuple(skin * 0.72)
        self.lips = tuple(skin * np.array([0.75, 0.45, 0.45]))

    def fx(self, value: float) -> float:
        """The x of a face feature after the head's turn."""
        return value * self.narrow + self.feature_dx

    def mask(self, sd):
        return _coverage(sd, self.pixel)

    def draw(self, canvas) -> None:
        self.hair_back(canvas)
        self.ears(canvas)
        self.head(canvas)
        self.hair_front(canvas)
        self.beard(canvas)
        self.eyes(canvas)
        self.brows(canvas)
        self.nose(canvas)
        self.mouth(canvas)
        self.moles(canvas)
        self.glasses(canvas)

    def hair_back(self, canvas):
        t = self.t
        if t.hair_top <= 0:  # bald
            return
        half_width = t.head_w * self.narrow + t.hair_volume
        top_cy = (t.hair_top - t.head_h) * -0.5 - 0.05
        sd = _ellipse_sd(self.x, self.y, 0, top_cy, half_width, (t.hair_top + t.head_h) * 0.5 * 0.9)
        if t.hair_length > 0:  # long hair: a band behind the head down to hair_length
            band = np.maximum(
                np.abs(self.x) - half_width, np.maximum(-self.y, self.y - t.hair_length)
            )
            sd = np.minimum(sd, band)
        _paint(canvas, self.mask(sd), self.n.hair)

    def ears(self, canvas):
        t = self.t
        for side in (-1, 1):
            cx = self.fx(side * t.head_w * 0.98)
            sd = _ellipse_sd(self.x, self.y, cx, t.eye_y + 0.08, t.ear_size * 0.6, t.ear_size)
            _paint(canvas, self.mask(sd), self.shadow)

    def head(self, canvas):
        t = self.t
        self.head_sd = _ellipse_sd(
            self.x,
            self.y,
            self.feature_dx * 0.5,
            0.0,
            t.head_w * self.narrow,
            t.head_h,
            power=t.head_power,
        )
        _paint(canvas, self.mask(self.head_sd), self.n.skin)

    def hair_front(self, canvas):
        t = self.t
        u = self.x - self.feature_dx
        line = t.hairline_y + t.hairline_slope * u + t.hairline_curve * u * u
        sd = np.maximum(self.y - line, self.head_sd)  # above the hairline, inside the head
        _paint(canvas, self.mask(sd), self.n.hair)

    def eyes(self, canvas):
        t, n = self.t, self.n
        ry = t.eye_ry * n.eye_open
        for side in (-1, 1):
            cx = self.fx(side * t.eye_dx)
            sd_eye = _ellipse_sd(
                self.x, self.y, cx, t.eye_y, t.eye_rx * self.narrow, ry, angle=-side * t.eye_tilt
            )
            _paint(canvas, self.mask(sd_eye), (0.93, 0.92, 0.9))
            ix = cx + n.gaze[0] * t.eye_rx
            iy = t.eye_y + n.gaze[1] * ry
            sd_iris = np.maximum(_ellipse_sd(self.x, self.y, ix, iy, t.iris_r, t.iris_r), sd_eye)
            _paint(canvas, self.mask(sd_iris), n.iris)

    def brows(self, canvas):
        t, n = self.t, self.n
        y = t.eye_y - t.brow_gap - n.brow_raise
        for side in (-1, 1):
            inner = self.fx(side * (t.eye_dx - t.brow_len * 0.5))
            outer = self.fx(side * (t.eye_dx + t.brow_len * 0.5))
            rise = math.tan(t.brow_angle) * t.brow_len
            points = [(inner, y + rise * 0.5), (outer, y - rise * 0.5)]
            _paint(canvas, self.mask(_stroke_sd(self.x, self.y, points, t.brow_thick)), n.hair)

    def nose(self, canvas):
        t = self.t
        cx, top, tip = self.fx(0.0), t.eye_y + 0.03, t.eye_y + t.nose_len
        ridge = [(cx, top), (cx + t.nose_w * 0.3, tip)]
        _paint(canvas, 0.6 * self.mask(_stroke_sd(self.x, self.y, ridge, 0.012)), self.shadow)
        for side in (-1, 1):
            sd = _ellipse_sd(self.x, self.y, cx + side * t.nose_w, tip, 0.022, 0.014)
            _paint(canvas, self.mask(sd), tuple(self.skin * 0.45))

    def mouth(self, canvas):
        t, n = self.t, self.n
        cx, w = self.fx(0.0), t.mouth_w * self.narrow
        curve = t.mouth_curve + n.smile
        xs = np.linspace(-1, 1, 7)
        points = [(cx + w * s, t.mouth_y - curve * s * s) for s in xs]
        _paint(canvas, self.mask(_stroke_sd(self.x, self.y, points, t.mouth_thick)), self.lips)

    def beard(self, canvas):
        t = self.t
        if t.beard <= 0:
            return
        top = t.mouth_y - t.beard
        sd = np.maximum(top - self.y, self.head_sd)  # below the beard line, inside the head
        _paint(canvas, 0.85 * self.mask(sd), self.n.hair)

    def glasses(self, canvas):
        t = self.t
        if t.glasses <= 0:
            return
        frame = tuple(np.asarray(self.n.hair) * 0.5)
        radius = t.eye_rx * 1.35
        for side in (-1, 1):
            ring = _ellipse_sd(
                self.x,
                self.y,
                self.fx(side * t.eye_dx),
                t.eye_y,
                radius * self.narrow,
                radius * 0.8,
            )
            _paint(canvas, self.mask(np.abs(ring) - t.glasses), frame)
        bridge = [(self.fx(-t.eye_dx + radius), t.eye_y), (self.fx(t.eye_dx - radius), t.eye_y)]
        _paint(canvas, self.mask(_stroke_sd(self.x, self.y, bridge, t.glasses)), frame)

    def moles(self, canvas):
        for mx, my, r in self.t.moles:
            sd = np.maximum(_ellipse_sd(self.x, self.y, self.fx(mx), my, r, r), self.head_sd)
            _paint(canvas, self.mask(sd), tuple(self.skin * 0.35))


def _pixel_grid(size: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres in image coordinates [-1, 1]: x (S, S) to the right, y (S, S) down."""
    centres = (np.arange(size, dtype=np.float32) + 0.5) / size * 2 - 1
    y, x = np.meshgrid(centres, centres, indexing="ij")
    return x, y


def _background(n: Nuisance, x, y, pixel: float) -> np.ndarray:
    """Background colour with a gradient and random blobs: (S, S, 3)."""
    canvas = (
        np.asarray(n.background, np.float32)
        + np.asarray(n.background_slope, np.float32) * ((x + y) * 0.5)[..., None]
    )
    for cx, cy, rx, ry, *colour in n.clutter:
        _paint(canvas, _coverage(_ellipse_sd(x, y, cx, cy, rx, ry), pixel), colour)
    return canvas


def render_face(
    template: FaceTemplate, nuisance: Nuisance, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Render one image: uint8 array (S, S, 3).

    Args:
        template: the identity.
        nuisance: this image's pose, expression, colours, lighting, occlusion and noise.
        size: S, the side in pixels.
        rng: draws the pixel noise.
    """
    n = nuisance
    x, y = _pixel_grid(size)
    pixel = 2.0 / size
    canvas = _background(n, x, y, pixel)
    # Image -> canonical face coordinates: undo the shift, rotation and scale.
    c, s = math.cos(n.rotation), math.sin(n.rotation)
    dx, dy = x - n.shift[0], y - n.shift[1]
    fx = (dx * c + dy * s) / n.scale
    fy = (-dx * s + dy * c) / n.scale
    _FaceDrawer(template, n, fx, fy, pixel / n.scale).draw(canvas)
    canvas *= (1.0 + n.light[0] * x + n.light[1] * y)[..., None]  # lighting gradient
    if n.occluder is not None:
        x0, y0, x1, y1, *colour = n.occluder
        inside = (x >= x0) & (x <= x1) & (y >= y0) & (y <= y1)
        canvas[inside] = colour
    canvas = (canvas - 0.5) * n.contrast + 0.5 + n.brightness
    canvas = canvas * np.asarray(n.gain, np.float32)
    canvas = canvas + rng.normal(0.0, n.noise_std, canvas.shape).astype(np.float32)
    return (np.clip(canvas, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


# ----------------------------------------------------------------------------- dataset


class SyntheticIdentities(Dataset):
    """Procedurally generated face-like identities, a torch Dataset of uint8 images.

    Item ``index`` is image ``index % images_per_identity`` of identity
    ``index // images_per_identity``: ``(uint8 (3, S, S), label)``.

    Attributes:
        targets: the label of every item.
        classes: identity names, ``"id00000"`` style, numbered from ``identity_offset``.

    Args:
        num_identities: how many identities.
        images_per_identity: images of each.
        image_size: S, the side in pixels.
        seed: the data set's seed; with the global identity number it fixes each template.
        identity_offset: global number of the first identity; give held-out data an offset past
            the training identities to get different identities.
    """

    def __init__(
        self,
        num_identities: int,
        images_per_identity: int,
        image_size: int = 64,
        seed: int = 0,
        identity_offset: int = 0,
    ):
        for name, value in [
            ("num_identities", num_identities),
            ("images_per_identity", images_per_identity),
            ("image_size", image_size),
        ]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if identity_offset < 0 or seed < 0:
            raise ValueError(f"seed={seed}, identity_offset={identity_offset}: expected >= 0")
        self.num_identities = num_identities
        self.images_per_identity = images_per_identity
        self.image_size = image_size
        self.seed = seed
        self.identity_offset = identity_offset
        self.targets = [j for j in range(num_identities) for _ in range(images_per_identity)]
        self.classes = [self.identity_name(j) for j in range(num_identities)]

    def identity_name(self, label: int) -> str:
        """The folder name of identity ``label``: its global number, zero-padded."""
        return f"id{self.identity_offset + label:05d}"

    def _rng(self, label: int, *stream: int) -> np.random.Generator:
        """An independent stream for ``(seed, global identity, *stream)``."""
        if not 0 <= label < self.num_identities:
            raise IndexError(f"identity {label} out of range [0, {self.num_identities})")
        key = (self.identity_offset + label, *stream)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=key))

    def template(self, label: int) -> FaceTemplate:
        """The face template of identity ``label``.

        Args:
            label: the identity, in ``[0, num_identities)``.
        """
        return sample_template(self._rng(label, 0))

    def image(self, label: int, image_index: int, aligned: bool = False) -> torch.Tensor:
        """Image ``image_index`` of identity ``label``: uint8 (3, S, S).

        Args:
            label: the identity, in ``[0, num_identities)``.
            image_index: any non-negative integer (not limited to ``images_per_identity``).
            aligned: render it without the pose nuisance (rotation, shift, scale, turn of the
                head), as a perfect face aligner would; colours, expression, occlusion and
                noise are unchanged. For diagnostics.
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
        """``(uint8 image (3, S, S), label)``."""
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        label, image_index = divmod(index, self.images_per_identity)
        return self.image(label, image_index), label

    def file_name(self, label: int, image_index: int) -> str:
        """``<identity>_<0001>.png``, numbered from 1 as LFW is."""
        return f"{self.identity_name(label)}_{image_index + 1:04d}.png"

    def write_to_disk(self, root: str | Path) -> dict[str, list[str]]:
        """Write every image as ``root/<identity>/<identity>_<0001>.png``.

        Args:
            root: the folder to write into (created if needed).

        Returns:
            ``{identity: [file name, ...]}`` of what was written.

        Raises:
            OSError: a file could not be written whole (a full disk, a quota, a file-size
                limit), or reads back different from what was written.
        """
        root = Path(root)
        written: dict[str, list[str]] = {}
        for label in range(self.num_identities):
            folder = root / self.identity_name(label)
            folder.mkdir(parents=True, exist_ok=True)
            names = []
            for i in range(self.images_per_identity):
                name = self.file_name(label, i)
                _write_verified(folder / name, encode_png(self.image(label, i)).numpy().tobytes())
                names.append(name)
            written[self.identity_name(label)] = names
        return written


# ----------------------------------------------------------------------------- on disk


def _write_verified(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and read it back: a short or failed write raises OSError.

    (torchvision's ``write_png`` ignores write errors: on a full disk it left 0-byte files.)
    """
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError as err:  # name the file: the message reaches the user as one line
        raise OSError(err.errno, err.strerror, str(path)) from None
    if path.read_bytes() != data:
        raise OSError(f"{path}: the file reads back different from what was written")


def _manifest(cfg) -> dict:
    """What the folders written by :func:`prepare_synthetic_data` were made from."""
    return {
        "generator_version": GENERATOR_VERSION,
        "seed": cfg.synthetic_seed,
        "image_size": drawn_side(cfg.image_size),
        "train": {
            "identities": cfg.synthetic_identities,
            "images_per_identity": cfg.synthetic_images_per_identity,
            "identity_offset": 0,
        },
        "heldout": {
            "identities": cfg.synthetic_heldout_identities,
            "images_per_identity": cfg.synthetic_heldout_images_per_identity,
            "identity_offset": cfg.synthetic_identities,
        },
        "pairs": {
            "n_folds": PAIRS_FOLDS,
            "pairs_per_fold": cfg.synthetic_pairs_per_fold,
            "files": ["val_pairs.txt", "test_pairs.txt"],  # identity-disjoint halves
        },
    }


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_manifest(path: Path, manifest: dict) -> None:
    write_text_atomic(path, json.dumps(manifest, indent=2))


def _folder_complete(folder: Path, part: dict) -> bool:
    """``part["identities"]`` identity folders of ``part["images_per_identity"]`` PNGs each."""
    if not folder.is_dir():
        return False
    identities = [p for p in folder.iterdir() if p.is_dir()]
    if len(identities) != part["identities"]:
        return False
    for identity in identities:
        images = list(identity.glob("*.png"))
        if len(images) != part["images_per_identity"]:
            return False
        if not all(looks_like_image(image) for image in images):  # e.g. 0-byte files
            return False
    return True


def _clear_previous(root: Path, manifest_path: Path) -> None:
    """Remove folders a previous call wrote; refuse to touch folders it did not write."""
    targets = [root / "train", root / "heldout"]
    if not manifest_path.exists():
        occupied = [t for t in targets if t.exists() and any(t.iterdir())]
        if occupied:
            raise DataError(
                f"{occupied[0]} exists and {manifest_path} does not: the folder was not written "
                "by prepare_synthetic_data; choose another data.root for the synthetic data"
            )
    for target in targets:
        shutil.rmtree(target, ignore_errors=True)


def _split_validation_test(written: dict[str, list[str]]) -> tuple[dict, dict]:
    """The held-out identities in two identity-disjoint halves: (validation, test)."""
    names = sorted(written)
    half = len(names) // 2
    return {n: written[n] for n in names[:half]}, {n: written[n] for n in names[half:]}


def _write_heldout_pairs(written: dict[str, list[str]], path: Path, pairs_per_fold: int, seed: int):
    """A pairs file for some held-out identities: identity-disjoint folds when there are enough."""
    try:
        folds = generate_pairs(written, PAIRS_FOLDS, pairs_per_fold, seed=seed)
    except DataError:
        # Too few identities per fold for disjoint folds: draw from all, then split.
        try:
            folds = generate_pairs(
                written, PAIRS_FOLDS, pairs_per_fold, seed=seed, disjoint_folds=False
            )
        except DataError as err:
            raise ConfigError(
                "data.synthetic_heldout_identities, data.synthetic_heldout_images_per_identity "
                f"and data.synthetic_pairs_per_fold: too small for the held-out pairs (half of "
                f"the held-out identities each for validation and test): {err}"
            ) from None
    write_pairs(path, folds)


def drawn_side(image_size) -> int:
    """The side the synthetic faces are drawn at for a network input of ``image_size``.

    Faces are drawn square; for an H x W input they are drawn at max(H, W) and the
    transforms resize and crop them to H x W as they do any photo of another shape.

    Args:
        image_size: S or (H, W) (``data.image_size``).
    """
    return max(image_hw(image_size))


# The DataConfig keys prepare_synthetic_data reads as counts.
_SIZE_KEYS = (
    "synthetic_identities",
    "synthetic_images_per_identity",
    "synthetic_heldout_identities",
    "synthetic_heldout_images_per_identity",
    "synthetic_pairs_per_fold",
)


def _check_sizes(cfg) -> None:
    """Every size key a positive integer and the seed >= 0, else a ConfigError naming the key."""
    try:
        image_hw(cfg.image_size)
    except ValueError:
        raise ConfigError(
            f"data.image_size: {cfg.image_size!r}: expected a positive integer or [height, width]"
        ) from None
    for key in _SIZE_KEYS:
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.{key}: {value!r}: expected a positive integer")
    if cfg.synthetic_seed < 0:
        raise ConfigError(f"data.synthetic_seed: {cfg.synthetic_seed!r}: expected >= 0")


def prepare_synthetic_data(root: str | Path, cfg) -> dict:
    """Write the built-in data set once: training identities, held-out identities and pairs.

    ``root/train/`` gets ``cfg.synthetic_identities`` identities, ``root/heldout/`` gets
    ``cfg.synthetic_heldout_identities`` other identities (numbered after the training ones),
    split in two identity-disjoint halves: ``root/heldout/val_pairs.txt`` (validation: model
    selection) and ``root/heldout/test_pairs.txt`` (test: reported once), each 10 folds of
    ``cfg.synthetic_pairs_per_fold`` same and different pairs. ``root/manifest.json`` records
    the settings; a later call with the same settings finds the folders complete and writes
    nothing. Call it from one process only (rank 0).

    Args:
        root: the folder to write into.
        cfg: a :class:`facenet.config.DataConfig` (its ``synthetic_*`` keys and ``image_size``).

    Returns:
        ``{"train_root", "heldout_root", "val_pairs", "test_pairs"}`` as path strings.

    Raises:
        ConfigError: a size key below 1, or sizes too small for the held-out pairs.
        DataError: ``root`` holds ``train``/``heldout`` folders this function did not write.
        OSError: ``root`` cannot be written.
    """
    _check_sizes(cfg)
    root = Path(root)
    paths = {
        "train_root": str(root / "train"),
        "heldout_root": str(root / "heldout"),
        "val_pairs": str(root / "heldout" / "val_pairs.txt"),
        "test_pairs": str(root / "heldout" / "test_pairs.txt"),
    }
    manifest_path = root / MANIFEST_NAME
    wanted = _manifest(cfg)
    found = _read_manifest(manifest_path)
    if (
        found == {**wanted, "complete": True}
        and Path(paths["val_pairs"]).is_file()
        and Path(paths["test_pairs"]).is_file()
        and _folder_complete(root / "train", wanted["train"])
        and _folder_complete(root / "heldout", wanted["heldout"])
    ):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    _clear_previous(root, manifest_path)
    _write_manifest(manifest_path, {**wanted, "complete": False})
    for part in ("train", "heldout"):
        spec = wanted[part]
        data = SyntheticIdentities(
            spec["identities"],
            spec["images_per_identity"],
            drawn_side(cfg.image_size),
            cfg.synthetic_seed,
            spec["identity_offset"],
        )
        written = data.write_to_disk(root / part)
    validation, test = _split_validation_test(written)
    for part, path in ((validation, paths["val_pairs"]), (test, paths["test_pairs"])):
        _write_heldout_pairs(part, Path(path), cfg.synthetic_pairs_per_fold, cfg.synthetic_seed)
    _write_manifest(manifest_path, {**wanted, "complete": True})
    return paths
