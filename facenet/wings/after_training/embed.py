"""Embedding every image under a folder with the evaluation transform, leaving out the files
that cannot be decoded."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from facenet.data.folder import list_images
from facenet.data.images import CorruptImageError, build_transform
from facenet.evaluation.embedding import PathImages, embed_batches
from facenet.evaluation.presets import CLASSIC, VerifySettings
from facenet.sizes import ImageSize
from facenet.wings.after_training.identify import non_finite_rows


class _ReadableImages(PathImages):
    """(index, image, None), or (index, None, reason) for an undecodable image."""

    def __getitem__(self, index: int):
        try:
            return index, super().__getitem__(index), None
        except CorruptImageError as err:
            return index, None, err.reason


@dataclass
class FolderEmbeddings:
    """(N, D) float32 ``embeddings`` of a folder's readable images, their ``paths`` and
    ``labels`` (folder names; "" directly in the folder), and ``(path, reason)`` per file left
    out."""

    embeddings: torch.Tensor
    paths: list
    labels: list
    unreadable: list


def embed_folder(
    model: nn.Module,
    root: str | os.PathLike,
    image_size: ImageSize,
    settings: VerifySettings = CLASSIC,
    normalize: str = "fixed",
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> FolderEmbeddings:
    """Every image under ``root`` (identity folders or a flat folder: ``list_images``) embedded
    in one process as ``settings`` say (flip, preprocessing, features, batch size); a DataError
    names an image whose embedding is NaN or infinite."""
    paths, labels = list_images(root)
    transform = build_transform(image_size, False, normalize, preprocess=settings.preprocess)
    loader = torch.utils.data.DataLoader(
        _ReadableImages(paths, transform), batch_size=settings.batch_size, collate_fn=list
    )
    kept, unreadable = [], []

    def readable_batches():  # (b, 3, H, W): each batch's decodable images
        for items in tqdm(
            loader, desc="embedding", unit="batch", disable=not progress, leave=False
        ):
            unreadable.extend((paths[i], reason) for i, image, reason in items if image is None)
            good = [(i, image) for i, image, _ in items if image is not None]
            kept.extend(i for i, _ in good)
            if good:
                yield torch.stack([image for _, image in good])

    embeddings = embed_batches(
        model, readable_batches(), device, settings.flip, settings.features, len(paths)
    )
    kept_paths = [paths[i] for i in kept]
    # a NaN row would be written, then silently never match (or match nothing) later
    non_finite_rows(embeddings.numpy(), f"embeddings of {root}", kept_paths)
    return FolderEmbeddings(embeddings, kept_paths, [labels[i] for i in kept], unreadable)
