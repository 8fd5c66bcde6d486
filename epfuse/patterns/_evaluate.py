"""Run a piece of a graph on ONNX Runtime to prove what it computes.

Some facts a rewrite depends on are easier to establish by evaluating the graph than by
matching it: which mask a subgraph builds from ``attention_mask``, which angles a run-time
cos/sin computation produces. :func:`value_dependencies` checks that the piece depends on the
graph inputs only in the allowed ways (some by value, others only through ``Shape``), so that
evaluating it over a grid of shapes covers every input it can see.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort


def value_dependencies(
    value: ir.Value, cut: Collection[ir.Value] = ()
) -> tuple[set[ir.Value], set[ir.Value]]:
    """(graph inputs read by value, graph inputs read only through their shape).

    Values in ``cut`` count as inputs (an evaluation fed there, e.g. positions the graph
    computes from the cache length).

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
