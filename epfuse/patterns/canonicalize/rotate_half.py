"""Rotate-half RoPE written out in primitive ops -> ONNX ``RotaryEmbedding`` (opset 23).

Hugging Face's ``apply_rotary_pos_emb`` exported below opset 23 reads::

    x1, x2 = Slice(x, 0, D/2), Slice(x, D/2, end)            # last axis
    y = x * Unsqueeze(cos, 1) + Concat(-x2, x1) * Unsqueeze(sin, 1)

with ``cos``/``sin`` of shape (B, S, D) built as ``Cos/Sin(Concat(freqs, freqs))`` (times the
``attention_scaling`` constant and/or Cast to the model dtype, in either order). That is
``RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2])`` in the 3-input per-token form, provided
``cos`` and ``sin`` really are two equal halves. The rule proves that structurally: the
Concat's two inputs are one value, or provably equal subgraphs (same ops, attributes and
constants); that holds before or after the trig op. The half is then rebuilt as ``trig(f)``
(with the same Cast and scale), the form ``rope_caches`` turns into constant caches
(evaluating the original subgraph to prove them).

Interleaved (GPT-J / Cohere ``rotate_every_two``)::

    rot = Reshape(Concat(Unsqueeze(-x[..., 1::2], -1), Unsqueeze(x[..., ::2], -1)), [B,N,S,D])
    y = x * cos + rot * sin,  cos = Cos(Reshape(Expand(Unsqueeze(f, -1), [1,1,1,2]), [B,S,-1]))

becomes ``RotaryEmbedding(..., interleaved=1)`` on ``trig(f)``, once the cos/sin are proven to
be ``repeat_interleave(f, 2)`` (the Expand repeats only the new last axis, the Reshape merges
it back while keeping the leading axes). GLM and Ernie 4.5 repeat after the head axis, from
the first half of a rotate-half cos: ``cos4 = repeat_interleave(Unsqueeze(c, 1)[..., :D/2],
2)`` with ``c = Cos(Concat(f, f))``; the rotation reads only that first half, so ``c`` must be
proven ``[h, h]`` by structure (no evaluated fallback), and the half is ``trig(f)`` again.

Partial rotary (``Concat(rope(Slice(x, 0, R)), Slice(x, R, end))``) becomes one
``RotaryEmbedding(x, ..., rotary_embedding_dim=R)``, which passes the rest through.

The TorchScript exporter (Optimum, transformers 4.x) writes the split point as
``x.shape[-1] // 2`` computed in the graph (folded here from static dims), loses the batch dim
of cos/sin (then they must be proven cache rows of the ``position_ids``, see
``rope_caches``), and writes ``repeat_interleave`` as a Range/NonZero/GatherND chain. When the
structure does not prove ``[c, c]``, the full-width cos/sin are evaluated against caches built
from the ``inv_freq`` found upstream (or from a constant cos/sin table gathered at the
positions); the result is then ``RotaryEmbedding(x, cos_cache, sin_cache, position_ids)``.
A split at the whole head with an empty pass-through (transformers 4.x's Phi-3) is a full
rotation. Positions that are not provably (batch, seq) of the rotated input (the graph's own
``arange(past, past + seq)[None]`` in Optimum's Gemma-2/3 exports, or positions whose batch
dim inference lost) are broadcast to it with ``Expand``, exactly as the exported
multiplication broadcasts cos/sin.

Not handled (left unchanged, so still correct): cos/sin neither provably duplicated halves
(or pairs, interleaved) nor evaluated to be, inputs that are not (B, N, S, D) (e.g. RoPE
applied before the head transpose), and rotations written in other orders.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from .._graph import (
    Builder,
    attr,
    const_ints,
    const_scalar,
    dim,
    initializer,
    input_at,
    only_consumer,
    producer,
    remove_dead,
    replace_value,
    same_computation,
    shape_vector,
)
from .._opset import require_default_opset
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..matcher import (
    ANY,
    Const,
    In,
    Ints,
    Match,
    OpPattern,
    Or,
    Pattern,
    Var,
    match,
    match_value,
    op,
)
from ..reasons import ReasonCode
from .rope_caches import RopeCosSinToCaches, find_freqs, full_width_caches, table_caches


def _last_axis_slice(node: ir.Node | None, x: ir.Value, rank: int) -> tuple[int, int] | None:
    """(start, end) of ``Slice(x, start, end, axes=[-1])`` with unit step."""
    if node is None or node.op_type != "Slice" or node.inputs[0] is not x:
        return None
    starts, ends = static_ints(input_at(node, 1)), static_ints(input_at(node, 2))
    axes, steps = input_at(node, 3), input_at(node, 4)
    if starts is None or ends is None or len(starts) != 1 or len(ends) != 1:
        return None
    if axes is None or const_ints(axes) not in ([-1], [rank - 1]):
        return None
    if steps is not None and const_ints(steps) != [1]:
        return None
    return starts[0], ends[0]


def static_ints(value: ir.Value | None, _depth: int = 0) -> list[int] | None:
    """A constant int vector, or one computed from static dims: the TorchScript exporter
    writes ``x[..., : x.shape[-1] // 2]`` as ``Unsqueeze(Cast(Div(Gather(Shape(x), 3), 2)))``.
    Only integer Div of non-negative static values is folded here (shape_vector does the
    rest), so the result is exactly what the graph computes."""
    ints = const_ints(value)
    if ints is not None or value is None or _depth > 8:
        return ints
    node = value.producer()
    if node is None or node.domain != "":
        return None
    if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        if node.op_type == "Cast" and ir.DataType(attr(node, "to")) not in _INT_TYPES:
            return None
        return static_ints(node.inputs[0], _depth + 1)
    if node.op_type == "Div" and value.dtype in _INT_TYPES:
        a, b = static_ints(node.inputs[0], _depth + 1), static_ints(node.inputs[1], _depth + 1)
        if a is None or b is None or len(a) != 1 or len(b) != 1 or a[0] < 0 or b[0] <= 0:
            return None
        return [a[0] // b[0]]
    if node.op_type == "Gather" and (shape := producer(node.inputs[0], "Shape")) is not None:
        # x.shape[-1] of a Slice whose width shape inference left unknown (static_last)
        index, src = const_ints(node.inputs[1]), shape.inputs[0]
        r = len(src.shape) if src.shape is not None else None
        if index is not None and len(index) == 1 and r is not None and attr(node, "axis", 0) == 0:
            start = attr(shape, "start", 0)
            if attr(shape, "end") is None and start in (0,) and index[0] in (-1, r - 1):
                width = static_last(src)
                return [width] if width is not None else None
    folded = shape_vector(value)
    if folded is None or not all(isinstance(d, int) for d in folded):
        return None
    return list(folded)


_INT_TYPES = (ir.DataType.INT64, ir.DataType.INT32)


def static_last(value: ir.Value) -> int | None:
    """The static last dim; for a step-1 last-axis Slice whose bounds are computed from static
    dims (shape inference leaves those unknown), the width the bounds give."""
    if value.shape is None or not value.shape:
        return None
    d = value.shape[-1]
    if isinstance(d, int):
        return d
    node = value.producer()
    if node is None or node.op_type != "Slice" or len(value.shape) != 4:
        return None
    source = node.inputs[0]
    bounds = _last_axis_slice(node, source, 4)
    width = source.shape[-1] if source.shape is not None and len(source.shape) == 4 else None
    if bounds is None or not isinstance(width, int):
        return None
    start, end = (b + width if b < 0 else b for b in bounds)
    return max(0, min(end, width) - max(0, min(start, width)))


def _strided_slice(node: ir.Node | None, rank: int) -> tuple[ir.Value, int] | None:
    """(x, start) of ``Slice(x, start, >= end, axes=[-1], steps=[2])``."""
    if node is None or node.op_type != "Slice":
        return None
    x = node.inputs[0]
    starts, ends = const_ints(input_at(node, 1)), const_ints(input_at(node, 2))
    axes, steps = const_ints(input_at(node, 3)), const_ints(input_at(node, 4))
    width = static_last(x)
    if starts is None or ends is None or width is None or steps != [2]:
        return None
    if axes not in ([-1], [rank - 1]) or len(starts) != 1 or ends[0] < width:
        return None
    return x, starts[0]


def _accepts(term, allowed, allowzero: int) -> bool:
    """A Reshape target entry that keeps an axis: 0 (copy), or the same run-time term."""
    return (term == 0 and not allowzero) or term in allowed


_REPEATED_PAIRS = op.Reshape(
    op.Expand(
        op.Unsqueeze(Var("f"), Ints([-1], [3]), bind="unsqueeze"),
        Const(lambda r: _pair_repeat(r, 4)),
        bind="expand",
    ),
    ANY,
    bind="reshape",
)


def _repeat_interleave_source(value: ir.Value) -> ir.Value | None:
    """f when ``value = Reshape(Expand(Unsqueeze(f, -1), [1, .., 1, 2]), [B, S, -1])``:
    ``repeat_interleave(f, 2, dim=-1)``, i.e. [f0, f0, f1, f1, ...]."""
    found = match_value(_REPEATED_PAIRS, value)
    if found is None:
        return None
    f = found["f"]
    width = static_last(f) if f.shape is not None and len(f.shape) == 3 else None
    if width is None:
        return None
    reshape = found.node("reshape")
    kept = (f, found.node("unsqueeze").outputs[0], found.node("expand").outputs[0])
    if not _reshape_keeps(reshape, 3, 2, *kept) or _target(reshape)[2] not in (2 * width, -1):
        return None
    return f


# ---------------------------------------------------------------- the declared shape
# x * cos4 + rotated * sin4, every product and the sum in either operand order; what the
# op trees cannot say (slice bounds, widths, Reshape targets) the checks below say.

_X = Var("x")

_ROTATE_HALF = op.Concat(
    op.Neg(op.Slice(_X, extra_inputs=True, bind="second")),
    op.Slice(_X, extra_inputs=True, bind="first"),
    axis=In(-1, 3),
)
"""``Concat(Neg(x[..., D/2:]), x[..., :D/2])`` on the last axis."""

_ROTATE_EVERY_TWO = op.Reshape(
    op.Concat(
        op.Unsqueeze(op.Neg(op.Slice(_X, extra_inputs=True, bind="odd")), Ints([-1], [4])),
        op.Unsqueeze(op.Slice(_X, extra_inputs=True, bind="even"), Ints([-1], [4])),
        axis=In(-1, 4),
    ),
    ANY,
    bind="rotated",
)
"""``Reshape(Concat(Unsqueeze(-x[..., 1::2], -1), Unsqueeze(x[..., ::2], -1), axis=-1),
[B, N, S, D])``: GPT-J / Cohere ``rotate_every_two``, which pairs (x[2i], x[2i+1]) -- ONNX
RotaryEmbedding's ``interleaved=1``."""


def _rank3_or_unknown(value: ir.Value) -> bool:
    # (an unknown shape is settled on the half, which must be rank 3)
    return value.shape is None or len(value.shape) == 3


def _trig_factor(name: str) -> Pattern:
    """cos4/sin4: ``Unsqueeze(c, [1])`` (broadcast over heads), or GLM's and Ernie 4.5's
    ``repeat_interleave(Unsqueeze(c, [1])[..., :D/2], 2)``:
    ``Reshape(Expand(Unsqueeze(Slice(Unsqueeze(c, 1), 0, D/2, axis -1), -1), [1,1,1,1,2]),
    [B, 1, S, D])`` (the halves of a rotate-half cos are repeated pairwise *after* the head
    axis is added; the rotation then reads the first half of c, which ``check`` proves to be
    one of two equal halves). c is bound to ``name``."""
    c = Var(name, check=_rank3_or_unknown)
    heads = op.Unsqueeze(c, Ints([1], [-3]), bind=f"{name}/heads")
    repeated = op.Reshape(
        op.Expand(
            op.Unsqueeze(op.Slice(heads, extra_inputs=True, bind=f"{name}/first"), Ints([-1], [4])),
            Const(lambda r: _pair_repeat(r, 5)),
            bind=f"{name}/expand",
        ),
        ANY,
        bind=f"{name}/repeated",
    )
    return Or(heads, repeated)


def _pair_repeat(repeat: np.ndarray, rank: int) -> bool:
    """An Expand target ``[1, .., 1, 2]`` of at most ``rank`` entries: a new last axis
    repeated twice."""
    values = [int(r) for r in repeat.reshape(-1)]
    return (
        repeat.dtype.kind in "iu"
        and len(values) <= rank
        and values[-1:] == [2]
        and all(r == 1 for r in values[:-1])
    )


_ROPE = op.Add(
    op.Mul(_X, _trig_factor("cos_full"), commute=True),
    op.Mul(Or(_ROTATE_HALF, _ROTATE_EVERY_TWO), _trig_factor("sin_full"), commute=True),
    commute=True,
)


def _valid(m: Match) -> bool:
    """What the op trees leave to say: the rotated width, slice bounds and Reshape targets,
    and that cos and sin take the same form (GLM's pairwise halves only when interleaved)."""
    x = m["x"]
    width = static_last(x)
    if x.shape is None or len(x.shape) != 4 or width is None or width % 2:
        return False
    interleaved = "rotated" in m
    if interleaved:
        odd, even = _strided_slice(m.node("odd"), 4), _strided_slice(m.node("even"), 4)
        if odd is None or even is None or (even[1], odd[1]) != (0, 1):
            return False
        rotated = m.node("rotated")
        if not _reshape_keeps(rotated, 4, 3, x) or _target(rotated)[3] not in (width, -1):
            return False
    else:
        half = width // 2
        if _last_axis_slice(m.node("first"), x, 4) != (0, half):
            return False
        got = _last_axis_slice(m.node("second"), x, 4)
        if got is None or got[0] not in (half, half - width) or got[1] < width:
            return False
    halves = ["cos_full/repeated" in m, "sin_full/repeated" in m]
    if halves not in ([False, False], [True, True]) or (halves[0] and not interleaved):
        return False
    if halves[0]:
        for name in ("cos_full", "sin_full"):
            if not _repeated_halves(m, name):
                return False
    return True


def _target(reshape: ir.Node) -> list | None:
    return shape_vector(reshape.inputs[1])


def _reshape_keeps(reshape: ir.Node, rank: int, kept: int, *refs: ir.Value) -> bool:
    """The Reshape's target has ``rank`` entries and keeps its first ``kept`` axes: each is
    0 (copy), the one -1, or that axis' run-time dim in one of ``refs`` (the same axis seen
    before and after the ops in between)."""
    target = _target(reshape)
    allowzero = attr(reshape, "allowzero", 0)
    if target is None or len(target) != rank or target.count(-1) > 1:
        return False
    return all(
        _accepts(target[axis], (*(dim(r, axis) for r in refs), -1), allowzero)
        for axis in range(kept)
    )


def _repeated_halves(m: Match, name: str) -> bool:
    """GLM's pairwise-repeated first half: c (B, S, D) with D even, the Slice its first half,
    the Reshape back to (B, 1, S, D)."""
    c, heads = m[name], m.node(f"{name}/heads")
    width = static_last(c)
    if c.shape is None or len(c.shape) != 3 or width is None or width % 2:
        return False
    if _last_axis_slice(m.node(f"{name}/first"), heads.outputs[0], 4) != (0, width // 2):
        return False
    reshape = m.node(f"{name}/repeated")
    expand = m.node(f"{name}/expand")
    if not _reshape_keeps(reshape, 4, 3, heads.outputs[0], expand.outputs[0]):
        return False
    return _target(reshape)[3] in (width, -1)


_HALVES = op.Concat(
    Var("h", check=lambda h: h.shape is not None and len(h.shape) == 3), Var("h2"), axis=In(-1, 2)
)


def _equal_halves(value: ir.Value) -> ir.Value | None:
    """h when ``value = Concat(h, h')`` on the last axis with h' provably equal to h."""
    found = match_value(_HALVES, value, where=lambda m: same_computation(m["h"], m["h2"]))
    return None if found is None else found["h"]


def _scale_step(core: Pattern) -> OpPattern:
    # a Mul by a scalar constant of rank <= 1 (attention_scaling)
    scale = Var(
        check=lambda v: const_scalar(v) is not None and v.shape is not None and len(v.shape) <= 1
    )
    return op.Mul(core, scale, commute=True, bind="mul")


def _outer_steps(trig: str) -> Pattern:
    """``full`` under at most one scalar Mul and one Cast, in either order (most steps
    first: the search keeps the first choice whose core ``_half_plan`` can undo); the core
    ``pre`` is read with or without the trig op on top."""
    core = Or(Var("pre"), getattr(op, trig)(Var("pre"), bind="trig"))
    return Or(
        op.Cast(_scale_step(core), bind="cast"),
        _scale_step(op.Cast(core, bind="cast")),
        op.Cast(core, bind="cast"),
        _scale_step(core),
        core,
    )


_OUTER_STEPS = {trig: _outer_steps(trig) for trig in ("Cos", "Sin")}


def _half_plan(full: ir.Value, trig: str, interleaved: bool = False):
    """(trig node or None, h, [Cast/Mul steps, innermost first]) when ``full`` is, under at
    most one ``Mul`` by a scalar constant and one ``Cast`` (in either order), either
    ``trig(Concat(f, f))`` (h = f, trig re-applied) or ``Concat(t, t)`` (h = t): each half of
    ``full`` is then exactly the same steps applied to ``trig(f)`` (or t)."""
    undo = _repeat_interleave_source if interleaved else _equal_halves
    halves: list[ir.Value] = []

    def undone(m: Match) -> bool:
        half = undo(m["pre"])
        halves[:] = [half] if half is not None else []
        return half is not None

    found = match_value(_OUTER_STEPS[trig], full, where=undone)
    if found is None:
        return None
    steps = [n for n in reversed(found.nodes) if n.op_type in ("Cast", "Mul")]
    return found.optional_node("trig"), halves[0], steps


def _half(ctx: RewriteContext, full: ir.Value, plan, before: ir.Node) -> ir.Value:
    """Build (once per ``full``, so Q and K share it) the half-width value of a plan."""
    prefix = f"epfuse/rope_half/{full.name or len(ctx.analyses)}"
    return ctx.analyses.built(
        "rotate-half", (full,), lambda: _rebuild(ctx.graph, before, prefix, *plan)
    )


def _rebuild(
    graph: ir.Graph,
    before: ir.Node,
    prefix: str,
    trig_node: ir.Node | None,
    half: ir.Value,
    steps: list[ir.Node],
) -> ir.Value:
    templates = ([trig_node] if trig_node is not None else []) + steps
    value = half
    for i, template in enumerate(templates):
        inputs = [value] if template is trig_node else _swap(template, value)
        node = ir.node(
            template.op_type,
            inputs,
            {k: a for k, a in template.attributes.items()},
            name=f"{prefix}/{template.op_type}_{i}",
        )
        node.outputs[0].name = f"{node.name}_out"
        graph.insert_before(before, node)
        value = node.outputs[0]
    return value


def _swap(template: ir.Node, value: ir.Value) -> list[ir.Value]:
    """The template's inputs with its (single) non-constant input replaced by ``value``."""
    if template.op_type == "Cast":
        return [value]
    return [value if const_scalar(i) is None else i for i in template.inputs]


def _bns(x: ir.Value) -> ir.Value:
    """The tensor whose (B, N, S) dims x has: x, or the input of the last-axis Slice x is
    (shape inference loses every dim of a Slice with computed bounds)."""
    node = x.producer()
    if node is not None and node.op_type == "Slice" and _last_axis_slice(node, node.inputs[0], 4):
        source = node.inputs[0]
        if source.shape is not None and len(source.shape) == 4:
            return source
    return x


def per_token(value: ir.Value, x: ir.Value) -> bool:
    """value is (batch, seq, ...) of the (B, N, S, H) x: provably not broadcast."""
    ref = _bns(x)
    return dim(value, 0) == dim(ref, 0) and dim(value, 1) == dim(ref, 2)


def expanded_positions(ctx: RewriteContext, before: ir.Node, positions, x) -> ir.Value:
    """``Expand(positions, [B, S])`` with B, S of the (B, N, S, H) ``x``.

    The exported graph multiplies x by cos/sin of the positions' (batch, seq), broadcast
    against x's; RotaryEmbedding reads one position per (batch, token), so the positions are
    broadcast to x's the same way (valid exactly when the original broadcast is: each of the
    positions' dims is 1 or x's). Computed positions (Optimum's Gemma exports rotate at
    ``arange(past, past + seq)[None]``) and positions whose batch shape inference lost both
    take this form. When B and S are named dims of a graph input, the target is read off
    that input, right after the positions are computed, so Q and K share one expanded value
    (the GQA lowering needs them rotated alike)."""
    ref = _bns(x)
    batch, seq = dim(ref, 0), dim(ref, 2)
    source = _input_with(ctx.graph, batch, seq)
    return ctx.analyses.built(
        "expanded-positions",
        (positions, batch, seq if source else ref),
        lambda: _expand_positions(ctx, before, positions, ref, source),
    )


def _expand_positions(ctx: RewriteContext, before: ir.Node, positions, ref, source) -> ir.Value:
    """The Expand of ``expanded_positions``, built once per positions and target."""
    if source is None:
        b = Builder(ctx.graph, before, f"epfuse/{before.name or 'rope'}/positions")
        picked = b.op(
            "Gather", [b.op("Shape", [ref]), b.const("batch_seq", np.array([0, 2]))], {"axis": 0}
        )
        out = b.op("Expand", [positions, picked])
    else:
        value, axes = source
        prefix = f"epfuse/{positions.name or 'positions'}/expanded"
        indices = initializer(ctx.graph, f"{prefix}/batch_seq", axes)
        shape = ir.node("Shape", [value], name=f"{prefix}/Shape")
        gather = ir.node(
            "Gather", [shape.outputs[0], indices], {"axis": 0}, name=f"{prefix}/Gather"
        )
        expand = ir.node("Expand", [positions, gather.outputs[0]], name=f"{prefix}/Expand")
        for n in (shape, gather, expand):
            n.outputs[0].name = n.name
        producer_node = positions.producer()
        if producer_node is not None and producer_node.graph is ctx.graph:
            ctx.graph.insert_after(producer_node, [shape, gather, expand])
        else:
            ctx.graph.insert_before(ctx.graph.node(0), [shape, gather, expand])
        out = expand.outputs[0]
    out.type = positions.type
    out.shape = ir.Shape([_dim_as_is(ref, 0), _dim_as_is(ref, 2)])
    return out


def _input_with(graph: ir.Graph, batch, seq):
    """(graph input, [axis of batch, axis of seq]) for named dims batch and seq, or None."""
    if not (isinstance(batch, tuple) and batch[0] == "sym"):
        return None
    if not (isinstance(seq, tuple) and seq[0] == "sym"):
        return None
    for value in graph.inputs:
        rank = len(value.shape) if value.shape is not None else 0
        terms = [dim(value, i) for i in range(rank)]
        if batch in terms and seq in terms:
            return value, np.array([terms.index(batch), terms.index(seq)], np.int64)
    return None


def _dim_as_is(value: ir.Value, axis: int):
    """``value.shape[axis]`` as it is (an int or a symbolic dim), for an output's shape."""
    return value.shape[axis] if value.shape is not None else None


def to_position_caches(ctx: RewriteContext, rope: ir.Node, x: ir.Value) -> str | None:
    """Turn ``rope``'s run-time cos/sin into caches read at position_ids (proven by
    evaluation, see ``rope_caches``), with the positions (batch, seq) like ``x``; or why not."""
    outcome = RopeCosSinToCaches().apply(rope, ctx)
    if not isinstance(outcome, Rewritten):
        return outcome.message if isinstance(outcome, Kept) else "not position_ids x inv_freq"
    return None  # positions that may broadcast are expanded to x's (batch, seq) in apply


def _proven_full_rope(ctx, node, x, cos_full, sin_full, interleaved, why: str) -> ir.Node | str:
    """RotaryEmbedding(x, cos_cache, sin_cache, positions) when the full-width run-time
    cos/sin are *evaluated* to be ``[c, c]`` (or ``repeat_interleave(c, 2)``) of cache rows
    ``c = cos/sin(positions * inv_freq) * scale``; or why not (``why`` names the structural
    failure). The positions and inv_freq are found upstream of cos (``rope_caches``' forms);
    how cos/sin are widened in between (Concat, Tile, GatherND of a traced repeat) does not
    matter, the evaluation decides."""
    traced = find_freqs(cos_full)
    if traced is None:
        found = table_caches(ctx, node, cos_full, sin_full, x.dtype, interleaved)
        if isinstance(found, str):
            return f"{why}; {found}"
        *caches, positions = found
    else:
        positions, inv_freq = traced
        caches = full_width_caches(
            ctx, node, inv_freq, x.dtype, cos_full, sin_full, positions, interleaved
        )
        if isinstance(caches, str):
            return f"{why}; {caches}"
    rope = ir.node(
        "RotaryEmbedding",
        [x, *caches, positions],
        {"interleaved": int(interleaved)},
        name=f"{node.name or 'rope'}/RotaryEmbedding",
    )
    return rope


@dataclasses.dataclass
class _RotateHalf:
    node: ir.Node
    x: ir.Value
    """The rotated input (the sliced part of ``source`` for a partial rotation)."""
    cos_full: ir.Value
    sin_full: ir.Value
    interleaved: bool
    halves: bool
    """GLM / Ernie 4.5: the pairs repeat the first half of a rotate-half cos/sin."""
    width: int | None
    source: ir.Value
    """What the RotaryEmbedding reads: ``x``, or the whole head for a partial rotation."""
    target: ir.Value
    """The value the RotaryEmbedding's output replaces."""
    chain: list[ir.Node]
    attributes: dict[str, int]
    rope: ir.Node | None = None
    """Set by ``check``: the proven RotaryEmbedding (not yet in the graph)."""


class RotateHalfMatch(NamedTuple):
    """What the declared rotate-half shape (``_ROPE``) binds at an Add."""

    x: ir.Value
    cos_full: ir.Value
    sin_full: ir.Value
    nodes: list[ir.Node]
    interleaved: bool
    halves: bool
    """cos/sin are the two halves of a repeated half-width table (``cos_full/repeated``)."""


def match_rotate_half(node: ir.Node) -> RotateHalfMatch | None:
    """The rotate-half RoPE shape at the Add ``node``, or None: the rule's match, public
    because the GQA lowering reads it to say why arithmetic RoPE it meets was not lifted."""
    m = match(_ROPE, node, where=_valid)
    if m is None:
        return None
    interleaved, halves = "rotated" in m, "cos_full/repeated" in m
    return RotateHalfMatch(m["x"], m["cos_full"], m["sin_full"], m.nodes, interleaved, halves)


class RotateHalfToRotaryEmbedding(
    Rule, name="rotate-half-to-rotary-embedding", stage=Stage.CANONICALIZE, anchor="Add"
):
    """x*cos + rotate_half(x)*sin -> ONNX RotaryEmbedding (opset 23)"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        matched = match_rotate_half(node)
        if matched is None:
            return None
        x, cos_full, sin_full, chain, interleaved, halves = matched
        width = static_last(x)
        for c in (cos_full, sin_full):
            d = static_last(c)
            if d is not None and d != width:
                return Kept(ReasonCode.SHAPE, "cos/sin width differs from the rotated width")
        partial = self._partial(node, x)
        if any(c.dtype not in (None, x.dtype) for c in (cos_full, sin_full)):
            return Kept(ReasonCode.DTYPE, "cos/sin do not have the dtype of the rotated input")
        attributes = {"interleaved": int(interleaved)}
        target = node.outputs[0]
        source = x
        if partial is not None:
            source, concat, tail = partial
            if width < static_last(source):
                attributes["rotary_embedding_dim"] = width
            chain = [concat, *chain, x.producer(), tail]
            target = concat.outputs[0]
        return _RotateHalf(
            node,
            x,
            cos_full,
            sin_full,
            interleaved,
            halves,
            width,
            source,
            target,
            chain,
            attributes,
        )

    def check(self, m: _RotateHalf, ctx: RewriteContext) -> Kept | None:
        known = ctx.cache.get(("default-opset", 23), None)
        if known:  # the opset cannot be raised: no need to prove anything
            return Kept(ReasonCode.OPSET, known)
        node, x, interleaved = m.node, m.x, m.interleaved
        rope = self._structural(ctx, node, x, m.cos_full, m.sin_full, interleaved, m.halves)
        if isinstance(rope, str) and m.halves:
            # the rotation reads only the first half of cos/sin: the evaluated proof of the
            # full-width (pairwise repeated) cos/sin does not apply.
            return Kept(ReasonCode.NOT_PROVEN, rope)
        if isinstance(rope, str):
            # Not provably [c, c] by structure (or its batch is not the input's): evaluate
            # the full-width cos/sin instead, against caches read at the position_ids.
            rope = _proven_full_rope(ctx, node, x, m.cos_full, m.sin_full, interleaved, rope)
            if isinstance(rope, str):
                return Kept(ReasonCode.NOT_PROVEN, rope)
        reason = require_default_opset(ctx.model, 23, ctx.cache)
        if reason:
            return Kept(ReasonCode.OPSET, reason)
        m.rope = rope
        return None

    def rewrite(self, m: _RotateHalf, ctx: RewriteContext) -> Rewritten:
        node, x, rope, target, interleaved = m.node, m.x, m.rope, m.target, m.interleaved
        source, chain, attributes, width = m.source, m.chain, m.attributes, m.width
        positions = input_at(rope, 3)
        if positions is not None and not per_token(positions, x):
            rope.replace_input_with(3, expanded_positions(ctx, node, positions, x))
        ctx.graph.insert_before(node, rope)
        rope.replace_input_with(0, source)
        for key, value in attributes.items():
            rope.attributes[key] = ir.AttrInt64(key, value)
        out = rope.outputs[0]
        out.shape, out.type = target.shape, target.type
        if target.name and not target.is_graph_output():
            out.name, target.name = target.name, None
        replace_value(target, out)
        remove_dead(ctx.graph, chain)
        kind = f"partial {width}" if "rotary_embedding_dim" in attributes else "full"
        kind += ", interleaved" if interleaved else ""
        return Rewritten(f"rotate-half RoPE ({kind}) -> RotaryEmbedding")

    @staticmethod
    def _structural(ctx, node, x, cos_full, sin_full, interleaved, halves=False) -> ir.Node | str:
        """RotaryEmbedding(x, cos_half, sin_half) (not yet in the graph) when cos/sin are provably [c, c] (or
        repeat_interleave(c, 2)) by structure, or why not. The halves' batch must be the
        input's; when the shapes do not say so (the TorchScript exporter loses the batch dim
        of the expanded inv_freq), they must be proven cache rows of the position_ids."""
        # halves: the pairs are repeated from c[..., :D/2] after the head axis; c must be [h, h]
        cos_plan = _half_plan(cos_full, "Cos", interleaved and not halves)
        sin_plan = _half_plan(sin_full, "Sin", interleaved and not halves)
        if cos_plan is None or sin_plan is None:
            return "cos/sin are not proven to be two equal halves [c, c]"
        all_per_token = True
        for _, half, steps in (cos_plan, sin_plan):
            casts = [n for n in steps if n.op_type == "Cast"]
            dtype = ir.DataType(attr(casts[-1], "to")) if casts else half.dtype
            if dtype != x.dtype:
                return "cos/sin do not have the dtype of the rotated input"
            # RotaryEmbedding reads cos/sin per (batch, token): they must not broadcast.
            if not per_token(half, x):
                all_per_token = False
        cos_half = _half(ctx, cos_full, cos_plan, node)
        sin_half = _half(ctx, sin_full, sin_plan, node)
        rope = ir.node(
            "RotaryEmbedding",
            [x, cos_half, sin_half],
            {"interleaved": int(interleaved)},
            name=f"{node.name or 'rope'}/RotaryEmbedding",
        )
        if not all_per_token:  # (rope is not in the graph yet: nothing to undo)
            reason = to_position_caches(ctx, rope, x)
            if reason:
                return f"cos/sin are not (batch, seq) like the rotated input ({reason})"
        return rope

    @staticmethod
    def _partial(node: ir.Node, x: ir.Value):
        """(full input, Concat, pass-through Slice) when x = full[..., :R] and the result is concatenated back
        with full[..., R:] on the last axis."""
        head = producer(x, "Slice")
        if head is None:
            return None
        full = head.inputs[0]
        if full.shape is None or len(full.shape) != 4 or static_last(full) is None:
            return None
        width = static_last(x)
        # width == the head size: transformers 4.x's Phi-3 always splits at cos.shape[-1] and
        # concatenates an empty pass-through; the whole is then a full rotation.
        if _last_axis_slice(head, full, 4) != (0, width) or width > static_last(full):
            return None
        concat = only_consumer(node.outputs[0])
        if concat is None or concat.op_type != "Concat" or attr(concat, "axis") not in (-1, 3):
            return None
        if len(concat.inputs) != 2 or concat.inputs[0] is not node.outputs[0]:
            return None
        tail = producer(concat.inputs[1], "Slice")
        got = _last_axis_slice(tail, full, 4) if tail else None
        if got is None or got[0] != width or got[1] < static_last(full):
            return None
        return full, concat, tail
