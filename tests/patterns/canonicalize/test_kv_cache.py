"""KV concat into Attention past/present: the concatenated K/V's ``Shape`` feeding the
Attention's own mask (Phi's ``attention_mask[..., :key_states.shape[-2]]``) must not make the
Attention read its own present (the "Graph contains a cycle" crash on Optimum's Phi-2)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import _infer_types
from epfuse.patterns import OptimizeOptions, RewriteContext, Rewritten
from epfuse.patterns.canonicalize.kv_cache import KVConcatToAttentionPast

B, N, S, P, H, T_MAX = 2, 2, 3, 4, 8, 16
F = TensorProto.FLOAT


def _graph(shape_form: str) -> onnx.ModelProto:
    """Attention(q, Concat(pk, k), Concat(pv, v), mask[..., :len(K)]) with len(K) read from
    the concatenated K by ``Shape`` (then ``Gather``) or ``Shape(start=-2, end=-1)``."""
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
        helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
    ]
    if shape_form == "gather":
        nodes += [
            helper.make_node("Shape", ["present_k"], ["k_shape"]),
            helper.make_node("Gather", ["k_shape", "two"], ["k_len0"], axis=0),
            helper.make_node("Unsqueeze", ["k_len0", "zero"], ["k_len"]),
        ]
    else:
        nodes.append(helper.make_node("Shape", ["present_k"], ["k_len"], start=-2, end=-1))
    nodes += [
        helper.make_node("Slice", ["mask4", "zero", "k_len", "three"], ["mask"]),
        helper.make_node("Attention", ["q", "present_k", "present_v", "mask"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("q", F, [B, N, S, H]),
        helper.make_tensor_value_info("k", F, [B, N, S, H]),
        helper.make_tensor_value_info("v", F, [B, N, S, H]),
        helper.make_tensor_value_info("past_k", F, [B, N, "P", H]),
        helper.make_tensor_value_info("past_v", F, [B, N, "P", H]),
        helper.make_tensor_value_info("mask4", F, [B, 1, S, T_MAX]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", F, [B, N, S, H]),
        helper.make_tensor_value_info("present_k", F, [B, N, "T", H]),
        helper.make_tensor_value_info("present_v", F, [B, N, "T", H]),
    ]
    graph = helper.make_graph(
        nodes,
        "kv",
        inputs,
        outputs,
        [i64("two", 2), i64("zero", [0]), i64("three", [3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("shape_form", ["gather", "start-end"])
def test_shape_of_concatenated_k_feeding_the_mask_makes_no_cycle(shape_form):
    original = _graph(shape_form)
    model = ir.serde.deserialize_model(original)
    _infer_types(model)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    attention = next(n for n in model.graph if n.op_type == "Attention")
    outcome = KVConcatToAttentionPast().apply(attention, ctx)
    assert isinstance(outcome, Rewritten), outcome
    model.graph.sort()  # raised "Graph contains a cycle" before the fix
    common_passes.RemoveUnusedNodesPass()(model)
    fused = next(n for n in model.graph if n.op_type == "Attention")
    assert len(fused.inputs) == 6 and fused.inputs[4].name == "past_k"
    assert not any(n.op_type == "Concat" for n in model.graph)  # one copy of the cache: GQA's
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)

    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal((B, N, S, H)).astype(np.float32) for name in "qkv"}
    feeds |= {n: rng.standard_normal((B, N, P, H)).astype(np.float32) for n in ("past_k", "past_v")}
    feeds["mask4"] = rng.standard_normal((B, 1, S, T_MAX)).astype(np.float32)
    for want, got in zip(_run(original, feeds), _run(proto, feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
