"""ONNX ``Attention`` (+ ``RotaryEmbedding`` on Q and K) -> ``com.microsoft::GroupQueryAttention``.

Preconditions, each checked before anything changes (a failed one keeps the layer and names
the reason in the report):

* the EP's record has GQA for the model dtype, and the softcap / sliding window the layer
  needs;
* the mask is *proven* (``analysis.mask_proof``) to be causal + right padding from a 2-D
  ``attention_mask`` (optionally with one sliding window), so that ``seqlens_k`` and
  ``local_window_size`` express it exactly;
* Q, K, V are (B, N, S, H) or (B, S, N*H) with static head counts and head size.

RoPE: when Q and K are rotated by the same canonical ``RotaryEmbedding`` (constant caches, or
LongRoPE's two constant pairs selected per call by a scalar ``Where``, and
``position_ids``; duplicated cos/sin subgraphs count as the same once evaluated equal, and a
Cast back to the rotated dtype is looked through) and the EP's fused rotary can take it (dtype, head-size and cache-width
limits, interleaving, positions read from ``position_ids``), the rotation moves into GQA with
``do_rotary=1``. Otherwise the rotation stays in the graph and GQA runs with ``do_rotary=0``
on the rotated Q and K — always correct — and the report says why (the note, and the
layer's ``codes``/``reasons`` with the ``ReasonCode``).

Fused rotary takes one position per token and, on a first prompt, only ``position_ids[0, 0]``
(then consecutive positions, for every row: ORT 1.32 CPU). So ``do_rotary=1`` needs the
positions to be a (batch, seq) int64 graph input, contiguous by the decoder's contract, or
positions the graph computes (Optimum's Gemma and Nemotron: ``arange(past, past + seq)``)
that ``analysis.rotary_positions`` proves by evaluation, over prompts, padded prompts, decode,
chunked prefill and decode after a padded prompt, to be GQA's own (then GQA gets no
``position_ids``, onnxruntime-genai's builder form) or fused rotary's when fed as
``position_ids``; anything else keeps the rotation outside (``ReasonCode.ROPE_POSITIONS``).
3-D mRoPE (``MRotaryEmbedding``, cos/sin mixed from position streams, or one stream of a
(3, batch, seq) input) always keeps the rotation outside.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._graph import (
    Builder,
    Dim,
    attr,
    const_array,
    dim,
    ensure_opset,
    input_at,
    producer,
    substitute,
)
from .._layout import bsd_consumer, from_bsd, to_bsd
from ..analysis.head_counts import HeadCounts, attention_heads
from ..analysis.manager import Unproven
from ..analysis.mask_proof import MaskProof, attention_mask_proof
from ..analysis.mrope_sections import is_streams, mrope_positions, unproven_reason
from ..analysis.rope_caches import EvaluatedEqual
from ..analysis.rotary_positions import ProvenPositions
from ..analysis.switched_caches import switched_cache
from ..base import AttentionFacts, Kept, RewriteContext, Rewritten, Rule, Stage
from ..canonicalize.rotate_half import match_rotate_half
from ..reasons import ReasonCode
from .attention_sink import SinkPlan, match_sink, qk_used

_MROPE_REASON = "3-D mRoPE positions ({how}): fused rotary takes one position per token"
_NOT_EXPRESSIBLE, _EP_UNSUPPORTED = ReasonCode.NOT_EXPRESSIBLE, ReasonCode.EP_UNSUPPORTED


class _Rope:
    def __init__(self, node: ir.Node):
        self.node = node
        self.source = node.inputs[0]
        self.cos, self.sin = input_at(node, 1), input_at(node, 2)
        self.positions = input_at(node, 3)
        self.interleaved = bool(attr(node, "interleaved", 0))
        self.rotary_dim = int(attr(node, "rotary_embedding_dim", 0))

    def caches(self):
        return const_array(self.cos), const_array(self.sin)

    def same_as(self, other: _Rope) -> bool:
        if (self.interleaved, self.rotary_dim) != (other.interleaved, other.rotary_dim):
            return False
        if self.positions is not other.positions:
            return False
        if self.cos is other.cos and self.sin is other.sin:
            return True
        (c1, s1), (c2, s2) = self.caches(), other.caches()
        return all(a is not None for a in (c1, s1, c2, s2)) and (
            np.array_equal(c1, c2) and np.array_equal(s1, s2)
        )

    def evaluates_as(self, other: _Rope, ctx: RewriteContext) -> bool:
        """Same attributes and positions, and cos/sin that are distinct subgraphs (the
        exporter duplicated them) proven equal by evaluation."""
        if (self.interleaved, self.rotary_dim) != (other.interleaved, other.rotary_dim):
            return False
        if self.positions is not other.positions or None in (self.cos, self.sin):
            return False
        if other.cos is None or other.sin is None:
            return False
        return ctx.analysis(EvaluatedEqual, (self.cos, self.sin), (other.cos, other.sin)).equal


@dataclasses.dataclass
class _GQAMatch:
    node: ir.Node
    heads: HeadCounts
    sink: SinkPlan | None
    softcap: float
    mask: MaskProof | None = None
    """Set by ``check``: the mask proven causal + padding (+ window)."""
    rope_plan: _RopePlan | None = None
    """Set by ``check``: whether the rotation moves into GQA, and why not."""


class AttentionToGQA(
    Rule, name="attention-to-gqa", stage=Stage.LOWER, anchor="Attention", emits=(Capability.GQA,)
):
    """Attention (+RoPE, KV cache, causal+padding mask) -> GroupQueryAttention"""

    def match(self, node: ir.Node, ctx: RewriteContext):
        k, v = input_at(node, 1), input_at(node, 2)
        past_k, past_v = input_at(node, 4), input_at(node, 5)
        if k is None or v is None or (past_k is None) != (past_v is None):
            return Kept(ReasonCode.FORM, "Attention inputs are not Q, K, V with a matching past")
        if past_k is None:
            # Without past inputs nothing proves K/V hold only the new tokens (a cache grown
            # outside the op would be mistaken for new keys).
            return Kept(
                ReasonCode.FORM,
                "the Attention has no past_key/past_value inputs (KV cache not canonical)",
            )
        if len(node.inputs) > 6 and node.inputs[6] is not None:
            return Kept(
                ReasonCode.NOT_EXPRESSIBLE,
                "nonpad_kv_seqlen is not expressible in GroupQueryAttention",
            )
        heads = attention_heads(ctx, node)
        if isinstance(heads, Unproven):
            return Kept(ReasonCode.HEADS, heads.reason)
        sink = match_sink(node, heads.q_heads) if qk_used(node) else None
        if isinstance(sink, str):
            return Kept(ReasonCode.FORM, sink)
        if heads.q_heads % heads.kv_heads:
            return Kept(ReasonCode.HEADS, "query heads are not a multiple of KV heads")
        softcap = float(attr(node, "softcap", 0.0) or 0.0)
        return _GQAMatch(node, heads, sink, softcap)

    def check(self, m: _GQAMatch, ctx: RewriteContext) -> Kept | None:
        gqa_caps = ctx.ops.gqa
        if gqa_caps is None:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name} has no GroupQueryAttention for {ctx.dtype}",
            )
        node, head_size, softcap = m.node, m.heads.head_size, m.softcap
        if m.sink is not None and not gqa_caps.head_sink:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name}'s GroupQueryAttention has no head_sink: the attention sinks "
                "stay in the standard Attention form",
            )
        if head_size % gqa_caps.head_size_multiple:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"head size {head_size} is not a multiple of {gqa_caps.head_size_multiple} "
                f"on {ctx.ep.name}",
            )
        if softcap and not gqa_caps.softcap:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name}'s GroupQueryAttention does not apply softcap",
            )
        mask = attention_mask_proof(ctx, node)
        if isinstance(mask, Unproven):
            return Kept(ReasonCode.MASK_NOT_PROVEN, f"mask not proven: {mask.reason}")
        if mask.window is not None and not gqa_caps.local_window:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name}'s GroupQueryAttention does not honour a sliding window",
            )
        rope_plan = self._plan_rope(node.inputs[0], node.inputs[1], head_size, mask, ctx)
        if gqa_caps.requires_rotary_caches and not rope_plan.fused:
            why = rope_plan.reason or "no RotaryEmbedding on Q and K to fuse"
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name}'s GroupQueryAttention wants cos/sin caches, but {why}",
            )
        m.mask, m.rope_plan = mask, rope_plan
        return None

    def rewrite(self, m: _GQAMatch, ctx: RewriteContext) -> Rewritten:
        node, sink, softcap, mask, rope_plan = m.node, m.sink, m.softcap, m.mask, m.rope_plan
        num_heads, kv_heads = m.heads.q_heads, m.heads.kv_heads
        head_size, rank = m.heads.head_size, m.heads.layout_rank
        q, k, v = node.inputs[0], node.inputs[1], node.inputs[2]
        past_k, past_v = node.inputs[4], node.inputs[5]
        scale = attr(node, "scale")
        scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_size)
        builder = Builder(ctx.graph, node, f"epfuse/{node.name or 'attention'}")
        if rope_plan.fused:
            q_in, k_in = rope_plan.q.source, rope_plan.k.source
        else:
            q_in, k_in = q, k
        if rank == 4:
            q_in = to_bsd(builder, q_in, num_heads, head_size)
            k_in = to_bsd(builder, k_in, kv_heads, head_size)
            v_in = to_bsd(builder, v, kv_heads, head_size)
        else:
            v_in = v
        seqlens_k, total_len = _sequence_inputs(ctx, builder, mask)
        inputs = [q_in, k_in, v_in, past_k, past_v, seqlens_k, total_len]
        attributes = {"num_heads": num_heads, "kv_num_heads": kv_heads, "scale": scale}
        if softcap:
            attributes["softcap"] = softcap
        if mask.window is not None:
            attributes["local_window_size"] = int(mask.window)
        if rope_plan.fused:
            rope = rope_plan.q
            inputs += (
                [rope.cos, rope.sin] if rope_plan.derived else [rope.cos, rope.sin, rope.positions]
            )
            attributes["do_rotary"] = 1
            attributes["rotary_interleaved"] = int(rope.interleaved)
        else:
            attributes["do_rotary"] = 0
        if sink is not None:
            values = sink.sinks.astype(q.dtype.numpy())
            inputs += [None] * (11 - len(inputs)) + [builder.const("head_sink", values)]
        ensure_opset(ctx.model, "com.microsoft", 1)
        gqa = ir.node(
            "GroupQueryAttention",
            inputs,
            attributes,
            domain="com.microsoft",
            num_outputs=3,
            name=f"{node.name or 'attention'}/GroupQueryAttention",
            metadata_props=dict(node.metadata_props),
        )
        out, present_k, present_v = gqa.outputs
        out.name = f"{gqa.name}/output"
        y = node.outputs[0] if sink is None else sink.output
        old_nodes = [*(sink.nodes if sink is not None else ()), node]  # the anchor last
        after = Builder(ctx.graph, None, f"{builder.prefix}/out")  # placed after gqa (substitute)
        if rank == 3:
            replaced = [(y, out)]
        elif (
            reshaped := bsd_consumer(y, num_heads * head_size, _query_batch_seq(q, sink))
        ) is not None:
            replaced = [(reshaped, out)]  # the exporter's (B, S, N*H) view is GQA's output
            value = reshaped
            while value is not y:  # Reshape <- Transpose [<- identity Reshape] <- y
                old_nodes.insert(0, value.producer())
                value = old_nodes[0].inputs[0]
        else:
            replaced = [(y, from_bsd(after, out, num_heads, head_size))]
        for index, new in ((1, present_k), (2, present_v)):
            old = node.outputs[index] if len(node.outputs) > index else None
            if old is not None:
                replaced.append((old, new))
            else:
                new.name = f"{gqa.name}/present_{index}"
        substitute(ctx.graph, old_nodes, [gqa, *after.nodes], replaced)
        if rope_plan.fused:
            result = "GroupQueryAttention(do_rotary=1)"
        else:
            result = "GroupQueryAttention(do_rotary=0)"
        extras = [mask.describe()]
        if softcap:
            extras.append(f"softcap {softcap:g}")
        if sink is not None:
            extras.append("attention sinks as head_sink")
        kept: tuple[Kept, ...] = ()
        if rope_plan.reason:
            extras.append(f"RoPE kept outside: {rope_plan.reason}")
            if rope_plan.code is not None:
                kept = (Kept(rope_plan.code, f"RoPE kept outside: {rope_plan.reason}"),)
        elif rope_plan.fused and rope_plan.how:
            extras.append(rope_plan.how)
        elif rope_plan.fused and switched_cache(rope_plan.q.cos) is not None:
            extras.append("LongRoPE caches chosen per call")
        cos = None  # the fused cos cache, (rows, rotary_dim / 2); LongRoPE's two are alike
        if rope_plan.fused:
            cos = rope_plan.q.caches()[0]
            if cos is None and (switched := switched_cache(rope_plan.q.cos)) is not None:
                cos = switched.when_true
        facts = AttentionFacts(
            op="com.microsoft::GroupQueryAttention",
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            head_size=head_size,
            do_rotary=rope_plan.fused,
            rotary_dim=2 * int(cos.shape[1]) if cos is not None else None,
            rotary_interleaved=rope_plan.fused and rope_plan.q.interleaved,
            rotary_cache_rows=int(cos.shape[0]) if cos is not None else None,
            local_window_size=int(mask.window) if mask.window is not None else None,
            softcap=softcap or None,
            head_sink=sink is not None,
        )
        return Rewritten("; ".join(extras), layer_result=result, facts=facts, kept=kept)

    def _plan_rope(
        self, q: ir.Value, k: ir.Value, head_size: int, mask: MaskProof, ctx: RewriteContext
    ):
        caps = ctx.ops.gqa
        q_node, k_node = _rotary_producer(q), _rotary_producer(k)
        mrotary = [producer(v, "MRotaryEmbedding", "com.microsoft") for v in (q, k)]
        if any(n is not None for n in mrotary):
            return _RopePlan(
                False, None, None, _MROPE_REASON.format(how="MRotaryEmbedding"), _NOT_EXPRESSIBLE
            )
        if q_node is None and k_node is None:
            # Rotation, if any, is in other ops (e.g. a decomposed rotate_half) and stays.
            arithmetic = _arithmetic_rope_reason(q)
            if arithmetic is None:  # nothing rotated (NoPE): nothing kept outside
                return _RopePlan(False, None, None, "Q and K are not rotated by a RotaryEmbedding")
            return _RopePlan(False, None, None, arithmetic, ReasonCode.FORM)
        if q_node is None or k_node is None:
            return _RopePlan(False, None, None, "only one of Q and K is rotated", ReasonCode.FORM)
        rq, rk = _Rope(q_node), _Rope(k_node)
        if not rq.same_as(rk) and not rq.evaluates_as(rk, ctx):
            return _RopePlan(False, rq, rk, "Q and K are rotated differently", ReasonCode.FORM)
        if rq.positions is None and rq.cos is not None and mrope_positions(rq.cos) is not None:
            how = "cos/sin mixed per stream"
            unproven = unproven_reason(ctx, rq.node)
            if unproven:
                how += f"; not lowered to MRotaryEmbedding: {unproven}"
            return _RopePlan(False, rq, rk, _MROPE_REASON.format(how=how), _NOT_EXPRESSIBLE)
        cos, sin = rq.caches()
        if cos is None and sin is None:
            # LongRoPE: Where(cond, cache, cache) picks one constant pair per call; GQA is
            # given the same selected caches the RotaryEmbedding reads.
            switched = [switched_cache(v) for v in (rq.cos, rq.sin)]
            if None not in switched and switched[0].cond is switched[1].cond:
                cos, sin = switched[0].when_true, switched[1].when_true
        if cos is None or sin is None or rq.positions is None:
            return _RopePlan(
                False, rq, rk, "cos/sin are not constant caches with position_ids", ReasonCode.FORM
            )
        if cos.ndim != 2 or sin.shape != cos.shape:
            return _RopePlan(
                False, rq, rk, "cos/sin caches are not (max_len, rotary_dim/2)", ReasonCode.SHAPE
            )
        pos = rq.positions
        if is_streams(pos):
            return _RopePlan(
                False, rq, rk, _MROPE_REASON.format(how="position_ids"), _NOT_EXPRESSIBLE
            )
        if pos.shape is None or len(pos.shape) != 2:
            return _RopePlan(
                False, rq, rk, "positions are not known to be (batch, seq)", ReasonCode.SHAPE
            )
        derived, how = False, None  # derived: positions are GQA's own, no position_ids input
        if not pos.is_graph_input():
            # Fused rotary uses position_ids[0, 0] + arange on a first prompt (ORT 1.32 CPU), or
            # its own positions without them: computed positions are proven one or the other.
            proven = ctx.analysis(
                ProvenPositions, pos, mask.attention_mask, ctx.options.max_seq_len
            )
            if isinstance(proven, Unproven):
                return _RopePlan(
                    False,
                    rq,
                    rk,
                    f"RoPE positions computed in the graph are not fused rotary's: {proven.reason}",
                    ReasonCode.ROPE_POSITIONS,
                )
            derived = proven.derived
            how = (
                f"RoPE positions computed in the graph: GQA's own, proven at {proven.probes} probes"
                if derived
                else "RoPE positions computed in the graph fed as position_ids, proven at "
                f"{proven.probes} probes ({proven.why_not_derived})"
            )
            if not derived and not proven.per_row:
                return _RopePlan(
                    False,
                    rq,
                    rk,
                    f"RoPE positions computed in the graph: {proven.why_not_derived}, and they "
                    "are (1, seq), not the (batch, seq) GQA's position_ids must be",
                    ReasonCode.ROPE_POSITIONS,
                )
            if not derived and not caps.rotary_position_ids:
                return _RopePlan(
                    False,
                    rq,
                    rk,
                    f"RoPE positions computed in the graph: {proven.why_not_derived}, and "
                    f"{ctx.ep.name}'s fused rotary ignores position_ids",
                    ReasonCode.ROPE_POSITIONS,
                )
        width = cos.shape[1]
        rotary_dim = rq.rotary_dim or head_size
        if rotary_dim != 2 * width:
            return _RopePlan(
                False,
                rq,
                rk,
                "rotary_embedding_dim disagrees with the cache width",
                ReasonCode.SHAPE,
            )
        if not caps.fused_rotary:
            return _RopePlan(
                False, rq, rk, f"{ctx.ep.name}'s GQA has no fused rotary", _EP_UNSUPPORTED
            )
        if not derived and not caps.rotary_position_ids:
            return _RopePlan(
                False,
                rq,
                rk,
                f"{ctx.ep.name}'s fused rotary ignores position_ids",
                ReasonCode.EP_UNSUPPORTED,
            )
        if rq.interleaved and not caps.interleaved_rotary:
            return _RopePlan(
                False, rq, rk, f"{ctx.ep.name}'s fused rotary is not interleaved", _EP_UNSUPPORTED
            )
        if head_size % caps.rotary_head_size_multiple:
            return _RopePlan(
                False,
                rq,
                rk,
                f"head size {head_size} is not a multiple of {caps.rotary_head_size_multiple} "
                "for fused rotary",
                _EP_UNSUPPORTED,
            )
        if width % caps.rotary_cache_width_multiple or width > head_size // 2:
            return _RopePlan(
                False,
                rq,
                rk,
                f"cos/sin width {width} is not accepted by fused rotary",
                _EP_UNSUPPORTED,
            )
        if not derived and pos.dtype != ir.DataType.INT64:
            return _RopePlan(False, rq, rk, "position_ids are not int64", ReasonCode.DTYPE)
        return _RopePlan(True, rq, rk, None, derived=derived, how=how)


def _rotary_producer(value: ir.Value) -> ir.Node | None:
    """The RotaryEmbedding making ``value``, under Casts to the dtype it already has
    (transformers' Cohere rotates in float32 and casts back: ``q_embed.to(dtype)``)."""
    for _ in range(4):
        node = value.producer()
        if node is None or node.op_type != "Cast" or node.domain != "":
            break
        source = node.inputs[0]
        if source is None or source.dtype is None or source.dtype != value.dtype:
            break
        value = source
    return producer(value, "RotaryEmbedding")


def _arithmetic_rope_reason(q: ir.Value) -> str | None:
    """Why RoPE written out as arithmetic (not lifted to RotaryEmbedding) stays outside."""
    node = q.producer()
    if node is None or node.op_type != "Add":
        return None
    match = match_rotate_half(node)
    if match is None:
        return None
    if mrope_positions(match.cos_full) is not None:
        return _MROPE_REASON.format(how="rotated by the exported arithmetic")
    return "RoPE is exported arithmetic that was not lifted to RotaryEmbedding"


class _RopePlan:
    def __init__(
        self,
        fused: bool,
        q: _Rope | None,
        k: _Rope | None,
        reason: str | None,
        code: ReasonCode | None = None,
        *,
        derived: bool = False,
        how: str | None = None,
    ):
        self.fused, self.q, self.k, self.reason, self.code = fused, q, k, reason, code
        self.derived, self.how = derived, how
        """``code``: why a rotation stays outside GQA (None: fused, or nothing rotated)."""
        """Fused with GQA's own positions (proven equal to the computed ones): no
        position_ids input, onnxruntime-genai's builder form."""


def _query_batch_seq(q: ir.Value, sink: SinkPlan | None) -> tuple[Dim, Dim] | None:
    """The batch and sequence terms of the Attention's output, which are its (B, N, S, H)
    query's (ONNX Attention); not claimed through a sink correction."""
    return None if sink is not None else (dim(q, 0), dim(q, 2))


def _sequence_inputs(ctx: RewriteContext, builder: Builder, mask: MaskProof):
    """seqlens_k = ReduceSum(mask) - 1 and total_sequence_length, built once per graph."""
    am = mask.attention_mask
    return ctx.analyses.built(
        "gqa-seqlens", (am,), lambda: _build_sequence_inputs(ctx, builder, am)
    )


def _build_sequence_inputs(ctx: RewriteContext, builder: Builder, am: ir.Value):
    graph = ctx.graph
    first = graph.node(0) if len(graph) else builder.before
    b = Builder(graph, first, "epfuse/seqlens")
    am_int = (
        am
        if am.dtype in (ir.DataType.INT64, ir.DataType.INT32)
        else b.op("Cast", [am], {"to": ir.DataType.INT64})
    )
    axes = b.const("axis1", np.array([1], dtype=np.int64))
    summed = b.op("ReduceSum", [am_int, axes], {"keepdims": 0})
    one = b.const("one", np.array(1, dtype=am_int.dtype.numpy() if am_int.dtype else np.int64))
    seqlens = b.op("Cast", [b.op("Sub", [summed, one])], {"to": ir.DataType.INT32})
    seqlens.name = "epfuse_seqlens_k"
    shape = b.op("Shape", [am], {"start": 1, "end": 2})
    squeezed = b.op("Squeeze", [shape])
    total = b.op("Cast", [squeezed], {"to": ir.DataType.INT32})
    total.name = "epfuse_total_sequence_length"
    return seqlens, total
