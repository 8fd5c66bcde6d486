"""Expand a standard ONNX op into its ONNX function body, in place.

``Attention``, ``RotaryEmbedding`` and ``RMSNormalization`` (opset 23) are ONNX functions: the
ONNX schema itself defines each one, for the node's attributes and input types, as a graph of
primitive ops (MatMul, Softmax, Tanh, Where, Slice, ReduceMean, ...). Inlining that body is the
exact inverse of lifting the primitive form into the op: it computes, by the standard's own
definition, what the op computes. The legalization rules use it for an EP whose record takes
none of the fused forms (tests compare the expanded graph with the op on ORT CPU).

The body is built by ONNX (``OpSchema.get_context_dependent_function_with_opset_version``) for
the node's concrete attributes, present inputs and input types, at the model's default-domain
opset; nothing here re-derives the semantics.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from .._graph import replace_value


def _type_proto(value: ir.Value) -> onnx.TypeProto | str:
    if value.dtype is None:
        return "an input's dtype is unknown"
    if value.shape is None:
        return "an input's rank is unknown"
    dims = [d if isinstance(d, int) else (str(d) if d is not None else None) for d in value.shape]
    return onnx.helper.make_tensor_type_proto(int(value.dtype), dims)


def function_body(node: ir.Node, opset: int) -> onnx.FunctionProto | str:
    """The ONNX function body of ``node`` at ``opset``, or why there is none."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return f"no ONNX schema for {node.op_type} at opset {opset}"
    if not schema.has_context_dependent_function and not schema.has_function:
        return f"ONNX defines no function body for {node.op_type}-{schema.since_version}"
    proto = ir.serde.serialize_node(node)
    del proto.input[:]
    proto.input.extend(f"in{i}" if v is not None else "" for i, v in enumerate(node.inputs))
    del proto.output[:]
    proto.output.extend(
        f"out{i}" if (o.uses() or o.is_graph_output()) else "" for i, o in enumerate(node.outputs)
    )
    types = []
    for value in node.inputs:
        if value is None:
            types.append(onnx.TypeProto())
            continue
        t = _type_proto(value)
        if isinstance(t, str):
            return t
        types.append(t)
    try:
        if schema.has_context_dependent_function:
            raw = schema.get_context_dependent_function_with_opset_version(
                opset, proto.SerializeToString(), [t.SerializeToString() for t in types]
            )
        else:
            raw = schema.get_function_with_opset_version(opset)
    except Exception as err:  # ONNX refuses to build it for these attributes/types
        return f"ONNX cannot build the function body of {node.op_type}: {err}"
    if not raw:
        return f"ONNX built no function body for {node.op_type} at opset {opset}"
    body = onnx.FunctionProto()
    if isinstance(raw, bytes):
        body.ParseFromString(raw)
    else:
        body = raw
    for fn in body.node:
        if fn.domain not in ("", "ai.onnx"):
            return f"the function body of {node.op_type} uses {fn.domain}::{fn.op_type}"
        for a in fn.attribute:
            if a.ref_attr_name or a.type in (
                onnx.AttributeProto.GRAPH,
                onnx.AttributeProto.GRAPHS,
            ):
                return f"the function body of {node.op_type} has attribute references or subgraphs"
    return body


def expand(node: ir.Node, graph: ir.Graph, body: onnx.FunctionProto) -> int:
    """Replace ``node`` by ``body``'s nodes (inserted before it); return how many were added."""
    env: dict[str, ir.Value | None] = {"": None}
    for formal, actual in zip(body.input, node.inputs, strict=False):
        env[formal] = actual
    # Formal inputs beyond the node's inputs are absent.
    for formal in body.input[len(node.inputs) :]:
        env[formal] = None
    prefix = node.name or node.op_type
    added = 0
    for index, fn in enumerate(body.node):
        inputs = [env[name] if name else None for name in fn.input]
        attributes = [ir.serde.deserialize_attribute(a) for a in fn.attribute]
        new = ir.Node(
            "",
            fn.op_type,
            inputs,
            attributes=attributes,
            num_outputs=len(fn.output),
            name=f"{prefix}/{fn.op_type}_{index}",
            metadata_props=dict(node.metadata_props),
        )
        graph.insert_before(node, new)
        added += 1
        for name, value in zip(fn.output, new.outputs, strict=True):
            value.name = f"{prefix}/{name}"
            if name:
                env[name] = value
    for formal, old in zip(body.output, node.outputs, strict=False):
        if not (old.uses() or old.is_graph_output()):
            continue
        new_value = env[formal]
        assert new_value is not None
        new_value.shape, new_value.type = old.shape, old.type
        replace_value(old, new_value)
    graph.remove(node, safe=True)
    return added
