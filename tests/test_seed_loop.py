"""The faithful seed-loop baseline reproduces the seed's faults, measured on a tiny model."""

import math
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from benchmarks import seed_loop
from facenet.memory import GraphMemoryMeter, graph_bytes_by_variable

NUM_CLASSES = 3
OUT_LINE = "out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)"
D_N_LINE = "d_n = l2_dist.forward(out_a, out_n)"


class TinyEmbeddingNet(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Linear -> L2 normalise: (B, 3, 6, 6) -> (B, D)."""

    def __init__(self, embedding_dim=4):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4, embedding_dim),
        )

    def forward(self, x):
        return nn.functional.normalize(self.body(x), dim=1)


def make_model(seed=0):
    torch.manual_seed(seed)
    return seed_loop.SeedModel(TinyEmbeddingNet(), NUM_CLASSES)


def make_batch(batch_size=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = [torch.randn(batch_size, 3, 6, 6, generator=generator) for _ in range(3)]
    label_p = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    label_n = (label_p + 1) % NUM_CLASSES
    return (*images, label_p, label_n)


def reference_graph_bytes(model, batch):
    """Graph bytes of the three mining forwards alone, and with d_p and d_n, measured afresh."""
    data_a, data_p, data_n = batch[:3]
    meter = GraphMemoryMeter(exclude=model)
    with meter:
        out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)
        forwards = meter.alive_bytes
        d_p = seed_loop.l2_dist.forward(out_a, out_p)
        d_n = seed_loop.l2_dist.forward(out_a, out_n)
        with_distances = meter.alive_bytes
    del out_a, out_p, out_n, d_p, d_n
    return forwards, with_distances


# --------------------------------------------------------------------------- gradient


def test_triplet_loss_sends_no_gradient():
    model, batch = make_model(), make_batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the parameters as they are
    state = {}
    margin = 5.0  # unit embeddings: d(a,n) - d(a,p) <= 2 < margin, so every triplet is hard
    result = seed_loop.seed_train_step(model, optimizer, *batch, margin=margin, state=state)
    assert result["n_selected"] == 5 and result["triplet_loss"] > 0
    loop_grads = [p.grad.clone() for p in model.parameters()]

    # Cross-entropy alone on the selected images, as the loop computes it.
    selected = [state["selected_data_a"], state["selected_data_p"], state["selected_data_n"]]
    labels = torch.cat(
        [state["selected_label_p"], state["selected_label_p"], state["selected_label_n"]]
    )
    logits = torch.cat([model.forward_classifier(x) for x in selected])
    ce = nn.functional.cross_entropy(logits, labels)
    assert math.isclose(ce.item(), result["ce_loss"], rel_tol=1e-6)
    ce_grads = torch.autograd.grad(ce, list(model.parameters()))
    for loop_grad, ce_grad in zip(loop_grads, ce_grads):
        torch.testing.assert_close(loop_grad, ce_grad, rtol=1e-5, atol=1e-7)

    # The check can fail: a triplet loss on the graph would have changed the gradient.
    embeddings = [model(x) for x in selected]
    triplet = seed_loop.TripletMarginLoss(margin).forward(*embeddings)
    triplet_grads = torch.autograd.grad(triplet, list(model.model.parameters()))
    assert max(g.abs().max().item() for g in triplet_grads) > 1e-4


# --------------------------------------------------------------------------- retention


def test_graphs_survive_the_step_and_are_released_when_overwritten():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forwards, retained = reference_graph_bytes(model, make_batch(seed=9))
    meter, state = GraphMemoryMeter(exclude=model), {}
    with meter:
        seed_loop.seed_train_step(model, optimizer, *make_batch(seed=1), margin=0.5, state=state)
        after_first = meter.alive_bytes
        first_out_a = weakref.ref(state["out_a"])
        meter.clear_timeline()
        seed_loop.seed_train_step(
            model, optimizer, *make_batch(seed=2), margin=0.5, state=state, meter=meter
        )
    # What stays after a step is exactly the three mining forwards and the two distances.
    assert after_first == retained > 0
    assert meter.alive_bytes == retained
    timeline = dict(meter.timeline)
    # The new forwards run while the old graphs are still held: two steps' graphs at once...
    assert timeline[OUT_LINE] == retained + forwards
    assert meter.peak_bytes >= retained + forwards
    # ...and the old ones go only when d_n, the last variable reaching them, is overwritten.
    assert timeline[D_N_LINE] == retained
    assert first_out_a() is None
    held = graph_bytes_by_variable(state)
    assert all(held[name] > 0 for name in ("out_a", "out_p", "out_n", "d_p", "d_n"))
    assert held["loss"] == held["cls_a"] == 0  # backpropagated: freed


def test_no_hard_triplet_continues_with_graphs_held():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    _, retained = reference_graph_bytes(model, make_batch())
    meter, state = GraphMemoryMeter(exclude=model), {}
    with meter:
        result = seed_loop.seed_train_step(
            model, optimizer, *make_batch(), margin=-10.0, state=state, meter=meter
        )
    assert result["skipped"] and result["n_selected"] == 0 and math.isnan(result["total_loss"])
    assert meter.timeline[-1].label == "continue"
    assert meter.alive_bytes == retained > 0
    for old, new in zip(before, model.parameters()):
        assert torch.equal(old, new)


def test_batchnorm_statistics_updated_six_times_per_step():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    bn = model.model.body[1]
    seed_loop.seed_train_step(model, optimizer, *make_batch(), margin=5.0)
    assert bn.num_batches_tracked.item() == 6


def test_timeline_names_the_lines_that_allocate_and_free():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    meter = GraphMemoryMeter()
    with meter:
        seed_loop.seed_train_step(model, optimizer, *make_batch(), margin=5.0, meter=meter)
    labels = [entry.label for entry in meter.timeline]
    deltas = dict(zip(labels[1:], np.diff([entry.alive_bytes for entry in meter.timeline])))
    assert deltas[OUT_LINE] > 0
    assert deltas["cls_a = model.forward_classifier(selected_data_a)"] > 0
    assert deltas["loss.backward()"] < 0


# --------------------------------------------------------------------------- the epoch


def test_seed_epoch_holds_two_steps_at_peak_and_releases_at_return():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    forwards, retained = reference_graph_bytes(model, make_batch())
    batches = [make_batch(seed=s) for s in range(3)]
    meter = GraphMemoryMeter(exclude=model)
    with meter:
        out = seed_loop.seed_epoch(model, optimizer, batches, margin=5.0, meter=meter)
    assert meter.alive_bytes == 0  # the loop's variables died with the epoch
    assert meter.peak_bytes >= retained + forwards
    selected = sum(step["n_selected"] for step in out["steps"])
    assert selected == 15
    assert len(out["distances"]) == len(out["labels"]) == 2 * selected
    assert out["labels"].sum() == selected  # one positive pair per selected triplet

    state = {}
    with meter:
        seed_loop.seed_epoch(model, optimizer, batches, margin=5.0, state=state)
    assert meter.alive_bytes == retained  # the caller's dict keeps the last step's graphs
    state.clear()
    assert meter.alive_bytes == 0


# --------------------------------------------------------------------------- the helpers


def test_pairwise_distance_against_brute_force():
    generator = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(7, 5, generator=generator), torch.randn(7, 5, generator=generator)
    expected = torch.tensor(
        [math.sqrt(float(((a - b) ** 2).sum()) + 1e-4 / 5) for a, b in zip(x1, x2)]
    )
    torch.testing.assert_close(seed_loop.l2_dist.forward(x1, x2), expected)


def test_adjust_learning_rate_and_original_optimizer():
    model = make_model()
    optimizer = seed_loop.create_optimizer(model)  # Adagrad, lr 0.1, its own lr_decay 1e-4
    assert isinstance(optimizer, torch.optim.Adagrad)
    for _ in range(2):
        seed_loop.adjust_learning_rate(optimizer, lr_decay=0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / (1 + 2 * 0.5))
    with pytest.raises(ValueError, match="rmsprop"):
        seed_loop.create_optimizer(model, name="rmsprop")


def test_seed_model_needs_an_embedding_size():
    with pytest.raises(ValueError, match="embedding_dim"):
        seed_loop.SeedModel(nn.Flatten(), NUM_CLASSES)
    with pytest.raises(ValueError, match="num_classes"):
        seed_loop.SeedModel(TinyEmbeddingNet(), 0)
    model = seed_loop.SeedModel(nn.Flatten(), NUM_CLASSES, embedding_dim=12)
    x = torch.randn(2, 3, 2, 2)
    assert model.forward_classifier(x).shape == (2, NUM_CLASSES)
    assert model.features.shape == (2, 12)  # the original kept its last output
