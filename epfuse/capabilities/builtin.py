"""The built-in records, transcribed from ``shared/reference/ort-attention-facts.md``.

Where the facts file marks something unverified or says nothing, the record is conservative:
a capability we have not seen stays off, since an EP that silently falls back to the CPU (or
rejects an attribute at load time) is worse than a slower graph that is kept.
"""

from __future__ import annotations

import dataclasses

from .records import EPCapabilities, GQASupport, OpSupport

# Op sets are built up from smaller ones (dataclasses.replace adding the ops an EP has on
# top), never by switching off ops another EP has: an op added to OpSupport stays off for
# every EP until its record turns it on. GQA records of the limited EPs start from what they
# all lack and each takes away more.
_PORTABLE = OpSupport(
    attention=True,
    attention_softcap=True,
    rotary_embedding=True,
    rms_normalization=True,
)
"""Standard ONNX (opset 23) attention, rotary and RMSNorm: the ``default`` target's ops, which
CPU and CUDA run too."""
_MS_ROTARY_AND_NORMS = dict(
    ms_rotary_embedding=True,
    simplified_layer_norm=True,
    skip_simplified_layer_norm=True,
    skip_layer_norm=True,
)

_CPU_GQA = GQASupport(
    qk_norm=False,
    head_sink=True,
    kv_cache_int8=True,
    head_size_multiple=8,
    rotary_head_size_multiple=16,
    rotary_cache_width_multiple=8,
    chunked_prefill_needs_batch1=True,
)
_CPU = dataclasses.replace(
    _PORTABLE,
    **_MS_ROTARY_AND_NORMS,
    gqa=_CPU_GQA,
    mrotary_embedding=True,
    matmul_nbits=True,
    gather_block_quantized=True,
    moe=True,
)

# ORT 1.32's CPU MoE runs each expert's two GEMMs on one thread (it splits the experts, not
# the work, across threads) with weights unpacked per call; the loop's MatMuls read prepacked
# weights on all threads, so it is 1.1-1.8x faster from 16 tokens at every measured shape. At
# decode the loop pays ~15 ops for every expert, routed or not: it breaks even between 393K
# decode weights per expert (Qwen3-30B-A3B's width with 96 experts: 0.92-1.01x in two runs)
# and 590K (64 experts: 1.04-1.08x), 2 threads; Qwen3-30B-A3B's own block (295K) decodes
# 1.18-1.25x faster through MoE (benchmarks/moe_shapes.py). float16 keeps MoE: ORT CPU has no
# float16 ScatterND add, so the loop cannot run.
_CPU_FLOAT = dataclasses.replace(_CPU, experts_loop_min_decode_weights=450_000)

CPU = EPCapabilities(
    name="cpu",
    provider="CPUExecutionProvider",
    description="ONNX Runtime CPU",
    dtypes={"float32": _CPU_FLOAT, "float16": _CPU},
    notes=("no bfloat16 kernels for GQA, Attention or RMSNormalization",),
)

_CUDA_FLOAT = dataclasses.replace(_PORTABLE, **_MS_ROTARY_AND_NORMS)
_CUDA_HALF = dataclasses.replace(_CUDA_FLOAT, gqa=GQASupport(qk_norm=True), matmul_nbits=True)
CUDA = EPCapabilities(
    name="cuda",
    provider="CUDAExecutionProvider",
    description="NVIDIA CUDA",
    dtypes={"float32": _CUDA_FLOAT, "float16": _CUDA_HALF, "bfloat16": _CUDA_HALF},
    notes=("GroupQueryAttention runs fp16/bf16 only",),
    preferred_dtype="float16",
    preferred_because="its GroupQueryAttention runs fp16/bf16 only",
)

_LIMITED_GQA = GQASupport(softcap=False, local_window=False, attention_bias=False)
"""What the GQA of DML, WebGPU, QNN and TRT-RTX all lack (each lacks more besides)."""
_QNN_GQA = dataclasses.replace(_LIMITED_GQA, interleaved_rotary=False, packed_qkv=False)
_DML_GQA = dataclasses.replace(_QNN_GQA, fused_rotary=False)
_WEBGPU = OpSupport(
    gqa=dataclasses.replace(_LIMITED_GQA, rotary_position_ids=False, qk_norm=True),
    matmul_nbits=True,
    ms_rotary_embedding=True,
    simplified_layer_norm=True,
    skip_simplified_layer_norm=True,
)
_DML = dataclasses.replace(_WEBGPU, gqa=_DML_GQA, skip_layer_norm=True)
DML = EPCapabilities(
    name="dml",
    provider="DmlExecutionProvider",
    description="DirectML",
    dtypes={"float16": _DML, "float32": _DML},
    notes=(
        "GQA without cos/sin inputs (no fused RoPE) and without packed QKV; causal only",
        "no ONNX Attention kernel",
    ),
    preferred_dtype="float16",
    preferred_because="GPU kernels run best in fp16 (half the memory traffic; the genai "
    "builder's DML models are fp16)",
)

WEBGPU = EPCapabilities(
    name="webgpu",
    provider="WebGpuExecutionProvider",
    description="WebGPU",
    dtypes={"float32": _WEBGPU, "float16": _WEBGPU},
    notes=("fused rotary takes positions from seqlens_k and ignores position_ids",),
    preferred_dtype="float16",
    preferred_because="GPU kernels run best in fp16 (half the memory traffic)",
)

QNN = EPCapabilities(
    name="qnn",
    provider="QNNExecutionProvider",
    description="Qualcomm QNN (GPU/HTP)",
    dtypes={"float32": OpSupport(gqa=_QNN_GQA), "float16": OpSupport(gqa=_QNN_GQA)},
    notes=("GQA rejects softcap, local window, interleaved rotary and attention_bias",),
)

_TRT = OpSupport(
    gqa=dataclasses.replace(_LIMITED_GQA, packed_qkv=False, requires_rotary_caches=True),
    attention=True,
    attention_softcap=False,
)
TRT_RTX = EPCapabilities(
    name="trt-rtx",
    provider="NvTensorRTRTXExecutionProvider",
    description="NVIDIA TensorRT for RTX",
    dtypes={"float16": _TRT, "bfloat16": _TRT},
    notes=("rank-3 q/k/v, wants cos/sin present; its Attention has no softcap",),
    preferred_dtype="float16",
    preferred_because="it has no float32 record",
)

OPENVINO = EPCapabilities(
    name="openvino",
    provider="OpenVINOExecutionProvider",
    description="Intel OpenVINO",
    dtypes={},
    notes=("no fused op verified yet: epfuse only canonicalizes",),
)

COREML = EPCapabilities(
    name="coreml",
    provider="CoreMLExecutionProvider",
    description="Apple CoreML",
    dtypes={},
    notes=("no GroupQueryAttention",),
)

DEFAULT = EPCapabilities(
    name="default",
    provider=None,
    description="portable standard ONNX (no vendor domains)",
    dtypes={"float32": _PORTABLE, "float16": _PORTABLE, "bfloat16": _PORTABLE},
    vendor_ops=False,
)

BUILTIN = (CPU, CUDA, DML, WEBGPU, TRT_RTX, QNN, OPENVINO, COREML, DEFAULT)
