"""The one place numeric tolerances live.

An optimized model passes when, on every compared element,
``|optimized - original| <= atol + rtol * |original|`` (the ``numpy.allclose`` rule), for the
logits and for the present K/V cache, with the tolerance of the model's compute dtype.

Why these values (measured with ORT 1.32 CPU on the bundled 2-layer model, |logits| <= ~4):

- float32: a fused kernel reorders the same fp32 sums (QK^T, softmax, PV, RoPE, RMSNorm); that
  moves results by a few ulps per op (fp32 ulp at 1.0 is 1.2e-7) and grows mildly with depth.
  Measured: the ONNX export vs the Hugging Face torch model 3e-6 on logits, 2e-6 on K/V;
  a single GroupQueryAttention vs ONNX Attention node: identical. 1e-4 leaves >= 30x headroom
  while still catching a lost mask, a wrong position, a lost scale or a wrong norm weight
  (>= 1e-3, usually >= 1).
- float16: unit roundoff 4.9e-4 (ulp 3.9e-3 at |x| = 4). Fused kernels keep fp32 accumulators
  and round once where the unfused graph rounds every intermediate to fp16. Measured: one GQA
  vs ONNX Attention node 6e-3 at |x| ~ 4 (S = 64); the fp16 export vs the torch fp16 model
  6e-3 (S = 7) to 1.3e-2 (S = 64) on logits; fp16 vs fp32 export 5e-3 to 1.1e-2. So 2e-2 abs
  + 2e-2 rel (0.1 allowed at |x| = 4) is ~2x-8x above honest reordering noise, yet well below
  the >= 0.1-1 errors of a real bug.
- bfloat16: unit roundoff 3.9e-3, 8x fp16 (8-bit mantissa); ORT CPU has no bf16 MatMul or
  attention, so this is not measured here: 3x fp16, on the assumption that bf16 kernels (CUDA)
  accumulate in fp32 and round once. Loosen only with a measurement.

int4 weights (``precision="int4"``): the fused model and the unfused reference hold the same
int4 numbers (quantization commutes with packing Q, K, V: see
``epfuse.optimizer.precision.int4``). With MatMulNBits computing in the activation dtype
(accuracy level 0-3) they agree as the activation dtype does: measured 7e-6 on logits and
6e-6 on K/V (Llama hidden 512, 4 layers), so the dtype's tolerance above applies. At accuracy
level 4 (the CPU default, int8 activations per block) an ulp-level difference upstream (fused
vs unfused norms) can move one activation across an int8 rounding boundary, a step of
absmax/127 of its block; measured 0.07 on logits and 0.05 on K/V on the same model (|logits|
up to ~5). ``int4-int8-compute`` (0.2 abs + 5% rel) is ~3x that. It is too loose to catch every
defect on its own, so ``optimize(verify=True)`` also compares the two models with the
accuracy level dropped (exact int4 weights, fp32 compute) at the float32 tolerance.

int8 KV cache (``kv_cache="int8"``, ``kv-int8``): the cache holds K and V rounded to
per-channel steps of 1.25 * max|x| / 127 (calibrated), an error of at most half a step per
element (~0.5% of the channel's range), which the attention turns into logit errors. Measured
against the float-cache model, prompt/decode/chunk/padded scenarios: 0.09 (bundled example,
|logits| <= 4) and 0.18 (Llama hidden 512, 4 layers; fp16 compute 0.25) on logits, 0.02 / 0.06
on K/V. 0.3 abs + 5% rel is 1.2x-3x that; a lost mask or position is off by >= 1. With int4
weights too the two tolerances add (``epfuse.optimizer.api``).

Drift from float32 (``DRIFT``; reported in ``report.precision["drift"]``, information, not a
verdict on the rewrite): what converting or quantizing a model costs, bounds on the max
|logits difference| and top-1 agreement over the drift inputs (a padded batch-2 prompt and
4 decode steps, ``epfuse.optimizer.precision.drift``). fp16: weights and activations rounded
to 11 bits; measured 7e-3 (bundled example) and 1e-2 (Llama hidden 512, 4 layers), at
|logits| <= ~4, top-1 100%: bound 0.1, >= 90% top-1 (fused fp16 vs the unfused fp16
reference: 6e-3, inside the float16 tolerance above). bf16: 8 bits, 8x fp16's unit roundoff: bound 8x fp16's. int4: block-32
round-to-nearest weights (step absmax/7 per block) move logits by O(1) on random-weight
models (measured 1.6 on the bundled example, 1.9 with 52% top-1 on the hidden-512 Llama,
|logits| ~4); trained models are smoother, but the bound is for these: 3.0 and >= 40% top-1
(random-weight logits are near-ties; top-1 agreement on trained models is far higher).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """Element-wise ``|actual - expected| <= atol + rtol * |expected|``."""

    atol: float
    rtol: float


TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4),
    "float16": Tolerance(atol=2e-2, rtol=2e-2),
    "bfloat16": Tolerance(atol=6e-2, rtol=6e-2),
}


QUANTIZED_TOLERANCES: dict[str, Tolerance] = {
    "int4-int8-compute": Tolerance(atol=0.2, rtol=0.05),
    "kv-int8": Tolerance(atol=0.3, rtol=0.05),
}
"""``kv-int8``: an int8 KV cache against the float-cache model (see the module docstring)."""
"""Fused vs unfused model with the *same* int4 weights whose MatMulNBits quantize their
activations to int8 (accuracy level 4): see the module docstring."""


@dataclass(frozen=True)
class DriftBound:
    """Expected drift of a converted model from its float32 original (information: a model
    outside it is reported, not refused)."""

    max_abs_logits: float
    top1_agreement: float


DRIFT: dict[str, DriftBound] = {
    "float32": DriftBound(max_abs_logits=1e-4, top1_agreement=1.0),
    "float16": DriftBound(max_abs_logits=0.1, top1_agreement=0.9),
    "bfloat16": DriftBound(max_abs_logits=0.8, top1_agreement=0.75),
    "int4": DriftBound(max_abs_logits=3.0, top1_agreement=0.4),
}


def tolerance_for(dtype: str, quantized: str | None = None) -> Tolerance:
    """The tolerance for a dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``);
    with ``quantized="int4-int8-compute"``, that of two models sharing the same int4 weights
    and int8 activation rounding (accuracy level 4)."""
    if quantized is not None:
        try:
            return QUANTIZED_TOLERANCES[quantized]
        except KeyError:
            known = sorted(QUANTIZED_TOLERANCES)
            raise KeyError(f"no tolerance for {quantized!r} weights; known: {known}") from None
    try:
        return TOLERANCES[str(dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}") from None


def drift_bound(precision: str) -> DriftBound:
    """The expected drift from float32 of ``precision`` (a dtype name or ``"int4"``)."""
    try:
        return DRIFT[precision]
    except KeyError:
        raise KeyError(f"no drift bound for {precision!r}; known: {sorted(DRIFT)}") from None
