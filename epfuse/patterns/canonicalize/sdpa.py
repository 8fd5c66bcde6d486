"""Decomposed scaled-dot-product attention -> ONNX ``Attention`` (opset 23).

Below opset 23 ``torch.onnx`` writes ``F.scaled_dot_product_attention`` (and eager HF
attention) out as primitive ops::

    scores = MatMul(Q * a, K^T * b) * c            # the scale on Q, K and/or the scores
    scores = softcap * Tanh(scores / softcap)       # optional (Gemma-2 style)
    scores = scores + mask                          # optional additive float mask
    P      = Softmax(scores, axis=-1)               # optionally Cast to float32 and back
    P      = Where(IsNaN(P), 0, P)                  # optional NaN guard (torch's SDPA)
    Y      = MatMul(P, V)

which is exactly ONNX ``Attention(Q, K, V, mask, scale=a*b*c, softcap=...)``. Checked before
anything changes: Q, K, V are rank 4; K^T is K with its last two axes swapped (a
``Transpose(perm=[0,1,3,2])`` or torch's ``Reshape(-1,T,H) -> Transpose(0,2,1) ->
Reshape(B,N,H,T)`` whose targets are proven from ``Shape(K)``); every scale is a constant
scalar, or one computed from constants and static dims (TorchScript's SDPA with
``scale=None`` writes ``sqrt(1/sqrt(Q.shape[-1]))`` on Q and on K^T); the softmax runs over the
last axis; the mask has the model dtype and rank <= 4.

The NaN guard only differs from plain softmax on rows whose softmax is NaN. With finite Q/K
that happens only when a whole row of the mask is -inf, so the guard is accepted only when the
mask is proven finite (``Where`` of finite constants, or a finite constant, through shape-only
ops) or absent; then both graphs compute the same numbers.

The emitted op is opset 23, so the model's default opset is raised (see ``_opset``).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import onnx_ir as ir

from .._graph import (
    attr,
    const_array,
    const_ints,
    const_scalar,
    dim,
    initializer,
    only_consumer,
    producer,
    remove_dead,
    replace_value,
    shape_vector,
)
from .._opset import require_default_opset
from ..analysis.head_counts import axis_size, record_heads
from ..analysis.manager import Unproven
from ..analysis.mask_proof import MASKED_BELOW, MaskProof
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..matcher import ABSENT, Ints, Match, Or, Var, match_value, op
from ..reasons import ReasonCode

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


_FOLDABLE = {"Cast", "Sqrt", "Reciprocal", "Div", "Mul", "Add", "Sub"}


def _static_scalar(value: ir.Value, depth: int = 0) -> np.ndarray | None:
    """A one-element array when ``value`` is a constant, or is computed from constants and
    static dims only (TorchScript's SDPA with ``scale=None`` computes ``1/sqrt(q.shape[-1])``
    in the graph, from ``Shape(Q)``, and puts its square root on Q and on K). The arithmetic
    runs in numpy in the graph's dtypes, as ORT would run it."""
    array = const_array(value)
    if array is not None:
        return array if array.size == 1 else None
    node = value.producer()
    if node is None or node.domain != "" or depth > 8:
        return None
    if node.op_type in ("Shape", "Slice", "Gather", "Squeeze", "Unsqueeze", "Reshape"):
        dims = shape_vector(value)
        if dims is None or len(dims) != 1 or not isinstance(dims[0], int):
            return None
        return np.array([dims[0]], np.int64)
    if node.op_type not in _FOLDABLE:
        return None
    args = [_static_scalar(v, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    if node.op_type == "Cast":
        return args[0].astype(ir.DataType(attr(node, "to")).numpy())
    if node.op_type in ("Sqrt", "Reciprocal"):
        if args[0].dtype.kind != "f":
            return None
        return np.sqrt(args[0]) if node.op_type == "Sqrt" else np.reciprocal(args[0])
    a, b = args
    if a.dtype != b.dtype or a.dtype.kind != "f" or (node.op_type == "Div" and not b.all()):
        return None  # integer division and mixed dtypes are not what SDPA's scale does
    op = {"Div": np.divide, "Mul": np.multiply, "Add": np.add, "Sub": np.subtract}
    return op[node.op_type](a, b)


def _scalar(operand: ir.Value) -> float | None:
    """c when ``operand`` is a floating scalar (rank <= 4) that is a constant or computed
    from constants and static dims (``_static_scalar``)."""
    array = _static_scalar(operand) if operand.shape is None or len(operand.shape) <= 4 else None
    if array is None or array.size != 1 or array.ndim > 4 or array.dtype.kind != "f":
        return None
    return float(array.reshape(-1)[0])


def _computed(value: ir.Value) -> bool:
    """Not a constant, nor computed from constants and static dims."""
    return value.const_value is None and _static_scalar(value) is None


def _scalar_operand(node: ir.Node) -> tuple[float, ir.Value] | None:
    """(c, x) when the binary ``node`` has one scalar operand c (``_scalar``) and x is
    computed (``_computed``)."""
    for a, b in ((0, 1), (1, 0)):
        c = _scalar(node.inputs[b])
        if c is not None and _computed(node.inputs[a]):
            return c, node.inputs[a]
    return None


def _peel_scale(value: ir.Value, chain: list[ir.Node]) -> tuple[ir.Value, float]:
    """Strip ``Mul``/``Div`` by constant scalars; the product of the factors."""
    factor = 1.0
    for _ in range(4):
        node = value.producer()
        if node is None or node.domain != "":
            break
        if node.op_type == "Mul" and (got := _scalar_operand(node)) is not None:
            factor *= got[0]
            value = got[1]
        elif node.op_type == "Div" and (divisor := const_scalar(node.inputs[1])) is not None:
            if divisor == 0 or node.inputs[0].const_value is not None:
                break
            if const_array(node.inputs[1]).ndim > 4:
                break
            factor /= divisor
            value = node.inputs[0]
        else:
            break
        chain.append(node)
    return value, factor


def _perm(*axes: int):
    """An attribute predicate: ``perm`` is ``axes``."""
    return lambda perm: perm is not None and list(perm) == list(axes)


_K_SWAPPED = Or(
    op.Transpose(Var("k"), perm=_perm(0, 1, 3, 2)),
    # torch: Reshape(K, [-1, T, H]) -> Transpose(0, 2, 1) -> Reshape([B, N, H, T])
    op.Reshape(
        op.Transpose(op.Reshape(Var("k"), Var("first")), perm=_perm(0, 2, 1)),
        Var("last"),
        bind="outer",
    ),
)


def _swaps_last_axes(m: Match) -> bool:
    """The torch form's Reshape targets, proven from ``Shape(K)``: [-1, T, H] and
    [B, N, H, T] of the rank-4 K."""
    if "outer" not in m:
        return True
    k = m["k"]
    if _rank(k) != 4:
        return False
    d = [dim(k, i) for i in range(4)]
    first, last = shape_vector(m["first"]), shape_vector(m["last"])
    return first == [-1, d[2], d[3]] and last == [d[0], d[1], d[3], d[2]]


def _untranspose(kt: ir.Value, chain: list[ir.Node]) -> ir.Value | None:
    """K when ``kt`` is K (B, N, T, H) with its last two axes swapped."""
    found = match_value(_K_SWAPPED, kt, where=_swaps_last_axes)
    if found is None:
        return None
    chain.extend(found.nodes)
    return found["k"]


def _proven_finite(value: ir.Value, depth: int = 0) -> bool:
    """The value holds only finite numbers whatever the inputs (Where of finite constants)."""
    if depth > 8:
        return False
    array = const_array(value)
    if array is not None:
        return array.dtype.kind == "f" and bool(np.isfinite(array).all())
    node = value.producer()
    if node is None or node.domain != "":
        return False
    if node.op_type == "Where":
        return _proven_finite(node.inputs[1], depth + 1) and _proven_finite(
            node.inputs[2], depth + 1
        )
    if node.op_type in ("Expand", "Reshape", "Unsqueeze", "Squeeze", "Slice", "Identity"):
        return _proven_finite(node.inputs[0], depth + 1)
    return False


def _key_slice_source(value: ir.Value, k: ir.Value) -> ir.Value:
    """``x`` when ``value`` is ``x[..., :T]`` with T the key length of K (torch's SDPA slices
    the mask to the keys); else ``value``. The slice is a no-op exactly when ``x`` has T
    columns, which the mask proof establishes (a longer mask does not broadcast)."""
    found = match_value(_KEY_SLICE, value)
    if found is None or _rank(found["x"]) != 4 or shape_vector(found["end"]) != [dim(k, 2)]:
        return value
    return found["x"]


_KEY_SLICE = op.Slice(Var("x"), Ints([0]), Var("end"), Ints([-1], [3]), Or(Ints([1]), ABSENT))
"""``x[..., :end]``: a last-axis Slice from 0 with unit step (or none)."""


def _lowest(dtype: ir.DataType) -> float:
    """The dtype's lowest finite number (ml_dtypes knows bfloat16 as well as numpy's floats)."""
    return float(ml_dtypes.finfo(dtype.numpy()).min)


@dataclasses.dataclass(frozen=True)
class _InertGuardPlan:
    """The finite mask that replaces a -inf mask whose NaN guard is proven inert.

    ``source`` is a boolean "visible" mask (``where``: the mask was ``Where(source, 0, -inf)``)
    or the additive mask itself (``Max(source, lowest)``). Masked entries become the dtype's
    lowest finite number: on a row with a visible key that is exactly the -inf result
    (``exp`` underflows to 0), and a row with none — only padding rows, by the proof — gets
    finite values instead of the guard's zeros, so no NaN can reach valid rows through the
    padded positions' K/V in later layers.
    """

    source: ir.Value
    dtype: ir.DataType
    where: bool

    def build(self, ctx: RewriteContext) -> ir.Value:
        return ctx.analyses.built(
            "finite-mask", (self.source, self.dtype, self.where), lambda: self._build(ctx)
        )

    def _build(self, ctx: RewriteContext) -> ir.Value:
        graph = ctx.graph
        lowest = np.array(_lowest(self.dtype), dtype=np.float32)
        base = f"{self.source.name or 'mask'}/epfuse_finite"
        if self.where:
            zero = np.array(0.0, dtype=np.float32)
            consts = [
                _typed_initializer(graph, f"{base}/visible", zero, self.dtype),
                _typed_initializer(graph, f"{base}/masked", lowest, self.dtype),
            ]
            node = ir.node("Where", [self.source, *consts], name=base)
        else:
            floor = _typed_initializer(graph, f"{base}/lowest", lowest, self.dtype)
            node = ir.node("Max", [self.source, floor], name=base)
        out = node.outputs[0]
        out.name = base
        out.dtype = self.dtype
        out.shape = self.source.shape
        producer_node = self.source.producer()
        if producer_node is not None and producer_node.graph is graph:
            graph.insert_after(producer_node, node)
        else:
            graph.insert_before(graph.node(0), node)
        return out


def _typed_initializer(graph: ir.Graph, name: str, value: np.ndarray, dtype: ir.DataType):
    return initializer(graph, name, value.astype(dtype.numpy()))


def _plan_inert_guard(mask: ir.Value, k: ir.Value, ctx: RewriteContext):
    """Prove the NaN guard after the softmax is inert on valid rows, by evaluating the mask.

    ``Where(IsNaN(P), 0, P)`` differs from ``P`` only on rows whose keys are all masked with
    -inf. The mask (with torch's slice to the key length peeled) is proven causal + padding,
    optionally with a sliding window (``analysis.mask_proof``): every valid query row then sees at
    least its own key, so the guard changes only padding rows, which the model's input
    contract (right padding) leaves unread. Returns the plan, or why the guard must stay.
    """
    dtype = mask.dtype
    where = producer(mask, "Where")
    if where is not None:
        visible, masked = const_scalar(where.inputs[1]), const_scalar(where.inputs[2])
        if (
            where.inputs[0].dtype == ir.DataType.BOOL
            and visible == 0.0
            and masked is not None
            and masked <= MASKED_BELOW
            and (const_array(where.inputs[2]).ndim <= 4)
        ):
            source = _key_slice_source(where.inputs[0], k)
            plan = _InertGuardPlan(source, dtype, where=True)
        else:
            where = None
    if where is None:
        plan = _InertGuardPlan(_key_slice_source(mask, k), dtype, where=False)
    proven = ctx.analysis(MaskProof, plan.source, False, False, ctx.options.max_seq_len)
    if isinstance(proven, Unproven):
        why = proven.reason
        return f"the mask is not finite and not proven to leave a key for every row ({why})"
    return plan


class AttentionMatch:
    """What matching a decomposed attention found: the nodes it covers (``chain``, removed on
    rewrite), the score scale, the softcap (0 when none), the additive mask and the softmax's
    precision. The attention-sink lift matches the same scores and reuses it."""

    def __init__(self) -> None:
        self.chain: list[ir.Node] = []
        self.scale = 1.0
        self.softcap = 0.0
        self.mask: ir.Value | None = None
        self.softmax_precision: int | None = None


_SOFTCAP = op.Mul(
    op.Tanh(
        Or(
            op.Div(Var("x"), Var("divisor"), bind="inner"),
            op.Mul(Var("x"), Var("factor"), commute=True, bind="inner"),
        )
    ),
    Var("cap", check=lambda v: (c := _scalar(v)) is not None and c > 0),
    commute=True,
)
"""``cap * Tanh(x / cap)`` (or ``x * (1 / cap)``): Gemma-2's logit softcap."""


def _caps(m: Match) -> bool:
    cap = _scalar(m["cap"])
    if "divisor" in m:
        return const_scalar(m["divisor"]) == cap
    factor = _scalar(m["factor"])
    return (
        factor is not None and _computed(m["x"]) and math.isclose(factor * cap, 1.0, rel_tol=1e-6)
    )


def _parse_softcap(value: ir.Value, m: AttentionMatch) -> ir.Value:
    """Strip ``cap * Tanh(x / cap)``; records the cap."""
    found = match_value(_SOFTCAP, value, where=_caps)
    if found is None:
        return value
    m.softcap = _scalar(found["cap"])
    m.chain.extend(found.nodes)
    return found["x"]


def _parse_scores(scores: ir.Value, m: AttentionMatch) -> tuple[ir.Value, ir.Value] | str | None:
    """(Q, K) of ``scores = scale * Q @ K^T`` (softcap, scale already parsed here)."""
    value = _parse_softcap(scores, m)
    value, factor = _peel_scale(value, m.chain)
    matmul = producer(value, "MatMul")
    if matmul is None:
        return None
    m.chain.append(matmul)
    q, fq = _peel_scale(matmul.inputs[0], m.chain)
    kt, fk1 = _peel_scale(matmul.inputs[1], m.chain)
    k = _untranspose(kt, m.chain)
    if k is None:
        return "the second MatMul operand is not K with its last two axes swapped"
    k, fk2 = _peel_scale(k, m.chain)
    m.scale = factor * fq * fk1 * fk2
    return q, k


@dataclasses.dataclass
class _Decomposed:
    scores_match: AttentionMatch
    q: ir.Value
    k: ir.Value
    v: ir.Value
    pv: ir.Node
    guarded: bool
    """A softmax NaN guard ``Where(IsNaN(P), 0, P)`` was stripped (``check`` proves it inert)."""
    guard_plan: _InertGuardPlan | None = None


class DecomposedAttentionToAttention(
    Rule, name="decomposed-attention-to-attention", stage=Stage.CANONICALIZE, anchor="Softmax"
):
    """MatMul/scale/mask/Softmax/MatMul attention -> ONNX Attention (opset 23)"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        m = AttentionMatch()
        m.chain.append(node)
        probs = node.outputs[0]
        # Optional float32 softmax: Cast(T -> float) before, Cast(float -> T) after.
        upcast = producer(node.inputs[0], "Cast")
        scores = node.inputs[0]
        if upcast is not None and attr(upcast, "to") == ir.DataType.FLOAT:
            scores = upcast.inputs[0]
            m.chain.append(upcast)
        consumer = only_consumer(probs)
        if upcast is not None and scores is not node.inputs[0]:
            if (
                consumer is None
                or consumer.op_type != "Cast"
                or attr(consumer, "to") != (scores.dtype)
            ):
                return None
            m.chain.append(consumer)
            probs = consumer.outputs[0]
            if scores.dtype != ir.DataType.FLOAT:
                m.softmax_precision = int(ir.DataType.FLOAT)
        probs, guarded = _strip_nan_guard(probs, m)
        pv = only_consumer(probs)
        if pv is None or pv.op_type != "MatMul" or pv.domain != "" or pv.inputs[0] is not probs:
            return None
        m.chain.append(pv)
        v = pv.inputs[1]

        parsed = self._parse_masked_scores(scores, m)
        if parsed is None:
            return None
        if isinstance(parsed, str):
            return Kept(ReasonCode.FORM, parsed)
        q, k = parsed

        reason = self._check(node, q, k, v, m)
        if reason:
            return Kept(ReasonCode.FORM, reason)
        return _Decomposed(m, q, k, v, pv, guarded)

    def check(self, d: _Decomposed, ctx: RewriteContext) -> Kept | None:
        mask = d.scores_match.mask
        if d.guarded and mask is not None and not _proven_finite(mask):
            guard_plan = _plan_inert_guard(mask, d.k, ctx)
            if isinstance(guard_plan, str):
                return Kept(ReasonCode.NOT_PROVEN, f"the softmax NaN guard is kept: {guard_plan}")
            d.guard_plan = guard_plan
        reason = require_default_opset(ctx.model, 23, ctx.cache)
        if reason:
            return Kept(ReasonCode.OPSET, reason)
        return None

    def rewrite(self, d: _Decomposed, ctx: RewriteContext) -> Rewritten:
        m, q, k, v, pv, guard_plan = d.scores_match, d.q, d.k, d.v, d.pv, d.guard_plan
        heads = [axis_size(x) for x in (q, k, v)]
        if guard_plan is not None:
            m.mask = guard_plan.build(ctx)
        attributes: dict[str, object] = {"scale": float(m.scale)}
        if m.softcap:
            attributes["softcap"] = float(m.softcap)
        if m.softmax_precision is not None:
            attributes["softmax_precision"] = m.softmax_precision
        fused = ir.node(
            "Attention",
            [q, k, v] + ([m.mask] if m.mask is not None else []),
            attributes,
            name=f"{pv.name or 'attention'}/Attention",
            metadata_props=dict(pv.metadata_props),
        )
        ctx.graph.insert_before(pv, fused)
        for value, count in zip((q, k, v), heads, strict=True):
            record_heads(value, count)
        y, old = fused.outputs[0], pv.outputs[0]
        y.shape, y.type = old.shape, old.type
        if old.name and not old.is_graph_output():
            y.name, old.name = old.name, None
        replace_value(old, y)
        remove_dead(ctx.graph, list(reversed(m.chain)))
        note = f"scale {m.scale:g}"
        if m.softcap:
            note += f", softcap {m.softcap:g}"
        return Rewritten(note + (", masked" if m.mask is not None else ""))

    @staticmethod
    def _parse_masked_scores(scores: ir.Value, m: AttentionMatch):
        add = producer(scores, "Add")
        if add is not None:
            for a, b in ((0, 1), (1, 0)):
                trial = AttentionMatch()
                parsed = _parse_scores(add.inputs[a], trial)
                if parsed is None:
                    continue
                m.chain += [add, *trial.chain]
                m.scale, m.softcap, m.mask = trial.scale, trial.softcap, add.inputs[b]
                return parsed
        trial = AttentionMatch()
        parsed = _parse_scores(scores, trial)
        if parsed is not None:
            m.chain += trial.chain
            m.scale, m.softcap = trial.scale, trial.softcap
        return parsed

    @staticmethod
    def _check(softmax: ir.Node, q, k, v, m: AttentionMatch) -> str | None:
        for name, value in (("Q", q), ("K", k), ("V", v)):
            if _rank(value) != 4:
                return f"{name} is not rank 4 (batch, heads, seq, head_size)"
            if value.dtype not in _FLOATS:
                return f"{name} is not floating point"
        if not (q.dtype == k.dtype == v.dtype):
            return "Q, K and V differ in dtype"
        axis = attr(softmax, "axis")
        if axis is None:  # the default was 1 (on a 2-D coercion) before opset 13
            axis = -1 if _default_opset(softmax) >= 13 else 1
        if axis not in (-1, 3):
            return f"softmax over axis {axis}, not the key axis"
        hq, hk = dim(q, 3), dim(k, 3)
        if isinstance(hq, int) and isinstance(hk, int) and hq != hk:
            return "Q and K head sizes differ"
        nq, nk, nv = axis_size(q), axis_size(k), axis_size(v)
        if not all(isinstance(n, int) for n in (nq, nk, nv)):
            return "head counts are not static"
        if nk != nv or nq % nk:
            return "query heads are not a multiple of the K/V heads"
        if not math.isfinite(m.scale) or m.scale == 0:
            return "the attention scale is not a finite non-zero number"
        if m.mask is not None:
            if m.mask.dtype != q.dtype:
                return "the additive mask does not have the model dtype"
            if _rank(m.mask) is None or _rank(m.mask) > 4:
                return "the mask rank is unknown or above 4"
        return None


def _default_opset(node: ir.Node) -> int:
    graph = node.graph
    opsets = graph.opset_imports if graph is not None else {}
    return opsets.get("", opsets.get("ai.onnx", 1))


def _strip_nan_guard(probs: ir.Value, m: AttentionMatch) -> tuple[ir.Value, bool]:
    """``Where(IsNaN(P), 0, P)`` -> its output (the caller proves the guard is a no-op)."""
    uses = list(probs.uses())
    if len(uses) != 2 or probs.is_graph_output():
        return probs, False
    isnan = next((u.node for u in uses if u.node.op_type == "IsNaN"), None)
    where = next((u.node for u in uses if u.node.op_type == "Where"), None)
    if isnan is None or where is None:
        return probs, False
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not probs:
        return probs, False
    if const_scalar(where.inputs[1]) != 0.0 or len(list(isnan.outputs[0].uses())) != 1:
        return probs, False
    if const_ints(where.inputs[1]) is not None:
        return probs, False
    m.chain.extend([isnan, where])
    return where.outputs[0], True
