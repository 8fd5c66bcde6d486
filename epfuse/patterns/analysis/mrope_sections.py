"""The meaning of a 3-D mRoPE cos/sin pair (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), proven by
evaluating the graph: which position stream feeds each frequency column, and the caches.

The mRoPE lowering (``lower/mrope``) rewrites from it; the GQA lowering asks it why a layer's
rotation stays outside the fused node. Nothing is read from names or assumed from the model
family. The cos/sin subgraph must read one graph input by value, of shape (3, batch, seq)
int64, and is then *evaluated* on ORT:

1. which stream feeds each of the R/2 frequency columns: change one stream at a time and see
   which columns move; the column map must be a sectioned (Qwen2/2.5-VL) or interleaved
   (Qwen3-VL) layout, which gives ``mrope_section`` and ``mrope_layout``;
2. the caches: float64 ``cos/sin(arange(max_seq_len) x inv_freq) * scale`` from the graph's
   ``inv_freq`` constant (the scale is read from position 0), or the graph's own constant
   (rows, R/2) tables when cos/sin are gathered from them;
3. proof: at random, independent T/H/W positions up to the last cache row the graph's cos/sin
   must equal the caches mixed by the column map.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from .._evaluate import SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import const_array, input_at
from .manager import Analysis, Unproven

if TYPE_CHECKING:
    from ..base import RewriteContext

SECTIONED, INTERLEAVED = 0, 1
_LAYOUT_NAMES = {SECTIONED: "sectioned", INTERLEAVED: "interleaved"}
_MAX_WALK = 256  # nodes searched upstream of cos/sin for their constants


@dataclasses.dataclass(frozen=True)
class MRopeSections(Analysis):
    """The proven meaning of one mRoPE cos/sin pair:
    ``ctx.analysis(MRopeSections, cos, sin, dtype, max_seq_len)`` (``dtype``: of the caches).
    None when cos/sin are not computed from a (3, B, S) input at all; :class:`Unproven` when
    they are but the layout or the caches could not be proven."""

    positions: ir.Value
    streams: np.ndarray
    """(R/2,) stream index (0 = T, 1 = H, 2 = W) of each frequency column."""
    sections: tuple[int, int, int]
    layout: int
    cos_cache: np.ndarray
    sin_cache: np.ndarray
    from_tables: bool
    """cos/sin are already gathered from constant tables (nothing computed at run time)."""

    def describe(self) -> str:
        return f"mRoPE {_LAYOUT_NAMES[self.layout]} sections {list(self.sections)}"

    @classmethod
    def compute(
        cls,
        ctx: RewriteContext,
        cos: ir.Value,
        sin: ir.Value,
        dtype: ir.DataType,
        max_seq_len: int,
    ) -> MRopeSections | Unproven | None:
        found = analyze_mrope(cos, sin, ctx.graph, max_seq_len, dtype)
        return Unproven(found) if isinstance(found, str) else found


def mrope_sections(ctx: RewriteContext, rope: ir.Node) -> MRopeSections | Unproven | None:
    """:class:`MRopeSections` of a ``RotaryEmbedding``'s cos/sin, from the run's analyses
    (None also when the node has no cos/sin inputs or no known dtype)."""
    x, cos, sin = rope.inputs[0], input_at(rope, 1), input_at(rope, 2)
    if cos is None or sin is None or x is None or x.dtype is None:
        return None
    return ctx.analysis(MRopeSections, cos, sin, x.dtype, ctx.options.max_seq_len)


def unproven_reason(ctx: RewriteContext, rope: ir.Node) -> str | None:
    """Why this run left ``rope``'s mRoPE as built, if its analysis said so (for reports):
    only what was asked already, nothing is computed."""
    x, cos, sin = rope.inputs[0], input_at(rope, 1), input_at(rope, 2)
    if cos is None or sin is None or x is None:
        return None
    found = ctx.analyses.peek(MRopeSections, cos, sin, x.dtype, ctx.options.max_seq_len)
    return found.reason if isinstance(found, Unproven) else None


def mrope_positions(value: ir.Value) -> ir.Value | None:
    """The (3, batch, seq) int graph input ``value`` is computed from, if it reads only that.

    Only a bounded upstream is searched (cos/sin subgraphs are small), so asking this of every
    RotaryEmbedding keeps the pass linear.
    """
    if not _small_upstream(value):
        return None
    try:
        by_value, _ = value_dependencies(value)
    except _Unprovable:
        return None
    if len(by_value) != 1:
        return None
    (pos,) = by_value
    if not is_streams(pos):
        return None
    return pos


def is_streams(value: ir.Value) -> bool:
    """A (3, batch, seq) integer value: mRoPE position streams."""
    shape = value.shape
    return (
        shape is not None
        and len(shape) == 3
        and shape[0] == 3
        and value.dtype in (ir.DataType.INT64, ir.DataType.INT32)
    )


def layout_of(streams: np.ndarray) -> tuple[int, tuple[int, int, int]] | None:
    """(layout, mrope_section) that produce the column map ``streams``, or None."""
    counts = tuple(int(c) for c in np.bincount(streams, minlength=3)[:3])
    if len(streams) != sum(counts):
        return None
    if np.all(np.diff(streams) >= 0):
        return SECTIONED, counts
    if np.array_equal(interleaved_streams(len(streams), counts), streams):
        return INTERLEAVED, counts
    return None


def interleaved_streams(half: int, sections: tuple[int, int, int]) -> np.ndarray:
    """Qwen3-VL's map: T everywhere, H at 1, 4, ... (first 3*h), W at 2, 5, ... (first 3*w)."""
    streams = np.zeros(half, dtype=np.int64)
    streams[1 : 3 * sections[1] : 3] = 1
    streams[2 : 3 * sections[2] : 3] = 2
    return streams


