"""Property suite: for drawn decoder configs and in-contract inputs, the model epfuse makes for
an EP computes what the generic graph computes (logits and present K/V on valid rows, with
the shared tolerances of ``epfuse.tolerances``).

Every EP whose output runs on ORT CPU is fuzzed: ``cpu`` (GQA, fused RoPE), ``dml`` and
``webgpu`` (GQA, RoPE outside), ``default`` (standard ONNX only), ``qnn`` and, for fp16,
``cuda`` and ``trt-rtx`` (GQA with fused RoPE; their graphs are checked with ORT CPU's GQA
kernel, not the target EP's, so only head sizes the CPU kernel takes are drawn for them).
Profiles: see tests/conftest.py (``ci`` by default; ``--hypothesis-profile=thorough`` for a
long run). A failing example prints as ``Draw 1 (cfg): DecoderConfig(...)`` and
``Draw 2 (cases): [Scenario(...), ...]``, which rebuild it exactly.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from epfuse.testing.strategies import check_equivalent, decoder_configs, scenario_lists

EPS = {
    "cpu": {"dtypes": ("float32", "float16")},
    "dml": {"dtypes": ("float32", "float16")},
    "webgpu": {"dtypes": ("float32", "float16")},
    "default": {"dtypes": ("float32", "float16")},
    # CUDA's fused rotary takes head sizes and cos widths that ORT CPU's GQA kernel rejects
    # (head_size % 16, cos width % 8): draw only what the CPU kernel can check.
    "cuda": {"dtypes": ("float16",), "head_dims": (16, 32), "rotary_dims": (16,)},
    "qnn": {"dtypes": ("float32", "float16"), "head_dims": (16, 32), "rotary_dims": (16,)},
    "trt-rtx": {"dtypes": ("float16",), "head_dims": (16, 32), "rotary_dims": (16,)},
}


@pytest.mark.parametrize(
    ("ep", "dtype"), [(ep, dtype) for ep, spec in EPS.items() for dtype in spec["dtypes"]]
)
@given(data=st.data())
def test_optimized_model_is_equivalent(ep: str, dtype: str, data: st.DataObject):
    strategy = decoder_configs(**{**EPS[ep], "dtypes": (dtype,)})
    cfg = data.draw(strategy, label="cfg")
    # Chunked prefill with batch > 1 is in contract only without GQA (ORT CPU's GQA needs 1).
    cases = data.draw(scenario_lists(chunk_batch=3 if ep == "default" else 1), label="cases")
    check_equivalent(cfg, ep, cases)
