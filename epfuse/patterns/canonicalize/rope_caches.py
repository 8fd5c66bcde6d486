"""Run-time cos/sin into constant caches: ``RotaryEmbedding(x, cos, sin)`` whose per-token
``cos``/``sin`` are computed as ``Cos/Sin(Cast(position_ids[..., None]) * inv_freq)`` (or Hugging
Face's ``inv_freq_expanded @ position_ids_expanded`` MatMul/Transpose form) becomes ``RotaryEmbedding(x, cos_cache, sin_cache, position_ids)``.

The caches have ``max_seq_len`` rows and are computed once, in float64, from the graph's own
``inv_freq`` constant (and constant output scale, Hugging Face's ``attention_scaling``), then
cast to the model dtype. Before rewriting, the original subgraph is evaluated on ORT at a
spread of positions and must agree with the cache: the interpretation is proven, not assumed.

Whatever transformers version wrote the graph: 4.x expands ``inv_freq`` to a batch size that
torch.onnx reads off another input (a past key), Optimum's Cohere patch ``repeat``s it
(Tile); such inputs, read only through their shape, are fed at several batch and past sizes
during the proof. For the rotate-half rule, :func:`full_width_caches` proves full-width
cos/sin (``[c, c]`` or ``repeat_interleave(c, 2)``, however the widening is written) against
caches, and :func:`table_caches` cos/sin gathered from constant tables (transformers < 4.38's
``cos_cached[position_ids]``). :func:`evaluated_equal` lets the GQA lowering accept Q and K
rotated by duplicated cos/sin subgraphs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .._evaluate import SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import Builder, attr, const_array, const_ints, const_scalar, input_at, producer
from ..analysis.signature import probe_array
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


# Tile: Optimum patches Cohere to ``inv_freq[None, :, None].repeat(batch, 1, 1)``.
_PASS_THROUGH = ("Cast", "Unsqueeze", "Reshape", "Expand", "Tile", "Identity", "Squeeze")


def _through(value: ir.Value | None, steps: int = 6) -> ir.Value | None:
    """Follow value-preserving ops (Cast, Unsqueeze, Reshape, Expand, ...) to their source."""
    for _ in range(steps):
        if value is None or value.const_value is not None:
            return value
        node = value.producer()
        if node is None or node.op_type not in _PASS_THROUGH or node.domain != "":
            return value
        value = node.inputs[0]
    return value


def _positions_on(value: ir.Value | None) -> ir.Value | None:
    """The first (batch, seq) integer value up the value-preserving ops above ``value``: the
    ``position_ids`` input, or positions the graph computes (Optimum's Gemma exports take no
    position_ids and rotate at ``arange(past, past + seq)[None]``)."""
    for _ in range(6):
        if value is None:
            return None
        if (found := _positions(value)) is not None and value.shape is not None:
            return found
        node = value.producer()
        if node is None or node.op_type not in _PASS_THROUGH or node.domain != "":
            return None
        value = node.inputs[0]
    return None


# (batch, seq, past) sizes computed positions are checked at.
_RANGE_PROBES = ((1, 1, 0), (2, 5, 0), (1, 1, 7), (2, 3, 8), (1, 33, 0))


def _positions_cut(graph: ir.Graph, positions: ir.Value) -> tuple[ir.Value, ...] | str:
    """Where the cos/sin proof feeds positions: the ``position_ids`` input itself, or positions
    the graph computes from input *shapes* only (``arange(past, past + seq)``), fed there.

    The caches have ``max_seq_len`` rows, which the input contract bounds for position_ids
    (< past + seq); computed positions must be shown to stay in that range too, by evaluating
    them at several (batch, seq, past) sizes. Positions computed from input values (an offset
    position_ids, say) are not cut: the proof then sees what else cos/sin read, and refuses.
    """
    if positions.is_graph_input():
        return ()
    try:
        by_value, by_shape = value_dependencies(positions)
    except _Unprovable as err:
        return f"the positions could not be evaluated ({err})"
    if by_value:
        return ()
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    try:
        evaluator = SubgraphEvaluator(graph, [positions], inputs=shaped)
    except Exception as err:
        return f"the computed positions could not be evaluated ({type(err).__name__})"
    for batch, seq, past in _RANGE_PROBES:
        feeds = {}
        for value in shaped:
            array = probe_array(value, None, batch, seq, past)
            if array is None:
                return f"the positions read the shape of {value.name!r}, which cannot be sized"
            feeds[value.name] = array
        try:
            (got,) = evaluator(feeds)
        except Exception as err:
            return f"the computed positions failed on a probe ({type(err).__name__})"
        got = np.asarray(got)
        if got.ndim != 2 or got.shape[1] != seq or got.shape[0] not in (1, batch):
            return "the computed positions are not (batch, seq)"
        if got.size and (got.min() < 0 or got.max() >= past + seq):
            return "the computed positions leave [0, past + seq) (the caches' contract)"
    return (positions,)


def _positions(value: ir.Value | None) -> ir.Value | None:
    if value is None or value.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    if value.shape is not None and len(value.shape) != 2:
        return None
    return value


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
        positions = _positions(unsq.inputs[0])
        if axes is None or axes.reshape(-1).tolist() not in ([-1], [2]) or positions is None:
            continue
        return positions, inv_freq
    return None


def _matmul_freqs(matmul: ir.Node):
    """(positions, inv_freq) of ``MatMul(inv_freq[None, :, None] (expanded), positions[:, None,
    :])``, the angles before Hugging Face's transpose."""
    inv_freq = const_array(_through(matmul.inputs[0]))
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
        if current is None or id(current) in seen or current.const_value is not None:
            continue
        seen.add(id(current))
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
    max_len = ctx.options.max_seq_len
    scale = _measured_scale(ctx.graph, cos, positions)
    if isinstance(scale, str):
        return scale
    key = ("rope-cache", inv_freq.tobytes(), scale, dtype, max_len)
    if key not in ctx.cache:
        ctx.cache[key] = (*_cache_arrays(inv_freq, scale, dtype, max_len), None)
    cos_np, sin_np, built = ctx.cache[key]
    if interleaved:
        widen = lambda rows: np.repeat(rows, 2, axis=-1)  # noqa: E731
    else:
        widen = lambda rows: np.concatenate([rows, rows], axis=-1)  # noqa: E731
    reason = _proven_once(
        ctx,
        ("rope-cache-full-proof", id(positions), interleaved, key),
        cos,
        sin,
        lambda: _prove(ctx.graph, cos, sin, positions, cos_np, sin_np, max_len, widen),
    )
    if reason:
        return reason
    if built is None:
        builder = Builder(ctx.graph, node, "epfuse/rope")
        built = (builder.const("cos_cache", cos_np), builder.const("sin_cache", sin_np))
        ctx.cache[key] = (cos_np, sin_np, built)
        for value, array64 in zip(built, _cache_arrays64(inv_freq, scale, max_len), strict=True):
            ctx.record_float64(value, array64)
    return built


