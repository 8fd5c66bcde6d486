"""remove-repeat-kv: Unsqueeze/Expand/Reshape repeat of K and V removed, heads grouped."""

import onnx
import onnx_ir as ir
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.optimizer.verify import assert_equivalent


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_repeat_removed_and_equal(kv_heads):
    original = build_decoder(DecoderConfig(style="torch23", kv_heads=kv_heads))
    canonical, report = epfuse.optimize_with_report(original, "default")
    producers = {out: n.op_type for n in canonical.graph.node for out in n.output}
    attention = [n for n in canonical.graph.node if n.op_type == "Attention"]
    assert len(attention) == 2
    for node in attention:
        assert producers[node.input[1]] == "RotaryEmbedding"  # rotated K, not repeated
        assert producers.get(node.input[2]) != "Reshape"
    rule = next(r for r in report.rules if r.name == "remove-repeat-kv")
    assert rule.rewritten == 2
    assert_equivalent(original, canonical)


def test_repeat_on_other_axis_is_kept_and_layer_not_fused():
    model = ir.from_proto(build_decoder(DecoderConfig(style="torch23", layers=1)))
    axes = ir.Value(name="axes_bad", const_value=ir.tensor([1], dtype=ir.DataType.INT64))
    model.graph.initializers["axes_bad"] = axes
    for node in model.graph:
        if node.op_type == "Unsqueeze" and node.inputs[0].name == "present.0.key":
            node.replace_input_with(1, axes)
    for ep in ("default", "cpu"):
        optimized, report = epfuse.optimize_with_report(
            ir.to_proto(model), ep, validate_output=False
        )
        rule = next(r for r in report.rules if r.name == "remove-repeat-kv")
        assert rule.rewritten == 0 and rule.kept == 1
        assert any("axis other than 2" in r for r in report.layers[0].reasons)
        assert not report.layers[0].fused
        assert not [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]


def test_kv_concat_moves_into_attention_past():
    original = build_decoder(DecoderConfig(style="torch23"))
    canonical = epfuse.optimize(original, "default")
    attention = [n for n in canonical.graph.node if n.op_type == "Attention"]
    assert len(attention) == 2
    for i, node in enumerate(attention):
        assert node.input[4:6] == [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        assert node.output[1:3] == [f"present.{i}.key", f"present.{i}.value"]
    assert "Concat" not in {
        n.op_type for n in canonical.graph.node if n.output[0].startswith("present")
    }
    assert [o.name for o in canonical.graph.output] == [o.name for o in original.graph.output]
    onnx.checker.check_model(canonical)
    assert_equivalent(original, canonical)


@pytest.mark.parametrize(("start", "end"), [(None, None), (2, 3)])
def test_shape_of_the_repeated_kv_reads_the_source(start, end):
    """transformers 4.x slices the mask to ``key_states.shape[-2]`` after repeat_kv: that Shape
    must read the unrepeated K (times the repeats on the head axis), or it keeps repeat_kv alive
    and, once the KV concat is the Attention's present, makes the Attention read itself."""
    import numpy as np
    import onnxruntime as ort

    model = ir.from_proto(build_decoder(DecoderConfig(style="torch23", layers=1)))
    attention = next(n for n in model.graph if n.op_type == "Attention")
    attrs = {} if start is None else {"start": start, "end": end}
    shape = ir.node("Shape", [attention.inputs[1]], attrs, name="repeated_k_shape")
    ident = ir.node("Identity", [shape.outputs[0]], name="k_shape_out")
    ident.outputs[0].name = "k_shape"
    model.graph.append(shape)
    model.graph.append(ident)
    model.graph.outputs.append(ident.outputs[0])
    original = ir.to_proto(model)
    canonical, report = epfuse.optimize_with_report(original, "default")
    rule = next(r for r in report.rules if r.name == "remove-repeat-kv")
    assert rule.rewritten == 1 and not report.warnings, report.warnings
    # the repeat is gone (its Shape no longer keeps the Expand of K alive) and the KV concat
    # moved into the Attention (no cycle: the run was not repeated without a rule)
    expanded = {n.input[0] for n in canonical.graph.node if n.op_type == "Expand"}
    assert not any(name.startswith("present") for name in expanded), expanded
    kv = next(r for r in report.rules if r.name == "kv-concat-to-attention-past")
    assert kv.rewritten == 1

    def k_shape(proto):
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        feeds = {}
        for i in sess.get_inputs():
            dims = [2 if d == "batch" else 3 if not isinstance(d, int) else d for d in i.shape]
            if i.name.startswith("past"):
                dims[2] = 4
            if i.name == "attention_mask":
                dims[1] = 7  # past 4 + 3 new tokens
            kind = np.int64 if "int64" in i.type else np.float32
            feeds[i.name] = np.ones(dims, kind)
        return sess.run(["k_shape"], feeds)[0]

    np.testing.assert_array_equal(k_shape(canonical), k_shape(original))
