"""RoPE at positions the graph computes (Optimum's Gemma exports take no position_ids and
rotate at ``arange(past, past + seq)[None]``): lifted to RotaryEmbedding over constant caches
read at those positions, broadcast to the rotated input's (batch, seq) by one Expand, which
GQA's fused rotary then reads as ``position_ids`` (proven in
``tests/patterns/lower/test_gqa_computed_positions.py``)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _arange_positions_decoder():
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch18")))
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}

    def const(name, array):
        value = ir.Value(name=name, const_value=ir.tensor(np.asarray(array, np.int64)))
        graph.initializers[name] = value
        return value

    nodes = []

    def op(op_type, args, **attrs):
        node = ir.node(op_type, args, attrs, name=f"arange_{len(nodes)}")
        node.outputs[0].name = node.name
        nodes.append(node)
        return node.outputs[0]

    past = op("Gather", [op("Shape", [inputs["past_key_values.0.key"]]), const("i2", 2)], axis=0)
    seq = op("Gather", [op("Shape", [inputs["input_ids"]]), const("i1", 1)], axis=0)
    arange = op("Range", [past, op("Add", [past, seq]), const("one", 1)])
    positions = op("Unsqueeze", [arange, const("ax0", [0])])
    graph.insert_before(graph.node(0), nodes)
    rotary = next(
        n
        for n in graph
        if n.op_type == "Unsqueeze" and any(v is inputs["position_ids"] for v in n.inputs)
    )
    rotary.replace_input_with(0, positions)
    return ir.to_proto(model)


def test_rope_at_computed_positions_is_lifted_with_caches():
    original = _arange_positions_decoder()
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    for layer in report.layers:
        assert layer.result == "GroupQueryAttention(do_rotary=1)", report.summary()
        assert "computed in the graph fed as position_ids" in layer.notes[0], report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert "Cos" not in ops and "Sin" not in ops  # constant caches, not run-time trig
    assert ops.count("Expand") == 1  # the positions broadcast once, shared by every layer
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    expand = next(n for n in optimized.graph.node if n.op_type == "Expand")
    assert all(n.input[9] == expand.output[0] for n in gqa)
    assert_equivalent(original, optimized)
