"""The emission table: every capability epfuse may emit, and what emitting it means.

One :class:`Capability` per switch of an :class:`OpSupport` record (``"gqa"``, a GQA feature
``"gqa.<field>"``, or a field of the record itself). Each member knows how it is read off a
record (:meth:`Capability.supported_by`), which field of the record it is
(:attr:`Capability.field`, so the probe can set it), what it is called in a report, and
(:data:`EMISSIONS`) which op, inputs and attributes emitting it puts in a graph.

Everything else is keyed by this enum: a rule's ``emits`` (``patterns.base.Rule``, whose
default ``requires()`` reads it), ``conformance.required_flags`` (which members a node
needs), the probe's schema check (:data:`EMISSIONS`) and its known-answer runs
(``capabilities.known_answers``). Adding a capability is one member here, its reader, its
emissions, and a record field; tests check that the four agree.

Members are ``StrEnum``: a member equals, hashes and formats as its flag string, so reports
and record notes read ``gqa.softcap`` as before.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from .records import OpSupport


class Capability(enum.StrEnum):
    GQA = "gqa"
    GQA_FUSED_ROTARY = "gqa.fused_rotary"
    GQA_ROTARY_POSITION_IDS = "gqa.rotary_position_ids"
    GQA_INTERLEAVED_ROTARY = "gqa.interleaved_rotary"
    GQA_SOFTCAP = "gqa.softcap"
    GQA_LOCAL_WINDOW = "gqa.local_window"
    GQA_PACKED_QKV = "gqa.packed_qkv"
    GQA_ATTENTION_BIAS = "gqa.attention_bias"
    GQA_HEAD_SINK = "gqa.head_sink"
    GQA_QK_NORM = "gqa.qk_norm"
    GQA_KV_CACHE_INT8 = "gqa.kv_cache_int8"
    MOE = "moe"
    ATTENTION = "attention"
    ATTENTION_SOFTCAP = "attention_softcap"
    ROTARY_EMBEDDING = "rotary_embedding"
    MS_ROTARY_EMBEDDING = "ms_rotary_embedding"
    MROTARY_EMBEDDING = "mrotary_embedding"
    RMS_NORMALIZATION = "rms_normalization"
    SIMPLIFIED_LAYER_NORM = "simplified_layer_norm"
    SKIP_SIMPLIFIED_LAYER_NORM = "skip_simplified_layer_norm"
    SKIP_LAYER_NORM = "skip_layer_norm"
    MATMUL_NBITS = "matmul_nbits"
    GATHER_BLOCK_QUANTIZED = "gather_block_quantized"

    @property
    def on_gqa(self) -> bool:
        """A feature of the GQA kernel (a ``GQASupport`` field), not a field of ``OpSupport``."""
        return self.value.startswith("gqa.")

    @property
    def field(self) -> str:
        """The record field this member is: of ``GQASupport`` when :attr:`on_gqa`, else of
        ``OpSupport`` (``gqa`` itself: the ``OpSupport.gqa`` record being present)."""
        return self.value.removeprefix("gqa.")

    def supported_by(self, ops: OpSupport) -> bool:
        """Does ``ops`` (one EP and dtype) allow emitting this?"""
        return bool(_READERS[self](ops))

    def lacking(self, ep_name: str) -> str:
        """Why a rule that needs this is not selected for ``ep_name`` (the report's wording)."""
        return f"{ep_name}{_LACKS[self]} for this dtype"


def _gqa(read: Callable[..., bool]) -> Callable[[OpSupport], bool]:
    return lambda ops: ops.gqa is not None and read(ops.gqa)


_READERS: dict[Capability, Callable[[OpSupport], object]] = {
    Capability.GQA: lambda ops: ops.gqa is not None,
    Capability.GQA_FUSED_ROTARY: _gqa(lambda g: g.fused_rotary),
    Capability.GQA_ROTARY_POSITION_IDS: _gqa(lambda g: g.rotary_position_ids),
    Capability.GQA_INTERLEAVED_ROTARY: _gqa(lambda g: g.interleaved_rotary),
    Capability.GQA_SOFTCAP: _gqa(lambda g: g.softcap),
    Capability.GQA_LOCAL_WINDOW: _gqa(lambda g: g.local_window),
    Capability.GQA_PACKED_QKV: _gqa(lambda g: g.packed_qkv),
    Capability.GQA_ATTENTION_BIAS: _gqa(lambda g: g.attention_bias),
    Capability.GQA_HEAD_SINK: _gqa(lambda g: g.head_sink),
    Capability.GQA_QK_NORM: _gqa(lambda g: g.qk_norm),
    Capability.GQA_KV_CACHE_INT8: _gqa(lambda g: g.kv_cache_int8),
    Capability.MOE: lambda ops: ops.moe,
    Capability.ATTENTION: lambda ops: ops.attention,
    Capability.ATTENTION_SOFTCAP: lambda ops: ops.attention_softcap,
    Capability.ROTARY_EMBEDDING: lambda ops: ops.rotary_embedding,
    Capability.MS_ROTARY_EMBEDDING: lambda ops: ops.ms_rotary_embedding,
    Capability.MROTARY_EMBEDDING: lambda ops: ops.mrotary_embedding,
    Capability.RMS_NORMALIZATION: lambda ops: ops.rms_normalization,
    Capability.SIMPLIFIED_LAYER_NORM: lambda ops: ops.simplified_layer_norm,
    Capability.SKIP_SIMPLIFIED_LAYER_NORM: lambda ops: ops.skip_simplified_layer_norm,
    Capability.SKIP_LAYER_NORM: lambda ops: ops.skip_layer_norm,
    Capability.MATMUL_NBITS: lambda ops: ops.matmul_nbits,
    Capability.GATHER_BLOCK_QUANTIZED: lambda ops: ops.gather_block_quantized,
}
"""How each member is read off a record: attribute access the linters and a rename see."""

_LACKS: dict[Capability, str] = {
    Capability.GQA: " has no GroupQueryAttention",
    Capability.GQA_FUSED_ROTARY: "'s GroupQueryAttention has no fused rotary",
    Capability.GQA_ROTARY_POSITION_IDS: "'s GroupQueryAttention ignores position_ids",
    Capability.GQA_INTERLEAVED_ROTARY: "'s GroupQueryAttention has no interleaved rotary",
    Capability.GQA_SOFTCAP: "'s GroupQueryAttention has no softcap",
    Capability.GQA_LOCAL_WINDOW: "'s GroupQueryAttention has no local window",
    Capability.GQA_PACKED_QKV: "'s GroupQueryAttention takes no packed QKV",
    Capability.GQA_ATTENTION_BIAS: "'s GroupQueryAttention takes no attention_bias",
    Capability.GQA_HEAD_SINK: "'s GroupQueryAttention has no head_sink",
    Capability.GQA_QK_NORM: "'s GroupQueryAttention does not apply q/k norm",
    Capability.GQA_KV_CACHE_INT8: "'s GroupQueryAttention has no int8 KV cache",
    Capability.MOE: " has no com.microsoft::MoE",
    Capability.ATTENTION: " has no ONNX Attention",
    Capability.ATTENTION_SOFTCAP: "'s Attention has no softcap",
    Capability.ROTARY_EMBEDDING: " has no ONNX RotaryEmbedding",
    Capability.MS_ROTARY_EMBEDDING: " has no com.microsoft::RotaryEmbedding",
    Capability.MROTARY_EMBEDDING: " has no com.microsoft::MRotaryEmbedding",
    Capability.RMS_NORMALIZATION: " does not take RMSNormalization",
    Capability.SIMPLIFIED_LAYER_NORM: " does not take SimplifiedLayerNormalization",
    Capability.SKIP_SIMPLIFIED_LAYER_NORM: " has no SkipSimplifiedLayerNormalization",
    Capability.SKIP_LAYER_NORM: " has no SkipLayerNormalization",
    Capability.MATMUL_NBITS: " has no com.microsoft::MatMulNBits",
    Capability.GATHER_BLOCK_QUANTIZED: " has no com.microsoft::GatherBlockQuantized",
}
"""The tail of :meth:`Capability.lacking` (after the EP's name)."""


@dataclasses.dataclass(frozen=True)
class Emission:
    """What epfuse emits for one capability: an op with named inputs/outputs and attributes
    (checked against the installed ORT's schemas by ``capabilities.schema``)."""

    domain: str
    op_type: str
    inputs: tuple[tuple[int, str], ...] = ()
    outputs: tuple[tuple[int, str], ...] = ()
    attributes: tuple[str, ...] = ()


def _skip_norm(op_type: str) -> tuple[Emission, ...]:
    """A com.microsoft skip norm, simplified (RMS) or not: both are emitted alike, with the
    residual sum (output 3) that the next layer's norm reads."""
    return (
        Emission(
            "com.microsoft",
            op_type,
            outputs=((3, "input_skip_bias_sum"),),
            attributes=("epsilon",),
        ),
    )


_GQA = ("com.microsoft", "GroupQueryAttention")
EMISSIONS: dict[Capability, tuple[Emission, ...]] = {
    Capability.GQA: (
        Emission(
            *_GQA,
            inputs=(
                (0, "query"),
                (1, "key"),
                (2, "value"),
                (3, "past_key"),
                (4, "past_value"),
                (5, "seqlens_k"),
                (6, "total_sequence_length"),
            ),
            outputs=((1, "present_key"), (2, "present_value")),
            attributes=("num_heads", "kv_num_heads", "scale", "do_rotary"),
        ),
    ),
    Capability.GQA_FUSED_ROTARY: (
        Emission(
            *_GQA,
            inputs=((7, "cos_cache"), (8, "sin_cache")),
            attributes=("do_rotary", "rotary_interleaved"),
        ),
    ),
    Capability.GQA_ROTARY_POSITION_IDS: (Emission(*_GQA, inputs=((9, "position_ids"),)),),
    Capability.GQA_INTERLEAVED_ROTARY: (Emission(*_GQA, attributes=("rotary_interleaved",)),),
    Capability.GQA_SOFTCAP: (Emission(*_GQA, attributes=("softcap",)),),
    Capability.GQA_LOCAL_WINDOW: (Emission(*_GQA, attributes=("local_window_size",)),),
    Capability.GQA_PACKED_QKV: (Emission(*_GQA, inputs=((0, "query"),)),),
    Capability.GQA_ATTENTION_BIAS: (Emission(*_GQA, inputs=((10, "attention_bias"),)),),
    Capability.GQA_HEAD_SINK: (Emission(*_GQA, inputs=((11, "head_sink"),)),),
    Capability.GQA_QK_NORM: (
        Emission(
            *_GQA,
            inputs=((14, "q_norm_weight"), (15, "k_norm_weight")),
            attributes=("q_norm_epsilon", "k_norm_epsilon"),
        ),
    ),
    Capability.GQA_KV_CACHE_INT8: (
        Emission(
            *_GQA,
            inputs=((12, "k_scale"), (13, "v_scale")),
            attributes=("k_quant_type", "v_quant_type", "kv_cache_bit_width"),
        ),
    ),
    Capability.MOE: (
        Emission(
            "com.microsoft",
            "MoE",
            inputs=(
                (0, "input"),
                (1, "router_probs"),
                (2, "fc1_experts_weights"),
                (3, "fc1_experts_bias"),
                (4, "fc2_experts_weights"),
                (5, "fc2_experts_bias"),
            ),
            attributes=(
                "k",
                "activation_type",
                "swiglu_fusion",
                "activation_alpha",
                "activation_beta",
                "swiglu_limit",
                "normalize_routing_weights",
            ),
        ),
    ),
    Capability.ATTENTION: (
        Emission("", "Attention", attributes=("q_num_heads", "kv_num_heads", "scale", "is_causal")),
    ),
    Capability.ATTENTION_SOFTCAP: (Emission("", "Attention", attributes=("softcap",)),),
    Capability.ROTARY_EMBEDDING: (
        Emission(
            "", "RotaryEmbedding", attributes=("interleaved", "num_heads", "rotary_embedding_dim")
        ),
    ),
    Capability.MS_ROTARY_EMBEDDING: (
        Emission(
            "com.microsoft",
            "RotaryEmbedding",
            inputs=((0, "input"), (1, "position_ids"), (2, "cos_cache"), (3, "sin_cache")),
            attributes=("interleaved", "num_heads", "rotary_embedding_dim"),
        ),
    ),
    Capability.MROTARY_EMBEDDING: (
        Emission("com.microsoft", "MRotaryEmbedding", attributes=("mrope_section",)),
    ),
    Capability.RMS_NORMALIZATION: (
        Emission("", "RMSNormalization", attributes=("axis", "epsilon", "stash_type")),
    ),
    Capability.SIMPLIFIED_LAYER_NORM: (
        Emission("", "SimplifiedLayerNormalization", attributes=("axis", "epsilon", "stash_type")),
    ),
    Capability.SKIP_SIMPLIFIED_LAYER_NORM: _skip_norm("SkipSimplifiedLayerNormalization"),
    Capability.SKIP_LAYER_NORM: _skip_norm("SkipLayerNormalization"),
    Capability.MATMUL_NBITS: (
        Emission(
            "com.microsoft",
            "MatMulNBits",
            inputs=((0, "A"), (1, "B"), (2, "scales"), (3, "zero_points")),
            attributes=("K", "N", "bits", "block_size", "accuracy_level"),
        ),
    ),
    # Its first type constraint is the packed int4 data, not the float dtype the schema
    # check reads: emitted by precision="int4" only, covered by the int4 tests on ORT.
    Capability.GATHER_BLOCK_QUANTIZED: (),
}
"""Per capability, the op(s) emitting it writes: the probe's schema check reads it."""
