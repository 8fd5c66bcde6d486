"""Run a piece of a graph on ONNX Runtime to prove what it computes.

Some facts a rewrite depends on are easier to establish by evaluating the graph than by
matching it: which mask a subgraph builds from ``attention_mask``, which angles a run-time
cos/sin computation produces. :func:`value_dependencies` checks that the piece depends on the
graph inputs only in the allowed ways (some by value, others only through ``Shape``), so that
evaluating it over a grid of shapes covers every input it can see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort


@dataclasses.dataclass(frozen=True)
class ShapeCut:
    """A ``Shape``/``Size`` of an intermediate value whose inferred shape names only static
    sizes and dims of graph inputs: an evaluation is fed its vector (:meth:`vector`) at
    ``value`` instead of running everything that value is computed from.

    Why: transformers 4.x slices a layer's mask to ``key_states.shape[-2]``, so the mask of
    layer ``l`` reads (by shape) the key of layer ``l``, computed from the output of every layer
    before it. Evaluating that region runs the whole prefix of the model for each layer
    (quadratic in depth) and, once an earlier layer is GroupQueryAttention, fails at probes
    ORT CPU's GQA refuses (batch > 1 chunked prefill). The key's inferred shape, e.g.
    ``[batch_size, 2, sequence_length, 32]``, already says which input dims it is.
    """

    value: ir.Value
    dims: tuple[int | tuple[str, int], ...]  # a static size, or (graph input name, axis)
    size: bool = False  # Size: the product of the dims
    start: int | None = None  # Shape's start/end attributes (opset 15)
    end: int | None = None

    def vector(self, shape_of: Callable[[str], Sequence[int] | None]) -> np.ndarray | None:
        """The cut's value when graph input ``name`` is fed with shape ``shape_of(name)``."""
        sizes = []
        for d in self.dims:
            if isinstance(d, int):
                sizes.append(d)
                continue
            shape = shape_of(d[0])
            if shape is None:
                return None
            sizes.append(int(shape[d[1]]))
        if self.size:
            return np.asarray(int(np.prod(sizes, dtype=np.int64)), dtype=np.int64)
        return np.asarray(sizes[slice(self.start, self.end)], dtype=np.int64)


def _shape_cut(node: ir.Node, dim_sources: Mapping[str, tuple[str, int]]) -> ShapeCut | None:
    src = node.inputs[0] if node.inputs else None
    if src is None or src.is_graph_input() or src.shape is None:
        return None
    dims: list[int | tuple[str, int]] = []
    for d in src.shape:
        if isinstance(d, int):
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value in dim_sources:
            dims.append(dim_sources[d.value])
        else:
            return None
    start = end = None
    if node.op_type == "Shape":
        start_attr, end_attr = node.attributes.get("start"), node.attributes.get("end")
        start = start_attr.as_int() if start_attr is not None else None
        end = end_attr.as_int() if end_attr is not None else None
    return ShapeCut(node.outputs[0], tuple(dims), node.op_type == "Size", start, end)


def _dim_sources(graph: ir.Graph) -> dict[str, tuple[str, int]]:
    """Each symbolic dim name of ``graph``'s inputs -> the first (input, axis) carrying it."""
    sources: dict[str, tuple[str, int]] = {}
    for value in graph.inputs:
        for axis, d in enumerate(value.shape or ()):
            if isinstance(d, ir.SymbolicDim) and d.value and d.value not in sources:
                sources[d.value] = (value.name, axis)
    return sources


def value_dependencies(
    value: ir.Value,
    cut: Collection[ir.Value] = (),
    *,
    shape_cuts: tuple[ir.Graph, list[ShapeCut]] | None = None,
) -> tuple[set[ir.Value], set[ir.Value]]:
    """(graph inputs read by value, graph inputs read only through their shape).

    Values in ``cut`` count as inputs (an evaluation fed there, e.g. positions the graph
    computes from the cache length).

    ``shape_cuts=(graph, cuts)``: a ``Shape``/``Size`` whose source's inferred shape is made
    of static sizes and ``graph``'s input dims (see :class:`ShapeCut`) is appended to
    ``cuts`` and read as those inputs by shape, its source not walked; the caller evaluates
    with the cuts as inputs (``SubgraphEvaluator(..., inputs=[..., *cut values])``).

    ``Shape`` of an intermediate value reads the inputs that value's *shape* depends on:
    found by :func:`_shape_operands`, which knows which operands of an op decide the output
    shape by their value (a Reshape target, Slice bounds) and which only by their shape (the
    data of elementwise ops, MatMul, Gather, ...). So ``Shape(Gather(embedding, input_ids))``
    reads ``input_ids`` only through its shape, and evaluating the piece at every probe
    size covers all it can see.
    """
    by_value: set[ir.Value] = set()
    by_shape: set[ir.Value] = set()
    seen: set[int] = set()
    seen_shape: set[int] = set()
    stack = [value]
    shape_stack: list[ir.Value] = []
    cut_ids = {id(v) for v in cut}
    sources = _dim_sources(shape_cuts[0]) if shape_cuts is not None else {}
    named = {v.name: v for v in shape_cuts[0].inputs} if shape_cuts is not None else {}
    while stack or shape_stack:
        if shape_stack:
            v = shape_stack.pop()
            if id(v) in seen_shape:
                continue
            seen_shape.add(id(v))
            if v.is_graph_input() or id(v) in cut_ids:
                by_shape.add(v)
                continue
            if v.const_value is not None or v.producer() is None:
                continue
            node = v.producer()
            _check_no_subgraph(node)
            read_value, read_shape = _shape_operands(node)
            stack.extend(read_value)
            shape_stack.extend(read_shape)
            continue
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input() or id(v) in cut_ids:
            by_value.add(v)
            continue
        if v.const_value is not None:
            continue
        node = v.producer()
        if node is None:
            continue
        if node.op_type in ("Shape", "Size") and node.domain == "":
            if shape_cuts is not None and (found := _shape_cut(node, sources)) is not None:
                shape_cuts[1].append(found)
                by_shape.update(named[d[0]] for d in found.dims if not isinstance(d, int))
                continue
            src = node.inputs[0]
            if src is not None:
                shape_stack.append(src)
            continue
        stack.extend(i for i in node.inputs if i is not None)
        _check_no_subgraph(node)
    return by_value, by_shape - by_value


