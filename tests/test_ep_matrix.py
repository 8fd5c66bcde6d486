"""Every registered EP x {float32, float16, bfloat16} on builder graphs.

For each cell:

* the output contains only ops/attributes the EP's record allows for the dtype
  (``epfuse.capabilities.conformance.check``: each node mapped to the record flags it
  needs), input ops included: what the record lacks was legalized (an op it has, or the
  op's primitive expansion), so every EP returns a model for every family;
* no feature is lost: softcap, sliding window (GQA ``local_window_size`` or an Attention that
  still reads its mask), interleaved and partial rotations, q/k norms are all present in
  some form;
* wherever the output is runnable on ORT CPU (float32/float16, no op without a CPU kernel,
  no GQA q/k-norm inputs, which the CPU kernel rejects) it equals the unfused graph.

``MATRIX_PATHS`` collects which path each cell took; ``test_matrix_summary`` prints it (run
with ``-s``) and checks the paths the issue asks for.
"""

from __future__ import annotations

import functools

import onnx
import pytest
from model_builder import DecoderConfig, build_decoder

import epfuse
from epfuse.capabilities import DTYPES, all_eps
from epfuse.capabilities.conformance import check, features
from epfuse.optimizer.verify import assert_equivalent

MODELS = {
    # Llama, torch.onnx opset-23 form (run-time cos/sin, repeat_kv, Concat cache).
    "llama-torch23": DecoderConfig(style="torch23"),
    # Gemma-2 style: logit softcap + sliding window; prompts below run past the window.
    "gemma2-mobius": DecoderConfig(style="mobius", softcap=5.0, sliding_window=4),
    "gemma2-torch23": DecoderConfig(style="torch23", softcap=5.0, sliding_window=4, layers=1),
    # GLM style: interleaved partial rotary.
    "glm-mobius": DecoderConfig(style="mobius", head_dim=32, rotary_dim=16, interleaved=True),
    "glm-torch23": DecoderConfig(
        style="torch23", head_dim=32, rotary_dim=16, interleaved=True, layers=1
    ),
    # Qwen3 style q/k norm; Qwen2 style q/k/v biases.
    "qwen3-mobius": DecoderConfig(style="mobius", qk_norm=True),
    "qwen3-torch23": DecoderConfig(style="torch23", qk_norm=True, layers=1),
    "qwen2-bias-mobius": DecoderConfig(style="mobius", qkv_bias=True),
}
LONG = {"prompt_len": 9, "decode_past_len": 7, "chunk_past_len": 6}
EPS = [record.name for record in all_eps()]
MATRIX_PATHS: dict[tuple[str, str, str], str] = {}


@functools.cache
def _original(model: str, dtype: str) -> onnx.ModelProto:
    import dataclasses

    return build_decoder(dataclasses.replace(MODELS[model], dtype=dtype))


def _path(optimized: onnx.ModelProto, report) -> str:
    """A short description of what the attention and RoPE became."""
    parts = {
        f"{r.name.removeprefix('legalize-')}"
        for r in report.rules
        if r.stage == "legalize" and r.rewritten
    }
    for node in optimized.graph.node:
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "GroupQueryAttention":
            bits = [f"rot{a.get('do_rotary', 0)}"]
            if len(node.input) > 1 and not node.input[1]:
                bits.append("packed")
            if len(node.input) > 14 and node.input[14]:
                bits.append("qknorm")
            if a.get("softcap"):
                bits.append("softcap")
            if a.get("local_window_size", -1) != -1:
                bits.append("window")
            parts.add("GQA(" + ",".join(bits) + ")")
        elif node.op_type == "Attention":
            parts.add("Attention" + ("(softcap)" if a.get("softcap") else ""))
        elif node.op_type == "RotaryEmbedding":
            parts.add("ms-RoPE" if node.domain == "com.microsoft" else "RoPE")
        elif "Normalization" in node.op_type:
            parts.add(node.op_type.replace("Normalization", "Norm"))
    return " + ".join(sorted(parts))


