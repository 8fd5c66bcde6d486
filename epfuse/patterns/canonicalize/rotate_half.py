"""Hugging Face ``apply_rotary_pos_emb`` written out in ops -> ONNX ``RotaryEmbedding``.

torch.onnx fuses the rotate-half idiom into ``RotaryEmbedding`` only when cos/sin have the
plain Llama form. Qwen2-VL-style mRoPE mixes cos/sin from three position streams first, so
the export keeps the arithmetic::

    y = x * Unsqueeze(Concat(c, c), 1) + Concat(-x[..., H/2:], x[..., :H/2]) * Unsqueeze(Concat(s, s), 1)

with x (B, N, S, H). That is exactly the non-interleaved ``RotaryEmbedding(x, c, s)`` with
(B, S, H/2) cos/sin (the same products and sums, up to float rounding), so it is rewritten;
the cos/sin computation is left as it is, for ``lower/mrope`` (or ``rope_caches``) to read.

Every piece is checked: both slices split the last axis of the same x at H/2 with step 1,
the negated half is the upper one and comes first, cos/sin are one value concatenated with
itself on the last axis and unsqueezed on axis 1, and their batch and sequence dims are x's.
Emitted only where the EP's record has ONNX ``RotaryEmbedding`` for the dtype.
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph import attr, const_ints, dim, input_at, producer
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage

_BIG = 2**31 - 1


def _last_axis(axes: list[int] | None, rank: int) -> bool:
    return axes is not None and len(axes) == 1 and axes[0] in (-1, rank - 1)


def _slice_of(value: ir.Value, rank: int) -> tuple[ir.Value, int, int] | None:
    """value = Slice(x, [start], [end], [last axis], [1]) -> (x, start, end)."""
    node = producer(value, "Slice")
    if node is None:
        return None
    starts, ends = const_ints(input_at(node, 1)), const_ints(input_at(node, 2))
    axes, steps = input_at(node, 3), input_at(node, 4)
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes is None or not _last_axis(const_ints(axes), rank):
        return None
    if steps is not None and const_ints(steps) != [1]:
        return None
    return node.inputs[0], starts[0], ends[0]


def _rotated_half(value: ir.Value, rank: int, head: int) -> ir.Value | None:
    """value = Concat(Neg(x[..., h:]), x[..., :h]) on the last axis -> x."""
    node = producer(value, "Concat")
    if node is None or len(node.inputs) != 2 or attr(node, "axis") not in (-1, rank - 1):
        return None
    neg = producer(node.inputs[0], "Neg")
    if neg is None:
        return None
    upper, lower = _slice_of(neg.inputs[0], rank), _slice_of(node.inputs[1], rank)
    if upper is None or lower is None or upper[0] is not lower[0]:
        return None
    half = head // 2
    if lower[1:] != (0, half) or upper[1] != half or upper[2] < head:
        return None
    return lower[0]


def _doubled(value: ir.Value) -> ir.Value | None:
    """value = Unsqueeze(Concat(c, c, axis=-1), [1]) -> c (B, S, H/2)."""
    unsq = producer(value, "Unsqueeze")
    if unsq is None or const_ints(input_at(unsq, 1)) != [1]:
        return None
    cat = producer(unsq.inputs[0], "Concat")
    if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        return None
    c = cat.inputs[0]
    if c.shape is None or len(c.shape) != 3 or attr(cat, "axis") not in (-1, 2):
        return None
    return c


def _split_mul(node: ir.Node | None) -> list[tuple[ir.Value, ir.Value]]:
    if node is None or node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
        return []
    a, b = node.inputs
    return [(a, b), (b, a)]


class RotateHalfToRotaryEmbedding(Rule):
    name = "rotate-half-to-rotary-embedding"
    stage = Stage.CANONICALIZE
    anchor = ("", "Add")
    description = "x*cos + rotate_half(x)*sin (exported arithmetic) -> RotaryEmbedding(x, cos, sin)"

    def apply(self, node: ir.Node, ctx: RewriteContext):
        if len(node.inputs) != 2 or any(v is None for v in node.inputs):
            return None
        match = self._match(node)
        if match is None:
            return None
        x, cos, sin = match
        if not ctx.ops.rotary_embedding:
            return Kept(f"{ctx.ep.name} has no ONNX RotaryEmbedding for {ctx.dtype}")
        for c in (cos, sin):
            if c.dtype != x.dtype:
                return Kept("cos/sin and the rotated input differ in dtype")
            if dim(c, 0) != dim(x, 0) or dim(c, 1) != dim(x, 2):
                return Kept("cos/sin are not (batch, seq) like the rotated input")
        out = node.outputs[0]
        if out.is_graph_output():
            return Kept("the rotated value is a graph output")
        rope = ir.node(
            "RotaryEmbedding",
            [x, cos, sin],
            {"interleaved": 0},
            name=f"{node.name or 'rope'}/RotaryEmbedding",
        )
        ctx.graph.insert_before(node, rope)
        rope.outputs[0].shape, rope.outputs[0].type = out.shape, out.type
        rope.outputs[0].name = f"{rope.name}/output"
        out.replace_all_uses_with(rope.outputs[0])
        ctx.graph.remove(node, safe=True)  # the rest of the arithmetic goes in the cleanup
        return Rewritten("rotate-half arithmetic -> RotaryEmbedding")

    @staticmethod
    def _match(node: ir.Node) -> tuple[ir.Value, ir.Value, ir.Value] | None:
        for first, second in ((0, 1), (1, 0)):
            for x, cos_full in _split_mul(node.inputs[first].producer()):
                if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int):
                    continue
                head = x.shape[3]
                if head % 2:
                    continue
                for rotated, sin_full in _split_mul(node.inputs[second].producer()):
                    if _rotated_half(rotated, 4, head) is not x:
                        continue
                    cos, sin = _doubled(cos_full), _doubled(sin_full)
                    if cos is None or sin is None:
                        continue
                    if dim(cos, 2) != head // 2 or dim(sin, 2) != head // 2:
                        continue
                    return x, cos, sin
        return None