def _measured_scale(graph, cos, positions) -> float | str:
    try:
        cut = _positions_cut(graph, positions)
        if isinstance(cut, str):
            return cut
        by_value, by_shape = value_dependencies(cos, cut=cut)
    except _Unprovable as err:
        return f"the cos subgraph could not be evaluated ({err})"
    if by_value != {positions}:
        return "cos/sin depend on more than the positions"
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    feeds = {positions.name: np.zeros((1, 1), dtype=positions.dtype.numpy())}
    for value in shaped:
        array = probe_array(value, positions, 1, 1, 0)
        if array is None:
            return f"cos/sin read the shape of {value.name!r}, which cannot be sized"
        feeds[value.name] = array
    try:
        (got,) = SubgraphEvaluator(graph, [cos], inputs=[positions, *shaped])(feeds)
    except Exception as err:
        return f"the cos subgraph could not be evaluated ({type(err).__name__})"
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    if got.size == 0 or not np.all(got == got[0]) or not np.isfinite(got[0]) or got[0] == 0:
        return "cos at position 0 is not one constant scale"
    return float(got[0])


def _cache_arrays64(inv_freq, scale, max_len):
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)
    return np.cos(angles) * scale, np.sin(angles) * scale


def _cache_arrays(inv_freq, scale, dtype, max_len):
    np_dtype = dtype.numpy()
    cos, sin = _cache_arrays64(inv_freq, scale, max_len)
    return cos.astype(np_dtype), sin.astype(np_dtype)


