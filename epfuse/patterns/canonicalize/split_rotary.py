"""Half-width RoPE on split halves (GPT-OSS) -> ONNX ``RotaryEmbedding`` (opset 23).

GPT-OSS's ``_apply_rotary_emb`` keeps cos/sin at half the head size and rotates the two
halves of the head explicitly::

    x1, x2 = Split(x, 2, axis=-1)                       # x: (B, N, S, D)
                                                        # (TorchScript: two Slices, bounds
                                                        # computed from Shape(x))
    c, s   = Unsqueeze(cos, 1), Unsqueeze(sin, 1)       # cos, sin: (B, S, D/2)
    y      = Concat(x1 * c - x2 * s, x2 * c + x1 * s, axis=-1)

which is the definition of non-interleaved ``RotaryEmbedding(x, cos, sin)`` in its per-token
form (cos/sin (B, S, D/2), no position ids). The rule checks that structure exactly (the
same two halves, the same c and s in both terms, equal halves of a static even head size,
cos/sin of the rotated dtype and half its width); it does not evaluate anything itself:
``rope_caches`` then proves the run-time cos/sin (YaRN's scaled ones included) to be rows of
constant caches by evaluating them. Where cos/sin broadcast over the batch, they must first be
proven cache rows of the (batch, seq) positions, as in ``rotate_half``, and positions that
broadcast over the batch (TorchScript exports compute ``arange(past, past + seq)[None]``)
are expanded to the input's (batch, seq).
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from .._graph import (
    attr,
    const_ints,
    input_at,
    producer,
    remove_dead,
    replace_value,
    shape_vector,
)
from .._opset import require_default_opset
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode
from .rotate_half import expanded_positions, per_token, static_last, to_position_caches


def _mul_of(node: ir.Node | None, a: ir.Value, b: ir.Value) -> bool:
    if node is None or node.op_type != "Mul" or node.domain != "":
        return False
    return list(node.inputs) in ([a, b], [b, a])


def _factors(node: ir.Node | None, x: ir.Value) -> ir.Value | None:
    """y when ``node`` is ``Mul(x, y)`` or ``Mul(y, x)``."""
    if node is None or node.op_type != "Mul" or node.domain != "" or len(node.inputs) != 2:
        return None
    if node.inputs[0] is x:
        return node.inputs[1]
    if node.inputs[1] is x:
        return node.inputs[0]
    return None


def _heads_unsqueezed(value: ir.Value, chain: list[ir.Node]) -> ir.Value | None:
    """cos when ``value = Unsqueeze(cos, [1])`` with cos rank 3."""
    node = producer(value, "Unsqueeze")
    if node is None or const_ints(input_at(node, 1)) != [1]:
        return None
    source = node.inputs[0]
    if source.shape is not None and len(source.shape) != 3:
        return None
    chain.append(node)
    return source


def _bound(node: ir.Node, index: int) -> int | None:
    """A Slice bound evaluated to one int (TorchScript computes ``chunk``'s from the shape)."""
    vector = shape_vector(input_at(node, index))
    return vector[0] if vector is not None and len(vector) == 1 else None


def _sliced_halves(x1: ir.Value, x2: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """([Slice, Slice], x) when x1 = x[..., :D/2] and x2 = x[..., D/2:] of a rank-4 x:
    ``torch.chunk(x, 2, dim=-1)`` traced by TorchScript, its bounds computed from Shape(x)
    (``(D + 1) // 2``, times 1 and 2), evaluated symbolically."""
    first, second = x1.producer(), x2.producer()
    slices = (first, second)
    if any(n is None or n.op_type != "Slice" or n.domain != "" for n in slices):
        return None
    x = first.inputs[0]
    if second.inputs[0] is not x or x.shape is None or len(x.shape) != 4:
        return None
    width = static_last(x)
    if width is None or width % 2:
        return None
    for n in slices:
        axes = const_ints(input_at(n, 3)) if input_at(n, 3) is not None else None
        steps = const_ints(input_at(n, 4)) if input_at(n, 4) is not None else [1]
        if axes not in ([-1], [3]) or steps != [1]:
            return None
    half = width // 2
    end = _bound(second, 2)
    if (_bound(first, 1), _bound(first, 2), _bound(second, 1)) != (0, half, half):
        return None
    if not isinstance(end, int) or end < width:
        return None
    return [first, second], x


def _halves(x1: ir.Value, x2: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """(Split or its two Slices, x) when x1, x2 are the two equal last-axis halves of a
    rank-4 x."""
    sliced = _sliced_halves(x1, x2)
    if sliced is not None:
        return sliced
    split = x1.producer()
    if (
        split is None
        or split.op_type != "Split"
        or split.domain != ""
        or x2.producer() is not split
    ):
        return None
    if len(split.outputs) != 2 or split.outputs[0] is not x1 or split.outputs[1] is not x2:
        return None
    x = split.inputs[0]
    if x.shape is None or len(x.shape) != 4 or attr(split, "axis", 0) not in (-1, 3):
        return None
    width = static_last(x)
    if width is None or width % 2:
        return None
    sizes = const_ints(input_at(split, 1)) if len(split.inputs) > 1 else None
    if sizes is None and attr(split, "num_outputs") != 2:
        return None
    if sizes is not None and sizes != [width // 2, width // 2]:
        return None
    return [split], x


@dataclasses.dataclass
class _SplitHalves:
    node: ir.Node
    x: ir.Value
    cos: ir.Value
    sin: ir.Value
    chain: list[ir.Node]
    rope: ir.Node | None = None
    """Set by ``check``: the RotaryEmbedding, its cos/sin proven per token (not in the graph)."""


class SplitHalvesToRotaryEmbedding(
    Rule, name="split-halves-to-rotary-embedding", stage=Stage.CANONICALIZE, anchor="Concat"
):
    """Concat(x1*c - x2*s, x2*c + x1*s) over Split(x) -> ONNX RotaryEmbedding"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        if len(node.inputs) != 2 or attr(node, "axis") not in (-1, 3):
            return None
        sub, add = producer(node.inputs[0], "Sub"), producer(node.inputs[1], "Add")
        if sub is None or add is None:
            return None
        a, b = (x.producer() for x in sub.inputs)  # x1*c, x2*s
        if a is None or b is None or len(a.inputs) != 2:
            return None
        matched = None
        for x1 in a.inputs:
            c = _factors(a, x1)
            for x2 in b.inputs:
                s = _factors(b, x2)
                if c is None or s is None or x1 is x2:
                    continue
                halves = _halves(x1, x2)
                if halves is None:
                    continue
                terms = [t.producer() for t in add.inputs]
                if not any(
                    _mul_of(p, x2, c) and _mul_of(q, x1, s) for p, q in (terms, terms[::-1])
                ):
                    continue
                matched = (halves, c, s)
        if matched is None:
            return None
        (split, x), c4, s4 = matched
        chain = [node, sub, add, a, b, *(t.producer() for t in add.inputs), *split]
        cos, sin = _heads_unsqueezed(c4, chain), _heads_unsqueezed(s4, chain)
        if cos is None or sin is None:
            return Kept(
                ReasonCode.SHAPE,
                "split-halves RoPE: cos/sin are not (batch, seq, D/2) broadcast over heads",
            )
        width = static_last(x)
        for value in (cos, sin):
            if value.dtype not in (None, x.dtype):
                return Kept(
                    ReasonCode.DTYPE, "split-halves RoPE: cos/sin do not have the rotated dtype"
                )
            half = static_last(value)
            if half is not None and 2 * half != width:
                return Kept(
                    ReasonCode.SHAPE, "split-halves RoPE: cos/sin are not half the head size wide"
                )
        return _SplitHalves(node, x, cos, sin, chain)

    def check(self, m: _SplitHalves, ctx: RewriteContext) -> Kept | None:
        reason = require_default_opset(ctx.model, 23, ctx.cache)
        if reason:
            return Kept(ReasonCode.OPSET, reason)
        x, cos, sin = m.x, m.cos, m.sin
        rope = ir.node(  # not in the graph until rewrite
            "RotaryEmbedding",
            [x, cos, sin],
            {"interleaved": 0},
            name=f"{m.node.name or 'rope'}/RotaryEmbedding",
        )
        if not (per_token(cos, x) and per_token(sin, x)):
            why = to_position_caches(ctx, rope, x)  # proven by evaluation, on rope's inputs
            if why:
                return Kept(
                    ReasonCode.SHAPE,
                    f"split-halves RoPE: cos/sin are not (batch, seq) of the input ({why})",
                )
        m.rope = rope
        return None

    def rewrite(self, m: _SplitHalves, ctx: RewriteContext) -> Rewritten:
        node, rope, chain = m.node, m.rope, m.chain
        positions = input_at(rope, 3)
        if positions is not None and not per_token(positions, m.x):
            # cos/sin of positions that broadcast over the batch (arange(past, past + seq)
            # computed in the graph): RotaryEmbedding reads one position per (batch, token).
            rope.replace_input_with(3, expanded_positions(ctx, node, positions, m.x))
        ctx.graph.insert_before(node, rope)
        out, target = rope.outputs[0], node.outputs[0]
        out.shape, out.type = target.shape, target.type
        if target.name and not target.is_graph_output():
            out.name, target.name = target.name, None
        replace_value(target, out)
        remove_dead(ctx.graph, chain)
        return Rewritten("split-halves RoPE (half-width cos/sin) -> RotaryEmbedding")
