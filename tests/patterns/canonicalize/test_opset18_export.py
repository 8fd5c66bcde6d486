"""Real torch.onnx opset-18 exports of tiny Hugging Face Llama (dynamo fp32 and fp16, and a
direct TorchScript ``dynamo=False`` export with its traced Shape/Gather/Concat reshapes and
``Where`` mask) and Cohere (interleaved RoPE; Gemma-2 and the other families at opset 18 are
in tests/families/test_families_opset18.py): the canonicalize rules lift them to
Attention/RotaryEmbedding/RMSNormalization, and the unchanged GQA lowering fuses every layer on
CPU; each result is checked for equivalence in all scenarios."""

from __future__ import annotations

import onnx
import pytest

import epfuse
from epfuse.optimizer.verify import assert_equivalent
from epfuse.testing.hf_export import export_hf_decoder, tiny_llama_config
from epfuse.testing.hf_families import tiny_dims

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

LAYERS = 2
DECOMPOSED = {"Softmax", "Cos", "Sin", "Neg", "IsNaN", "Pow", "ReduceMean", "Reciprocal"}
# On CPU the lifted RMSNormalization is lowered further (with the residual Add) when it can be.
NORMS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


def _norms(ops: list[str]) -> int:
    return sum(ops.count(name) for name in NORMS)


@pytest.fixture(scope="module", params=["float32", "float16", "float32-torchscript"])
def export18(request, tmp_path_factory) -> tuple[str, str]:
    dtype, _, exporter = request.param.partition("-")
    path = tmp_path_factory.mktemp("llama18") / f"llama18-{request.param}.onnx"
    export_hf_decoder(
        tiny_llama_config(), path, opset=18, dtype=dtype, dynamo=exporter != "torchscript"
    )
    model = onnx.load(str(path))
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Attention", "RotaryEmbedding", "RMSNormalization"}  # really decomposed
    assert {"Softmax", "Neg", "Pow"} <= ops
    return str(path), dtype


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
    assert _norms(ops) == 2 * LAYERS + 1
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


@pytest.fixture(scope="module")
def cohere_export18(tmp_path_factory) -> str:
    """Cohere at opset 18: interleaved RoPE (strided Slices, stack, Reshape on
    repeat_interleave'd cos/sin) and a mean-centred norm."""
    from transformers import CohereConfig

    config = CohereConfig(
        **tiny_dims(),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("cohere18") / "cohere-18.onnx"
    export_hf_decoder(config, path, opset=18)
    return str(path)


def test_cohere_interleaved_rope_fuses(cohere_export18):
    optimized, report = epfuse.optimize_with_report(cohere_export18, "cpu")
    assert [layer.result for layer in report.layers] == ["GroupQueryAttention(do_rotary=1)"] * 2
    for node in optimized.graph:
        if node.op_type == "GroupQueryAttention":
            assert node.attributes["rotary_interleaved"].value == 1
    ops = {n.op_type for n in optimized.graph}
    assert not {"Softmax", "Neg", "Cos", "Sin", "Slice"} & ops
    assert_equivalent(cohere_export18, optimized)
