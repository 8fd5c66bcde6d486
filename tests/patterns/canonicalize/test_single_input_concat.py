"""single-input-concat: a one-input Concat in front of a past (as TorchScript traces leave it)
is removed, the fused attention reads the past graph input itself, and the model is equal."""

import onnx
from model_builder import DecoderConfig, build_decoder

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
