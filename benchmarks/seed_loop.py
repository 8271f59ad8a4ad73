"""BASELINE - NOT AN EXAMPLE TO FOLLOW. The seed's training loop, ported faithfully.

The loop of ``train_triplet.py`` from liorshk/facenet_pytorch (quoted in SEED.md), bugs
included, so that the corrected trainer is measured against what it replaces. Only what no
longer runs on current PyTorch is changed, each change marked ``# MODERNISED``; logging, the
progress bar, the evaluation and the checkpoint are left out (they do not touch the graphs).
The loop's variables live in a ``state`` dict the caller passes from one step to the next, so
their survival into the next iteration, the heart of the seed's memory problem, is reproduced;
with a ``GraphMemoryMeter`` each ported line is followed by ``meter.mark(<original line>)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from facenet.memory import GraphMemoryMeter

# ------------------------------------------------------------------ the original's utilities


class PairwiseDistance:
    """The original ``utils.PairwiseDistance``: ``(sum |x1 - x2|^p + eps)^(1/p)`` per row.

    MODERNISED: an old-style ``autograd.Function`` whose ``forward`` was called directly (so it
    built an ordinary graph); now a plain class with the same ``forward``.
    """

    def __init__(self, p: float):
        self.norm = p

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """(B, D), (B, D) -> (B,) distances."""
        assert x1.size() == x2.size()
        eps = 1e-4 / x1.size(1)
        diff = torch.abs(x1 - x2)
        out = torch.pow(diff, self.norm).sum(dim=1)
        return torch.pow(out + eps, 1.0 / self.norm)


class TripletMarginLoss:
    """The original's triplet loss: ``mean(clamp(margin + d(a, p) - d(a, n), min=0))``.

    MODERNISED: an old-style ``autograd.Function`` called through ``forward``; now a plain class.
    """

    def __init__(self, margin: float):
        self.margin = margin
        self.pdist = PairwiseDistance(2)  # norm 2

    def forward(
        self, anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        """(B, D) x 3 -> scalar loss."""
        d_p = self.pdist.forward(anchor, positive)
        d_n = self.pdist.forward(anchor, negative)
        dist_hinge = torch.clamp(self.margin + d_p - d_n, min=0.0)
        loss = torch.mean(dist_hinge)
        return loss


l2_dist = PairwiseDistance(2)  # a module-level global, as in the original


class SeedModel(nn.Module):
    """The original ``FaceModel`` around any embedding network (images (B, C, H, W) to
    embeddings (B, D)): ``forward`` keeps its last output in ``self.features`` and
    ``forward_classifier`` runs ``forward`` again, as the original did. ``embedding_dim``: D,
    read from ``embedding_net.embedding_dim`` or ``.embed_dim`` if omitted."""

    def __init__(
        self, embedding_net: nn.Module, num_classes: int, embedding_dim: int | None = None
    ):
        super().__init__()
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(
                f"SeedModel: num_classes must be a positive integer, got {num_classes!r}"
            )
        dim = embedding_dim or getattr(embedding_net, "embedding_dim", None)
        dim = dim or getattr(embedding_net, "embed_dim", None)
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(
                f"SeedModel: cannot tell the embedding size of {type(embedding_net).__name__} "
                f"(no embedding_dim or embed_dim attribute); pass embedding_dim=D"
            )
        self.model = embedding_net
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> embeddings (B, D)."""
        self.features = self.model(x)
        return self.features

    def forward_classifier(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> logits (B, num_classes), through a new ``forward``."""
        features = self.forward(x)
        res = self.classifier(features)
        return res


def adjust_learning_rate(optimizer: torch.optim.Optimizer, lr_decay: float) -> None:
    """The original's per-step decay ``lr = lr0 / (1 + step * lr_decay)`` on every group
    (each gets a ``step`` counter, as in the original)."""
    for group in optimizer.param_groups:
        if "step" not in group:
            group["step"] = 0
            group["seed_lr"] = group["lr"]  # stands for the original's global args.lr
        group["step"] += 1

        group["lr"] = group["seed_lr"] / (1 + group["step"] * lr_decay)


def create_optimizer(
    model: nn.Module,
    name: str = "adagrad",
    lr: float = 0.1,
    lr_decay: float = 1e-4,
    wd: float = 0.0,
) -> torch.optim.Optimizer:
    """The original's optimizers and defaults (Adagrad, lr 0.1, its own lr_decay 1e-4, applied
    on top of :func:`adjust_learning_rate`'s)."""
    if name == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=lr, momentum=0.9, dampening=0.9, weight_decay=wd
        )
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
    if name == "adagrad":
        return torch.optim.Adagrad(model.parameters(), lr=lr, lr_decay=lr_decay, weight_decay=wd)
    raise ValueError(
        f"create_optimizer: name must be one of 'sgd', 'adam', 'adagrad'; got {name!r}"
    )


# --------------------------------------------------------------------------- the loop


class _LoopVariables:
    """Attribute access to the ``state`` dict, so the ported lines read like the original's."""

    def __init__(self, variables: dict[str, Any]):
        self.__dict__ = variables  # the caller's dict itself: what the loop binds, it keeps


