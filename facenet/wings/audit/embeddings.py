"""The audit's two sets embedded once each: a training folder and an evaluation's images, as
the model's preparation and the settings (flip, preprocessing, features) make them, kept in a
cache folder under a key of everything that decides the numbers."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from facenet.data.folder import list_images
from facenet.data.images import build_transform
from facenet.evaluation.embedding import PathImages, embed_batches
from facenet.evaluation.presets import VerifySettings
from facenet.files import read_npz, write_atomic
from facenet.sizes import plain_size
from facenet.wings.after_training.embed import embed_folder
from facenet.wings.after_training.loading import TrainedModel


@dataclass
class EmbeddedSet:
    """(N, D) float32 ``embeddings`` ((N, 2D) with flip), the ``paths`` and ``labels``
    (identity folder names) of their rows, and ``(path, reason)`` per file left out."""

    embeddings: np.ndarray
    paths: list
    labels: list
    unreadable: list = field(default_factory=list)


def _key(trained: TrainedModel, settings: VerifySettings, paths: list) -> str:
    """What decides the embeddings: the weights, the preparation and every file's path, size
    and modification time (a file replaced in place changes them)."""
    files = [(p, s.st_size, s.st_mtime_ns) for p in paths for s in [os.stat(p)]]
    decided_by = {
        "weights_sha256": trained.weights_sha256(),
        "image_size": plain_size(trained.image_size),
        "normalize": trained.normalize,
        **settings.provenance(),
        "files": files,
    }
    return hashlib.sha256(json.dumps(decided_by).encode()).hexdigest()[:32]


# what a cache file holds: array -> (dimensions, numpy dtype kind: float or unicode)
CACHED = {
    "embeddings": (2, "f"),  # (N, D) float32
    "key": (0, "U"),
    "labels": (1, "U"),  # (N,)
    "paths": (1, "U"),  # (N,)
    "unreadable": (2, "U"),  # (M, 2): path, reason
}


def _stale(arrays: dict, key: str, paths: list) -> str | None:
    """Why ``arrays``, read back from a cache, are not the embeddings stored under ``key`` of
    the images ``paths`` (a row for each readable one, the others listed as unreadable); None
    when they are. A file copied from another cache, edited or cut short is caught here."""
    if sorted(arrays) != sorted(CACHED):
        return f"holds {sorted(arrays)}, not {sorted(CACHED)}"
    for name, (ndim, kind) in CACHED.items():
        if arrays[name].ndim != ndim or arrays[name].dtype.kind != kind:
            return f"'{name}' is {arrays[name].dtype} of shape {arrays[name].shape}"
    embeddings, rows, unreadable = arrays["embeddings"], arrays["paths"], arrays["unreadable"]
    if arrays["key"].item() != key:
        return "stored under another key"
    if embeddings.dtype != np.float32 or not len(embeddings) == len(rows) == len(arrays["labels"]):
        return f"{embeddings.dtype} embeddings of shape {embeddings.shape} for {len(rows)} paths"
    if not np.isfinite(embeddings).all():
        return "holds NaN or infinite embeddings"
    if unreadable.shape[1] != 2:
        return f"'unreadable' of shape {unreadable.shape}, not (M, 2)"
    if sorted([*rows, *unreadable[:, 0]]) != sorted(map(str, paths)):
        return "lists other images than those embedded now"
    return None


def _cached(cache: str | os.PathLike | None, key: str, paths: list, compute) -> EmbeddedSet:
    """``compute()``, or what it returned before for ``paths`` under ``key`` in the folder
    ``cache``; a cache that does not hold that is computed again, with a warning."""
    if not cache:
        return compute()
    path = Path(cache, f"audit-embeddings-{key}.npz")
    if path.is_file():
        arrays = read_npz(path, "an embeddings cache of facenet-audit")
        if (reason := _stale(arrays, key, paths)) is None:
            listed = [arrays[name].tolist() for name in ("paths", "labels", "unreadable")]
            return EmbeddedSet(arrays["embeddings"], *listed)
        warnings.warn(f"{path}: {reason}; embedding again and replacing it", stacklevel=2)
    found = compute()
    arrays = {
        "key": np.array(key),
        "embeddings": found.embeddings,
        "paths": np.array(found.paths, dtype=str),
        "labels": np.array(found.labels, dtype=str),
        "unreadable": np.array(found.unreadable, dtype=str).reshape(-1, 2),
    }
    Path(cache).mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda fh: np.savez(fh, **arrays))
    return found


def embed_training(
    trained: TrainedModel, root, settings: VerifySettings, device, cache=None, progress=False
) -> EmbeddedSet:
    """Every readable image under the identity folders of ``root`` (unreadable ones left out
    and listed), with a progress bar on stderr if ``progress``; the model must be on
    ``device``."""
    paths, _ = list_images(root)

    def compute():
        found = embed_folder(
            trained.model, root, trained.image_size, settings, trained.normalize, device, progress
        )
        return EmbeddedSet(found.embeddings.numpy(), found.paths, found.labels, found.unreadable)

    return _cached(cache, _key(trained, settings, paths), paths, compute)


def embed_images(
    trained: TrainedModel, paths: list, settings: VerifySettings, device, cache=None
) -> EmbeddedSet:
    """The images ``paths`` (an evaluation's, which must all be readable), each labelled by its
    folder's name; the model must be on ``device``."""

    def compute():
        transform = build_transform(
            trained.image_size, False, trained.normalize, preprocess=settings.preprocess
        )
        loader = torch.utils.data.DataLoader(
            PathImages(paths, transform), batch_size=settings.batch_size
        )
        found = embed_batches(trained.model, loader, device, settings.flip, settings.features)
        return EmbeddedSet(found.numpy(), list(paths), [Path(p).parent.name for p in paths])

    return _cached(cache, _key(trained, settings, paths), paths, compute)
