"""Where no op the EP runs can express a layer, its standard Attention is legalized exactly
(expanded to primitives, softcap and mask included) and the report says why per layer."""

from __future__ import annotations

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities.conformance import check
from epfuse.optimizer.verify import assert_equivalent


def _attention(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "Attention"]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize(
    ("ep", "dtype", "why"),
    [
        (
            "trt-rtx",
            "float16",
            "trt-rtx does not take Attention for float16 (needs attention_softcap)",
        ),
        ("dml", "float16", "dml does not take Attention for float16 (needs attention"),
        ("webgpu", "float32", "webgpu does not take Attention for float32 (needs attention"),
        ("qnn", "float32", "qnn does not take Attention for float32 (needs attention"),
        ("coreml", "float32", "coreml does not take Attention for float32 (needs attention"),
    ],
)
def test_softcap_layer_legalized_exactly_and_reported(ep, dtype, why):
    """The layer GQA cannot express is not dropped to fit, and not left in an op the EP does
    not run: its Attention is expanded to its ONNX function body (softcap and mask included),
    equal on ORT CPU, and the report says both why GQA refused and how it was legalized."""
    cfg = DecoderConfig(style="mobius", softcap=5.0, sliding_window=4, dtype=dtype)
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, ep, precision=dtype)
    assert not _attention(optimized)
    assert not any(n.op_type == "GroupQueryAttention" for n in optimized.graph.node)
    assert sum(n.op_type == "Tanh" for n in optimized.graph.node) == cfg.layers
    assert not check(optimized, epfuse.get_ep(ep), dtype).violations
    for layer in report.layers:
        assert not layer.fused and layer.runs_on_ep
        assert layer.result == "Attention expanded to primitive ops"
        assert any(why in n for n in layer.notes), layer.notes
        if ep != "coreml":  # coreml has no GQA at all: the GQA rule is not even selected
            assert any("softcap" in r for r in layer.reasons), layer.reasons
    assert_equivalent(original, optimized, prompt_len=9, decode_past_len=7, chunk_past_len=6)


def test_cpu_softcap_layer_runs_on_ep():
    cfg = DecoderConfig(style="mobius", softcap=5.0)
    _, report = epfuse.optimize_with_report(build_decoder(cfg), "cpu")
    assert all(layer.fused and layer.runs_on_ep for layer in report.layers)


def test_default_keeps_softcap_attention_and_runs_it():
    cfg = DecoderConfig(style="mobius", softcap=5.0)
    _, report = epfuse.optimize_with_report(build_decoder(cfg), "default")
    assert all(not layer.fused and layer.runs_on_ep for layer in report.layers)


def test_trt_rtx_keeps_attention_when_rotary_cannot_be_fused():
    """TRT-RTX's GQA wants cos/sin present (record: requires_rotary_caches). When the rotation
    cannot move into GQA, the layer keeps Attention rather than becoming a GQA without caches
    (found by the conformance checker on a real fp16 Qwen3 export, whose rotation is
    decomposed)."""
    cfg = DecoderConfig(style="mobius", dtype="float16")
    model = build_decoder(cfg)
    # Make Q and K rotated differently (q keeps partial rotary attrs of its own): the planner
    # refuses to fuse, so there is nothing to put in cos/sin.
    for node in model.graph.node:
        if node.op_type == "RotaryEmbedding" and node.output[0].startswith("q_rot"):
            for a in node.attribute:
                if a.name == "interleaved":
                    a.i = 1
    optimized, report = epfuse.optimize_with_report(model, "trt-rtx")
    assert not any(n.op_type == "GroupQueryAttention" for n in optimized.graph.node)
    assert all(any("wants cos/sin caches" in r for r in layer.reasons) for layer in report.layers)
    optimized_cpu = epfuse.optimize(model, "cpu")  # CPU has no such need: GQA(do_rotary=0)
    gqa = [n for n in optimized_cpu.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == cfg.layers
    assert_equivalent(model, optimized, prompt_len=9)
