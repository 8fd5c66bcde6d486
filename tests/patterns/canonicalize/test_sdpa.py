"""Decomposed attention -> ONNX Attention: small graphs run on ORT before and after the rule,
refusals leave the graph untouched, and the opset-18 builder decoder fuses end to end."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import TensorProto, helper, numpy_helper
from proto_graph import ProtoGraph, run_unoptimized

import epfuse
from epfuse.capabilities import get_ep
from epfuse.capabilities.conformance import check
from epfuse.optimizer.manager import _infer_types
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.sdpa import DecomposedAttentionToAttention
from epfuse.tolerances import tolerance_for

B, NQ, S, T, H = 2, 4, 3, 5, 8


@dataclasses.dataclass
class Variant:
    kv_heads: int = 2  # K/V given already repeated to NQ heads unless kv_heads == 1 (MQA)
    # "split" | "scores" | "div" | "none" | "shape" (split, computed from Shape(q) in the
    # graph: TorchScript's SDPA with scale=None, as Optimum's Nemotron/StableLM exports)
    scale_form: str = "split"
    k_transpose: str = "reshape"  # "reshape" | "perm" | "wrong_perm"
    softcap: float = 0.0
    mask: str = "where"  # "where" (finite Where) | "input" (float graph input) | "none"
    nan_guard: bool = True
    softmax_axis: int = -1
    fp16_softmax_casts: bool = False
    dtype: int = TensorProto.FLOAT


def _graph(v: Variant) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(v.dtype)
    kvh = 1 if v.kv_heads == 1 else NQ
    g = ProtoGraph(const_dtype=np_dtype)
    const, op, nodes, inits = g.const, g.op, g.nodes, g.inits

    inputs = [
        helper.make_tensor_value_info("q", v.dtype, [B, NQ, S, H]),
        helper.make_tensor_value_info("k", v.dtype, [B, kvh, T, H]),
        helper.make_tensor_value_info("v", v.dtype, [B, kvh, T, H]),
    ]
    if v.k_transpose == "perm":
        kt = op("Transpose", ["k"], "kt", perm=[0, 1, 3, 2])
    elif v.k_transpose == "wrong_perm":
        kt = op("Transpose", ["k"], "kt", perm=[0, 2, 3, 1])
    else:
        shape = op("Shape", ["k"], "kshape")
        i64 = np.int64
        last = op("Slice", [shape, const("m1", [-1], i64), const("big", [2**63 - 1], i64)], "l")
        second = op("Slice", [shape, const("m2", [-2], i64), "m1"], "s2")
        lead = op("Slice", [shape, const("small", [-(2**63)], i64), "m2"], "lead")
        k3 = op("Reshape", ["k", op("Concat", ["m1", second, last], "k3s", axis=0)], "k3")
        kt3 = op("Transpose", [k3], "kt3", perm=[0, 2, 1])
        kt = op("Reshape", [kt3, op("Concat", [lead, last, second], "kts", axis=0)], "kt")
    scale = 1 / math.sqrt(H)
    q = "q"
    if v.scale_form == "split":
        q = op("Mul", ["q", const("sq", math.sqrt(scale))], "q_s")
        kt = op("Mul", [kt, "sq"], "kt_s")
    elif v.scale_form == "shape":
        i64 = np.int64
        width = op(
            "Slice",
            [op("Shape", ["q"], "qshape"), const("w0", [-1], i64), const("w1", [2**62], i64)],
            "qwidth",
        )
        root = op("Sqrt", [op("Cast", [width], "qwidth_f", to=v.dtype)], "qroot")
        sq = op("Sqrt", [op("Div", [const("one", [1.0]), root], "qinv")], "sq")
        q = op("Mul", ["q", sq], "q_s")
        kt = op("Mul", [kt, sq], "kt_s")
    scores = op("MatMul", [q, kt], "qk")
    if v.scale_form == "scores":
        scores = op("Mul", [scores, const("sc", scale)], "qk_s")
    elif v.scale_form == "div":
        scores = op("Div", [scores, const("dv", math.sqrt(H))], "qk_s")
    if v.softcap:
        cap = const("cap", v.softcap)
        scores = op("Mul", [op("Tanh", [op("Div", [scores, cap], "d")], "t"), cap], "capped")
    if v.mask == "where":
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, [B, 1, S, T]))
        fmin = np.finfo(np_dtype).min
        bias = op("Where", ["keep", const("z", 0.0), const("mn", fmin)], "bias")
        scores = op("Add", [scores, bias], "scores")
    elif v.mask == "input":
        inputs.append(helper.make_tensor_value_info("bias", v.dtype, [B, 1, S, T]))
        scores = op("Add", [scores, "bias"], "scores")
    if v.fp16_softmax_casts:
        scores = op("Cast", [scores], "scores_f32", to=TensorProto.FLOAT)
    probs = op("Softmax", [scores], "probs", axis=v.softmax_axis)
    if v.fp16_softmax_casts:
        probs = op("Cast", [probs], "probs_t", to=v.dtype)
    if v.nan_guard:
        nan = op("IsNaN", [probs], "nan")
        probs = op("Where", [nan, const("z0", 0.0), probs], "safe")
    op("MatMul", [probs, "v"], "y")
    graph = helper.make_graph(
        nodes, "sdpa", inputs, [helper.make_tensor_value_info("y", v.dtype, None)], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if dtype == np.bool_:
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True  # no fully masked row
            feeds[vi.name] = keep
        elif vi.name == "bias":
            feeds[vi.name] = np.where(rng.random(shape) < 0.7, 0.0, -1e4).astype(dtype)
        else:
            feeds[vi.name] = (2 * rng.standard_normal(shape)).astype(dtype)
    return feeds


def _apply(model: onnx.ModelProto, dtype: str = "float32", ep: str = "cpu"):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)  # as the pass manager does before any rule runs
    ctx = RewriteContext(ir_model, get_ep(ep), dtype, OptimizeOptions())
    softmax = next(n for n in ir_model.graph if n.op_type == "Softmax")
    outcome = DecomposedAttentionToAttention().apply(softmax, ctx)
    return ir_model, outcome


def _attrs(proto: onnx.ModelProto) -> dict:
    node = next(n for n in proto.graph.node if n.op_type == "Attention")
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


FUSED = {
    "split-reshape": Variant(),
    "scores-perm": Variant(scale_form="scores", k_transpose="perm"),
    "div-scale": Variant(scale_form="div"),
    "shape-computed-scale": Variant(scale_form="shape", k_transpose="perm"),
    "unscaled-nomask": Variant(scale_form="none", mask="none"),
    "softcap": Variant(softcap=4.0),
    "mqa": Variant(kv_heads=1),
    "bias-input-unguarded": Variant(mask="input", nan_guard=False),
    "fp16-float-softmax": Variant(dtype=TensorProto.FLOAT16, fp16_softmax_casts=True),
}


@pytest.mark.parametrize("name", list(FUSED))
def test_fuses_and_computes_the_same(name):
    v = FUSED[name]
    original = _graph(v)
    dtype = "float16" if v.dtype == TensorProto.FLOAT16 else "float32"
    fused, outcome = _apply(original, dtype)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(fused)
    onnx.checker.check_model(proto, full_check=True)
    ops = [n.op_type for n in proto.graph.node]
    assert "Attention" in ops
    assert not {"Softmax", "MatMul", "IsNaN", "Tanh"} & set(ops)
    assert {o.domain: o.version for o in proto.opset_import}[""] == 23
    attrs = _attrs(proto)
    expected_scale = 1.0 if v.scale_form == "none" else 1 / math.sqrt(H)
    assert attrs["scale"] == pytest.approx(expected_scale, rel=1e-3 if dtype == "float16" else 1e-6)
    assert attrs.get("softcap", 0.0) == pytest.approx(v.softcap)
    if v.fp16_softmax_casts:
        assert attrs["softmax_precision"] == TensorProto.FLOAT
    feeds = _feeds(original)
    tol = tolerance_for(dtype)  # the project's tolerances, measured in tolerances.py
    np.testing.assert_allclose(
        run_unoptimized(proto, feeds).astype(np.float32),
        run_unoptimized(original, feeds).astype(np.float32),
        rtol=tol.rtol,
        atol=tol.atol,
    )


KEPT = {
    "softmax-not-last-axis": (Variant(softmax_axis=2), "softmax over axis 2"),
    "nan-guard-with-unproven-mask": (Variant(mask="input"), "NaN guard"),
}


@pytest.mark.parametrize("name", list(KEPT))
def test_refuses_without_proof(name):
    v, reason = KEPT[name]
    original = _graph(v)
    fused, outcome = _apply(original)
    assert isinstance(outcome, Kept) and reason in outcome.message
    proto = ir.to_proto(fused)
    assert [n.op_type for n in proto.graph.node] == [n.op_type for n in original.graph.node]
    assert proto.opset_import[0].version == 18  # nothing changed, not even the opset


def test_softcap_lifted_whatever_the_ep():
    """TensorRT-RTX takes a softcap in neither its Attention nor its GQA; the lift does not
    ask (canonical form is EP-independent): legalization expands it later if need be."""
    fused, outcome = _apply(_graph(Variant(softcap=4.0)), "float16", ep="trt-rtx")
    assert isinstance(outcome, Rewritten)
    attention = [n for n in fused.graph if n.op_type == "Attention"]
    assert len(attention) == 1 and attention[0].attributes["softcap"].value == 4.0


def test_wrong_transpose_is_not_attention():
    fused, outcome = _apply(_graph(Variant(k_transpose="wrong_perm")))
    assert isinstance(outcome, Kept) and "last two axes" in outcome.message
    assert not any(n.op_type == "Attention" for n in fused.graph)


def test_refuses_when_the_opset_cannot_be_raised():
    """A GroupNormalization (changed meaning in opset 21) blocks the opset-23 op."""
    model = _graph(Variant())
    model.graph.input.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [1, 2, 4]))
    model.graph.initializer.extend(
        [
            numpy_helper.from_array(np.ones(2, np.float32), "gs"),
            numpy_helper.from_array(np.zeros(2, np.float32), "gb"),
        ]
    )
    model.graph.node.append(
        helper.make_node("GroupNormalization", ["g", "gs", "gb"], ["gn"], num_groups=2)
    )
    model.graph.output.append(helper.make_tensor_value_info("gn", TensorProto.FLOAT, None))
    fused, outcome = _apply(model)
    assert isinstance(outcome, Kept) and "GroupNormalization" in outcome.message
    assert fused.opset_imports[""] == 18
    assert not any(n.op_type == "Attention" for n in fused.graph)


BUILDER = {
    "full": DecoderConfig(style="torch18"),
    "scores-perm": DecoderConfig(style="torch18", scale_form="scores", k_transpose="perm"),
    "softcap-mqa": DecoderConfig(style="torch18", kv_heads=1, softcap=3.0),
    "partial": DecoderConfig(style="torch18", head_dim=32, rotary_dim=16),
    "window": DecoderConfig(style="torch18", sliding_window=4),
    # transformers 4.x's mask slice to the repeated key's length: each later layer's mask reads
    # the earlier layers' outputs by shape (cut at the key's inferred shape)
    "mask-slice": DecoderConfig(style="torch18", mask_slice=True, layers=3),
    "mha": DecoderConfig(style="torch18", kv_heads=4, layers=1),
    "interleaved": DecoderConfig(style="torch18", interleaved=True),
    "partial-interleaved": DecoderConfig(
        style="torch18", head_dim=32, rotary_dim=16, interleaved=True
    ),
}


@pytest.mark.parametrize("name", list(BUILDER))
def test_builder_decoder_fuses_to_gqa(name):
    """The opset-18 builder decoder: every layer becomes GQA with fused rotary on CPU."""
    cfg = BUILDER[name]
    original = build_decoder(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert [layer.result for layer in report.layers] == ["GroupQueryAttention(do_rotary=1)"] * (
        cfg.layers
    )
    ops = {n.op_type for n in optimized.graph.node}
    assert not ops & {"Softmax", "Cos", "Sin", "Neg", "IsNaN", "Tanh", "Attention", "Pow"}
    for node in optimized.graph.node:
        if node.op_type == "GroupQueryAttention":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["rotary_interleaved"] == int(cfg.interleaved)
    kwargs = {"prompt_len": 9, "decode_past_len": 7} if cfg.sliding_window else {}
    assert_equivalent(original, optimized, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_builder_decoder_default_ep_is_standard_onnx(dtype):
    original = build_decoder(DecoderConfig(style="torch18", dtype=dtype, softcap=5.0))
    optimized = epfuse.optimize(original, "default")
    ops = [n.op_type for n in optimized.graph.node]
    assert ops.count("Attention") == 2 and ops.count("RotaryEmbedding") == 4
    assert ops.count("RMSNormalization") == 5
    assert not {"Softmax", "Cos", "Sin", "Neg", "Pow"} & set(ops)
    assert all(n.domain in ("", "ai.onnx") for n in optimized.graph.node)
    assert_equivalent(original, optimized)


def test_dml_gets_the_lifted_graph():
    """DML has GQA and the contrib RotaryEmbedding / SimplifiedLayerNormalization but no ONNX
    RotaryEmbedding or RMSNormalization: the opset-18 export is lifted all the same, then
    lowered and legalized: no Neg/ReduceMean left, four contrib RoPEs (2 layers x Q, K)."""
    original = build_decoder(DecoderConfig(style="torch18"))
    for ep in ("dml", "webgpu"):
        optimized, report = epfuse.optimize_with_report(original, ep, precision="fp32")
        assert [layer.result for layer in report.layers] == ["GroupQueryAttention(do_rotary=0)"] * 2
        ops = [f"{n.domain}::{n.op_type}" for n in optimized.graph.node]
        assert not {"::Neg", "::ReduceMean", "::Pow", "::Softmax"} & set(ops)
        assert ops.count("com.microsoft::RotaryEmbedding") == 4
        assert not check(optimized, epfuse.get_ep(ep), "float32").violations
        assert_equivalent(original, optimized)


def test_ep_that_fuses_nothing_still_gets_a_model():
    """TensorRT-RTX fp16 cannot express a softcap layer: the model comes back with the layer
    expanded to primitives (runnable there), every layer's reason in the report; strict mode
    refuses it."""
    original = build_decoder(DecoderConfig(style="torch18", dtype="float16", softcap=5.0))
    optimized, report = epfuse.optimize_with_report(original, "trt-rtx")
    assert report.fused_layers == 0 and len(report.layers) == 2
    for layer in report.layers:
        assert layer.result == "Attention expanded to primitive ops" and layer.runs_on_ep
        assert any("softcap" in r for r in layer.reasons), layer.reasons
    assert not check(optimized, epfuse.get_ep("trt-rtx"), "float16").violations
    assert_equivalent(original, optimized)
    with pytest.raises(epfuse.UnsupportedModelError, match="require_fusion: 2 of 2"):
        epfuse.optimize(original, "trt-rtx", require_fusion=True)
