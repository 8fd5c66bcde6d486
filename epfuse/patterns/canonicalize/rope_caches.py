"""Run-time cos/sin into constant caches: ``RotaryEmbedding(x, cos, sin)`` whose per-token
``cos``/``sin`` are computed as ``Cos/Sin(Cast(position_ids[..., None]) * inv_freq)`` (or Hugging
Face's ``inv_freq_expanded @ position_ids_expanded`` MatMul/Transpose form) becomes ``RotaryEmbedding(x, cos_cache, sin_cache, position_ids)``.

The caches have ``max_seq_len`` rows and are computed once, in float64, from the graph's own
``inv_freq`` constant (and constant output scale, Hugging Face's ``attention_scaling``), then
cast to the model dtype. Before rewriting, the original subgraph is evaluated on ORT at a
spread of positions and must agree with the cache: the interpretation is proven, not assumed
(the proofs are the run's analyses, ``analysis.rope_caches``; this rule matches and builds).

Whatever transformers version wrote the graph: 4.x expands ``inv_freq`` to a batch size that
torch.onnx reads off another input (a past key), Optimum's Cohere patch ``repeat``s it
(Tile); such inputs, read only through their shape, are fed at several batch and past sizes
during the proof. For the rotate-half rule, :func:`full_width_caches` proves full-width
cos/sin (``[c, c]`` or ``repeat_interleave(c, 2)``, however the widening is written) against
caches, and :func:`table_caches` cos/sin gathered from constant tables (transformers < 4.38's
``cos_cached[position_ids]``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._graph import Builder, attr, const_array, const_scalar, input_at, producer
from ..analysis.manager import Unproven
from ..analysis.rope_caches import (
    PASS_THROUGH,
    CacheSpec,
    RopeCacheProof,
    RopeCacheRows,
    RopeSwitchProof,
    RopeTableProof,
    measured_scale,
    positions_of,
    through,
)
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


def _trace_trig(value: ir.Value, trig: str):
    """value = trig(freqs) under at most one ``Mul(scale)`` and one ``Cast``, in either order
    (Hugging Face computes ``(cos(emb) * attention_scaling).to(dtype)``) -> (freqs, scale)."""
    scale = 1.0
    seen: set[str] = set()
    for _ in range(2):
        node = value.producer()
        if node is None or node.op_type not in ("Mul", "Cast") or node.op_type in seen:
            break
        seen.add(node.op_type)
        if node.op_type == "Cast":
            value = node.inputs[0]
            continue
        for a, b in ((0, 1), (1, 0)):
            s = const_scalar(node.inputs[b])
            if s is not None:
                scale, value = s, node.inputs[a]
                break
        else:
            return None
    trig_node = producer(value, trig)
    if trig_node is None:
        return None
    return trig_node.inputs[0], scale


def _positions_on(value: ir.Value | None) -> ir.Value | None:
    """The first (batch, seq) integer value up the value-preserving ops above ``value``: the
    ``position_ids`` input, or positions the graph computes (Optimum's Gemma exports take no
    position_ids and rotate at ``arange(past, past + seq)[None]``)."""
    for _ in range(6):
        if value is None:
            return None
        if (found := positions_of(value)) is not None and value.shape is not None:
            return found
        node = value.producer()
        if node is None or node.op_type not in PASS_THROUGH or node.domain != "":
            return None
        value = node.inputs[0]
    return None


def _trace_freqs(freqs: ir.Value):
    """(positions, inv_freq) of the per-token angles, in the two exported forms:

    * ``Mul(Cast(Unsqueeze(positions, -1)), inv_freq)`` (torch folds the K=1 matmul);
    * ``Transpose(MatMul(Expand(inv_freq[None, :, None]), Cast(positions[:, None, :])),
      [0, 2, 1])``, Hugging Face's ``inv_freq_expanded @ position_ids_expanded``.

    Only the two sources are traced here; what the subgraph computes from them is proven by
    evaluating it against the caches (``_prove``), so the pass-through ops need no more care.
    """
    transpose = producer(freqs, "Transpose")
    if transpose is not None:
        matmul = producer(transpose.inputs[0], "MatMul")
        if matmul is None or list(attr(transpose, "perm", [])) != [0, 2, 1]:
            return None
        return _matmul_freqs(matmul)
    mul = producer(freqs, "Mul")
    if mul is None:
        return None
    for a, b in ((0, 1), (1, 0)):
        inv_freq = const_array(mul.inputs[b])
        if inv_freq is None or inv_freq.ndim != 1 or inv_freq.dtype.kind != "f":
            continue
        cast = producer(mul.inputs[a], "Cast")
        unsq = producer(cast.inputs[0] if cast else mul.inputs[a], "Unsqueeze")
        if unsq is None:
            continue
        axes = const_array(input_at(unsq, 1))
        positions = positions_of(unsq.inputs[0])
        if axes is None or axes.reshape(-1).tolist() not in ([-1], [2]) or positions is None:
            continue
        return positions, inv_freq
    return None


def _matmul_freqs(matmul: ir.Node):
    """(positions, inv_freq) of ``MatMul(inv_freq[None, :, None] (expanded), positions[:, None,
    :])``, the angles before Hugging Face's transpose."""
    inv_freq = const_array(through(matmul.inputs[0]))
    positions = _positions_on(matmul.inputs[1])
    if inv_freq is None or positions is None or inv_freq.dtype.kind != "f":
        return None
    if sum(d != 1 for d in inv_freq.shape) > 1:
        return None  # not one frequency vector
    return positions, inv_freq.reshape(-1)


