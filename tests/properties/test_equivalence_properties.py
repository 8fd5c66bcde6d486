"""Property suite: for drawn decoder configs and in-contract inputs, the model epfuse makes for
an EP computes what the generic graph computes (logits and present K/V on valid rows, with
the shared tolerances of ``epfuse.optimizer.tolerances``).

Every EP whose output runs on ORT CPU is fuzzed: ``cpu`` (GQA, fused RoPE), ``dml`` and
``webgpu`` (GQA, RoPE outside), ``default`` (standard ONNX only) and, for fp16, ``cuda`` (GQA
with fused RoPE; its graph is checked with ORT CPU's GQA kernel, not CUDA's). Profiles: see
tests/conftest.py (``ci`` by default; ``--hypothesis-profile=thorough`` for a long run).
A failing example prints as ``cfg=DecoderConfig(...)`` and ``cases=[Scenario(...), ...]``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st
from model_builder import DecoderConfig, build_decoder
from strategies import decoder_configs, scenario_lists

import epfuse
from epfuse.optimizer.verify import Scenario, compare_models

EPS = {
    "cpu": {"dtypes": ("float32", "float16")},
    "dml": {"dtypes": ("float32", "float16")},
    "webgpu": {"dtypes": ("float32", "float16")},
    "default": {"dtypes": ("float32", "float16")},
    # CUDA's fused rotary takes head sizes and cos widths that ORT CPU's GQA kernel rejects
    # (head_size % 16, cos width % 8): draw only what the CPU kernel can check.
    "cuda": {"dtypes": ("float16",), "head_dims": (16, 32), "rotary_dims": (16,)},
}


def check_equivalent(cfg: DecoderConfig, ep: str, cases: list[Scenario]) -> None:
    """Build, optimize for ``ep``, compare on ``cases``; fail with the table and the config."""
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, ep)
    note(f"reproduce: build_decoder({cfg!r}), optimize for {ep!r}")
    note(report.summary())
    result = compare_models(original, optimized, scenarios=cases)
    assert result.passed, f"{cfg!r} on {ep}:\n{result}"


@pytest.mark.parametrize(
    ("ep", "dtype"), [(ep, dtype) for ep, spec in EPS.items() for dtype in spec["dtypes"]]
)
@given(data=st.data())
def test_optimized_model_is_equivalent(ep: str, dtype: str, data: st.DataObject):
    strategy = decoder_configs(**{**EPS[ep], "dtypes": (dtype,)})
    cfg = data.draw(strategy, label="cfg")
    cases = data.draw(scenario_lists(), label="cases")
    check_equivalent(cfg, ep, cases)
