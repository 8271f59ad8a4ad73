"""Embedding images in eval mode without autograd: a pairs list (sharded over ranks, each
unique image once) or any iterable of image batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from facenet.data.images import build_transform, read_image
from facenet.distributed import agree_on_error, gather_variable_rows, get_rank, get_world_size
from facenet.evaluation.presets import CLASSIC, FEATURES, VerifySettings
from facenet.sizes import ImageSize


def _gather_shards(local: torch.Tensor, total: int, world: int) -> torch.Tensor:
    """Embeddings sharded round-robin over ranks, back in input order: (U, D)."""
    shards = gather_variable_rows(local)
    out = torch.empty((total, shards[0].shape[1]), dtype=local.dtype)
    for rank, shard in enumerate(shards):
        out[rank::world] = shard.cpu()
    return out


class PathImages(torch.utils.data.Dataset):
    """The transformed images of a list of paths."""

    def __init__(self, paths, transform):
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(read_image(self.paths[index]))


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


def _prepared(batches, flip: bool):
    """``(images, mirror images or None)`` of each (b, C, H, W) batch, the next one decoded
    and mirrored in a thread while the model runs on this one (decoding and the image
    transform release the GIL)."""
    iterator = iter(batches)

    def read_next():
        images = next(iterator, None)
        return None if images is None else (images, images.flip(-1) if flip else None)

    with ThreadPoolExecutor(1, thread_name_prefix="facenet-batches") as reader:
        ahead = reader.submit(read_next)
        while (batch := ahead.result()) is not None:
            ahead = reader.submit(read_next)
            yield batch


def _embed(model: nn.Module, images, mirrored, device, features: str) -> torch.Tensor:
    """(b, D) float32 CPU embeddings of a batch, (b, 2D) with its mirror images'."""
    embeddings = _forward(model, images.to(device), features)  # (b, D)
    if mirrored is not None:  # (b, 2D)
        flipped = _forward(model, mirrored.to(device), features)
        embeddings = torch.cat([embeddings, flipped], dim=1)
    return embeddings.float().cpu()


def embed_batches(
    model: nn.Module,
    batches,
    device,
    flip: bool,
    features: str = "unit",
    max_images: int | None = None,
) -> torch.Tensor:
    """(N, D) float32 embeddings on the CPU, (N, 2D) with ``flip`` (each image's, then its
    mirror's), of the images of every (b, C, H, W) batch, in eval mode; (0, 0) for none.

    An image and its mirror image go through separate forwards of the same b images: one
    forward of both (2b) would hold twice the activations, and a network's output for an image
    depends on its batch in the last bits (oneDNN's blocking: 4e-8 measured), which would move
    the evaluation's figures. With ``max_images`` (at least N) the embeddings are written into
    one tensor allocated at the first batch: a small block kept per batch would lie among the
    next forwards' freed buffers and split them (+275 MB of peak RSS over 10 forwards of
    Inception-ResNet-v1 on 128 images at 160 px)."""
    if features not in FEATURES:
        raise ValueError(f"features={features!r}: expected one of {FEATURES}")
    was_training = model.training
    model.eval()
    chunks, out, end = [], None, 0
    try:
        with torch.inference_mode():
            for images, mirrored in _prepared(batches, flip):
                batch = _embed(model, images, mirrored, device, features)  # (b, D)
                if max_images is None:
                    chunks.append(batch)
                    continue
                if out is None:
                    out = torch.empty((max_images, batch.shape[1]))  # (max_images, D)
                out[end : end + len(batch)] = batch
                end += len(batch)
    finally:
        model.train(was_training)
    if out is not None:
        return out[:end]
    return torch.cat(chunks) if chunks else torch.zeros(0, 0)


def embed_pair_list(
    model: nn.Module,
    pair_list,
    image_size: ImageSize,
    settings: VerifySettings = CLASSIC,
    normalize: str = "fixed",
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(emb1, emb2)``, (N, D) float32 on the CPU ((N, 2D) with ``settings.flip``), of both
    sides of a ``PairList``, each unique image embedded once; image size S or (H, W)."""
    paths, index1, index2 = pair_list.unique_paths()  # index: (N,) int64 into paths
    transform = build_transform(image_size, False, normalize, preprocess=settings.preprocess)
    # rank r embeds images r, r + W, ...; the shards are gathered unpadded and interleaved back
    rank, world = get_rank(), get_world_size()
    loader = torch.utils.data.DataLoader(
        PathImages(paths[rank::world], transform),
        batch_size=settings.batch_size,
        num_workers=settings.num_workers,
    )
    try:
        local = embed_batches(
            model, loader, device, settings.flip, settings.features, len(loader.dataset)
        )
        error = None
    except Exception as err:  # e.g. an unreadable image in this rank's shard
        local, error = None, err
    agree_on_error(error)  # a rank that failed does not leave the others in the gather
    embeddings = _gather_shards(local, len(paths), world)  # (U, D)
    return embeddings[torch.as_tensor(index1)], embeddings[torch.as_tensor(index2)]
