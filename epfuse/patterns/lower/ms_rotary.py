"""ONNX ``RotaryEmbedding`` (opset 23) -> ``com.microsoft::RotaryEmbedding``, for EPs whose record
has the contrib op but not the ONNX one (DirectML, WebGPU).

It runs in the FINALIZE stage, after attention lowering: a rotation GroupQueryAttention took
(``do_rotary=1``) is gone by then, and what is left is the rotation an EP must run on its own
(``do_rotary=0``: DML has no cos/sin inputs on GQA, WebGPU's fused rotary ignores
``position_ids``).

The two ops differ in input order (ONNX: X, cos, sin, position_ids; contrib: input,
position_ids, cos, sin) and in which attributes are needed. Every attribute is carried
explicitly: ``interleaved`` (the peers lose it here), ``rotary_embedding_dim`` (partial
rotary) and ``num_heads``, which the contrib op needs whenever ``rotary_embedding_dim`` is
set. Both (B, N, S, H) and (B, S, N*H) inputs are accepted by the contrib op with the same
meaning (checked by a known-answer run on ORT 1.32 CPU for both layouts, full/partial rotary
and both pairings: bit-identical).

Preconditions: position_ids present and int64 with 2-D constant-shape (max_pos, R/2) caches
(the per-token cos/sin form has no contrib equivalent), a static head count and head size,
and ``rotary_embedding_dim`` (or the head size) equal to twice the cache width.
"""

from __future__ import annotations

import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._graph import attr, ensure_opset, input_at, substitute
from .._layout import last_dim
from ..analysis.head_counts import axis_size
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


class OnnxRotaryToContrib(
    Rule,
    name="rotary-embedding-to-contrib",
    stage=Stage.FINALIZE,
    anchor="RotaryEmbedding",
    emits=(Capability.MS_ROTARY_EMBEDDING,),
):
    """ONNX RotaryEmbedding -> com.microsoft::RotaryEmbedding (EPs without the ONNX op)"""

    def requires(self, ops, ep):
        # Only a fallback: an EP that runs the ONNX op keeps it.
        if Capability.ROTARY_EMBEDDING.supported_by(ops):
            return f"{ep.name} runs ONNX RotaryEmbedding itself"
        return super().requires(ops, ep)

    def match(self, node: ir.Node, ctx: RewriteContext):
        x, cos, sin, positions = (input_at(node, i) for i in range(4))
        if cos is None or sin is None or positions is None:
            return Kept(
                ReasonCode.NOT_EXPRESSIBLE,
                "RotaryEmbedding without position_ids (per-token cos/sin): no contrib form",
            )
        if positions.dtype != ir.DataType.INT64:
            return Kept(ReasonCode.DTYPE, "position_ids are not int64")
        if positions.shape is not None and len(positions.shape) != 2:
            return Kept(ReasonCode.SHAPE, "position_ids are not (batch, seq)")
        if cos.shape is None or sin.shape is None or len(cos.shape) != 2:
            return Kept(
                ReasonCode.SHAPE, "cos/sin caches are not 2-D (max_positions, rotary_dim/2)"
            )
        width = cos.shape[1]
        if not isinstance(width, int) or list(sin.shape) != list(cos.shape):
            return Kept(ReasonCode.SHAPE, "cos/sin cache width is not static and equal")
        if x.shape is None or len(x.shape) not in (3, 4):
            return Kept(ReasonCode.SHAPE, "the rotated input is not rank 3 or 4")
        if len(x.shape) == 4:
            heads, head_size = x.shape[1], x.shape[3]
            if not isinstance(heads, int) and isinstance(head_size, int):
                heads = axis_size(x, 1)
            declared = attr(node, "num_heads")
            if declared and isinstance(heads, int) and declared != heads:
                return Kept(ReasonCode.HEADS, "num_heads disagrees with the input's head axis")
        else:
            heads = attr(node, "num_heads")
            hidden = last_dim(x)
            if not heads or hidden is None or hidden % heads:
                return Kept(
                    ReasonCode.HEADS, "3-D input without a num_heads that divides its width"
                )
            head_size = hidden // heads
        if not isinstance(heads, int) or not isinstance(head_size, int):
            return Kept(ReasonCode.HEADS, "head count or head size is not static")
        rotary_dim = int(attr(node, "rotary_embedding_dim", 0) or 0) or head_size
        if rotary_dim != 2 * width or rotary_dim > head_size:
            return Kept(
                ReasonCode.SHAPE, "rotary_embedding_dim disagrees with the cos/sin cache width"
            )
        return node, heads, head_size, rotary_dim

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, heads, head_size, rotary_dim = match
        x, cos, sin, positions = (input_at(node, i) for i in range(4))
        interleaved = int(attr(node, "interleaved", 0) or 0)
        ensure_opset(ctx.model, "com.microsoft", 1)
        new = ir.node(
            "RotaryEmbedding",
            [x, positions, cos, sin],
            {
                "interleaved": interleaved,
                "num_heads": heads,
                "rotary_embedding_dim": rotary_dim,
            },
            domain="com.microsoft",
            name=f"{node.name or 'rotary'}/ms_RotaryEmbedding",
        )
        substitute(ctx.graph, [node], new, [(node.outputs[0], new.outputs[0])])
        kind = "interleaved" if interleaved else "half-split"
        partial = f", partial {rotary_dim}/{head_size}" if rotary_dim != head_size else ""
        return Rewritten(f"RotaryEmbedding -> com.microsoft::RotaryEmbedding ({kind}{partial})")
