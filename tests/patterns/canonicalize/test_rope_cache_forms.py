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


def _model(
    lossy_positions: bool, batch_from: str = "position_ids", shift: bool = False
) -> ir.Model:
    """``batch_from``: the input whose shape gives the batch inv_freq is expanded to
    (transformers 4.x under dynamo reads it off a past key). ``shift``: positions are offset by
    the past length (computed positions: the caches could not be read at the input)."""
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, H, 2) / H))).astype(np.float32)
    nodes = [
        helper.make_node("Unsqueeze", ["inv_freq", "axes02"], ["inv3"]),
        helper.make_node("Shape", [batch_from], ["batch"], start=0, end=1),
        helper.make_node("Concat", ["batch", "tail"], ["target"], axis=0),
        helper.make_node("Expand", ["inv3", "target"], ["inv_expanded"]),
    ]
    positions = "position_ids"
    if shift:
        nodes += [
            helper.make_node("Shape", ["past_key"], ["past_len"], start=2, end=3),
            helper.make_node("Add", ["position_ids", "past_len"], ["shifted"]),
        ]
        positions = "shifted"
    nodes.append(helper.make_node("Unsqueeze", [positions, "axis1"], ["p3"]))
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
            helper.make_tensor_value_info("past_key", TensorProto.FLOAT, ["b", 2, "p", H]),
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
        assert isinstance(outcome, Kept) and "do not match" in outcome.message
        assert len(rope.inputs) == 3 and rope.inputs[1].name == "cos"


def test_cos_sin_may_read_another_inputs_shape():
    """transformers 4.x expands inv_freq to ``position_ids.shape[0]``, which torch.onnx takes
    from whichever input carries the batch dim (a past key): the proof feeds that input at
    several batch and past sizes."""
    model = _model(False, batch_from="past_key")
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(max_seq_len=512))
    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    outcome = RopeCosSinToCaches().apply(rope, ctx)
    assert isinstance(outcome, Rewritten), outcome
    assert rope.inputs[3].name == "position_ids"


def test_angles_that_depend_on_another_inputs_shape_are_kept():
    """cos(position_ids + past length): the angles' positions are not the position_ids
    input the caches would be read at, so the rewrite is refused."""
    model = _model(False, batch_from="past_key", shift=True)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions(max_seq_len=512))
    rope = next(n for n in model.graph if n.op_type == "RotaryEmbedding")
    outcome = RopeCosSinToCaches().apply(rope, ctx)
    assert isinstance(outcome, Kept) and "more than the positions" in outcome.message, outcome
    assert len(rope.inputs) == 3 and rope.inputs[1].name == "cos"
