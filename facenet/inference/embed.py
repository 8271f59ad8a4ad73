"""Embedding every image under a folder (identity folders or a flat folder) with the
evaluation transform, leaving out the files that cannot be decoded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from facenet.data.folder import list_images
from facenet.data.images import CorruptImageError, build_transform, read_image
from facenet.evaluation.embedding import embed_batches
from facenet.inference.identify import non_finite_rows
from facenet.sizes import ImageSize

__all__ = ["FolderEmbeddings", "embed_folder"]


class _ReadableImages(torch.utils.data.Dataset):
    """Images by path; an undecodable one gives None and its reason instead of a tensor."""

    def __init__(self, paths, transform):
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        try:
            return index, self.transform(read_image(self.paths[index])), None
        except CorruptImageError as err:
            return index, None, err.reason


def _collate_readable(items):
    """(indices of the decoded images, their batch (b, 3, S, S), [(index, reason), ...])."""
    good = [(i, image) for i, image, _ in items if image is not None]
    bad = [(i, reason) for i, image, reason in items if image is None]
    images = torch.stack([image for _, image in good]) if good else None
    return [i for i, _ in good], images, bad


@dataclass
class FolderEmbeddings:
    """The embeddings of a folder's readable images.

    Args:
        embeddings: (N, D) float32, one row per readable image.
        paths: the N image files.
        labels: their identities (folder names; "" for images directly in the folder).
        unreadable: ``(path, reason)`` for every file left out.
    """

    embeddings: torch.Tensor
    paths: list
    labels: list
    unreadable: list


def embed_folder(
    model: nn.Module,
    root: str | os.PathLike,
    image_size: ImageSize,
    normalize: str = "fixed",
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    flip: bool = False,
    progress: bool = False,
) -> FolderEmbeddings:
    """Embed every image under ``root`` with the evaluation transform, in one process.

    Args:
        model: the embedding network.
        root: identity folders or a flat folder of images (see :func:`list_images`).
        image_size: the network's input: S or (H, W) (``facenet.sizes.image_hw``).
        normalize: the pixel standardisation the network was trained with.
        batch_size: images per forward.
        device: where the network runs.
        flip: concatenate each embedding with that of the flipped image ((N, 2D)).
        progress: show a progress bar (on stderr).

    Raises:
        DataError: an image whose embedding is NaN or infinite, named.
    """
    paths, labels = list_images(root)
    dataset = _ReadableImages(paths, build_transform(image_size, train=False, normalize=normalize))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, collate_fn=_collate_readable
    )
    kept, unreadable, chunks = [], [], []
    for indices, images, bad in tqdm(
        loader, desc="embedding", unit="batch", disable=not progress, leave=False
    ):
        unreadable += [(paths[i], reason) for i, reason in bad]
        if images is not None:
            kept += indices
            chunks += embed_batches(model, [images], device, flip)
    embeddings = torch.cat(chunks) if chunks else torch.zeros(0, 0)
    kept_paths = [paths[i] for i in kept]
    # A NaN row would be written and then silently never match (or match nothing) later.
    non_finite_rows(embeddings.numpy(), f"embeddings of {root}", kept_paths)
    return FolderEmbeddings(embeddings, kept_paths, [labels[i] for i in kept], unreadable)
