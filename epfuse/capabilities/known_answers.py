"""Known answers: a tiny model per capability, run on one EP alone and compared with a float64
numpy reference at the dtype's tolerance (``epfuse.tolerances``).

Non-CPU EPs run with ``session.disable_cpu_ep_fallback``, so a silent fallback shows up as a
failure. :data:`KNOWN_ANSWERS` is keyed by ``emissions.Capability``. The models are built in
onnx_ir (:func:`_node` names the values, :func:`_run` wires them) and serialized once, for
the session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from epfuse.tolerances import tolerance_for

from .emissions import Capability

_B, _S, _N, _KV, _H, _M = 1, 5, 2, 1, 16, 16
_NP = {"float32": np.float32, "float16": np.float16}


@dataclasses.dataclass(frozen=True)
class _Op:
    """One node by value names ("" for an absent input or output), wired by :func:`_run`."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str
    attributes: dict[str, Any]


def _node(op_type: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> _Op:
    return _Op(op_type, tuple(inputs), tuple(outputs), domain, attrs)


def _run(
    nodes: list[_Op],
    inputs: dict[str, np.ndarray],
    outputs: list[str],
    provider: str,
    opset: int = 23,
) -> list[np.ndarray]:
    values = {
        name: ir.Value(
            name=name,
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
            shape=ir.Shape(array.shape),
        )
        for name, array in inputs.items()
    }
    graph_inputs = list(values.values())
    built = []
    for spec in nodes:
        node = ir.node(
            spec.op_type,
            [values[name] if name else None for name in spec.inputs],
            attributes=spec.attributes,
            domain=spec.domain,
            num_outputs=len(spec.outputs),
        )
        for value, name in zip(node.outputs, spec.outputs, strict=True):
            value.name = name  # "" stays absent in the serialized node
            if name:
                values[name] = value
        built.append(node)
    floats = [v for v in inputs.values() if v.dtype.kind == "f"]
    elem = ir.DataType.from_numpy(floats[0].dtype)
    for name in outputs:
        if values[name].type is None:
            values[name].type = ir.TensorType(elem)
    graph = ir.Graph(
        graph_inputs,
        [values[name] for name in outputs],
        nodes=built,
        opset_imports={"": opset, "com.microsoft": 1},
        name="probe",
    )
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if provider != "CPUExecutionProvider":
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    model = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    return session.run(outputs, inputs)


def rotate(x: np.ndarray, pos: np.ndarray, interleaved: bool, rotary: int = _H) -> np.ndarray:
    """The reference RoPE: x (B, heads, S, H) rotated at positions ``pos`` (S,) or (B, S)
    (base 10000, the first ``rotary`` channels of each head), in float64."""
    inv = 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)
    ang = np.expand_dims(pos, -2)[..., None] * inv  # (1 | B, 1, S, rotary / 2)
    cos, sin = np.cos(ang), np.sin(ang)
    rot, rest = x[..., :rotary], x[..., rotary:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(rot.shape)
    else:
        a, b = rot[..., : rotary // 2], rot[..., rotary // 2 :]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    return np.concatenate([out, rest], -1)


def _attend(q, k, v, softcap=0.0, window=None, sink=None):
    """Causal grouped attention on (B, heads, S, H) float64 arrays; ``sink`` (heads,) adds
    ``exp(sink[h])`` to each softmax denominator (an extra, dropped score column)."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    i, j = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = np.where(allowed, scores, -np.inf)
    if sink is not None:
        column = np.broadcast_to(sink[None, :, None, None], (*scores.shape[:3], 1))
        scores = np.concatenate([scores, column], -1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return (p[..., : v.shape[2]] if sink is not None else p) @ v


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _bsd(x):  # (B, heads, S, H) -> (B, S, heads*H)
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


def _gqa_case(
    dtype,
    provider,
    *,
    rotary=False,
    interleaved=False,
    softcap=0.0,
    window=None,
    packed=False,
    qk_norm=False,
    sink=False,
):
    rng = np.random.default_rng(0)
    t = _NP[dtype]
    q = rng.standard_normal((_B, _N, _S, _H)).astype(t)
    k = rng.standard_normal((_B, _KV, _S, _H)).astype(t)
    v = rng.standard_normal((_B, _KV, _S, _H)).astype(t)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    feeds = {
        "past_k": np.zeros((_B, _KV, 0, _H), t),
        "past_v": np.zeros((_B, _KV, 0, _H), t),
        "seqlens_k": np.array([_S - 1], np.int32),
        "total": np.array(_S, np.int32),
    }
    if packed:
        feeds["query"] = np.concatenate([_bsd(q), _bsd(k), _bsd(v)], -1)
        names = ["query", "", ""]
    else:
        feeds.update(query=_bsd(q), key=_bsd(k), value=_bsd(v))
        names = ["query", "key", "value"]
    names += ["past_k", "past_v", "seqlens_k", "total"]
    attrs = {"num_heads": _N, "kv_num_heads": _KV, "do_rotary": int(rotary)}
    if qk_norm:
        wq = (1 + 0.3 * rng.standard_normal(_H)).astype(t)
        wk = (1 + 0.3 * rng.standard_normal(_H)).astype(t)
        q64, k64 = _rms(q64, wq.astype(np.float64), 1e-6), _rms(k64, wk.astype(np.float64), 1e-6)
        feeds.update(wq=wq, wk=wk)
        attrs.update(q_norm_epsilon=1e-6, k_norm_epsilon=1e-6)
    if rotary:
        pos = np.arange(_S)
        inv = 1.0 / 10000 ** (np.arange(0, _H, 2) / _H)
        ang = np.arange(_M)[:, None] * inv[None]
        feeds.update(
            cos=np.cos(ang).astype(t),
            sin=np.sin(ang).astype(t),
            pos=np.arange(_S, dtype=np.int64)[None],
        )
        names += ["cos", "sin", "pos"]
        attrs["rotary_interleaved"] = int(interleaved)
        q64, k64 = rotate(q64, pos, interleaved), rotate(k64, pos, interleaved)
    if qk_norm:
        names += [""] * (14 - len(names)) + ["wq", "wk"]
    sinks = None
    if sink:
        # One sink far above every score (it must not be assumed to lose the max) and one
        # far below (a near no-op), as GPT-OSS's learned sinks span.
        sinks = np.array([6.0, -4.0][:_N], t)
        names += [""] * (11 - len(names)) + ["sink"]
        feeds["sink"] = sinks
        sinks = sinks.astype(np.float64)
    if softcap:
        attrs["softcap"] = softcap
    if window is not None:
        attrs["local_window_size"] = window
    node = _node("GroupQueryAttention", names, ["y"], domain="com.microsoft", **attrs)
    (got,) = _run([node], feeds, ["y"], provider)
    return got, _bsd(_attend(q64, k64, v64, softcap, window, sinks))


def _gqa_int8_cache_case(dtype, provider, past=3, new=2):
    """Decode-style step over an int8 past with per-channel power-of-two scales: the past
    dequantizes exactly and the new K/V are integers times the scales, so the float64
    attention over ``int8 * scale`` is the exact answer, and the present must hold the past's
    int8 values followed by the new tokens' (checked as part of the answer)."""
    rng = np.random.default_rng(5)
    t = _NP[dtype]
    scales = [(2.0 ** -rng.integers(3, 7, (_KV, 1, _H))).astype(np.float32) for _ in "kv"]
    ints = [rng.integers(-100, 100, (_B, _KV, past + new, _H)) for _ in "kv"]
    k, v = ((i[:, :, past:] * s).astype(t) for i, s in zip(ints, scales, strict=True))
    q = rng.standard_normal((_B, _N, new, _H)).astype(t)
    feeds = {
        "query": _bsd(q),
        "key": _bsd(k),
        "value": _bsd(v),
        "past_k": ints[0][:, :, :past].astype(np.int8),
        "past_v": ints[1][:, :, :past].astype(np.int8),
        "seqlens_k": np.array([past + new - 1], np.int32),
        "total": np.array(past + new, np.int32),
        "k_scale": scales[0],
        "v_scale": scales[1],
    }
    names = ["query", "key", "value", "past_k", "past_v", "seqlens_k", "total"]
    names += [""] * 5 + ["k_scale", "v_scale"]
    attrs = {"num_heads": _N, "kv_num_heads": _KV, "kv_cache_bit_width": 8}
    attrs.update(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL")
    node = _node("GroupQueryAttention", names, ["y", "pk", "pv"], domain="com.microsoft", **attrs)
    to = ir.DataType.from_numpy(np.dtype(t))
    casts = [_node("Cast", [n], [n + "_f"], to=to) for n in ("pk", "pv")]
    y, pk, pv = _run([node, *casts], feeds, ["y", "pk_f", "pv_f"], provider)
    kd, vd = (i * s.astype(np.float64) for i, s in zip(ints, scales, strict=True))
    rep = _N // _KV
    scores = q.astype(np.float64) @ np.repeat(kd, rep, 1).transpose(0, 1, 3, 2) / np.sqrt(_H)
    i, j = np.arange(new)[:, None] + past, np.arange(past + new)[None]
    scores = np.where(j <= i, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = _bsd((p / p.sum(-1, keepdims=True)) @ np.repeat(vd, rep, 1))
    got = np.concatenate([y.ravel(), pk.ravel(), pv.ravel()])
    return got, np.concatenate([ref.ravel(), ints[0].ravel(), ints[1].ravel()])


def _attention_case(dtype, provider, softcap=0.0):
    rng = np.random.default_rng(1)
    t = _NP[dtype]
    q = rng.standard_normal((_B, _N, _S, _H)).astype(t)
    k = rng.standard_normal((_B, _KV, _S, _H)).astype(t)
    v = rng.standard_normal((_B, _KV, _S, _H)).astype(t)
    attrs = {"is_causal": 1}
    if softcap:
        attrs["softcap"] = softcap
    node = _node("Attention", ["q", "k", "v"], ["y"], **attrs)
    (got,) = _run([node], {"q": q, "k": k, "v": v}, ["y"], provider)
    ref = _attend(*(a.astype(np.float64) for a in (q, k, v)), softcap)
    return got, ref


def _rope_case(dtype, provider, contrib: bool):
    rng = np.random.default_rng(2)
    t = _NP[dtype]
    rotary = _H // 2  # partial and interleaved: the features peers lose
    x = rng.standard_normal((_B, _N, _S, _H)).astype(t)
    pos = rng.integers(0, _M, (_B, _S))
    inv = 1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)
    ang = np.arange(_M)[:, None] * inv[None]
    feeds = {"x": _bsd(x), "cos": np.cos(ang).astype(t), "sin": np.sin(ang).astype(t), "pos": pos}
    attrs = {"interleaved": 1, "num_heads": _N, "rotary_embedding_dim": rotary}
    if contrib:
        node = _node(
            "RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft", **attrs
        )
    else:
        node = _node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], **attrs)
    (got,) = _run([node], feeds, ["y"], provider)
    ref = np.stack(
        [rotate(x[b : b + 1].astype(np.float64), pos[b], True, rotary)[0] for b in range(_B)]
    )
    return got, _bsd(ref)


def _norm_case(dtype, provider, op: str):
    rng = np.random.default_rng(3)
    t = _NP[dtype]
    x = rng.standard_normal((2, 3, 32)).astype(t)
    skip = rng.standard_normal((2, 3, 32)).astype(t)
    w = (1 + 0.2 * rng.standard_normal(32)).astype(t)
    beta = (0.2 * rng.standard_normal(32)).astype(t)
    eps = 1e-5
    x64, s64, w64, b64 = (a.astype(np.float64) for a in (x, skip, w, beta))
    if op in ("RMSNormalization", "SimplifiedLayerNormalization"):
        node = _node(op, ["x", "w"], ["y"], axis=-1, epsilon=eps, stash_type=1)
        (got,) = _run([node], {"x": x, "w": w}, ["y"], provider)
        return got, _rms(x64, w64, eps)
    total = x64 + s64
    if op == "SkipSimplifiedLayerNormalization":
        node = _node(
            op, ["x", "skip", "w"], ["y", "", "", "sum"], domain="com.microsoft", epsilon=eps
        )
        y, summed = _run([node], {"x": x, "skip": skip, "w": w}, ["y", "sum"], provider)
        ref = _rms(total, w64, eps)
    else:
        node = _node(
            op,
            ["x", "skip", "w", "beta"],
            ["y", "", "", "sum"],
            domain="com.microsoft",
            epsilon=eps,
        )
        y, summed = _run(
            [node], {"x": x, "skip": skip, "w": w, "beta": beta}, ["y", "sum"], provider
        )
        centred = total - total.mean(-1, keepdims=True)
        ref = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + eps) * w64 + b64
    return np.concatenate([y.ravel(), summed.ravel()]), np.concatenate([ref.ravel(), total.ravel()])