def _check_no_subgraph(node: ir.Node) -> None:
    for attr_value in node.attributes.values():
        if attr_value.type == ir.AttributeType.GRAPH:
            raise _Unprovable("subgraph attribute in the analysed region")


# Ops whose output shape is a function of their operands' shapes (and attributes) only.
_SHAPE_FROM_SHAPES = frozenset(
    {
        "Abs", "Add", "And", "Cast", "CastLike", "Ceil", "Concat", "Cos", "Div", "Einsum",
        "Equal", "Erf", "Exp", "Flatten", "Floor", "Gather", "GatherElements", "Gelu", "Gemm",
        "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN", "LayerNormalization",
        "Less", "LessOrEqual", "Log", "LogSoftmax", "MatMul", "Max", "Min", "Mod", "Mul",
        "Neg", "Not", "Or", "Pow", "Reciprocal", "Relu", "RMSNormalization", "Shape",
        "Sigmoid", "Sign", "Sin", "Size", "Softmax", "Sqrt", "Sub", "Tanh", "Transpose",
        "Trilu", "Where", "Xor",
    }
)  # fmt: skip
# Ops whose output shape reads some operands by value: op -> indices of those operands
# (the others, if any, only by shape).
_SHAPE_FROM_VALUES = {
    "Reshape": (1,),
    "Expand": (1,),
    "Slice": (1, 2, 3, 4),
    "Unsqueeze": (1,),
    "Squeeze": (1,),
    "Tile": (1,),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "Pad": (1, 2, 3),
    "Split": (1,),
    "ReduceMean": (1,),
    "ReduceSum": (1,),
    "ReduceMax": (1,),
    "ReduceMin": (1,),
}


def _shape_operands(node: ir.Node) -> tuple[list[ir.Value], list[ir.Value]]:
    """(operands read by value, operands read by shape) that decide ``node``'s output shape.

    Unknown ops (and other domains) are conservative: every operand counts as read by value.
    """
    operands = list(node.inputs)
    if node.domain in ("", "ai.onnx"):
        if node.op_type in _SHAPE_FROM_SHAPES:
            return [], [v for v in operands if v is not None]
        by_value = _SHAPE_FROM_VALUES.get(node.op_type)
        if by_value is not None:
            read_value = [v for i, v in enumerate(operands) if v is not None and i in by_value]
            read_shape = [v for i, v in enumerate(operands) if v is not None and i not in by_value]
            return read_value, read_shape
    return [v for v in operands if v is not None], []


class _Unprovable(Exception):
    pass


def float32_boundary(graph: ir.Graph) -> None:
    """Make ``graph``'s bfloat16 inputs and outputs float32, with a Cast at the boundary
    (numpy has no bfloat16); names stay. The output Cast is an exact widening; inputs are fed
    bf16-representable values (presents of a bf16 model, integers), so their Cast is exact too.
    """
    for i, value in enumerate(list(graph.inputs)):
        if value.dtype != ir.DataType.BFLOAT16:
            continue
        fed = ir.Value(name=value.name, type=ir.TensorType(ir.DataType.FLOAT), shape=value.shape)
        value.name = f"{value.name}__epfuse_bf16"
        cast = ir.node("Cast", [fed], {"to": ir.DataType.BFLOAT16}, name=f"{fed.name}_to_bf16")
        value.replace_all_uses_with(cast.outputs[0])
        if len(graph):
            graph.insert_before(graph.node(0), cast)
        else:
            graph.append(cast)
        graph.inputs[i] = fed
    for i, out in enumerate(list(graph.outputs)):
        if out.dtype != ir.DataType.BFLOAT16:
            continue
        name = out.name
        out.name = f"{name}__epfuse_bf16"
        cast = ir.node("Cast", [out], {"to": ir.DataType.FLOAT}, name=f"{name}_to_f32")
        cast.outputs[0].name = name
        cast.outputs[0].dtype = ir.DataType.FLOAT
        cast.outputs[0].shape = out.shape
        graph.append(cast)
        graph.outputs[i] = cast.outputs[0]


class SubgraphEvaluator:
    """Compile the slice of ``graph`` between its inputs and ``outputs`` once, run it often."""

    def __init__(
        self,
        graph: ir.Graph,
        outputs: Sequence[ir.Value],
        inputs: Sequence[ir.Value] | None = None,
    ):
        """``inputs`` defaults to the graph inputs; any cut of the graph may be given."""
        sub = ir.convenience.extract(
            graph, list(graph.inputs if inputs is None else inputs), list(outputs)
        )
        used = [v for v in sub.inputs if v.uses()]
        for v in used:
            if v.type is None:  # a ShapeCut's Shape/Size output a rule made without a type
                v.type = ir.TensorType(ir.DataType.INT64)
        sub.inputs.clear()
        sub.inputs.extend(used)
        float32_boundary(sub)
        self.input_names = [v.name for v in sub.inputs]
        opsets = dict(graph.opset_imports)
        model = ir.Model(sub, ir_version=10)
        model.opset_imports.update(opsets)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        proto = ir.to_proto(model)
        self.session = ort.InferenceSession(
            proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, {k: feeds[k] for k in self.input_names})
