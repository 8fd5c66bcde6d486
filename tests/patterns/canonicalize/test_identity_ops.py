"""identity_ops: a one-input Concat or a float32 -> float32 Cast in front of a past (as
TorchScript traces leave them) is removed, the fused attention reads the past graph input
itself, and the model is equal; a real conversion and a node that is a graph output stay."""

import onnx
from model_builder import DecoderConfig, build_decoder
from onnx import TensorProto, helper

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _with_concat_before_past(cfg: DecoderConfig) -> onnx.ModelProto:
    model = build_decoder(cfg)
    past = model.graph.input[3].name  # past_key_values.0.key
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == past:
                node.input[i] = "past_copy"
    model.graph.node.insert(0, onnx.helper.make_node("Concat", [past], ["past_copy"], axis=2))
    return model


def test_one_input_concat_before_the_past_goes_and_gqa_reads_the_input():
    cfg = DecoderConfig(style="torch23")
    original = _with_concat_before_past(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rule = next(r for r in report.rules if r.name == "single-input-concat")
    assert rule.rewritten == 1, report.summary()
    assert all(layer.fused for layer in report.layers), report.summary()
    past = original.graph.input[3].name
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa[0].input[3] == past  # the graph input, not a copy
    assert "Concat" not in [n.op_type for n in optimized.graph.node]
    assert_equivalent(original, optimized, prompt_len=9, decode_past_len=7)


def test_a_concat_that_is_a_graph_output_stays():
    model = build_decoder(DecoderConfig(style="torch23"))
    past = model.graph.input[3].name
    model.graph.node.append(onnx.helper.make_node("Concat", [past], ["past_echo"], axis=2))
    model.graph.output.append(
        onnx.helper.make_tensor_value_info("past_echo", onnx.TensorProto.FLOAT, None)
    )
    optimized, report = epfuse.optimize_with_report(model, "cpu")
    rule = next(r for r in report.rules if r.name == "single-input-concat")
    assert rule.rewritten == 0
    assert "past_echo" in [o.name for o in optimized.graph.output]


def _with_cast_before_past(to: int) -> onnx.ModelProto:
    model = build_decoder(DecoderConfig(style="torch23"))
    past = model.graph.input[3].name  # past_key_values.0.key
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == past:
                node.input[i] = "past_cast"
    cast = [helper.make_node("Cast", [past], ["past_cast"], to=to)]
    if to != TensorProto.FLOAT:  # and back, so the model still computes in float32
        cast = [
            helper.make_node("Cast", [past], ["past_half"], to=to),
            helper.make_node("Cast", ["past_half"], ["past_cast"], to=TensorProto.FLOAT),
        ]
    for node in reversed(cast):
        model.graph.node.insert(0, node)
    return model


def _rule(report):
    return next(r for r in report.rules if r.name == "same-type-cast")


def test_a_cast_to_the_own_type_goes_and_gqa_reads_the_input():
    original = _with_cast_before_past(TensorProto.FLOAT)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert _rule(report).rewritten == 1, report.summary()
    assert all(layer.fused for layer in report.layers), report.summary()
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa[0].input[3] == original.graph.input[3].name  # the graph input, not a copy
    assert_equivalent(original, optimized, prompt_len=9, decode_past_len=7)


def test_a_real_conversion_stays():
    original = _with_cast_before_past(TensorProto.FLOAT16)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    assert _rule(report).rewritten == 0
    casts = [n for n in optimized.graph.node if n.op_type == "Cast" and n.input[0] == "past_half"]
    assert len(casts) == 1  # the float16 -> float32 Cast back is a real conversion too
    assert_equivalent(original, optimized, prompt_len=9, decode_past_len=7)


def test_a_cast_that_is_a_graph_output_stays():
    model = build_decoder(DecoderConfig(style="torch23"))
    past = model.graph.input[3].name
    model.graph.node.append(helper.make_node("Cast", [past], ["past_echo"], to=TensorProto.FLOAT))
    model.graph.output.append(helper.make_tensor_value_info("past_echo", TensorProto.FLOAT, None))
    optimized, report = epfuse.optimize_with_report(model, "cpu")
    assert _rule(report).rewritten == 0
    assert "past_echo" in [o.name for o in optimized.graph.output]
