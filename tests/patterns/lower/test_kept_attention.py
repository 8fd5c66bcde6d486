"""Where no op the EP runs can express a layer, the standard Attention stays exactly as it was
(softcap attribute, mask input) and the report says the layer does not run on the EP."""

from __future__ import annotations

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _attention(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "Attention"]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize(
    ("ep", "dtype", "why"),
    [
        ("trt-rtx", "float16", "trt-rtx's Attention does not apply softcap 5"),
        ("dml", "float16", "dml has no ONNX Attention for float16"),
        ("webgpu", "float32", "webgpu has no ONNX Attention for float32"),
        ("qnn", "float32", "qnn has no ONNX Attention for float32"),
    ],
)
def test_softcap_layer_kept_exactly_and_reported(ep, dtype, why):
    cfg = DecoderConfig(style="mobius", softcap=5.0, sliding_window=4, dtype=dtype)
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, ep)
    kept = _attention(optimized)
    assert len(kept) == cfg.layers
    before = {n.name: n for n in _attention(original)}
    for node in kept:
        src = before[node.name]
        assert _attrs(node) == _attrs(src)  # softcap, is_causal, heads, scale untouched
        assert list(node.input)[3] == list(src.input)[3]  # the exact mask input
    assert not any(n.op_type == "GroupQueryAttention" for n in optimized.graph.node)
    for layer in report.layers:
        assert not layer.fused and not layer.runs_on_ep
        assert any(why in r for r in layer.reasons), layer.reasons
        assert any("does not apply softcap" in r for r in layer.reasons)
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
