"""Small graph queries and edits shared by the rules (on top of onnx_ir).

The symbolic shape evaluator answers questions such as "is this Reshape target
``[batch, seq, heads, head_dim]``?" for shape vectors the exporters build at run time from
``Shape``/``Concat``/``Squeeze``/``Unsqueeze``/``Gather``/``Add`` nodes. A dimension is an
``int`` or a hashable symbolic term; two terms are equal when they are the same dimension of
the same value or carry the same declared ``dim_param`` (ONNX's meaning of a shared name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

Dim = Any  # int | tuple (symbolic term)


# ---------------------------------------------------------------- constants and attributes


def const_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return tensor.numpy()


def const_ints(value: ir.Value | None) -> list[int] | None:
    array = const_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(x) for x in array.reshape(-1)]


def const_scalar(value: ir.Value | None) -> float | None:
    array = const_array(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(-1)[0])


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    attribute = node.attributes.get(name)
    if attribute is None:
        return default
    return attribute.value


def producer(value: ir.Value | None, op_type: str, domain: str = "") -> ir.Node | None:
    """The node producing ``value`` if it is ``domain::op_type``."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.op_type != op_type or node.domain not in (domain, _alias(domain)):
        return None
    return node


def _alias(domain: str) -> str:
    return "ai.onnx" if domain == "" else domain


