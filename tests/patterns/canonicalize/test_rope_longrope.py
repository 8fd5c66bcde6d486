"""rope-cos-sin-to-caches on LongRoPE's run-time switch: ``inv_freq = Where(max(position_ids)
+ 1 > T, long, short)`` becomes two proven constant cache pairs selected by the graph's own
condition, which GroupQueryAttention then reads as its cos/sin caches (do_rotary=1)."""

import numpy as np
import onnx
import pytest
from model_builder import DecoderConfig, build_decoder, inv_freq
from onnx import helper, numpy_helper

import epfuse
from epfuse.optimizer.verify import Scenario, compare_models
from epfuse.patterns.reasons import ReasonCode

T = 12  # the switch: long factors above T positions


def _longrope(style: str, cond_reads_mask: bool = False, sin_factor: float = 1.0):
    """A model_builder decoder whose inv_freq is switched at run time as HF's LongRoPE."""
    cfg = DecoderConfig(style=style, max_positions=64)
    model = build_decoder(cfg)
    graph = model.graph
    short = inv_freq(cfg).astype(np.float32)
    long = (short / np.linspace(1.5, 4.0, short.size)).astype(np.float32)
    graph.initializer.extend(
        [
            numpy_helper.from_array(short, "lr_short"),
            numpy_helper.from_array(long, "lr_long"),
            numpy_helper.from_array((long * sin_factor).astype(np.float32), "lr_long_sin"),
            numpy_helper.from_array(np.array(T, np.int64), "lr_T"),
            numpy_helper.from_array(np.array(1, np.int64), "lr_one"),
        ]
    )
    nodes = [
        helper.make_node("ReduceMax", ["position_ids"], ["lr_max"], keepdims=0),
        helper.make_node("Add", ["lr_max", "lr_one"], ["lr_len"]),
    ]
    if cond_reads_mask:  # a condition that reads attention_mask by value
        nodes += [
            helper.make_node("ReduceSum", ["attention_mask"], ["lr_sum"], keepdims=0),
            helper.make_node("Add", ["lr_len", "lr_sum"], ["lr_len2"]),
            helper.make_node("Greater", ["lr_len2", "lr_T"], ["lr_cond"]),
        ]
    else:
        nodes.append(helper.make_node("Greater", ["lr_len", "lr_T"], ["lr_cond"]))
    nodes += [
        helper.make_node("Where", ["lr_cond", "lr_long", "lr_short"], ["lr_inv_freq"]),
        helper.make_node("Where", ["lr_cond", "lr_long_sin", "lr_short"], ["lr_inv_freq_sin"]),
    ]
    freqs = next(n for n in graph.node if n.output[0] == "freqs")
    freqs.input[1] = "lr_inv_freq"
    if sin_factor != 1.0:  # sin reads its own angles, switched to other long frequencies
        sin_freqs = helper.make_node("Mul", [freqs.input[0], "lr_inv_freq_sin"], ["freqs_sin"])
        for node in graph.node:
            if node.op_type == "Sin":
                node.input[0] = "freqs_sin"
        at = list(graph.node).index(freqs)
        graph.node.insert(at + 1, sin_freqs)
    for i, node in enumerate(nodes):
        graph.node.insert(i, node)
    onnx.checker.check_model(model)
    return model, short, long


def _scenarios():
    """Lengths below, at and above T, and decodes/chunks across it."""
    return [
        Scenario.prompt((T - 1, T - 1)),
        Scenario.prompt((T, T)),
        Scenario.prompt((T + 1, T + 1)),
        Scenario.prompt((T + 3, T - 3)),  # row 1 rotates long: the batch's max decides
        Scenario.continuation(2, T - 1, 1),  # total T: short
        Scenario.continuation(2, T, 1),  # past rotated short, the new token long
        Scenario.continuation(1, T - 2, 3),  # the chunk crosses T
        Scenario.continuation(1, T + 2, 3),
        Scenario.padded_decode((T - 4, T - 6)),
        Scenario.padded_decode((T + 3, T + 1)),
    ]


@pytest.mark.parametrize("style", ["torch23", "torch18"])
def test_switch_becomes_two_proven_caches_inside_gqa(style):
    original, short, long = _longrope(style)
    optimized, report = epfuse.optimize_with_report(original, "cpu", max_seq_len=64)
    assert report.fused_layers == len(report.layers) == 2, report.summary()
    for layer in report.layers:
        assert layer.result == "GroupQueryAttention(do_rotary=1)", layer
        assert "LongRoPE caches chosen per call" in "; ".join(layer.notes)
    ops = [n.op_type for n in optimized.graph.node]
    for op in ("Cos", "Sin", "RotaryEmbedding"):
        assert op not in ops, op
    producers = {o: n for n in optimized.graph.node for o in n.output}
    inits = {i.name: numpy_helper.to_array(i) for i in optimized.graph.initializer}
    angles = np.arange(64, dtype=np.float64)[:, None]
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    for node in gqa:
        for slot, trig in ((7, np.cos), (8, np.sin)):
            where = producers[node.input[slot]]
            assert where.op_type == "Where"
            # the graph's own condition, still read off position_ids
            assert producers[where.input[0]].op_type == "Greater"
            np.testing.assert_allclose(inits[where.input[1]], trig(angles * long), atol=1e-6)
            np.testing.assert_allclose(inits[where.input[2]], trig(angles * short), atol=1e-6)
    # one Where per cache, shared by every layer
    assert ops.count("Where") == 2
    result = compare_models(original, optimized, scenarios=_scenarios())
    assert result.passed, str(result)
    assert all(s.skipped is None and s.error is None for s in result.scenarios), str(result)


@pytest.mark.parametrize(
    ("variant", "code"),
    [
        # a condition reading more than position_ids is not the switch this rule proves
        ({"cond_reads_mask": True}, ReasonCode.NOT_PROVEN),
        # a sin switching to other frequencies than cos is not one pair of caches
        ({"sin_factor": 1.01}, ReasonCode.FORM),
    ],
    ids=["condition-reads-more-than-positions", "sin-switches-to-other-frequencies"],
)
def test_not_a_provable_switch_stays_outside(variant, code):
    original, _, _ = _longrope("torch23", **variant)
    optimized, report = epfuse.optimize_with_report(original, "cpu", max_seq_len=64)
    rule = next(r for r in report.rules if r.name == "rope-cos-sin-to-caches")
    assert rule.rewritten == 0 and code.value in rule.kept_codes, rule
    assert all(layer.result == "GroupQueryAttention(do_rotary=0)" for layer in report.layers)
    result = compare_models(original, optimized, scenarios=_scenarios()[:8])
    assert result.passed, str(result)
