"""rope-cos-sin-to-caches: run-time cos/sin become proven constant caches."""

import numpy as np
import onnx
import onnx_ir as ir
from model_builder import DecoderConfig, build_decoder, rope_caches

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _ropes(model):
    return [n for n in model.graph.node if n.op_type == "RotaryEmbedding"]


def test_caches_replace_run_time_cos_sin_and_match_float64():
    cfg = DecoderConfig(style="torch23", head_dim=32, rotary_dim=16)
    original = build_decoder(cfg)
    canonical = epfuse.optimize(original, "default", max_seq_len=256)
    ropes = _ropes(canonical)
    assert len(ropes) == 2 * cfg.layers
    assert not {n.op_type for n in canonical.graph.node} & {"Cos", "Sin"}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in canonical.graph.initializer}
    ref_cos, ref_sin = rope_caches(DecoderConfig(head_dim=32, rotary_dim=16, max_positions=256))
    for node in ropes:
        assert len(node.input) == 4 and node.input[3] == "position_ids"
        # the graph stores inv_freq in fp32; the caches are exact for that constant
        np.testing.assert_allclose(inits[node.input[1]], ref_cos, atol=2e-6)
        np.testing.assert_allclose(inits[node.input[2]], ref_sin, atol=2e-6)
    # one pair of caches shared by every layer
    assert len({(n.input[1], n.input[2]) for n in ropes}) == 1
    assert_equivalent(original, canonical)


def test_cos_sin_not_matching_inv_freq_are_kept():
    """A graph whose sin uses other frequencies than its cos is not rewritten."""
    cfg = DecoderConfig(style="torch23", layers=1)
    model = ir.from_proto(build_decoder(cfg))
    graph = model.graph
    mul = next(n for n in graph if n.op_type == "Mul" and n.outputs[0].name == "freqs")
    doubled = ir.node("Add", [mul.outputs[0], mul.outputs[0]], name="double")
    doubled.outputs[0].name = "freqs2"
    graph.insert_after(mul, doubled)
    for node in graph:
        if node.op_type == "Sin":
            node.replace_input_with(0, doubled.outputs[0])
    original = ir.to_proto(model)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rule = next(r for r in report.rules if r.name == "rope-cos-sin-to-caches")
    assert rule.rewritten == 0 and rule.kept == 2
    gqa = [n for n in optimized.graph.node if n.op_type == "GroupQueryAttention"]
    assert all(a.i == 0 for n in gqa for a in n.attribute if a.name == "do_rotary")
    assert_equivalent(original, optimized)
