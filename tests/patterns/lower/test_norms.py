"""Norm fusions per EP: exact counts, residual sum from output 3, equivalence on ORT CPU."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import TensorProto, helper

import epfuse
from epfuse.errors import ValidationError
from epfuse.optimizer.validate import validate
from epfuse.optimizer.verify import assert_equivalent


def _ops(model: onnx.ModelProto) -> Counter:
    return Counter(f"{n.domain + '::' if n.domain else ''}{n.op_type}" for n in model.graph.node)


# A 2-layer decoder has 5 RMSNorms: 1 on the embeddings (no residual Add before it) and 4
# after residual Adds (post-attention of both layers, input norm of layer 1, final norm).
@pytest.mark.parametrize(
    ("ep", "skip", "simplified", "rms"),
    [
        ("cpu", 4, 0, 1),
        ("cuda", 4, 0, 1),
        ("dml", 4, 1, 0),
        ("webgpu", 4, 1, 0),
        ("default", 0, 0, 5),
        # No norm op in the record: RMSNormalization is legalized to its function body.
        ("openvino", 0, 0, 0),
        ("coreml", 0, 0, 0),
        ("qnn", 0, 0, 0),
    ],
)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rms_norm_fusion_counts_and_equivalence(ep, skip, simplified, rms, dtype):
    original = build_decoder(DecoderConfig(style="mobius", dtype=dtype))
    optimized = epfuse.optimize(original, ep, precision=dtype)
    ops = _ops(optimized)
    assert ops["com.microsoft::SkipSimplifiedLayerNormalization"] == skip
    assert ops["SimplifiedLayerNormalization"] == simplified
    assert ops["RMSNormalization"] == rms
    if rms or skip or simplified:
        assert ops["Add"] == (4 - skip)  # every residual Add is absorbed by a fusion
    else:
        assert ops["ReduceMean"] == 5  # the expanded norms
    for node in optimized.graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            eps = {a.name: a.f for a in node.attribute}["epsilon"]
            assert eps == pytest.approx(1e-6)  # carried, not the contrib default 1e-12
    assert_equivalent(original, optimized)


def test_residual_sum_comes_from_output_3():
    optimized = epfuse.optimize(build_decoder(DecoderConfig(style="mobius", layers=2)), "cpu")
    skips = [n for n in optimized.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
    consumed = {name for n in optimized.graph.node for name in n.input}
    # The sums of the first three feed the next residual step; the final norm's sum is dead.
    assert [s.output[3] in consumed for s in skips] == [True, True, True, False]
    assert all(len(s.output) < 2 or s.output[1] not in consumed for s in skips)


def _layer_norm_model(broadcast_skip: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    d = 16
    inits = [
        helper.make_tensor("g", TensorProto.FLOAT, [d], rng.standard_normal(d).tolist()),
        helper.make_tensor("b", TensorProto.FLOAT, [d], rng.standard_normal(d).tolist()),
    ]
    skip_shape = [1, 1, d] if broadcast_skip else ["batch", "seq", d]
    nodes = [
        helper.make_node("Add", ["x", "y"], ["s"]),
        helper.make_node("LayerNormalization", ["s", "g", "b"], ["n"], axis=-1, epsilon=1e-5),
        helper.make_node("Mul", ["n", "s"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "ln",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, skip_shape),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", d])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(model: onnx.ModelProto, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]


def test_skip_layer_norm_fusion_is_exact_on_cpu():
    import onnx_ir as ir

    from epfuse.capabilities import get_ep
    from epfuse.optimizer.manager import PassManager
    from epfuse.patterns import OptimizeOptions

    original = _layer_norm_model()
    model = ir.serde.deserialize_model(original)
    PassManager().run(model, get_ep("cpu"), "float32", OptimizeOptions())
    fused = ir.to_proto(model)
    assert _ops(fused) == Counter({"com.microsoft::SkipLayerNormalization": 1, "Mul": 1})
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal((2, 3, 16)).astype(np.float32) for k in ("x", "y")}
    np.testing.assert_allclose(_run(fused, feeds), _run(original, feeds), atol=1e-5, rtol=1e-5)


def test_broadcast_residual_is_not_fused():
    import onnx_ir as ir

    from epfuse.capabilities import get_ep
    from epfuse.optimizer.manager import PassManager
    from epfuse.patterns import OptimizeOptions

    model = ir.serde.deserialize_model(_layer_norm_model(broadcast_skip=True))
    report = PassManager().run(model, get_ep("cpu"), "float32", OptimizeOptions())
    assert _ops(ir.to_proto(model))["LayerNormalization"] == 1
    rule = next(r for r in report.rules if r.name == "skip-layer-norm")
    assert rule.kept == 1 and rule.rewritten == 0


def test_simplified_layer_norm_back_to_rms_norm_for_default():
    # Take the DML output (SimplifiedLayerNormalization) and retarget it to portable ONNX.
    original = build_decoder(DecoderConfig(style="mobius"))
    dml = epfuse.optimize(original, "dml", precision="fp32")
    assert _ops(dml)["SimplifiedLayerNormalization"] == 1
    import onnx_ir as ir

    from epfuse.capabilities import get_ep
    from epfuse.optimizer.manager import PassManager
    from epfuse.patterns import OptimizeOptions

    model = ir.serde.deserialize_model(dml)
    PassManager().run(model, get_ep("default"), "float32", OptimizeOptions())
    back = ir.to_proto(model)
    assert _ops(back)["SimplifiedLayerNormalization"] == 0
    # default lacks the contrib SkipSimplifiedLayerNormalization too: legalized to
    # Add + RMSNormalization (legalize/skip_norm), so every norm is an RMSNormalization.
    skips = _ops(dml)["com.microsoft::SkipSimplifiedLayerNormalization"]
    assert _ops(back)["com.microsoft::SkipSimplifiedLayerNormalization"] == 0
    assert skips == 4 and _ops(back)["RMSNormalization"] == 1 + skips
    assert_equivalent(original, back)


def test_validate_checks_ort_internal_ops_against_ort_schema():
    import onnx_ir as ir

    dml = epfuse.optimize(build_decoder(DecoderConfig(style="mobius")), "dml", precision="fp32")
    assert validate(ir.serde.deserialize_model(dml)) is None  # passes onnx.checker + ORT load
    for node in dml.graph.node:
        if node.op_type == "SimplifiedLayerNormalization":
            node.attribute.append(helper.make_attribute("bogus", 1))
    with pytest.raises(ValidationError, match="unknown attributes"):
        validate(ir.serde.deserialize_model(dml))
