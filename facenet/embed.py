"""Embedding images for evaluation, export and inference, outside the training step.

``embed_pair_list`` embeds both sides of a verification pairs list, each unique image once, in
eval mode without autograd; under several processes each rank embeds a shard and the shards
are gathered back into input order.
"""

from __future__ import annotations

import torch
from torch import nn

from facenet.data.images import build_transform, read_image
from facenet.distributed import gather_variable_rows, get_rank, get_world_size

__all__ = ["embed_pair_list"]


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


def embed_pair_list(
    model: nn.Module,
    pair_list,
    image_size: int,
    batch_size: int = 128,
    device: str | torch.device = "cpu",
    flip: bool = False,
    normalize: str = "fixed",
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed both sides of every pair, each unique image once, in eval mode without autograd.

    Args:
        model: the embedding network.
        pair_list: a ``PairList`` (``unique_paths()`` gives the images and the index of each side).
        image_size: the network's input size.
        batch_size: images per forward.
        device: where the network runs.
        flip: concatenate the embedding of each image with that of its horizontal flip
            (the classic option: the result is (N, 2D)).
        normalize: the pixel standardisation.
        num_workers: DataLoader workers decoding images.

    Returns:
        ``(emb1, emb2)``, each (N, D) or (N, 2D) float32 on the CPU.
    """
    paths, index1, index2 = pair_list.unique_paths()
    transform = build_transform(image_size, train=False, normalize=normalize)
    # Several ranks: rank r embeds images r, r + W, r + 2W, ...; the shards are gathered
    # without padding and interleaved back, so every image counts once.
    rank, world = get_rank(), get_world_size()
    loader = torch.utils.data.DataLoader(
        _PathDataset(paths[rank::world], transform), batch_size=batch_size, num_workers=num_workers
    )
    was_training = model.training
    model.eval()
    chunks = []
    try:
        with torch.inference_mode():
            for images in loader:
                images = images.to(device)
                embeddings = model(images)  # (b, D)
                if flip:
                    embeddings = torch.cat([embeddings, model(images.flip(-1))], dim=1)
                chunks.append(embeddings.float())
    finally:
        model.train(was_training)
    embeddings = _gather_shards(chunks, len(paths), world)  # (U, D) on the CPU
    index1 = torch.as_tensor(index1, dtype=torch.long)
    index2 = torch.as_tensor(index2, dtype=torch.long)
    return embeddings[index1], embeddings[index2]
