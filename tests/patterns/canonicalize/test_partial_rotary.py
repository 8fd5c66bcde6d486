"""Partial rotary (Slice / RotaryEmbedding / Concat) -> one RotaryEmbedding with
rotary_embedding_dim, checked on ORT CPU against the sliced original."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from rope_models import rotary_feeds

from epfuse.capabilities import get_ep
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.partial_rotary import PartialRotaryToRotaryDim
from epfuse.patterns.reasons import ReasonCode

B, N, S, H = 2, 3, 4, 16


def _graph(rotary=8, tail_start=None, tail_end=2**62, interleaved=0, axis=-1):
    tail_start = rotary if tail_start is None else tail_start
    ints = lambda name, v: helper.make_tensor(name, TensorProto.INT64, [1], [v])  # noqa: E731
    inits = [ints("zero", 0), ints("r", rotary), ints("t0", tail_start), ints("end", tail_end)]
    inits.append(ints("axis", axis))
    nodes = [
        helper.make_node("Slice", ["x", "zero", "r", "axis"], ["head"]),
        helper.make_node("Slice", ["x", "t0", "end", "axis"], ["tail"]),
        helper.make_node(
            "RotaryEmbedding", ["head", "cos", "sin"], ["rot"], interleaved=interleaved
        ),
        helper.make_node("Concat", ["rot", "tail"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "partial",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [B, N, S, H]),
            helper.make_tensor_value_info("cos", TensorProto.FLOAT, [B, S, rotary // 2]),
            helper.make_tensor_value_info("sin", TensorProto.FLOAT, [B, S, rotary // 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [B, N, S, H])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _apply(proto):
    model = ir.from_proto(proto)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    concat = next(n for n in model.graph if n.op_type == "Concat")
    return model, PartialRotaryToRotaryDim().apply(concat, ctx)


def _run(proto, rotary):
    rng = np.random.default_rng(1)
    feeds = rotary_feeds(rng, (B, N, S, H), rotary)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary", [4, 8])
def test_partial_rotary_becomes_rotary_dim_and_stays_equal(rotary, interleaved):
    proto = _graph(rotary=rotary, interleaved=interleaved)
    model, outcome = _apply(proto)
    assert isinstance(outcome, Rewritten), outcome
    model.graph.sort()
    out = ir.to_proto(model)
    onnx.checker.check_model(out)
    (rope,) = [n for n in model.graph if n.op_type == "RotaryEmbedding"]
    assert rope.attributes["rotary_embedding_dim"].value == rotary
    assert rope.attributes["interleaved"].value == interleaved
    assert rope.inputs[0].name == "x"
    np.testing.assert_allclose(_run(out, rotary), _run(proto, rotary), atol=1e-6)


def test_gap_between_slices_is_kept():
    _, outcome = _apply(_graph(rotary=8, tail_start=10))
    assert isinstance(outcome, Kept) and outcome.code is ReasonCode.FORM


def test_tail_stopping_short_of_the_head_end_is_kept():
    _, outcome = _apply(_graph(rotary=8, tail_end=14))
    assert isinstance(outcome, Kept)


def test_slice_on_another_axis_is_kept():
    _, outcome = _apply(_graph(rotary=2, axis=1))
    assert isinstance(outcome, Kept) and "last-axis" in outcome.message
