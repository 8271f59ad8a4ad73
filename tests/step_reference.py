"""The stated forward of every step path, written as plain autograd, for the step tests.

Each function runs the forward that ``facenet.training.step`` says a path computes (several ranks as
one process forwarding each rank's part separately), the loss, and ``backward()``. Nothing
here uses the package's step code: the mining pass runs on a deep copy of the model, so its
BatchNorm running statistics stay untouched without any helper.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from facenet.metric.miners import Triplets


class BNNet(nn.Module):
    """A small conv-BatchNorm embedding net (BatchNorm2d and BatchNorm1d), optional dropout."""

    def __init__(self, dim=8, num_classes=6, dropout=0.0):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(16, dim), nn.BatchNorm1d(dim))
        self.classifier = nn.Linear(dim, num_classes) if num_classes else None

    def forward(self, x, return_logits=False):
        z = self.head(self.backbone(x))
        embeddings = F.normalize(z, dim=1)
        return (embeddings, self.classifier(z)) if return_logits else embeddings


def make_batch(p=6, k=4, size=8, seed=0, dtype=torch.float64):
    """(P*K, 3, size, size) images and their labels, identities in consecutive groups."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(p * k, 3, size, size, generator=generator, dtype=dtype)
    return images, torch.arange(p).repeat_interleave(k)


def _forward(model, images, ce):
    if ce:
        return model(images, return_logits=True)
    return model(images), None


def _loss(loss_fn, embeddings, triplets, logits, labels, ce_weight, margin_softmax=None):
    """Triplet loss + ce_weight x the mean cross-entropy: plain, or ``margin_softmax``'s (a
    cosine classifier's ``loss``, (N,) losses)."""
    loss = loss_fn(embeddings, triplets)
    if ce_weight > 0:
        ce = F.cross_entropy if margin_softmax is None else margin_softmax
        loss = loss + ce_weight * ce(logits, labels).mean()
    return loss


def _chunks(part, size):
    """Consecutive chunks of ``size``; a last chunk of one image joins the one before."""
    pieces = list(part.split(size))
    if len(pieces) > 1 and pieces[-1].shape[0] == 1:
        pieces[-2:] = [torch.cat(pieces[-2:])]
    return pieces


def _unique(triplets):
    flat = torch.cat(list(triplets))
    unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    return unique, Triplets(*inverse.split(triplets.anchor.numel()))


def stated_backward(model, images, labels, path, miner, loss_fn, *, world=1, chunk=0, ce=0.0):
    """Autograd through the stated forward of ``path`` for ``world`` ranks; returns the loss."""
    parts = list(images.chunk(world))
    count = parts[0].shape[0]
    margin_softmax = getattr(getattr(model, "classifier", None), "loss", None)
    if path in ("one-pass", "chunked"):
        pieces = [piece for part in parts for piece in (_chunks(part, chunk) if chunk else [part])]
        outputs = [_forward(model, piece, ce > 0) for piece in pieces]
        embeddings = torch.cat([e for e, _ in outputs])  # (B, D)
        triplets = miner(embeddings.detach(), labels)
        used, _ = _unique(triplets)
        logits = torch.cat([lg for _, lg in outputs])[used] if ce > 0 else None
        loss = _loss(loss_fn, embeddings, triplets, logits, labels[used], ce, margin_softmax)
    else:  # two-pass: mining per rank on a copy; each rank's selected images a BN batch
        mining_model = copy.deepcopy(model)
        with torch.no_grad():
            mining = torch.cat([mining_model(part) for part in parts])
        triplets = miner(mining, labels)
        unique, local = _unique(triplets)
        outputs = []
        for rank, part in enumerate(parts):
            rows = unique[(unique >= rank * count) & (unique < (rank + 1) * count)] - rank * count
            if len(rows) == 1:  # BatchNorm needs two: the first other image joins, unused
                embeddings, logits = _forward(
                    model, part[[rows.item(), int(rows.item() == 0)]], ce > 0
                )
                outputs.append((embeddings[:1], None if logits is None else logits[:1]))
            elif len(rows) > 1:
                outputs.append(_forward(model, part[rows], ce > 0))
        embeddings = torch.cat([e for e, _ in outputs])  # (U, D)
        logits = torch.cat([lg for _, lg in outputs]) if ce > 0 else None
        loss = _loss(loss_fn, embeddings, local, logits, labels[unique], ce, margin_softmax)
    loss.backward()
    return loss.detach()


def reference_training(model, batches, path, miner, loss_fn, lr, **kwargs):
    """SGD steps through :func:`stated_backward`; the final state dict."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for images, labels in batches:
        stated_backward(model, images, labels, path, miner, loss_fn, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_relative_close(got, want, rel=1e-8, scale=None):
    """max |got - want| <= rel * scale (default: max |want|), for tensors or state dicts."""
    if isinstance(want, dict):
        for key in want:
            assert_relative_close(got[key], want[key], rel, None if scale is None else scale[key])
        return
    if not want.is_floating_point():
        assert torch.equal(got, want)
        return
    size = want.abs().max() if scale is None else scale.abs().max()
    error = (got - want).abs().max()
    assert error <= rel * size + 1e-300, f"error {error:.3e} > {rel} x {size:.3e}"