def analyze_mrope(
    cos: ir.Value, sin: ir.Value, graph: ir.Graph, max_seq_len: int, dtype: ir.DataType
) -> MRopeSections | str | None:
    """None when cos/sin are not computed from a (3, B, S) input; a reason when unproven
    (uncached: a run asks :func:`mrope_sections`)."""
    pos = mrope_positions(cos)
    if pos is None or mrope_positions(sin) is not pos:
        return None
    if pos.dtype != ir.DataType.INT64:
        return "the mRoPE position streams are not int64"
    try:
        evaluator = SubgraphEvaluator(graph, [cos, sin], inputs=[pos])
    except Exception as err:
        return f"the mRoPE cos/sin subgraph could not be evaluated ({type(err).__name__})"
    if evaluator.input_names != [pos.name]:
        return "mRoPE cos/sin depend on more than the positions"

    try:
        return _analyze(evaluator, pos, cos, sin, max_seq_len, dtype)
    except _EvaluationFailed as err:
        return f"the mRoPE cos/sin subgraph failed on a probe ({err})"


class _EvaluationFailed(Exception):
    pass


def _analyze(evaluator, pos, cos, sin, max_seq_len, dtype) -> MRopeSections | str:
    def run(streams: np.ndarray):
        try:
            got = evaluator({pos.name: streams.astype(np.int64)})
        except Exception as err:
            raise _EvaluationFailed(type(err).__name__) from err
        return [np.asarray(g, dtype=np.float64) for g in got]

    zero_cos, zero_sin = run(np.zeros((3, 1, 1), dtype=np.int64))
    if zero_cos.ndim != 3 or zero_cos.shape != zero_sin.shape or zero_cos.shape[:2] != (1, 1):
        return "mRoPE cos/sin are not (batch, seq, R/2)"
    half = zero_cos.shape[2]
    tables = _tables(cos, half), _tables(sin, half)
    have_tables = tables[0] is not None and tables[1] is not None
    if have_tables and tables[0].shape != tables[1].shape:
        return "mRoPE cos and sin tables differ in shape"
    limit = tables[0].shape[0] if have_tables else max_seq_len
    if limit < 16:
        return f"only {limit} cached positions"

    # 1. the column map, by moving one stream at a time
    base = np.unique(np.linspace(1, limit - 8, num=32).astype(np.int64))
    base_pos = np.broadcast_to(base, (3, 1, len(base))).copy()
    ref_cos, ref_sin = run(base_pos)
    if ref_cos.shape != (1, len(base), half) or ref_sin.shape != ref_cos.shape:
        return "mRoPE cos/sin are not (batch, seq, R/2)"
    moved = np.zeros((3, half), dtype=bool)
    for k in range(3):
        probe = base_pos.copy()
        probe[k] += 7
        got_cos, got_sin = run(probe)
        moved[k] = ((got_cos != ref_cos) | (got_sin != ref_sin)).any(axis=(0, 1))
    if not (moved.sum(axis=0) == 1).all():
        return "some cos/sin column is not read from exactly one position stream"
    streams = moved.argmax(axis=0)
    found = layout_of(streams)
    if found is None:
        return "the position streams are mixed in neither the sectioned nor the interleaved layout"
    layout, sections = found

    # 2. the caches
    inv_freq = _inv_freq(cos, half), _inv_freq(sin, half)
    np_dtype = dtype.numpy()
    if have_tables:
        cos_cache, sin_cache = (t.astype(np_dtype) for t in tables)
        from_tables = True
    elif inv_freq[0] is not None and inv_freq[1] is not None:
        if not np.array_equal(inv_freq[0], inv_freq[1]):
            return "mRoPE cos and sin use different inv_freq"
        scale = float(zero_cos.reshape(-1)[0])
        if not (np.all(zero_cos == scale) and np.all(zero_sin == 0.0)) or scale <= 0:
            return "mRoPE cos/sin are not scaled cos/sin of angles zero at position 0"
        angles = np.arange(max_seq_len, dtype=np.float64)[:, None] * inv_freq[0][None, :]
        cos_cache = (np.cos(angles) * scale).astype(np_dtype)
        sin_cache = (np.sin(angles) * scale).astype(np_dtype)
        from_tables = False
    else:
        return "mRoPE cos/sin come from neither an inv_freq constant nor constant tables"

    # 3. proof at independent T/H/W positions
    rows = cos_cache.shape[0]
    rng = np.random.default_rng(0)
    tol = 1e-6 + 2e-7 * rows  # float32 angle rounding grows with the position
    if np_dtype != np.float32:
        tol = max(tol, 2e-3)
    for batch, seq in ((2, 37), (1, 5)):
        probe = rng.integers(0, rows, size=(3, batch, seq), dtype=np.int64)
        probe[:, 0, 0] = rows - 1
        got_cos, got_sin = run(probe)
        cols = np.arange(half)
        index = probe[streams].transpose(1, 2, 0)  # (B, S, R/2): the row each column reads
        for got, cache in ((got_cos, cos_cache), (got_sin, sin_cache)):
            expected = cache.astype(np.float64)[index, cols]
            if got.shape != expected.shape or not np.allclose(got, expected, atol=tol, rtol=0):
                return "the graph's mRoPE cos/sin do not match the mixed caches"
    return MRopeSections(pos, streams, sections, layout, cos_cache, sin_cache, from_tables)


