"""Run-time cos/sin -> constant caches, the exported angle forms (see test_rope_caches.py for
the opset-23 form): the tracer only finds inv_freq and the positions;
the evaluation proof is what accepts or refuses. Here, Hugging Face's MatMul/Transpose angle
form is accepted, and refused when the positions pass through float16 on the way (positions
above 2048 round to even numbers: not the angles the caches would hold). The Mul form and the
scaled/cast variants are run in test_rotate_half.py, as they come out of the rotate-half rule."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import Kept, OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.rope_caches import RopeCosSinToCaches

H = 16


def _model(lossy_positions: bool) -> ir.Model:
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, H, 2) / H))).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["inv_freq", "axes02"], ["inv3"]),
        helper.make_node("Shape", ["position_ids"], ["batch"], start=0, end=1),
        helper.make_node("Concat", ["batch", "tail"], ["target"], axis=0),
        helper.make_node("Expand", ["inv3", "target"], ["inv_expanded"]),
        helper.make_node("Unsqueeze", ["position_ids", "axis1"], ["p3"]),
    ]
    if lossy_positions:
        nodes += [
            helper.make_node("Cast", ["p3"], ["p16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", ["p16"], ["pf"], to=TensorProto.FLOAT),
        ]
    else:
        nodes.append(helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT))
    nodes += [
        helper.make_node("MatMul", ["inv_expanded", "pf"], ["mm"]),
        helper.make_node("Transpose", ["mm"], ["freqs"], perm=[0, 2, 1]),
        helper.make_node("Cos", ["freqs"], ["cos"]),
        helper.make_node("Sin", ["freqs"], ["sin"]),
        helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(inv_freq, "inv_freq"),
        numpy_helper.from_array(np.array([0, 2], np.int64), "axes02"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([H // 2, 1], np.int64), "tail"),
    ]
    graph = helper.make_graph(
        nodes,
        "rope",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2, "s", H]),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, "s", H])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    model = ir.serde.deserialize_model(proto)
    _infer_types(model)
    return model


@pytest.mark.parametrize("lossy", [False, True])
def test_the_evaluation_decides(lossy):
    model = _model(lossy)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(max_seq_len=4096))
    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    outcome = RopeCosSinToCaches().apply(rope, ctx)
    if not lossy:
        assert isinstance(outcome, Rewritten), outcome
        assert rope.inputs[1].const_value.shape == (4096, H // 2)
        assert rope.inputs[3].name == "position_ids"
    else:
        assert isinstance(outcome, Kept) and "do not match" in outcome.reason
        assert len(rope.inputs) == 3 and rope.inputs[1].name == "cos"