@dataclasses.dataclass
class _RunTimeRope:
    node: ir.Node
    positions: ir.Value
    inv_freq: np.ndarray | None
    scale: float
    switch: tuple | None = None
    """LongRoPE: (positions, condition, inv_freq when true, when false) instead of inv_freq."""
    caches: tuple[ir.Value, ir.Value] | None = None
    """Set by ``check``: the constant caches proven equal to the run-time cos/sin."""
    described: str = ""
    """Set by ``check`` for a switch: what the two cache pairs are."""


class RopeCosSinToCaches(
    Rule, name="rope-cos-sin-to-caches", stage=Stage.CANONICALIZE, anchor="RotaryEmbedding"
):
    """run-time cos/sin from position_ids x inv_freq -> constant (max_seq_len, R/2) caches"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        if input_at(node, 3) is not None:
            return None  # already the cache form
        x, cos, sin = node.inputs[0], input_at(node, 1), input_at(node, 2)
        if cos is None or sin is None or cos.const_value is not None:
            return None
        traced_cos, traced_sin = _trace_trig(cos, "Cos"), _trace_trig(sin, "Sin")
        if traced_cos is None or traced_sin is None:
            return None
        (freqs_c, scale_c), (freqs_s, scale_s) = traced_cos, traced_sin
        if scale_c != scale_s:
            return Kept(ReasonCode.FORM, "cos and sin are scaled differently")
        traced = _trace_freqs(freqs_c)
        if traced is None:
            switch = _trace_switched(freqs_c)
            if switch is not None:  # LongRoPE: two frequency sets, chosen at run time
                return _switched_match(node, switch, freqs_s, scale_c)
        if traced is None or _trace_freqs(freqs_s) is None:
            return Kept(
                ReasonCode.FORM, "cos/sin are computed from positions in a form not recognized"
            )
        positions, inv_freq = traced
        if _trace_freqs(freqs_s)[0] is not positions:
            return Kept(ReasonCode.FORM, "cos and sin read different positions")
        if x.dtype is None:
            return Kept(ReasonCode.DTYPE, "the rotated input has no known dtype")
        return _RunTimeRope(node, positions, inv_freq, scale_c)

    def check(self, m: _RunTimeRope, ctx: RewriteContext) -> Kept | None:
        node = m.node
        x, cos, sin = node.inputs[0], node.inputs[1], node.inputs[2]
        if m.switch is not None:
            built = _switched_caches(ctx, node, m.switch, m.scale, x.dtype, cos, sin)
            if isinstance(built, str):
                return Kept(ReasonCode.NOT_PROVEN, built)
            *caches, m.described = built
        else:
            caches = _caches(ctx, m.inv_freq, m.scale, x.dtype, node, cos, sin, m.positions)
            if isinstance(caches, str):
                return Kept(ReasonCode.NOT_PROVEN, caches)
        m.caches = tuple(caches)
        return None

    def rewrite(self, m: _RunTimeRope, ctx: RewriteContext) -> Rewritten:
        node, positions = m.node, m.positions
        cos_cache, sin_cache = m.caches
        node.replace_input_with(1, cos_cache)
        node.replace_input_with(2, sin_cache)
        node.resize_inputs(4)
        node.replace_input_with(3, positions)
        if m.switch is not None:
            rows = cos_cache.shape[0]
            return Rewritten(f"LongRoPE: two cos/sin caches of {rows} positions, {m.described}")
        return Rewritten(f"cos/sin caches of {cos_cache.shape[0]} positions")


def find_freqs(value: ir.Value, limit: int = 48):
    """(positions, inv_freq) of the nearest angles ``_trace_freqs`` recognizes upstream of
    ``value`` (breadth first, at most ``limit`` nodes), or None. What lies between them and
    ``value`` is left to the evaluation in :func:`full_width_caches`."""
    queue, seen = [value], set()
    while queue and len(seen) < limit:
        current = queue.pop(0)
        if current is None or current in seen or current.const_value is not None:
            continue
        seen.add(current)
        node = current.producer()
        traced = _trace_freqs(current)
        if traced is None and node is not None and node.op_type == "MatMul":
            traced = _matmul_freqs(node)
        if traced is not None:
            return traced
        if node is not None:
            queue.extend(node.inputs)
    return None


def full_width_caches(ctx, node, inv_freq, dtype, cos, sin, positions, interleaved: bool):
    """(cos_cache, sin_cache) of width ``len(inv_freq)`` when the full-width run-time
    ``cos``/``sin`` evaluate to ``[c, c]`` (``interleaved``: ``repeat_interleave(c, 2)``) of
    the cache rows of the positions, times one scale (Hugging Face's ``attention_scaling``,
    read off at position 0, where cos is the scale itself); or why not."""
    scale = measured_scale(ctx.graph, cos, positions)
    if isinstance(scale, str):
        return scale
    spec = CacheSpec.of(inv_freq, scale, dtype, ctx.options.max_seq_len)
    widen = "repeat" if interleaved else "concat"
    proof = ctx.analysis(RopeCacheProof, cos, sin, positions, spec, widen)
    if isinstance(proof, Unproven):
        return proof.reason
    return _built_caches(ctx, node, spec)


def _caches(ctx, inv_freq, scale, dtype, node, cos, sin, positions):
    """The (cos_cache, sin_cache) constants, or why the run-time cos/sin are not them.

    The proof is made per cos/sin pair (layers may compute their own), the constants are
    shared by every pair they are proven for.
    """
    spec = CacheSpec.of(inv_freq, scale, dtype, ctx.options.max_seq_len)
    proof = ctx.analysis(RopeCacheProof, cos, sin, positions, spec, "")
    if isinstance(proof, Unproven):
        return proof.reason
    return _built_caches(ctx, node, spec)


def _built_caches(ctx, node, spec: CacheSpec) -> tuple[ir.Value, ir.Value]:
    """The constants of ``spec``, built once per run (with their float64 sources recorded)."""

    def build():
        rows = ctx.analysis(RopeCacheRows, spec)
        builder = Builder(ctx.graph, node, "epfuse/rope")
        built = (builder.const("cos_cache", rows.cos), builder.const("sin_cache", rows.sin))
        for value, array64 in zip(built, spec.arrays64(), strict=True):
            ctx.record_float64(value, array64)
        return built

    return ctx.analyses.built("rope-cache", (spec,), build)


def table_caches(ctx, node, cos, sin, dtype, interleaved: bool):
    """(cos_cache, sin_cache, positions) when the full-width run-time ``cos``/``sin`` are rows
    of constant tables gathered at the positions (``analysis.rope_caches.RopeTableProof``);
    or why not."""
    proof = ctx.analysis(RopeTableProof, cos, sin, dtype, interleaved)
    if isinstance(proof, Unproven):
        return proof.reason
    builder = Builder(ctx.graph, node, "epfuse/rope")
    cos_cache, sin_cache = (
        builder.const("cos_cache", proof.cos),
        builder.const("sin_cache", proof.sin),
    )
    return cos_cache, sin_cache, proof.positions


# ------------------------------------------------------------- LongRoPE's run-time switch
#
# Hugging Face's LongRoPE (Phi-3.5-mini, Phi-4-mini) rotates with
# ``inv_freq = Where(max(position_ids) + 1 > original_max, long_inv_freq, short_inv_freq)``,
# and scales cos/sin by one attention factor either way. The canonical form keeps the
# graph's own condition and selects between two constant cache pairs with a scalar
# ``Where`` (the two caches of onnxruntime-genai's builder, chosen by HF's condition instead of
# the builder's total length, so it is HF's model exactly, padded batches included).


def _trace_switched(freqs: ir.Value):
    """(positions, cond, when_true, when_false) when the angles are positions x
    ``Where(cond, inv_freq_a, inv_freq_b)`` of two constant frequency vectors, in the
    exported forms :func:`_trace_freqs` reads (torch's folded Mul, HF's MatMul/Transpose)."""
    transpose = producer(freqs, "Transpose")
    if transpose is not None:
        matmul = producer(transpose.inputs[0], "MatMul")
        if matmul is None or list(attr(transpose, "perm", [])) != [0, 2, 1]:
            return None
        pairs = [(matmul.inputs[1], matmul.inputs[0])]
    else:
        mul = producer(freqs, "Mul")
        if mul is None:
            return None
        pairs = [(mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])]
    for pos_side, freq_side in pairs:
        where = producer(through(freq_side), "Where")
        if where is None:
            continue
        cond, a, b = where.inputs
        arrays = [const_array(through(v)) for v in (a, b)]
        if any(
            x is None or x.dtype.kind != "f" or sum(d != 1 for d in x.shape) > 1 for x in arrays
        ):
            continue
        when_true, when_false = (x.reshape(-1) for x in arrays)
        if when_true.shape != when_false.shape or cond is None:
            continue
        if cond.dtype != ir.DataType.BOOL or cond.shape is None:
            continue
        if any(not isinstance(d, int) or d != 1 for d in cond.shape):
            continue  # one frequency set for the whole call, not mixed per element
        positions = _positions_on(pos_side)
        if positions is None:
            continue
        return positions, cond, when_true, when_false
    return None


def _switched_match(node: ir.Node, switch, freqs_s, scale) -> _RunTimeRope | Kept:
    positions, cond, when_true, when_false = switch
    other = _trace_switched(freqs_s)
    if other is None or other[0] is not positions or other[1] is not cond:
        return Kept(ReasonCode.FORM, "cos and sin switch their frequencies differently")
    if not (np.array_equal(other[2], when_true) and np.array_equal(other[3], when_false)):
        return Kept(ReasonCode.FORM, "cos and sin switch between different frequencies")
    if node.inputs[0].dtype is None:
        return Kept(ReasonCode.DTYPE, "the rotated input has no known dtype")
    return _RunTimeRope(node, positions, None, scale, switch=switch)


def _switched_caches(ctx, node, switch, scale, dtype, cos, sin):
    """(cos, sin, description): ``Where(cond, cache_true, cache_false)`` for cos and sin,
    built once per switch and shared by every layer; or why the run-time cos/sin are not that
    (``analysis.rope_caches.RopeSwitchProof``, per cos/sin pair; duplicates of a proven pair,
    the per-layer copies, share its proof)."""
    positions, cond, when_true, when_false = switch
    max_len = ctx.options.max_seq_len
    specs = tuple(CacheSpec.of(f, scale, dtype, max_len) for f in (when_true, when_false))
    proof = ctx.analysis(RopeSwitchProof, cos, sin, positions, cond, *specs)
    if isinstance(proof, Unproven):
        return proof.reason
    build = lambda: _build_switch(ctx, cond, specs, dtype)  # noqa: E731
    return (*ctx.analyses.built("rope-switched", (cond, *specs), build), proof.described)


def _build_switch(ctx, cond, specs, dtype) -> tuple[ir.Value, ir.Value]:
    builder = Builder(ctx.graph, None, "epfuse/rope")
    rows = [ctx.analysis(RopeCacheRows, spec) for spec in specs]
    arrays64 = [spec.arrays64() for spec in specs]
    selected = []
    for i, name in enumerate(("cos", "sin")):
        true_c = builder.const(f"{name}_cache_when_switched", (rows[0].cos, rows[0].sin)[i])
        false_c = builder.const(f"{name}_cache_unswitched", (rows[1].cos, rows[1].sin)[i])
        for value, array64 in ((true_c, arrays64[0][i]), (false_c, arrays64[1][i])):
            ctx.record_float64(value, array64)
        where = ir.node("Where", [cond, true_c, false_c], name=f"epfuse/rope/{name}_cache_switch")
        out = where.outputs[0]
        out.name = where.name
        out.type, out.shape = ir.TensorType(dtype), ir.Shape(list(rows[0].cos.shape))
        source = cond.producer()
        if source is not None and source.graph is ctx.graph:
            ctx.graph.insert_after(source, where)
        else:
            ctx.graph.insert_before(ctx.graph.node(0), where)
        selected.append(out)
    return tuple(selected)
