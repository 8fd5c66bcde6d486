"""kv_cache="int8": GroupQueryAttention past/present typed int8 with calibrated per-channel
scales (cpu's record has gqa.kv_cache_int8, probed), equal to the unfused float-cache model
within the kv-int8 tolerance at prompt and decode with a real past."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities.conformance import required_flags
from epfuse.errors import OptionError, UnsupportedModelError
from epfuse.optimizer.precision.kv_cache import HEADROOM, float_cache_boundary
from epfuse.optimizer.verify import compare_models
from epfuse.tolerances import tolerance_for

CFG = DecoderConfig(layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=256)


@pytest.fixture(scope="module")
def fp32_model():
    return build_decoder(CFG)


@pytest.fixture(scope="module")
def int8_model(fp32_model):
    return epfuse.optimize_with_report(fp32_model, "cpu", kv_cache="int8", verify=True)


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_cache_io_is_int8_with_per_channel_scales(int8_model):
    model, report = int8_model
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == CFG.layers
    for node in ir.serde.deserialize_model(model).graph:
        if node.op_type == "GroupQueryAttention":
            assert "gqa.kv_cache_int8" in required_flags(node)
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    for node in gqa:
        attrs = _attrs(node)
        assert attrs["k_quant_type"] == attrs["v_quant_type"] == b"PER_CHANNEL"
        assert attrs["kv_cache_bit_width"] == 8
        for scale in node.input[12:14]:
            assert inits[scale].shape == (CFG.kv_heads, 1, CFG.head_dim)
            assert inits[scale].dtype == np.float32 and (inits[scale] > 0).all()
        # do_rotary: both channels of a rotary pair share the scale (rotation-invariant)
        k_scale = inits[node.input[12]]
        half = CFG.head_dim // 2
        np.testing.assert_array_equal(k_scale[..., :half], k_scale[..., half:])
    int8 = onnx.TensorProto.INT8
    cache = [
        v
        for v in [*model.graph.input, *model.graph.output]
        if "past" in v.name or "present" in v.name
    ]
    assert len(cache) == 4 * CFG.layers
    assert all(v.type.tensor_type.elem_type == int8 for v in cache)
    assert "int8 KV cache on 2 layer(s)" in report.precision["kv_cache"]
    assert f"headroom {HEADROOM:g}" in report.summary()
    assert report.verification.startswith("passed")
    assert "kv-int8 tolerance" in report.verification


def test_equals_unfused_within_the_int8_tolerance_at_prompt_and_decode(fp32_model, int8_model):
    model, _ = int8_model
    unfused = epfuse.optimize(fp32_model, "cpu", skip_layers={0, 1})
    assert not [n for n in unfused.graph.node if n.op_type == "GroupQueryAttention"]
    result = compare_models(unfused, model, scenarios=["prompt", "decode"])
    assert result.tolerance == tolerance_for("float32", "kv-int8")
    assert result.passed, str(result)
    assert [s.name for s in result.scenarios if s.skipped is None] == ["prompt", "decode"]
    # the cache really is quantized: at the float32 tolerance the same comparison fails
    assert not compare_models(unfused, model, tolerance=tolerance_for("float32")).passed


def test_runs_on_ort_with_int8_past_and_a_quarter_of_the_bytes(int8_model):
    model, _ = int8_model
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = [i for i in session.get_inputs() if "past" in i.name]
    assert {i.type for i in past} == {"tensor(int8)"}
    feeds = {
        "input_ids": np.array([[1, 2, 3]], np.int64),
        "attention_mask": np.ones((1, 3), np.int64),
        "position_ids": np.arange(3, dtype=np.int64)[None],
    }
    feeds.update({i.name: np.zeros((1, CFG.kv_heads, 0, CFG.head_dim), np.int8) for i in past})
    outputs = session.run(None, feeds)
    presents = [
        o for o, meta in zip(outputs, session.get_outputs(), strict=True) if "present" in meta.name
    ]
    assert all(
        p.dtype == np.int8 and p.shape == (1, CFG.kv_heads, 3, CFG.head_dim) for p in presents
    )


def test_fp16_compute_with_int8_cache_verifies(fp32_model):
    model, report = epfuse.optimize_with_report(
        fp32_model, "cpu", precision="fp16", kv_cache="int8", verify=True
    )
    assert report.dtype == "float16"
    assert "reference: the unfused model at float16" in report.verification
    given = ir.serde.deserialize_model(model)
    bounded = float_cache_boundary(given)
    past = [v for v in bounded.graph.inputs if "past" in v.name]
    assert {v.dtype for v in past} == {ir.DataType.FLOAT16}
    # The copy is retyped, not the model it was made from (clones share type objects).
    assert {v.dtype for v in given.graph.inputs if "past" in v.name} == {ir.DataType.INT8}


def test_ep_without_the_flag_is_a_one_line_error(fp32_model):
    with pytest.raises(UnsupportedModelError) as err:
        epfuse.optimize(fp32_model, "cuda", kv_cache="int8")
    assert "kv_cache int8: cuda's record takes no int8 KV cache for float16" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedModelError, match="has no GroupQueryAttention"):
        epfuse.optimize(fp32_model, "default", kv_cache="int8")
    with pytest.raises(OptionError, match="unknown kv_cache 'int4'"):
        epfuse.optimize(fp32_model, "cpu", kv_cache="int4")


def test_default_cache_is_the_compute_dtype(fp32_model):
    model = epfuse.optimize(fp32_model, "cpu", kv_cache=None)
    past = [v for v in model.graph.input if "past" in v.name]
    assert {v.type.tensor_type.elem_type for v in past} == {onnx.TensorProto.FLOAT}
    converted = ir.serde.deserialize_model(model)
    assert float_cache_boundary(converted) is converted
