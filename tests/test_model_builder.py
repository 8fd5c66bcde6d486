"""Tests for tests/model_builder.py: both graph styles build, load, run, agree with each other and
with an independent float64 numpy Llama."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from model_builder import (
    DecoderConfig,
    build_decoder,
    decoder_feeds,
    decoder_weights,
    input_names,
    output_names,
)

STYLES = ("torch23", "mobius", "torch18")

# Variants cross-checked style against style and against the numpy reference.
VARIANTS = {
    "full": {},
    "partial": {"rotary_dim": 8},
    "interleaved": {"interleaved": True},
    "partial_interleaved": {"rotary_dim": 8, "interleaved": True},
    "softcap": {"softcap": 5.0},
    "window": {"sliding_window": 3},  # shorter than the 7-token prompt
    "mha": {"kv_heads": 4},  # no repeat_kv in the torch23 graph
    "mqa_window_softcap": {"kv_heads": 1, "sliding_window": 4, "softcap": 3.0},
    "qk_norm": {"qk_norm": True},
    "qkv_bias": {"qkv_bias": True},
    "qk_norm_bias_partial": {"qk_norm": True, "qkv_bias": True, "rotary_dim": 8},
}

PROMPT = np.array([[3, 17, 42, 99, 5, 64, 120], [7, 8, 9, 10, 11, 0, 0]], dtype=np.int64)
PROMPT_MASK = np.array([[1] * 7, [1] * 5 + [0] * 2], dtype=np.int64)  # row 1: right-padded
CHUNK = np.array([[33, 2, 77]], dtype=np.int64)
DECODE = np.array([[61]], dtype=np.int64)


@functools.cache
def _session(cfg: DecoderConfig) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    model = build_decoder(cfg)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _run(cfg: DecoderConfig, ids, mask=None, past=None) -> list[np.ndarray]:
    return _session(cfg).run(None, decoder_feeds(cfg, ids, attention_mask=mask, past=past))


def _scenario(cfg: DecoderConfig) -> dict[str, list[np.ndarray]]:
    """A right-padded batch-2 prompt, then on row 0 alone a 3-token chunk and a 1-token decode."""
    prompt = _run(cfg, PROMPT, PROMPT_MASK)
    past = [t[:1] for t in prompt[1:]]
    chunk = _run(cfg, CHUNK, past=past)
    decode = _run(cfg, DECODE, past=chunk[1:])
    return {"prompt": prompt, "chunk": chunk, "decode": decode}


# --------------------------------------------------------------------------------------------
# Independent float64 reference (HF Llama semantics), one unpadded sequence at a time.


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rope(t: np.ndarray, cfg: DecoderConfig) -> np.ndarray:
    """Rotate (heads, S, head_dim) by positions 0..S-1."""
    r = cfg.rotary_dim or cfg.head_dim
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, r, 2) / r)
    ang = np.arange(t.shape[1])[:, None] * freqs[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    rot, rest = t[..., :r], t[..., r:]
    if cfg.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return np.concatenate([out, rest], axis=-1)


def reference_decoder(cfg: DecoderConfig, ids: np.ndarray):
    """Logits (S, vocab) and per-layer rotated keys / values (kv_heads, S, head_dim)."""
    w = {k: v.astype(np.float64) for k, v in decoder_weights(cfg).items()}
    n, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    s = len(ids)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = j <= i
    if cfg.sliding_window is not None:
        allowed &= j > i - cfg.sliding_window
    x = w["model.embed_tokens.weight"][ids]
    keys, values = [], []
    for layer in range(cfg.layers):
        p = f"model.layers.{layer}"
        h = _rms(x, w[f"{p}.input_layernorm.weight"])
        proj = {}
        for name, heads in (("q", n), ("k", kv), ("v", kv)):
            t = h @ w[f"{p}.self_attn.{name}_proj.weight"]
            if cfg.qkv_bias:
                t = t + w[f"{p}.self_attn.{name}_proj.bias"]
            t = t.reshape(s, heads, hd)
            if cfg.qk_norm and name != "v":
                t = _rms(t, w[f"{p}.self_attn.{name}_norm.weight"])
            proj[name] = t.transpose(1, 0, 2)
        q, k, v = proj["q"], proj["k"], proj["v"]
        q, k = _rope(q, cfg), _rope(k, cfg)
        keys.append(k)
        values.append(v)
        k, v = np.repeat(k, n // kv, axis=0), np.repeat(v, n // kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        if cfg.softcap:
            scores = cfg.softcap * np.tanh(scores / cfg.softcap)
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ v).transpose(1, 0, 2).reshape(s, n * hd)
        x = x + y @ w[f"{p}.self_attn.o_proj.weight"]
        h = _rms(x, w[f"{p}.post_attention_layernorm.weight"])
        gate = h @ w[f"{p}.mlp.gate_proj.weight"]
        act = gate / (1.0 + np.exp(-gate)) * (h @ w[f"{p}.mlp.up_proj.weight"])
        x = x + act @ w[f"{p}.mlp.down_proj.weight"]
    logits = _rms(x, w["model.norm.weight"]) @ w["lm_head.weight"]
    return logits, keys, values


def _check_against_reference(cfg: DecoderConfig, out: dict, tol: float) -> None:
    seq0 = np.concatenate([PROMPT[0], CHUNK[0], DECODE[0]])
    logits, keys, values = reference_decoder(cfg, seq0)
    got = np.concatenate([out["prompt"][0][0], out["chunk"][0][0], out["decode"][0][0]])
    np.testing.assert_allclose(got.astype(np.float64), logits, rtol=tol, atol=tol)
    presents = out["decode"][1:]
    for layer in range(cfg.layers):
        k, v = presents[2 * layer][0], presents[2 * layer + 1][0]
        np.testing.assert_allclose(k.astype(np.float64), keys[layer], rtol=tol, atol=tol)
        np.testing.assert_allclose(v.astype(np.float64), values[layer], rtol=tol, atol=tol)
    # Row 1 of the padded prompt equals its unpadded 5-token computation.
    n1 = int(PROMPT_MASK[1].sum())
    logits1, keys1, _ = reference_decoder(cfg, PROMPT[1, :n1])
    got1 = out["prompt"][0][1, :n1].astype(np.float64)
    np.testing.assert_allclose(got1, logits1, rtol=tol, atol=tol)
    got_k1 = out["prompt"][1][1, :, :n1].astype(np.float64)
    np.testing.assert_allclose(got_k1, keys1[0], rtol=tol, atol=tol)


# --------------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_builds_and_checks(style: str, dtype: str) -> None:
    cfg = DecoderConfig(style=style, dtype=dtype)
    model = build_decoder(cfg)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    opset = 18 if style == "torch18" else 23
    assert [(o.domain, o.version) for o in model.opset_import] == [("", opset)]
    if style == "torch18":
        ops = {n.op_type for n in model.graph.node}
        assert not ops & {"Attention", "RotaryEmbedding", "RMSNormalization"}
    assert [i.name for i in model.graph.input] == input_names(cfg)
    assert [o.name for o in model.graph.output] == output_names(cfg)
    elem = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert elem["input_ids"] == onnx.TensorProto.INT64
    assert elem["past_key_values.0.key"] == cfg.onnx_dtype
    assert model.graph.output[0].type.tensor_type.elem_type == cfg.onnx_dtype


def test_deterministic_from_seed() -> None:
    cfg = DecoderConfig()
    assert build_decoder(cfg).SerializeToString() == build_decoder(cfg).SerializeToString()
    a = decoder_weights(cfg)["model.layers.0.self_attn.q_proj.weight"]
    b = decoder_weights(dataclasses.replace(cfg, seed=1))["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(a, b)
    assert decoder_weights(cfg).keys() == decoder_weights(dataclasses.replace(cfg, seed=1)).keys()


def test_torch23_structure() -> None:
    cfg = DecoderConfig(layers=2, rotary_dim=8, interleaved=True, sliding_window=4)
    nodes = build_decoder(cfg).graph.node
    ops = Counter(n.op_type for n in nodes)
    assert ops["Attention"] == 2 and ops["RotaryEmbedding"] == 4
    assert ops["Cos"] == ops["Sin"] == 4  # one pair per RotaryEmbedding, as the exporter does
    assert ops["GatherND"] == 1 and ops["LessOrEqual"] == 1 and ops["Greater"] == 1
    assert ops["Expand"] == 2 + 1 + 4  # gather index (2), mask (1), repeat_kv (2 per layer)
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type == "Attention":
            assert len(n.input) == 4 and len(n.output) == 1
            assert attrs["is_causal"] == 0 and attrs["scale"] == pytest.approx(0.25)
        if n.op_type == "RotaryEmbedding":
            assert len(n.input) == 3
            assert attrs["interleaved"] == 1 and attrs["rotary_embedding_dim"] == 8
    presents = {n.output[0]: n for n in nodes if n.output[0].startswith("present.")}
    assert {n.op_type for n in presents.values()} == {"Concat"}
    assert len(presents) == 4


def test_mobius_structure() -> None:
    cfg = DecoderConfig(style="mobius", layers=2)
    model = build_decoder(cfg)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Attention"] == 2 and ops["RotaryEmbedding"] == 4
    assert ops["Concat"] == 1 and ops["Cos"] == 0  # only the mask's expand shape
    for n in model.graph.node:
        if n.op_type == "Attention":
            assert list(n.output[1:]) == [
                n.input[4].replace("past_key_values", "present"),
                n.input[5].replace("past_key_values", "present"),
            ]
        if n.op_type == "RotaryEmbedding":
            assert n.input[1:] == ["cos_cache", "sin_cache", "position_ids"]
    caches = {i.name: i for i in model.graph.initializer}
    assert list(caches["cos_cache"].dims) == [cfg.max_positions, cfg.head_dim // 2]


@pytest.mark.parametrize("style", STYLES)
def test_runs_prompt_decode_padded(style: str) -> None:
    cfg = DecoderConfig(style=style)
    out = _scenario(cfg)
    assert out["prompt"][0].shape == (2, 7, cfg.vocab)
    assert out["prompt"][1].shape == (2, cfg.kv_heads, 7, cfg.head_dim)
    assert out["chunk"][1].shape == (1, cfg.kv_heads, 10, cfg.head_dim)
    assert out["decode"][0].shape == (1, 1, cfg.vocab)
    assert out["decode"][1].shape == (1, cfg.kv_heads, 11, cfg.head_dim)
    for step in out.values():
        assert all(np.isfinite(t).all() for t in step)
    # Realistic scale: attention is not uniform, so positions change the logits.
    assert np.abs(out["prompt"][0][0]).max() > 1.0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_styles_agree_and_match_reference(variant: str) -> None:
    base = DecoderConfig(**VARIANTS[variant])
    torch23 = _scenario(base)
    mobius = _scenario(dataclasses.replace(base, style="mobius"))
    n1 = int(PROMPT_MASK[1].sum())
    for step in torch23:
        a, b = torch23[step], mobius[step]
        if step == "prompt":  # valid rows only
            np.testing.assert_allclose(a[0][0], b[0][0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(a[0][1, :n1], b[0][1, :n1], rtol=1e-4, atol=1e-4)
            for x, y in zip(a[1:], b[1:], strict=True):
                np.testing.assert_allclose(x[0], y[0], rtol=1e-4, atol=1e-4)
                np.testing.assert_allclose(x[1, :, :n1], y[1, :, :n1], rtol=1e-4, atol=1e-4)
        else:
            for x, y in zip(a, b, strict=True):
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)
    _check_against_reference(base, torch23, tol=1e-4)
    _check_against_reference(dataclasses.replace(base, style="mobius"), mobius, tol=1e-4)


def test_reference_sees_mask_and_rope() -> None:
    """Guard on the test itself: the variants change the reference's answer."""
    seq = np.concatenate([PROMPT[0], CHUNK[0], DECODE[0]])
    base, _, _ = reference_decoder(DecoderConfig(), seq)
    for variant in ("partial", "interleaved", "softcap", "window"):
        other, _, _ = reference_decoder(DecoderConfig(**VARIANTS[variant]), seq)
        assert np.abs(other[-1] - base[-1]).max() > 0.05, variant


@pytest.mark.parametrize("style", STYLES)
def test_float16_runs(style: str) -> None:
    cfg = DecoderConfig(style=style, dtype="float16", sliding_window=5)
    out = _scenario(cfg)
    for step in out.values():
        assert all(t.dtype == np.float16 and np.isfinite(t).all() for t in step)
    _check_against_reference(cfg, out, tol=1e-2)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch18_matches_reference(variant: str) -> None:
    """The opset-18 decomposed form computes the same decoder as the reference."""
    cfg = DecoderConfig(**VARIANTS[variant], style="torch18")
    _check_against_reference(cfg, _scenario(cfg), tol=1e-4)
    split = dataclasses.replace(cfg, scale_form="scores", k_transpose="perm")
    _check_against_reference(split, _scenario(split), tol=1e-4)
