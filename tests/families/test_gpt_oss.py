"""GPT-OSS (tiny, 2 layers: one sliding-window, one full) exported by torch.onnx at opsets
18 and 23, end to end on CPU.

1. the export is the Hugging Face model (prompt, then decode on its past);
2. on cpu every layer becomes GroupQueryAttention with fused (YaRN) rotary, the layer's
   local window, and ``head_sink`` equal to the model's learned ``sinks`` parameter;
3. the result is equivalent in every scenario, prompt and past beyond the window;
4. on an EP whose GQA has no head_sink, each layer keeps the standard Attention form that
   carries the sinks exactly, says so, and is equivalent too.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from export_runs import assert_matches_hf, export_and_optimize
from onnx import numpy_helper

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.verify import assert_equivalent
from epfuse.testing.hf_export import hf_model
from epfuse.testing.hf_families import SINK_FAMILIES, SLIDING_WINDOW

pytestmark = pytest.mark.slow

W = SLIDING_WINDOW
PROMPT, PAST = 2 * W + 1, 2 * W
FAMILY = SINK_FAMILIES["gpt-oss"]
LENGTHS = dict(
    prompt_len=PROMPT,
    decode_past_len=PAST,
    chunk_past_len=PAST,
    chunk_len=3,
    padded_lens=(PROMPT, W - 1),
)
"""verify's lengths, prompt and past beyond the window: one set for the fused and the kept form."""


@pytest.fixture(scope="module", params=[18, 23], ids=["opset18", "opset23"])
def exported(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / f"gpt_oss_{request.param}.onnx"
    original, optimized, report = export_and_optimize(FAMILY.make_config(), path, request.param)
    return original, optimized, report


def test_export_matches_hugging_face(exported):
    original, _, _ = exported
    assert_matches_hf(FAMILY.make_config(), original, PROMPT, decode=True, seed=3)


def test_every_layer_takes_its_sinks_into_gqa(exported):
    _, optimized, report = exported
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    inits = {t.name: numpy_helper.to_array(t) for t in optimized.graph.initializer}
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2 and not any(n.op_type == "Attention" for n in optimized.graph.node)
    model = hf_model(FAMILY.make_config())
    for i, (node, layer) in enumerate(zip(gqa, report.layers, strict=True)):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        details = "; ".join(layer.notes + layer.reasons)
        assert layer.result == "GroupQueryAttention(do_rotary=1)", details
        assert "attention sinks as head_sink" in details
        assert attrs.get("local_window_size", -1) == (W if i == 0 else -1), details
        expected = model.model.layers[i].self_attn.sinks.detach().numpy()
        np.testing.assert_array_equal(inits[node.input[11]], expected)
    # GPT-OSS's clamped SwiGLU experts: interleaved gate/up, alpha 1.702, beta 1, limit 7 (these
    # tiny experts are below the cpu float32 record's decode-weight threshold for the loop).
    moe = [n for n in optimized.graph.node if n.op_type == "MoE"]
    assert len(moe) == 2
    for node in moe:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["normalize_routing_weights"] == 1  # top-k on logits, then softmax
        assert attrs["swiglu_limit"] == pytest.approx(7.0)
        assert attrs["activation_alpha"] == pytest.approx(1.702)
        assert attrs["activation_beta"] == pytest.approx(1.0)
    # The sink correction, the run-time YaRN cos/sin and the exported experts are gone.
    for op in ("ReduceLogSumExp", "Cos", "Sin", "RotaryEmbedding", "TopK", "GatherND"):
        assert not any(n.op_type == op for n in optimized.graph.node), op


def test_with_the_loop_preferred_the_clamped_experts_become_the_loop(exported):
    """As real GPT-OSS blocks on cpu float32 (3.1M decode weights per expert at GPT-OSS-20B,
    past the threshold): the loop over the experts, clamp and biases included."""
    original, _, _ = exported
    loop = get_ep("cpu").variant("cpu-loop", experts_loop_min_decode_weights=0)
    optimized, report = epfuse.optimize_with_report(original, loop)
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert "MoE" not in ops and ops.count("NonZero") == 2 * FAMILY.make_config().num_local_experts
    # The batched experts' gathers are gone (the loop keeps the graph's own router and TopK).
    for op in ("ReduceLogSumExp", "Cos", "Sin", "RotaryEmbedding", "GatherND"):
        assert op not in ops, op
    assert_equivalent(original, optimized, **LENGTHS)


def test_optimized_is_equivalent_beyond_the_window(exported):
    original, optimized, _ = exported
    assert_equivalent(original, optimized, **LENGTHS)


def test_without_head_sink_the_standard_form_carries_the_sinks(exported):
    original, _, _ = exported
    no_sink = get_ep("cpu").variant("cpu-no-head-sink", gqa={"head_sink": False})
    kept, report = epfuse.optimize_with_report(original, no_sink)
    assert report.fused_layers == 0
    for layer in report.layers:
        assert any("has no head_sink" in r for r in layer.reasons), layer
    ops = [n.op_type for n in kept.graph.node]
    assert ops.count("Attention") == 2 and ops.count("ReduceLogSumExp") == 2
    assert "GroupQueryAttention" not in ops
    assert_equivalent(original, kept, **LENGTHS)
