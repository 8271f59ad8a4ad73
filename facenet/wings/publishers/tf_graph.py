"""TensorFlow's frozen graphs (``GraphDef`` ``.pb``) read without TensorFlow, from the protobuf
wire format, field numbers from tensorflow/core/framework/{graph,node_def,attr_value,tensor,
tensor_shape}.proto. Only what a frozen inference graph needs: nodes (name, op, inputs, attrs),
float32/int32/bool constants, and which nodes TensorFlow runs when its boolean placeholders are
fed (tf.cond's Switch/Merge). Every length, varint and declared shape is checked against the
bytes that hold it before anything is allocated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from graphlib import CycleError, TopologicalSorter

import numpy as np

MAX_FILL = 2**20  # elements one value may fill (TensorProto's version 0; not fewer than all)
MAX_DIM = 2**31  # numpy refuses a shape such as (0, 2**62) even with no element in it
MAX_KEY = 1024  # bytes of a checkpoint's tensor name; keys that extend each other stay bounded
DT_BOOL = 10
_DTYPES = {1: np.dtype("<f4"), 3: np.dtype("<i4"), DT_BOOL: np.dtype("?")}  # types.proto


class GraphError(ValueError):
    """Damaged bytes, named by position (callers add the file's name)."""


@dataclass(frozen=True)
class Node:
    """One ``NodeDef``: ``attrs`` hold str, int, float, bool, shape tuples, arrays (tensors), or
    lists of these; an unsupported tensor type is None."""

    name: str
    op: str
    inputs: tuple[str, ...]
    attrs: dict = field(default_factory=dict)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 70:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            if value >= 2**64:
                break
            return (value - 2**64 if value >= 2**63 else value), pos  # int64 two's complement
    raise GraphError(f"a truncated or overlong varint at byte {pos}")


def _fields(buf: bytes, start: int, end: int):
    """(field number, wire type, value) of a message in ``buf[start:end]``; value: an int
    (varint), or the (start, end) of the bytes (fixed32/64, length-delimited)."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number < 1 or wire not in (0, 1, 2, 5):  # 3, 4: groups, which no GraphDef has
            raise GraphError(f"field {number} has wire type {wire} at byte {pos}")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value
            continue
        size, pos = _varint(buf, pos, end) if wire == 2 else (8 if wire == 1 else 4, pos)
        if not 0 <= size <= end - pos:
            raise GraphError(f"field {number} at byte {pos} runs {size} bytes past its message")
        yield number, wire, (pos, pos + size)
        pos += size


def _text(buf: bytes, span) -> str:
    try:
        return buf[span[0] : span[1]].decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        raise GraphError(f"a name or string at byte {span} that is not UTF-8 text") from None


def _shape(buf: bytes, span) -> tuple[int, ...]:
    """TensorShapeProto: dim = 2 (Dim: size = 1)."""
    dims = []
    for number, wire, value in _fields(buf, *span):
        if number == 2 and wire == 2:
            sizes = [v for n, w, v in _fields(buf, *value) if n == 1 and w == 0]
            dims.append(sizes[-1] if sizes else 0)
    return tuple(dims)


def _count(shape: tuple[int, ...], what: str) -> int:
    """The element count of a tensor's declared ``shape``; GraphError for a negative dimension,
    one of ``MAX_DIM`` or more, or a rank over 32 (TensorFlow's limit is 254)."""
    if len(shape) > 32 or not all(0 <= d < MAX_DIM for d in shape):
        raise GraphError(f"{what} of shape {shape[:33]}")
    return math.prod(shape)


def _floats(buf: bytes, items: list) -> np.ndarray:
    """Float32 values of (wire type, span) items: packed (2) or one by one (5), concatenated."""
    spans = [v for w, v in items if w in (2, 5) and (v[1] - v[0]) % 4 == 0]
    if len(spans) != len(items):
        raise GraphError("float values whose length is not a multiple of 4 bytes")
    parts = [np.frombuffer(buf, "<f4", (e - s) // 4, s) for s, e in spans]
    return np.concatenate(parts) if parts else np.zeros(0, "<f4")


def _int_values(buf: bytes, items: list) -> np.ndarray:
    values = []
    for wire, value in items:  # packed varints (2) or one varint each (0)
        if wire == 0:
            values.append(value)
            continue
        pos, end = value
        while pos < end:
            number, pos = _varint(buf, pos, end)
            values.append(number)
    return np.array(values, np.int64)


def _tensor(buf: bytes, span) -> np.ndarray | None:
    """TensorProto: dtype 1, tensor_shape 2, tensor_content 4, float_val 5, int_val 7, bool_val
    11; None for another dtype. The element count is checked against the bytes before
    allocating."""
    dtype, shape, content, items = 0, (), None, {5: [], 7: [], 11: []}
    for number, wire, value in _fields(buf, *span):
        if number == 1 and wire == 0:
            dtype = value
        elif number == 2 and wire == 2:
            shape = _shape(buf, value)
        elif number == 4 and wire == 2:
            content = value
        elif number in items:
            items[number].append((wire, value))
    if dtype not in _DTYPES:
        return None
    count, kind = _count(shape, "a constant"), _DTYPES[dtype]
    if content is not None:
        if content[1] - content[0] != count * kind.itemsize:
            raise GraphError(f"a constant of shape {shape} holds {content[1] - content[0]} bytes")
        return np.frombuffer(buf, kind, count, content[0]).reshape(shape)
    if dtype == 1:
        values = _floats(buf, items[5])
    else:
        values = _int_values(buf, items[11 if dtype == DT_BOOL else 7]).astype(kind)
    if len(values) != count and not (len(values) == 1 and count <= MAX_FILL):
        raise GraphError(f"a constant of shape {shape} holds {len(values)} values")
    return np.broadcast_to(values, (count,)).reshape(shape)


def _list(buf: bytes, span) -> list:
    """AttrValue.ListValue: s 2, i 3, f 4, b 5, type 6, shape 7 (tensors and funcs skipped)."""
    found: dict[int, list] = {}
    for number, wire, value in _fields(buf, *span):
        found.setdefault(number, []).append((wire, value))
    if 2 in found:
        return [_text(buf, v) for w, v in found[2] if w == 2]
    if 4 in found:
        return _floats(buf, found[4]).tolist()
    if 7 in found:
        return [_shape(buf, v) for w, v in found[7] if w == 2]
    number = next((n for n in (3, 5, 6) if n in found), None)
    return [] if number is None else _int_values(buf, found[number]).tolist()


def _attr(buf: bytes, span):
    """AttrValue: list 1, s 2, i 3, f 4, b 5, type 6, shape 7, tensor 8; the last field set."""
    value = None
    for number, wire, raw in _fields(buf, *span):
        if number == 1 and wire == 2:
            value = _list(buf, raw)
        elif number == 2 and wire == 2:
            value = _text(buf, raw)
        elif number in (3, 6) and wire == 0:
            value = raw
        elif number == 5 and wire == 0:
            value = bool(raw)
        elif number == 4 and wire == 5:
            value = float(np.frombuffer(buf, "<f4", 1, raw[0])[0])
        elif number == 7 and wire == 2:
            value = _shape(buf, raw)
        elif number == 8 and wire == 2:
            value = _tensor(buf, raw)
    return value


def _node(buf: bytes, span) -> Node:
    """NodeDef: name 1, op 2, input 3, attr 5 (map entries: key 1, value 2)."""
    name, op, inputs, attrs = "", "", [], {}
    for number, wire, value in _fields(buf, *span):
        if wire != 2:
            continue
        if number == 1:
            name = _text(buf, value)
        elif number == 2:
            op = _text(buf, value)
        elif number == 3:
            inputs.append(_text(buf, value))
        elif number == 5:
            entry = {n: v for n, w, v in _fields(buf, *value) if w == 2}
            if 1 in entry:
                attrs[_text(buf, entry[1])] = _attr(buf, entry[2]) if 2 in entry else None
    if not name or not op:
        raise GraphError(f"a node without a name or op at byte {span[0]}")
    return Node(name, op, tuple(inputs), attrs)


def parse_graph(buf: bytes) -> dict[str, Node]:
    """The nodes of a serialized ``GraphDef`` (node = 1) by name, in file order; GraphError for
    damaged bytes. Constants' arrays are read-only views into ``buf``."""
    nodes: dict[str, Node] = {}
    try:
        for number, wire, value in _fields(buf, 0, len(buf)):
            if number == 1 and wire == 2:
                node = _node(buf, value)
                if node.name in nodes:
                    raise GraphError(f"two nodes named {node.name!r}")
                nodes[node.name] = node
    except GraphError as err:
        raise GraphError(f"not a TensorFlow GraphDef ({err})") from None
    if not nodes:
        raise GraphError("not a TensorFlow GraphDef (no nodes)")
    return nodes


def _ref(text: str) -> tuple[str, int, bool]:
    """An input ``name``, ``name:port`` or ``^name`` (a control input) as (name, port, control)."""
    if text.startswith("^"):
        return text[1:], 0, True
    name, _, port = text.partition(":")
    if not re.fullmatch("[0-9]{1,9}", port or "0"):  # str.isdigit admits "²", which int refuses
        raise GraphError(f"an input {text[:80]!r} whose output port is not a number")
    return name, int(port or 0), False


def _predicate(nodes: dict[str, Node], switch: Node, feeds: dict[str, bool]) -> bool:
    """The value of ``switch``'s predicate: a boolean placeholder in ``feeds`` or a boolean
    constant, reached through Identity nodes (tf.cond's ``pred_id``)."""
    name = _ref(switch.inputs[1])[0] if len(switch.inputs) == 2 else ""
    while name in nodes and nodes[name].op == "Identity" and nodes[name].inputs:  # no cycle
        name = _ref(nodes[name].inputs[0])[0]
    node = nodes.get(name, Node("?", "?", ()))
    if name in feeds and node.op.startswith("Placeholder") and node.attrs.get("dtype") == DT_BOOL:
        return feeds[name]
    value = node.attrs.get("value") if node.op == "Const" else None
    if isinstance(value, np.ndarray) and value.dtype == bool and value.size == 1:
        return bool(value.reshape(()))
    raise GraphError(
        f"{switch.name!r} switches on {name!r}, which is neither the boolean placeholder "
        f"{' or '.join(map(repr, feeds))} nor a boolean constant"
    )


def _upstream(nodes: dict[str, Node], output: str, follow) -> set:
    """The nodes reached back from ``output`` along inputs where ``follow(name, port, control)``."""
    reached, stack = set(), [output]
    while stack:
        name = stack.pop()
        if name in nodes and name not in reached:
            reached.add(name)
            stack.extend(ref[0] for ref in map(_ref, nodes[name].inputs) if follow(*ref))
    return reached


def live_nodes(nodes: dict[str, Node], output: str, feeds: dict[str, bool]) -> tuple[set, set]:
    """(ancestors, live): the nodes ``output`` depends on (data and control inputs), and those
    of them whose values reach it when TensorFlow runs with ``feeds`` giving its boolean
    placeholders. TensorFlow's dead-tensor rule (control_flow_ops.py, executor.cc): a Switch
    forwards its input to output 1 when its predicate is true, else to output 0, the other
    output is dead; a node with a dead input is dead, except a Merge, live when any data input
    is. Inputs that are not in the graph count as live (whoever needs them names them).
    GraphError for a cycle (a loop) or a Switch on another predicate."""
    ancestors = _upstream(nodes, output, lambda *ref: True)
    inputs = {name: [_ref(i)[0] for i in nodes[name].inputs] for name in ancestors}
    try:
        order = [name for name in TopologicalSorter(inputs).static_order() if name in nodes]
    except CycleError as err:
        cycle = err.args[1][0]
        raise GraphError(f"a cycle through {cycle!r}, which a frozen graph does not have") from None
    dead, ports = {}, {}  # ports: each Switch's live output

    def live(name: str, port: int, control: bool) -> bool:
        return name not in nodes or not dead[name] and (control or ports.get(name, port) == port)

    for name in order:
        node, refs = nodes[name], [_ref(i) for i in nodes[name].inputs]
        flags = [live(*ref) for ref in refs if node.op != "Merge" or not ref[2]]
        dead[name] = not (any if node.op == "Merge" else all)(flags)
        if node.op == "Switch":
            ports[name] = int(_predicate(nodes, node, feeds))
    return ancestors, set() if dead.get(output, True) else _upstream(nodes, output, live)


# --------------------------------------------------------------------------- checkpoints

_MAGIC = 0xDB4775248B80FB57  # tensorflow/core/lib/io/format.h: kTableMagicNumber
_FOOTER = 48  # two block handles padded to 40 bytes, then the magic


def _block(buf: bytes, handle) -> list[tuple[bytes, tuple[int, int]]]:
    """(key, value span) of a LevelDB table block (tensorflow/core/lib/io/block.cc): entries of
    shared, unshared and value lengths, the key's new bytes and the value, then the restart
    offsets and their count; ``handle``: the (offset, size) before its 5-byte trailer."""
    start, size = handle
    end = start + size
    if (
        start < 0 or size < 4 or end + 5 > len(buf) or buf[end] != 0
    ):  # trailer: type 0 (uncompressed), crc
        raise GraphError(f"a table block at byte {start} that is compressed or past the end")
    restarts = end - 4 - 4 * int.from_bytes(buf[end - 4 : end], "little")
    if restarts < start:
        raise GraphError(f"a table block at byte {start} with more restarts than bytes")
    entries, key, pos = [], b"", start
    while pos < restarts:
        shared, pos = _varint(buf, pos, restarts)
        unshared, pos = _varint(buf, pos, restarts)
        length, pos = _varint(buf, pos, restarts)
        if (
            shared > len(key)
            or min(shared, unshared, length) < 0
            or pos + unshared + length > restarts
        ):
            raise GraphError(f"a table entry at byte {pos} runs past its block")
        if shared + unshared > MAX_KEY:
            raise GraphError(f"a table key at byte {pos} of {shared + unshared} bytes")
        key, pos = key[:shared] + buf[pos : pos + unshared], pos + unshared
        entries.append((key, (pos, pos + length)))
        pos += length
    return entries


def _handle(buf: bytes, pos: int, end: int) -> tuple[tuple[int, int], int]:
    """A block handle (offset, size) and the position after it."""
    offset, pos = _varint(buf, pos, end)
    size, pos = _varint(buf, pos, end)
    return (offset, size), pos


def _bundle_entry(index: bytes, span, data: bytes) -> np.ndarray | None:
    """BundleEntryProto: dtype 1, shape 2, shard_id 3, offset 4, size 5, slices 7; a float32
    tensor as a read-only view into ``data``, None for another dtype."""
    ints, spans = {}, {}
    for number, wire, value in _fields(index, *span):
        (ints if wire == 0 else spans)[number] = value
    if 7 in spans or ints.get(3, 0) != 0:
        raise GraphError("a partitioned or sharded tensor, which this reader does not read")
    shape = _shape(index, spans[2]) if 2 in spans else ()
    if ints.get(1) != 1:
        return None
    offset, size = ints.get(4, 0), ints.get(5, 0)
    if size != _count(shape, "a tensor") * 4:
        raise GraphError(f"a tensor of shape {shape} stored in {size} bytes")
    if not 0 <= offset <= len(data) - size:
        raise GraphError(f"a tensor at byte {offset} of {size} bytes past the data file's end")
    return np.frombuffer(data, "<f4", size // 4, offset).reshape(shape)


def parse_bundle(index: bytes, data: bytes) -> dict[str, np.ndarray]:
    """The float32 tensors of a TensorFlow checkpoint (a tensor bundle: ``.index``, a LevelDB
    table of ``BundleEntryProto`` by name, and its one ``.data-00000-of-00001`` shard);
    GraphError for damaged or unsupported bytes."""
    try:
        if len(index) < _FOOTER or int.from_bytes(index[-8:], "little") != _MAGIC:
            raise GraphError("no table footer")
        end = len(index) - 8
        # the metaindex's handle, then the index's
        _, pos = _handle(index, len(index) - _FOOTER, end)
        handles = [
            _handle(index, *span)[0] for _, span in _block(index, _handle(index, pos, end)[0])
        ]
        for (start, size), (after, _) in zip(handles, handles[1:]):
            if after < start + size + 5:  # one block read twice: entries pointing at one block
                raise GraphError(f"table blocks at bytes {start} and {after} overlap")
        entries = [entry for handle in handles for entry in _block(index, handle)]
        header = {n: v for key, span in entries if key == b"" for n, w, v in _fields(index, *span)}
        if header.get(1, 1) != 1 or header.get(2, 0) != 0:
            raise GraphError("a bundle of several shards or big-endian, not read here")
        tensors = {
            _text(key, (0, len(key))): _bundle_entry(index, span, data)
            for key, span in entries
            if key
        }
    except GraphError as err:
        raise GraphError(f"not a TensorFlow checkpoint ({err})") from None
    return {name: value for name, value in tensors.items() if value is not None}
