"""A ``Cast`` to the type its input already has is that input.

transformers 4.x's eager attention casts the softmax back to the query's dtype
(``softmax(...).to(query.dtype)``); traced in float32 that is a float32 -> float32 ``Cast``
between the softmax and what reads it, which hides GPT-OSS's sink column slice from the
attention-sinks rule. ONNX defines a Cast to the input's own type as the identity (its
``saturate`` attribute only acts on float8 targets, and then only on values out of range,
which a float8 input cannot hold), so its readers can read the input.
"""

from __future__ import annotations

import onnx_ir as ir

from ..base import RewriteContext, Rewritten, Rule, Stage


class SameTypeCast(Rule, name="same-type-cast", stage=Stage.CANONICALIZE, anchor="Cast"):
    """Cast(x, to=dtype(x)) -> x"""

    def match(self, node: ir.Node, ctx: RewriteContext) -> ir.Node | None:
        source = node.inputs[0] if node.inputs else None
        to = node.attributes.get("to")
        if source is None or source.dtype is None or to is None:
            return None
        if ir.DataType(to.as_int()) != source.dtype:
            return None
        if node.outputs[0].is_graph_output():  # its name is part of the model's signature
            return None
        return node

    def rewrite(self, node: ir.Node, ctx: RewriteContext) -> Rewritten:
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        ctx.graph.remove(node, safe=True)
        return Rewritten("a Cast to its input's own type is its input")
