"""ONNX RotaryEmbedding -> com.microsoft::RotaryEmbedding (DML, WebGPU): attributes carried,
known answers on ORT CPU for both layouts, full/partial and both pairings."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import TensorProto, helper

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns import OptimizeOptions

B, N, S, H, M = 2, 3, 5, 16, 32


def _rope_model(layout: str, rotary: int, interleaved: int) -> onnx.ModelProto:
    x_shape = [B, N, S, H] if layout == "bnsh" else [B, S, N * H]
    angles = np.arange(M)[:, None] * (1 / 10000 ** (np.arange(0, rotary, 2) / rotary))[None]
    inits = [
        onnx.numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"),
        onnx.numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin"),
    ]
    attrs = {"interleaved": interleaved}
    if rotary != H:
        attrs["rotary_embedding_dim"] = rotary
    if layout == "bsd":
        attrs["num_heads"] = N
    node = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "rope",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape),
            helper.make_tensor_value_info("pos", TensorProto.INT64, [B, S]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)


def _numpy_rope(x_bnsh, pos, rotary, interleaved):
    inv = 1 / 10000 ** (np.arange(0, rotary, 2) / rotary)
    ang = pos[:, None, :, None] * inv  # (B, 1, S, R/2)
    cos, sin = np.cos(ang), np.sin(ang)
    rot, rest = x_bnsh[..., :rotary], x_bnsh[..., rotary:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(rot.shape)
    else:
        a, b = rot[..., : rotary // 2], rot[..., rotary // 2 :]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    return np.concatenate([out, rest], -1)


@pytest.mark.parametrize("layout", ["bnsh", "bsd"])
@pytest.mark.parametrize("rotary", [H, 8])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_contrib_rope_known_answer(layout, rotary, interleaved):
    original = _rope_model(layout, rotary, interleaved)
    model = ir.serde.deserialize_model(original)
    PassManager().run(model, get_ep("dml"), "float32", OptimizeOptions())
    lowered = ir.to_proto(model)
    (node,) = lowered.graph.node
    assert (node.domain, node.op_type) == ("com.microsoft", "RotaryEmbedding")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs == {"interleaved": interleaved, "num_heads": N, "rotary_embedding_dim": rotary}
    assert list(node.input) == ["x", "pos", "cos", "sin"]
    rng = np.random.default_rng(1)
    x_bnsh = rng.standard_normal((B, N, S, H))
    x = x_bnsh if layout == "bnsh" else x_bnsh.transpose(0, 2, 1, 3).reshape(B, S, N * H)
    pos = rng.integers(0, M, (B, S))
    feeds = {"x": x.astype(np.float32), "pos": pos.astype(np.int64)}
    got = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    if layout == "bsd":
        got = got.reshape(B, S, N, H).transpose(0, 2, 1, 3)
    expected = _numpy_rope(x_bnsh, pos, rotary, interleaved)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_cpu_keeps_onnx_rotary():
    model = ir.serde.deserialize_model(_rope_model("bsd", H, 0))
    report = PassManager().run(model, get_ep("cpu"), "float32", OptimizeOptions())
    assert [n.domain for n in model.graph] == [""]
    rule = next(r for r in report.rules if r.name == "rotary-embedding-to-contrib")
    assert not rule.selected


@pytest.mark.parametrize("style", ["torch23", "mobius"])
def test_glm_interleaved_partial_on_dml(style):
    cfg = DecoderConfig(style=style, head_dim=32, rotary_dim=16, interleaved=True)
    original = build_decoder(cfg)
    optimized = epfuse.optimize(original, "dml", precision="fp32")
    ropes = [n for n in optimized.graph.node if n.op_type == "RotaryEmbedding"]
    assert len(ropes) == 2 * cfg.layers and all(n.domain == "com.microsoft" for n in ropes)
    for node in ropes:
        attrs = {a.name: a.i for a in node.attribute}
        assert attrs["interleaved"] == 1 and attrs["rotary_embedding_dim"] == 16
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == cfg.layers
    assert all(len(n.input) == 7 and n.input[1] and n.input[2] for n in gqa)  # no packing
    assert_equivalent(original, optimized)
