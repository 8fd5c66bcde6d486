"""What a run-time RoPE cos/sin computes, proven by evaluating the graph: the rows of constant
caches (``cos/sin(positions x inv_freq) * scale``), of the graph's own constant tables, or of two
cache pairs a LongRoPE condition switches between; and whether two duplicated cos/sin
subgraphs evaluate equal.

The rules that lift RoPE (``canonicalize/rope_caches``, ``canonicalize/rotate_half``) and the
GQA lowering (Q and K rotated by duplicated cos/sin) ask these through the run's analyses
(``ctx.analysis(RopeCacheProof, ...)``); a proof is made per cos/sin pair, and a pair that is
structurally the same computation as one already proven for the same caches (the exporter's
per-layer copies) shares its proof, so a model's proofs cost one evaluation, not one per layer.

The subgraph may read the positions by value and other graph inputs through their shape only
(transformers 4.x expands ``inv_freq`` to a batch size torch.onnx reads off a past key; Optimum's
Cohere patch ``repeat``s it): those are fed at several batch and past sizes, and the result
must be the cache rows of the positions every time. Positions the graph computes from input
shapes (``arange(past, past + seq)``) are the evaluation's cut, proven to stay in the caches'
``[0, past + seq)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from .._evaluate import SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import attr, const_array, const_ints, input_at, same_computation
from .manager import Analysis, Unproven
from .signature import input_role, probe_array

if TYPE_CHECKING:
    from ..base import RewriteContext


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """Constant caches ``cos/sin(arange(rows)[:, None] x inv_freq) * scale`` in ``dtype``, as
    a hashable key (the frequencies as float64 bytes)."""

    inv_freq: bytes
    scale: float
    dtype: ir.DataType
    rows: int

    @classmethod
    def of(cls, inv_freq: np.ndarray, scale: float, dtype: ir.DataType, rows: int) -> CacheSpec:
        return cls(np.asarray(inv_freq, dtype=np.float64).tobytes(), float(scale), dtype, rows)

    def arrays64(self) -> tuple[np.ndarray, np.ndarray]:
        """The caches in float64 (what a later precision conversion rounds from)."""
        freqs = np.frombuffer(self.inv_freq, dtype=np.float64)
        angles = np.arange(self.rows, dtype=np.float64)[:, None] * freqs
        return np.cos(angles) * self.scale, np.sin(angles) * self.scale


@dataclasses.dataclass(frozen=True)
class RopeCacheRows(Analysis):
    """The caches of a :class:`CacheSpec` in its dtype, computed once per run."""

    cos: np.ndarray
    sin: np.ndarray

    @classmethod
    def compute(cls, ctx: RewriteContext, spec: CacheSpec) -> RopeCacheRows:
        np_dtype = spec.dtype.numpy()
        cos, sin = spec.arrays64()
        return cls(cos.astype(np_dtype), sin.astype(np_dtype))


_WIDEN: dict[str, Callable[[np.ndarray], np.ndarray] | None] = {
    "": None,
    "concat": lambda rows: np.concatenate([rows, rows], axis=-1),
    "repeat": lambda rows: np.repeat(rows, 2, axis=-1),
}


@dataclasses.dataclass(frozen=True)
class RopeCacheProof(Analysis):
    """``ctx.analysis(RopeCacheProof, cos, sin, positions, spec, widen)``: the run-time
    ``cos``/``sin`` are, at every position, the rows of ``spec``'s caches (``widen``: ``""``
    half width; ``"concat"`` full width ``[c, c]``; ``"repeat"`` ``repeat_interleave(c, 2)``).
    """

    shared: bool
    """Proven by a structurally identical pair (no evaluation of its own)."""

    @classmethod
    def compute(cls, ctx, cos, sin, positions, spec: CacheSpec, widen: str):
        rows = ctx.analysis(RopeCacheRows, spec)
        graph, fn = ctx.graph, _WIDEN[widen]

        def prove():
            return _prove(graph, cos, sin, positions, rows.cos, rows.sin, spec.rows, fn), ""

        key = ("rope-cache", positions, spec, widen)
        reason, _, shared = _shared_proof(ctx, key, cos, sin, prove)
        return Unproven(reason) if reason else cls(shared)


@dataclasses.dataclass(frozen=True)
class RopeTableProof(Analysis):
    """``ctx.analysis(RopeTableProof, cos, sin, dtype, interleaved)``: the full-width run-time
    ``cos``/``sin`` are rows of constant tables gathered at the positions (transformers <
    4.38's ``cos_cached``, sliced to the sequence length, then ``cos[position_ids]``), the
    tables being ``[c, c]`` (``interleaved``: ``repeat_interleave(c, 2)``). The tables' halves
    are checked whole; that the graph reads their rows at the positions is proven by
    evaluation, with a past as long as the table (the contract: positions < past + seq)."""

    cos: np.ndarray
    """The half-width cos rows in ``dtype`` (the caches to build)."""
    sin: np.ndarray
    positions: ir.Value

    @classmethod
    def compute(cls, ctx, cos, sin, dtype: ir.DataType, interleaved: bool):
        found = _table_rows(cos, sin, dtype, interleaved)
        if isinstance(found, str):
            return Unproven(found)
        cos_rows, sin_rows, positions = found
        rows = cos_rows.shape[0]
        fn = _WIDEN["repeat" if interleaved else "concat"]
        probes = ((1, rows), (2, rows))
        reason = _prove(ctx.graph, cos, sin, positions, cos_rows, sin_rows, rows, fn, probes)
        return Unproven(reason) if reason else cls(cos_rows, sin_rows, positions)


@dataclasses.dataclass(frozen=True)
class RopeSwitchProof(Analysis):
    """``ctx.analysis(RopeSwitchProof, cos, sin, positions, cond, when_true, when_false)``:
    LongRoPE's run-time cos/sin are ``Where(cond, caches(when_true), caches(when_false))``.

    Proven by evaluation, in two parts. (1) Each cache pair: the subgraph is cut at the
    condition and fed True, then False, at spread positions and several batch/past sizes;
    whatever the condition computes, each branch is its cache. (2) The condition with the
    rest: the whole subgraph, condition included, is evaluated at prompts of n positions for n
    around the length where the condition turns (found by evaluating it, below, at and above
    that length) and at spread lengths, and must give the rows of the cache the condition
    picks. The condition itself stays in the graph as exported.
    """

    described: str
    """What the switch was found to be (for the report)."""

    @classmethod
    def compute(cls, ctx, cos, sin, positions, cond, when_true: CacheSpec, when_false: CacheSpec):
        arrays = [ctx.analysis(RopeCacheRows, spec) for spec in (when_true, when_false)]
        pairs = [(a.cos, a.sin) for a in arrays]
        max_len = when_true.rows

        def prove():
            return _prove_switched(ctx.graph, positions, cond, max_len, cos, sin, pairs)

        key = ("rope-switched", cond, when_true, when_false)
        reason, described, _ = _shared_proof(ctx, key, cos, sin, prove)
        return Unproven(reason) if reason else cls(described)


@dataclasses.dataclass(frozen=True)
class EvaluatedEqual(Analysis):
    """``ctx.analysis(EvaluatedEqual, (a, ...), (b, ...))``: each value of the first tuple
    evaluates equal to the one of the second at the same place, at spread positions and
    several batch and past sizes (the exporter duplicated the cos/sin subgraph for Q and K:
    opset 23 dynamo exports emit one Cos/Sin per RotaryEmbedding). They may read one 2-D
    integer input (the positions) by value and any inputs through their shape; anything else
    (hidden states) is not evaluated."""

    equal: bool

    @classmethod
    def compute(cls, ctx, left: tuple[ir.Value, ...], right: tuple[ir.Value, ...]):
        return cls(_evaluated_equal(ctx.graph, list(left), list(right), ctx.options.max_seq_len))


def _shared_proof(ctx, key: tuple, cos, sin, prove) -> tuple[str | None, Any, bool]:
    """(why not, what the proof found, whether shared) for this cos/sin pair: ``prove()``,
    unless the pair is structurally the same computation as one already proven under ``key``
    (same ops, attributes and constants on the same inputs), whose proof it shares."""

    proven = ctx.analyses.built("rope-proven-pairs", key, list)
    live = [p for p in proven if p[0].graph is ctx.graph and p[1].graph is ctx.graph]
    for c, s, found in live[:4]:
        if same_computation(cos, c) and same_computation(sin, s):
            return None, found, True
    reason, found = prove()
    if reason is None:
        proven.append((cos, sin, found))
    return reason, found, False


# Tile: Optimum patches Cohere to ``inv_freq[None, :, None].repeat(batch, 1, 1)``.
PASS_THROUGH = ("Cast", "Unsqueeze", "Reshape", "Expand", "Tile", "Identity", "Squeeze")


def through(value: ir.Value | None, steps: int = 6) -> ir.Value | None:
    """Follow value-preserving ops (Cast, Unsqueeze, Reshape, Expand, ...) to their source."""
    for _ in range(steps):
        if value is None or value.const_value is not None:
            return value
        node = value.producer()
        if node is None or node.op_type not in PASS_THROUGH or node.domain != "":
            return value
        value = node.inputs[0]
    return value


# (batch, seq, past) sizes computed positions are checked at; a mask they read by value is fed
# right-padded (row b valid for its first lengths[b] tokens), and once with a padded prompt's
# hole kept in the cache (decode after a padded prompt: [1]*5 + [0]*2 + [1]).
_RANGE_PROBES = (
    (1, 1, 0, None),
    (2, 5, 0, (5, 3)),
    (1, 1, 7, None),
    (2, 3, 8, (11, 6)),
    (1, 33, 0, None),
    (2, 1, 7, ((1,) * 8, (1,) * 5 + (0,) * 2 + (1,))),
)


def _probe_mask(batch: int, total: int, rows) -> np.ndarray:
    if rows is None:
        return np.ones((batch, total), np.int64)
    if isinstance(rows[0], tuple):
        return np.asarray(rows, np.int64)
    return (np.arange(total)[None, :] < np.asarray(rows)[:, None]).astype(np.int64)


def _positions_cut(graph: ir.Graph, positions: ir.Value) -> tuple[ir.Value, ...] | str:
    """Where the cos/sin proof feeds positions: the ``position_ids`` input itself, or positions
    the graph computes from input *shapes* (``arange(past, past + seq)``) and at most the
    attention mask by value (``cumsum(mask) - 1``), fed there.

    The caches have ``max_seq_len`` rows, which the input contract bounds for position_ids
    (< past + seq); computed positions must be shown to stay in that range too, by evaluating
    them at several (batch, seq, past) sizes and masks. Positions computed from other input
    values (an offset position_ids, say) are not cut: the proof then sees what else cos/sin
    read, and refuses.
    """
    if positions.is_graph_input():
        return ()
    try:
        by_value, by_shape = value_dependencies(positions)
    except _Unprovable as err:
        return f"the positions could not be evaluated ({err})"
    mask = None
    if by_value:
        (mask,) = by_value if len(by_value) == 1 else (None,)
        if mask is None or input_role(mask) != "mask":
            return ()
    shaped = sorted(by_shape, key=lambda v: v.name or "")
    try:
        evaluator = SubgraphEvaluator(
            graph, [positions], inputs=[*shaped, *([mask] if mask is not None else [])]
        )
    except Exception as err:
        return f"the computed positions could not be evaluated ({type(err).__name__})"
    for batch, seq, past, rows in _RANGE_PROBES:
        feeds = {}
        for value in shaped:
            array = probe_array(value, None, batch, seq, past)
            if array is None:
                return f"the positions read the shape of {value.name!r}, which cannot be sized"
            feeds[value.name] = array
        if mask is not None:
            feeds[mask.name] = _probe_mask(batch, past + seq, rows).astype(mask.dtype.numpy())
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


def positions_of(value: ir.Value | None) -> ir.Value | None:
    if value is None or value.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    if value.shape is not None and len(value.shape) != 2:
        return None
    return value


def measured_scale(graph, cos, positions) -> float | str:
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
    if positions_of(positions) is None or positions.shape is None:
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


def _table_rows(cos, sin, dtype, interleaved):
    """(cos rows, sin rows, positions) of the tables cos/sin are gathered from, or why not."""
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
    return halves[0], halves[1], positions


def _gathered_table(value: ir.Value):
    """(table, positions) of ``Gather(table[:n], positions)`` under value-preserving ops."""
    gather = _through_to(value, "Gather")
    if gather is None or attr(gather, "axis", 0) != 0:
        return None
    positions = positions_of(through(gather.inputs[1]))
    source = gather.inputs[0]
    node = source.producer()
    if node is not None and node.op_type == "Slice":  # cos_cached[:seq_len] (rows axis)
        axes = input_at(node, 3)
        if const_ints(input_at(node, 1)) != [0] or (axes is not None and const_ints(axes) != [0]):
            return None
        source = node.inputs[0]
    table = const_array(through(source))
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
        if node.op_type not in PASS_THROUGH:
            return None
        value = node.inputs[0]
    return None


def _prove_switched(graph, positions, cond, max_len, cos, sin, arrays):
    """(None, what was found) when the run-time cos/sin are the switched caches ``arrays``
    ((cos, sin) when the condition holds, then when not; see :class:`RopeSwitchProof`), else
    (why not, "")."""
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
