"""Norm fusions per EP: only what the record allows, standard ops everywhere else.

* ``Add(a, b)`` feeding ``RMSNormalization`` -> ``com.microsoft::SkipSimplifiedLayerNormalization``
  (record flag ``skip_simplified_layer_norm``); the residual sum that later layers read is the
  fused op's 4th output ``input_skip_bias_sum``.
* ``Add(a, b)`` feeding ``LayerNormalization`` -> ``com.microsoft::SkipLayerNormalization``
  (``skip_layer_norm``), likewise.
* ``RMSNormalization`` -> ORT's ``SimplifiedLayerNormalization`` (default domain, not an ONNX
  op) where the record has ``simplified_layer_norm`` but not ``rms_normalization``, and the
  reverse where the record has ``rms_normalization`` but not ``simplified_layer_norm``.

Preconditions (checked before any edit): normalization over the last axis only, a 1-D scale
(and bias) as wide as that axis, ``stash_type`` 1 (fp32 statistics, what the fused kernels
compute), and for the skip fusions two Add operands of provably the same shape (rank 2 or 3;
the fused op does not broadcast). ``epsilon`` is always written explicitly: the contrib ops
default to 1e-12, the ONNX ones to 1e-5.
"""

from __future__ import annotations

import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._graph import attr, dim, ensure_opset, input_at, substitute
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..matcher import Var, match_value, op
from ..reasons import ReasonCode

_ONNX_DEFAULT_EPS = 1e-5


def _last_axis_norm(node: ir.Node, has_bias: bool) -> tuple[int, float] | str:
    """(width, epsilon) when ``node`` normalizes the last axis with 1-D scale (and bias)."""
    x = node.inputs[0]
    if x.shape is None:
        return "the normalized input has no known rank"
    rank = len(x.shape)
    axis = int(attr(node, "axis", -1))
    if axis not in (-1, rank - 1):
        return f"normalizes from axis {axis}, not the last axis only"
    if int(attr(node, "stash_type", 1)) != 1:
        return "stash_type is not 1 (fp32 statistics)"
    width = x.shape[-1]
    if not isinstance(width, int):
        return "the normalized width is not static"
    scale = input_at(node, 1)
    if scale is None:
        return "no scale input"
    for p in (scale, input_at(node, 2) if has_bias else None):
        if p is not None and (p.shape is None or list(p.shape) != [width]):
            return f"scale/bias is not 1-D of width {width}"
    return width, float(attr(node, "epsilon", _ONNX_DEFAULT_EPS))


_RESIDUAL = op.Add(Var("a"), Var("b"), bind="add")


def _residual_add(node: ir.Node) -> tuple[ir.Node, ir.Value, ir.Value] | str | None:
    """The Add feeding ``node`` with operands of provably the same shape."""
    found = match_value(_RESIDUAL, node.inputs[0])
    if found is None:
        return None
    add, a, b = found.node("add"), found["a"], found["b"]
    if a.shape is None or b.shape is None:
        return "residual Add operand shapes are unknown"
    if len(a.shape) != len(b.shape) or len(a.shape) not in (2, 3):
        return "residual Add operands are not both rank 2 or 3"
    for axis in range(len(a.shape)):
        da, db = dim(a, axis), dim(b, axis)
        if da != db or (not isinstance(da, int) and da[0] != "sym"):
            return "residual Add operands are not provably the same shape (broadcast?)"
    if a.dtype != b.dtype:
        return "residual Add operands differ in dtype"
    return add, a, b


