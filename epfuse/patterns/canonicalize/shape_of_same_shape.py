"""``Shape`` of an op whose output has its input's shape reads the input's shape instead.

TorchScript traces read sizes off intermediate tensors: transformers' attention takes
``query.shape`` after the rotation, so a ``Shape`` hangs on the rotated Q. Once attention is
fused (the rotation moves inside GroupQueryAttention), that ``Shape`` alone would keep the
RotaryEmbedding on Q alive: dead compute on every step. ONNX specifies the output of
RotaryEmbedding and of RMSNormalization to have the shape of input 0, so reading the shape
there is exact for every input, and the op is left to the consumers that need its values.
"""

from __future__ import annotations

import onnx_ir as ir

from ..base import RewriteContext, Rewritten, Rule, Stage

# ONNX ops whose output 0 has exactly the shape of input 0 (their schemas say so).
_SAME_SHAPE = frozenset({"RotaryEmbedding", "RMSNormalization"})


class ShapeOfSameShapeOp(
    Rule, name="shape-of-same-shape-op", stage=Stage.CANONICALIZE, anchor="Shape"
):
    """Shape(RotaryEmbedding(x)) / Shape(RMSNormalization(x)) -> Shape(x)"""

    def match(self, node: ir.Node, ctx: RewriteContext) -> tuple[ir.Node, ir.Node] | None:
        source = node.inputs[0]
        op = source.producer() if source is not None else None
        if op is None or op.domain != "" or op.op_type not in _SAME_SHAPE:
            return None
        if source is not op.outputs[0] or op.inputs[0] is None:
            return None
        return node, op

    def rewrite(self, match: tuple[ir.Node, ir.Node], ctx: RewriteContext) -> Rewritten:
        node, op = match
        node.replace_input_with(0, op.inputs[0])
        return Rewritten(f"reads the shape of {op.op_type}'s input")
