"""Qwen3's per-head q/k RMS norm into GroupQueryAttention (``q_norm_weight``/``k_norm_weight``),
only where the record has ``gqa.qk_norm`` (CUDA, WebGPU per the facts file; ORT 1.32's CPU
kernel rejects these inputs at run time).

Shape: ``GQA(post_q(Norm(pre_q(Xq), wq)), post_k(Norm(pre_k(Xk), wk)), ...)`` where ``pre``
and ``post`` are chains of Reshape/Transpose, ``Norm`` is RMSNormalization (or ORT's
SimplifiedLayerNormalization) over the last axis with a 1-D scale of the head size, and ``X``
is the (B, S, N*H) projection. GQA applies its norm per head *before* any rotary, so the
chains must hold nothing else: with the rotation outside GQA (``do_rotary=0``) it sits between
the norm and GQA, nothing matches, and the norm stays in the graph.

Proof, by evaluation (the layout chains read run-time shape vectors): on probe sizes, ``pre``
must map every aligned H-chunk of X's last axis to one row of the norm's last axis, in order,
and ``post`` applied to ``pre``'s output must give X back. A row-wise norm then commutes with
the chains, so ``post(Norm(pre(X)))`` is the per-head norm of X, which is what GQA computes
from ``X`` and the weight. Values are coded in base 128 so that the probes are exact in fp16
and bf16.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._evaluate import SubgraphEvaluator
from .._graph import attr, input_at
from .._layout import last_dim
from ..analysis.signature import probe_array
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode

_LAYOUT = ("Reshape", "Transpose")
_NORMS = ("RMSNormalization", "SimplifiedLayerNormalization")
_PROBES = ((2, 3), (1, 5))
_BASE = 128


def _chain(value: ir.Value) -> tuple[ir.Node, ir.Value] | None:
    """(norm node, X) for ``value = post(Norm(pre(X)))``; None when the shape differs."""
    node = value.producer()
    for _ in range(6):
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in _NORMS:
            break
        if node.op_type not in _LAYOUT:
            return None
        node = node.inputs[0].producer()
    else:
        return None
    norm = node
    x = norm.inputs[0]
    for _ in range(6):
        producer = x.producer()
        if producer is None or producer.op_type not in _LAYOUT:
            break
        if x.shape is not None and len(x.shape) == 3 and producer.op_type == "Reshape":
            break
        x = producer.inputs[0]
    if x.shape is None or len(x.shape) != 3:
        return None
    return norm, x


def _norm_params(norm: ir.Node, head_size: int) -> tuple[ir.Value, float] | str:
    x = norm.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    axis = int(attr(norm, "axis", -1))
    if rank is None or axis not in (-1, rank - 1):
        return "the q/k norm is not over the last axis"
    if int(attr(norm, "stash_type", 1)) != 1:
        return "the q/k norm does not keep fp32 statistics"
    weight = input_at(norm, 1)
    if weight is None or weight.const_value is None or list(weight.shape or []) != [head_size]:
        return f"the q/k norm scale is not a constant of the head size {head_size}"
    if len(norm.outputs) > 1 and any(o.uses() for o in norm.outputs[1:]):
        return "the q/k norm's extra outputs are used"
    return weight, float(attr(norm, "epsilon", 1e-5))


def _prove(
    graph: ir.Graph, gqa_input: ir.Value, norm: ir.Node, x: ir.Value, heads: int, head_size: int
) -> str | None:
    """None when ``gqa_input == per-head Norm(x)`` is proven on the probe sizes."""
    norm_in, norm_out = norm.inputs[0], norm.outputs[0]
    if gqa_input.type is None and norm_out.dtype is not None:
        # Reshape/Transpose keep the dtype; the evaluator needs it to return bf16 as fp32.
        gqa_input.type = ir.TensorType(norm_out.dtype)
    try:
        pre = SubgraphEvaluator(graph, [norm_in], inputs=[*graph.inputs, x])
        post = SubgraphEvaluator(graph, [gqa_input], inputs=[*graph.inputs, norm_out])
    except Exception as err:
        return f"the q/k layout chain could not be evaluated ({type(err).__name__})"
    width = heads * head_size
    for batch, seq in _PROBES:
        feeds = {}
        for value in graph.inputs:
            if value.name in pre.input_names or value.name in post.input_names:
                array = probe_array(value, None, batch, seq, 0)
                if array is None:
                    return f"cannot size input {value.name!r} to probe the q/k layout"
                feeds[value.name] = array
        code = np.arange(batch * seq * width).reshape(batch, seq, width)
        digits = [code % _BASE, code // _BASE]
        if int(code.max()) >= _BASE * _BASE:
            return "probe too large"
        moved = []
        for d in digits:
            feeds[x.name] = d.astype(_feed_dtype(x))
            try:
                (out,) = pre(feeds)
            except Exception as err:
                return f"the q/k layout chain failed on a probe ({type(err).__name__}: {err})"
            moved.append(np.asarray(out, dtype=np.float64))
        if moved[0].shape[-1] != head_size:
            return "the q/k norm does not act on head_size-wide rows"
        rows = (moved[0] + _BASE * moved[1]).reshape(-1, head_size)
        starts = rows[:, :1]
        if not (
            np.all(starts % head_size == 0) and np.array_equal(rows, starts + np.arange(head_size))
        ):
            return "the q/k norm rows are not whole heads of the projection"
        for d, m in zip(digits, moved, strict=True):
            feeds.pop(x.name, None)
            feeds[norm_out.name] = m.astype(_feed_dtype(norm_out))
            try:
                (back,) = post(feeds)
            except Exception as err:
                return f"the q/k layout chain failed on a probe ({type(err).__name__}: {err})"
            if not np.array_equal(np.asarray(back, dtype=np.float64), d.astype(np.float64)):
                return "the layout after the q/k norm does not undo the one before it"
            feeds.pop(norm_out.name)
    return None


def _feed_dtype(value: ir.Value):
    """What to feed for ``value``: bf16 is fed as fp32 (SubgraphEvaluator casts it inside)."""
    if value.dtype is None or value.dtype == ir.DataType.BFLOAT16:
        return np.float32
    return value.dtype.numpy()


@dataclasses.dataclass
class _QKNorm:
    node: ir.Node
    found_q: tuple[ir.Node, ir.Value]
    """(the norm, the projection it normalizes) on Q."""
    found_k: tuple[ir.Node, ir.Value]
    head_size: int
    params: list
    """(weight, epsilon) of the Q and the K norm."""


class QKNormIntoGQA(
    Rule,
    name="qk-norm-into-gqa",
    stage=Stage.LOWER,
    anchor=("com.microsoft", "GroupQueryAttention"),
    emits=(Capability.GQA_QK_NORM,),
    # Before pack-qkv: packing merges the q and k inputs the norms are read from.
    benefit=2,
):
    """per-head q/k RMSNorm ahead of GQA -> q_norm_weight/k_norm_weight"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        q, k = input_at(node, 0), input_at(node, 1)
        if k is None or input_at(node, 14) is not None:
            return None
        found_q, found_k = _chain(q), _chain(k)
        if found_q is None and found_k is None:
            return None
        if found_q is None or found_k is None:
            return Kept(ReasonCode.FORM, "only one of Q and K is normalized ahead of GQA")
        heads, kv_heads = attr(node, "num_heads"), attr(node, "kv_num_heads")
        width = last_dim(found_q[1])
        if width is None or width % heads:
            return Kept(ReasonCode.HEADS, "cannot determine the head size for q/k norm")
        head_size = width // heads
        if last_dim(found_k[1]) != kv_heads * head_size:
            return Kept(
                ReasonCode.HEADS, "K projection width does not match kv_num_heads * head_size"
            )
        params = []
        for norm, _ in (found_q, found_k):
            checked = _norm_params(norm, head_size)
            if isinstance(checked, str):
                return Kept(ReasonCode.FORM, checked)
            params.append(checked)
        return _QKNorm(node, found_q, found_k, head_size, params)

    def check(self, m: _QKNorm, ctx: RewriteContext) -> Kept | None:
        heads, kv_heads = attr(m.node, "num_heads"), attr(m.node, "kv_num_heads")
        q, k = m.node.inputs[0], m.node.inputs[1]
        for (norm, x), value, n in ((m.found_q, q, heads), (m.found_k, k, kv_heads)):
            reason = _prove(ctx.graph, value, norm, x, n, m.head_size)
            if reason:
                return Kept(ReasonCode.NOT_PROVEN, reason)
        return None

    def rewrite(self, m: _QKNorm, ctx: RewriteContext) -> Rewritten:
        node, found_q, found_k = m.node, m.found_q, m.found_k
        (wq, eq), (wk, ek) = m.params
        node.replace_input_with(0, found_q[1])
        node.replace_input_with(1, found_k[1])
        if len(node.inputs) < 16:
            node.resize_inputs(16)
        node.replace_input_with(14, wq)
        node.replace_input_with(15, wk)
        node.attributes["q_norm_epsilon"] = ir.AttrFloat32("q_norm_epsilon", eq)
        node.attributes["k_norm_epsilon"] = ir.AttrFloat32("k_norm_epsilon", ek)
        return Rewritten(f"q/k norm into GQA (eps {eq:g}/{ek:g})")
