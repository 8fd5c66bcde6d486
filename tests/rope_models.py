"""One ONNX ``RotaryEmbedding`` node over constant cos/sin caches, for the rules that take it
apart or hand it to another op (legalize's expansion, the com.microsoft lowering): both tests
run the same node against ORT's kernel."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

B, N, S, H, M = 2, 3, 5, 16, 32
"""Batch, heads, sequence, head size and cache rows of the model."""


def rope_model(layout: str, rotary: int, interleaved: int) -> onnx.ModelProto:
    """``y = RotaryEmbedding(x, cos, sin, pos)`` at opset 23: ``layout`` "bnsh" (4-D x) or
    "bsd" (3-D x with ``num_heads``); ``rotary`` < H rotates a prefix of each head."""
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


def rotary_feeds(
    rng: np.random.Generator,
    x_shape: tuple[int, int, int, int],
    rotary: int,
    names: tuple[str, str, str] = ("x", "cos", "sin"),
) -> dict[str, np.ndarray]:
    """Random feeds of a rotary over a (B, N, S, H) ``x``: ``x`` standard normal and cos/sin
    (B, S, rotary / 2) of angles drawn uniformly in [0, 6), under ``names``."""
    batch, _, seq, _ = x_shape
    angles = rng.uniform(0, 6, (batch, seq, rotary // 2))
    x, cos, sin = names
    return {
        x: rng.standard_normal(x_shape).astype(np.float32),
        cos: np.cos(angles).astype(np.float32),
        sin: np.sin(angles).astype(np.float32),
    }
