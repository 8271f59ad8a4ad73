"""Template verification (IJB-B/C 1:1) as insightface computes it: deepinsight/insightface,
recognition/arcface_torch/eval_ijbc.py at commit 7fadd420c2351d0ffa8cac403421c1a3ed733365.

Each face is warped from its five landmarks onto the model's template and embedded with its
mirror image, the two features added; optionally scaled by the detector score and/or made unit
length; averaged within a media (one video or photo source), summed over the template's media,
L2-normalised; a pair's score is the cosine of its templates. TAR at each FAR is read at the
ROC point nearest the FAR, ties to the larger TAR, as insightface reads it. Pooling and scoring
run in float64 (insightface: float32 until the template sum).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.metrics import auc, roc_curve
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from facenet.data.images import normalize_steps
from facenet.errors import ConfigError, DataError
from facenet.evaluation.embedding import embed_batches
from facenet.evaluation.presets import FromAttributes
from facenet.sizes import ImageSize, image_hw
from facenet.wings.align.presets import TEMPLATES
from facenet.wings.templates.ijb import LANDMARKS, TemplateSet, read_face

FARS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # eval_ijbc.py's x_labels
PAIR_CHUNK = 2**14  # pairs scored at once: two (chunk, D) float64, 64 MiB each at D = 512


@dataclass(frozen=True)
class TemplateSettings(FromAttributes):
    """insightface's flags: ``flip_test`` (``use_flip_test``: image and mirror features added),
    ``detector_score`` (``use_detector_score``: each feature times its detector score),
    ``norm_score`` (``use_norm_score``: the feature's norm kept; False: unit length before
    pooling); ``features``: "raw" (the network's output before L2 normalisation, as
    insightface's networks give it) or "unit"; ``template``: a name in ``TEMPLATES``, None for
    the one of the model's input size; ``workers``: processes reading and warping faces."""

    flip_test: bool = True
    detector_score: bool = True
    norm_score: bool = True
    features: str = "raw"
    template: str | None = None
    batch_size: int = 128
    workers: int = 0


@dataclass(frozen=True)
class TemplateResult:
    """``template_ids`` (T,) ascending, their unit ``template_features`` (T, D) float64, the
    pairs' cosine ``scores`` (P,), sklearn's ROC (``fpr``, ``tpr``), its ``auc``, ``tar``
    {FAR: TAR} read at every FAR as insightface reads it, and the ``impostor_pairs`` counted:
    they resolve only FARs from 1 / impostor_pairs up (one false accept)."""

    template_ids: np.ndarray
    template_features: np.ndarray
    scores: np.ndarray
    fpr: np.ndarray
    tpr: np.ndarray
    auc: float
    tar: dict
    impostor_pairs: int

    def resolved(self) -> dict:
        """{FAR: TAR} of the FARs the impostor pairs resolve (a FAR below one false accept
        would read the TAR at a larger FPR)."""
        return {far: tar for far, tar in self.tar.items() if far * self.impostor_pairs >= 1}

    def tar_at_far(self) -> dict[str, float | str]:
        """metrics.json's ``tar_at_far``: {"1e-06": TAR, or "not resolved (N impostor pairs
        resolve FAR >= 1/N)" where the pairs cannot resolve it}."""
        n, resolved = self.impostor_pairs, self.resolved()
        unresolved = f"not resolved ({n} impostor pairs resolve FAR >= 1/{n})"
        return {f"{far:g}": resolved.get(far, unresolved) for far in self.tar}

    def tar_line(self) -> str:
        """``TAR@FAR=1e-06: not resolved (...)  TAR@FAR=0.1 0.7500``: the figures as printed."""
        cells = self.tar_at_far().items()
        return "  ".join(
            f"TAR@FAR={far} {tar:.4f}" if isinstance(tar, float) else f"TAR@FAR={far}: {tar}"
            for far, tar in cells
        )


def choose_template(image_size: ImageSize, name: str | None = None) -> str:
    """``name`` (one of ``TEMPLATES``), or the template whose (H, W) is the model's input size."""
    if name is not None:
        if name not in TEMPLATES:
            raise ConfigError(f"template {name!r}: expected one of {tuple(TEMPLATES)}")
        return name
    size = image_hw(image_size)
    found = [key for key, t in TEMPLATES.items() if (t.height, t.width) == size]
    if not found:
        known = ", ".join(f"{k} {t.height} x {t.width}" for k, t in TEMPLATES.items())
        raise ConfigError(
            f"the model takes {size[0]} x {size[1]} images and no landmark template has that "
            f"size ({known}): give --template (its crop is then resized to the model's input)"
        )
    return found[0]


class WarpedFaces(torch.utils.data.Dataset):
    """The faces of a :class:`TemplateSet`, each warped by ``warp(image, landmarks)`` ((H, W, 3)
    uint8 and (5, 2) -> the (h, w, 3) uint8 crop), resized (bilinear, antialiased) to
    ``image_size`` where the template has another size, and standardised."""

    def __init__(self, faces: TemplateSet, warp: Callable, image_size, normalize: str):
        self.faces, self.warp, self.size = faces, warp, image_hw(image_size)
        self.standardise = v2.Compose(normalize_steps(normalize))

    def __len__(self) -> int:
        return len(self.faces.images)

    def __getitem__(self, index: int) -> torch.Tensor:  # (3, H, W)
        image = read_face(self.faces, index).permute(1, 2, 0).numpy()
        try:
            crop = torch.from_numpy(self.warp(image, self.faces.landmarks[index]))
        except ValueError as err:  # landmarks no similarity fits: all on one point or line
            where = f"{self.faces.meta(LANDMARKS)}: image {self.faces.images[index]!r}"
            raise DataError(f"{where}: {err}") from None
        crop = crop.permute(2, 0, 1)  # (3, h, w)
        if crop.shape[1:] != self.size:
            crop = TF.resize(crop, list(self.size), antialias=True)
        return self.standardise(crop)


def check_weights(faces: TemplateSet, settings: TemplateSettings) -> None:
    """Refuse detector scores that weigh every face of a template by 0: its pooled feature would
    be zero and each of its pairs would score 0 whatever the model."""
    if not settings.detector_score:
        return
    ids, t = np.unique(faces.templates, return_inverse=True)
    weighed = np.bincount(t, weights=faces.scores > 0, minlength=len(ids))  # (T,) faces > 0
    if not weighed.all():
        raise DataError(
            f"{faces.meta(LANDMARKS)}: every detector score (column 12) of template "
            f"{ids[np.argmin(weighed)]} is 0, so it would pool to zero; give "
            "--no-detector-score or fix the scores"
        )


def embed_faces(model, faces: WarpedFaces, device, settings: TemplateSettings) -> np.ndarray:
    """(N, D) float32 feature of every face (image and mirror added with ``flip_test``), the
    faces read by ``settings.workers`` processes (0: this one); detector scores that would pool
    a template to zero are refused first (:func:`check_weights`), before hours of embedding."""
    check_weights(faces.faces, settings)
    loader = torch.utils.data.DataLoader(
        faces, batch_size=settings.batch_size, num_workers=settings.workers
    )
    try:
        out = embed_batches(model, loader, device, settings.flip_test, settings.features)
    except DataError as err:
        if not settings.workers:
            raise
        # a worker's error comes back with its traceback; the last line ends in its message
        raise DataError(str(err).strip().splitlines()[-1].split(": ", 1)[-1]) from None
    if settings.flip_test:  # (N, 2D): each image's feature, then its mirror's
        out = out[:, : out.shape[1] // 2] + out[:, out.shape[1] // 2 :]
    return out.numpy()


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` divided by their L2 norm; zero rows stay zero (sklearn's ``normalize``)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def template_features(features, scores, templates, media, settings: TemplateSettings):
    """(template ids (T,) ascending, (T, D) float64 unit features) from image ``features``
    (N, D) after the flip sum, detector ``scores``, ``templates`` and ``media`` (N,)."""
    ids, t = np.unique(templates, return_inverse=True)
    order = np.lexsort((media, t))  # by template, then media: each media one run
    t, m = t[order], np.asarray(media)[order]
    x = np.take(features, order, axis=0).astype(np.float64)  # one float64 copy, then in place
    if not settings.norm_score:
        x /= np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.finfo(float).tiny)
    if settings.detector_score:
        weights = np.asarray(scores, dtype=np.float64)[order]
        # scaled by a power of two, exactly: a template is made unit length, so only the scores'
        # ratios count, and weights near 1 keep the sums of squares from overflowing (1e155)
        # or underflowing (1e-200)
        x *= np.ldexp(weights, -np.frexp(weights.max(initial=0.0))[1])[:, None]
    starts = np.flatnonzero(np.r_[True, (t[1:] != t[:-1]) | (m[1:] != m[:-1])])
    counts = np.diff(np.r_[starts, len(t)])
    means = np.add.reduceat(x, starts) / counts[:, None]  # (M, D) one row per media
    t_starts = np.flatnonzero(np.r_[True, np.diff(t[starts]) != 0])
    return ids, _unit(np.add.reduceat(means, t_starts))  # (T, D)


def read_tar(labels, scores) -> tuple:
    """(fpr, tpr, AUC, {FAR: TAR}) of sklearn's ``roc_curve``: each TAR at the ROC
    point nearest the FAR, a tie to the later point (insightface flips the curve and takes the
    first minimum)."""
    fpr, tpr, _ = roc_curve(labels, scores)
    back_fpr, back_tpr = fpr[::-1], tpr[::-1]
    tar = {far: float(back_tpr[np.argmin(np.abs(back_fpr - far))]) for far in FARS}
    return fpr, tpr, float(auc(fpr, tpr)), tar


def verify_templates(faces: TemplateSet, features, settings: TemplateSettings) -> TemplateResult:
    """Pool ``features`` (N, D) of ``faces`` (from :func:`embed_faces`) and score its pairs."""
    ids, pooled = template_features(features, faces.scores, faces.templates, faces.media, settings)
    rows = np.searchsorted(ids, faces.pairs)  # (P, 2) rows of pooled; every id is known
    scores = np.empty(len(rows))
    for s in range(0, len(rows), PAIR_CHUNK):
        a, b = pooled[rows[s : s + PAIR_CHUNK, 0]], pooled[rows[s : s + PAIR_CHUNK, 1]]
        scores[s : s + PAIR_CHUNK] = np.einsum("pd,pd->p", a, b)
    impostors = int(np.count_nonzero(faces.labels == 0))
    return TemplateResult(ids, pooled, scores, *read_tar(faces.labels, scores), impostors)
