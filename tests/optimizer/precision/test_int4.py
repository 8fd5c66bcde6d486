"""int4 weights through onnxruntime's MatMulNBitsQuantizer: after lowering (packed QKV is one
weight), options as the genai builder's CPU defaults, fused == unfused at the same int4
weights, drift from float32 reported."""

import numpy as np
import onnx
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.io import save_model
from epfuse.optimizer.precision import Int4Options
from epfuse.optimizer.verify import compare_models
from epfuse.tolerances import tolerance_for

CFG = DecoderConfig(layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=64, vocab=256)


def _nodes(model, op):
    return [n for n in model.graph.node if n.op_type == op]


def _attrs(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


@pytest.fixture(scope="module")
def fp32_model():
    return build_decoder(CFG)


def test_cpu_int4_defaults_packed_qkv_one_weight_and_verified(fp32_model):
    optimized, report = epfuse.optimize_with_report(
        fp32_model, "cpu", precision="int4", verify=True
    )
    assert report.dtype == "float32" and report.precision["chosen"] == "int4"
    assert report.fused_layers == 2
    assert not _nodes(optimized, "MatMul")  # every MatMul weight quantized (lm_head too)
    nbits = _nodes(optimized, "MatMulNBits")
    hidden = CFG.heads * CFG.head_dim
    qkv = (CFG.heads + 2 * CFG.kv_heads) * CFG.head_dim
    # per layer: packed QKV, o_proj, gate, up, down; plus lm_head
    assert len(nbits) == 5 * CFG.layers + 1
    assert sum(_attrs(n)["N"] == qkv and _attrs(n)["K"] == hidden for n in nbits) == CFG.layers
    for node in nbits:
        attrs = _attrs(node)
        assert (attrs["bits"], attrs["block_size"], attrs["accuracy_level"]) == (4, 32, 4)
        assert len(node.input) == 3  # symmetric: no zero points
    gqa = _nodes(optimized, "GroupQueryAttention")
    assert all(not g.input[1] and not g.input[2] for g in gqa)  # packed QKV input
    assert "reference: the unfused model at int4" in report.verification
    assert report.precision["drift"]["rows"] > 0
    assert "quantization" in report.precision


def test_int4_options(fp32_model):
    options = Int4Options(block_size=16, symmetric=False, accuracy_level=0, lm_head=False)
    optimized, report = epfuse.optimize_with_report(
        fp32_model, "cpu", precision="int4", int4=options
    )
    matmuls = _nodes(optimized, "MatMul")
    assert len(matmuls) == 1 and matmuls[0].output[0] == "logits"  # lm_head kept
    for node in _nodes(optimized, "MatMulNBits"):
        attrs = _attrs(node)
        assert attrs["block_size"] == 16 and "accuracy_level" not in attrs
        assert len(node.input) == 4  # asymmetric: zero points
    assert "lm_head kept" in report.precision["quantization"]
    embedded = epfuse.optimize(
        fp32_model, "cpu", precision="int4", int4=Int4Options(embeddings=True)
    )
    assert len(_nodes(embedded, "GatherBlockQuantized")) == 1


def test_fused_int4_equals_unfused_int4_and_drift_is_bounded(fp32_model):
    fused = epfuse.optimize(fp32_model, "cpu", precision="int4")
    unfused = epfuse.optimize(fp32_model, "cpu", precision="int4", skip_layers={0, 1})
    assert not _nodes(unfused, "GroupQueryAttention")
    result = compare_models(unfused, fused, tolerance=tolerance_for("float32", "int4-int8-compute"))
    assert result.passed, str(result)
    # and the int4 weights are far from float32: the same comparison at fp32 tolerance fails
    # against the float32 original (quantization really happened)
    assert not compare_models(fp32_model, fused).passed


def test_external_data_input_quantizes_and_saves(tmp_path, fp32_model):
    source = tmp_path / "in.onnx"
    copy = onnx.ModelProto()
    copy.CopyFrom(fp32_model)  # onnx.save moves the weights of the proto it saves out
    onnx.save(copy, source, save_as_external_data=True, location="in.onnx.data")
    optimized = epfuse.optimize(source, "cpu", precision="int4")
    out = tmp_path / "out" / "m.onnx"
    save_model(optimized, out)
    assert (tmp_path / "out" / "m.onnx.data").exists()
    loaded = onnx.load(str(out))
    assert len(_nodes(loaded, "MatMulNBits")) == 5 * CFG.layers + 1
    direct = epfuse.optimize(fp32_model, "cpu", precision="int4")
    a = {t.name: onnx.numpy_helper.to_array(t) for t in loaded.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in direct.graph.initializer}
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_float_compute_int4_fused_equals_unfused_at_the_fp32_tolerance(fp32_model):
    """Same int4 weights, MatMulNBits in fp32 (accuracy level 0): the rewrite is exact to the
    float32 tolerance; the check verify=True adds for accuracy level 4."""
    options = Int4Options(accuracy_level=0)
    fused = epfuse.optimize(fp32_model, "cpu", precision="int4", int4=options)
    unfused = epfuse.optimize(fp32_model, "cpu", precision="int4", int4=options, skip_layers={0, 1})
    result = compare_models(unfused, fused)
    assert result.tolerance == tolerance_for("float32")
    assert result.passed, str(result)


@pytest.mark.parametrize("symmetric", [True, False])
def test_column_chunks_quantize_to_the_whole_weights_numbers(symmetric):
    """Large weights are quantized a block of columns at a time (peak memory); the stacked
    result is byte for byte what ORT's quantizer makes of the whole weight."""
    import onnx_ir as ir

    from epfuse.optimizer.precision import int4

    rng = np.random.default_rng(0)
    k, n = 96, 200
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["s", k]))
    w = ir.Value(name="w", const_value=ir.tensor(rng.standard_normal((k, n)).astype(np.float32)))
    w.dtype, w.shape = ir.DataType.FLOAT, ir.Shape([k, n])
    node = ir.node("MatMul", [x, w], name="mm")
    node.outputs[0].name, node.outputs[0].dtype = "y", ir.DataType.FLOAT
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 21})
    model = ir.Model(graph, ir_version=10)
    options = Int4Options(symmetric=symmetric)
    whole = int4._run_quantizer(int4._single_node_model(model, node, 1), options, ("MatMul",))
    chunk = k * 4 * 48  # 48 columns per chunk: 5 chunks, the last one short
    nodes, inits = int4._chunked_matmul(model, node, options, chunk)
    (expected,) = whole.node
    assert [a for a in nodes[0].attribute] == [a for a in expected.attribute]
    want = {t.name: onnx.numpy_helper.to_array(t) for t in whole.initializer}
    got = {t.name: onnx.numpy_helper.to_array(t) for t in inits}
    assert want.keys() == got.keys() and len(want) == (2 if symmetric else 3)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])
