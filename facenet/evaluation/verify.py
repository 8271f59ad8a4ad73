"""One verification path: a model and a pairs list (or an insightface ``.bin`` set) in, a
``VerificationResult`` out; the same protocol for pair distances read from a file.

Training's validation and the evaluate command both call :func:`verify`, each translating its
own settings (a run configuration, a command line) into these plain arguments, so a checkpoint
evaluated on the same pairs gives the same figures either way.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from facenet.data.insightface_bin import BinImages, BinPairs
from facenet.errors import DataError
from facenet.evaluation.embedding import embed_dataset, embed_pair_list
from facenet.evaluation.presets import classic_thresholds, mobilefacenet_thresholds
from facenet.evaluation.protocol import (
    DISTANCES,
    VerificationResult,
    default_thresholds,
    evaluate_embeddings,
    evaluate_verification,
    pair_distances,
)
from facenet.sizes import ImageSize

__all__ = ["GRIDS", "embed_pairs", "threshold_grids", "verify", "verify_distances"]

GRIDS = ("default", "classic", "mobilefacenet")


# How far the default grid of a distance reaches for embeddings of norm r instead of 1:
# squared distances scale with r**2, euclidean ones with r; cosine and angular not at all.
_NORM_POWER = {"squared": 2, "euclidean": 1, "seed_l2": 1}


def threshold_grids(
    grid: str = "default", distance: str = "squared", flip: bool = False
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(accuracy grid, VAL grid) of a grid name; None, None: the distance's own grids.

    Args:
        grid: "default" (chosen by the distance), "classic" (the publishers' [0, 4) grids
            whatever the distance) or "mobilefacenet" (Xiaoccer/MobileFaceNet_Pytorch's
            similarities in steps of 1e-4, as cosine distances: :func:`mobilefacenet_thresholds`,
            for accuracy and VAL alike).
        distance: the pair distance (only "default" grids depend on it).
        flip: the embeddings concatenate two unit vectors (norm sqrt 2): a "default" grid
            of a norm-dependent distance then runs, in the same steps, to the doubled range
            (squared distances up to 8), or thresholds above the unit range would never be
            tried. The publishers' grids stay as their code had them.
    """
    if grid not in GRIDS:
        raise ValueError(f"unknown threshold grid {grid!r}; expected one of {GRIDS}")
    if grid == "classic":
        return classic_thresholds(), classic_thresholds(fine=True)
    if grid == "mobilefacenet":  # one grid: the publisher has no VAL of its own
        return mobilefacenet_thresholds(), mobilefacenet_thresholds()
    if not flip or distance not in _NORM_POWER:
        return None, None
    stretch = 2.0 ** (_NORM_POWER[distance] / 2)  # (sqrt 2) ** power

    def stretched(fine: bool) -> np.ndarray:
        unit = default_thresholds(distance, fine=fine)  # arange(0, top, step): (T,)
        steps = int(np.ceil(len(unit) * stretch)) + 1  # through the doubled range's top
        return np.arange(steps) * (unit[1] - unit[0])  # starts with the unit grid, exactly

    return stretched(False), stretched(True)


def _source(pairs) -> str:
    """The name of a pairs list or ``.bin`` set, for error messages."""
    if isinstance(pairs, BinPairs):
        return f"{pairs.name}.bin"
    return str(getattr(pairs, "source", "") or "pairs")


def embed_pairs(
    model: nn.Module,
    pairs,
    image_size: ImageSize,
    *,
    normalize: str = "fixed",
    preprocess: str = "resize",
    flip: bool = False,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    features: str = "unit",
) -> tuple[np.ndarray, np.ndarray]:
    """Both sides of every pair embedded in eval mode: ``(emb1, emb2)``, (N, D) float32.

    Args:
        model: the embedding network, already on ``device``.
        pairs: a ``PairList`` (sharded over ranks under several processes) or a ``BinPairs``
            (embedded in this process; its aligned faces are resized whole, so ``preprocess``
            and ``num_workers`` do not apply).
        image_size: the network's input: S or (H, W) (``facenet.sizes.image_hw``).
        normalize: the pixel standardisation the network was trained with.
        preprocess: "resize" or "crop" for image files (``facenet.data.images``).
        flip: concatenate each embedding with that of the flipped image ((N, 2D) then).
        batch_size: images per forward.
        device: where the network runs.
        num_workers: DataLoader workers decoding image files.
        features: "unit" (the network's unit embeddings) or "raw" (before L2 normalisation).
    """
    if isinstance(pairs, BinPairs):  # images 2i and 2i + 1 are pair i
        images = BinImages(pairs, image_size, normalize)
        embeddings = embed_dataset(model, images, batch_size, device, flip, features=features)
        embeddings = embeddings.numpy()
        return embeddings[0::2], embeddings[1::2]
    emb1, emb2 = embed_pair_list(
        model,
        pairs,
        image_size,
        batch_size,
        device,
        flip,
        normalize=normalize,
        num_workers=num_workers,
        preprocess=preprocess,
        features=features,
    )
    return emb1.numpy(), emb2.numpy()


def _folds(pairs, n_folds: int) -> np.ndarray | None:
    """A pairs file's own folds, or folds that each hold both kinds of pair; None: contiguous.

    The file's folds differ from contiguous blocks once pairs were skipped, and a one-fold
    file lists one kind, then the other. A ``.bin`` set alternates kinds: contiguous folds.
    """
    return pairs.folds_for(n_folds) if hasattr(pairs, "folds_for") else None


