"""Attention with per-head sinks (GPT-OSS) -> ONNX ``Attention`` + an exact sink correction.

Hugging Face's GPT-OSS appends one learned logit per head (the "sink") to every row of the
attention scores, normalizes, and drops that column again::

    scores   = scale * Q @ K^T + mask                        # as in decomposed SDPA
    combined = Concat(scores, Expand(sinks (1,N,1,1)), axis=-1)
    combined = combined - ReduceMax(combined, -1)           # optional (a no-op for softmax)
    P        = Slice(Softmax(combined), 0:-1 on the last axis)
    Y        = P @ V

so ``P = exp(s) / (sum(exp(s)) + exp(sink))``: an extra term in the softmax denominator.
ONNX ``Attention`` (opsets 23-25) has no sink input, so the canonical form keeps a standard
``Attention`` and rescales its output by the share the sink leaves to the keys::

    Y_att, ..., S = Attention(Q, K, V, mask, qk_matmul_output_mode=2)  # S: masked scores
    Y = Y_att * Sigmoid(ReduceLogSumExp(S, -1) - sink)

since ``sum(exp(s)) / (sum(exp(s)) + exp(sink)) = sigmoid(logsumexp(s) - sink)``. Every op is
standard ONNX, so EPs whose GroupQueryAttention has no ``head_sink`` still run the sinks exactly
(``lower/attention_sink`` turns the form into GQA's ``head_sink`` where the record allows).
Mode 2 is the scores with softcap and mask applied, exactly what the softmax normalizes.

Nothing is taken on the graph's word: the sink values and where they enter the softmax are
proven by evaluating the original subgraph (from the scores and V to Y) on ORT at several
batch, query and key sizes against the formula above with the sink vector read from that same
evaluation. A fully masked row gives 0 in both forms (the sink dominates; Attention's zero-row
guard and ``sigmoid(-inf)`` agree).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from epfuse.tolerances import tolerance_for

from .._evaluate import ShapeCut, SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import (
    attr,
    const_ints,
    dim,
    initializer,
    input_at,
    only_consumer,
    producer,
    remove_dead,
    replace_value,
)
from .._opset import require_default_opset
from ..analysis.head_counts import axis_size, record_heads
from ..analysis.signature import probe_array
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode
from .sdpa import (
    AttentionMatch,
    DecomposedAttentionToAttention,
)

# (batch, query length, extra key columns beyond the query) the original is evaluated at.
_PROBES = ((1, 1, 0), (2, 3, 4), (1, 5, 7))


def _last_axis(node: ir.Node, name: str = "axis") -> bool:
    return attr(node, name) in (-1, 3)


def _strip_max(value: ir.Value, chain: list[ir.Node]) -> ir.Value:
    """``x - ReduceMax(x, -1, keepdims=1)`` -> x (softmax is invariant to it)."""
    sub = producer(value, "Sub")
    if sub is None:
        return value
    x, reduced = sub.inputs
    rmax = producer(reduced, "ReduceMax")
    if rmax is None or rmax.inputs[0] is not x or attr(rmax, "keepdims", 1) != 1:
        return value
    axes = const_ints(input_at(rmax, 1)) if len(rmax.inputs) > 1 else attr(rmax, "axes")
    if axes is None or list(axes) not in ([-1], [3]):
        return value
    chain.extend([sub, rmax])
    return x


def _drops_last_column(node: ir.Node | None) -> bool:
    """``Slice(x, starts=[0], ends=[-1], axes=[-1], steps=[1])`` on the last axis."""
    if node is None or node.op_type != "Slice" or node.domain != "":
        return False
    starts, ends = const_ints(input_at(node, 1)), const_ints(input_at(node, 2))
    axes = const_ints(input_at(node, 3)) if input_at(node, 3) is not None else None
    steps = const_ints(input_at(node, 4)) if input_at(node, 4) is not None else [1]
    return starts == [0] and ends == [-1] and axes in ([-1], [3]) and steps == [1]


@dataclasses.dataclass
class _SinkAttention:
    chain: list[ir.Node]
    """Softmax, Concat, the column Slice and the P @ V MatMul (then the scores' chain)."""
    scores_match: AttentionMatch
    scores: ir.Value
    column: ir.Value
    q: ir.Value
    k: ir.Value
    v: ir.Value
    pv: ir.Node
    heads: list
    sinks: np.ndarray | None = None
    """Set by ``check``: the per-head sink logits, proven by evaluation."""


class AttentionSinksToAttention(
    Rule, name="attention-sinks-to-attention", stage=Stage.CANONICALIZE, anchor="Softmax"
):
    """Softmax over [scores | per-head sink] with the sink column dropped ->
    Attention * Sigmoid(LogSumExp(scores) - sink)"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        if not _last_axis(node):
            return None
        chain: list[ir.Node] = [node]
        combined = _strip_max(node.inputs[0], chain)
        concat = producer(combined, "Concat")
        if concat is None or len(concat.inputs) != 2 or not _last_axis(concat):
            return None
        scores, column = concat.inputs
        chain.append(concat)
        sliced = only_consumer(node.outputs[0])
        if not _drops_last_column(sliced):
            return None
        chain.append(sliced)
        pv = only_consumer(sliced.outputs[0])
        if pv is None or pv.op_type != "MatMul" or pv.domain != "":
            return None
        if pv.inputs[0] is not sliced.outputs[0]:
            return None
        chain.append(pv)
        v = pv.inputs[1]

        m = AttentionMatch()
        parsed = DecomposedAttentionToAttention._parse_masked_scores(scores, m)
        if parsed is None:
            return None
        if isinstance(parsed, str):
            return Kept(ReasonCode.FORM, f"attention sinks: {parsed}")
        q, k = parsed
        reason = DecomposedAttentionToAttention._check(node, q, k, v, m)
        if reason:
            return Kept(ReasonCode.FORM, f"attention sinks: {reason}")
        heads = [axis_size(x) for x in (q, k, v)]
        return _SinkAttention(chain, m, scores, column, q, k, v, pv, heads)

    def check(self, s: _SinkAttention, ctx: RewriteContext) -> Kept | None:
        y = s.pv.outputs[0]
        sinks = _prove_sinks(ctx, s.scores, s.column, s.v, y, s.heads[0], s.heads[2])
        if isinstance(sinks, str):
            return Kept(ReasonCode.NOT_PROVEN, f"attention sinks not proven: {sinks}")
        reason = require_default_opset(ctx.model, 23, ctx.cache)
        if reason:
            return Kept(ReasonCode.OPSET, reason)
        s.sinks = sinks
        return None

    def rewrite(self, s: _SinkAttention, ctx: RewriteContext) -> Rewritten:
        chain, m, q, k, v, pv, heads = s.chain, s.scores_match, s.q, s.k, s.v, s.pv, s.heads
        sinks = s.sinks
        attributes: dict[str, object] = {"scale": float(m.scale), "qk_matmul_output_mode": 2}
        if m.softcap:
            attributes["softcap"] = float(m.softcap)
        base = pv.name or "attention"
        fused = ir.node(
            "Attention",
            [q, k, v, m.mask],
            attributes,
            num_outputs=4,
            name=f"{base}/Attention",
            metadata_props=dict(pv.metadata_props),
        )
        y_att, _, _, qk = fused.outputs
        y_att.name, qk.name = f"{base}/attention_output", f"{base}/masked_scores"
        dtype = q.dtype.numpy()
        sink = initializer(
            ctx.graph, f"{base}/head_sinks", sinks.reshape(1, -1, 1, 1).astype(dtype)
        )
        axes = initializer(ctx.graph, f"{base}/last_axis", np.array([-1], np.int64))
        lse = ir.node("ReduceLogSumExp", [qk, axes], {"keepdims": 1}, name=f"{base}/lse")
        gap = ir.node("Sub", [lse.outputs[0], sink], name=f"{base}/lse_minus_sink")
        keep = ir.node("Sigmoid", [gap.outputs[0]], name=f"{base}/key_share")
        scaled = ir.node("Mul", [y_att, keep.outputs[0]], name=f"{base}/sink_scaled")
        for new in (fused, lse, gap, keep, scaled):
            new.metadata_props.update(pv.metadata_props)
            ctx.graph.insert_before(pv, new)
        for value, count in zip((q, k, v), heads, strict=True):
            record_heads(value, count)
        y, old = scaled.outputs[0], pv.outputs[0]
        y.shape, y.type = old.shape, old.type
        y_att.shape, y_att.type = old.shape, old.type
        if old.name and not old.is_graph_output():
            y.name, old.name = old.name, None
        replace_value(old, y)
        remove_dead(ctx.graph, list(reversed(chain + m.chain)))
        note = f"scale {m.scale:g}, per-head sinks {np.round(sinks, 3).tolist()}"
        return Rewritten(note + (", masked" if m.mask is not None else ""))


def _prove_sinks(
    ctx: RewriteContext,
    scores: ir.Value,
    column: ir.Value,
    v: ir.Value,
    y: ir.Value,
    num_heads: int | None,
    v_heads: int | None,
) -> np.ndarray | str:
    """The per-head sink vector, proven by evaluating scores, V -> Y of the original graph.

    The sink column must not read any input by value (only shapes); the subgraph is run on
    random scores and V at several sizes and must equal softmax([s | sink])[:-1] @ V, with
    ``sink`` the column it evaluates to (one value per head, the same for every row).

    The column may read the shape of an intermediate (transformers 4.x expands the sinks to
    ``query_states.shape``): a ``Shape`` whose source's inferred shape is static sizes and
    input dims is a cut (:class:`ShapeCut`), fed its vector at each probe. Without it a later
    layer's Q shape reaches the earlier layers (GPT-OSS's experts route tokens by value) and
    the column would count as reading the inputs by value, though it reads sizes only.
    """
    if not isinstance(num_heads, int) or not isinstance(v_heads, int):
        return "the head counts are not static"
    head_size = dim(v, 3)
    if not isinstance(head_size, int):
        return "V's head size is not static"
    cuts: list[ShapeCut] = []
    try:
        by_value, by_shape = value_dependencies(column, shape_cuts=(ctx.graph, cuts))
    except _Unprovable as err:
        return str(err)
    if by_value:
        return "the sink column reads model inputs by value"
    shaped = sorted(by_shape, key=lambda x: x.name or "")
    try:
        evaluator = SubgraphEvaluator(
            ctx.graph, [y, column], inputs=[scores, v, *shaped, *(c.value for c in cuts)]
        )
    except Exception as err:
        return f"the sink subgraph could not be evaluated ({type(err).__name__})"
    dtype = scores.dtype.numpy() if scores.dtype != ir.DataType.BFLOAT16 else np.float32
    rng = np.random.default_rng(0)
    found: np.ndarray | None = None
    fixed = [d if isinstance(d, int) else None for d in (scores.shape or [None] * 4)]
    for batch, seq, extra in _PROBES:
        # Static dims of the scores (a fixed-shape export) override the probe's sizes.
        batch, seq = fixed[0] or batch, fixed[2] or seq
        total = fixed[3] or seq + extra
        extra = total - seq
        feeds = {
            scores.name: (3 * rng.standard_normal((batch, num_heads, seq, total))).astype(dtype),
            v.name: rng.standard_normal((batch, v_heads, total, head_size)).astype(dtype),
        }
        for value in shaped:
            array = probe_array(value, None, batch, seq, extra)
            if array is None:
                return f"the sink column reads the shape of {value.name!r}, which cannot be sized"
            feeds[value.name] = array
        sizes = {name: array.shape for name, array in feeds.items()}
        for cut in cuts:
            vector = cut.vector(sizes.get)
            if vector is None:
                return f"cannot size the shape {cut.value.name!r} the sink column reads"
            feeds[cut.value.name] = vector
        try:
            got, col = evaluator(feeds)
        except Exception as err:
            return f"the sink subgraph could not be run ({type(err).__name__})"
        col = np.asarray(col, dtype=np.float64)
        if col.shape != (batch, num_heads, seq, 1):
            return f"the sink column is {col.shape}, not one logit per (batch, head, query)"
        sinks = col[0, :, 0, 0]
        if not np.array_equal(col, np.broadcast_to(sinks[None, :, None, None], col.shape)):
            return "the sink logits vary with batch or query position"
        if found is not None and not np.array_equal(found, sinks):
            return "the sink logits change with the sequence sizes"
        found = sinks
        s = feeds[scores.name].astype(np.float64)
        combined = np.concatenate([s, col], axis=-1)
        e = np.exp(combined - combined.max(-1, keepdims=True))
        probs = (e / e.sum(-1, keepdims=True))[..., :-1]
        ref = probs @ feeds[v.name].astype(np.float64)
        tol = tolerance_for("float32" if dtype == np.float32 else "float16")
        close = np.allclose(got, ref, atol=tol.atol, rtol=tol.rtol)
        if np.asarray(got).shape != ref.shape or not close:
            return "the subgraph does not compute softmax([scores | sink]) without the sink column"
    assert found is not None
    return found