def _choose_hard_triplets(v: _LoopVariables, model, margin: float, device, mark) -> None:
    """The loop body's lines from moving the batch to the device to ``hard_triplets``."""
    # MODERNISED: .cuda() -> .to(device); the Variable(...) line that followed is dropped.
    v.data_a, v.data_p, v.data_n = v.data_a.to(device), v.data_p.to(device), v.data_n.to(device)
    mark("data_a, data_p, data_n = data_a.cuda(), data_p.cuda(), data_n.cuda()")

    # compute output
    v.out_a, v.out_p, v.out_n = model(v.data_a), model(v.data_p), model(v.data_n)
    mark("out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)")

    # Choose the hard negatives
    v.d_p = l2_dist.forward(v.out_a, v.out_p)
    mark("d_p = l2_dist.forward(out_a, out_p)")
    v.d_n = l2_dist.forward(v.out_a, v.out_n)
    mark("d_n = l2_dist.forward(out_a, out_n)")
    v.all = (v.d_n - v.d_p < margin).cpu().data.numpy().flatten()
    mark("all = (d_n - d_p < args.margin).cpu().data.numpy().flatten()")
    v.hard_triplets = np.where(v.all == 1)
    mark("hard_triplets = np.where(all == 1)")


def _copy_selected(v: _LoopVariables, device, mark) -> None:
    """The chosen embeddings, images and labels, copied out through numpy."""
    # MODERNISED (the next six lines): Variable(...) dropped, .cuda() -> .to(device).
    v.out_selected_a = torch.from_numpy(v.out_a.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "out_selected_a = Variable(torch.from_numpy(out_a.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )
    v.out_selected_p = torch.from_numpy(v.out_p.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "out_selected_p = Variable(torch.from_numpy(out_p.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )
    v.out_selected_n = torch.from_numpy(v.out_n.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "out_selected_n = Variable(torch.from_numpy(out_n.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )

    v.selected_data_a = torch.from_numpy(v.data_a.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "selected_data_a = Variable(torch.from_numpy(data_a.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )
    v.selected_data_p = torch.from_numpy(v.data_p.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "selected_data_p = Variable(torch.from_numpy(data_p.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )
    v.selected_data_n = torch.from_numpy(v.data_n.cpu().data.numpy()[v.hard_triplets]).to(device)
    mark(
        "selected_data_n = Variable(torch.from_numpy(data_n.cpu().data.numpy()[hard_triplets]).cuda())"  # noqa: E501 (the original line)
    )

    v.selected_label_p = torch.from_numpy(v.label_p.cpu().numpy()[v.hard_triplets])
    mark("selected_label_p = torch.from_numpy(label_p.cpu().numpy()[hard_triplets])")
    v.selected_label_n = torch.from_numpy(v.label_n.cpu().numpy()[v.hard_triplets])
    mark("selected_label_n= torch.from_numpy(label_n.cpu().numpy()[hard_triplets])")


def _losses(v: _LoopVariables, model, margin: float, device, mark) -> None:
    """The triplet loss on the copies, the classifier's three forwards, the total loss."""
    v.triplet_loss = TripletMarginLoss(margin).forward(
        v.out_selected_a, v.out_selected_p, v.out_selected_n
    )
    mark(
        "triplet_loss = TripletMarginLoss(args.margin).forward(out_selected_a, out_selected_p, out_selected_n)"  # noqa: E501 (the original line)
    )

    v.cls_a = model.forward_classifier(v.selected_data_a)
    mark("cls_a = model.forward_classifier(selected_data_a)")
    v.cls_p = model.forward_classifier(v.selected_data_p)
    mark("cls_p = model.forward_classifier(selected_data_p)")
    v.cls_n = model.forward_classifier(v.selected_data_n)
    mark("cls_n = model.forward_classifier(selected_data_n)")

    v.criterion = nn.CrossEntropyLoss()
    v.predicted_labels = torch.cat([v.cls_a, v.cls_p, v.cls_n])
    mark("predicted_labels = torch.cat([cls_a,cls_p,cls_n])")
    # MODERNISED: Variable(...) dropped, .cuda() -> .to(device).
    v.true_labels = torch.cat(
        [
            v.selected_label_p.to(device),
            v.selected_label_p.to(device),
            v.selected_label_n.to(device),
        ]
    )
    mark(
        "true_labels = torch.cat([Variable(selected_label_p.cuda()),Variable(selected_label_p.cuda()),Variable(selected_label_n.cuda())])"  # noqa: E501 (the original line)
    )

    v.cross_entropy_loss = v.criterion(v.predicted_labels.to(device), v.true_labels.to(device))
    mark("cross_entropy_loss = criterion(predicted_labels.cuda(),true_labels.cuda())")

    v.loss = v.cross_entropy_loss + v.triplet_loss
    mark("loss = cross_entropy_loss + triplet_loss")


def _log(v: _LoopVariables, mark) -> dict[str, float]:
    """The loop body's logging and the epoch's distances and labels."""
    # log loss value. MODERNISED: .data[0] -> .item(); each is a device sync, as it was.
    losses = {
        "triplet_loss": v.triplet_loss.item(),
        "ce_loss": v.cross_entropy_loss.item(),
        "total_loss": v.loss.item(),
    }

    v.dists = l2_dist.forward(v.out_selected_a, v.out_selected_n)
    v.distances.append(v.dists.data.cpu().numpy())
    v.labels.append(np.zeros(v.dists.size(0)))

    v.dists = l2_dist.forward(v.out_selected_a, v.out_selected_p)
    v.distances.append(v.dists.data.cpu().numpy())
    v.labels.append(np.ones(v.dists.size(0)))
    mark("labels.append(np.ones(dists.size(0)))  # end of the loop body")
    return losses


def seed_train_step(
    model: SeedModel,
    optimizer: torch.optim.Optimizer,
    *batch: torch.Tensor,
    margin: float = 0.2,
    state: dict[str, Any] | None = None,
    meter: GraphMemoryMeter | None = None,
    lr_decay: float = 0.0,
) -> dict[str, Any]:
    """One iteration of the original loop's body on ``data_a, data_p, data_n, label_p,
    label_n`` (images (B, C, H, W), labels (B,)), faithfully, bugs included.

    Args:
        margin: the original's ``args.margin``: selection threshold and triplet-loss margin.
        state: the loop's variables, carried from one iteration to the next (pass the same dict
            every step to reproduce the original's retention); None: they die with the step.
        meter: its ``mark`` is called with the original source line after each ported line.
        lr_decay: the original's ``args.lr_decay`` for :func:`adjust_learning_rate`.

    Returns:
        ``triplet_loss``, ``ce_loss``, ``total_loss`` (floats, NaN when skipped), ``n_selected``
        and ``skipped`` (no triplet was hard: the original's ``continue``, no update).
    """
    state = {} if state is None else state
    v = _LoopVariables(state)
    mark = meter.mark if meter is not None else lambda label: None
    device = next(model.parameters()).device  # the port's stand-in for .cuda()
    if "distances" not in state:
        v.labels, v.distances = [], []  # the epoch's lists, created before the loop

    # The for-statement binds the new batch to the loop variables.
    v.data_a, v.data_p, v.data_n, v.label_p, v.label_n = batch
    mark("for batch_idx, (data_a, data_p, data_n,label_p,label_n) in pbar:")

    _choose_hard_triplets(v, model, margin, device, mark)
    if len(v.hard_triplets[0]) == 0:
        mark("continue")
        losses = dict.fromkeys(("triplet_loss", "ce_loss", "total_loss"), float("nan"))
        return {**losses, "n_selected": 0, "skipped": True}
    _copy_selected(v, device, mark)
    _losses(v, model, margin, device, mark)
    # compute gradient and update weights
    optimizer.zero_grad()
    v.loss.backward()
    mark("loss.backward()")
    optimizer.step()
    mark("optimizer.step()")

    # update the optimizer learning rate
    adjust_learning_rate(optimizer, lr_decay)

    return {**_log(v, mark), "n_selected": len(v.hard_triplets[0]), "skipped": False}


def seed_epoch(
    model: SeedModel,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, ...]],
    margin: float,
    meter: GraphMemoryMeter | None = None,
    *,
    state: dict[str, Any] | None = None,
    lr_decay: float = 0.0,
) -> dict[str, Any]:
    """The original ``train()`` up to its evaluation: ``model.train()`` and the loop.

    Args:
        model: a :class:`SeedModel`.
        optimizer: the optimizer.
        batches: iterable of ``(data_a, data_p, data_n, label_p, label_n)``.
        margin: the original's ``args.margin``.
        meter: a ``GraphMemoryMeter`` for the per-line timeline of every step; None for none.
        state: the loop's variables; pass a dict to inspect them afterwards (it keeps the last
            step's graphs alive while you hold it). If None they die when the epoch returns,
            as the original's locals did when ``train()`` returned.
        lr_decay: the original's ``args.lr_decay`` for :func:`adjust_learning_rate`.

    Returns:
        ``steps`` (one dict per batch, from :func:`seed_train_step`), and the epoch's
        ``distances`` and ``labels`` (numpy, one per selected pair: 0 for anchor-negative,
        1 for anchor-positive) that the original handed to its evaluation.
    """
    # switch to train mode
    model.train()

    state = {} if state is None else state
    v = _LoopVariables(state)
    v.labels, v.distances = [], []

    steps = [
        seed_train_step(
            model, optimizer, *batch, margin=margin, state=state, meter=meter, lr_decay=lr_decay
        )
        for batch in batches
    ]

    labels = np.array([sublabel for label in v.labels for sublabel in label])
    # MODERNISED: subdist[0] -> subdist (a distance is now a 0-d element, not a 1-element row).
    distances = np.array([subdist for dist in v.distances for subdist in dist])
    return {"steps": steps, "distances": distances, "labels": labels}