def only_consumer(value: ir.Value) -> ir.Node | None:
    """The one node reading ``value``, or None when it has several readers or is a graph
    output (a rewrite that absorbs ``value`` would then change what others see)."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    return uses[0].node


def input_at(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


# ---------------------------------------------------------------- edits


def replace_value(old: ir.Value, new: ir.Value) -> None:
    """Make every consumer and graph output of ``old`` use ``new``.

    When ``old`` is a graph output, ``new`` takes over its name so the model's signature
    is unchanged.
    """
    if old.is_graph_output():
        name = old.name
        old.name = None
        new.name = name
    old.replace_all_uses_with(new, replace_graph_outputs=True)


def substitute(
    graph: ir.Graph,
    old_nodes: Sequence[ir.Node],
    new_node: ir.Node | Sequence[ir.Node],
    replaced: Sequence[tuple[ir.Value, ir.Value]],
) -> None:
    """Put ``new_node`` (or several new nodes, in order: e.g. a fused op and the layout
    nodes a detached ``Builder`` made for its output) in the place of ``old_nodes``, right
    after ``old_nodes[-1]`` (the anchor, whose outputs' readers all come later): each
    ``(old, new)`` value pair hands over its name, type, shape and every use, graph outputs
    included, so the model's signature and the value names users see do not change. The
    replace tail every rewrite shares (onnx-ir's ``replace_nodes_and_values``);
    ``old_nodes`` must be dead once their replaced values are handed over."""
    for old, new in replaced:
        # The name moves before onnx-ir's helper copies the rest, so that two values never
        # hold one name in the graph at once.
        name, old.name = old.name, None
        new.name = name
    ir.convenience.replace_nodes_and_values(
        graph,
        old_nodes[-1],
        list(old_nodes),
        [new_node] if isinstance(new_node, ir.Node) else list(new_node),
        [old for old, _ in replaced],
        [new for _, new in replaced],
    )


def same_computation(a: ir.Value, b: ir.Value, depth: int = 0) -> bool:
    """a and b are provably equal: the same value, equal constants, or outputs of the same op
    (type, attributes, output index) on provably equal inputs. Exporters sometimes emit a
    duplicated subgraph instead of reusing one value."""
    if a is b:
        return True
    if depth > 8 or a is None or b is None:
        return False
    ca, cb = const_array(a), const_array(b)
    if ca is not None or cb is not None:
        return (
            ca is not None
            and cb is not None
            and ca.dtype == cb.dtype
            and (ca.shape == cb.shape and bool((ca == cb).all()))
        )
    na, nb = a.producer(), b.producer()
    if na is None or nb is None or (na.domain, na.op_type) != (nb.domain, nb.op_type):
        return False
    if a.index() != b.index() or len(na.inputs) != len(nb.inputs):
        return False
    if na.op_type in _NONDETERMINISTIC:
        return False
    attrs_a = {k: repr(v.value) for k, v in na.attributes.items()}
    attrs_b = {k: repr(v.value) for k, v in nb.attributes.items()}
    if attrs_a != attrs_b:
        return False
    return all(same_computation(x, y, depth + 1) for x, y in zip(na.inputs, nb.inputs, strict=True))


_NONDETERMINISTIC = (
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
)


def ensure_opset(model: ir.Model, domain: str, version: int) -> None:
    if domain not in model.opset_imports:
        model.opset_imports[domain] = version
        model.graph.opset_imports[domain] = version


def initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register a new initializer with a unique name."""
    base, n = name, 0
    while name in graph.initializers:
        n += 1
        name = f"{base}_{n}"
    value = ir.Value(
        name=name,
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        const_value=ir.tensor(array, name=name),
    )
    graph.register_initializer(value)
    return value


class Builder(ir.tape.Tape):
    """onnx-ir's ``Tape`` for a rewrite: each node it records is placed just before an anchor
    node (a rewrite's new nodes must come before the anchor's readers, not at the graph's end
    where a Tape on the graph would append them) and named, with its outputs, after a prefix.
    Without an anchor (``before=None``) it only records them in ``nodes``, for ``substitute``
    to place (nodes that read a new node's output must come after it)."""

    def __init__(self, graph: ir.Graph, before: ir.Node | None, prefix: str):
        super().__init__(None)  # placed by hand below, not appended to a graph
        self.graph = graph
        self.before = before
        self.prefix = prefix

    def op(  # type: ignore[override]  (Tape.op's shape, plus num_outputs; no overloads)
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        attributes: dict[str, Any] | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
        name: str | None = None,
    ) -> ir.Value | tuple[ir.Value, ...]:
        node_name = f"{self.prefix}/{name or op_type}_{len(self.nodes)}"
        outputs = self.op_multi_out(
            op_type, inputs, attributes, num_outputs=num_outputs, domain=domain, name=node_name
        )
        for i, out in enumerate(outputs):
            out.name = f"{node_name}_out{i}"
        if self.before is not None:
            self.graph.insert_before(self.before, self.nodes[-1])
        return outputs[0] if num_outputs == 1 else tuple(outputs)

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return initializer(self.graph, f"{self.prefix}/{name}", array)


# ---------------------------------------------------------------- symbolic shapes


def dim(value: ir.Value, axis: int) -> Dim:
    """A term for ``value.shape[axis]``: an int, a declared name, or (value, axis)."""
    shape = value.shape
    if shape is not None:
        if axis < 0:
            axis += len(shape)
        d = shape[axis] if 0 <= axis < len(shape) else None
        if isinstance(d, int):
            return d
        if d is not None and getattr(d, "value", None):
            return ("sym", d.value)
    return ("dim", id(value), axis)


def rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def shape_vector(value: ir.Value | None, _depth: int = 0) -> list[Dim] | None:
    """Evaluate a 1-D int64 shape vector (or scalar, as a 1-list) symbolically."""
    if value is None or _depth > 12:
        return None
    ints = const_ints(value)
    if ints is not None:
        return ints
    node = value.producer()
    if node is None:
        return None
    op = node.op_type
    if op == "Shape":
        src = node.inputs[0]
        r = rank(src)
        if r is None:
            return None
        start = attr(node, "start", 0)
        end = attr(node, "end", r)
        start = max(0, start + r if start < 0 else start)
        end = min(r, end + r if end < 0 else end)
        return [dim(src, i) for i in range(start, end)]
    if op in ("Squeeze", "Unsqueeze", "Identity", "Cast", "Reshape"):
        # Flat view: these only change the rank of a shape vector or scalar.
        return shape_vector(node.inputs[0], _depth + 1)
    if op == "Concat":
        out: list[Dim] = []
        for v in node.inputs:
            part = shape_vector(v, _depth + 1)
            if part is None:
                return None
            out.extend(part)
        return out
    if op == "Slice":
        data = shape_vector(node.inputs[0], _depth + 1)
        starts, ends = const_ints(input_at(node, 1)), const_ints(input_at(node, 2))
        axes, steps = input_at(node, 3), input_at(node, 4)
        if data is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
            return None
        if axes is not None and const_ints(axes) not in ([0], [-1]):
            return None
        if steps is not None and const_ints(steps) != [1]:
            return None
        return data[starts[0] : ends[0]]  # Python clamps like ONNX for step 1
    if op == "Gather":
        data = shape_vector(node.inputs[0], _depth + 1)
        idx = const_ints(node.inputs[1])
        if data is None or idx is None:
            return None
        try:
            return [data[i] for i in idx]
        except IndexError:
            return None
    if op in ("Add", "Sub", "Mul", "Div", "Equal", "Where"):
        parts = [shape_vector(v, _depth + 1) for v in node.inputs]
        if any(p is None for p in parts):
            return None
        width = max(len(p) for p in parts)
        if any(len(p) not in (1, width) for p in parts):
            return None
        columns = zip(*(p * width if len(p) == 1 else p for p in parts), strict=True)
        out = [_elementwise(op, *column) for column in columns]
        return None if any(x is None for x in out) else out
    if op == "ConstantOfShape":
        length = shape_vector(node.inputs[0], _depth + 1)
        fill = attr(node, "value")
        array = fill.numpy() if fill is not None else np.zeros(1, dtype=np.float32)
        if length is None or len(length) != 1 or not isinstance(length[0], int):
            return None
        if array.dtype.kind not in "iub" or array.size != 1:
            return None
        return [int(array.reshape(-1)[0])] * length[0]
    return None


def _nonnegative(term: Dim) -> bool:
    """A term that is a size: a dimension, or sums and products of sizes."""
    if isinstance(term, int):
        return term >= 0
    if isinstance(term, tuple) and term[:1] in (("dim",), ("sym",)):
        return True
    return (
        isinstance(term, tuple)
        and term[:1] in (("Add",), ("Mul",))
        and all(_nonnegative(t) for t in term[1:])
    )


def _elementwise(op: str, *args: Dim) -> Dim | None:
    """One element of an arithmetic / comparison / select on shape vectors (None: unknown).

    ``Equal`` and ``Where`` cover torch's ``expand(..., -1, ...)`` idiom
    ``Where(shape == -1, 1, shape)``: a size is never -1."""
    if op == "Where":
        cond, x, y = args
        if not isinstance(cond, int):
            return None
        return x if cond else y
    x, y = args
    if isinstance(x, int) and isinstance(y, int):
        if op == "Div":  # ONNX's integer Div truncates: floor where both are non-negative
            if y != 0 and (x % y == 0 or (x >= 0 and y > 0)):
                return x // y
            return None
        return {"Add": x + y, "Sub": x - y, "Mul": x * y, "Equal": int(x == y)}[op]
    if op == "Equal":
        if x == y:
            return 1
        for a, b in ((x, y), (y, x)):
            if isinstance(b, int) and b < 0 and _nonnegative(a):
                return 0
        return None
    if (op == "Add" and y == 0) or (op in ("Mul", "Div") and y == 1):
        return x
    if op == "Mul" and x == 1:
        return y
    if op == "Div":
        return None
    if op in ("Add", "Mul"):
        x, y = sorted((x, y), key=repr)
    return (op, x, y)


def remove_dead(graph: ir.Graph, nodes: Sequence[ir.Node]) -> None:
    """Remove those of ``nodes`` whose outputs nothing reads any more, and then the producers
    that only they read (the shape vectors a matched chain computed for itself).

    Rules call this after rerouting a matched chain, so that a later sweep is not offered
    the dead chain again; nodes still read elsewhere (shared cos/sin, masks) stay. Each node
    is removed at most once, so the work is linear in what is removed.
    """
    pending = list({id(n): n for n in nodes if n.graph is graph}.values())
    while pending:
        node = pending.pop()
        if node.graph is not graph:
            continue
        if any(out.uses() or out.is_graph_output() for out in node.outputs):
            continue
        inputs = [v for v in node.inputs if v is not None]
        graph.remove(node, safe=True)
        for value in inputs:
            upstream = value.producer()
            if upstream is not None and upstream.graph is graph:
                pending.append(upstream)
