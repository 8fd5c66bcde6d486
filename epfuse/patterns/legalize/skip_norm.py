"""``com.microsoft::SkipSimplifiedLayerNormalization`` -> ``Add`` (+ bias ``Add``) +
ONNX ``RMSNormalization``, for an EP whose record lacks the contrib op (a CPU-optimized model
re-targeted to ``default``, OpenVINO, CoreML ...).

Exact by definition: the contrib op normalizes ``input + skip (+ bias)`` over the last axis
with fp32 statistics, ``y = s / sqrt(mean(s^2) + epsilon) * gamma``, and returns that sum as
its 4th output; ``RMSNormalization(axis=-1, stash_type=1)`` computes the same ``y``. The
contrib epsilon default (1e-12) is written explicitly, since the ONNX op's is 1e-5.
Preconditions: the mean / inv_std_var outputs unused (the ONNX op has none), opset >= 23.
Where the record also lacks ``RMSNormalization``, the stage's next sweep expands it to
primitives (``expand``).
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph import attr, input_at, substitute
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode
from ._common import missing, why

_CONTRIB_DEFAULT_EPS = 1e-12


class SkipSimplifiedToAddRMSNorm(
    Rule,
    name="legalize-skip-simplified-layer-norm",
    stage=Stage.LEGALIZE,
    anchor=("com.microsoft", "SkipSimplifiedLayerNormalization"),
):
    """SkipSimplifiedLayerNormalization the EP does not take -> Add + RMSNormalization"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        flags = missing(node, ctx)
        if not flags:
            return None
        reason = why(node, ctx, flags)
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:3]):
            return Kept(
                ReasonCode.OUTPUTS_USED,
                f"{reason}; its mean/inv_std_var outputs are used (no ONNX form)",
            )
        opset = ctx.model.opset_imports.get("", ctx.model.graph.opset_imports.get("", 0))
        if opset < 23:
            return Kept(
                ReasonCode.OPSET,
                f"{reason}; RMSNormalization needs opset 23 (the model has {opset})",
            )
        x, skip, gamma = node.inputs[0], input_at(node, 1), input_at(node, 2)
        if x is None or skip is None or gamma is None:
            return Kept(ReasonCode.FORM, f"{reason}; an input is missing")
        return node, reason

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, reason = match
        x, skip, gamma, bias = (
            node.inputs[0],
            input_at(node, 1),
            input_at(node, 2),
            input_at(node, 3),
        )
        base = node.name or "SkipSimplifiedLayerNormalization"
        add = ir.node("Add", [x, skip], name=f"{base}/Add")
        ctx.graph.insert_before(node, add)
        summed = add.outputs[0]
        if bias is not None:
            add_bias = ir.node("Add", [summed, bias], name=f"{base}/AddBias")
            ctx.graph.insert_before(node, add_bias)
            summed = add_bias.outputs[0]
        epsilon = float(attr(node, "epsilon", _CONTRIB_DEFAULT_EPS))
        norm = ir.node(
            "RMSNormalization",
            [summed, gamma],
            {"axis": -1, "epsilon": epsilon, "stash_type": 1},
            name=f"{base}/RMSNormalization",
        )
        replaced = [(node.outputs[0], norm.outputs[0])]
        if len(node.outputs) > 3:
            replaced.append((node.outputs[3], summed))
        substitute(ctx.graph, [node], norm, replaced)
        return Rewritten(f"{reason}: SkipSimplifiedLayerNormalization -> Add + RMSNormalization")
