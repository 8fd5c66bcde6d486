"""The rotate-half arithmetic of an export becomes RotaryEmbedding only when it is exactly it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from rope_models import rotary_feeds

from epfuse.capabilities import get_ep
from epfuse.patterns import OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.rotate_half import RotateHalfToRotaryEmbedding

B, N, S, H = 2, 3, 5, 8


def _model(*, swap_halves: bool = False, split: int = H // 2) -> onnx.ModelProto:
    """y = x * [c, c] + [-x2, x1] * [s, s] as torch.onnx writes HF's apply_rotary_pos_emb."""
    consts = {
        "zero": [0],
        "half": [split],
        "end": [2**63 - 1],
        "axis": [3],
        "one": [1],
    }
    inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items()]
    nodes = [
        helper.make_node("Slice", ["x", "zero", "half", "axis", "one"], ["x1"]),
        helper.make_node("Slice", ["x", "half", "end", "axis", "one"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["neg"]),
        helper.make_node(
            "Concat", ["x1", "neg"] if swap_halves else ["neg", "x1"], ["rot"], axis=-1
        ),
        helper.make_node("Concat", ["c", "c"], ["cc"], axis=-1),
        helper.make_node("Concat", ["s", "s"], ["ss"], axis=-1),
        helper.make_node("Unsqueeze", ["cc", "one"], ["c4"]),
        helper.make_node("Unsqueeze", ["ss", "one"], ["s4"]),
        helper.make_node("Mul", ["x", "c4"], ["xc"]),
        helper.make_node("Mul", ["rot", "s4"], ["rs"]),
        helper.make_node("Add", ["xc", "rs"], ["rotated"]),
        helper.make_node("Identity", ["rotated"], ["y"]),
    ]
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "rope",
        [
            helper.make_tensor_value_info("x", f, ["batch", N, "seq", H]),
            helper.make_tensor_value_info("c", f, ["batch", "seq", H // 2]),
            helper.make_tensor_value_info("s", f, ["batch", "seq", H // 2]),
        ],
        [helper.make_tensor_value_info("y", f, ["batch", N, "seq", H])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _apply(proto: onnx.ModelProto, ep: str = "cpu"):
    model = ir.serde.deserialize_model(proto)
    ctx = RewriteContext(model, get_ep(ep), "float32", OptimizeOptions())
    add = next(n for n in model.graph if n.op_type == "Add")
    return RotateHalfToRotaryEmbedding().apply(add, ctx), ir.serde.serialize_model(model)


def _run(proto, feeds):
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def test_lifts_to_rotary_embedding_and_stays_equal():
    original = _model()
    outcome, rewritten = _apply(original)
    assert isinstance(outcome, Rewritten)
    ropes = [n for n in rewritten.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 1 and list(ropes[0].input) == ["x", "c", "s"]
    assert not any(n.op_type == "Add" for n in rewritten.graph.node)
    rng = np.random.default_rng(0)
    feeds = rotary_feeds(rng, (B, N, S, H), H, names=("x", "c", "s"))
    # the same products and sums; ORT's kernel may round them differently (fused multiply-add)
    np.testing.assert_allclose(_run(rewritten, feeds), _run(original, feeds), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", [{"swap_halves": True}, {"split": 3}])
def test_other_arithmetic_is_not_matched(variant):
    outcome, _ = _apply(_model(**variant))
    assert outcome is None


def test_lift_does_not_depend_on_the_ep():
    """Canonicalize lifts whatever the EP (DML has no ONNX RotaryEmbedding: legalization maps
    it to the contrib op later, not the lift's business)."""
    for ep in ("dml", "qnn", "coreml"):
        outcome, rewritten = _apply(_model(), ep=ep)
        assert isinstance(outcome, Rewritten), (ep, outcome)
        assert any(n.op_type == "RotaryEmbedding" for n in rewritten.graph.node)