class _SkipNormFusion(Rule, stage=Stage.LOWER):
    fused_op: str
    has_bias: bool

    def match(self, node: ir.Node, ctx: RewriteContext):
        found = _residual_add(node)
        if found is None:
            return None
        if isinstance(found, str):
            return Kept(ReasonCode.FORM, found)
        add, a, b = found
        checked = _last_axis_norm(node, self.has_bias)
        if isinstance(checked, str):
            return Kept(ReasonCode.SHAPE, checked)
        _, epsilon = checked
        if len(node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return Kept(ReasonCode.OUTPUTS_USED, "the normalization's statistics outputs are used")
        return node, add, a, b, epsilon

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, add, a, b, epsilon = match
        params = [input_at(node, 1)]
        if self.has_bias:
            params.append(input_at(node, 2))
        ensure_opset(ctx.model, "com.microsoft", 1)
        fused = ir.node(
            self.fused_op,
            [a, b, *params],
            {"epsilon": epsilon},
            domain="com.microsoft",
            num_outputs=4,
            name=f"{node.name or self.fused_op}/{self.fused_op}",
        )
        y, _, _, summed = fused.outputs
        substitute(ctx.graph, [add, node], fused, [(node.outputs[0], y), (add.outputs[0], summed)])
        return Rewritten(f"residual Add + {node.op_type} -> {self.fused_op}")


class SkipRMSNormFusion(
    _SkipNormFusion,
    name="skip-simplified-layer-norm",
    anchor="RMSNormalization",
    emits=(Capability.SKIP_SIMPLIFIED_LAYER_NORM,),
    # Before rms-norm-to-simplified-layer-norm: renaming the norm first hides the
    # residual Add + RMSNormalization pair from this fusion.
    benefit=2,
):
    """residual Add + RMSNormalization -> SkipSimplifiedLayerNormalization"""

    fused_op = "SkipSimplifiedLayerNormalization"
    has_bias = False


class SkipLayerNormFusion(
    _SkipNormFusion,
    name="skip-layer-norm",
    anchor="LayerNormalization",
    emits=(Capability.SKIP_LAYER_NORM,),
):
    """residual Add + LayerNormalization -> SkipLayerNormalization"""

    fused_op = "SkipLayerNormalization"
    has_bias = True


class _RenameNorm(Rule, stage=Stage.LOWER):
    """One norm op into its same-semantics twin: same inputs, same attributes."""

    target: str
    lack: Capability
    """The anchor's own capability: an EP that runs the anchor keeps it."""

    def requires(self, ops, ep):
        lacking = super().requires(ops, ep)
        if lacking is None and self.lack.supported_by(ops):
            return f"{ep.name} runs {self.anchor[1]} itself"
        return lacking

    def match(self, node: ir.Node, ctx: RewriteContext):
        checked = _last_axis_norm(node, False)
        if isinstance(checked, str):
            return Kept(ReasonCode.SHAPE, checked)
        _, epsilon = checked
        if len(node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return Kept(ReasonCode.OUTPUTS_USED, "the normalization's extra outputs are used")
        return node, epsilon

    def check(self, match, ctx: RewriteContext) -> Kept | None:
        if self.target == "RMSNormalization" and ctx.model.opset_imports.get("", 0) < 23:
            return Kept(ReasonCode.OPSET, "RMSNormalization needs opset 23")
        return None

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, epsilon = match
        attributes = {"axis": -1, "epsilon": epsilon, "stash_type": 1}
        new = ir.node(
            self.target,
            [node.inputs[0], input_at(node, 1)],
            attributes,
            name=f"{node.name or self.target}/{self.target}",
        )
        substitute(ctx.graph, [node], new, [(node.outputs[0], new.outputs[0])])
        return Rewritten(f"{node.op_type} -> {self.target}")


class RMSNormToSimplified(
    _RenameNorm,
    name="rms-norm-to-simplified-layer-norm",
    anchor="RMSNormalization",
    emits=(Capability.SIMPLIFIED_LAYER_NORM,),
):
    """RMSNormalization -> SimplifiedLayerNormalization (EPs without RMSNormalization)"""

    target = "SimplifiedLayerNormalization"
    lack = Capability.RMS_NORMALIZATION


class SimplifiedToRMSNorm(
    _RenameNorm,
    name="simplified-layer-norm-to-rms-norm",
    anchor="SimplifiedLayerNormalization",
    emits=(Capability.RMS_NORMALIZATION,),
):
    """SimplifiedLayerNormalization -> RMSNormalization (EPs without the ORT op)"""

    target = "RMSNormalization"
    lack = Capability.SIMPLIFIED_LAYER_NORM
