"""sandberg's frozen Inception-ResNet-v1 graph with random weights, serialized as a GraphDef,
and TensorFlow checkpoints (tensor bundles) of given variables.

Written from davidsandberg/facenet src/models/inception_resnet_v1.py (commit 05849dd04c,
scopes, layer order, SAME/VALID paddings, residual scales, the bottleneck) and from the frozen
20180408-102900 graph's node layout (BatchNorms folded into the kernels plus a
``Conv2D_bn_offset``; "variables": kept as FusedBatchNorm nodes), independently of the
converter. "release": what src/freeze_graph.py (at 096ed770f1) writes, from TF 1.x slim's
batch_norm (fused, updates_collections None), dropout and tf.cond: both branches of each cond
on ``phase_train``. Wire format: tensorflow/core/framework/*.proto; a bundle's index is an
uncompressed LevelDB table (leveldb's doc/table_format.md) of BundleEntryProto
(tensorflow/core/protobuf/tensor_bundle.proto)."""

from __future__ import annotations

import os
import struct

import numpy as np

_R = "InceptionResnetV1"
_DTYPE = {np.dtype("float32"): 1, np.dtype("int32"): 3, np.dtype("int64"): 9, np.dtype(bool): 10}
PHASE = "phase_train"


def varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def shape_proto(shape) -> bytes:
    return b"".join(field(2, varint(1 << 3) + varint(d)) for d in shape)


def tensor_proto(array: np.ndarray) -> bytes:
    array = np.array(array, order="C")  # ascontiguousarray would make a scalar 1-d
    return (
        varint(1 << 3) + varint(_DTYPE[array.dtype]) + field(2, shape_proto(array.shape))
        + field(4, array.astype(array.dtype.newbyteorder("<")).tobytes())
    )  # fmt: skip


def attr_value(value) -> bytes:
    if isinstance(value, np.ndarray):
        return field(8, tensor_proto(value))
    if isinstance(value, bool):
        return varint(5 << 3) + varint(int(value))
    if isinstance(value, int):
        return varint(3 << 3) + varint(value)
    if isinstance(value, float):
        return varint(4 << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, str):
        return field(2, value.encode())
    if isinstance(value, tuple):  # a shape
        return field(7, shape_proto(value))
    return field(1, field(3, b"".join(varint(v) for v in value)))  # list(int), packed


def node_def(name: str, op: str, inputs=(), **attrs) -> bytes:
    body = field(1, name.encode()) + field(2, op.encode())
    body += b"".join(field(3, i.encode()) for i in inputs)
    for key, value in attrs.items():
        body += field(5, field(1, key.encode()) + field(2, attr_value(value)))
    return body


def _nth(i: int) -> str:
    """TensorFlow's suffix for the i-th node of one name: "", "_1", "_2", ..."""
    return f"_{i}" if i else ""


