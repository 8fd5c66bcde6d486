"""Head counts and head size of attention inputs, proven from shapes and the ops that made them.

Every rule that emits an attention or rotary op with ``num_heads`` needs the head axis of a
(B, N, S, H) tensor, and exporters rarely leave it in the shape: the TorchScript exporter
reshapes with targets built at run time (``Concat(Shape(x)[0], Shape(x)[1], -1, H)``), and
per-head norms or rotations sit between that Reshape and the attention. This is the one place
that derives it (the attention lift, the GQA lowering, the contrib-rotary lowering and the
genai packager all ask here):

* :func:`axis_size` — the static size of one axis of a rank-4 value: from its shape, else
  from its producer (a Reshape target whose ``-1`` is solved by cancelling the factors the
  target shares with the input's shape, a Transpose, ops that keep or broadcast the axis);
* :class:`HeadCounts` — the analysis of an ONNX ``Attention`` node, asked through the run's
  analyses (:func:`attention_heads`, keyed by the node and its operands) or, outside a run,
  :func:`count_heads`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import TYPE_CHECKING

import onnx_ir as ir

from .._graph import Dim, attr, const_ints, dim, input_at, shape_vector
from .._layout import last_dim
from .manager import Analysis, Unproven

if TYPE_CHECKING:
    from ..base import RewriteContext

_ELEMENTWISE = ("Add", "Sub", "Mul", "Div", "Neg", "Cast", "Identity", "Where")
# Ops whose output has their first input's shape (normalizations over the last axis,
# rotations): Qwen3/Gemma-3 per-head q/k norms, RoPE.
_KEEPS_SHAPE = (
    "RotaryEmbedding",
    "RMSNormalization",
    "LayerNormalization",
    "SimplifiedLayerNormalization",
)
_MAX_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class HeadCounts(Analysis):
    """Head counts and head size of an ONNX ``Attention`` node:
    ``ctx.analysis(HeadCounts, node, *node.inputs)`` (the operands are in the key: the fact
    is about what the node reads, see ``analysis.manager``)."""

    q_heads: int
    kv_heads: int
    head_size: int
    layout_rank: int
    """4: Q/K/V are (batch, heads, seq, head_size); 3: (batch, seq, heads * head_size)."""

    @classmethod
    def compute(cls, ctx: RewriteContext, node: ir.Node, *inputs: ir.Value | None):
        return count_heads(node)


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def axis_size(value: ir.Value, axis: int = 1, _depth: int = 0) -> int | None:
    """The static size of ``axis`` (default 1, the heads of (B, N, S, H)) of a rank-4 value,
    or None when it cannot be established."""
    known = dim(value, axis)
    if isinstance(known, int):
        return known
    node = value.producer()
    if node is None or _depth > _MAX_DEPTH or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Reshape":
        return _reshaped_axis(node, axis)
    if op == "Transpose":
        perm = list(attr(node, "perm", []))
        if len(perm) != 4:
            return None
        return axis_size(node.inputs[0], perm[axis], _depth + 1)
    if op == "Slice":
        axes = const_ints(input_at(node, 3))
        keeps = axes in ([-1], [3]) and axis != 3
        return axis_size(node.inputs[0], axis, _depth + 1) if keeps else None
    if op == "Concat":
        if attr(node, "axis") not in (-1, 3) or axis == 3:
            return None
        return axis_size(node.inputs[0], axis, _depth + 1)
    if op in _KEEPS_SHAPE:
        if op != "RotaryEmbedding" and attr(node, "axis", -1) not in (-1, 3):
            return None
        return axis_size(node.inputs[0], axis, _depth + 1)
    if op in _ELEMENTWISE:
        return _broadcast_axis(node, axis, _depth)
    return None


def _broadcast_axis(node: ir.Node, axis: int, depth: int) -> int | None:
    """The broadcast size of ``axis`` over the operands (right-aligned)."""
    counts = []
    for operand in node.inputs:
        if operand is None or (
            operand.const_value is not None and operand.shape is not None and len(operand.shape) < 2
        ):
            continue
        rank = _rank(operand)
        if rank is None or rank > 4:
            return None
        if rank < 4:
            position = axis - (4 - rank)
            if position < 0:
                continue
            size = dim(operand, position)
            if not isinstance(size, int):
                return None
            counts.append(size)
            continue
        got = axis_size(operand, axis, depth + 1)
        if got is None:
            return None
        counts.append(got)
    return max(counts) if counts else None


def _reshaped_axis(node: ir.Node, axis: int) -> int | None:
    target = shape_vector(node.inputs[1])
    if target is None or len(target) != 4:
        return None
    got = target[axis]
    if isinstance(got, int) and got > 0:
        return got
    if got == 0 and not attr(node, "allowzero", 0):
        return axis_size(node.inputs[0], axis, _MAX_DEPTH)  # copied: its shape only
    if got != -1 or target.count(-1) != 1:
        return None
    source = node.inputs[0]
    rank = _rank(source)
    if rank is None:
        return None
    allowzero = attr(node, "allowzero", 0)
    factors: list[Dim] = [dim(source, i) for i in range(rank)]
    width = last_dim(source)
    if width is not None:
        factors[-1] = width
    others = [
        dim(source, i) if t == 0 and not allowzero and i < rank else t
        for i, t in enumerate(target)
        if i != axis
    ]
    return _quotient(factors, others)


def _quotient(numerator: list[Dim], denominator: list[Dim]) -> int | None:
    """prod(numerator) / prod(denominator) when the symbolic factors cancel exactly and the
    static rest divides; else None."""
    num, den = Counter(numerator), Counter(denominator)
    for term in list(num):
        if not isinstance(term, int):
            common = min(num[term], den.get(term, 0))
            num[term] -= common
            den[term] -= common
    if any(not isinstance(t, int) and n > 0 for t, n in (*num.items(), *den.items())):
        return None
    p = q = 1
    for t, n in num.items():
        p *= t**n if isinstance(t, int) else 1  # symbolic ones cancelled (count 0)
    for t, n in den.items():
        q *= t**n if isinstance(t, int) else 1
    return p // q if q > 0 and p % q == 0 else None


def attention_heads(ctx: RewriteContext, node: ir.Node) -> HeadCounts | Unproven:
    """:class:`HeadCounts` of an ONNX ``Attention`` node, from the run's analyses."""
    return ctx.analysis(HeadCounts, node, *node.inputs)


