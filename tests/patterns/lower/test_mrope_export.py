"""Real torch.onnx exports (opset 23) of tiny random-weight Qwen2.5-VL (sectioned mRoPE) and
Qwen3-VL (interleaved) text decoders: the export matches torch, and the optimized graphs
(MRotaryEmbedding on cpu, per-stream caches + Where without it, standard ONNX for default)
match the export on text-only and image-like positions."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from model_builder import image_positions

import epfuse
from epfuse.capabilities import get_ep
from epfuse.optimizer.verify import assert_equivalent, compare_models
from epfuse.testing.hf_export import (
    export_hf_mrope_decoder,
    hf_mrope_reference,
    past_input_names,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl_config,
)

# torch and transformers are optional (the ``export`` extra); hf_export imports them lazily.
pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LENGTHS = dict(prompt_len=10, decode_past_len=9, chunk_past_len=6, chunk_len=4)
FAMILIES = {
    "qwen2.5-vl": (tiny_qwen2_5_vl_config, [2, 3, 3], 0),
    "qwen3-vl": (tiny_qwen3_vl_config, [4, 2, 2], 1),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
    make_config, sections, layout = FAMILIES[request.param]
    path = tmp_path_factory.mktemp("mrope") / f"{request.param}.onnx"
    config = make_config()
    export_hf_mrope_decoder(config, path, opset=23, seed=0)
    return config, onnx.load(path), sections, layout


def _cpu_without_mrotary():
    return get_ep("cpu").variant("cpu-no-mrope", mrotary_embedding=False)


def _ops(model) -> set[str]:
    return {n.op_type for n in model.graph.node}


def test_export_matches_torch_on_image_positions(exported):
    config, model, _, _ = exported
    pos = next(i for i in model.graph.input if i.name == "position_ids")
    assert pos.type.tensor_type.shape.dim[0].dim_value == 3
    assert "RotaryEmbedding" not in _ops(model)  # the exporter leaves mRoPE as arithmetic
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, (2, 10))
    mask = np.ones((2, 10), np.int64)
    positions = image_positions(np.tile(np.arange(10), (2, 1)))
    ref, _ = hf_mrope_reference(config, 0, ids, mask, positions)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    for name in past_input_names(2):
        feeds[name] = np.zeros((2, 2, 0, 16), np.float32)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref, atol=1e-4, rtol=1e-4)


def test_cpu_lowers_to_mrotary_and_gqa_without_rotary(exported):
    _, original, sections, layout = exported
    optimized, report = epfuse.optimize_with_report(original, "cpu")
    proto = optimized
    rotations = [n for n in proto.graph.node if n.op_type == "MRotaryEmbedding"]
    assert len(rotations) == 4
    for node in rotations:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["mrope_section"] == sections and attrs["mrope_layout"] == layout
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 2
    for node in gqa:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["do_rotary"] == 0 and len(node.input) <= 7
    assert not _ops(proto) & {"Cos", "Sin", "Where", "Split"}  # nothing recomputed at run time
    assert all("3-D mRoPE positions" in " ".join(layer.notes) for layer in report.layers)
    assert_equivalent(original, optimized, **LENGTHS)
    assert_equivalent(original, optimized, position_streams=image_positions, **LENGTHS)


def test_plain_rotation_paths_match(exported):
    _, original, _, _ = exported
    fused = epfuse.optimize(original, "cpu")
    for ep in (_cpu_without_mrotary(), "default"):
        plain = epfuse.optimize(original, ep)
        ops = _ops(plain)
        assert "MRotaryEmbedding" not in ops and "RotaryEmbedding" in ops and "Where" in ops
        assert not ops & {"Cos", "Sin"}  # constant per-stream caches
        assert_equivalent(original, plain, **LENGTHS)
        assert_equivalent(original, plain, position_streams=image_positions, **LENGTHS)
        same = compare_models(fused, plain, position_streams=image_positions, **LENGTHS)
        assert same.passed, str(same)


def test_eps_without_rotary_ops_keep_the_arithmetic_and_say_why(exported):
    _, original, _, _ = exported
    optimized, report = epfuse.optimize_with_report(original, "dml")
    assert "RotaryEmbedding" not in _ops(optimized) and "MRotaryEmbedding" not in _ops(optimized)
    for layer in report.layers:
        # The lifted mRoPE rotation (cos/sin mixed per stream) has no rotary op on these EPs:
        # legalization expands it back to arithmetic, and the layer says why RoPE is outside.
        assert "3-D mRoPE positions" in " ".join(layer.notes)
