"""Embedding images in eval mode without autograd, outside the training step.

``embed_pair_list`` embeds both sides of a verification pairs list, each unique image once;
under several processes each rank embeds a shard and the shards are gathered back into input
order. ``embed_dataset`` embeds any dataset of image tensors; ``embed_batches`` is the loop
both use (and ``facenet.inference.embed`` for folders).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from facenet.data.images import build_transform, read_image
from facenet.distributed import agree_on_error, gather_variable_rows, get_rank, get_world_size
from facenet.sizes import ImageSize

__all__ = ["FEATURES", "embed_batches", "embed_dataset", "embed_pair_list"]

# What is taken of the network: "unit" (its L2-normalised embedding) or "raw" (the embedding
# layer's output before normalisation, what Xiaoccer/MobileFaceNet_Pytorch's network returns).
FEATURES = ("unit", "raw")


def _gather_shards(chunks: list[torch.Tensor], total: int, world: int) -> torch.Tensor:
    """Reassemble embeddings sharded round-robin over ranks into input order (U, D)."""
    local = torch.cat(chunks) if chunks else torch.zeros(0)
    if world == 1:
        return local.cpu()
    shards = gather_variable_rows(local)
    out = torch.empty((total, shards[0].shape[1]), dtype=local.dtype)
    for rank, shard in enumerate(shards):
        out[rank::world] = shard.cpu()
    return out


class _PathDataset(torch.utils.data.Dataset):
    """Images by path, decoded and transformed for evaluation."""

    def __init__(self, paths, transform):
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(read_image(self.paths[index]))


def _check_features(features: str) -> None:
    if features not in FEATURES:
        raise ValueError(f"features={features!r}: expected one of {FEATURES}")


def _forward(model: nn.Module, images: torch.Tensor, features: str) -> torch.Tensor:
    """(b, D) unit embeddings, or with ``features="raw"`` the same layer before normalising."""
    if features == "unit":
        return model(images)
    if not (hasattr(model, "backbone") and hasattr(model, "embedding")):
        raise ValueError(
            f"features='raw' needs an EmbeddingNet (backbone + embedding head), "
            f"not {type(model).__name__}"
        )
    return model.embedding.prelogits(model.backbone(images))


def embed_batches(
    model: nn.Module, batches, device, flip: bool, features: str = "unit"
) -> list[torch.Tensor]:
    """Embeddings (b, D), or (b, 2D) with ``flip``, of every image batch, in eval mode.

    Args:
        model: the embedding network.
        batches: an iterable of image batches (b, C, H, W).
        device: where the network runs.
        flip: concatenate each embedding with that of the horizontally flipped image.
        features: "unit" (the network's output) or "raw" (before L2 normalisation).
    """
    _check_features(features)
    was_training = model.training
    model.eval()
    chunks = []
    try:
        with torch.inference_mode():
            for images in batches:
                images = images.to(device)
                embeddings = _forward(model, images, features)  # (b, D)
                if flip:  # the classic option: [emb(x), emb(flipped x)] -> (b, 2D)
                    flipped = _forward(model, images.flip(-1), features)
                    embeddings = torch.cat([embeddings, flipped], dim=1)
                chunks.append(embeddings.float().cpu())
    finally:
        model.train(was_training)
    return chunks


def embed_dataset(
    model: nn.Module,
    dataset,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    flip: bool = False,
    progress: bool = False,
    features: str = "unit",
) -> torch.Tensor:
    """Embed every image of a dataset of (3, S, S) tensors, in order, in one process.

    Args:
        model: the embedding network.
        dataset: ``dataset[i]`` is image i, already transformed.
        batch_size: images per forward.
        device: where the network runs.
        flip: concatenate each embedding with that of the horizontally flipped image.
        progress: show a progress bar (on stderr).
        features: "unit" or "raw" (:data:`FEATURES`).

    Returns:
        (N, D) or (N, 2D) float32 on the CPU.
    """
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size)
    batches = tqdm(loader, desc="embedding", unit="batch", disable=not progress, leave=False)
    chunks = embed_batches(model, batches, device, flip, features)
    return torch.cat(chunks) if chunks else torch.zeros(0, 0)


def embed_pair_list(
    model: nn.Module,
    pair_list,
    image_size: ImageSize,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    flip: bool = False,
    normalize: str = "fixed",
    num_workers: int = 0,
    preprocess: str = "resize",
    features: str = "unit",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed both sides of every pair, each unique image once, in eval mode without autograd.

    Args:
        model: the embedding network.
        pair_list: a ``PairList`` (``unique_paths()`` gives the images and the index of each side).
        image_size: the network's input: S or (H, W) (``facenet.sizes.image_hw``).
        batch_size: images per forward.
        device: where the network runs.
        flip: concatenate the embedding of each image with that of its horizontal flip
            (the classic option: the result is (N, 2D)).
        normalize: the pixel standardisation.
        num_workers: DataLoader workers decoding images.
        preprocess: "resize" (1.125 S, centre S) or "crop" (no resize, the centre S x S of an
            aligned crop, as the publishers evaluate); see ``build_transform``.
        features: "unit" (the network's unit embeddings) or "raw" (before L2 normalisation:
            Xiaoccer/MobileFaceNet_Pytorch concatenates an image's and its flip's raw outputs).

    Returns:
        ``(emb1, emb2)``, each (N, D) or (N, 2D) float32 on the CPU.
    """
    paths, index1, index2 = pair_list.unique_paths()
    transform = build_transform(image_size, False, normalize, preprocess=preprocess)
    # Several ranks: rank r embeds images r, r + W, r + 2W, ...; the shards are gathered
    # without padding and interleaved back, so every image counts once.
    rank, world = get_rank(), get_world_size()
    loader = torch.utils.data.DataLoader(
        _PathDataset(paths[rank::world], transform), batch_size=batch_size, num_workers=num_workers
    )
    try:
        chunks, error = embed_batches(model, loader, device, flip, features), None
    except Exception as err:  # e.g. an unreadable image in this rank's shard
        chunks, error = [], err
    # Every rank agrees before the gather: a rank that failed does not leave the others in it.
    agree_on_error(error)
    embeddings = _gather_shards(chunks, len(paths), world)  # (U, D) on the CPU
    index1 = torch.as_tensor(index1, dtype=torch.long)
    index2 = torch.as_tensor(index2, dtype=torch.long)
    return embeddings[index1], embeddings[index2]
