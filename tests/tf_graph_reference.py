"""A NumPy interpreter of a frozen TensorFlow graph's own operations, in float64, for parity.

Written from TensorFlow's op definitions (tensorflow/core/ops/nn_ops.cc, math_ops.cc,
array_ops.cc: NHWC tensors, HWIO kernels, "SAME" padding of ceil(in / stride) outputs with the
odd pixel after, pooling that averages over the window's valid pixels only) and independent of
the converter: it runs the graph's nodes as they are, folded BatchNorms, Mul/Add residuals and
l2_normalize's Square/Sum/Maximum/Rsqrt included. tf.cond's Switch and Merge follow
TensorFlow's dead-tensor rule (tensorflow/core/common_runtime/executor.cc, control_flow_ops.py):
only the branch its predicate picks runs; an op on a live path outside OPS is refused.
"""

from __future__ import annotations

import numpy as np


def _pads(size: int, k: int, stride: int, padding: str) -> tuple[int, int, int]:
    """(output size, pad before, pad after) of one spatial axis, TensorFlow's convention."""
    if padding == "VALID":
        return (size - k) // stride + 1, 0, 0
    out = -(-size // stride)
    total = max((out - 1) * stride + k - size, 0)
    return out, total // 2, total - total // 2


def _windows(x: np.ndarray, kh: int, kw: int, strides, padding: str, fill: float):
    """(N, OH, OW, kh, kw, C) windows of NHWC ``x``, padding filled with ``fill``."""
    (oh, top, bottom), (ow, left, right) = (
        _pads(x.shape[1], kh, strides[1], padding),
        _pads(x.shape[2], kw, strides[2], padding),
    )
    x = np.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)), constant_values=fill)
    rows = np.arange(oh)[:, None] * strides[1] + np.arange(kh)[None]  # (OH, kh)
    cols = np.arange(ow)[:, None] * strides[2] + np.arange(kw)[None]  # (OW, kw)
    return x[:, rows[:, None, :, None], cols[None, :, None, :], :]


def conv2d(x: np.ndarray, kernel: np.ndarray, attrs: dict) -> np.ndarray:
    """NHWC ``x`` (N, H, W, I) with an HWIO kernel (kh, kw, I, O) -> (N, OH, OW, O)."""
    assert attrs.get("data_format", "NHWC") == "NHWC"
    assert all(d == 1 for d in attrs.get("dilations", [1, 1, 1, 1]))
    kh, kw = kernel.shape[:2]
    patches = _windows(x, kh, kw, attrs["strides"], attrs["padding"], 0.0)
    return np.einsum("nhwabi,abio->nhwo", patches, kernel, optimize=True)


def pool(x: np.ndarray, attrs: dict, reduce) -> np.ndarray:
    """MaxPool / AvgPool over NaN-padded windows (the padding is left out of the reduction)."""
    _, kh, kw, _ = attrs["ksize"]
    return reduce(_windows(x, kh, kw, attrs["strides"], attrs["padding"], np.nan), axis=(3, 4))


def _batch_norm(x, scale, offset, mean, var, attrs):
    assert not attrs.get("is_training", True), "only inference BatchNorms"
    return (x - mean) / np.sqrt(var + attrs.get("epsilon", 1e-4)) * scale + offset, mean, var


def _concat(*args):
    *values, axis = args
    return np.concatenate(values, axis=int(axis))


OPS = {
    "Conv2D": lambda a, x, k: conv2d(x, k, a),
    "BiasAdd": lambda a, x, b: x + b,
    "Relu": lambda a, x: np.maximum(x, 0),
    "Add": lambda a, x, y: x + y,
    "AddV2": lambda a, x, y: x + y,
    "Mul": lambda a, x, y: x * y,
    "ConcatV2": lambda a, *args: _concat(*args),
    "MaxPool": lambda a, x: pool(x, a, np.nanmax),
    "AvgPool": lambda a, x: pool(x, a, np.nanmean),
    "Reshape": lambda a, x, shape: x.reshape([int(s) for s in shape]),
    "MatMul": lambda a, x, w: (
        (x.T if a.get("transpose_a") else x) @ (w.T if a.get("transpose_b") else w)
    ),
    "FusedBatchNorm": lambda a, *args: _batch_norm(*args, a),
    "FusedBatchNormV3": lambda a, *args: _batch_norm(*args[:5], a),
    "Square": lambda a, x: x * x,
    "Sum": lambda a, x, axes: x.sum(axis=tuple(np.atleast_1d(axes)), keepdims=a["keep_dims"]),
    "Maximum": lambda a, x, y: np.maximum(x, y),
    "Rsqrt": lambda a, x: 1 / np.sqrt(x),
    "Identity": lambda a, x: x,
}


DEAD = None  # a node none of whose outputs TensorFlow computes


def _input(text: str) -> tuple[str, int, bool]:
    """``name``, ``name:port`` or ``^name`` -> (name, port, is a control input)."""
    name, _, port = text.lstrip("^").partition(":")
    return name, int(port or 0), text.startswith("^")


def _run(node, args: list, control_dead: bool):
    """The node's outputs (a tuple), or DEAD."""
    if node.op == "Merge":  # (the first live input, its index)
        live = [(a, i) for i, a in enumerate(args) if a is not DEAD]
        return live[0] if live else DEAD
    if control_dead or any(a is DEAD for a in args):
        return DEAD
    if node.op == "Switch":  # (output_false, output_true)
        x, pred = args
        return (DEAD, x) if bool(pred) else (x, DEAD)
    if node.op == "Const":
        value = node.attrs["value"]
        return (value.astype(np.float64) if value.dtype.kind == "f" else value,)
    if node.op not in OPS:
        raise NotImplementedError(f"{node.name!r}: {node.op} on a live path")
    out = OPS[node.op](node.attrs, *args)
    return out if isinstance(out, tuple) else (out,)


def run_graph(nodes: dict, feeds: dict[str, np.ndarray], output: str) -> np.ndarray:
    """The value of node ``output``, every node it depends on (data and control inputs)
    evaluated once in topological order (float64 throughout; a boolean feed such as
    ``phase_train`` as it is)."""
    values = {}
    for name, value in feeds.items():
        value = np.asarray(value)
        values[name] = (value.astype(np.float64) if value.dtype.kind == "f" else value,)
    stack = [output]
    while stack:
        name = stack[-1]
        if name in values:
            stack.pop()
            continue
        refs = [_input(i) for i in nodes[name].inputs]
        pending = [ref[0] for ref in refs if ref[0] not in values]
        if pending:
            stack.extend(pending)
            continue
        args = [
            DEAD if values[n] is DEAD else values[n][port]
            for n, port, control in refs
            if not control
        ]
        control_dead = any(values[n] is DEAD for n, _, control in refs if control)
        values[name] = _run(nodes[name], args, control_dead)
        stack.pop()
    return values[output][0]
