"""SkipSimplifiedLayerNormalization -> Add + RMSNormalization for records without the contrib
op: equal to the contrib kernel on ORT CPU (output and residual sum, with and without bias,
fp32 and fp16), kept where the statistics outputs are read, a no-op where the record has it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.legalize.skip_norm import SkipSimplifiedToAddRMSNorm
from epfuse.patterns.reasons import ReasonCode
from epfuse.tolerances import tolerance_for

RNG = np.random.default_rng(0)
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
RULE = SkipSimplifiedToAddRMSNorm()


def _model(elem, bias: bool, outputs=("y", "", "", "sum"), epsilon=None):
    H = 16
    inputs = [
        helper.make_tensor_value_info("x", elem, [2, 3, H]),
        helper.make_tensor_value_info("skip", elem, [2, 3, H]),
    ]
    gamma = helper.make_tensor(
        "gamma", elem, [H], RNG.standard_normal(H).astype(_NP[elem]).tobytes(), raw=True
    )
    inits = [gamma]
    names = ["x", "skip", "gamma"]
    if bias:
        inits.append(
            helper.make_tensor(
                "bias", elem, [H], RNG.standard_normal(H).astype(_NP[elem]).tobytes(), raw=True
            )
        )
        names.append("bias")
    attrs = {} if epsilon is None else {"epsilon": epsilon}
    node = helper.make_node(
        "SkipSimplifiedLayerNormalization", names, list(outputs), domain="com.microsoft", **attrs
    )
    outs = [
        helper.make_tensor_value_info(o, elem, [2, 3, H])
        if o in ("y", "sum")
        else helper.make_tensor_value_info(o, TensorProto.FLOAT, [2, 3, 1])
        for o in outputs
        if o
    ]
    graph = helper.make_graph([node], "g", inputs, outs, initializer=inits)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def _apply(model, ep="default", dtype="float32"):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, get_ep(ep), dtype, OptimizeOptions())
    node = next(n for n in ir_model.graph if n.op_type == RULE.anchor[1])
    return RULE.apply(node, ctx), ir.to_proto(ir_model)


def _run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("epsilon", [None, 1e-6])
def test_equals_the_contrib_kernel(elem, bias, epsilon):
    dtype = "float32" if elem == TensorProto.FLOAT else "float16"
    model = _model(elem, bias, epsilon=epsilon)
    outcome, legal = _apply(model, dtype=dtype)
    assert isinstance(outcome, Rewritten), outcome
    ops = sorted(n.op_type for n in legal.graph.node)
    assert ops == sorted(["Add", "RMSNormalization"] + (["Add"] if bias else []))
    onnx.checker.check_model(legal)
    # Scale like a residual stream, so epsilon matters little but the sum is non-trivial.
    feeds = {k: (RNG.standard_normal((2, 3, 16)) * 3).astype(_NP[elem]) for k in ("x", "skip")}
    tol = tolerance_for(dtype)
    for want, got in zip(_run(model, feeds), _run(legal, feeds), strict=True):
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tol.rtol, atol=tol.atol
        )


def test_kept_when_statistics_are_read():
    outcome, _ = _apply(_model(TensorProto.FLOAT, False, outputs=("y", "", "inv", "sum")))
    assert isinstance(outcome, Kept) and outcome.code is ReasonCode.OUTPUTS_USED


def test_no_op_where_the_record_has_it():
    outcome, _ = _apply(_model(TensorProto.FLOAT, False), ep="cpu")
    assert outcome is None


def test_retargeted_cuda_fp32_model_runs_on_default(example_model):
    """cuda fp32 keeps standard Attention but fuses SkipSimplifiedLayerNormalization; re-
    targeted to default, the contrib op becomes Add + RMSNormalization and the model conforms."""
    cuda = epfuse.optimize(onnx.load(str(example_model)), "cuda", precision="fp32")
    assert any(n.op_type == "SkipSimplifiedLayerNormalization" for n in cuda.graph.node)
    out, report = epfuse.optimize_with_report(cuda, "default")
    assert all(n.domain in ("", "ai.onnx") for n in out.graph.node)
    assert not report.violations and all(layer.runs_on_ep for layer in report.layers)
    original = onnx.load(str(example_model))
    from epfuse.optimizer.verify import compare_models

    assert compare_models(original, out).passed
