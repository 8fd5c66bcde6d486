"""shape-of-same-shape-op: a Shape read off the rotated Q (as TorchScript traces do) no longer
keeps Q's RotaryEmbedding alive once attention is fused, and still gives the same shape."""

import numpy as np
import onnx
import onnxruntime as ort
from model_builder import DecoderConfig, build_decoder, decoder_feeds

import epfuse
from epfuse.optimizer.verify import assert_equivalent


def _with_shape_of_rotated_q(cfg: DecoderConfig) -> onnx.ModelProto:
    model = build_decoder(cfg)
    graph = model.graph
    attention = next(n for n in graph.node if n.op_type == "Attention")
    rotary = next(
        n
        for n in graph.node
        if n.op_type == "RotaryEmbedding" and n.output[0] in attention.input[:1]
    )
    graph.node.append(onnx.helper.make_node("Shape", [rotary.output[0]], ["q_shape"]))
    graph.output.append(onnx.helper.make_tensor_value_info("q_shape", onnx.TensorProto.INT64, [4]))
    return model


def _run(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def test_shape_of_rotated_q_reads_q_and_the_rotation_fuses():
    cfg = DecoderConfig(style="torch23", layers=1)
    original = _with_shape_of_rotated_q(cfg)
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rule = next(r for r in report.rules if r.name == "shape-of-same-shape-op")
    assert rule.rewritten == 1, report.summary()
    assert report.layers[0].result == "GroupQueryAttention(do_rotary=1)", report.summary()
    ops = [n.op_type for n in optimized.graph.node]
    assert "RotaryEmbedding" not in ops, ops  # both rotations are inside GQA now
    feeds = decoder_feeds(cfg, np.arange(10, dtype=np.int64).reshape(2, 5))
    want, got = _run(original, feeds), _run(optimized, feeds)
    np.testing.assert_array_equal(got["q_shape"], want["q_shape"])


def test_without_the_extra_shape_nothing_is_rewritten():
    original = build_decoder(DecoderConfig(style="torch23"))
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    rule = next(r for r in report.rules if r.name == "shape-of-same-shape-op")
    assert rule.rewritten == 0 and rule.kept == 0
    assert_equivalent(original, optimized)
