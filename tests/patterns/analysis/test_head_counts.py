"""Head counts: one analysis for the attention lift, the GQA lowering, the contrib-rotary
lowering and the genai packager, proven through run-time reshape targets."""

from __future__ import annotations

import onnx_ir as ir
from patterns.analysis.test_shapes import _torchscript_graph, _values

from epfuse.capabilities import get_ep
from epfuse.patterns import OptimizeOptions, RewriteContext
from epfuse.patterns.analysis.head_counts import HeadCounts, attention_heads, axis_size


def _forget_shapes(model: ir.Model, *names: str) -> dict[str, ir.Value]:
    values = _values(model)
    for name in names:
        values[name].shape = ir.Shape([None] * 4)
    return values


def test_heads_through_a_runtime_reshape_target():
    model = _torchscript_graph()
    values = _forget_shapes(model, "r", "t")
    values["x"].shape = ir.Shape(["batch", "seq", 64])
    values["y64"].shape = ir.Shape(["batch", "seq", 64])
    assert axis_size(values["t"], 1) == 4  # -1 of [B, S, -1, 16] over (B, S, 64)
    assert axis_size(values["t"], 3) == 16


def test_uncancelled_factors_are_not_heads():
    model = _torchscript_graph()
    values = _forget_shapes(model, "r", "t")
    values["y64"].shape = ir.Shape(["other", "seq", 64])  # B of the target is not its B
    values["x"].shape = ir.Shape(["batch", "seq", 64])
    assert axis_size(values["t"], 1) is None


def test_attention_heads_are_memoized_and_typed():
    model = _torchscript_graph()
    values = _values(model)
    graph = model.graph
    q = values["t"]
    q.shape = ir.Shape(["batch", None, "seq", None])
    values["r"].shape = ir.Shape([None] * 4)
    values["x"].shape = values["y64"].shape = ir.Shape(["batch", "seq", 64])
    k = ir.Value(name="k", shape=ir.Shape(["batch", 2, "seq", 16]), type=q.type)
    graph.inputs.append(k)
    node = ir.node("Attention", [q, k, k], name="attn")
    graph.append(node)
    ctx = RewriteContext(model, get_ep("cpu"), "float32", OptimizeOptions())
    got = attention_heads(ctx, node)
    assert got == HeadCounts(4, 2, 16, 4)
    assert attention_heads(ctx, node) is got and ctx.analyses.computed == 1
