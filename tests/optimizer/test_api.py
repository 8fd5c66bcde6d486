"""The public API on the bundled torch.onnx export: types in and out, no input mutation,
external data, and equivalence of the fused model in every scenario."""

import onnx
import onnx_ir as ir
import pytest

import epfuse
from epfuse.optimizer.io import load_model, save_model
from epfuse.optimizer.verify import assert_equivalent


def _count(model, op):
    nodes = model.graph.node if isinstance(model, onnx.ModelProto) else model.graph
    return sum(n.op_type == op for n in nodes)


def test_bundled_export_fuses_every_layer_and_stays_equal(example_model):
    optimized, report = epfuse.optimize_with_report(example_model, "cpu")
    assert isinstance(optimized, ir.Model)
    assert report.fused_layers == len(report.layers) == 2
    assert all(layer.result == "GroupQueryAttention(do_rotary=1)" for layer in report.layers)
    proto = ir.to_proto(optimized)
    assert _count(proto, "GroupQueryAttention") == 2
    for op in ("Attention", "RotaryEmbedding", "Cos", "Sin", "Expand", "GatherND", "Concat"):
        assert _count(proto, op) == 0, op
    # names of the signature are unchanged
    original = onnx.load(str(example_model))
    assert [i.name for i in proto.graph.input] == [i.name for i in original.graph.input]
    assert [o.name for o in proto.graph.output] == [o.name for o in original.graph.output]
    assert_equivalent(original, proto, prompt_len=9)


def test_proto_in_proto_out_and_input_untouched(example_model):
    original = onnx.load(str(example_model))
    before = original.SerializeToString()
    optimized = epfuse.optimize(original, "CPUExecutionProvider")
    assert isinstance(optimized, onnx.ModelProto)
    assert original.SerializeToString() == before
    assert _count(optimized, "GroupQueryAttention") == 2


def test_ir_in_ir_out_and_input_untouched(example_model):
    model = ir.load(example_model)
    nodes = len(model.graph)
    optimized = epfuse.optimize(model, "cpu")
    assert isinstance(optimized, ir.Model) and optimized is not model
    assert len(model.graph) == nodes and _count(model, "Attention") == 2


def test_unknown_ep_raises_value_error(example_model):
    with pytest.raises(ValueError, match="known: cpu, cuda, dml"):
        epfuse.optimize(example_model, ep="npu")


def test_external_data_round_trip(tmp_path, example_model):
    source = tmp_path / "ext.onnx"
    save_model(load_model(example_model), source, external_data=True)
    assert (tmp_path / "ext.onnx.data").exists()
    optimized = epfuse.optimize(source, "cpu")
    out = tmp_path / "out" / "opt.onnx"
    save_model(optimized, out)
    assert (out.parent / "opt.onnx.data").exists()  # stays external, like its input
    assert sorted(p.name for p in out.parent.iterdir()) == ["opt.onnx", "opt.onnx.data"]
    assert_equivalent(onnx.load(str(example_model)), str(out), scenarios=("prompt", "decode"))


def test_max_seq_len_sets_cache_rows(example_model):
    optimized = epfuse.optimize(onnx.load(str(example_model)), "cpu", max_seq_len=128)
    gqa = next(n for n in optimized.graph.node if n.op_type == "GroupQueryAttention")
    cos = next(i for i in optimized.graph.initializer if i.name == gqa.input[7])
    assert list(cos.dims) == [128, 8]
    report = epfuse.read_report(optimized)
    assert report.options["max_seq_len"] == 128
    assert any("<= 128" in a for a in report.assumptions)