def verify(
    model: nn.Module,
    pairs,
    image_size: ImageSize,
    *,
    normalize: str = "fixed",
    preprocess: str = "resize",
    flip: bool = False,
    subtract_mean: bool = False,
    distance: str = "squared",
    grid: str = "default",
    n_folds: int = 10,
    far_target: float = 1e-3,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    return_distances: bool = False,
    features: str = "unit",
    threshold_rule: str = "first",
    scoring: str = "float64",
) -> VerificationResult | tuple[VerificationResult, np.ndarray]:
    """The verification protocol (accuracy, VAL@FAR, AUC, EER) of ``model`` on ``pairs``.

    Args:
        model: the embedding network, already on ``device``.
        pairs: a ``PairList`` (``facenet.data.pairs``) or a ``BinPairs``
            (``facenet.data.insightface_bin``).
        image_size: the network's input: S or (H, W) (``facenet.sizes.image_hw``).
        normalize: the pixel standardisation the network was trained with.
        preprocess: "resize" or "crop" (image files only).
        flip: concatenate each embedding with that of the flipped image.
        subtract_mean: subtract the training folds' mean embedding (the classic option).
        distance: the pair distance (``facenet.evaluation.protocol.DISTANCES``).
        grid: the threshold grids (:func:`threshold_grids`).
        n_folds: folds of the protocol.
        far_target: the FAR at which VAL is read.
        batch_size: images per forward.
        device: where the network runs.
        num_workers: DataLoader workers decoding image files.
        return_distances: also return the (N,) pair distances (without mean subtraction:
            what a fixed threshold such as a run's validation threshold applies to).
        features: "unit" (the network's unit embeddings) or "raw" (before L2 normalisation).
        threshold_rule: how each fold's threshold is chosen: "first" (classic) or "mean"
            (Xiaoccer/MobileFaceNet_Pytorch's; ``facenet.evaluation.protocol``).
        scoring: "float64" (the distance in float64) or "mobilefacenet" (lfw_eval.py's
            cosine, in the features' float32, operation for operation).

    Returns:
        The ``VerificationResult``, or ``(result, distances)`` with ``return_distances``.

    Raises:
        DataError: pairs the protocol cannot use (e.g. a fold without both kinds), named.
    """
    emb1, emb2 = embed_pairs(
        model,
        pairs,
        image_size,
        normalize=normalize,
        preprocess=preprocess,
        flip=flip,
        batch_size=batch_size,
        device=device,
        num_workers=num_workers,
        features=features,
    )
    thresholds, val_thresholds = threshold_grids(grid, distance, flip and features == "unit")
    result = _checked(
        _source(pairs),
        evaluate_embeddings,
        emb1,
        emb2,
        pairs.issame,
        metric=distance,
        subtract_mean=subtract_mean,
        n_folds=n_folds,
        far_target=far_target,
        thresholds=thresholds,
        val_thresholds=val_thresholds,
        folds=_folds(pairs, n_folds),
        threshold_rule=threshold_rule,
        scoring=scoring,
    )
    if not return_distances:
        return result
    return result, pair_distances(emb1, emb2, metric=distance)


def verify_distances(
    distances: Any,
    issame: Any,
    *,
    distance: str = "squared",
    grid: str = "default",
    n_folds: int = 10,
    far_target: float = 1e-3,
    source: str = "distances",
    threshold_rule: str = "first",
) -> VerificationResult:
    """The verification protocol on pair distances measured elsewhere (e.g. read from a file).

    Args:
        distances: (N,) distance of each pair.
        issame: (N,) True/1 for same-identity pairs.
        distance: the metric the distances were measured with (chooses the default grids).
        grid: the threshold grids (:func:`threshold_grids`).
        n_folds: contiguous folds of the protocol.
        far_target: the FAR at which VAL is read.
        source: where the distances came from, for error messages.
        threshold_rule: "first" (classic) or "mean" (Xiaoccer/MobileFaceNet_Pytorch's).

    Distances at or above the grid's largest threshold are accepted by no threshold; when
    there are any, a warning says how many (all of them give accuracy 0.5 with a zero
    spread). The grid is not extended to cover them: the grids are the protocol's (the
    publishers' for ``classic``), and distances beyond them usually mean another distance
    than ``distance`` was measured.

    Raises:
        DataError: distances the protocol cannot use, named by ``source``.
    """
    thresholds, val_thresholds = threshold_grids(grid)
    _warn_above_grid(distances, thresholds, distance, source)
    return _checked(
        source,
        evaluate_verification,
        distances,
        issame,
        n_folds,
        far_target,
        thresholds,
        val_thresholds,
        distance,
        threshold_rule=threshold_rule,
    )


def _warn_above_grid(distances: Any, thresholds, distance: str, source: str) -> None:
    """Warn when some distances lie at or above every threshold of the accuracy grid."""
    try:
        values = np.asarray(distances, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return  # the protocol refuses these with its own message
    if distance not in DISTANCES or values.size == 0 or not np.isfinite(values).all():
        return  # likewise
    grid = default_thresholds(distance) if thresholds is None else np.asarray(thresholds)
    above = int((values >= grid[-1]).sum())
    if above:
        warnings.warn(
            f"{source}: {above} of {len(values)} distances (largest {values.max():.4g}) lie at "
            f"or above the largest threshold of the {distance} grid ({grid[-1]:.4g}): no "
            "threshold accepts them as the same identity; were they measured with another "
            "--distance?",
            stacklevel=2,
        )


def _checked(source: str, protocol, *args, **kwargs) -> VerificationResult:
    """``protocol(*args, **kwargs)``; its refusal of the data as a DataError naming ``source``."""
    try:
        return protocol(*args, **kwargs)
    except DataError:
        raise
    except ValueError as err:  # the protocol checked the pairs: they do not fit, a user matter
        raise DataError(f"{source}: {err}") from None
