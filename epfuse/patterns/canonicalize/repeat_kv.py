"""Remove repeat_kv: ``Attention(q, Reshape(Expand(Unsqueeze(k, [2]))), ...)`` becomes
``Attention(q, k, ...)``, since ONNX Attention groups query heads over fewer KV heads itself
(query head h reads KV head ``h // (q_heads / kv_heads)``, which is exactly what Hugging Face's
``repeat_kv`` lays out).

Proof obligations, checked on the symbolic shape vectors: the Unsqueeze inserts axis 2 of a
rank-4 (B, Nkv, T, H) tensor; the Expand target is (B, Nkv, r, T, H) with r a constant; the
Reshape target is (B, Nkv*r, T, H) with the same symbolic B and T (or 0 / -1 where those
mean the same). K and V must be repeated alike, or nothing is changed.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .._graph import attr, const_ints, dim, initializer, input_at, producer, shape_vector
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


def _unrepeat(value: ir.Value) -> tuple[ir.Value, int] | str | None:
    reshape = producer(value, "Reshape")
    expand = producer(reshape.inputs[0], "Expand") if reshape else None
    unsqueeze = producer(expand.inputs[0], "Unsqueeze") if expand else None
    if unsqueeze is None:
        return None
    if const_ints(input_at(unsqueeze, 1)) not in ([2], [-3]):
        return "repeat_kv unsqueezes an axis other than 2"
    kv = unsqueeze.inputs[0]
    if kv.shape is not None and len(kv.shape) != 4:
        return "repeat_kv source is not rank 4"
    target = shape_vector(expand.inputs[1])
    final = shape_vector(reshape.inputs[1])
    if target is None or final is None or len(target) != 5 or len(final) != 4:
        return "repeat_kv shapes are not statically provable"
    repeats = target[2]
    if not isinstance(repeats, int) or repeats < 1:
        return "repeat_kv repeat count is not a constant"
    kv_heads, head_size = target[1], target[4]
    if not isinstance(kv_heads, int) or not isinstance(head_size, int):
        return "repeat_kv head count or head size is not a constant"
    for axis, expected in ((1, kv_heads), (3, head_size)):
        known = dim(kv, axis)
        if isinstance(known, int) and known != expected:
            return "repeat_kv target does not match the KV tensor"
    allowzero = attr(reshape, "allowzero", 0)
    for axis, expand_axis in ((0, 0), (2, 3)):
        got = final[axis]
        if got == target[expand_axis] or got == -1 or (got == 0 and not allowzero):
            continue
        return "repeat_kv reshape does not keep batch and sequence axes"
    if final[1] not in (kv_heads * repeats, -1) or final[3] not in (head_size, -1):
        return "repeat_kv reshape does not merge KV heads with repeats"
    if final.count(-1) > 1:
        return "repeat_kv reshape is ambiguous"
    return kv, repeats


class RemoveRepeatKV(
    Rule,
    name="remove-repeat-kv",
    stage=Stage.CANONICALIZE,
    anchor="Attention",
    # Before kv-concat-to-attention-past: removing the repeat exposes the Concat(past, new)
    # that rule matches on the same Attention, so both land in one sweep.
    benefit=2,
):
    """K/V repeated to the query head count -> grouped KV heads in Attention"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        k, v = input_at(node, 1), input_at(node, 2)
        if k is None or v is None or input_at(node, 4) is not None:
            return None
        got_k, got_v = _unrepeat(k), _unrepeat(v)
        if got_k is None and got_v is None:
            return None
        for got in (got_k, got_v):
            if isinstance(got, str):
                return Kept(ReasonCode.FORM, got)
        if got_k is None or got_v is None or got_k[1] != got_v[1]:
            return Kept(ReasonCode.FORM, "K and V are not repeated alike")
        return node, got_k, got_v

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, got_k, got_v = match
        k, v = node.inputs[1], node.inputs[2]
        for repeated, (kv, repeats) in ((k, got_k), (v, got_v)):
            _shapes_from_source(ctx.graph, repeated, kv, repeats)
        node.replace_input_with(1, got_k[0])
        node.replace_input_with(2, got_v[0])
        return Rewritten(f"repeat_kv x{got_k[1]} removed")


def _shapes_from_source(graph: ir.Graph, repeated: ir.Value, kv: ir.Value, repeats: int) -> None:
    """Each ``Shape`` of the repeated K/V reads the source's instead (times ``repeats`` on the
    head axis): the proof above makes the repeated shape (B, Nkv*r, T, H) of the source's
    (B, Nkv, T, H). transformers 4.x slices the mask to ``key_states.shape[-2]`` after
    repeat_kv; left on the repeated value, that Shape would keep repeat_kv alive and, once the
    KV concat becomes the Attention's present, make the Attention read its own output."""
    for use in list(repeated.uses()):
        shape = use.node
        if (shape.domain, shape.op_type) != ("", "Shape"):
            continue
        start, end = attr(shape, "start", 0), attr(shape, "end", 4)
        start, end = (max(0, min(4, i + 4 if i < 0 else i)) for i in (start, end))
        heads = start <= 1 < end and repeats != 1
        out = shape.outputs[0]
        if heads and out.is_graph_output():
            continue  # (a graph output would need a new name; no exporter writes this)
        shape.replace_input_with(0, kv)
        if not heads:
            continue
        factor = np.ones(4, np.int64)
        factor[1] = repeats
        const = initializer(graph, f"{shape.name or 'kv'}/repeat/factor", factor[start:end])
        mul = ir.node("Mul", [out, const], name=f"{shape.name or 'kv'}/repeat/Mul")
        scaled = mul.outputs[0]
        scaled.name = f"{mul.name}_out0"
        scaled.dtype, scaled.shape = ir.DataType.INT64, out.shape
        for consumer in list(out.uses()):
            if consumer.node is not mul:
                consumer.node.replace_input_with(consumer.idx, scaled)
        graph.insert_after(shape, mul)