def _proven_once(ctx, key, cos, sin, prove) -> str | None:
    """The outcome of ``prove()`` for this cos/sin pair. A pair that is structurally the same
    computation as one already proven under ``key`` (same ops, attributes and constants on the
    same inputs: the exporter's per-layer or per-RotaryEmbedding duplicates) shares its proof,
    so a model's proofs cost one evaluation, not one per layer."""
    from .rotate_half import same_computation  # (rotate_half imports this module)

    pair_key = (*key, id(cos), id(sin))
    if pair_key in ctx.cache:
        return ctx.cache[pair_key]
    proven = ctx.cache.setdefault((*key, "proven"), [])
    if any(same_computation(cos, c) and same_computation(sin, s) for c, s in proven[:4]):
        reason = None
    else:
        reason = prove()
        if reason is None:
            proven.append((cos, sin))
    ctx.cache[pair_key] = reason
    return reason


def _caches(ctx, inv_freq, scale, dtype, node, cos, sin, positions):
    """The (cos_cache, sin_cache) constants, or why the run-time cos/sin are not them.

    The proof is made per cos/sin pair (layers may compute their own), the constants are
    shared by every pair they are proven for.
    """
    max_len = ctx.options.max_seq_len
    key = ("rope-cache", inv_freq.tobytes(), scale, dtype, max_len)
    if key not in ctx.cache:
        ctx.cache[key] = (*_cache_arrays(inv_freq, scale, dtype, max_len), None)
    cos_np, sin_np, built = ctx.cache[key]
    reason = _proven_once(
        ctx,
        ("rope-cache-proof", id(positions), key),
        cos,
        sin,
        lambda: _prove(ctx.graph, cos, sin, positions, cos_np, sin_np, max_len),
    )
    if reason:
        return reason
    if built is None:
        builder = Builder(ctx.graph, node, "epfuse/rope")
        built = (builder.const("cos_cache", cos_np), builder.const("sin_cache", sin_np))
        ctx.cache[key] = (cos_np, sin_np, built)
        for value, array64 in zip(built, _cache_arrays64(inv_freq, scale, max_len), strict=True):
            ctx.record_float64(value, array64)
    return built


