"""RoPE at positions the graph computes (no ``position_ids`` input: Optimum's Gemma and
Nemotron exports) moves into GroupQueryAttention only where evaluation proves the positions are
fused rotary's (``analysis.rotary_positions``):

* counted from the attention mask (``cumsum(mask) - 1``, Hugging Face's generation): GQA's own
  positions in every probe, so GQA takes no ``position_ids`` (onnxruntime-genai's builder form),
  also on an EP whose fused rotary ignores position_ids;
* counted from the cache length (``arange(past, past + seq)``): GQA's own except after a
  right-padded prompt (the row continues at the cache length, GQA at its length), so they are
  fed as ``position_ids``; an EP that ignores position_ids keeps the rotation outside;
* anything else (here reversed on a first prompt, where fused rotary takes ``position_ids[0, 0]
  + s``) keeps the rotation outside with ``ReasonCode.ROPE_POSITIONS``.

Each optimized model equals its original on ORT in every scenario, the decode after a padded
prompt included.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from export_runs import padded_decode_logits_diff
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import assert_equivalent, compare_models
from epfuse.patterns.analysis.manager import Unproven
from epfuse.patterns.analysis.rotary_positions import ProvenPositions, prove_positions
from epfuse.patterns.reasons import ReasonCode
from epfuse.tolerances import tolerance_for


def _computed_positions_decoder(form: str) -> ir.Model:
    """The torch18 builder decoder with its RoPE reading positions computed in the graph
    (``position_ids`` left as an unused input)."""
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch18")))
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    nodes: list[ir.Node] = []

    def const(name: str, array) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(np.asarray(array, np.int64)))
        graph.initializers[name] = value
        return value

    def op(op_type: str, args, **attrs) -> ir.Value:
        node = ir.node(op_type, args, attrs, name=f"positions_{len(nodes)}")
        node.outputs[0].name = node.name
        nodes.append(node)
        return node.outputs[0]

    past = op("Gather", [op("Shape", [inputs["past_key_values.0.key"]]), const("i2", 2)], axis=0)
    seq = op("Gather", [op("Shape", [inputs["input_ids"]]), const("i1", 1)], axis=0)
    one = const("one", 1)
    if form == "cache-length":  # Optimum's Gemma: arange(past, past + seq)[None]
        arange = op("Range", [past, op("Add", [past, seq]), one])
        positions = op("Unsqueeze", [arange, const("ax0", [0])])
    elif form == "mask-cumsum":  # cumsum(mask) - 1, padding at 1, the last seq columns
        mask = inputs["attention_mask"]
        counted = op("Sub", [op("CumSum", [mask, const("ax1", 1)]), one])
        padded = op("Equal", [mask, const("zero", 0)])
        filled = op("Where", [padded, one, counted])
        start = op("Neg", [op("Unsqueeze", [seq, const("ax0", [0])])])
        positions = op("Slice", [filled, start, const("end", [2**62]), const("axes", [1])])
    elif form == "reversed":  # in range, but backwards: not what fused rotary takes
        last = op("Sub", [op("Add", [past, seq]), one])
        arange = op("Range", [last, op("Sub", [past, one]), const("minus", -1)])
        positions = op("Unsqueeze", [arange, const("ax0", [0])])
    else:
        raise ValueError(form)
    graph.insert_before(graph.node(0), nodes)
    reads = [
        n
        for n in graph
        if n.op_type == "Unsqueeze" and any(v is inputs["position_ids"] for v in n.inputs)
    ]
    assert reads  # the builder's RoPE reads position_ids through one Unsqueeze
    for node in reads:
        node.replace_input_with(0, positions)
    return model


def _last_positions(model: ir.Model) -> ir.Value:
    named = [n for n in model.graph if n.name.startswith("positions_")]
    return named[-1].outputs[0]


@pytest.mark.parametrize(
    ("form", "expected"),
    [("cache-length", False), ("mask-cumsum", True), ("reversed", None)],
)
def test_proof_tells_gqa_own_positions_from_fed_and_refused(form, expected):
    model = _computed_positions_decoder(form)
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    proven = prove_positions(_last_positions(model), mask, model.graph, 4096)
    if expected is None:
        assert isinstance(proven, Unproven) and "first prompt" in proven.reason, proven
        return
    assert isinstance(proven, ProvenPositions), proven
    assert proven.derived is expected
    if not expected:
        assert "decode after a padded prompt" in proven.why_not_derived


def test_positions_reading_another_input_by_value_are_refused():
    model = _computed_positions_decoder("cache-length")
    ids = next(v for v in model.graph.inputs if v.name == "input_ids")
    mask = next(v for v in model.graph.inputs if v.name == "attention_mask")
    positions = _last_positions(model)
    offset = ir.node("Add", [positions, ids], name="offset")
    model.graph.append(offset)
    proven = prove_positions(offset.outputs[0], mask, model.graph, 4096)
    assert isinstance(proven, Unproven) and "input_ids" in proven.reason, proven


def _gqa(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]


@pytest.mark.parametrize("form", ["cache-length", "mask-cumsum", "reversed"])
def test_computed_positions_fuse_where_proven_and_stay_equal(form):
    original = ir.to_proto(_computed_positions_decoder(form))
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    nodes = _gqa(optimized)
    assert len(nodes) == len(report.layers) == 2, report.summary()
    for layer, node in zip(report.layers, nodes, strict=True):
        if form == "reversed":
            assert layer.result == "GroupQueryAttention(do_rotary=0)", report.summary()
            assert ReasonCode.ROPE_POSITIONS in layer.codes, report.summary()
            assert any("first prompt" in r for r in layer.reasons), report.summary()
            continue
        assert layer.result == "GroupQueryAttention(do_rotary=1)", report.summary()
        assert not layer.codes, report.summary()
        assert layer.facts.do_rotary
        fed = len(node.input) > 9 and bool(node.input[9])
        assert fed == (form == "cache-length"), list(node.input)
    ops = [n.op_type for n in optimized.graph.node]
    assert ("RotaryEmbedding" in ops) == (form == "reversed")
    assert not {"Cos", "Sin"} & set(ops)  # lifted to constant caches at the computed positions
    result = compare_models(original, optimized)
    assert result.passed, str(result)
    if form == "mask-cumsum":  # its rows equal the rows run alone: verify compares this too
        assert result.scenario("padded_decode").skipped is None, str(result)
    # Verify skips the decode after a padded prompt for cache-length positions (the original's
    # rows differ from the rows run alone); the fed positions keep even that equal.
    assert (
        padded_decode_logits_diff(original, optimized, [9, 4, 6]) <= tolerance_for("float32").atol
    )


@pytest.mark.parametrize("form", ["cache-length", "mask-cumsum"])
def test_ep_ignoring_position_ids_fuses_only_gqa_own_positions(form):
    original = ir.to_proto(_computed_positions_decoder(form))
    optimized, report = epfuse.optimize_with_report(original, "webgpu", precision="float32")
    for layer in report.layers:
        if form == "mask-cumsum":
            assert layer.result == "GroupQueryAttention(do_rotary=1)", report.summary()
        else:
            assert layer.result == "GroupQueryAttention(do_rotary=0)", report.summary()
            assert ReasonCode.ROPE_POSITIONS in layer.codes, report.summary()
            assert any("ignores position_ids" in r for r in layer.reasons), report.summary()
    assert_equivalent(original, optimized)
