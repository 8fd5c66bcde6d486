"""Q and K rotated by duplicated cos/sin subgraphs (torch.onnx emits one Cos/Sin per
RotaryEmbedding at opset 23) are one rotation: the GQA lowering proves them equal by
evaluation instead of refusing, and still refuses rotations that evaluate differently.

The angles here are written in a form the cos/sin cache proof does not trace (``positions +
0``), so the rotation stays outside GQA either way: what is tested is the reason given, which
must name the real obstacle, and the equivalence of the result.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from model_builder import DecoderConfig, build_decoder
from onnx import helper, numpy_helper

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _untraceable_angles(model: onnx.ModelProto, k_differs: bool) -> onnx.ModelProto:
    """freqs = (pos + 0) * inv_freq; with ``k_differs`` layer 0's K reads cos/sin of 1.5 freqs."""
    graph = model.graph
    mul = next(n for n in graph.node if n.output[0] == "freqs")
    index = list(graph.node).index(mul)
    graph.initializer.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero_shift"))
    graph.node.insert(index, helper.make_node("Add", [mul.input[0], "zero_shift"], ["pos_add"]))
    mul.input[0] = "pos_add"
    if k_differs:
        graph.initializer.append(numpy_helper.from_array(np.array(1.5, np.float32), "k_scale"))
        index = list(graph.node).index(mul) + 1
        graph.node.insert(index, helper.make_node("Mul", ["freqs", "k_scale"], ["freqs_k"]))
        for node in graph.node:
            if node.output[0] in ("cos_1", "sin_1"):
                node.input[0] = "freqs_k"
    return model


@pytest.mark.parametrize("k_differs", [False, True])
def test_duplicated_cos_sin_are_proven_equal(k_differs):
    original = _untraceable_angles(build_decoder(DecoderConfig(style="torch23")), k_differs)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    reasons = [" ".join(layer.notes + layer.reasons) for layer in report.layers]
    assert all(layer.fused for layer in report.layers), report.summary()
    expected = "rotated differently" if k_differs else "not constant caches"
    assert expected in reasons[0], report.summary()
    assert "not constant caches" in reasons[1], report.summary()
    assert_equivalent(original, optimized)


def test_rotation_cast_back_to_its_own_dtype_still_fuses():
    """Cohere rotates in float32 and casts back (``q_embed.to(dtype)``): a Cast to the dtype
    the rotated Q/K already have is no obstacle to moving the rotation into GQA."""
    cfg = DecoderConfig(style="torch23")
    original = build_decoder(cfg)
    graph = original.graph
    for rotated in ("q_rot", "k_rot", "q_rot_1", "k_rot_1"):
        # the shapes an exporter records (Optimum does), so the head counts are static here
        heads = cfg.heads if rotated.startswith("q") else cfg.kv_heads
        graph.value_info.append(
            helper.make_tensor_value_info(
                f"{rotated}_cast", 1, ["batch", heads, "seq", cfg.head_dim]
            )
        )
        index = next(i for i, n in enumerate(graph.node) if rotated in n.output)
        graph.node.insert(index + 1, helper.make_node("Cast", [rotated], [f"{rotated}_cast"], to=1))
        for node in graph.node[index + 2 :]:
            node.input[:] = [f"{rotated}_cast" if i == rotated else i for i in node.input]
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    results = [layer.result for layer in report.layers]
    assert results == ["GroupQueryAttention(do_rotary=1)"] * 2, report.summary()
    assert_equivalent(original, optimized)
