"""GraphMemoryMeter and the other memory figures, checked against hand-computed byte counts."""

import threading

import numpy as np
import pytest
import torch
from torch import nn

from facenet.memory import (
    CUDA_ALLOCATED,
    CUDA_MAX_ALLOCATED,
    CUDA_MAX_RESERVED,
    CUDA_RESERVED,
    GraphMemoryMeter,
    current_rss_bytes,
    format_bytes,
    graph_bytes_by_variable,
    memory_figures,
    module_state_bytes,
    peak_rss_bytes,
    reset_cuda_peaks,
)

FLOAT = 4  # bytes per float32


def linear_relu(in_features=3, out_features=5):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU())


def tiny_conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)
    )


# --------------------------------------------------------------------------- counting


def test_linear_relu_counts_input_and_output():
    # Linear saves its input x (for the weight gradient); its weight is a parameter and not
    # counted. ReLU saves its output. Hand count: 4*3 + 4*5 floats.
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        y = model(x)
    assert meter.alive_bytes == (4 * 3 + 4 * 5) * FLOAT
    del y


def test_backward_frees_everything():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        y = model(x)
        assert meter.alive_bytes > 0
        y.sum().backward()
    assert meter.alive_bytes == 0
    assert meter.peak_bytes == (4 * 3 + 4 * 5) * FLOAT


def test_graph_held_by_variable_until_del_even_after_block():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        y = model(x)
    expected = (4 * 3 + 4 * 5) * FLOAT
    assert meter.alive_bytes == expected  # the with-block has ended; y still holds its graph
    z = y * 1  # a new reference to the same graph
    del y
    assert meter.alive_bytes == expected
    del z
    assert meter.alive_bytes == 0


def test_backward_after_block_releases():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        y = model(x)
    y.sum().backward()
    assert meter.alive_bytes == 0


def test_retain_graph_keeps_bytes_until_last_backward():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        loss = model(x).sum()
    loss.backward(retain_graph=True)
    assert meter.alive_bytes == (4 * 3 + 4 * 5) * FLOAT
    loss.backward()
    assert meter.alive_bytes == 0


def test_no_grad_and_inference_mode_save_nothing():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        with torch.no_grad():
            a = model(x)
        with torch.inference_mode():
            b = model(x)
    assert meter.alive_bytes == 0 and meter.peak_bytes == 0
    del a, b


def test_parameters_leaves_and_their_views_not_counted():
    weight = nn.Parameter(torch.randn(3, 5))
    leaf = torch.randn(7, requires_grad=True)
    meter = GraphMemoryMeter()
    with meter:
        a = weight.sin()  # saves the parameter itself
        b = weight.t().cos()  # saves a view of the parameter
        c = leaf.exp() * 0  # exp saves its output, a non-leaf: counted
        assert meter.alive_bytes == 7 * FLOAT
        d = (weight * 1).sin()  # sin saves weight * 1, a non-leaf copy: counted
    assert meter.alive_bytes == 7 * FLOAT + 3 * 5 * FLOAT
    del a, b, c, d
    assert meter.alive_bytes == 0


def test_exclude_module_buffers():
    # BatchNorm saves its running statistics for backward; they belong to the module.
    model, x = tiny_conv_net(), torch.randn(2, 3, 8, 8)
    counted, excluded = GraphMemoryMeter(), GraphMemoryMeter(exclude=model)
    with counted:
        y1 = model(x)
    with excluded:
        y2 = model(x)
    running_stats = 2 * 4 * FLOAT  # running_mean and running_var, 4 channels each
    assert counted.alive_bytes - excluded.alive_bytes == running_stats
    del y1, y2
    with pytest.raises(TypeError, match="exclude"):
        with GraphMemoryMeter(exclude=[1, 2]):
            pass


