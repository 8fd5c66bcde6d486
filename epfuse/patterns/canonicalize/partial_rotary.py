"""Partial rotary as one op: ``Concat(RotaryEmbedding(x[..., :R], cos, sin[, pos]), x[..., R:])``
on the last axis becomes ``RotaryEmbedding(x, cos, sin[, pos], rotary_embedding_dim=R)``.

Models with ``partial_rotary_factor < 1`` rotate the first R channels of every head and pass
the rest through; torch.onnx exports that as two ``Slice`` of the head axis, a
``RotaryEmbedding`` of the first and a ``Concat``. ONNX ``RotaryEmbedding`` defines
``rotary_embedding_dim`` as exactly this (rotate ``x[..., :R]``, keep ``x[..., R:]``), and
with one RotaryEmbedding per Q and K the lowering can move the rotation into
GroupQueryAttention.

Checked before rewriting: x is rank 4 (B, N, S, H) with a static H (so "last axis" is the
within-head axis, not heads folded into the width); both slices read the same x on the last
axis with step 1, the first ``[0, R)`` and the second ``[R, H or more)``, with R even and
``0 < R < H``; the RotaryEmbedding has no ``rotary_embedding_dim`` of its own; the Concat is on
the last axis with the rotated part first.
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph import attr, const_ints, dim, input_at, substitute
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..matcher import ANY, In, match, op
from ..reasons import ReasonCode


def _slice_range(node: ir.Node, head_size: int) -> tuple[ir.Value, int, int] | None:
    """(data, start, end) of a last-axis step-1 Slice with constant bounds, ends clamped."""
    starts, ends = const_ints(input_at(node, 1)), const_ints(input_at(node, 2))
    axes = const_ints(input_at(node, 3)) if input_at(node, 3) is not None else None
    steps = const_ints(input_at(node, 4)) if input_at(node, 4) is not None else [1]
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes is None or axes not in ([-1], [3]) or steps != [1]:
        return None
    start, end = starts[0], ends[0]
    if start < 0:
        start += head_size
    if end < 0:
        end += head_size
    return node.inputs[0], max(0, min(start, head_size)), max(0, min(end, head_size))


_PARTIAL = op.Concat(
    op.RotaryEmbedding(
        op.Slice(ANY, extra_inputs=True, bind="head"), extra_inputs=True, bind="rope"
    ),
    op.Slice(ANY, extra_inputs=True, bind="tail"),
    axis=In(-1, 3),
)
"""``Concat(RotaryEmbedding(head slice, ...), tail slice)`` on the last axis; that both slices
read one x (and where) is checked apart, so that a near miss is reported."""


class PartialRotaryToRotaryDim(
    Rule, name="partial-rotary-to-rotary-dim", stage=Stage.CANONICALIZE, anchor="Concat"
):
    """Concat(RotaryEmbedding(x[..., :R]), x[..., R:]) -> rotary_embedding_dim=R"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        found = match(_PARTIAL, node)
        if found is None:
            return None
        rope, head, tail = found.node("rope"), found.node("head"), found.node("tail")
        x = head.inputs[0]
        if x.shape is None or len(x.shape) != 4 or not isinstance(dim(x, 3), int):
            return Kept(
                ReasonCode.SHAPE, "partial rotary input is not (B, N, S, H) with a static head size"
            )
        head_size = dim(x, 3)
        first, second = _slice_range(head, head_size), _slice_range(tail, head_size)
        if first is None or second is None or first[0] is not x or second[0] is not x:
            return Kept(
                ReasonCode.FORM,
                "partial rotary slices are not constant last-axis slices of one tensor",
            )
        rotary_dim = first[2]
        if first[1] != 0 or second[1] != rotary_dim or second[2] != head_size:
            return Kept(ReasonCode.FORM, "partial rotary slices do not split the head at one point")
        if not (0 < rotary_dim < head_size) or rotary_dim % 2:
            return Kept(
                ReasonCode.SHAPE, f"rotary dim {rotary_dim} is not even and inside the head"
            )
        if attr(rope, "rotary_embedding_dim", 0):
            return Kept(ReasonCode.FORM, "the sliced RotaryEmbedding is itself partial")
        return node, rope, x, rotary_dim, head_size

    def rewrite(self, found, ctx: RewriteContext) -> Rewritten:
        node, rope, x, rotary_dim, head_size = found
        rotated = node.inputs[0]
        attributes = {
            "interleaved": int(attr(rope, "interleaved", 0)),
            "rotary_embedding_dim": rotary_dim,
        }
        if attr(rope, "num_heads") is not None:
            attributes["num_heads"] = int(attr(rope, "num_heads"))
        full = ir.node(
            "RotaryEmbedding",
            [x, *rope.inputs[1:]],
            attributes,
            name=f"{rope.name or 'rotary'}/partial",
            metadata_props=dict(rope.metadata_props),
        )
        dead = [node]
        if not rotated.uses() or all(u.node is node for u in rotated.uses()):
            dead.insert(0, rope)
        substitute(ctx.graph, dead, full, [(node.outputs[0], full.outputs[0])])
        return Rewritten(f"partial rotary on {rotary_dim} of {head_size} channels")