class SandbergGraph:
    """The graph's nodes as (name, NodeDef bytes), in building order; ``bytes()`` joins them."""

    def __init__(self, seed=0, embedding_dim=512, size=160, form="folded"):
        self.rng, self.form, self.nodes = np.random.default_rng(seed), form, []
        self.constants: dict[str, np.ndarray] = {}  # the float ones, by name
        self.training: set[str] = set()  # float constants on the training branches
        self.embedding_dim, self.size = embedding_dim, size
        self.add("input", "Placeholder", dtype=1, shape=(1, size, size, 3))
        if form == "release":
            self.add(PHASE, "Placeholder", dtype=10, shape=())
        self._network()

    def add(self, name: str, op: str, inputs=(), **attrs) -> str:
        self.nodes.append((name, node_def(name, op, inputs, **attrs)))
        return name

    def __bytes__(self) -> bytes:
        return b"".join(field(1, body) for _, body in self.nodes)

    def const(self, name: str, array, control: str = "") -> str:
        """A float constant; ``control``: the cond branch (``switch_t``) it lives on."""
        self.constants[name] = np.asarray(array)
        if control.endswith("switch_t"):
            self.training.add(name)
        inputs = [f"^{control}"] if control else []
        return self.add(name, "Const", inputs, value=np.asarray(array), dtype=1)

    def variable(self, name: str, array) -> str:
        """A frozen variable, read through its ``/read`` Identity in a release graph."""
        self.const(name, array)
        return self.add(f"{name}/read", "Identity", [name]) if self.form == "release" else name

    def random(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def conv(self, scope, x, kernel, cout, stride=1, padding="SAME", cin=None) -> str:
        """slim.conv2d with sandberg's BatchNorm (center, no scale, eps 1e-3) and ReLU."""
        kh, kw = kernel
        w = self.random(kh, kw, cin, cout, scale=(2 / (kh * kw * cin)) ** 0.5)
        conv = self.add(
            f"{scope}/Conv2D",
            "Conv2D",
            [x, self.variable(f"{scope}/weights", w)],
            strides=[1, stride, stride, 1],
            padding=padding,
            data_format="NHWC",
        )
        bn = f"{scope}/BatchNorm/cond/FusedBatchNorm_1"
        if self.form == "folded":
            self.add(
                bn,
                "BiasAdd",
                [conv, self.const(f"{scope}/Conv2D_bn_offset", self.random(cout, scale=0.1))],
            )
        elif self.form == "release":
            bn = self.cond_batch_norm(scope, conv, cout)
        else:
            self.batch_norm(scope, conv, cout, bn)
        return self.add(f"{scope}/Relu", "Relu", [bn])

    def bn_params(self, scope, depth) -> list[str]:
        """gamma (ones: no scale), beta, moving mean and variance of ``scope``'s BatchNorm."""
        return [
            self.const(f"{scope}/BatchNorm/Const", np.ones(depth, np.float32)),
            self.variable(f"{scope}/BatchNorm/beta", self.random(depth, scale=0.1)),
            self.variable(f"{scope}/BatchNorm/moving_mean", self.random(depth, scale=0.1)),
            self.variable(
                f"{scope}/BatchNorm/moving_variance", 0.5 + self.rng.random(depth, np.float32)
            ),
        ]

    def batch_norm(self, scope, x, depth, name) -> str:
        inputs = [x, *self.bn_params(scope, depth)]
        return self.add(
            name, "FusedBatchNorm", inputs, epsilon=1e-3, is_training=False, data_format="NHWC"
        )

    def cond(self, scope) -> str:
        """tf.cond's predicate nodes under ``scope``; returns ``pred_id``."""
        switch = self.add(f"{scope}/Switch", "Switch", [PHASE, PHASE])
        self.add(f"{scope}/switch_t", "Identity", [f"{switch}:1"])
        self.add(f"{scope}/switch_f", "Identity", [switch])
        return self.add(f"{scope}/pred_id", "Identity", [PHASE])

    def switch(self, name, x, pred, branch: int) -> str:
        """``x`` taken into a cond branch: the Switch's output 1 (true) or 0 (false)."""
        self.add(name, "Switch", [x, pred])
        return f"{name}:1" if branch else name

    def cond_batch_norm(self, scope, x, depth) -> str:
        """slim.batch_norm(is_training=phase_train): the batch's statistics (empty mean and
        variance constants) when true, the moving ones when false, merged; then cond_1."""
        params, at = self.bn_params(scope, depth), f"{scope}/BatchNorm/cond"
        pred, attrs = self.cond(at), {"epsilon": 1e-3, "data_format": "NHWC"}
        train = [self.switch(f"{at}/FusedBatchNorm/Switch" + _nth(i), v, pred, 1)
                 for i, v in enumerate([x, *params[:2]])]  # fmt: skip
        train += [self.const(f"{at}/Const{s}", np.zeros(0, np.float32), f"{at}/switch_t")
                  for s in ("", "_1")]  # fmt: skip
        train = self.add(f"{at}/FusedBatchNorm", "FusedBatchNorm", train, is_training=True, **attrs)
        infer = [self.switch(f"{at}/FusedBatchNorm_1/Switch" + _nth(i), v, pred, 0)
                 for i, v in enumerate([x, *params])]  # fmt: skip
        infer = self.add(
            f"{at}/FusedBatchNorm_1", "FusedBatchNorm", infer, is_training=False, **attrs
        )
        merges = [
            self.add(f"{at}/Merge{s}", "Merge", [f"{infer}{p}", f"{train}{p}"], N=2)
            for s, p in ((_nth(i), f":{i}" if i else "") for i in range(3))
        ]
        return self.forced_updates(f"{scope}/BatchNorm/cond_1", merges, params[2:])

    def forced_updates(self, at, merges, moving) -> str:
        """updates_collections None: a second cond whose true branch assigns the moving
        averages (AssignSub, made Sub by freeze_graph.py) before passing the output on."""
        pred, updates = self.cond(at), []
        for i, (variable, stat) in enumerate(zip(moving, merges[1:])):
            scope = f"{at}/AssignMovingAvg" + _nth(i)
            variable = self.switch(f"{scope}/Switch", variable, pred, 1)  # a RefSwitch, renamed
            stat = self.switch(f"{scope}/sub/Switch", stat, pred, 1)
            decay = self.const(f"{scope}/decay", np.float32(1 - 0.995), f"{at}/switch_t")
            delta = self.add(f"{scope}/sub", "Sub", [variable, stat])
            delta = self.add(f"{scope}/mul", "Mul", [delta, decay])
            updates.append(self.add(scope, "Sub", [variable, delta]))
        out = self.switch(f"{at}/Identity/Switch", merges[0], pred, 1)
        out = self.add(f"{at}/Identity", "Identity", [out, *(f"^{u}" for u in updates)])
        kept = self.switch(f"{at}/Switch_1", merges[0], pred, 0)
        return self.add(f"{at}/Merge", "Merge", [kept, out], N=2)

    def dropout(self, x) -> str:
        """slim.dropout(keep_prob 0.8, is_training=phase_train): x / keep * floor(keep + U[0, 1))
        when true, x when false."""
        at = f"{_R}/Logits/Dropout/cond"
        pred, branch = self.cond(at), f"{at}/switch_t"
        kept = self.switch(f"{at}/Identity/Switch", x, pred, 0)
        kept = self.add(f"{at}/Identity", "Identity", [kept])
        x, d = self.switch(f"{at}/dropout/Shape/Switch", x, pred, 1), f"{at}/dropout"
        keep = self.const(f"{d}/keep_prob", np.float32(0.8), branch)
        low = self.const(f"{d}/random_uniform/min", np.float32(0), branch)
        high = self.const(f"{d}/random_uniform/max", np.float32(1), branch)
        u = self.add(f"{d}/random_uniform/RandomUniform", "RandomUniform",
                     [self.add(f"{d}/Shape", "Shape", [x])], dtype=1)  # fmt: skip
        span = self.add(f"{d}/random_uniform/sub", "Sub", [high, low])
        u = self.add(f"{d}/random_uniform/mul", "Mul", [u, span])
        u = self.add(f"{d}/random_uniform", "Add", [u, low])
        mask = self.add(f"{d}/Floor", "Floor", [self.add(f"{d}/add", "Add", [keep, u])])
        out = self.add(f"{d}/mul", "Mul", [self.add(f"{d}/div", "RealDiv", [x, keep]), mask])
        return self.add(f"{at}/Merge", "Merge", [kept, out], N=2)

    def pool(self, scope, x, op="MaxPool", k=3, stride=2) -> str:
        attrs = {"ksize": [1, k, k, 1], "strides": [1, stride, stride, 1], "padding": "VALID"}
        return self.add(f"{scope}/{op}", op, [x], data_format="NHWC", **attrs)

    def concat(self, scope, branches) -> str:
        axis = self.add(f"{scope}/concat/axis", "Const", value=np.array(3, np.int32), dtype=3)
        return self.add(f"{scope}/concat", "ConcatV2", [*branches, axis], N=len(branches))

    def branches(self, scope, x, cin, layers) -> list[str]:
        """Each branch: its layers (name, kernel, depth, stride) in order; a "MaxPool" alone."""
        outs = []
        for i, branch in enumerate(layers):
            y, c = x, cin
            for name, kernel, depth, stride in branch:
                at = f"{scope}/Branch_{i}/{name}"
                if name.startswith("MaxPool"):
                    y = self.pool(at, y)
                    continue
                padding = "VALID" if stride == 2 else "SAME"
                y, c = self.conv(at, y, kernel, depth, stride, padding, cin=c), depth
            outs.append(y)
        return outs

    def block(self, scope, x, cin, layers, scale, relu=True) -> str:
        """block35 / block17 / block8: relu(x + scale * up(concat(branches)))."""
        outs = self.branches(scope, x, cin, layers)
        width = sum(branch[-1][2] for branch in layers)  # the concatenation's depth
        up = f"{scope}/Conv2d_1x1"
        w = self.random(1, 1, width, cin, scale=(1 / width) ** 0.5)
        conv = self.add(
            f"{up}/Conv2D",
            "Conv2D",
            [self.concat(scope, outs), self.variable(f"{up}/weights", w)],
            strides=[1, 1, 1, 1],
            padding="SAME",
            data_format="NHWC",
        )
        up = self.add(
            f"{up}/BiasAdd",
            "BiasAdd",
            [conv, self.variable(f"{up}/biases", self.random(cin, scale=0.1))],
        )
        mul = self.add(f"{scope}/mul", "Mul", [self.const(f"{scope}/mul/x", np.float32(scale)), up])
        out = self.add(f"{scope}/add", "Add", [x, mul])
        return self.add(f"{scope}/Relu", "Relu", [out]) if relu else out

    def _network(self) -> None:
        x, cin = "input", 3
        for name, kernel, depth, stride, padding in STEM:
            if name.startswith("MaxPool"):
                x = self.pool(f"{_R}/{name}", x)
                continue
            x, cin = self.conv(f"{_R}/{name}", x, kernel, depth, stride, padding, cin=cin), depth
        for scope, layers, scale, count in BLOCKS:
            for i in range(count):
                at = f"{_R}/{scope}_{i + 1}" if count > 1 else f"{_R}/{scope}"
                if scale is None:  # a reduction: the branches concatenated
                    x = self.concat(at, self.branches(at, x, cin, layers))
                    cin = sum(b[-1][2] if b[-1][1] else cin for b in layers)
                else:
                    x = self.block(at, x, cin, layers, scale, relu=scope != "Block8")
        self.head(x, cin)

    def head(self, x, features) -> None:
        """Average pooling over the last grid, the bottleneck and l2_normalize."""
        grid = (self.size - 3) // 2 + 1 - 2  # Conv2d_1a, Conv2d_2a
        for _ in range(4):  # MaxPool_3a, Conv2d_4b, Mixed_6a, Mixed_7a; Conv2d_4a: - 2
            grid = (grid - 3) // 2 + 1 - (2 if _ == 0 else 0)
        pool = {"ksize": [1, grid, grid, 1], "strides": [1, 1, 1, 1], "padding": "VALID"}
        x = self.add(f"{_R}/Logits/AvgPool_1a_8x8/AvgPool", "AvgPool", [x], **pool)
        flat = self.add(
            f"{_R}/Logits/Flatten/shape", "Const", value=np.array([-1, features], np.int32), dtype=3
        )
        x = self.add(f"{_R}/Logits/Flatten/Reshape", "Reshape", [x, flat])
        x = self.dropout(x) if self.form == "release" else x
        d, scope = self.embedding_dim, f"{_R}/Bottleneck"
        w = self.variable(f"{scope}/weights", self.random(features, d, scale=features**-0.5))
        x = self.add(f"{scope}/MatMul", "MatMul", [x, w], transpose_a=False, transpose_b=False)
        shape4 = self.add(
            f"{scope}/BatchNorm/Reshape/shape",
            "Const",
            value=np.array([-1, 1, 1, d], np.int32),
            dtype=3,
        )
        x = self.add(f"{scope}/BatchNorm/Reshape", "Reshape", [x, shape4])
        if self.form == "release":
            x = self.cond_batch_norm(scope, x, d)
        else:
            x = self.batch_norm(scope, x, d, f"{scope}/BatchNorm/cond/FusedBatchNorm_1")
        shape2 = self.add(
            f"{scope}/BatchNorm/Shape", "Const", value=np.array([-1, d], np.int32), dtype=3
        )
        x = self.add(f"{scope}/BatchNorm/Reshape_1", "Reshape", [x, shape2])
        square = self.add("embeddings/Square", "Square", [x])
        axis = self.add(
            "embeddings/Sum/reduction_indices", "Const", value=np.array(1, np.int32), dtype=3
        )
        total = self.add("embeddings/Sum", "Sum", [square, axis], keep_dims=True)
        eps = self.const("embeddings/Maximum/y", np.float32(1e-10))
        norm = self.add(
            "embeddings/Rsqrt", "Rsqrt", [self.add("embeddings/Maximum", "Maximum", [total, eps])]
        )
        self.add("embeddings", "Mul", [x, norm])


# sandberg's stem: (scope, kernel, depth, stride, padding)
STEM = [
    ("Conv2d_1a_3x3", (3, 3), 32, 2, "VALID"),
    ("Conv2d_2a_3x3", (3, 3), 32, 1, "VALID"),
    ("Conv2d_2b_3x3", (3, 3), 64, 1, "SAME"),
    ("MaxPool_3a_3x3", None, 64, 2, "VALID"),
    ("Conv2d_3b_1x1", (1, 1), 80, 1, "VALID"),
    ("Conv2d_4a_3x3", (3, 3), 192, 1, "VALID"),
    ("Conv2d_4b_3x3", (3, 3), 256, 2, "VALID"),
]


def _residual(width: int, second: tuple, third: tuple) -> list:
    """block35/17/8's branches: a 1x1, then a 1x1 and the ``second`` kernels, (``third``)."""
    one = ("Conv2d_1x1", (1, 1), width, 1)
    a = ("Conv2d_0a_1x1", (1, 1), width, 1)
    name = lambda letter, k: (f"Conv2d_0{letter}_{k[0]}x{k[1]}", k, width, 1)
    branches = [[one], [a, *(name("bc"[i], k) for i, k in enumerate(second))]]
    return branches + ([[a, *(name("bc"[i], k) for i, k in enumerate(third))]] if third else [])


_B35 = _residual(32, ((3, 3),), ((3, 3), (3, 3)))
_B17 = _residual(128, ((1, 7), (7, 1)), ())
_B8 = _residual(192, ((1, 3), (3, 1)), ())
_MAX = [("MaxPool_1a_3x3", None, 0, 2)]
# (scope, branches: (name, kernel, depth, stride), residual scale or None, repeats)
BLOCKS = [
    ("Repeat/block35", _B35, 0.17, 5),
    (
        "Mixed_6a",
        [
            [("Conv2d_1a_3x3", (3, 3), 384, 2)],
            [("Conv2d_0a_1x1", (1, 1), 192, 1), ("Conv2d_0b_3x3", (3, 3), 192, 1),
             ("Conv2d_1a_3x3", (3, 3), 256, 2)],
            _MAX,
        ],
        None,
        1,
    ),
    ("Repeat_1/block17", _B17, 0.10, 10),
    (
        "Mixed_7a",
        [
            [("Conv2d_0a_1x1", (1, 1), 256, 1), ("Conv2d_1a_3x3", (3, 3), 384, 2)],
            [("Conv2d_0a_1x1", (1, 1), 256, 1), ("Conv2d_1a_3x3", (3, 3), 256, 2)],
            [("Conv2d_0a_1x1", (1, 1), 256, 1), ("Conv2d_0b_3x3", (3, 3), 256, 1),
             ("Conv2d_1a_3x3", (3, 3), 256, 2)],
            _MAX,
        ],
        None,
        1,
    ),
    ("Repeat_2/block8", _B8, 0.20, 5),
    ("Block8", _B8, 1.0, 1),
]  # fmt: skip


def table_block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A LevelDB block: each key prefix-compressed against the one before, one restart at 0."""
    out, last = bytearray(), b""
    for key, value in entries:
        shared = len(os.path.commonprefix([last, key]))
        out += varint(shared) + varint(len(key) - shared) + varint(len(value))
        out += key[shared:] + value
        last = key
    return bytes(out) + struct.pack("<II", 0, 1)


def bundle(tensors: dict[str, np.ndarray]) -> tuple[bytes, bytes]:
    """A one-shard tensor bundle of ``tensors``: its ``.index`` and ``.data-00000-of-00001``."""
    data, entries = bytearray(), [(b"", varint(1 << 3) + varint(1))]  # header: num_shards 1
    for name in sorted(tensors):
        array = np.array(tensors[name], order="C")
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        entry = varint(1 << 3) + varint(_DTYPE[array.dtype]) + field(2, shape_proto(array.shape))
        entry += varint(4 << 3) + varint(len(data)) + varint(5 << 3) + varint(len(raw))
        entries.append((name.encode(), entry))
        data += raw
    index = bytearray()

    def put(block: bytes) -> bytes:  # its handle; the trailer: type 0, a crc left at 0
        offset = len(index)
        index.extend(block + bytes(5))
        return varint(offset) + varint(len(block))

    handle = put(table_block(entries))
    meta, top = put(table_block([])), put(table_block([(entries[-1][0], handle)]))
    footer = (meta + top).ljust(40, b"\0") + struct.pack("<Q", 0xDB4775248B80FB57)
    return bytes(index + footer), bytes(data)