def _runnable_on_cpu(optimized: onnx.ModelProto, report, dtype: str) -> bool:
    if dtype == "bfloat16":
        return False  # ORT CPU has no bf16 MatMul/attention: the original does not run either
    if any("not loaded on the CPU EP" in a for a in report.assumptions):
        return False
    return not any(
        n.op_type == "GroupQueryAttention" and len(n.input) > 14 and n.input[14]
        for n in optimized.graph.node
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ep", EPS)
@pytest.mark.parametrize("model", list(MODELS))
def test_matrix_cell(model: str, ep: str, dtype: str):
    cfg = MODELS[model]
    original = _original(model, dtype)
    optimized, report = epfuse.optimize_with_report(original, ep, precision=dtype)
    record = epfuse.get_ep(ep)

    # Strict: every node of the output is something the record takes, input ops included
    # (what the record lacks was legalized: to an op it has, or to primitives).
    conformance = check(optimized, record, dtype)
    assert not conformance.violations, conformance.violations
    assert all(layer.runs_on_ep for layer in report.layers)
    legalized = {r.name: r.rewritten for r in report.rules if r.stage == "legalize"}

    before, after = features(original, cfg.head_dim), features(optimized, cfg.head_dim)
    expanded = legalized.get("legalize-attention-to-primitives", 0)
    assert expanded == sum(
        layer.result.endswith("expanded to primitive ops") for layer in report.layers
    )
    assert after.attention_layers + expanded == before.attention_layers == cfg.layers
    # Features read off fused/standard ops; an expanded op carries them in primitives (its
    # ONNX function body), checked by equality on CPU below and by the Tanh count here.
    tanh = sum(n.op_type == "Tanh" for n in optimized.graph.node)
    assert len(after.softcaps) + (tanh if expanded else 0) == len(before.softcaps)
    assert set(after.softcaps) <= set(before.softcaps)
    if not legalized.get("legalize-rotary-embedding-to-primitives"):
        assert after.rotations == before.rotations
    if not legalized.get("legalize-rms-norm-to-primitives"):
        assert after.head_norms == before.head_norms
    if cfg.sliding_window and not expanded:
        windowed = after.windows.count(cfg.sliding_window) + after.masked_attention
        assert windowed == cfg.layers, after
    assert set(after.windows) <= {cfg.sliding_window} - {None, 0}

    MATRIX_PATHS[(model, ep, dtype)] = _path(optimized, report)
    if _runnable_on_cpu(optimized, report, dtype):
        assert_equivalent(original, optimized, **(LONG if cfg.sliding_window else {}))
        MATRIX_PATHS[(model, ep, dtype)] += "  [= on CPU]"


def test_matrix_summary():
    """Print the matrix (pytest -s) and check the headline paths."""
    for model in MODELS:
        for ep in EPS:
            for dtype in DTYPES:
                if (model, ep, dtype) not in MATRIX_PATHS:
                    test_matrix_cell(model, ep, dtype)
    width = max(len(f"{m} {e} {d}") for m, e, d in MATRIX_PATHS)
    for (model, ep, dtype), path in sorted(MATRIX_PATHS.items()):
        print(f"{model} {ep} {dtype}".ljust(width), path)
    paths = MATRIX_PATHS
    # GLM interleaved partial rotary on the separate-RoPE path (DML): contrib RoPE, GQA rot0.
    assert paths[("glm-mobius", "dml", "float16")].startswith("GQA(rot0) + SimplifiedLayerNorm")
    assert "ms-RoPE" in paths[("glm-mobius", "dml", "float16")]
    # Gemma-2 on CPU: softcap and window inside GQA with fused rotary.
    assert "GQA(rot1,packed,softcap,window)" in paths[("gemma2-mobius", "cpu", "float32")]
    # Qwen3 q/k norm inside GQA on CUDA half (then packable); kept ahead of GQA on WebGPU,
    # whose rotation must stay outside GQA, between the norm and the attention.
    assert "GQA(rot1,packed,qknorm)" in paths[("qwen3-mobius", "cuda", "float16")]
    assert "GQA(rot1,packed,qknorm)" in paths[("qwen3-torch23", "cuda", "bfloat16")]
    assert "qknorm" not in paths[("qwen3-mobius", "webgpu", "float16")]
    # TRT-RTX: neither its GQA nor its Attention applies softcap: the layer is expanded to
    # primitives (its Attention's ONNX function body), which TRT-RTX runs; equal on CPU.
    trt = paths[("gemma2-mobius", "trt-rtx", "float16")]
    assert "attention-to-primitives" in trt and "Attention" not in trt.split("+")[0]
    assert "[= on CPU]" in trt
    # Every cell returned a model (strict mode aside): nothing refused.
    assert len(paths) == len(MODELS) * len(EPS) * len(DTYPES)


@pytest.fixture(scope="module")
def qwen3_export(tmp_path_factory) -> onnx.ModelProto:
    from transformers import Qwen3Config

    from epfuse.testing.hf_export import export_hf_decoder
    from epfuse.testing.hf_families import tiny_dims

    config = Qwen3Config(**tiny_dims(vocab_size=128, max_position_embeddings=256))
    path = export_hf_decoder(config, tmp_path_factory.mktemp("qwen3") / "qwen3.onnx", opset=23)
    return onnx.load(path)


@pytest.mark.slow
@pytest.mark.parametrize("ep", EPS)
def test_real_qwen3_export_per_ep(qwen3_export, ep):
    """A real torch.onnx Qwen3 export (q/k norm on the head axis) through every EP at fp32."""
    optimized, report = epfuse.optimize_with_report(qwen3_export, ep, precision="fp32")
    conformance = check(optimized, epfuse.get_ep(ep), "float32", original=qwen3_export)
    assert not conformance.violations, conformance.violations
    before, after = features(qwen3_export, 16), features(optimized, 16)
    legalized = {r.name: r.rewritten for r in report.rules if r.stage == "legalize"}
    assert before.head_norms == 4
    # An op legalized to primitives carries its feature in its ONNX function body (checked by
    # equality below); every other EP keeps it in a norm/rotary/GQA op the features read.
    if legalized.get("legalize-rms-norm-to-primitives"):
        assert not any(n.op_type == "RMSNormalization" for n in optimized.graph.node)
    else:
        assert after.head_norms == 4
    if legalized.get("legalize-rotary-embedding-to-primitives"):
        assert not any(n.op_type == "RotaryEmbedding" for n in optimized.graph.node)
    else:
        assert before.rotations == after.rotations
    if ep in ("cpu", "dml", "webgpu"):
        assert report.fused_layers == 2
    if ep == "dml":
        assert all(
            n.domain == "com.microsoft" for n in optimized.graph.node if "Rotary" in n.op_type
        )
    assert_equivalent(qwen3_export, optimized, prompt_len=9, decode_past_len=7)
