"""Deployment precision: which dtype the optimized model computes in, and which weights are int4.

People export once, in float32, and deploy at the precision the hardware runs best: fp16 on
CUDA/DirectML/WebGPU (CUDA's GroupQueryAttention has no fp32 kernel), int4 weights on CPU.
This package turns the requested precision into a :class:`PrecisionPlan` (``choose``) that the
pass manager applies in its PRECISION stage: *after* canonicalization (so run-time RoPE has
become float64-built constant caches and the attention is one standard op) and *before*
selection and lowering, so the record of the converted dtype decides what is emitted (a cuda
fp32 export becomes fp16 GroupQueryAttention). int4 weight quantization runs last, after
lowering, so a packed QKV weight is quantized as one (``int4``).

Precisions: ``auto`` (the default), ``fp32``, ``fp16``, ``bf16``, ``int4``. ``auto`` keeps a
low-precision input as it is; a float32 input goes to the record's ``preferred_dtype`` (the
dtype the EP's attention runs best in, e.g. float16 for cuda), else stays float32. ``int4``
quantizes MatMul weights on top of the ``auto`` compute dtype (float32 activations on CPU,
as onnxruntime-genai's builder does for ``-p int4 -e cpu``; float16 on cuda).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epfuse.capabilities import EPCapabilities
from epfuse.errors import UnsupportedModelError

PRECISIONS: tuple[str, ...] = ("auto", "fp32", "fp16", "bf16", "int4")
_DTYPE_OF = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True)
class Int4Options:
    """Weight-only int4 quantization (onnxruntime's ``MatMulNBitsQuantizer``).

    Defaults are onnxruntime-genai's builder's for ``-p int4 -e cpu``: block size 32,
    symmetric, accuracy level 4 (int8 activations in the CPU kernel), ``lm_head`` quantized,
    embeddings not.
    """

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4
    """MatMulNBits ``accuracy_level``: 0 unset, 1 fp32, 2 fp16, 3 bf16, 4 int8 compute."""
    lm_head: bool = True
    """Quantize the MatMul that produces the logits."""
    embeddings: bool = False
    """Quantize the token embedding Gather (``GatherBlockQuantized``)."""

    def __post_init__(self) -> None:
        size = self.block_size
        if size < 16 or size & (size - 1):
            raise ValueError(f"int4 block size must be a power of two >= 16, got {size}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"int4 accuracy level must be 0-4, got {self.accuracy_level}")

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        parts = [f"block {self.block_size}", kind, f"accuracy level {self.accuracy_level}"]
        parts.append("lm_head quantized" if self.lm_head else "lm_head kept")
        parts.append("embeddings quantized" if self.embeddings else "embeddings kept")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class PrecisionPlan:
    """What the PRECISION stage does: convert to ``compute_dtype``, then maybe int4 weights."""

    requested: str
    source_dtype: str
    compute_dtype: str
    reason: str
    int4: Int4Options | None = None

    @property
    def converts(self) -> bool:
        return self.compute_dtype != self.source_dtype

    @property
    def changes_numerics(self) -> bool:
        """True when the result cannot equal the input bit for bit (converted or quantized)."""
        return self.converts or self.int4 is not None

    @property
    def name(self) -> str:
        """The precision label: ``int4`` or the compute dtype."""
        return "int4" if self.int4 is not None else self.compute_dtype

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "requested": self.requested,
            "chosen": self.name,
            "source_dtype": self.source_dtype,
            "compute_dtype": self.compute_dtype,
            "reason": self.reason,
        }
        if self.int4 is not None:
            data["int4"] = dataclasses.asdict(self.int4)
        return data


def normalize(precision: str) -> str:
    """``fp16``/``float16`` ... -> the short name; ValueError on anything else."""
    value = str(precision).strip().lower()
    value = _ALIASES.get(value, value)
    if value not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(PRECISIONS)}")
    return value


def choose(
    precision: str,
    record: EPCapabilities,
    source_dtype: str,
    int4: Int4Options | None = None,
) -> PrecisionPlan:
    """The plan for ``precision`` on ``record`` for a model whose activations are ``source_dtype``.

    An explicit dtype always wins. Conversion goes down only (float32 -> fp16/bf16): a model
    exported in fp16 or bf16 has already lost what float32 would need, so asking for another
    float dtype is refused (:class:`UnsupportedModelError`). int4 needs the record's
    ``matmul_nbits`` for the compute dtype.
    """
    requested = normalize(precision)
    if requested in _DTYPE_OF:
        target = _DTYPE_OF[requested]
        reason = f"requested {requested}"
    else:
        target, reason = _auto_dtype(record, source_dtype)
        if requested == "int4":
            reason = f"int4 weights; activations {target} ({reason})"
    if target != source_dtype and source_dtype != "float32":
        raise UnsupportedModelError(
            f"precision {requested}: the model computes in {source_dtype}; epfuse converts "
            "float32 exports only (export in float32, or ask for its own dtype)"
        )
    if target != source_dtype:
        reason += f"; converted from {source_dtype}"
    plan_int4 = None
    if requested == "int4":
        plan_int4 = int4 or Int4Options()
        if not record.ops(target).matmul_nbits:
            raise UnsupportedModelError(
                f"precision int4: {record.name} has no MatMulNBits ({target}) in its record"
            )
    elif int4 is not None:
        raise ValueError("int4 options given but precision is not int4")
    return PrecisionPlan(requested, source_dtype, target, reason, plan_int4)


def _auto_dtype(record: EPCapabilities, source_dtype: str) -> tuple[str, str]:
    preferred = record.preferred_dtype
    if source_dtype != "float32":
        return source_dtype, f"auto: the input's dtype {source_dtype} (never converted up)"
    if preferred and preferred != source_dtype:
        why = record.preferred_because or "the record's preferred dtype"
        return preferred, f"auto: {record.name} prefers {preferred} ({why})"
    return (
        source_dtype,
        f"auto: {record.name} runs its attention in the input's dtype {source_dtype}",
    )


__all__ = ["PRECISIONS", "Int4Options", "PrecisionPlan", "choose", "normalize"]