def test_storage_counted_once_and_whole():
    a = torch.randn(10, requires_grad=True)
    meter = GraphMemoryMeter()
    with meter:
        b = a * 2  # (10,) non-leaf, 40 bytes
        both = b.sin() + b.cos()  # sin and cos each save b: one storage
        assert meter.alive_bytes == 10 * FLOAT
        ends = b[:2] * b[8:]  # two 2-element views of b: still b's one 40-byte storage
        assert meter.alive_bytes == 10 * FLOAT
        square = b * b  # the same tensor saved twice
        assert meter.alive_bytes == 10 * FLOAT
    del both, ends, square
    assert meter.alive_bytes == 0


def test_peak_and_reset_peak():
    model = linear_relu()
    one = (4 * 3 + 4 * 5) * FLOAT
    meter = GraphMemoryMeter()
    with meter:
        y1 = model(torch.randn(4, 3))
        y2 = model(torch.randn(4, 3))
    assert meter.peak_bytes == 2 * one
    del y1
    assert meter.alive_bytes == one and meter.peak_bytes == 2 * one
    meter.reset_peak()
    assert meter.peak_bytes == meter.alive_bytes == one
    del y2
    assert meter.peak_bytes == one >= meter.alive_bytes == 0


def test_usable_across_steps_and_reentry():
    model = linear_relu()
    one = (4 * 3 + 4 * 5) * FLOAT
    meter = GraphMemoryMeter()
    for _ in range(3):
        with meter:
            model(torch.randn(4, 3)).sum().backward()
            assert meter.alive_bytes == 0
    with meter:
        with meter:  # nested entry is harmless
            y = model(torch.randn(4, 3))
        z = model(torch.randn(4, 3))
    assert meter.alive_bytes == 2 * one and meter.peak_bytes == 2 * one
    del y, z


def test_timeline_marks():
    model, x = linear_relu(), torch.randn(4, 3)
    meter = GraphMemoryMeter()
    with meter:
        meter.mark("start")
        y = model(x)
        meter.mark("forward")
        y.sum().backward()
        meter.mark("backward")
    assert [label for label, _ in meter.timeline] == ["start", "forward", "backward"]
    assert [b for _, b in meter.timeline] == [0, (4 * 3 + 4 * 5) * FLOAT, 0]
    assert meter.timeline[1].alive_bytes == meter.timeline[1][1]
    meter.clear_timeline()
    assert meter.timeline == []


# --------------------------------------------------------------------------- autograd unchanged


def _grads(model, x, create_graph=False):
    loss = model(x).pow(2).sum()
    return torch.autograd.grad(loss, list(model.parameters()), create_graph=create_graph)


def test_gradients_identical_with_meter():
    model, x = tiny_conv_net(), torch.randn(2, 3, 8, 8)
    plain = _grads(model, x)
    with GraphMemoryMeter():
        metered = _grads(model, x)
    for g_plain, g_metered in zip(plain, metered):
        torch.testing.assert_close(g_plain, g_metered, rtol=0, atol=0)


def test_double_backward_identical_with_meter():
    x = torch.randn(5, requires_grad=True)

    def second_derivative():
        (g,) = torch.autograd.grad((x * 1).exp().sin().sum(), x, create_graph=True)
        return torch.autograd.grad(g.sum(), x)[0]

    plain = second_derivative()
    meter = GraphMemoryMeter()
    with meter:
        metered = second_derivative()
    torch.testing.assert_close(plain, metered, rtol=0, atol=0)
    assert meter.alive_bytes == 0


def test_inplace_change_of_saved_tensor_still_raises():
    x = torch.randn(5, requires_grad=True)
    with GraphMemoryMeter():
        y = x.exp()  # saves its output
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        y.sum().backward()


def test_backward_in_other_threads_releases():
    model = linear_relu()
    meter = GraphMemoryMeter()
    with meter:
        losses = [model(torch.randn(4, 3)).sum() for _ in range(8)]
    assert meter.alive_bytes == 8 * (4 * 3 + 4 * 5) * FLOAT
    threads = [threading.Thread(target=loss.backward) for loss in losses]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    del losses, threads
    assert meter.alive_bytes == 0


