"""davidsandberg/facenet's Inception-ResNet-v1 (src/models/inception_resnet_v1.py) from its
TensorFlow variables onto :class:`EmbeddingNet` ("inception_resnet_v1"): the name
correspondence is facenet-pytorch's (models/utils/tensorflow2pytorch.py at 0093a5a9f0), whose
module names are ours. A convolution's BatchNorm comes as its variables (``BatchNorm/beta``,
``moving_mean``, ``moving_variance``: sandberg's batch norms have no scale) or folded into the
kernel by TensorFlow's graph tools (a scaled kernel plus ``Conv2D_bn_offset``); a release
graph's training branches (tf.cond on ``phase_train``) are left out.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from facenet.models.embedding import EmbeddingNet
from facenet.wings.publishers.inception_resnet_v1 import BN_EPS, ResidualBlock
from facenet.wings.publishers.tf_graph import Node, live_nodes

ROOT = "InceptionResnetV1"
OUTPUT, PHASE_TRAIN = "embeddings", "phase_train"  # sandberg's train_softmax.py names
# Non-parameter constants a frozen graph may hold: tf.nn.l2_normalize's epsilon.
GRAPH_EXTRAS = ("embeddings/Maximum/y",)
MIN_INPUT, MAX_INPUT = 75, 1024  # px a converted graph may declare (sandberg's take 160)
_BOTTLENECK = "Bottleneck/weights"
_LINEAR = "embedding.linear.weight"
_BLOCKS = {
    "repeat_1": "Repeat/block35_",
    "repeat_2": "Repeat_1/block17_",
    "repeat_3": "Repeat_2/block8_",
}


class MappingError(ValueError):
    """The variables are not those of this network; the message names the first culprit."""


def tf_scope(name: str, conv: nn.Conv2d) -> str:
    """sandberg's variable scope of our backbone convolution ``name`` ("repeat_1.3.branch1.0.conv"
    -> "Repeat/block35_4/Branch_1/Conv2d_0a_1x1")."""
    head, *rest = name.removesuffix(".conv").split(".")
    kernel = "x".join(map(str, conv.kernel_size))
    if not rest:  # the stem: conv2d_1a -> Conv2d_1a_3x3
        return f"{head.capitalize()}_{kernel}"
    if head in _BLOCKS:
        head, rest = _BLOCKS[head] + str(int(rest[0]) + 1), rest[1:]
    else:  # mixed_6a, mixed_7a, block8
        head = head.capitalize()
    if rest == ["conv2d"]:  # a residual block's up-projection, with biases
        return f"{head}/Conv2d_1x1"
    branch, *index = rest
    if conv.stride[0] == 2:
        layer = f"Conv2d_1a_{kernel}"
    else:
        layer = f"Conv2d_0{'abc'[int(index[0])]}_{kernel}" if index else "Conv2d_1x1"
    return f"{head}/Branch_{branch.removeprefix('branch')}/{layer}"


class _Taker:
    """Variables taken by name (``used``), their shapes checked against ours."""

    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors, self.used = tensors, set()

    def has(self, name: str) -> bool:
        return f"{ROOT}/{name}" in self.tensors

    def __call__(self, name: str, like: torch.Tensor, perm=None) -> torch.Tensor:
        """Variable ``ROOT/name`` as a tensor of ``like``'s shape, its axes in ``perm``'s order."""
        full = f"{ROOT}/{name}"
        if full not in self.tensors:
            raise MappingError(f"no variable {full!r}: not sandberg's Inception-ResNet-v1")
        array = np.asarray(self.tensors[full], np.float32)
        expected = tuple(like.shape[i] for i in np.argsort(perm)) if perm else tuple(like.shape)
        if array.shape != expected:
            raise MappingError(f"{full!r} has shape {array.shape}; expected {expected}")
        if not np.isfinite(array).all():  # written, its own loader would refuse the file
            raise MappingError(f"{full!r} holds NaN or infinite values")
        self.used.add(full)
        return torch.from_numpy(np.array(array.transpose(perm) if perm else array, order="C"))


def _bn(take: _Taker, scope: str, prefix: str, like: torch.Tensor) -> dict:
    """The BatchNorm variables ``{scope}/BatchNorm/*`` onto our BatchNorm ``prefix`` (``like``:
    its bias): sandberg's have no scale, which a frozen graph holds as ones (``Const``)."""
    gamma = f"{scope}/BatchNorm/Const"
    return {
        f"{prefix}.weight": take(gamma, like) if take.has(gamma) else torch.ones(like.shape),
        f"{prefix}.bias": take(f"{scope}/BatchNorm/beta", like),
        f"{prefix}.running_mean": take(f"{scope}/BatchNorm/moving_mean", like),
        f"{prefix}.running_var": take(f"{scope}/BatchNorm/moving_variance", like),
        f"{prefix}.num_batches_tracked": torch.tensor(0),
    }


def _conv_bn(take: _Taker, scope: str, prefix: str, like: torch.Tensor) -> dict:
    """The BatchNorm after the convolution ``scope``, as variables or folded."""
    offset = f"{scope}/Conv2D_bn_offset"
    if not take.has(offset):
        return _bn(take, scope, prefix, like)
    # Folded: the kernel already holds gamma / sqrt(var + eps), so this BatchNorm only adds the
    # offset; var = 1 - eps makes float32(var + eps) exactly 1, an exact identity.
    return {
        f"{prefix}.weight": torch.ones(like.shape),
        f"{prefix}.bias": take(offset, like),
        f"{prefix}.running_mean": torch.zeros(like.shape),
        f"{prefix}.running_var": torch.full(like.shape, 1 - BN_EPS),
        f"{prefix}.num_batches_tracked": torch.tensor(0),
    }


def _check_scales(take: _Taker, backbone: nn.Module) -> None:
    """A frozen graph's residual scales (``mul/x``) must be ours."""
    for name, block in backbone.named_modules():
        if not isinstance(block, ResidualBlock):
            continue
        scope = tf_scope(f"{name}.conv2d", block.conv2d).removesuffix("/Conv2d_1x1")
        if take.has(f"{scope}/mul/x"):
            value = float(take(f"{scope}/mul/x", torch.tensor(0.0)))
            if value != np.float32(block.scale):
                raise MappingError(f"'{ROOT}/{scope}/mul/x' is {value:g}; ours is {block.scale}")


def sandberg_state_dict(tensors: Mapping[str, np.ndarray]) -> tuple[dict, set[str]]:
    """``EmbeddingNet("inception_resnet_v1", D)``'s state dict from sandberg's variables (D:
    the bottleneck's width) and the names used; MappingError names the first missing or
    wrongly shaped variable. Kernels HWIO -> OIHW, the bottleneck (F, D) -> (D, F)."""
    weights = np.asarray(tensors.get(f"{ROOT}/{_BOTTLENECK}", np.zeros(0)))
    if weights.ndim != 2 or not 1 <= weights.shape[1] <= 65536:
        raise MappingError(f"no variable '{ROOT}/{_BOTTLENECK}' (F, D): not sandberg's network")
    with torch.device("meta"):  # names and shapes only: nothing allocated
        net = EmbeddingNet("inception_resnet_v1", int(weights.shape[1]))
    state, take, out = net.state_dict(), _Taker(tensors), {}
    for name, conv in net.backbone.named_modules():
        if not isinstance(conv, nn.Conv2d):
            continue
        scope, key = tf_scope(name, conv), f"backbone.{name}"
        out[f"{key}.weight"] = take(f"{scope}/weights", state[f"{key}.weight"], (3, 2, 0, 1))
        if conv.bias is not None:
            out[f"{key}.bias"] = take(f"{scope}/biases", state[f"{key}.bias"])
        else:
            bn = key.removesuffix(".conv") + ".bn"
            out.update(_conv_bn(take, scope, bn, state[f"{bn}.bias"]))
    out[_LINEAR] = take(_BOTTLENECK, state[_LINEAR], (1, 0))
    out.update(_bn(take, "Bottleneck", "embedding.bn", state["embedding.bn.bias"]))
    _check_scales(take, net.backbone)
    return out, take.used


def _check_batch_norms(nodes: Mapping[str, Node], live: set) -> None:
    """The live FusedBatchNorms (the bottleneck's, and the convolutions' when not folded) must
    use the moving statistics and our epsilon."""
    for name, node in nodes.items():
        if name not in live or not node.op.startswith("FusedBatchNorm"):
            continue
        if node.attrs.get("is_training", True):  # TensorFlow's default
            raise MappingError(f"{name!r} normalises with the batch's statistics: a training graph")
        if node.attrs.get("epsilon") != np.float32(BN_EPS):
            raise MappingError(
                f"{name!r} has epsilon {node.attrs.get('epsilon')}; ours is {BN_EPS}"
            )


def graph_state_dict(nodes: Mapping[str, Node]) -> tuple[dict, int, int]:
    """:func:`sandberg_state_dict` of the float constants TensorFlow runs to compute
    ``embeddings`` with ``phase_train`` False, every one of them used (l2_normalize's epsilon
    aside); the input size a 4-d placeholder declares (else 160; MappingError outside
    ``MIN_INPUT..MAX_INPUT``); and the number of constants
    ignored on dead branches (sandberg's release graphs keep each batch norm's and dropout's
    training branch as a tf.cond on ``phase_train``)."""
    if OUTPUT not in nodes:
        raise MappingError(f"no node {OUTPUT!r}: not sandberg's Inception-ResNet-v1")
    ancestors, live = live_nodes(dict(nodes), OUTPUT, {PHASE_TRAIN: False})
    floats = [
        name
        for name, node in nodes.items()
        if node.op == "Const" and getattr(node.attrs.get("value"), "dtype", None) == np.float32
    ]
    _check_batch_norms(nodes, live)
    state, used = sandberg_state_dict({n: nodes[n].attrs["value"] for n in floats if n in live})
    ignored = (ancestors - live).intersection(floats)
    unused = [n for n in floats if n not in used and n not in ignored and n not in GRAPH_EXTRAS]
    if unused:
        raise MappingError(
            f"{len(unused)} constant(s) sandberg's Inception-ResNet-v1 does not have, such as "
            f"{unused[0]!r}"
        )
    shapes = [n.attrs.get("shape") for n in nodes.values() if n.op == "Placeholder"]
    dims = [s for s in shapes if isinstance(s, tuple) and len(s) == 4]
    size = dims[0][1] if len(dims) == 1 and dims[0][1] == dims[0][2] else -1
    if size != -1 and not MIN_INPUT <= size <= MAX_INPUT:
        raise MappingError(
            f"the input placeholder declares {size} x {size} px; expected {MIN_INPUT} to "
            f"{MAX_INPUT} (Inception-ResNet-v1's smallest input, and a bound on one image's "
            "activations: 4096 px needs over 6 GB)"
        )
    return state, 160 if size == -1 else size, len(ignored)
