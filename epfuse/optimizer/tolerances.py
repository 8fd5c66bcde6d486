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


def tolerance_for(dtype: str) -> Tolerance:
    """The tolerance for a dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    try:
        return TOLERANCES[str(dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r}; known: {sorted(TOLERANCES)}") from None