def test_entered_from_several_threads():
    model = linear_relu()
    meter = GraphMemoryMeter()
    outputs, lock = [], threading.Lock()

    def build():
        with meter:
            for _ in range(5):
                y = model(torch.randn(4, 3))
                with lock:
                    outputs.append(y)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert meter.alive_bytes == 20 * (4 * 3 + 4 * 5) * FLOAT
    outputs.clear()
    assert meter.alive_bytes == 0


def test_brute_force_against_graph_walk_on_random_models():
    # The meter (hooks, counted as saved) against a walk of the finished graph (saved tensors
    # read back from the nodes): two independent routes to the same number.
    rng = np.random.default_rng(0)
    for _ in range(5):
        batch, width = int(rng.integers(1, 6)), int(rng.integers(2, 9))
        layers = [nn.Linear(3, width), nn.BatchNorm1d(width) if batch > 1 else nn.Identity()]
        layers += [nn.Tanh(), nn.Linear(width, 2), nn.Softplus()]
        model = nn.Sequential(*layers)
        meter = GraphMemoryMeter()
        with meter:
            y = model(torch.randn(batch, 3))
        assert meter.alive_bytes > 0
        assert graph_bytes_by_variable({"y": y}) == {"y": meter.alive_bytes}
        del y


def test_graph_bytes_by_variable():
    model, x = linear_relu(), torch.randn(4, 3)
    y = model(x)
    z = y.sum()
    sizes = graph_bytes_by_variable({"y": y, "z": z, "x": x, "n": 3})
    assert sizes == {"y": 128, "z": 128, "x": 0, "n": 0}  # z's sum saves no tensor
    z.backward()
    assert graph_bytes_by_variable({"y": y}) == {"y": 0}  # freed by backward


# --------------------------------------------------------------------------- other figures


def test_module_state_bytes():
    model = nn.Linear(3, 5)  # 15 + 5 parameters
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = module_state_bytes(model, optimizer)
    assert before == {
        "param_bytes": 20 * FLOAT,
        "grad_bytes": 0,
        "buffer_bytes": 0,
        "optimizer_state_bytes": 0,
    }
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()  # creates one momentum buffer per parameter
    after = module_state_bytes(model, optimizer)
    assert after["grad_bytes"] == 20 * FLOAT
    assert after["optimizer_state_bytes"] == 20 * FLOAT
    assert module_state_bytes(nn.BatchNorm1d(6))["buffer_bytes"] == 2 * 6 * FLOAT + 8


def test_rss_figures():
    import mmap

    before = current_rss_bytes()
    # Freshly mapped pages (not a heap block the allocator may have kept resident), touched.
    block = mmap.mmap(-1, 32 * 2**20)
    block.write(b"\x01" * (32 * 2**20))
    during = current_rss_bytes()
    assert during - before >= 24 * 2**20
    # The kernel updates its high-water mark lazily (per-thread counters are synced in batches).
    assert peak_rss_bytes() >= during - 4 * 2**20 > 0
    block.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the figures without CUDA")
def test_cuda_figures_empty_without_cuda():
    cuda = dict(rss=False, cuda_now=True)
    assert memory_figures(device="cuda", **cuda) == memory_figures(device="cpu", **cuda) == {}
    reset_cuda_peaks()  # a no-op, not an error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_figures_with_cuda():
    reset_cuda_peaks()
    before = memory_figures(device="cuda", rss=False, cuda_now=True)
    block = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    stats = memory_figures(device="cuda", rss=False, cuda_now=True)
    assert list(stats) == [CUDA_MAX_ALLOCATED, CUDA_MAX_RESERVED, CUDA_ALLOCATED, CUDA_RESERVED]
    assert stats[CUDA_ALLOCATED] >= before[CUDA_ALLOCATED] + 2**20
    assert stats[CUDA_MAX_ALLOCATED] >= stats[CUDA_ALLOCATED]
    assert memory_figures(device="cpu", rss=False, cuda_now=True) == {}
    assert list(memory_figures(device=0, rss=False)) == [CUDA_MAX_ALLOCATED, CUDA_MAX_RESERVED]
    del block


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (int(12.3 * 2**20), "12.3 MiB"),
        (3 * 2**30, "3.0 GiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text
