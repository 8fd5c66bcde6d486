"""3-D mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``RotaryEmbedding(x, cos, sin)`` whose per-token
cos/sin are mixed from a (3, batch, seq) position input -> ``com.microsoft::MRotaryEmbedding``
with constant caches, or (where the EP has no MRotaryEmbedding) per-stream cache rows mixed by
``Where`` in front of the same standard ``RotaryEmbedding``.

GroupQueryAttention's fused rotary takes one position per token, so an mRoPE layer always runs
GQA with ``do_rotary=0`` on the Q/K rotated here (``lower/gqa`` never fuses it).

What the cos/sin mean (the stream of each frequency column, the layout, the caches) is proven
by evaluating the graph in ``analysis.mrope_sections`` (:class:`MRopeSections`); this rule only
builds from it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from epfuse.capabilities.emissions import Capability

from .._graph import Builder, attr, ensure_opset, input_at, substitute
from ..analysis.manager import Unproven
from ..analysis.mrope_sections import MRopeSections, mrope_sections
from ..base import Kept, RewriteContext, Rewritten, Rule, Stage
from ..reasons import ReasonCode


class MRopeLowering(
    Rule,
    name="mrope",
    stage=Stage.LOWER,
    anchor="RotaryEmbedding",
    emits=(Capability.MROTARY_EMBEDDING,),
):
    """RotaryEmbedding with cos/sin mixed from (3, B, S) positions -> MRotaryEmbedding
    (or constant per-stream caches + Where)"""

    def requires(self, ops, ep):
        # Selected on every EP: without MRotaryEmbedding it still mixes constant per-stream
        # caches for the standard RotaryEmbedding already in the graph (or keeps the layer,
        # saying why, in ``apply``).
        return None

    def match(self, node: ir.Node, ctx: RewriteContext):
        if input_at(node, 3) is not None:
            return None  # positions go in by id: 1-D RoPE
        mrope = mrope_sections(ctx, node)
        if mrope is None:
            return None
        if isinstance(mrope, Unproven):
            return Kept(ReasonCode.NOT_PROVEN, f"mRoPE not proven: {mrope.reason}")
        if mrope.from_tables and not _takes_mrotary(ctx):
            return None  # already per-stream constant caches in front of RotaryEmbedding
        return node, mrope

    def check(self, match, ctx: RewriteContext) -> Kept | None:
        if not _takes_mrotary(ctx) and not ctx.ops.rotary_embedding:
            return Kept(
                ReasonCode.EP_UNSUPPORTED,
                f"{ctx.ep.name} has neither MRotaryEmbedding nor RotaryEmbedding: "
                "mRoPE stays as exported",
            )
        return None

    def rewrite(self, match, ctx: RewriteContext) -> Rewritten:
        node, mrope = match
        if _takes_mrotary(ctx):
            return self._to_mrotary(node, mrope, ctx)
        mixed = _mixed_cos_sin(ctx, node, mrope)
        node.replace_input_with(1, mixed[0])
        node.replace_input_with(2, mixed[1])
        return Rewritten(f"{mrope.describe()}: constant per-stream caches + Where")

    @staticmethod
    def _to_mrotary(node: ir.Node, mrope: MRopeSections, ctx: RewriteContext):
        cos_cache, sin_cache = _cache_values(ctx, node, mrope)
        attributes = {
            "mrope_section": list(mrope.sections),
            "mrope_layout": mrope.layout,
            "interleaved": int(attr(node, "interleaved", 0) or 0),
        }
        for name in ("num_heads", "rotary_embedding_dim"):
            value = attr(node, name)
            if value:
                attributes[name] = int(value)
        ensure_opset(ctx.model, "com.microsoft", 1)
        fused = ir.node(
            "MRotaryEmbedding",
            [node.inputs[0], mrope.positions, cos_cache, sin_cache],
            attributes,
            domain="com.microsoft",
            name=f"{node.name or 'rope'}/MRotaryEmbedding",
            metadata_props=dict(node.metadata_props),
        )
        substitute(ctx.graph, [node], fused, [(node.outputs[0], fused.outputs[0])])
        return Rewritten(f"{mrope.describe()} -> MRotaryEmbedding")


def _takes_mrotary(ctx: RewriteContext) -> bool:
    return bool(ctx.ops.mrotary_embedding and ctx.ep.vendor_ops)


def _cache_values(ctx: RewriteContext, node: ir.Node, mrope: MRopeSections):
    """The constant caches, one pair per run for every layer whose cos/sin they are."""

    def build():
        builder = Builder(ctx.graph, node, "epfuse/mrope")
        cos = builder.const("cos_cache", mrope.cos_cache)
        return cos, builder.const("sin_cache", mrope.sin_cache)

    return ctx.analyses.built("mrope-caches", _cache_key(mrope), build)


def _mixed_cos_sin(ctx: RewriteContext, node: ir.Node, mrope: MRopeSections):
    """Where(is_t, cos[pos_t], Where(is_h, cos[pos_h], cos[pos_w])) and the same for sin."""
    key = (mrope.positions, mrope.streams.tobytes(), *_cache_key(mrope))
    return ctx.analyses.built("mrope-mixed", key, lambda: _build_mixed(ctx, node, mrope))


def _build_mixed(ctx: RewriteContext, node: ir.Node, mrope: MRopeSections):
    cos_cache, sin_cache = _cache_values(ctx, node, mrope)
    graph = ctx.graph
    first = graph.node(0) if len(graph) else node
    b = Builder(graph, first, "epfuse/mrope")
    pos = [
        b.op("Gather", [mrope.positions, b.const(f"stream{k}", np.array(k))], {"axis": 0})
        for k in range(3)
    ]
    is_t = b.const("is_t", mrope.streams == 0)
    is_h = b.const("is_h", mrope.streams == 1)
    mixed = []
    for cache in (cos_cache, sin_cache):
        rows = [b.op("Gather", [cache, p], {"axis": 0}) for p in pos]
        mixed.append(b.op("Where", [is_t, rows[0], b.op("Where", [is_h, rows[1], rows[2]])]))
    return tuple(mixed)


def _cache_key(mrope: MRopeSections) -> tuple[bytes, bytes]:
    return mrope.cos_cache.tobytes(), mrope.sin_cache.tobytes()
