"""Verification of a model on a pairs list or an insightface ``.bin`` set, or of distances
measured elsewhere, under one ``VerifySettings``: training's validation and facenet-evaluate
both call :func:`verify`, so a checkpoint gives the same figures either way.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import partial

import numpy as np
import torch
from torch import nn

from facenet.errors import DataError
from facenet.evaluation.embedding import embed_batches, embed_pair_list
from facenet.evaluation.presets import CLASSIC, VerifySettings
from facenet.evaluation.protocol import (
    VerificationResult,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)
from facenet.sizes import ImageSize


def verify(
    model: nn.Module,
    pairs,
    image_size: ImageSize,
    settings: VerifySettings = CLASSIC,
    *,
    normalize: str = "fixed",
    device: str | torch.device = "cpu",
    return_distances: bool = False,
) -> VerificationResult | tuple[VerificationResult, np.ndarray]:
    """The protocol's figures of ``model`` (on ``device``) on a ``PairList`` (embedded sharded
    over ranks) or a ``BinPairs`` (in this process, faces resized whole: no ``preprocess``);
    with ``return_distances`` also the (N,) pair distances without mean subtraction (what a
    fixed threshold, such as a run's validation threshold, applies to).

    Raises:
        DataError: pairs the protocol cannot use (e.g. a fold without both kinds), named.
    """
    if hasattr(pairs, "images_for"):  # a .bin set: images 2i and 2i + 1 are pair i
        images = pairs.images_for(image_size, normalize)
        loader = torch.utils.data.DataLoader(images, batch_size=settings.batch_size)
        embeddings = embed_batches(model, loader, device, settings.flip, settings.features).numpy()
        emb1, emb2, folds, source = embeddings[0::2], embeddings[1::2], None, f"{pairs.name}.bin"
    else:  # a pairs file's own folds (they differ from contiguous blocks once pairs were skipped)
        found = embed_pair_list(model, pairs, image_size, settings, normalize, device)
        emb1, emb2 = (embeddings.numpy() for embeddings in found)
        folds = pairs.folds_for(settings.n_folds) if hasattr(pairs, "folds_for") else None
        source = str(getattr(pairs, "source", "") or "pairs")
    distances = pair_distances(emb1, emb2, metric=settings.distance)  # (N,)
    evaluate = partial(evaluate_embeddings, emb1, emb2, pairs.issame, settings, folds)
    result = _checked(source, distances, settings, evaluate)
    return (result, distances) if return_distances else result


def verify_distances(
    distances, issame, settings: VerifySettings = CLASSIC, source: str = "distances"
) -> VerificationResult:
    """The protocol on (N,) pair distances measured elsewhere, ``source`` naming them."""
    settings = replace(settings, flip=False)  # distances: the unit grids, whatever flip says
    evaluate = partial(evaluate_verification, distances, issame, settings)
    return _checked(source, distances, settings, evaluate)


# AUC below 0.5 by more than this and three standard errors of chance (Hanley and McNeil's,
# half the pairs of each kind): the same identity scores higher, as similarities do
REVERSED_AUC_MARGIN = 0.1


def _checked(source: str, distances, settings: VerifySettings, evaluate) -> VerificationResult:
    """``evaluate()`` (the protocol under ``settings``), its refusal of the data as a DataError
    naming ``source``; a warning where the threshold grid misses the (N,) pair ``distances``
    (measured without mean subtraction) or they rank the wrong way (the figures would be chance
    or worse without a word)."""
    try:
        r = evaluate()
    except DataError:
        raise
    except ValueError as err:  # the protocol checked the pairs: they do not fit, a user matter
        raise DataError(f"{source}: {err}") from None
    missed, passed = 1 - r.tpr[-1], r.fpr[0]  # same pairs above the grid, others below it
    if missed or passed:
        grid = f"{settings.grid!r} [{r.thresholds[0]:g}, {r.thresholds[-1]:g}]"
        warnings.warn(
            f"{source}: {missed:.1%} of the same-identity pairs lie at or above the top of the "
            f"{r.distance} threshold grid {grid} (--grid, eval.grid or a --preset) (no "
            f"threshold accepts them) and {passed:.1%} of "
            "the others below it (every one accepts them); the distances span "
            f"[{np.min(distances):.4g}, {np.max(distances):.4g}]: were they measured with another "
            "--distance, or on raw features (use --features unit, or --distance cosine or "
            "angular)?",
            stacklevel=3,
        )
    if r.auc < 0.5 - max(REVERSED_AUC_MARGIN, 3 * ((r.n_pairs + 1) / 3) ** 0.5 / r.n_pairs):
        warnings.warn(
            f"{source}: the same identity scores higher than different ones (AUC {r.auc:.4f}): "
            "similarities read as distances, or the other way? give (or drop) --similarities, "
            "or negate them",
            stacklevel=3,
        )
    return r