def _small_upstream(value: ir.Value) -> bool:
    seen: set[ir.Node] = set()
    stack = [value]
    while stack:
        node = stack.pop().producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        if len(seen) > _MAX_WALK:
            return False
        stack.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return True


def _upstream(value: ir.Value):
    seen: set[ir.Node] = set()
    stack = [value]
    while stack and len(seen) < _MAX_WALK:
        node = stack.pop().producer()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(v for v in node.inputs if v is not None and v.const_value is None)


def _tables(value: ir.Value, half: int) -> np.ndarray | None:
    """The one constant (rows, R/2) float table that cos (or sin) is gathered from."""
    found = []
    for node in _upstream(value):
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
            table = const_array(node.inputs[0])
            if (
                table is not None
                and table.ndim == 2
                and table.shape[1] == half
                and table.dtype.kind == "f"
            ):
                found.append(table)
    if not found or any(not np.array_equal(t, found[0]) for t in found[1:]):
        return None
    return found[0]


def _inv_freq(value: ir.Value, half: int) -> np.ndarray | None:
    """The one (R/2,) float constant multiplied into the angles (float64)."""
    found = []
    for node in _upstream(value):
        if node.op_type == "Mul" and node.domain in ("", "ai.onnx"):
            for operand in node.inputs:
                array = const_array(operand)
                if array is None or array.dtype.kind != "f":
                    continue
                if array.size == half and array.reshape(-1).shape == (half,) and half > 1:
                    found.append(array.reshape(-1).astype(np.float64))
    if not found or any(not np.array_equal(f, found[0]) for f in found[1:]):
        return None
    return found[0]
