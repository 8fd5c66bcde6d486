"""Half-width RoPE on Split halves (GPT-OSS) -> RotaryEmbedding: a small graph runs on ORT
before and after the rule, with the halves from a Split or from the two Slices TorchScript
traces ``chunk`` to (bounds computed from Shape(x)); a swapped sign (not a rotation) and
slices that are not the halves are not matched."""

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


def _halves(form: str) -> list[onnx.NodeProto]:
    """x1, x2: a Split, or torch.chunk(x, 2, -1) traced by TorchScript: h = (D + 1) // 2
    from Shape(x), x1 = x[..., 0:h*1], x2 = x[..., h*1:h*2] ("off": x2 starts one early)."""
    if form == "split":
        return [helper.make_node("Split", ["x"], ["x1", "x2"], axis=3, num_outputs=2)]
    n = helper.make_node
    return [
        n("Shape", ["x"], ["shape"]),
        n("Gather", ["shape", "last"], ["width"], axis=0),
        n("Add", ["width", "one_s"], ["width1"]),
        n("Div", ["width1", "two_s"], ["h"]),  # 17 // 2: ONNX's integer Div truncates
        n("Mul", ["h", "one_s"], ["h1"]),
        n("Mul", ["h", "two_s"], ["h2"]),
        n("Unsqueeze", ["h1", "zero"], ["end1"]),
        n("Unsqueeze", ["h2", "zero"], ["end2"]),
        *([n("Sub", ["end1", "one"], ["early"])] if form == "off" else []),
        n("Slice", ["x", "zero", "end1", "minus1"], ["x1"]),
        n("Slice", ["x", "early" if form == "off" else "end1", "end2", "minus1"], ["x2"]),
    ]


def _graph(wrong_sign: bool = False, halves: str = "split") -> onnx.ModelProto:
    f = TensorProto.FLOAT
    i64 = TensorProto.INT64
    nodes = [
        helper.make_node("Unsqueeze", ["cos", "one"], ["c"]),
        helper.make_node("Unsqueeze", ["sin", "one"], ["s"]),
        *_halves(halves),
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
        [
            helper.make_tensor("one", i64, [1], [1]),
            helper.make_tensor("zero", i64, [1], [0]),
            helper.make_tensor("minus1", i64, [1], [-1]),
            helper.make_tensor("last", i64, [], [-1]),
            helper.make_tensor("one_s", i64, [], [1]),
            helper.make_tensor("two_s", i64, [], [2]),
        ],
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


@pytest.mark.parametrize("halves", ["split", "slices"])
def test_split_halves_become_rotary_embedding(halves):
    original = _graph(halves=halves)
    lifted, outcome = _apply(original)
    assert isinstance(outcome, Rewritten), outcome
    proto = ir.to_proto(lifted)
    onnx.checker.check_model(proto, full_check=True)
    assert [n.op_type for n in proto.graph.node] == ["RotaryEmbedding"]
    rng = np.random.default_rng(0)
    feeds = rotary_feeds(rng, (B, N, S, D), D)
    tol = tolerance_for("float32")
    np.testing.assert_allclose(_run(proto, feeds), _run(original, feeds), **vars(tol))


@pytest.mark.parametrize(
    ("wrong_sign", "halves"), [(True, "split"), (True, "slices"), (False, "off")]
)
def test_not_a_rotation_is_not_matched(wrong_sign, halves):
    _, outcome = _apply(_graph(wrong_sign, halves))
    assert outcome is None
