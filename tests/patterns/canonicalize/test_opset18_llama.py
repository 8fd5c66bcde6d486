"""The real torch.onnx opset-18 export of a tiny Hugging Face Llama: the canonicalize rules
lift it to Attention/RotaryEmbedding/RMSNormalization, and the unchanged GQA lowering fuses
every layer on CPU; each result is checked for equivalence in all four scenarios."""

from __future__ import annotations

import onnx
import pytest

import epfuse
from epfuse.optimizer.verify import assert_equivalent
from epfuse.testing.hf_export import export_hf_decoder, tiny_llama_config

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LAYERS = 2
DECOMPOSED = {"Softmax", "Cos", "Sin", "Neg", "IsNaN", "Pow", "ReduceMean", "Reciprocal"}


@pytest.fixture(scope="module", params=["float32", "float16"])
def export18(request, tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("llama18") / f"llama18-{request.param}.onnx"
    export_hf_decoder(tiny_llama_config(), path, opset=18, dtype=request.param)
    model = onnx.load(str(path))
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Attention", "RotaryEmbedding", "RMSNormalization"}  # really decomposed
    assert {"Softmax", "Neg", "Pow"} <= ops
    return str(path), request.param


def test_cpu_fuses_every_layer_to_gqa_with_rotary(export18):
    path, dtype = export18
    optimized, report = epfuse.optimize_with_report(path, "cpu")
    assert report.dtype == dtype
    assert [layer.result for layer in report.layers] == ["GroupQueryAttention(do_rotary=1)"] * (
        LAYERS
    )
    assert all("causal + padding" in layer.notes for layer in report.layers)
    ops = [n.op_type for n in optimized.graph]
    assert ops.count("GroupQueryAttention") == LAYERS
    assert ops.count("RMSNormalization") == 2 * LAYERS + 1
    assert not DECOMPOSED & set(ops)
    assert not {"Attention", "RotaryEmbedding"} & set(ops)
    assert optimized.opset_imports[""] == 23
    result = assert_equivalent(path, optimized)
    assert result.passed


def test_default_ep_gives_standard_onnx(export18):
    path, _ = export18
    optimized = epfuse.optimize(path, "default")
    ops = [n.op_type for n in optimized.graph]
    assert ops.count("Attention") == LAYERS
    assert ops.count("RotaryEmbedding") == 2 * LAYERS
    assert ops.count("RMSNormalization") == 2 * LAYERS + 1
    assert not DECOMPOSED & set(ops)
    assert all(n.domain in ("", "ai.onnx") for n in optimized.graph)
    attention = [n for n in optimized.graph if n.op_type == "Attention"]
    assert all(len(n.inputs) >= 6 and n.inputs[4] is not None for n in attention)  # past K/V
    assert_equivalent(path, optimized)
