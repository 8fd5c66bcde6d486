"""KV concat into Attention's past inputs:
``Attention(q, Concat(past_k, k, axis=-2), Concat(past_v, v, axis=-2), mask)`` becomes
``Attention(q, k, v, mask, past_k, past_v) -> (y, present_k, present_v)``.

ONNX Attention defines ``present = Concat(past, new)`` on the sequence axis, so the concat
outputs are replaced by the Attention's presents and keep their names (they are usually the
model's ``present.*`` outputs). A used ``qk_matmul_output`` (the attention-sink form,
``attention_sinks``) is carried over: its scores cover past + new keys either way.

A ``Shape`` of the concatenated K/V (Phi's mask is sliced to ``key_states.shape[-2]``) may feed
the Attention's own mask: reading it off the present would make the Attention depend on its
own output (a cycle). It is computed from the parts instead, ``Shape(past) + Shape(new) *
[0, 0, 1, 0]`` (the parts agree on every axis but the concatenated one), so the mask reads
past and new only through ``Shape``, as before.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._graph import Builder, attr, input_at, producer, rank, replace_value
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


def _split_concat(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value] | None:
    concat = producer(value, "Concat")
    if concat is None or len(concat.inputs) != 2 or attr(concat, "axis") not in (2, -2):
        return None
    past, new = concat.inputs
    if past is None or new is None:
        return None
    return past, new, concat.outputs[0]


class KVConcatToAttentionPast(
    Rule, name="kv-concat-to-attention-past", stage=Stage.CANONICALIZE, anchor="Attention"
):
    """Concat(past, new) feeding Attention -> Attention past/present"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        if input_at(node, 4) is not None or input_at(node, 5) is not None:
            return None
        k_parts, v_parts = _split_concat(input_at(node, 1)), _split_concat(input_at(node, 2))
        if k_parts is None or v_parts is None:
            return None
        for past in (k_parts[0], v_parts[0]):
            if past.shape is not None and len(past.shape) != 4:
                return Kept(
                    ReasonCode.SHAPE, "KV cache is not rank 4 (batch, heads, seq, head_size)"
                )
        if any(out.uses() or out.is_graph_output() for out in node.outputs[1:3]):
            return Kept(ReasonCode.OUTPUTS_USED, "Attention already has used present outputs")
        qk = node.outputs[3] if len(node.outputs) > 3 else None
        qk_used = qk is not None and bool(qk.uses() or qk.is_graph_output())
        for past, new, present in (k_parts, v_parts):
            if _shape_uses(present) and 4 not in (rank(past), rank(new)):
                return Kept(
                    ReasonCode.SHAPE,
                    "the shape of the concatenated KV cache is read and its rank is unknown",
                )
        return node, k_parts, v_parts, qk if qk_used else None

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, k_parts, v_parts, qk = match
        qk_used = qk is not None
        (past_k, new_k, present_k), (past_v, new_v, present_v) = k_parts, v_parts
        inputs = [node.inputs[0], new_k, new_v, input_at(node, 3), past_k, past_v]
        fused = ir.node(
            "Attention",
            inputs,
            {name: a for name, a in node.attributes.items()},
            num_outputs=4 if qk_used else 3,
            name=node.name,
            metadata_props=dict(node.metadata_props),
        )
        for past, new, present in (k_parts, v_parts):
            _shapes_from_parts(ctx.graph, past, new, present)
        ctx.graph.insert_before(node, fused)
        y, new_present_k, new_present_v = fused.outputs[:3]
        if qk_used:
            new_qk = fused.outputs[3]
            new_qk.shape, new_qk.type = qk.shape, qk.type
            new_qk.name, qk.name = qk.name, None
            replace_value(qk, new_qk)
        y.name, y.shape, y.type = node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type
        node.outputs[0].name = None
        replace_value(node.outputs[0], y)
        for old, new in ((present_k, new_present_k), (present_v, new_present_v)):
            new.shape, new.type = old.shape, old.type
            if old.name and not old.is_graph_output():
                new.name, old.name = old.name, None
            replace_value(old, new)
        ctx.graph.remove(node, safe=True)
        return Rewritten("KV concat moved into Attention past/present")


def _shape_uses(value: ir.Value) -> list[ir.Node]:
    return [
        use.node for use in value.uses() if use.node.op_type == "Shape" and use.node.domain == ""
    ]


def _shapes_from_parts(graph: ir.Graph, past: ir.Value, new: ir.Value, present: ir.Value) -> None:
    """Replace each ``Shape(present)`` by the shape computed from ``past`` and ``new``."""
    shapes = _shape_uses(present)
    if not shapes:
        return
    concat = present.producer()
    assert concat is not None
    b = Builder(graph, concat, f"{concat.name or 'kv'}/shape")
    axis = b.const("seq_axis", np.array([0, 0, 1, 0], np.int64))
    full = b.op("Add", [b.op("Shape", [past]), b.op("Mul", [b.op("Shape", [new]), axis])])
    full.dtype, full.shape = ir.DataType.INT64, ir.Shape([4])
    for shape in shapes:
        start, end = attr(shape, "start"), attr(shape, "end")
        out = full
        if start is not None or end is not None:
            starts = b.const("start", np.array([start or 0], np.int64))
            ends = b.const("end", np.array([4 if end is None else end], np.int64))
            out = b.op("Slice", [full, starts, ends])
            out.dtype, out.shape = ir.DataType.INT64, shape.outputs[0].shape
        replace_value(shape.outputs[0], out)
        graph.remove(shape, safe=True)