def _moe_case(dtype, provider):
    """Interleaved SwiGLU experts with GPT-OSS's clamp (alpha 1.702, beta 1, limit 7 scaled
    to these inputs), softmax over all experts, top 2, renormalized, biases on both layers."""
    rng = np.random.default_rng(4)
    t = _NP[dtype]
    tokens, hidden, inter, experts, k, limit = 6, 16, 8, 4, 2, 0.8
    x = rng.standard_normal((tokens, hidden)).astype(t)
    logits = (2 * rng.standard_normal((tokens, experts))).astype(t)
    fc1 = (rng.standard_normal((experts, 2 * inter, hidden)) / 3).astype(t)
    b1 = (0.3 * rng.standard_normal((experts, 2 * inter))).astype(t)
    fc2 = (rng.standard_normal((experts, hidden, inter)) / 3).astype(t)
    b2 = (0.3 * rng.standard_normal((experts, hidden))).astype(t)
    node = _node(
        "MoE",
        ["x", "r", "fc1", "b1", "fc2", "b2"],
        ["y"],
        domain="com.microsoft",
        k=k,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=1.702,
        activation_beta=1.0,
        swiglu_limit=limit,
        normalize_routing_weights=1,
    )
    feeds = {"x": x, "r": logits, "fc1": fc1, "b1": b1, "fc2": fc2, "b2": b2}
    (got,) = _run([node], feeds, ["y"], provider)
    x64, l64 = x.astype(np.float64), logits.astype(np.float64)
    probs = np.exp(l64 - l64.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.zeros((tokens, hidden))
    for i in range(tokens):
        chosen = np.argsort(-probs[i], kind="stable")[:k]
        weights = probs[i, chosen] / probs[i, chosen].sum()
        for e, w in zip(chosen, weights, strict=True):
            h = fc1[e].astype(np.float64) @ x64[i] + b1[e]
            gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            act = (up + 1.0) * gate / (1.0 + np.exp(-1.702 * gate))
            ref[i] += w * (fc2[e].astype(np.float64) @ act + b2[e])
    return got, ref


KNOWN_ANSWERS: dict[Capability, Callable[[str, str], tuple[np.ndarray, np.ndarray]]] = {
    Capability.GQA: lambda d, p: _gqa_case(d, p),
    Capability.GQA_FUSED_ROTARY: lambda d, p: _gqa_case(d, p, rotary=True),
    Capability.GQA_INTERLEAVED_ROTARY: lambda d, p: _gqa_case(d, p, rotary=True, interleaved=True),
    Capability.GQA_SOFTCAP: lambda d, p: _gqa_case(d, p, softcap=2.0),
    Capability.GQA_LOCAL_WINDOW: lambda d, p: _gqa_case(d, p, window=2),
    Capability.GQA_PACKED_QKV: lambda d, p: _gqa_case(d, p, packed=True),
    Capability.GQA_QK_NORM: lambda d, p: _gqa_case(d, p, qk_norm=True),
    Capability.GQA_HEAD_SINK: lambda d, p: _gqa_case(d, p, sink=True, window=3),
    Capability.GQA_KV_CACHE_INT8: _gqa_int8_cache_case,
    Capability.MOE: _moe_case,
    Capability.ATTENTION: lambda d, p: _attention_case(d, p),
    Capability.ATTENTION_SOFTCAP: lambda d, p: _attention_case(d, p, softcap=2.0),
    Capability.ROTARY_EMBEDDING: lambda d, p: _rope_case(d, p, contrib=False),
    Capability.MS_ROTARY_EMBEDDING: lambda d, p: _rope_case(d, p, contrib=True),
    Capability.RMS_NORMALIZATION: lambda d, p: _norm_case(d, p, "RMSNormalization"),
    Capability.SIMPLIFIED_LAYER_NORM: lambda d, p: _norm_case(d, p, "SimplifiedLayerNormalization"),
    Capability.SKIP_SIMPLIFIED_LAYER_NORM: lambda d, p: _norm_case(
        d, p, "SkipSimplifiedLayerNormalization"
    ),
    Capability.SKIP_LAYER_NORM: lambda d, p: _norm_case(d, p, "SkipLayerNormalization"),
}
"""Capabilities with a known-answer run; :data:`NOT_RUN` says why the others have none."""

NOT_RUN: dict[Capability, str] = {
    Capability.GQA_ROTARY_POSITION_IDS: "covered by the fused-rotary run's explicit position_ids",
    Capability.GQA_ATTENTION_BIAS: "schema-only (epfuse emits no attention_bias yet)",
    Capability.MROTARY_EMBEDDING: "schema-only (mRoPE is proven per model by evaluation)",
    Capability.MATMUL_NBITS: "schema-only (int4 models are compared on ORT by the int4 tests)",
    Capability.GATHER_BLOCK_QUANTIZED: "int4 only (compared on ORT by the int4 tests)",
}


def known_answer(flag: Capability | str, dtype: str, provider: str) -> str | None:
    """None when ``flag`` computes the right answer for ``dtype`` on ``provider``, else why not."""
    tol = tolerance_for(dtype)
    try:
        got, ref = KNOWN_ANSWERS[Capability(flag)](dtype, provider)
    except Exception as err:
        line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"fails to run: {line[:200]}"
    got = np.asarray(got, dtype=np.float64)
    if got.shape != ref.shape:
        return f"wrong shape {got.shape}, expected {ref.shape}"
    err = np.abs(got - ref)
    if not np.all(err <= tol.atol + tol.rtol * np.abs(ref)):
        return f"wrong answer (max |error| {float(err.max()):.3g})"
    return None
