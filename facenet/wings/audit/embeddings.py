"""The audit's two sets embedded once each: a training folder and an evaluation's images, as
the model's preparation and the settings (flip, preprocessing, features) make them, kept in a
cache folder under a key of everything that decides the numbers."""

from __future__ import annotations

import hashlib
import json
import os
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


def _cached(cache: str | os.PathLike | None, key: str, compute) -> EmbeddedSet:
    """``compute()``, or what it returned before under ``key`` in the folder ``cache``."""
    if not cache:
        return compute()
    path = Path(cache, f"audit-embeddings-{key}.npz")
    if path.is_file():
        arrays = read_npz(path, "an embeddings cache of facenet-audit")
        unreadable = arrays["unreadable"].reshape(-1, 2).tolist()
        return EmbeddedSet(
            arrays["embeddings"], arrays["paths"].tolist(), arrays["labels"].tolist(), unreadable
        )
    found = compute()
    arrays = {
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

    return _cached(cache, _key(trained, settings, paths), compute)


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

    return _cached(cache, _key(trained, settings, paths), compute)
