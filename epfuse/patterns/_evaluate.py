"""Run a piece of a graph on ONNX Runtime to prove what it computes.

Some facts a rewrite depends on are easier to establish by evaluating the graph than by
matching it: which mask a subgraph builds from ``attention_mask``, which angles a run-time
cos/sin computation produces. :func:`value_dependencies` checks that the piece depends on the
graph inputs only in the allowed ways (some by value, others only through ``Shape``), so that
evaluating it over a grid of shapes covers every input it can see.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort


def value_dependencies(value: ir.Value) -> tuple[set[ir.Value], set[ir.Value]]:
    """(graph inputs read by value, graph inputs read only through their shape)."""
    by_value: set[ir.Value] = set()
    by_shape: set[ir.Value] = set()
    seen: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            by_value.add(v)
            continue
        if v.const_value is not None:
            continue
        node = v.producer()
        if node is None:
            continue
        if node.op_type == "Shape" and node.domain == "":
            src = node.inputs[0]
            if src is not None and src.is_graph_input():
                by_shape.add(src)
            elif src is not None:
                stack.extend(_shape_sources(src, seen))
            continue
        if node.op_type == "Size" and node.domain == "":
            src = node.inputs[0]
            if src is not None and src.is_graph_input():
                by_shape.add(src)
            continue
        stack.extend(i for i in node.inputs if i is not None)
        for attr_value in node.attributes.values():
            if attr_value.type == ir.AttributeType.GRAPH:
                raise _Unprovable("subgraph attribute in the analysed region")
    return by_value, by_shape - by_value


def _shape_sources(value: ir.Value, seen: set[int]) -> list[ir.Value]:
    # The shape of an intermediate value may depend on input values; be conservative and
    # treat its producer's inputs as read by value.
    node = value.producer()
    if node is None:
        return [value]
    return [i for i in node.inputs if i is not None]


class _Unprovable(Exception):
    pass


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
        # ORT's Python API cannot feed bfloat16 arrays: bf16 inputs are fed as fp32 (probe
        # values are bf16-exact) and cast inside.
        for index, value in enumerate(list(sub.inputs)):
            if value.dtype == ir.DataType.BFLOAT16:
                wide = ir.Value(
                    name=value.name, shape=value.shape, type=ir.TensorType(ir.DataType.FLOAT)
                )
                value.name = f"{wide.name}__bf16"
                cast = ir.node("Cast", [wide], {"to": ir.DataType.BFLOAT16})
                value.replace_all_uses_with(cast.outputs[0])
                sub.insert_before(sub.node(0), cast) if len(sub) else sub.append(cast)
                sub.inputs[index] = wide
        # ORT's Python API cannot return bfloat16 arrays: widen such outputs (exactly) to fp32.
        for index, out in enumerate(list(sub.outputs)):
            if out.dtype == ir.DataType.BFLOAT16:
                cast = ir.node("Cast", [out], {"to": ir.DataType.FLOAT})
                cast.outputs[0].name = f"{out.name}__fp32"
                cast.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
                sub.append(cast)
                sub.outputs[index] = cast.outputs[0]
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
