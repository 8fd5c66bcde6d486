"""fp16/bf16 conversion: the converted dtype's record decides the lowering (cuda fp32 export ->
fp16 GroupQueryAttention), the fused fp16 model equals the unfused fp16 model, and what stays
float32 does."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder, inv_freq

import epfuse
from epfuse.capabilities import get_ep
from epfuse.capabilities.conformance import check
from epfuse.errors import VerificationError
from epfuse.optimizer.precision.fp16 import convert_float
from epfuse.optimizer.verify import assert_equivalent
from epfuse.tolerances import drift_bound

FP16 = onnx.TensorProto.FLOAT16


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _float_io(model):
    values = [*model.graph.input, *model.graph.output]
    return {v.name: v.type.tensor_type.elem_type for v in values if v.name != "input_ids"}


@pytest.fixture(scope="module")
def fp32_model():
    return build_decoder(DecoderConfig(layers=2, heads=4, kv_heads=2, head_dim=16))


def test_cuda_auto_on_fp32_export_is_fp16_gqa_and_verified(fp32_model):
    optimized, report = epfuse.optimize_with_report(fp32_model, "cuda", verify=True)
    assert report.dtype == "float16"
    assert report.precision["chosen"] == "float16"
    assert "prefers float16" in report.precision["reason"]
    assert report.fused_layers == len(report.layers) == 2
    assert _ops(optimized).count("GroupQueryAttention") == 2
    assert "reference: the unfused model at float16" in report.verification
    drift = report.precision["drift"]
    assert drift["within_expected"], drift["summary"]
    assert drift["top1_agreement"] >= drift_bound("float16").top1_agreement
    # past/present and logits in the compute dtype; token inputs untouched
    io = _float_io(optimized)
    assert io["logits"] == FP16
    assert all(io[n] == FP16 for n in io if "past" in n or "present" in n)
    assert "precision: float16 (auto: cuda prefers float16" in report.summary()
    assert not check(optimized, get_ep("cuda"), "float16").violations


def test_explicit_fp32_keeps_todays_cuda_graph(fp32_model):
    optimized, report = epfuse.optimize_with_report(fp32_model, "cuda", precision="fp32")
    assert report.dtype == "float32" and report.fused_layers == 0
    assert "GroupQueryAttention" not in _ops(optimized)
    assert "Attention" in _ops(optimized)


def test_cpu_fp16_rope_caches_rounded_once_from_float64():
    cfg = DecoderConfig(layers=1, heads=4, kv_heads=2, head_dim=16)
    optimized, report = epfuse.optimize_with_report(build_decoder(cfg), "cpu", precision="fp16")
    assert "rounded once from float64" in report.precision["conversion"]
    gqa = next(n for n in optimized.graph.node if n.op_type == "GroupQueryAttention")
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in optimized.graph.initializer}
    cos = inits[gqa.input[7]]
    # the graph's inv_freq is a float32 constant; the cache is built from it in float64
    freq = inv_freq(cfg).astype(np.float32).astype(np.float64)
    angles = np.arange(cos.shape[0], dtype=np.float64)[:, None] * freq
    assert cos.dtype == np.float16
    np.testing.assert_array_equal(cos, np.cos(angles).astype(np.float16))


def test_kept_attention_gets_fp32_softmax_and_norms_keep_fp32_statistics(fp32_model):
    # skip_layers keeps both layers as standard Attention in the converted graph
    optimized = epfuse.optimize(fp32_model, "cpu", precision="fp16", skip_layers={0, 1})
    attention = [n for n in optimized.graph.node if n.op_type == "Attention"]
    assert len(attention) == 2
    for node in attention:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["softmax_precision"] == onnx.TensorProto.FLOAT
    for node in optimized.graph.node:
        if node.op_type in ("RMSNormalization", "SimplifiedLayerNormalization"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs.get("stash_type", 1) == 1


def test_bf16_structure_checked_verify_refused(fp32_model):
    optimized, report = epfuse.optimize_with_report(fp32_model, "cuda", precision="bf16")
    assert report.dtype == "bfloat16" and report.fused_layers == 2
    assert not check(optimized, get_ep("cuda"), "bfloat16").violations
    io = _float_io(optimized)
    assert set(io.values()) <= {onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT64}
    with pytest.raises(VerificationError, match="no bfloat16 MatMul"):
        epfuse.optimize(fp32_model, "cuda", precision="bf16", verify=True)


def test_blocked_op_stays_fp32_behind_casts():
    # Min is in ORT's converter's DEFAULT_OP_BLOCK_LIST: it stays float32 behind Casts.
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([3]))
    big = ir.Value(name="c", const_value=ir.tensor(np.array([1e6, 1.5, 0.5], np.float32)))
    big.dtype, big.shape = ir.DataType.FLOAT, ir.Shape([3])
    minimum = ir.node("Min", [x, big], name="min")
    out = ir.node("Mul", [minimum.outputs[0], x], name="mul")
    out.outputs[0].name = "y"
    graph = ir.Graph(
        [x], out.outputs, nodes=[minimum, out], initializers=[big], opset_imports={"": 18}
    )
    model = ir.Model(graph, ir_version=10)
    for n in graph:
        n.outputs[0].dtype = ir.DataType.FLOAT
    summary = convert_float(model, "float16")
    assert summary.blocked_nodes == ["min"]
    assert big.const_value.dtype == ir.DataType.FLOAT  # read only by the fp32 node: exact
    proto = ir.to_proto(model)
    assert [n.op_type for n in proto.graph.node].count("Cast") == 2
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = np.array([2.0, 3.0, 4.0], np.float16)
    (got,) = session.run(None, {"x": feed})
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, np.minimum(feed, [1e6, 1.5, 0.5]) * feed, rtol=1e-3)


def test_fp16_conversion_of_a_fused_cpu_model_is_equal_to_the_unfused_fp16(fp32_model):
    # the same claim the API's verify makes, done by hand with the public pieces
    fused, report = epfuse.optimize_with_report(fp32_model, "cpu", precision="fp16")
    unfused = epfuse.optimize(fp32_model, "cpu", precision="fp16", skip_layers={0, 1})
    assert report.fused_layers == 2
    assert_equivalent(unfused, fused, prompt_len=9)


def test_convert_array_clamps_to_fp16_range_and_takes_scalars():
    from epfuse.optimizer.precision.fp16 import convert_array

    got = convert_array(np.array([np.finfo(np.float32).min, 1e-9, 3.0], np.float32), "float16")
    assert got.dtype == np.float16 and got[0] == -65504 and got[1] > 0 and got[2] == 3
    scalar = convert_array(np.float32(-1e30), "float16")
    assert scalar.shape == () and scalar == -65504
    assert convert_array(np.float32(-1e30), "bfloat16").shape == ()
