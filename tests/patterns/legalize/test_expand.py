"""ONNX Attention / RotaryEmbedding / RMSNormalization -> their ONNX function bodies, for EPs
whose record lacks the op: known answers on ORT CPU (the op's kernel vs the expansion) over
the forms the pipeline produces, and the rule's no-op where the record takes the op."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from rope_models import B, H, N, S, rope_model

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.legalize.expand import (
    ExpandAttention,
    ExpandRMSNormalization,
    ExpandRotaryEmbedding,
)
from epfuse.tolerances import tolerance_for

RNG = np.random.default_rng(0)
_NP = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def _model(node, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph([node], "one", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(model: onnx.ModelProto, feeds) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _expand(model: onnx.ModelProto, rule, ep: str, dtype: str):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, get_ep(ep), dtype, OptimizeOptions())
    node = next(n for n in ir_model.graph if n.op_type == rule.anchor[1])
    outcome = rule.apply(node, ctx)
    return outcome, ir.to_proto(ir_model)


def _check(model, feeds, rule, dtype, ep="coreml"):
    outcome, expanded = _expand(model, rule, ep, dtype)
    assert isinstance(outcome, Rewritten), outcome
    assert rule.anchor[1] not in {n.op_type for n in expanded.graph.node}
    onnx.checker.check_model(expanded)
    tol = tolerance_for(dtype)
    for want, got in zip(_run(model, feeds), _run(expanded, feeds), strict=True):
        assert want.shape == got.shape
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tol.rtol, atol=tol.atol
        )
    return outcome


def _tensor(shape, elem):
    return RNG.standard_normal(shape).astype(_NP[elem])


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
@pytest.mark.parametrize(
    "form",
    ["bnsh-past-boolmask-softcap", "bsd-gqa-past-causal", "bsd-floatmask", "bnsh-nopast-causal"],
)
def test_attention_expansion_equals_the_kernel(form, elem):
    dtype = "float32" if elem == TensorProto.FLOAT else "float16"
    B, N, KV, S, P, H = 2, 4, 2, 3, 5, 8
    T = P + S
    attrs: dict = {"scale": 0.3}
    inputs, feeds = [], {}

    def add(name, shape, e=elem, value=None):
        inputs.append(helper.make_tensor_value_info(name, e, shape))
        feeds[name] = _tensor(shape, e) if value is None else value

    bsd = form.startswith("bsd")
    if bsd:
        attrs.update(q_num_heads=N, kv_num_heads=KV)
        add("q", [B, S, N * H])
        add("k", [B, S, KV * H])
        add("v", [B, S, KV * H])
    else:
        add("q", [B, N, S, H])
        add("k", [B, KV, S, H])
        add("v", [B, KV, S, H])
    names = ["q", "k", "v"]
    with_past = "past" in form
    if "boolmask" in form:
        mask = np.tril(np.ones((S, T), bool), P)[None, None].repeat(B, 0)
        mask[1, :, :, T - 2 :] = False  # a padded row
        mask[1, :, :, :2] = True
        add("mask", [B, 1, S, T], TensorProto.BOOL, mask)
        names.append("mask")
    elif "floatmask" in form:
        add(
            "mask",
            [B, 1, S, S],
            value=np.where(RNG.random((B, 1, S, S)) < 0.2, -1e4, 0).astype(_NP[elem]),
        )
        names.append("mask")
    else:
        names.append("")
    if "softcap" in form:
        attrs["softcap"] = 5.0
    if "causal" in form:
        attrs["is_causal"] = 1
    outputs = [helper.make_tensor_value_info("y", elem, None)]
    out_names = ["y"]
    if with_past:
        add("past_k", [B, KV, P, H])
        add("past_v", [B, KV, P, H])
        names += ["past_k", "past_v"]
        outputs += [helper.make_tensor_value_info(n, elem, None) for n in ("pk", "pv")]
        out_names += ["pk", "pv"]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node("Attention", names, out_names, **attrs)
    outcome = _check(_model(node, inputs, outputs), feeds, ExpandAttention(), dtype)
    assert outcome.fused is False and outcome.layer_result.endswith("primitive ops")


@pytest.mark.parametrize("layout", ["bnsh", "bsd"])
@pytest.mark.parametrize(("rotary", "interleaved"), [(16, 0), (8, 1), (8, 0)])
def test_rotary_expansion_equals_the_kernel(layout, rotary, interleaved):
    model = rope_model(layout, rotary, interleaved)
    x_shape = [B, N, S, H] if layout == "bnsh" else [B, S, N * H]
    feeds = {
        "x": _tensor(x_shape, TensorProto.FLOAT),
        "pos": np.array([[0, 1, 2, 3, 4], [7, 9, 11, 12, 30]], np.int64),
    }
    _check(model, feeds, ExpandRotaryEmbedding(), "float32", ep="qnn")


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_rms_norm_expansion_equals_the_kernel(elem):
    dtype = "float32" if elem == TensorProto.FLOAT else "float16"
    shape = [2, 3, 32]
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], epsilon=1e-6, axis=-1)
    model = _model(
        node,
        [helper.make_tensor_value_info("x", elem, shape)],
        [helper.make_tensor_value_info("y", elem, shape)],
        [onnx.numpy_helper.from_array(_tensor([32], elem), "w")],
    )
    _check(model, {"x": 3 * _tensor(shape, elem)}, ExpandRMSNormalization(), dtype, ep="qnn")


def test_nothing_to_do_where_the_record_takes_the_op():
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], epsilon=1e-6)
    model = _model(
        node,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [onnx.numpy_helper.from_array(np.ones(8, np.float32), "w")],
    )
    outcome, _ = _expand(model, ExpandRMSNormalization(), "cpu", "float32")
    assert outcome is None
