"""ONNX ``Attention`` / ``RotaryEmbedding`` / ``RMSNormalization`` -> primitive ops, for an EP
whose record does not take the op (or, for ``Attention``, its softcap).

The expansion is the op's ONNX function body (``_expand``), built for the node's attributes
and input types: the inverse of the canonicalize lifts (``sdpa``, ``rotate_half``,
``rms_norm``), by the standard's definition. Preconditions: known input dtypes and ranks, and
a body ONNX can build at the model's opset; otherwise the node is kept and the run fails the
final conformance check with the reason.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir

from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode
from ._common import missing, why
from ._expand import expand, function_body


class _ExpandToPrimitives(Rule, stage=Stage.LEGALIZE):
    layer_result: ClassVar[str | None] = None

    def match(self, node: ir.Node, ctx: RewriteContext):
        flags = missing(node, ctx)
        if not flags:
            return None
        opset = ctx.model.opset_imports.get("", ctx.model.graph.opset_imports.get("", 0))
        body = function_body(node, opset)
        if isinstance(body, str):
            return Kept(
                ReasonCode.EP_UNSUPPORTED, f"{why(node, ctx, flags)}; cannot expand it: {body}"
            )
        return node, flags, body

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, flags, body = match
        count = expand(node, ctx.graph, body)
        note = (
            f"{why(node, ctx, flags)}: expanded to its ONNX function body ({count} primitive ops)"
        )
        if self.layer_result is None:
            return Rewritten(note)
        return Rewritten(note, layer_result=self.layer_result, fused=False)


class ExpandAttention(
    _ExpandToPrimitives, name="legalize-attention-to-primitives", anchor="Attention"
):
    """ONNX Attention the EP does not take -> MatMul/Softmax/... (its function body)"""

    layer_result = "Attention expanded to primitive ops"


class ExpandRotaryEmbedding(
    _ExpandToPrimitives, name="legalize-rotary-embedding-to-primitives", anchor="RotaryEmbedding"
):
    """ONNX RotaryEmbedding the EP does not take -> Slice/Mul/Add (its function body)"""


class ExpandRMSNormalization(
    _ExpandToPrimitives, name="legalize-rms-norm-to-primitives", anchor="RMSNormalization"
):
    """ONNX RMSNormalization the EP does not take -> ReduceMean/Sqrt/... (function body)"""