def count_heads(node: ir.Node) -> HeadCounts | Unproven:
    """Head counts and head size of an ONNX ``Attention`` node, or why they are not static
    (uncached: a run asks :func:`attention_heads`).

    3-D inputs take ``q_num_heads``/``kv_num_heads`` (required then by the op); 4-D inputs
    the head axis of Q and of K (or its past) and the last axis of K."""
    found = _attention_heads(node)
    return Unproven(found) if isinstance(found, str) else found


def _attention_heads(node: ir.Node) -> HeadCounts | str:
    q, k = node.inputs[0], input_at(node, 1)
    past_k = input_at(node, 4)
    q_heads, kv_heads = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
    if q_heads is not None and kv_heads is not None:
        width = last_dim(q)
        if width is None or width % q_heads:
            return "cannot determine the head size"
        return HeadCounts(q_heads, kv_heads, width // q_heads, 3)
    if q is None or k is None or _rank(q) != 4:
        return "cannot determine head counts and head size statically"
    kvh = hs = None
    for source in (past_k, k):
        if source is None or _rank(source) != 4:
            continue
        kvh = kvh if isinstance(kvh, int) else axis_size(source, 1)
        hs = hs if isinstance(hs, int) else axis_size(source, 3)
    qh = axis_size(q, 1)
    if not all(isinstance(x, int) for x in (qh, kvh, hs)):
        return "cannot determine head counts and head size statically"
    return HeadCounts(qh, kvh, hs, 4)


def record_heads(value: ir.Value, heads: int) -> None:
    """Write a proven head count into a value's shape where ONNX inference left it unknown,
    so later rules (GQA lowering) read it without re-deriving it."""
    if value.shape is None or isinstance(value.shape[1], int) or value.is_graph_input():
        return  # known already, or part of the model's signature (left as declared)
    dims = list(value.shape)
    dims[1] = heads
    value.shape = ir.Shape(dims)
