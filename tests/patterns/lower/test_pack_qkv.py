"""Packed QKV for GQA where the record allows it: one MatMul (+ bias Add), key/value absent."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder, decoder_weights

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns import OptimizeOptions


def _gqa(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


@pytest.mark.parametrize("style", ["torch23", "mobius"])
@pytest.mark.parametrize("bias", [False, True])
def test_packs_on_cpu_and_stays_equal(style, bias):
    cfg = DecoderConfig(style=style, qkv_bias=bias)
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    ops = Counter(n.op_type for n in optimized.graph.node)
    # 7 MatMuls per layer + lm_head before; q/k/v become one per layer.
    assert ops["MatMul"] == 5 * cfg.layers + 1
    for node in _gqa(optimized):
        assert node.input[1] == "" and node.input[2] == ""
    rule = next(r for r in report.rules if r.name == "pack-qkv")
    assert rule.rewritten == cfg.layers
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in optimized.graph.initializer}
    w = decoder_weights(cfg)
    p = "model.layers.0.self_attn"
    packed = inits[f"{p}.qkv_proj.weight"]
    expected = np.concatenate([w[f"{p}.{x}_proj.weight"] for x in "qkv"], axis=1)
    assert np.array_equal(packed, expected)
    assert f"{p}.q_proj.weight" not in inits  # the originals are gone, not held twice
    if bias:
        assert ops["Add"] == cfg.layers  # one packed bias Add per layer
        expected = np.concatenate([w[f"{p}.{x}_proj.bias"] for x in "qkv"])
        assert np.array_equal(inits[f"{p}.qkv_proj.bias"], expected)
    assert_equivalent(original, optimized)


@pytest.mark.parametrize("ep", ["dml", "qnn", "trt-rtx", "webgpu"])
def test_not_packed_where_the_record_forbids_or_rope_sits_between(ep):
    dtype = "float16"
    optimized = epfuse.optimize(build_decoder(DecoderConfig(style="mobius", dtype=dtype)), ep)
    gqa = _gqa(optimized)
    assert gqa and all(n.input[1] and n.input[2] for n in gqa)


def test_qk_norm_between_projection_and_gqa_is_not_packed():
    optimized = epfuse.optimize(build_decoder(DecoderConfig(style="mobius", qk_norm=True)), "cpu")
    assert all(n.input[1] and n.input[2] for n in _gqa(optimized))


def test_packed_weight_is_lazy_and_external_data_is_not_loaded(tmp_path):
    cfg = DecoderConfig(style="mobius")
    path = tmp_path / "model.onnx"
    onnx.save(build_decoder(cfg), path, save_as_external_data=True, size_threshold=1024)
    model = ir.load(path)
    assert isinstance(
        model.graph.initializers["model.layers.0.self_attn.q_proj.weight"].const_value,
        ir.ExternalTensor,
    )
    PassManager().run(model, get_ep("cpu"), "float32", OptimizeOptions())
    packed = [v for k, v in model.graph.initializers.items() if k.endswith("qkv_proj.weight")]
    assert len(packed) == cfg.layers
    assert all(isinstance(v.const_value, ir.LazyTensor) for v in packed)
    out = tmp_path / "out.onnx"
    ir.save(model, out, external_data="out.onnx.data")
    assert_equivalent(path, out)