def _prove(
    graph, cos, sin, positions, cos_np, sin_np, max_len, widen=None, probes=None, fixed=None
) -> str | None:
    """Evaluate the original cos/sin on sampled positions; they must match the caches.

    ``widen`` maps cache rows to what the graph computes (full-width [c, c]), when not the
    identity; ``probes`` overrides the (batch, past) sizes. Besides the positions (read by value), the subgraph may read other graph inputs through
    their shape only: transformers 4.x expands ``inv_freq`` to the batch size taken from
    whichever input torch picked (a past key, say). Those inputs are fed at several batch
    and past sizes, and the result must be the cache rows of the positions every time.
    ``fixed`` maps values the evaluation is cut at to what they are fed (LongRoPE's switch
    condition, proven once per branch).
    """
    fixed = fixed or {}
    try:
        cut = _positions_cut(graph, positions)
        if isinstance(cut, str):
            return cut
        cut = (*cut, *fixed)
        by_value, by_shape = value_dependencies(cos, cut=cut)
        sin_value, sin_shape = value_dependencies(sin, cut=cut)
    except _Unprovable as err:
        return f"the cos/sin subgraph could not be evaluated ({err})"
    if (by_value | sin_value) - set(fixed) != {positions}:
        return "cos/sin depend on more than the positions"
    shaped = sorted((by_shape | sin_shape) - set(fixed), key=lambda v: v.name or "")
    cut_at = [positions, *(v for v in fixed if v in by_value | sin_value)]
    try:
        evaluator = SubgraphEvaluator(graph, [cos, sin], inputs=[*cut_at, *shaped])
    except Exception as err:
        return f"the cos/sin subgraph could not be evaluated ({type(err).__name__})"
    sample = np.unique(np.linspace(0, max_len - 1, num=min(max_len, 97)).astype(np.int64))
    pos_dtype = positions.dtype.numpy()
    tol = 1e-6 + 2e-7 * max_len  # float32 angle rounding grows with the position
    if cos_np.dtype != np.float32:
        tol = max(tol, 2e-3)
    # Positions the graph computes may be (1, seq), broadcast over the batch.
    rows = 1 if positions.shape is not None and positions.shape[0] == 1 else 2
    for batch, past in probes or _PROBES:
        ids = np.stack([sample, sample[::-1]][: min(batch, rows)]).astype(pos_dtype)
        feeds = {positions.name: ids, **{v.name: a for v, a in fixed.items()}}
        for value in shaped:
            array = probe_array(value, positions, batch, len(sample), past)
            if array is None:
                return f"cos/sin read the shape of {value.name!r}, which cannot be sized"
            feeds[value.name] = array
        try:
            got_cos, got_sin = evaluator(feeds)
        except Exception as err:  # e.g. a graph whose position_ids have a static shape
            return (
                f"the cos/sin subgraph could not be run on sampled positions ({type(err).__name__})"
            )
        for got, ref in ((got_cos, cos_np), (got_sin, sin_np)):
            ref64 = ref[ids].astype(np.float64)
            if widen is not None:
                ref64 = widen(ref64)
            got64 = np.asarray(got, dtype=np.float64)
            if got64.shape != ref64.shape:
                return "the run-time cos/sin are not (batch, seq, width) of the caches"
            if not np.allclose(got64, ref64, atol=tol, rtol=0):
                return "the run-time cos/sin do not match caches built from inv_freq"
    return None


# (batch, past) sizes the shape-only inputs are fed at: two batches, with and without a past.
_PROBES = ((1, 0), (2, 3))


def evaluated_equal(ctx, left: list[ir.Value], right: list[ir.Value]) -> bool:
    """True when each value of ``left`` evaluates equal to the one of ``right`` at the same
    place, at spread positions and several batch and past sizes: the exporter duplicated the
    cos/sin subgraph for Q and K (opset 23 dynamo exports emit one Cos/Sin per
    RotaryEmbedding). They may read one 2-D integer input (the positions) by value and any
    inputs through their shape; anything else (hidden states) is not evaluated."""
    key = ("rope-evaluated-equal", *map(id, left), *map(id, right))
    if key in ctx.cache:
        return ctx.cache[key]
    ctx.cache[key] = result = _evaluated_equal(ctx.graph, left, right, ctx.options.max_seq_len)
    return result


