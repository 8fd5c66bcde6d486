"""Explicit softmax attention -> ONNX Attention, on hand-built chains checked on ORT CPU.

Each lifted graph must compute the same output as the chain it replaces (the chain is the
only reference: a wrong scale, softcap or mask order shows up as a numeric difference), and
chains in any other order, or with shared intermediates, must be left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from epfuse.capabilities import get_ep
from epfuse.patterns import OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.sdpa import DecomposedAttentionToAttention

B, N, S, T, H = 2, 4, 3, 5, 8


def _f(name, value):
    return helper.make_tensor(name, TensorProto.FLOAT, [], [value])


def _chain(scale=("Mul", 0.3), softcap=2.0, mask=True, order="standard", extra_use=False):
    """q (B,N,S,H) · k (B,N,T,H)ᵀ -> [scale] -> [softcap] -> [+mask] -> softmax -> · v."""
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
    ]
    inits = []
    x = "qk"

    def add_scale(x):
        if scale is None:
            return x
        op, s = scale
        inits.append(_f("s", s))
        nodes.append(helper.make_node(op, [x, "s"], ["scaled"]))
        return "scaled"

    def add_softcap(x):
        if softcap is None:
            return x
        inits.append(_f("cap", softcap))
        nodes.extend(
            [
                helper.make_node("Div", [x, "cap"], ["capd"]),
                helper.make_node("Tanh", ["capd"], ["tanh"]),
                helper.make_node("Mul", ["tanh", "cap"], ["capped"]),
            ]
        )
        return "capped"

    # "standard" is Attention's order; otherwise the scale comes after the softcap
    standard = order == "standard"
    x = add_softcap(add_scale(x)) if standard else add_scale(add_softcap(x))
    if mask:
        nodes.append(helper.make_node("Add", [x, "mask"], ["masked"]))
        x = "masked"
    nodes.append(helper.make_node("Softmax", [x], ["probs"], axis=-1))
    nodes.append(helper.make_node("MatMul", ["probs", "v"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, N, S, H])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("probs", TensorProto.FLOAT, None))
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [B, N, S, H]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [B, N, T, H]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, [B, N, T, H]),
    ]
    if mask:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, [B, 1, S, T]))
    graph = helper.make_graph(nodes, "chain", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _apply(proto: onnx.ModelProto):
    model = ir.from_proto(proto)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    softmax = next(n for n in model.graph if n.op_type == "Softmax")
    outcome = DecomposedAttentionToAttention().apply(softmax, ctx)
    return model, outcome


def _run(proto: onnx.ModelProto, feeds):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], {i.name: feeds[i.name] for i in sess.get_inputs()})[0]


def _feeds():
    rng = np.random.default_rng(0)
    mask = np.where(rng.random((B, 1, S, T)) < 0.3, -np.inf, 0.0).astype(np.float32)
    mask[..., 0] = 0.0  # every row sees at least one key
    return {
        "q": (rng.standard_normal((B, N, S, H)) * 2).astype(np.float32),
        "k": (rng.standard_normal((B, N, T, H)) * 2).astype(np.float32),
        "v": rng.standard_normal((B, N, T, H)).astype(np.float32),
        "mask": mask,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"scale": ("Div", 4.0)},
        {"scale": None},
        {"softcap": None},
        {"mask": False},
        {"scale": None, "softcap": None, "mask": False},
    ],
    ids=["mul-softcap-mask", "div-scale", "no-scale", "no-softcap", "no-mask", "bare"],
)
def test_lifted_chain_matches_the_original(kwargs):
    proto = _chain(**kwargs)
    model, outcome = _apply(proto)
    assert isinstance(outcome, Rewritten), outcome
    lifted = ir.to_proto(model)
    ops = [n.op_type for n in lifted.graph.node]
    assert ops == ["Attention"], ops
    attrs = {a.name: helper.get_attribute_value(a) for a in lifted.graph.node[0].attribute}
    scale = kwargs.get("scale", ("Mul", 0.3))
    expected_scale = 1.0 if scale is None else (scale[1] if scale[0] == "Mul" else 1 / scale[1])
    assert attrs["scale"] == pytest.approx(expected_scale)
    assert attrs.get("softcap", 0.0) == pytest.approx(kwargs.get("softcap", 2.0) or 0.0)
    feeds = _feeds()
    np.testing.assert_allclose(_run(lifted, feeds), _run(proto, feeds), atol=2e-6, rtol=1e-5)


def test_scale_after_softcap_is_not_lifted():
    proto = _chain(order="scale-after-softcap")
    model, outcome = _apply(proto)
    assert not isinstance(outcome, Rewritten)
    assert "Attention" not in {n.op_type for n in model.graph}


def test_shared_probabilities_are_not_lifted():
    model, outcome = _apply(_chain(extra_use=True))
    assert outcome is None
    assert "Attention" not in {n.op_type for n in model.graph}


def test_mismatched_softcap_constants_are_not_lifted():
    proto = _chain()
    # the Div reads a different constant than the Mul
    proto.graph.initializer.append(_f("cap2", 3.0))
    div = next(n for n in proto.graph.node if n.op_type == "Div")
    div.input[1] = "cap2"
    model, outcome = _apply(proto)
    assert not isinstance(outcome, Rewritten)  # c*tanh(x/c') with c != c' is no softcap
    assert "Attention" not in {n.op_type for n in model.graph}
