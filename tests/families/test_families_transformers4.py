"""Real torch.onnx (dynamo) exports made with the *installed* transformers fuse as the
transformers 5.x exports do, per layer, RoPE into GQA included.

Users export with whatever transformers they have: Optimum pins 4.57.x, whose rotary module
expands ``inv_freq`` to the batch size read from another input (a past key), so the cos/sin
proof must accept cos/sin that read other inputs' shapes. This module runs in the optimum
venv (transformers 4.57.x; ``-m optimum``), and passes unchanged under 5.x: the expectations
are the 5.x tables of ``test_families_opset18`` / ``test_families_opset23``. Each export is
also checked against the Hugging Face model it came from, and the optimized model against the
export in every scenario, with lengths past the sliding window.
"""

from __future__ import annotations

import onnx
import pytest
import transformers
from export_runs import assert_prompt_matches_hf
from families.test_families_opset18 import EXPECTED as EXPECTED_18
from families.test_families_opset23 import EXPECTED as EXPECTED_23

import epfuse
from epfuse.optimizer.verify import compare_models
from epfuse.testing.hf_export import export_hf_decoder
from epfuse.testing.hf_families import ALL_FAMILIES, SLIDING_WINDOW

pytestmark = [pytest.mark.slow, pytest.mark.optimum]

W = SLIDING_WINDOW
PROMPT, PAST = 2 * W + 1, 2 * W  # longer than any sliding window


def _expected(name: str, opset: int) -> tuple[int, tuple[int | None, ...], float]:
    """(do_rotary, window per layer, softcap) of the transformers 5.x export."""
    if opset >= 23 and name in EXPECTED_23:
        e = EXPECTED_23[name]
        rotary, windows, softcap = int(e.rotary), e.windows, e.softcap
    elif name in EXPECTED_18:
        rotary, windows, softcap = EXPECTED_18[name]
    else:  # MORE_FAMILIES: Phi-2 (partial rotary) and Cohere (interleaved rotary) fuse fully.
        rotary, windows, softcap = 1, (None, None), 0.0
    if softcap and _TRANSFORMERS_MAJOR < 5:
        # transformers 4.x's sdpa attention (the default) drops Gemma-2's
        # attn_logit_softcapping, so neither the model nor its export caps the scores (the
        # export is checked against that model below): nothing for GQA to apply.
        softcap = 0.0
    return rotary, windows, softcap


_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
INTERLEAVED = {"cohere"}  # rotate_every_two: GQA's rotary_interleaved


# The four families the issue names at every opset; the partial (Phi-2) and interleaved
# (Cohere) rotary forms at opset 18, where RoPE is exported decomposed. CI has 2 cores.
CASES = [
    (name, opset) for name in ("llama3", "qwen3", "mistral", "gemma2") for opset in (18, 20, 23)
] + [("phi2", 18), ("cohere", 18)]


@pytest.mark.parametrize(("name", "opset"), CASES, ids=[f"{n}-opset{o}" for n, o in CASES])
def test_export_fuses_like_transformers5(name, opset, tmp_path):
    config = ALL_FAMILIES[name].make_config()
    path = export_hf_decoder(config, tmp_path / f"{name}.onnx", opset=opset)
    original = onnx.load(str(path))
    assert_prompt_matches_hf(config, original, PROMPT)

    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rotary, windows, softcap = _expected(name, opset)
    assert len(report.layers) == len(windows), report.summary()
    for layer, window in zip(report.layers, windows, strict=True):
        assert layer.fused, report.summary()
        assert layer.result == f"GroupQueryAttention(do_rotary={rotary})", report.summary()
        assert not any("RoPE kept outside" in r for r in layer.reasons), report.summary()
        mask = "causal + padding" + (f" + sliding window {window}" if window else "")
        assert layer.notes[:1] == [mask], report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    for node, window in zip(gqa, windows, strict=True):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == rotary
        assert attrs.get("rotary_interleaved", 0) == int(name in INTERLEAVED)
        assert attrs.get("local_window_size", -1) == (window if window else -1)
        assert attrs.get("softcap", 0.0) == pytest.approx(softcap)
    assert not any(n.op_type in ("Cos", "Sin", "Softmax") for n in optimized.graph.node)

    result = compare_models(original, optimized, prompt_len=PROMPT, decode_past_len=PAST)
    assert result.passed, str(result)
