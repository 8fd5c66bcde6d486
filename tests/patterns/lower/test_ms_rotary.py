"""ONNX RotaryEmbedding -> com.microsoft::RotaryEmbedding (DML, WebGPU): attributes carried,
known answers on ORT CPU for both layouts, full/partial and both pairings."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from model_builder import DecoderConfig, build_decoder
from rope_models import B, H, M, N, S, rope_model

import epfuse
from epfuse.capabilities import get_ep
from epfuse.capabilities.known_answers import rotate
from epfuse.optimizer.manager import PassManager
from epfuse.optimizer.verify import assert_equivalent
from epfuse.patterns import OptimizeOptions


@pytest.mark.parametrize("layout", ["bnsh", "bsd"])
@pytest.mark.parametrize("rotary", [H, 8])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_contrib_rope_known_answer(layout, rotary, interleaved):
    original = rope_model(layout, rotary, interleaved)
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
    expected = rotate(x_bnsh, pos, interleaved, rotary)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_cpu_keeps_onnx_rotary():
    model = ir.serde.deserialize_model(rope_model("bsd", H, 0))
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
