"""Real torch.onnx **opset-18** (decomposed) exports of every family, end to end on CPU.

The same families and per-layer expectations as the opset-23 tests: the canonicalize stage
(decomposed attention, rotate-half RoPE, RMSNorm, cos/sin caches) must bring the opset-18
form to what the lowering fuses, with the same result per layer, and equivalence in every
scenario with prompts and pasts longer than any sliding window.
"""

from __future__ import annotations

import onnx
import pytest
from export_runs import assert_prompt_matches_hf

import epfuse
from epfuse.optimizer.verify import assert_equivalent
from epfuse.testing.hf_export import export_hf_decoder
from epfuse.testing.hf_families import FAMILIES, SLIDING_WINDOW

pytestmark = pytest.mark.slow

W = SLIDING_WINDOW
# (do_rotary per layer, windows per layer, softcap)
EXPECTED = {
    "llama3": (1, (None, None), 0.0),
    "llama-linear": (1, (None, None), 0.0),
    "llama-yarn": (1, (None, None), 0.0),
    "qwen2": (1, (None, None), 0.0),
    "mistral": (1, (W, W), 0.0),
    "gemma2": (1, (W, None), 5.0),
    "qwen3": (1, (None, None), 0.0),
    "phi3": (1, (None, None), 0.0),
    "stablelm": (1, (None, None), 0.0),
    "gemma3": (1, (W, None, W, None), 0.0),
    "glm": (1, (None, None), 0.0),  # interleaved partial rotary
    "olmo2": (1, (None, None), 0.0),
    "nemotron": (1, (None, None), 0.0),
    "olmo": (1, (None, None), 0.0),
    "olmo3": (1, (W, None), 0.0),
    "gemma": (1, (None, None), 0.0),
    "ernie4_5": (1, (None, None), 0.0),  # interleaved, as GLM
    "hunyuan-dense": (0, (None, None), 0.0),  # q/k norm after RoPE: rotation stays outside
}
assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_opset18_export_fuses_and_stays_equal(name, tmp_path):
    path = tmp_path / f"{name}.onnx"
    export_hf_decoder(FAMILIES[name].make_config(), path, opset=18)
    original = onnx.load(str(path))
    assert_prompt_matches_hf(FAMILIES[name].make_config(), original, 2 * W + 1)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rotary, windows, softcap = EXPECTED[name]
    assert len(report.layers) == len(windows)
    assert all(layer.fused for layer in report.layers), report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == len(windows)
    for node, window in zip(gqa, windows, strict=True):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == rotary
        assert attrs.get("local_window_size", -1) == (window if window else -1)
        assert attrs.get("softcap", 0.0) == pytest.approx(softcap)
    # Nothing of the decomposed attention or RMSNorm is left, nor the run-time RoPE where GQA
    # rotates (where RoPE stays outside GQA, its Cos/Sin stay with it).
    gone = {"Softmax", "ReduceMean"} | ({"Cos", "Sin"} if rotary else set())
    assert not gone & {n.op_type for n in optimized.graph.node}
    assert_equivalent(original, optimized, prompt_len=2 * W + 1, decode_past_len=2 * W)
