"""Half-width RoPE on Split halves (GPT-OSS) -> RotaryEmbedding: a small graph runs on ORT
before and after the rule; a swapped sign (not a rotation) is not matched."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from rope_models import rotary_feeds

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.split_rotary import SplitHalvesToRotaryEmbedding
from epfuse.tolerances import tolerance_for

B, N, S, D = 2, 3, 5, 16


def _graph(wrong_sign: bool = False) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Unsqueeze", ["cos", "one"], ["c"]),
        helper.make_node("Unsqueeze", ["sin", "one"], ["s"]),
        helper.make_node("Split", ["x"], ["x1", "x2"], axis=3, num_outputs=2),
        helper.make_node("Mul", ["x1", "c"], ["a"]),
        helper.make_node("Mul", ["x2", "s"], ["b"]),
        helper.make_node("Add" if wrong_sign else "Sub", ["a", "b"], ["first"]),
        helper.make_node("Mul", ["c", "x2"], ["p"]),  # operands in either order
        helper.make_node("Mul", ["x1", "s"], ["q"]),
        helper.make_node("Add", ["q", "p"], ["second"]),
        helper.make_node("Concat", ["first", "second"], ["y"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "rope",
        [
            helper.make_tensor_value_info("x", f, [B, N, S, D]),
            helper.make_tensor_value_info("cos", f, [B, S, D // 2]),
            helper.make_tensor_value_info("sin", f, [B, S, D // 2]),
        ],
        [helper.make_tensor_value_info("y", f, None)],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _apply(model):
    ir_model = ir.serde.deserialize_model(model)
    _infer_types(ir_model)
    ctx = RewriteContext(ir_model, get_ep("cpu"), "float32", OptimizeOptions())
    concat = next(n for n in ir_model.graph if n.op_type == "Concat")
    return ir_model, SplitHalvesToRotaryEmbedding().apply(concat, ctx)


def _run(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]


def test_split_halves_become_rotary_embedding():
    original = _graph()
    lifted, outcome = _apply(original)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(lifted)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["RotaryEmbedding"]
    rng = np.random.default_rng(0)
    feeds = rotary_feeds(rng, (B, N, S, D), D)
    tol = tolerance_for("float32")
    np.testing.assert_allclose(_run(proto, feeds), _run(original, feeds), **vars(tol))


@pytest.mark.parametrize("wrong_sign", [True])
def test_not_a_rotation_is_not_matched(wrong_sign):
    _, outcome = _apply(_graph(wrong_sign))
    assert outcome is None
