"""The loops people pick instead of ours, re-implemented from reading their code (ours, not
pasted), as setups of ``benchmarks.bench_real_faces``: ``pml`` (pytorch-metric-learning's
documented recipe, run with the library itself), ``sandberg`` (davidsandberg/facenet's
``train_tripletloss.py``) and ``tamerthamoqa`` (facenet-pytorch-glint360k's
``train_triplet_loss.py``). Each trains the bench's network from the same initial weights with
the bench's optimizer and learning-rate schedule (the peers choose theirs by flag: their
defaults are named below) on the bench's decoded, cropped and flipped images.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from pytorch_metric_learning import distances, losses, miners, reducers, samplers
from torch.utils.data import BatchSampler

from facenet.data.batches import collate_batches, standardize
from facenet.data.loading import make_loader
from facenet.errors import ConfigError
from facenet.models.embedding import build_model
from facenet.training.build import build_data
from facenet.training.optim import build_optimizer


@dataclass(frozen=True)
class PeerSettings:
    """The peers' knobs, at each peer's default (``--peer KEY=VALUE`` changes one)."""

    margin: float = 0.2  # all three: TripletMarginLoss(margin=0.2), --alpha 0.2, --margin 0.2
    pml_m: int = 4  # MPerClassSampler's m; a batch is data.p x data.k images
    people_per_batch: int = 45  # sandberg: --people_per_batch
    images_per_person: int = 40  # sandberg: --images_per_person
    sandberg_batch: int = 90  # sandberg: --batch_size, images (30 triplets) a training batch
    identities_per_batch: int = 32  # tamerthamoqa: --num_human_identities_per_batch
    triplets_per_batch: int = 544  # tamerthamoqa: --batch_size
    semihard: bool = False  # tamerthamoqa: --use_semihard_negatives (default: hard)


def peer_setting(text: str) -> tuple[str, object]:
    """An argparse ``type``: ``KEY=VALUE`` of :class:`PeerSettings`, the value checked."""
    key, _, value = text.partition("=")
    kinds = {f.name: f.type for f in dataclasses.fields(PeerSettings)}
    if key not in kinds:
        raise argparse.ArgumentTypeError(f"{text}: KEY=VALUE, KEY one of {', '.join(kinds)}")
    try:
        if kinds[key] == "bool":
            parsed = {"true": True, "false": False}[value.lower()]
        else:
            parsed = (int if kinds[key] == "int" else float)(value)
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text}: not a {kinds[key]}") from None
    if kinds[key] != "bool" and not (math.isfinite(parsed) and parsed > 0):
        raise argparse.ArgumentTypeError(f"{text}: must be finite and positive")
    return key, parsed


def _budget_data(loader, set_epoch=lambda epoch: None) -> SimpleNamespace:
    """What ``train_for_budget`` iterates: ``loader`` once per epoch, ``set_epoch`` before."""
    return SimpleNamespace(loader=loader, sampler=SimpleNamespace(set_epoch=set_epoch))


class _Each:
    """An iterable calling ``make()`` for each pass: batches that depend on the model."""

    def __init__(self, make: Callable[[], Iterator]):
        self.make = make

    def __iter__(self):
        return self.make()


def _images(folder, indices, normalize: str) -> torch.Tensor:
    """(B, 3, S_h, S_w) network input of ``folder``'s images at ``indices``, each cropped and
    flipped afresh (torch's generator)."""
    images, _ = collate_batches([folder[int(i)] for i in indices])
    return standardize(images, normalize)


def _network(cfg):
    """The bench's network without a classifier (the peers train triplets only) and its
    optimizer; the caller has seeded torch."""
    model = build_model(cfg.model, None, cfg.data.image_size)
    return model, build_optimizer(model.parameters(), cfg.optim)


def _folder(cfg, run_dir):
    """The training folder built anew: its decoded-image cache starts empty, as ours does
    (the held-out identities are read back from ``run_dir``)."""
    loader = build_data(cfg, run_dir).loader
    return getattr(loader.dataset, "dataset", loader.dataset)  # under SeededSamples


def _classes(folder) -> list:
    """Each identity's image indices into ``folder``, by label."""
    labels = np.asarray(folder.targets)
    return [np.flatnonzero(labels == c) for c in range(len(folder.classes))]


# --------------------------------------------------------------------------- pml


def setup_pml(cfg, data, run_dir, peer: PeerSettings) -> tuple:
    """pytorch-metric-learning 2.9.0's documented recipe: KevinMusgrave/pytorch-metric-learning
    examples/notebooks/TripletMarginLossMNIST.ipynb (commit 216a792c): CosineSimilarity,
    ``TripletMarginMiner(0.2, type_of_triplets="semihard")``, ``TripletMarginLoss(0.2)`` with
    ``ThresholdReducer(low=0)``, the notebook's loop (zero_grad, forward, mine, loss, backward,
    step; it uses Adam at 0.01), on batches drawn by the library's ``MPerClassSampler`` (m
    images an identity, so that every batch holds positives) instead of a shuffle."""
    folder, batch = _folder(cfg, run_dir), cfg.data.p * cfg.data.k
    try:
        sampler = samplers.MPerClassSampler(folder.targets, peer.pml_m, batch, len(folder))
    except AssertionError as err:
        raise ConfigError(f"--peer pml_m={peer.pml_m}, data.p x data.k={batch}: {err}") from None
    epoch = SimpleNamespace(epoch=0)  # the crops' seeds follow it
    batches = BatchSampler(sampler, batch, drop_last=True)
    loader = make_loader(folder, batches, 0, False, cfg.train.seed, epoch_of=epoch)
    distance = distances.CosineSimilarity()
    miner = miners.TripletMarginMiner(peer.margin, distance=distance, type_of_triplets="semihard")
    reducer = reducers.ThresholdReducer(low=0)
    loss_func = losses.TripletMarginLoss(peer.margin, distance=distance, reducer=reducer)
    model, optimizer = _network(cfg)

    def step(batch) -> tuple[float | None, int]:
        images, labels = batch
        optimizer.zero_grad()
        embeddings = model(standardize(images, cfg.data.normalize))  # (B, D)
        loss = loss_func(embeddings, labels, miner(embeddings, labels))
        loss.backward()
        optimizer.step()
        return loss.item(), images.shape[0]

    model.train()
    set_epoch = lambda n: setattr(epoch, "epoch", n)  # noqa: E731
    return model, optimizer, step, _budget_data(loader, set_epoch), dict


# --------------------------------------------------------------------------- sandberg
# davidsandberg/facenet src/train_tripletloss.py, commit 096ed770f163957c1e56efa7feeb194773920f6e


def sample_people(classes: list, people: int, per_person: int, rng) -> tuple[list, list]:
    """His ``sample_people``: identities in a shuffled order, up to ``per_person`` shuffled
    images of each, until ``people x per_person`` images; (image indices, count per identity).
    The list can hold more identities than ``people`` (those with fewer images)."""
    wanted, order = people * per_person, np.arange(len(classes))
    rng.shuffle(order)
    images, counts = [], []
    for label in order:
        if len(images) >= wanted:
            break
        chosen = np.arange(len(classes[label]))
        rng.shuffle(chosen)
        chosen = chosen[: min(len(chosen), per_person, wanted - len(images))]
        images += [classes[label][i] for i in chosen]
        counts.append(len(chosen))
    return images, counts


def select_triplets(embeddings: np.ndarray, counts: list, people: int, alpha: float, rng):
    """His ``select_triplets`` on (N, D) embeddings grouped by identity (``counts``): for each
    anchor-positive pair of the first ``people`` identities, one negative drawn at random among
    all with ``neg_dist_sqr - pos_dist_sqr < alpha`` (VGG Face's rule: negatives closer than
    the positive included), none when none qualifies; the list shuffled. (a, p, n) rows."""
    triplets, start = [], 0
    for i in range(people):
        n_images = int(counts[i])
        for j in range(1, n_images):
            a = start + j - 1
            neg_sqr = np.sum(np.square(embeddings[a] - embeddings), 1)  # (N,)
            neg_sqr[start : start + n_images] = np.nan  # his identity's images never qualify
            for p in range(start + j, start + n_images):
                pos_sqr = np.sum(np.square(embeddings[a] - embeddings[p]))
                negatives = np.where(neg_sqr - pos_sqr < alpha)[0]
                if negatives.shape[0] > 0:
                    triplets.append((a, p, negatives[rng.randint(negatives.shape[0])]))
        start += n_images
    rng.shuffle(triplets)
    return triplets


def sandberg_loss(embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """His ``facenet.triplet_loss`` on (3T, D) rows a, p, n, a, p, n, ...: the mean over the T
    triplets of ``max(|a - p|^2 - |a - n|^2 + alpha, 0)``."""
    a, p, n = embeddings.reshape(-1, 3, embeddings.shape[1]).unbind(1)  # (T, D) each
    basic = (a - p).square().sum(1) - (a - n).square().sum(1) + alpha
    return basic.clamp(min=0.0).mean()


def _sandberg_rounds(cfg, folder, classes, model, peer: PeerSettings, rng, pending) -> Iterator:
    """One round of his ``train()``'s loop: people sampled, their embeddings computed in
    training mode without gradients (as his TensorFlow graph ran them: batch statistics),
    triplets selected; then batches of his ``batch_size`` images of the triplets' images,
    loaded afresh. ``pending[0]`` counts the images embedded."""
    size, normalize = peer.sandberg_batch, cfg.data.normalize
    indices, counts = sample_people(classes, peer.people_per_batch, peer.images_per_person, rng)
    with torch.no_grad():
        chunks = [indices[i : i + size] for i in range(0, len(indices), size)]
        embeddings = torch.cat([model(_images(folder, c, normalize)) for c in chunks]).numpy()
    pending[0] += len(indices)
    chosen = select_triplets(embeddings, counts, peer.people_per_batch, peer.margin, rng)
    rows = [indices[i] for triplet in chosen for i in triplet]  # a, p, n, a, p, n, ...
    for i in range(0, len(rows), size):
        yield _images(folder, rows[i : i + size], normalize)


def setup_sandberg(cfg, data, run_dir, peer: PeerSettings) -> tuple:
    """His loop (defaults: 45 people x 40 images a round, batches of 90 images, alpha 0.2,
    Adagrad at 0.1, weight decay 0): each step one batch of triplets, his loss, the update.
    ``epochs_started`` counts his rounds (people sampled)."""
    folder = _folder(cfg, run_dir)
    if peer.sandberg_batch % 3:
        raise ConfigError(f"--peer sandberg_batch={peer.sandberg_batch}: not whole triplets")
    if peer.people_per_batch * peer.images_per_person > len(folder):
        raise ConfigError(
            f"--peer people_per_batch x images_per_person = "
            f"{peer.people_per_batch * peer.images_per_person}: more than the {len(folder)} "
            "training images (his sampling would run out of identities)"
        )
    model, optimizer = _network(cfg)
    rng, pending = np.random.RandomState(cfg.train.seed), [0]
    classes = _classes(folder)
    rounds = _Each(lambda: _sandberg_rounds(cfg, folder, classes, model, peer, rng, pending))

    def step(images) -> tuple[float | None, int]:
        loss = sandberg_loss(model(images), peer.margin)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        count, pending[0] = images.shape[0] + pending[0], 0
        return loss.item(), count

    model.train()
    return model, optimizer, step, _budget_data(rounds), dict


# --------------------------------------------------------------------------- tamerthamoqa
# tamerthamoqa/facenet-pytorch-glint360k, commit 38fc241a565cba5913751810d3eb7c20f309e211:
# datasets/TripletLossDataset.py (generate_triplets) and train_triplet_loss.py (main's loop).


def generate_triplet_batch(classes: list, identities: int, size: int, rng) -> list:
    """One ``training_iteration`` of its ``generate_triplets``: ``identities`` identities drawn
    without replacement, then ``size`` triplets among them, (anchor, positive, negative) image
    indices with the anchor's identity drawn again until it has 2 images."""
    labels = np.arange(len(classes))
    chosen = rng.choice(labels, size=identities, replace=False)
    if all(len(classes[c]) < 2 for c in chosen):  # its while-loop would never end
        raise ConfigError("--peer identities_per_batch: drew identities with 1 image each")
    batch = []
    for _ in range(size):
        pos, neg = rng.choice(chosen), rng.choice(chosen)
        while len(classes[pos]) < 2:
            pos = rng.choice(chosen)
        while pos == neg:
            neg = rng.choice(chosen)
        if len(classes[pos]) == 2:
            anc, positive = rng.choice(2, size=2, replace=False)
        else:
            anc = positive = rng.randint(0, len(classes[pos]))
            while anc == positive:
                positive = rng.randint(0, len(classes[pos]))
        negative = rng.randint(0, len(classes[neg]))
        batch.append((classes[pos][anc], classes[pos][positive], classes[neg][negative]))
    return batch


def tamerthamoqa_valid(pos: torch.Tensor, neg: torch.Tensor, margin: float, semihard: bool):
    """(B,) bool: its hard rule ``neg - pos < margin``, and with ``semihard`` also
    ``pos < neg``; distances (B,) each."""
    valid = neg - pos < margin
    return valid & (pos < neg) if semihard else valid


def setup_tamerthamoqa(cfg, data, run_dir, peer: PeerSettings) -> tuple:
    """Its loop (defaults: 544 triplets of 32 identities a batch, hard negatives, margin 0.2,
    Adagrad at 0.075 with weight decay 1e-5): the batch's a, p and n images in one forward,
    ``nn.PairwiseDistance`` (eps 1e-6 inside the norm), the triplets its rule keeps, the mean
    hinge on those (NaN when none: zero gradients, and the optimizer still steps, as there).
    Triplets are generated batch by batch: the same draws in the same order as its list of an
    epoch (5,000 batches, longer than any budget here)."""
    folder = _folder(cfg, run_dir)
    classes = _classes(folder)
    if peer.identities_per_batch > len(classes):
        raise ConfigError(
            f"--peer identities_per_batch={peer.identities_per_batch}: more than the "
            f"{len(classes)} training identities"
        )
    model, optimizer = _network(cfg)
    rng, normalize = np.random.RandomState(cfg.train.seed), cfg.data.normalize

    def batches() -> Iterator:
        while True:
            triplets = generate_triplet_batch(
                classes, peer.identities_per_batch, peer.triplets_per_batch, rng
            )
            yield _images(folder, np.asarray(triplets).T.reshape(-1), normalize)  # a.., p.., n..

    def step(images) -> tuple[float | None, int]:
        a, p, n = model(images).chunk(3)  # (B, D) each
        pos, neg = F.pairwise_distance(a, p), F.pairwise_distance(a, n)  # (B,) each
        keep = tamerthamoqa_valid(pos, neg, peer.margin, peer.semihard)
        loss = (peer.margin + pos[keep] - neg[keep]).clamp(min=0.0).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item(), images.shape[0]

    model.train()
    return model, optimizer, step, _budget_data(_Each(batches)), dict


PEERS = {"pml": setup_pml, "sandberg": setup_sandberg, "tamerthamoqa": setup_tamerthamoqa}
