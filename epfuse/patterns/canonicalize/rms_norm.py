"""Decomposed RMSNorm -> ONNX ``RMSNormalization`` (opset 23).

Below opset 23 Hugging Face's RMSNorm exports as::

    xf = [Cast(x, float)]                              # half-precision exports
    r  = Reciprocal(Sqrt(ReduceMean(Pow(xf, 2), [-1], keepdims=1) + eps))  # or Div(1, Sqrt)
    n  = xf * r                                        # or Div(xf, Sqrt(...))

(ReduceMean's axes are an input from opset 18, an attribute before; the TorchScript exporter
behind Optimum writes ``torch.rsqrt`` as ``Div(1, Sqrt)`` and its opset-14..17 ReduceMean with
the attribute, which the opset raise to 23 converts in place, see ``_opset``.)
    y  = w * [Cast(n, T)]

ONNX ``RMSNormalization(x, w, axis=-1, epsilon=eps, stash_type=1)`` is defined (its function
body) as: cast x to float, divide by ``sqrt(mean(x^2) + eps)``, cast back to T, multiply by
the scale -- the same steps in the same order, so both forms round identically (up to the
kernel's own float32 summation order). The computation must therefore be float32: an fp16
norm computed *in fp16* (no Cast) is left alone, since stash_type=1 would round differently.

Checked before anything changes: the Pow exponent is 2 (or ``Mul(x, x)``), the mean is over the
last axis only with keepdims, eps is a constant scalar, the Mul/Div reads the same x that was
squared, the Casts (if any) go T -> float -> T, and the weight broadcasts over the last axis
only (rank <= 1, or leading dims of 1).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from .._graph import (
    attr,
    const_ints,
    const_scalar,
    input_at,
    only_consumer,
    producer,
    remove_dead,
    replace_value,
)
from .._opset import require_default_opset
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    if len(node.inputs) != 2:
        return None
    a, b = node.inputs
    if a is value:
        return b
    if b is value:
        return a
    return None


@dataclasses.dataclass
class _RMSNorm:
    chain: list[ir.Node]
    """The matched nodes, the anchor first (removed once dead)."""
    x: ir.Value
    weight: ir.Value
    weight_mul: ir.Node
    eps: float
    upcast: ir.Node | None
    """The Cast to float32 in front of the chain, when the norm runs on the cast input."""


class DecomposedRMSNormToRMSNormalization(
    Rule,
    name="decomposed-rmsnorm-to-rmsnormalization",
    stage=Stage.CANONICALIZE,
    anchor="ReduceMean",
):
    """Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul RMSNorm -> RMSNormalization"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        chain: list[ir.Node] = [node]
        square = node.inputs[0].producer() if node.inputs[0] is not None else None
        if square is None or square.domain != "":
            return None
        squared = (square.op_type == "Pow" and const_scalar(square.inputs[1]) == 2.0) or (
            square.op_type == "Mul" and square.inputs[0] is square.inputs[1]
        )
        if not squared:
            return None
        xf = square.inputs[0]
        chain.append(square)
        rank = None if xf.shape is None else len(xf.shape)
        axes = const_ints(input_at(node, 1))
        if axes is None:
            axes = attr(node, "axes")  # opset < 18 form
            axes = list(axes) if axes is not None else None
        if rank is None or axes not in ([-1], [rank - 1]) or attr(node, "keepdims", 1) != 1:
            return None
        add = only_consumer(node.outputs[0])
        if add is None or add.op_type != "Add":
            return None
        eps = const_scalar(_other(add, node.outputs[0]))
        if eps is None or not 0 <= eps < 1:
            return None
        sqrt = only_consumer(add.outputs[0])
        if sqrt is None or sqrt.op_type != "Sqrt":
            return None
        chain += [add, sqrt]
        scale_node = only_consumer(sqrt.outputs[0])
        if scale_node is None:
            return None
        if scale_node.op_type == "Reciprocal" or _is_one_over(scale_node, sqrt.outputs[0]):
            chain.append(scale_node)
            normalize = only_consumer(scale_node.outputs[0])
            if normalize is None or normalize.op_type != "Mul":
                return None
            if _other(normalize, scale_node.outputs[0]) is not xf:
                return None
        elif scale_node.op_type == "Div":
            normalize = scale_node
            if normalize.inputs[0] is not xf or normalize.inputs[1] is not sqrt.outputs[0]:
                return None
        else:
            return None
        chain.append(normalize)
        if xf.dtype != ir.DataType.FLOAT:
            return Kept(
                ReasonCode.DTYPE,
                "RMSNorm computed in a dtype other than float32 (stash_type would differ)",
            )

        normalized = normalize.outputs[0]
        x = xf
        upcast = producer(xf, "Cast")
        after = only_consumer(normalized)
        if after is not None and after.op_type == "Cast" and upcast is not None:
            source = upcast.inputs[0]
            if attr(after, "to") != source.dtype or source.dtype is None:
                return Kept(ReasonCode.DTYPE, "RMSNorm casts to float and back to different dtypes")
            if not source.dtype.is_floating_point():
                return None
            chain.append(after)
            x, normalized = source, after.outputs[0]
        weight_mul = only_consumer(normalized)
        if weight_mul is None or weight_mul.op_type != "Mul":
            return None
        weight = _other(weight_mul, normalized)
        if weight is None or weight.dtype != x.dtype:
            return None
        reason = _weight_reason(weight, x)
        if reason:
            return Kept(ReasonCode.SHAPE, reason)
        chain.append(weight_mul)
        return _RMSNorm(chain, x, weight, weight_mul, eps, upcast if x is not xf else None)

    def check(self, m: _RMSNorm, ctx: RewriteContext) -> Kept | None:
        reason = require_default_opset(ctx.model, 23, ctx.cache)
        return Kept(ReasonCode.OPSET, reason) if reason else None

    def rewrite(self, m: _RMSNorm, ctx: RewriteContext) -> Rewritten:
        x, weight, weight_mul, eps = m.x, m.weight, m.weight_mul, m.eps
        fused = ir.node(
            "RMSNormalization",
            [x, weight],
            {"axis": -1, "epsilon": float(eps), "stash_type": 1},
            name=f"{weight_mul.name or 'rmsnorm'}/RMSNormalization",
        )
        ctx.graph.insert_before(weight_mul, fused)
        old, y = weight_mul.outputs[0], fused.outputs[0]
        y.shape, y.type = old.shape, old.type
        if old.name and not old.is_graph_output():
            y.name, old.name = old.name, None
        replace_value(old, y)
        remove_dead(ctx.graph, list(reversed(m.chain)) + ([m.upcast] if m.upcast else []))
        return Rewritten(f"RMSNorm eps {eps:g} -> RMSNormalization")


def _is_one_over(node: ir.Node, value: ir.Value) -> bool:
    """``Div(1, value)``: TorchScript's ``torch.rsqrt`` (Optimum exports), a Reciprocal."""
    return (
        node.op_type == "Div"
        and len(node.inputs) == 2
        and node.inputs[1] is value
        and const_scalar(node.inputs[0]) == 1.0
    )


def _weight_reason(weight: ir.Value, x: ir.Value) -> str | None:
    """None when ``weight`` broadcasts over the last axis of x only (and does not widen x)."""
    if weight.shape is None or x.shape is None:
        return "the RMSNorm weight or input has an unknown shape"
    dims = list(weight.shape)
    if len(dims) > len(x.shape):
        return "the RMSNorm weight has a higher rank than its input"
    if any(d != 1 for d in dims[:-1]):
        return "the RMSNorm weight does not act on the last axis only"
    last, width = (dims[-1] if dims else 1), x.shape[-1]
    if not isinstance(last, int) or (last != 1 and last != width):
        return "the RMSNorm weight width does not match the normalized axis"
    return None