def _evaluated_equal(graph, left, right, max_len: int) -> bool:
    try:
        deps = [value_dependencies(v) for v in (*left, *right)]
    except _Unprovable:
        return False
    by_value = set().union(*(d[0] for d in deps))
    by_shape = set().union(*(d[1] for d in deps)) - by_value
    if len(by_value) != 1:
        return False
    (positions,) = by_value
    if _positions(positions) is None or positions.shape is None:
        return False
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    try:
        evaluator = SubgraphEvaluator(graph, [*left, *right], inputs=[positions, *shaped])
    except Exception:
        return False
    sample = np.unique(np.linspace(0, max_len - 1, num=min(max_len, 97)).astype(np.int64))
    for batch, past in _PROBES:
        ids = np.stack([sample, sample[::-1]][:batch]).astype(positions.dtype.numpy())
        feeds = {positions.name: ids}
        for value in shaped:
            array = probe_array(value, positions, batch, len(sample), past)
            if array is None:
                return False
            feeds[value.name] = array
        try:
            got = evaluator(feeds)
        except Exception:
            return False
        half = len(left)
        for a, b in zip(got[:half], got[half:], strict=True):
            if a.shape != b.shape or not np.array_equal(a, b):
                return False
    return True


def table_caches(ctx, node, cos, sin, dtype, interleaved: bool):
    """(cos_cache, sin_cache, positions) when the full-width run-time ``cos``/``sin`` are rows
    of constant tables gathered at the positions (transformers < 4.38's ``cos_cached``, sliced
    to the sequence length, then ``cos[position_ids]``), the tables being ``[c, c]``
    (``interleaved``: ``repeat_interleave(c, 2)``); or why not. The tables' halves are checked
    whole; that the graph reads their rows at the positions is proven by evaluation, with a
    past as long as the table (the contract: positions < past + seq)."""
    cos_src, sin_src = _gathered_table(cos), _gathered_table(sin)
    if cos_src is None or sin_src is None:
        return "cos/sin are neither position_ids x inv_freq nor rows of a constant table"
    (cos_table, positions), (sin_table, sin_positions) = cos_src, sin_src
    if sin_positions is not positions or cos_table.shape != sin_table.shape:
        return "cos and sin tables are read differently"
    if cos_table.ndim != 2 or cos_table.shape[1] % 2:
        return "the cos/sin tables are not (positions, rotary_dim)"
    halves = []
    for table in (cos_table, sin_table):
        half = table[:, ::2] if interleaved else table[:, : table.shape[1] // 2]
        widened = np.repeat(half, 2, axis=-1) if interleaved else np.concatenate([half] * 2, -1)
        if not np.array_equal(widened, table):
            return "the cos/sin tables are not two equal halves [c, c]"
        halves.append(half.astype(dtype.numpy()))
    rows = cos_table.shape[0]
    if interleaved:
        widen = lambda r: np.repeat(r, 2, axis=-1)  # noqa: E731
    else:
        widen = lambda r: np.concatenate([r, r], axis=-1)  # noqa: E731
    key = ("rope-table-proof", id(cos), id(sin), interleaved)
    if key not in ctx.cache:
        ctx.cache[key] = _prove(
            ctx.graph, cos, sin, positions, *halves, rows, widen, ((1, rows), (2, rows))
        )
    if ctx.cache[key]:
        return ctx.cache[key]
    builder = Builder(ctx.graph, node, "epfuse/rope")
    return builder.const("cos_cache", halves[0]), builder.const("sin_cache", halves[1]), positions


def _gathered_table(value: ir.Value):
    """(table, positions) of ``Gather(table[:n], positions)`` under value-preserving ops."""
    gather = _through_to(value, "Gather")
    if gather is None or attr(gather, "axis", 0) != 0:
        return None
    positions = _positions(_through(gather.inputs[1]))
    source = gather.inputs[0]
    node = source.producer()
    if node is not None and node.op_type == "Slice":  # cos_cached[:seq_len] (rows axis)
        axes = input_at(node, 3)
        if const_ints(input_at(node, 1)) != [0] or (axes is not None and const_ints(axes) != [0]):
            return None
        source = node.inputs[0]
    table = const_array(_through(source))
    if table is None or positions is None or table.dtype.kind != "f" or table.ndim < 2:
        return None
    if any(d != 1 for d in table.shape[:-2]):
        return None
    table = table.reshape(table.shape[-2:])
    return table.astype(np.float64), positions


def _through_to(value: ir.Value, op_type: str) -> ir.Node | None:
    """The ``op_type`` node under at most a few value-preserving ops above ``value``."""
    for _ in range(6):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == op_type and node.domain == "":
            return node
        if node.op_type not in _PASS_THROUGH:
            return None
        value = node.inputs[0]
    return None


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
        where = producer(_through(freq_side), "Where")
        if where is None:
            continue
        cond, a, b = where.inputs
        arrays = [const_array(_through(v)) for v in (a, b)]
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
    built once per switch and shared by every layer; or why the run-time cos/sin are not that.

    Proven by evaluation, in two parts. (1) Each cache pair: the subgraph is cut at the
    condition and fed True, then False, at spread positions and several batch/past sizes
    (:func:`_prove`); whatever the condition computes, each branch is its cache. (2) The
    condition with the rest: the whole subgraph, condition included, is evaluated at prompts of
    n positions for n around the length where the condition turns (found by evaluating it,
    below, at and above that length) and at spread lengths, and must give the rows of the cache
    the condition picks. The condition itself stays in the graph as exported.
    """
    _, cond, when_true, when_false = switch
    max_len = ctx.options.max_seq_len
    key = ("rope-switched", id(cond), when_true.tobytes(), when_false.tobytes(), scale, dtype)
    arrays_key = ("rope-switched-arrays", key, max_len)
    if arrays_key not in ctx.cache:
        ctx.cache[arrays_key] = [
            _cache_arrays(freqs, scale, dtype, max_len) for freqs in (when_true, when_false)
        ]
    arrays = ctx.cache[arrays_key]
    found: dict[str, str] = {}

    def prove() -> str | None:
        reason, found["described"] = _prove_switched(
            ctx.graph, switch, scale, dtype, max_len, cos, sin, arrays
        )
        return reason

    # Per cos/sin pair; duplicates of a proven pair (per-layer copies) share its proof.
    reason = _proven_once(ctx, ("rope-switched-proof", key), cos, sin, prove)
    if reason:
        return reason
    if key in ctx.cache:
        return ctx.cache[key]
    described = found.get("described", "")
    builder = Builder(ctx.graph, node, "epfuse/rope")
    selected = []
    for i, name in enumerate(("cos", "sin")):
        true_c = builder.const(f"{name}_cache_when_switched", arrays[0][i])
        false_c = builder.const(f"{name}_cache_unswitched", arrays[1][i])
        for value, freqs in ((true_c, when_true), (false_c, when_false)):
            ctx.record_float64(value, _cache_arrays64(freqs, scale, max_len)[i])
        where = ir.node("Where", [cond, true_c, false_c], name=f"epfuse/rope/{name}_cache_switch")
        out = where.outputs[0]
        out.name = where.name
        out.type, out.shape = ir.TensorType(dtype), ir.Shape(list(arrays[0][i].shape))
        source = cond.producer()
        if source is not None and source.graph is ctx.graph:
            ctx.graph.insert_after(source, where)
        else:
            ctx.graph.insert_before(ctx.graph.node(0), where)
        selected.append(out)
    ctx.cache[key] = (*selected, described)
    return ctx.cache[key]


def _prove_switched(graph, switch, scale, dtype, max_len, cos, sin, arrays=None):
    """(None, what was found) when the run-time cos/sin are the switched caches ``arrays``
    (see :func:`_switched_caches`), else (why not, "")."""
    positions, cond, when_true, when_false = switch
    if arrays is None:
        arrays = [_cache_arrays(freqs, scale, dtype, max_len) for freqs in (when_true, when_false)]
    for (cos_np, sin_np), flag in zip(arrays, (True, False), strict=True):
        reason = _prove(
            graph, cos, sin, positions, cos_np, sin_np, max_len, fixed={cond: np.array(flag)}
        )
        if reason:
            branch = "switched" if flag else "unswitched"
            return f"LongRoPE's {branch} cos/sin: {reason}", ""
    try:
        by_value, by_shape = value_dependencies(cond)
    except _Unprovable as err:
        return f"the LongRoPE condition could not be evaluated ({err})", ""
    if by_value != {positions}:
        return "the LongRoPE condition reads more than the positions", ""
    try:
        _, cos_shape = value_dependencies(cos)
        _, sin_shape = value_dependencies(sin)
    except _Unprovable as err:
        return f"the cos/sin subgraph could not be evaluated ({err})", ""
    shaped = sorted((by_shape | cos_shape | sin_shape) - {positions}, key=lambda v: v.name or "")
    try:
        evaluator = SubgraphEvaluator(graph, [cond, cos, sin], inputs=[positions, *shaped])
    except Exception as err:
        return f"the LongRoPE condition could not be evaluated ({type(err).__name__})", ""
    pos_dtype = positions.dtype.numpy()

    def run(n: int, batch: int = 1):
        ids = np.tile(np.arange(n, dtype=pos_dtype), (batch, 1))
        if batch > 1:
            ids[1] = ids[1][::-1]  # same maximum, other order
        feeds = {positions.name: ids}
        for value in shaped:
            array = probe_array(value, positions, batch, n, 0)
            if array is None:
                raise _Unprovable(f"it reads the shape of {value.name!r}, which cannot be sized")
            feeds[value.name] = array
        flag, got_cos, got_sin = evaluator(feeds)
        return bool(np.asarray(flag).reshape(-1)[0]), ids, got_cos, got_sin

    lengths = sorted({*range(1, min(max_len, 64) + 1), *np.geomspace(1, max_len, 24).astype(int)})
    try:
        flags = {n: run(n)[0] for n in lengths}
        threshold = _turning_length(flags, lambda n: run(n)[0])
        checked = set(lengths[:: max(1, len(lengths) // 12)]) | {1, max_len}
        if threshold is not None:
            checked |= {n for n in (threshold - 1, threshold, threshold + 1) if 1 <= n <= max_len}
        tol = 1e-6 + 2e-7 * max_len
        if arrays[0][0].dtype != np.float32:
            tol = max(tol, 2e-3)
        for n in sorted(checked):
            for batch in (1, 2):
                flag, ids, got_cos, got_sin = run(n, batch)
                cos_np, sin_np = arrays[0] if flag else arrays[1]
                for got, ref in ((got_cos, cos_np), (got_sin, sin_np)):
                    expected = ref[ids].astype(np.float64)
                    got64 = np.asarray(got, dtype=np.float64)
                    if got64.shape != expected.shape or not np.allclose(
                        got64, expected, atol=tol, rtol=0
                    ):
                        return (
                            f"the LongRoPE cos/sin at {n} positions are not the cache its condition picks",
                            "",
                        )
    except _Unprovable as err:
        return f"the LongRoPE condition could not be evaluated: {err}", ""
    except Exception as err:
        return f"the LongRoPE condition could not be run on prompts ({type(err).__name__})", ""
    if threshold is None:
        described = "the switch evaluated at prompt lengths 1.." + str(max_len)
    else:
        described = f"the switched caches above {threshold} positions"
    return None, described


def _turning_length(flags: dict[int, bool], evaluate) -> int | None:
    """T when the condition is False for prompts of at most T positions and True beyond
    (bisected between the sampled lengths), or None when it is not one such threshold."""
    ordered = sorted(flags)
    values = [flags[n] for n in ordered]
    if not any(values) or all(values) or values != sorted(values):
        return None
    first = values.index(True)
    low, high = ordered[first - 1], ordered[first]  # False at low, True at high
    while high - low > 1:
        mid = (low + high) // 2
        if evaluate(mid):
            high = mid
        else:
            low = mid
    return low
