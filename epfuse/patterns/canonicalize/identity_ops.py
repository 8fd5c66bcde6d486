"""Ops that compute their input: their readers read the input instead.

Traces leave such nodes where they stand between a graph input or an op and what a later rule
matches, so the fused op would read a copy, or the pattern would not be seen:

* ``Concat`` of one input. TorchScript traces of transformers' cache code leave
  ``Concat(past_key_values.0.key)`` in front of the first layer's past; the fused
  GroupQueryAttention would read a copy instead of the past itself (onnxruntime-genai shares
  the past and present buffers only when the attention reads the graph input). ONNX defines a
  one-tensor Concat as that tensor, for every axis.
* ``Cast`` to the type its input already has. transformers 4.x's eager attention casts the
  softmax back to the query's dtype (``softmax(...).to(query.dtype)``); traced in float32 that
  is a float32 -> float32 Cast between the softmax and its readers, which hides GPT-OSS's sink
  column slice from the attention-sinks rule. ONNX defines such a Cast as the identity (its
  ``saturate`` attribute acts only on float8 targets' out-of-range values, which a float8
  input cannot hold).

A node whose output is a graph output stays: its name is part of the model's signature.
"""

from __future__ import annotations

import onnx_ir as ir

from ..base import RewriteContext, Rewritten, Rule, Stage


class _IdentityOp(Rule, stage=Stage.CANONICALIZE):
    """The shared match and rewrite: ``is_identity`` says whether this node computes its
    first input."""

    why: str

    def is_identity(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def match(self, node: ir.Node, ctx: RewriteContext) -> ir.Node | None:
        if not node.inputs or node.inputs[0] is None or node.outputs[0].is_graph_output():
            return None
        return node if self.is_identity(node) else None

    def rewrite(self, node: ir.Node, ctx: RewriteContext) -> Rewritten:
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        ctx.graph.remove(node, safe=True)
        return Rewritten(self.why)


class SingleInputConcat(_IdentityOp, name="single-input-concat", anchor="Concat"):
    """Concat(x) -> x"""

    why = "a one-input Concat is its input"

    def is_identity(self, node: ir.Node) -> bool:
        return len(node.inputs) == 1


class SameTypeCast(_IdentityOp, name="same-type-cast", anchor="Cast"):
    """Cast(x, to=dtype(x)) -> x"""

    why = "a Cast to its input's own type is its input"

    def is_identity(self, node: ir.Node) -> bool:
        to = node.attributes.get("to")
        dtype = node.inputs[0].dtype
        return to is not None and dtype is not None and ir.DataType(to.as_int()) == dtype
