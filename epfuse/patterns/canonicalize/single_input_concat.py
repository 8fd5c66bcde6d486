"""A ``Concat`` of one input is that input.

TorchScript traces of transformers' cache code can leave ``Concat(past_key_values.0.key)``
(a concatenation over a one-element list) in front of the first layer's past. It computes
nothing, but it stands between the graph input and the attention's past, so the fused
GroupQueryAttention would read a copy instead of the past itself (onnxruntime-genai shares
the past and present buffers only when the attention reads the graph input). ONNX defines
Concat of a single tensor as that tensor, for every axis, so its readers can read the input.
"""

from __future__ import annotations

import onnx_ir as ir

from ..base import RewriteContext, Rewritten, Rule, Stage


class SingleInputConcat(
    Rule, name="single-input-concat", stage=Stage.CANONICALIZE, anchor="Concat"
):
    """Concat(x) -> x"""

    def match(self, node: ir.Node, ctx: RewriteContext) -> ir.Node | None:
        if len(node.inputs) != 1 or node.inputs[0] is None:
            return None
        if node.outputs[0].is_graph_output():  # its name is part of the model's signature
            return None
        return node

    def rewrite(self, node: ir.Node, ctx: RewriteContext) -> Rewritten:
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        ctx.graph.remove(node, safe=True)
        return Rewritten("a one-input Concat is its input")
