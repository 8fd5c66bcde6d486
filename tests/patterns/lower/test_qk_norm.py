"""Qwen3 q/k norm into GQA (q_norm_weight/k_norm_weight) only where the record allows it and
the layout around the norm is proven to be per head; elsewhere the norm stays ahead of GQA.

ORT 1.32's CPU GQA rejects q/k-norm inputs at run time, so the fused form is checked
structurally here; the kept form (every other EP) is checked for equality on ORT CPU."""

from __future__ import annotations

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder, decoder_weights
from onnx import helper

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _gqa(model):
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("style", ["torch23", "mobius"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_on_cuda(style, dtype):
    cfg = DecoderConfig(style=style, qk_norm=True, dtype=dtype)
    optimized, report = epfuse.optimize_with_report(build_decoder(cfg), "cuda")
    nodes = _gqa(optimized)
    assert len(nodes) == cfg.layers
    for i, node in enumerate(nodes):
        p = f"model.layers.{i}.self_attn"
        assert list(node.input[14:16]) == [f"{p}.q_norm.weight", f"{p}.k_norm.weight"]
        attrs = _attrs(node)
        assert attrs["do_rotary"] == 1
        assert attrs["q_norm_epsilon"] == pytest.approx(1e-6)
        assert attrs["k_norm_epsilon"] == pytest.approx(1e-6)
    # Only the 5 hidden-size norms remain (1 RMSNorm + 4 fused skip norms); the 4 per-head ones
    # moved into GQA.
    kinds = [n.op_type for n in optimized.graph.node if "Normalization" in n.op_type]
    assert len(kinds) == 5
    rule = next(r for r in report.rules if r.name == "qk-norm-into-gqa")
    assert rule.rewritten == cfg.layers and rule.kept == 0
    # The norm no longer sits between projection and GQA: the projections get packed.
    if style == "mobius":
        assert all(n.input[1] == "" for n in nodes)
    weights = decoder_weights(cfg)
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (cfg.head_dim,)


@pytest.mark.parametrize(
    ("ep", "dtype"),
    [
        ("cpu", "float32"),
        ("cpu", "float16"),
        ("webgpu", "float32"),
        ("dml", "float16"),
        ("cuda", "float32"),
        ("qnn", "float16"),
        ("trt-rtx", "float16"),
    ],
)
def test_norm_stays_ahead_of_gqa_elsewhere(ep, dtype):
    cfg = DecoderConfig(style="mobius", qk_norm=True, dtype=dtype)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, ep, precision=dtype)
    assert all(len(n.input) <= 14 or not n.input[14] for n in _gqa(optimized))
    head_norms = [
        n
        for n in optimized.graph.node
        if n.op_type in ("RMSNormalization", "SimplifiedLayerNormalization")
        and "_norm.weight" in n.input[1]
        and "self_attn" in n.input[1]
    ]
    if epfuse.get_ep(ep).ops(dtype).rms_normalization or ep in ("dml", "webgpu"):
        assert len(head_norms) == 2 * cfg.layers
    else:  # no norm op in the record: the norms are expanded, still ahead of GQA
        assert not head_norms
        assert sum(n.op_type == "ReduceMean" for n in optimized.graph.node) == 5 + 2 * cfg.layers
    assert_equivalent(original, optimized)


def test_norm_across_heads_is_not_fused():
    """A norm over the head axis (not per head) has a scale of the same width when heads ==
    head_dim; the probe must see that its rows are not heads and keep it."""
    cfg = DecoderConfig(
        style="mobius", qk_norm=True, heads=16, kv_heads=16, head_dim=16, layers=1, dtype="float16"
    )
    model = build_decoder(cfg)
    nodes = list(model.graph.node)
    out = []
    for node in nodes:
        if node.op_type == "RMSNormalization" and "self_attn" in node.input[1]:
            src = node.input[0]
            out.append(helper.make_node("Transpose", [src], [src + "_t"], perm=[0, 1, 3, 2]))
            node.input[0] = src + "_t"
            out.append(node)
            y = node.output[0]
            node.output[0] = y + "_pre"
            out.append(helper.make_node("Transpose", [y + "_pre"], [y], perm=[0, 1, 3, 2]))
        else:
            out.append(node)
    del model.graph.node[:]
    model.graph.node.extend(out)
    optimized, report = epfuse.optimize_with_report(model, "cuda")
    assert all(len(n.input) <= 14 or not n.input[14] for n in _gqa(optimized))
    assert any("not whole heads" in r for layer in report.layers for r in layer.reasons)
    assert_equivalent(model, optimized)
