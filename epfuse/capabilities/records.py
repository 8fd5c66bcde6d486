"""Capability records: frozen data saying what one execution provider runs, per dtype.

A record says what an optimized model for the EP may contain. Ops of the input the record
omits are legalized (``epfuse.patterns.legalize``: mapped to an op the record has, or expanded
to primitives); the output never holds a node the record does not take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class GQASupport:
    """What the EP's ``com.microsoft::GroupQueryAttention`` kernel honours for one dtype."""

    fused_rotary: bool = True
    """do_rotary=1 with cos/sin caches."""
    rotary_position_ids: bool = True
    """Fused rotary reads ``position_ids`` (WebGPU derives positions from seqlens_k)."""
    interleaved_rotary: bool = True
    packed_qkv: bool = True
    softcap: bool = True
    local_window: bool = True
    attention_bias: bool = True
    qk_norm: bool = False
    """``q_norm_weight``/``k_norm_weight`` inputs are honoured."""
    head_sink: bool = False
    """The ``head_sink`` input (one softmax-denominator logit per head, GPT-OSS) is honoured."""
    kv_cache_int8: bool = False
    """An int8 past/present with per-channel float scales (``k_quant_type``/``v_quant_type``
    PER_CHANNEL, ``kv_cache_bit_width`` 8, inputs 12/13), ``kv_cache="int8"``."""
    head_size_multiple: int = 1
    rotary_head_size_multiple: int = 1
    rotary_cache_width_multiple: int = 1
    chunked_prefill_needs_batch1: bool = False
    requires_rotary_caches: bool = False
    """The kernel wants cos/sin inputs present (TRT-RTX)."""


@dataclasses.dataclass(frozen=True)
class OpSupport:
    """Everything epfuse may emit for one (EP, dtype)."""

    gqa: GQASupport | None = None
    attention: bool = False
    """ONNX ``Attention`` (opset 23)."""
    attention_softcap: bool = False
    rotary_embedding: bool = False
    """ONNX ``RotaryEmbedding`` (opset 23)."""
    ms_rotary_embedding: bool = False
    """``com.microsoft::RotaryEmbedding``."""
    mrotary_embedding: bool = False
    rms_normalization: bool = False
    simplified_layer_norm: bool = False
    skip_simplified_layer_norm: bool = False
    skip_layer_norm: bool = False
    matmul_nbits: bool = False
    """``com.microsoft::MatMulNBits`` (int4 weight-only MatMul, ``precision="int4"``)."""
    gather_block_quantized: bool = False
    """``com.microsoft::GatherBlockQuantized`` (int4 embedding table)."""
    moe: bool = False
    """``com.microsoft::MoE`` with interleaved SwiGLU experts (``swiglu_fusion=1``)."""
    experts_loop_min_decode_weights: int | None = None
    """A cost choice, not a capability: where ``moe`` is set too, batched experts whose decode
    weights per expert (top k x weights per expert / experts: the work each expert the loop
    visits carries for one token) reach this many become the loop over the experts
    (``legalize-experts-to-loop``) instead of MoE, because the loop measured faster on this EP
    and dtype there (``benchmarks/moe_shapes.py``); below it the loop's per-expert ops cost more
    at decode than the kernel. None: MoE wherever it is proven. MoE is still emitted where the
    loop cannot be (opset < 16)."""

    def supported(self) -> list[str]:
        names = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value:
                names.append(field.name)
        return names


NOTHING = OpSupport()


@dataclasses.dataclass(frozen=True)
class EPCapabilities:
    """One execution provider: its names and, per dtype, the ops epfuse may emit."""

    name: str
    provider: str | None
    """ONNX Runtime provider name, or None for the portable ``default`` target."""
    description: str
    dtypes: Mapping[str, OpSupport]
    vendor_ops: bool = True
    """May epfuse emit ``com.microsoft`` ops at all."""
    notes: tuple[str, ...] = ()
    preferred_dtype: str | None = None
    """The dtype its attention runs best in; ``precision="auto"`` converts a float32 export to
    it (None: keep the input's dtype)."""
    preferred_because: str = ""

    def __post_init__(self) -> None:
        if self.preferred_dtype is not None and self.preferred_dtype not in DTYPES:
            raise ValueError(f"{self.name}: unknown preferred_dtype {self.preferred_dtype!r}")
        unknown = set(self.dtypes) - set(DTYPES)
        if unknown:
            raise ValueError(f"unknown dtype(s) {sorted(unknown)} in record {self.name!r}")
        object.__setattr__(self, "dtypes", MappingProxyType(dict(self.dtypes)))
        if not self.vendor_ops:
            for dtype, ops in self.dtypes.items():
                vendor = (
                    ops.gqa,
                    ops.ms_rotary_embedding,
                    ops.mrotary_embedding,
                    ops.skip_simplified_layer_norm,
                    ops.skip_layer_norm,
                    ops.simplified_layer_norm,
                    ops.matmul_nbits,
                    ops.gather_block_quantized,
                    ops.moe,
                )
                if any(vendor):
                    raise ValueError(
                        f"{self.name}: vendor op enabled for {dtype} but vendor_ops=False"
                    )

    def ops(self, dtype: str) -> OpSupport:
        """What may be emitted for ``dtype``; an absent dtype supports nothing."""
        return self.dtypes.get(dtype, NOTHING)

    def variant(self, name: str, *, gqa: Mapping[str, Any] | None = None, **ops: Any):
        """This record under another ``name`` with the same change at every dtype: ``ops``
        replaces OpSupport fields, ``gqa`` GQASupport fields (e.g. a user's EP build without
        one kernel: ``get_ep("cpu").variant("cpu-no-moe", moe=False)``)."""

        def changed(support: OpSupport) -> OpSupport:
            if gqa and support.gqa is not None:
                support = dataclasses.replace(support, gqa=dataclasses.replace(support.gqa, **gqa))
            return dataclasses.replace(support, **ops)

        dtypes = {dtype: changed(support) for dtype, support in self.dtypes.items()}
        return dataclasses.replace(self, name=name, dtypes=dtypes)
