"""Small standard-op ONNX decoder LLMs with a KV cache, for tests.

``build_decoder(DecoderConfig(...))`` returns a Llama-like decoder (opset 23, IR version 10) in one
of two forms that epfuse must rewrite:

- ``style="torch23"`` reproduces, node for node, what ``torch.onnx.export(dynamo=True,
  opset_version=23)`` produces for a Hugging Face Llama with a ``DynamicCache``: a boolean mask
  built once from ``attention_mask`` with Range/LessOrEqual/GatherND, per-token cos/sin computed
  from ``position_ids`` and fed to the 3-input ``RotaryEmbedding`` on (B, N, S, H) tensors, the
  cache grown by ``Concat``, K/V repeated to all query heads (repeat_kv) and a 4-D ``Attention``
  with ``is_causal=0``.
- ``style="torch18"`` is the same export at opset 18, where torch.onnx has no Attention,
  RotaryEmbedding or RMSNormalization and writes them out: RMSNorm as
  Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul (with Casts to float32 and back in half precision),
  RoPE as rotate-half Slice/Neg/Concat/Mul/Add on ``Cos/Sin(Concat(freqs, freqs))`` (or, with
  ``interleaved``, GPT-J/Cohere's strided-Slice/stack/Reshape ``rotate_every_two`` on
  ``Cos/Sin(repeat_interleave(freqs, 2))``), and
  attention as MatMul(Q*s, K^T*s) (``scale_form="split"``, torch's SDPA) or MatMul(Q, K^T)*s
  (``"scores"``, HF eager) + an additive ``Where(mask, 0, finfo.min)`` mask, Softmax, the
  NaN guard ``Where(IsNaN(P), 0, P)`` and MatMul(P, V). K^T is torch's
  Reshape/Transpose/Reshape (``k_transpose="reshape"``) or ``Transpose(perm=[0,1,3,2])``.
  ``mask_slice`` slices each layer's mask to its repeated key's length, as transformers 4.x's
  sdpa attention does (``attention_mask[:, :, :, : key_states.shape[-2]]``): the mask of layer
  ``l`` then reads, by shape, a key computed from every earlier layer's output.
- ``style="mobius"`` is the form onnxruntime/mobius's builder emits: constant cos/sin caches
  indexed by ``position_ids``, 3-D (B, S, N*H) q/k/v, and one ``Attention`` that takes the past
  K/V, groups KV heads itself (``q_num_heads``/``kv_num_heads``) and produces the present K/V
  graph outputs directly, with ``is_causal=1`` and a padding (or padding + window) bool mask.

``positions="mrope"`` (mobius style only) makes a Qwen2-VL-style decoder: ``position_ids`` is
(3, batch, seq) (temporal, height, width streams); each stream gathers its rows of the constant
cos/sin caches and ``Where`` masks over the R/2 frequency columns pick, per column, the stream
that ``mrope_section`` assigns it (``mrope_layout`` "sectioned" as Qwen2/2.5-VL, or
"interleaved" as Qwen3-VL); the mixed (B, S, R/2) cos/sin feed a standard 3-input
``RotaryEmbedding``. With the same position in all three streams it is the 1-D decoder.

For one config and seed both styles hold the same weights (``decoder_weights``) and compute the
same function. Weights are at a realistic scale (unit-variance embeddings, 1/sqrt(fan_in)
projections, q/k twice that) so attention is peaked: a wrong mask, RoPE pairing or position
changes the logits visibly.

Graph signature (both styles), symbolic dims "batch", "seq", "past", "total" (= past + seq):
  inputs  input_ids (batch, seq) int64, attention_mask (batch, total) int64,
          position_ids (batch, seq) int64,
          past_key_values.{i}.key / .value (batch, kv_heads, past, head_dim) cfg.dtype
  outputs logits (batch, seq, vocab) cfg.dtype,
          present.{i}.key / .value (batch, kv_heads, past + seq, head_dim) cfg.dtype
Contract: right padding only; total = past + seq.

Weights are stored the way the exporter stores them: Linear weights pre-transposed to
(in_features, out_features) so that ``MatMul(x, W)`` applies them.
"""

from __future__ import annotations

import collections
import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 23
IR_VERSION = 10
RMS_EPS = 1e-6

_DTYPES = {
    "float32": (np.dtype(np.float32), TensorProto.FLOAT),
    "float16": (np.dtype(np.float16), TensorProto.FLOAT16),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), TensorProto.BFLOAT16),
}
_STYLES = ("torch23", "mobius", "torch18")
OPSET_TORCH18 = 18


@dataclass(frozen=True)
class DecoderConfig:
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    rotary_dim: int | None = None  # None = full head_dim; else partial rotary (even, < head_dim)
    interleaved: bool = False
    softcap: float = 0.0  # attention logit softcap (Attention softcap attribute); 0 = off
    sliding_window: int | None = None  # HF semantics: W keys including the current one
    vocab: int = 128
    intermediate: int = 64
    dtype: str = "float32"  # "float32" | "float16" | "bfloat16"
    rope_theta: float = 10000.0
    max_positions: int = 256  # rows of the constant cos/sin caches (mobius style)
    style: str = "torch23"  # "torch23" | "mobius" | "torch18"
    seed: int = 0
    positions: str = "1d"  # "1d" | "mrope" ((3, batch, seq) position_ids; mobius style only)
    mrope_section: tuple[int, int, int] | None = None  # (t, h, w), sum R/2; None = a default
    mrope_layout: str = "sectioned"  # "sectioned" (Qwen2/2.5-VL) | "interleaved" (Qwen3-VL)
    qk_norm: bool = False  # Qwen3: RMSNormalization over head_dim on q and k before RoPE
    qkv_bias: bool = False  # Qwen2: bias Add after the q/k/v projections
    scale_form: str = "split"  # torch18: "split" (sqrt(s) on Q and K^T) | "scores" (s on QK^T)
    k_transpose: str = "reshape"  # torch18: "reshape" (torch's 3-D form) | "perm" (Transpose)
    mask_slice: bool = False  # torch18: the mask sliced to Shape(repeated K)[-2] per layer

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.style not in _STYLES:
            raise ValueError(f"style must be one of {_STYLES}, got {self.style!r}")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError("rotary_dim must be even and in (0, head_dim), or None")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1 or None")
        if self.positions not in ("1d", "mrope"):
            raise ValueError(f"positions must be '1d' or 'mrope', got {self.positions!r}")
        if self.positions == "mrope":
            if self.style != "mobius":
                raise ValueError("positions='mrope' is built in the mobius style only")
            if self.mrope_layout not in ("sectioned", "interleaved"):
                raise ValueError("mrope_layout must be 'sectioned' or 'interleaved'")
            if sum(self.sections) != self.rotary // 2 or min(self.sections) < 0:
                raise ValueError(f"mrope_section must be >= 0 and sum to {self.rotary // 2}")
        if self.scale_form not in ("split", "scores"):
            raise ValueError("scale_form must be 'split' or 'scores'")
        if self.k_transpose not in ("reshape", "perm"):
            raise ValueError("k_transpose must be 'reshape' or 'perm'")
        if self.mask_slice and self.style != "torch18":
            raise ValueError("mask_slice is built in the torch18 style only")

    @property
    def sections(self) -> tuple[int, int, int]:
        """mrope_section, by default Qwen's proportions (1/4, 3/8, 3/8 sectioned; interleaved
        1/2, 1/4, 1/4 so that the H and W strides fit in R/2)."""
        if self.mrope_section is not None:
            return tuple(self.mrope_section)
        half = self.rotary // 2
        h = half * 3 // 8 if self.mrope_layout == "sectioned" else half // 4
        return (half - 2 * h, h, h)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def rotary(self) -> int:
        """Rotated width R of each head (cos/sin caches are R/2 wide)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def n_rep(self) -> int:
        return self.heads // self.kv_heads

    @property
    def np_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype][0]

    @property
    def onnx_dtype(self) -> int:
        return _DTYPES[self.dtype][1]


# --------------------------------------------------------------------------------------------
# Weights and RoPE tables (shared by both styles and by reference implementations)


def decoder_weights(cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Deterministic weights for ``cfg`` (from ``cfg.seed``), already cast to ``cfg.dtype``.

    Keys are the initializer names used by ``build_decoder``; Linear weights are (in, out).
    """
    rng = np.random.default_rng(cfg.seed)
    d, kvd, f = cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg.intermediate

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        return (mean + std * rng.standard_normal(shape)).astype(cfg.np_dtype)

    def linear(fan_in: int, fan_out: int, gain: float = 1.0) -> np.ndarray:
        return normal((fan_in, fan_out), gain / math.sqrt(fan_in))

    w = {"model.embed_tokens.weight": normal((cfg.vocab, d), 1.0)}
    for i in range(cfg.layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = normal((d,), 0.1, mean=1.0)
        # q and k at twice the usual scale: peaked attention makes mask and RoPE errors visible.
        w[f"{p}.self_attn.q_proj.weight"] = linear(d, d, gain=2.0)
        w[f"{p}.self_attn.k_proj.weight"] = linear(d, kvd, gain=2.0)
        w[f"{p}.self_attn.v_proj.weight"] = linear(d, kvd)
        w[f"{p}.self_attn.o_proj.weight"] = linear(d, d)
        w[f"{p}.post_attention_layernorm.weight"] = normal((d,), 0.1, mean=1.0)
        w[f"{p}.mlp.gate_proj.weight"] = linear(d, f)
        w[f"{p}.mlp.up_proj.weight"] = linear(d, f)
        w[f"{p}.mlp.down_proj.weight"] = linear(f, d)
    w["model.norm.weight"] = normal((d,), 0.1, mean=1.0)
    w["lm_head.weight"] = linear(d, cfg.vocab)
    # Optional parts come last so that the weights above do not depend on them.
    for i in range(cfg.layers):
        p = f"model.layers.{i}.self_attn"
        if cfg.qkv_bias:
            w[f"{p}.q_proj.bias"] = normal((d,), 0.5)
            w[f"{p}.k_proj.bias"] = normal((kvd,), 0.5)
            w[f"{p}.v_proj.bias"] = normal((kvd,), 0.5)
        if cfg.qk_norm:
            w[f"{p}.q_norm.weight"] = normal((cfg.head_dim,), 0.3, mean=1.0)
            w[f"{p}.k_norm.weight"] = normal((cfg.head_dim,), 0.3, mean=1.0)
    return w


def inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """RoPE inverse frequencies, (R/2,) float64: 1 / theta ** (arange(0, R, 2) / R)."""
    r = cfg.rotary
    return 1.0 / cfg.rope_theta ** (np.arange(0, r, 2, dtype=np.float64) / r)


def rope_caches(cfg: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Constant (max_positions, R/2) cos and sin caches, computed in float64, in cfg.dtype."""
    angles = np.arange(cfg.max_positions, dtype=np.float64)[:, None] * inv_freq(cfg)[None, :]
    return np.cos(angles).astype(cfg.np_dtype), np.sin(angles).astype(cfg.np_dtype)


def mrope_streams(cfg: DecoderConfig) -> np.ndarray:
    """(R/2,) index of the position stream (0 = T, 1 = H, 2 = W) of each frequency column."""
    t, h, w = cfg.sections
    half = t + h + w
    if cfg.mrope_layout == "sectioned":
        return np.repeat(np.arange(3), [t, h, w])
    streams = np.zeros(half, dtype=np.int64)  # Qwen3-VL: T everywhere, then H and W strided
    streams[1 : 3 * h : 3] = 1
    streams[2 : 3 * w : 3] = 2
    return streams


def image_positions(token_positions: np.ndarray, start: int = 2, grid=(1, 2, 3)) -> np.ndarray:
    """(3, B, S) Qwen2-VL-style positions for (B, S) token indices: text tokens before
    ``start``, then an image of ``grid`` (t, h, w) patches at distinct T/H/W positions, then
    text continuing from the image's largest position + 1. A pure function of the token index,
    so a prompt and its continuation agree."""
    t = np.asarray(token_positions, dtype=np.int64)
    gt, gh, gw = grid
    n = gt * gh * gw
    i = np.clip(t - start, 0, n - 1)
    image = np.stack([start + i // (gh * gw), start + (i // gw) % gh, start + i % gw])
    after = t - n + max(gt, gh, gw)  # the first text token after the image: start + max(grid)
    streams = np.where(t < start, t, np.where(t < start + n, image, after))
    return np.broadcast_to(streams, (3, *t.shape)).copy()


# --------------------------------------------------------------------------------------------
# Feeds and outputs


def input_names(cfg: DecoderConfig) -> list[str]:
    names = ["input_ids", "attention_mask", "position_ids"]
    for i in range(cfg.layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def output_names(cfg: DecoderConfig) -> list[str]:
    names = ["logits"]
    for i in range(cfg.layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def decoder_feeds(
    cfg: DecoderConfig,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    position_ids: np.ndarray | None = None,
    past: Sequence[np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Feed dict for one step. ``past`` is the flat [k0, v0, k1, v1, ...] list of present outputs
    of the previous step (None = empty cache). Defaults: all-ones mask over past + seq and
    positions past + arange(seq), which is right for right padding."""
    input_ids = np.asarray(input_ids, dtype=np.int64)
    b, s = input_ids.shape
    if past is None:
        empty = np.zeros((b, cfg.kv_heads, 0, cfg.head_dim), dtype=cfg.np_dtype)
        past = [empty] * (2 * cfg.layers)
    p = past[0].shape[2]
    if attention_mask is None:
        attention_mask = np.ones((b, p + s), dtype=np.int64)
    if position_ids is None:
        position_ids = np.broadcast_to(np.arange(p, p + s, dtype=np.int64), (b, s)).copy()
    if cfg.positions == "mrope" and np.ndim(position_ids) == 2:
        position_ids = np.broadcast_to(position_ids, (3, b, s)).copy()  # text only
    values = [input_ids, np.asarray(attention_mask, np.int64), np.asarray(position_ids, np.int64)]
    return dict(zip(input_names(cfg), [*values, *past], strict=True))


# --------------------------------------------------------------------------------------------
# Graph construction


class _GraphBuilder:
    """Collects nodes and initializers; names values from hints, deduplicates int constants."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._used: collections.Counter[str] = collections.Counter()
        self._int_consts: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        n = self._used[hint]
        self._used[hint] += 1
        return hint if n == 0 else f"{hint}_{n}"

    def initializer(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def ints(self, *values: int, scalar: bool = False) -> str:
        """An int64 constant: a 1-D vector of ``values``, or a scalar."""
        key = (values, scalar)
        if key not in self._int_consts:
            array = np.array(values[0] if scalar else values, dtype=np.int64)
            self._int_consts[key] = self.initializer(self.fresh("const_i64"), array)
        return self._int_consts[key]

    def op(self, op_type: str, inputs: Sequence[str], hint: str, **attrs) -> str:
        """Append a single-output node; returns the name of its output."""
        return self.op_multi(op_type, inputs, [self.fresh(hint)], **attrs)[0]

    def op_multi(
        self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], **attrs
    ) -> list[str]:
        """Append a node with explicitly named outputs."""
        node_name = self.fresh(f"node_{op_type}")
        self.nodes.append(
            helper.make_node(op_type, list(inputs), list(outputs), node_name, **attrs)
        )
        return list(outputs)


def _rms_norm(b: _GraphBuilder, x: str, weight: str, hint: str) -> str:
    return b.op("RMSNormalization", [x, weight], hint, axis=-1, epsilon=RMS_EPS, stash_type=1)


def _mlp(b: _GraphBuilder, h: str, prefix: str) -> str:
    gate = b.op("MatMul", [h, f"{prefix}.mlp.gate_proj.weight"], "gate")
    act = b.op("Mul", [gate, b.op("Sigmoid", [gate], "sigmoid")], "silu")
    up = b.op("MatMul", [h, f"{prefix}.mlp.up_proj.weight"], "up")
    gated = b.op("Mul", [act, up], "gated")
    return b.op("MatMul", [gated, f"{prefix}.mlp.down_proj.weight"], "mlp")


def _rms_norm_decomposed(cfg: DecoderConfig):
    """HF's LlamaRMSNorm as torch.onnx writes it below opset 23 (float32 inside)."""

    def norm(b: _GraphBuilder, x: str, weight: str, hint: str) -> str:
        half = cfg.onnx_dtype != TensorProto.FLOAT
        xf = b.op("Cast", [x], f"{hint}_f32", to=TensorProto.FLOAT) if half else x
        two = b.initializer(b.fresh("const_two"), np.array(2.0, np.float32))
        eps = b.initializer(b.fresh("const_eps"), np.array(RMS_EPS, np.float32))
        var = b.op("ReduceMean", [b.op("Pow", [xf, two], f"{hint}_sq"), b.ints(-1)], "var")
        rstd = b.op("Reciprocal", [b.op("Sqrt", [b.op("Add", [var, eps], "var_eps")], "std")], "r")
        y = b.op("Mul", [xf, rstd], f"{hint}_normed")
        if half:
            y = b.op("Cast", [y], f"{hint}_cast", to=cfg.onnx_dtype)
        return b.op("Mul", [weight, y], hint)

    return norm


def _layer(b: _GraphBuilder, i: int, x: str, attention, norm=_rms_norm) -> str:
    """One pre-norm decoder layer around ``attention(h, prefix, i) -> (B, S, hidden)``."""
    prefix = f"model.layers.{i}"
    h = norm(b, x, f"{prefix}.input_layernorm.weight", "attn_norm")
    y = b.op("MatMul", [attention(h, prefix, i), f"{prefix}.self_attn.o_proj.weight"], "o_proj")
    x = b.op("Add", [x, y], "residual")
    h = norm(b, x, f"{prefix}.post_attention_layernorm.weight", "mlp_norm")
    return b.op("Add", [x, _mlp(b, h, prefix)], "residual")


def _rotary_attrs(cfg: DecoderConfig, num_heads: int) -> dict:
    attrs = {"interleaved": int(cfg.interleaved), "num_heads": num_heads}
    if cfg.rotary_dim is not None:
        attrs["rotary_embedding_dim"] = cfg.rotary_dim
    return attrs


def _build_torch23(b: _GraphBuilder, cfg: DecoderConfig) -> None:
    """The torch.onnx (dynamo, opset 23; or 18 for style torch18) export of HF Llama with a
    DynamicCache."""
    n, kv, hd = cfg.heads, cfg.kv_heads, cfg.head_dim
    decomposed = cfg.style == "torch18"
    norm = _rms_norm_decomposed(cfg) if decomposed else _rms_norm
    if decomposed:
        # torch's additive mask: 0 where visible, the dtype's most negative finite value where not
        zero_f = b.initializer(b.fresh("const_zero_f"), np.array(0.0, cfg.np_dtype))
        fmin = np.array(float(ml_dtypes.finfo(cfg.np_dtype).min)).astype(cfg.np_dtype)
        min_f = b.initializer(b.fresh("const_min_f"), fmin)
    last = cfg.layers - 1
    zero, one = b.ints(0, scalar=True), b.ints(1, scalar=True)

    # Symbolic sizes, as the exporter reads them.
    seq_1d = b.op("Shape", ["input_ids"], "seq_1d", start=1, end=2)
    seq = b.op("Squeeze", [seq_1d], "seq")
    past_1d = b.op("Shape", [f"past_key_values.{last}.key"], "past_1d", start=2, end=3)
    past = b.op("Squeeze", [past_1d], "past")
    batch_1d = b.op("Shape", [f"past_key_values.{last}.value"], "batch_1d", start=0, end=1)
    batch = b.op("Squeeze", [batch_1d], "batch")
    total = b.op("Add", [past, seq], "total")

    x = b.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embedding", axis=0)

    # Boolean (B, 1, S, T) mask: causal (and window) on cache positions, AND padding.
    am_bool = b.op("Cast", ["attention_mask"], "attention_mask_bool", to=TensorProto.BOOL)
    b_idx = b.op("Range", [zero, batch, one], "arange_batch")
    q_idx = b.op("Add", [b.op("Range", [zero, seq, one], "arange_seq"), past], "q_idx")
    kv_idx = b.op("Range", [zero, total, one], "kv_idx")
    b4 = b.op("Unsqueeze", [b.op("Unsqueeze", [b_idx, b.ints(1, 2)], "b2"), b.ints(3)], "b4")
    q4 = b.op("Unsqueeze", [b.op("Unsqueeze", [q_idx, b.ints(0, 1)], "q3"), b.ints(3)], "q4")
    kv4 = b.op("Unsqueeze", [b.op("Unsqueeze", [kv_idx, b.ints(0, 1)], "kv3"), b.ints(2)], "kv4")
    true = b.initializer("new_ones", np.array(True))
    causal = b.op("And", [true, b.op("LessOrEqual", [kv4, q4], "le")], "causal")
    if cfg.sliding_window is not None:
        lo = b.op("Sub", [q4, b.ints(cfg.sliding_window, scalar=True)], "window_lo")
        causal = b.op("And", [causal, b.op("Greater", [kv4, lo], "in_window")], "causal_window")
    bkv_shape = b.op("Shape", [b.op("Max", [b4, kv4], "bkv_max")], "bkv_shape", start=0)
    last_axis = b.ints(-1)
    b_exp = b.op("Unsqueeze", [b.op("Expand", [b4, bkv_shape], "b_exp"), last_axis], "b_idx5")
    kv_exp = b.op("Unsqueeze", [b.op("Expand", [kv4, bkv_shape], "kv_exp"), last_axis], "kv_idx5")
    gather_idx = b.op("Concat", [b_exp, kv_exp], "pad_index", axis=-1)
    pad = b.op("GatherND", [am_bool, gather_idx], "pad_mask", batch_dims=0)
    mask = b.op("And", [causal, pad], "mask")
    total_1d = b.op("Reshape", [total, b.ints(-1)], "total_1d", allowzero=0)
    mask_shape = b.op("Concat", [batch_1d, b.ints(1), seq_1d, total_1d], "mask_shape", axis=0)
    mask = b.op("Expand", [mask, mask_shape], "attn_mask")
    if decomposed:
        fmask = b.op("Where", [mask, zero_f, min_f], "attn_bias")

    # Per-token RoPE angles (B, S, R/2) in float32.
    b.initializer("model.rotary_emb.inv_freq", inv_freq(cfg).astype(np.float32))
    pos = b.op("Unsqueeze", ["position_ids", b.ints(2)], "pos3")
    pos = b.op("Cast", [pos], "pos_float", to=TensorProto.FLOAT)
    freqs = b.op("Mul", [pos, "model.rotary_emb.inv_freq"], "freqs")
    if decomposed and cfg.interleaved:  # freqs.repeat_interleave(2, dim=-1)
        pairs = b.op(
            "Expand", [b.op("Unsqueeze", [freqs, b.ints(3)], "f4"), b.ints(1, 1, 1, 2)], "f2"
        )
        bs = b.op("Shape", [freqs], "freqs_bs", start=0, end=-1)
        emb = b.op("Reshape", [pairs, b.op("Concat", [bs, b.ints(-1)], "emb_shape", axis=0)], "emb")
    elif decomposed:
        emb = b.op("Concat", [freqs, freqs], "emb", axis=-1)
    if decomposed:
        cos_full, sin_full = b.op("Cos", [emb], "cos"), b.op("Sin", [emb], "sin")
        if cfg.onnx_dtype != TensorProto.FLOAT:
            cos_full = b.op("Cast", [cos_full], "cos_cast", to=cfg.onnx_dtype)
            sin_full = b.op("Cast", [sin_full], "sin_cast", to=cfg.onnx_dtype)
        cos4 = b.op("Unsqueeze", [cos_full, b.ints(1)], "cos4")
        sin4 = b.op("Unsqueeze", [sin_full, b.ints(1)], "sin4")

    def const_f(value: float) -> str:
        return b.initializer(b.fresh("const_f"), np.array(value).astype(cfg.np_dtype))

    i64_max, i64_min = 2**63 - 1, -(2**63)

    def last_slice(t: str, start: int, end: int, hint: str) -> str:
        return b.op("Slice", [t, b.ints(start), b.ints(end), b.ints(3), b.ints(1)], hint)

    def rotate_half(t: str, hint: str) -> str:
        r = cfg.rotary
        rot = last_slice(t, 0, r, f"{hint}_rot") if cfg.rotary_dim is not None else t
        if cfg.interleaved:  # GPT-J / Cohere rotate_every_two
            ends, axis3, two = b.ints(i64_max), b.ints(3), b.ints(2)
            x1 = b.op("Slice", [rot, b.ints(0), ends, axis3, two], f"{hint}_even")
            x2 = b.op("Slice", [rot, b.ints(1), ends, axis3, two], f"{hint}_odd")
            neg = b.op("Unsqueeze", [b.op("Neg", [x2], f"{hint}_neg"), b.ints(-1)], f"{hint}_n5")
            pos = b.op("Unsqueeze", [x1, b.ints(-1)], f"{hint}_p5")
            stack = b.op("Concat", [neg, pos], f"{hint}_stack", axis=-1)
            bns = b.op("Shape", [rot], f"{hint}_bns", start=0, end=3)
            flat = b.op("Concat", [bns, b.ints(r)], f"{hint}_flat", axis=0)
            turned = b.op("Reshape", [stack, flat], f"{hint}_rh")
        else:
            x1 = last_slice(rot, 0, r // 2, f"{hint}_x1")
            x2 = last_slice(rot, r // 2, i64_max, f"{hint}_x2")
            turned = b.op("Concat", [b.op("Neg", [x2], f"{hint}_neg"), x1], f"{hint}_rh", axis=-1)
        y = b.op(
            "Add",
            [b.op("Mul", [rot, cos4], f"{hint}_c"), b.op("Mul", [turned, sin4], f"{hint}_s")],
            hint,
        )
        if cfg.rotary_dim is not None:
            rest = last_slice(t, r, i64_max, f"{hint}_pass")
            y = b.op("Concat", [y, rest], f"{hint}_cat", axis=-1)
        return y

    def transpose_k(k: str) -> str:
        if cfg.k_transpose == "perm":
            return b.op("Transpose", [k], "k_t", perm=[0, 1, 3, 2])
        kshape = b.op("Shape", [k], "k_shape", start=0)
        last = b.op("Slice", [kshape, b.ints(-1), b.ints(i64_max)], "k_last")
        second = b.op("Slice", [kshape, b.ints(-2), b.ints(-1)], "k_second")
        lead = b.op("Slice", [kshape, b.ints(i64_min), b.ints(-2)], "k_lead")
        k3 = b.op("Reshape", [k, b.op("Concat", [b.ints(-1), second, last], "k3s", axis=0)], "k3")
        kt3 = b.op("Transpose", [k3], "kt3", perm=[0, 2, 1])
        kt_shape = b.op("Concat", [lead, last, second], "kts", axis=0)
        return b.op("Reshape", [kt3, kt_shape], "k_t")

    def sdpa(q: str, k: str, v: str) -> str:
        scale = 1.0 / math.sqrt(hd)
        kt = transpose_k(k)
        if cfg.scale_form == "split":
            s = const_f(math.sqrt(scale))
            scores = b.op(
                "MatMul", [b.op("Mul", [q, s], "q_s"), b.op("Mul", [kt, s], "kt_s")], "qk"
            )
        else:
            scores = b.op("Mul", [b.op("MatMul", [q, kt], "qk"), const_f(scale)], "qk_s")
        if cfg.softcap:
            cap = const_f(cfg.softcap)
            capped = b.op("Tanh", [b.op("Div", [scores, cap], "qk_div")], "qk_tanh")
            scores = b.op("Mul", [capped, cap], "qk_cap")
        mask = fmask
        if cfg.mask_slice:  # transformers 4.x: attention_mask[:, :, :, : key_states.shape[-2]]
            key_len = b.op(
                "Gather",
                [b.op("Shape", [k], "k_len_shape"), b.ints(-2, scalar=True)],
                "k_len",
                axis=0,
            )
            key_len = b.op("Unsqueeze", [key_len, b.ints(0)], "k_len_1d")
            mask = b.op("Slice", [fmask, b.ints(0), key_len, b.ints(3), b.ints(1)], "mask_sliced")
        scores = b.op("Add", [scores, mask], "scores")
        p = b.op("Softmax", [scores], "probs", axis=-1)
        p = b.op("Where", [b.op("IsNaN", [p], "probs_nan"), zero_f, p], "probs_safe")
        return b.op("MatMul", [p, v], "sdpa")

    # Shape vectors are built where the exporter first needs them, then reused.
    shapes: dict[str, str] = {}

    def shape(hint: str, *parts: str) -> str:
        if hint not in shapes:
            shapes[hint] = b.op("Concat", list(parts), hint, axis=0)
        return shapes[hint]

    def project(h: str, weight: str, hint: str) -> str:
        y = b.op("MatMul", [h, weight], hint)
        if cfg.qkv_bias:
            y = b.op("Add", [y, weight.replace(".weight", ".bias")], f"{hint}_bias")
        bshd = shape("bshd", batch_1d, seq_1d, b.ints(-1), b.ints(hd))
        y = b.op("Reshape", [y, bshd], f"{hint}_bshd", allowzero=1)
        if cfg.qk_norm and hint in ("q", "k"):
            norm_weight = weight.replace(f"{hint}_proj.weight", f"{hint}_norm.weight")
            y = norm(b, y, norm_weight, f"{hint}_norm")  # decomposed in the torch18 style
        return b.op("Transpose", [y], f"{hint}_bnsh", perm=[0, 2, 1, 3])

    def rotate(t: str, num_heads: int, hint: str) -> str:
        if decomposed:
            return rotate_half(t, hint)
        # The exporter emits a fresh Cos/Sin pair for every use.
        cos = b.op("Cos", [freqs], "cos")
        sin = b.op("Sin", [freqs], "sin")
        if cfg.onnx_dtype != TensorProto.FLOAT:
            cos = b.op("Cast", [cos], "cos_cast", to=cfg.onnx_dtype)
            sin = b.op("Cast", [sin], "sin_cast", to=cfg.onnx_dtype)
        return b.op("RotaryEmbedding", [t, cos, sin], hint, **_rotary_attrs(cfg, num_heads))

    def repeat_kv(t: str, hint: str) -> str:
        if cfg.n_rep == 1:
            return t
        t = b.op("Unsqueeze", [t, b.ints(2)], f"{hint}_5d")
        rep = shape("rep", batch_1d, b.ints(kv), b.ints(cfg.n_rep), total_1d, b.ints(hd))
        t = b.op("Expand", [t, rep], f"{hint}_expand")
        bnth = shape("bnth", batch_1d, b.ints(n), total_1d, b.ints(hd))
        return b.op("Reshape", [t, bnth], f"{hint}_rep", allowzero=1)

    def attention(h: str, prefix: str, i: int) -> str:
        q = project(h, f"{prefix}.self_attn.q_proj.weight", "q")
        k = project(h, f"{prefix}.self_attn.k_proj.weight", "k")
        v = project(h, f"{prefix}.self_attn.v_proj.weight", "v")
        q, k = rotate(q, n, "q_rot"), rotate(k, kv, "k_rot")
        (k,) = b.op_multi("Concat", [f"past_key_values.{i}.key", k], [f"present.{i}.key"], axis=-2)
        (v,) = b.op_multi(
            "Concat", [f"past_key_values.{i}.value", v], [f"present.{i}.value"], axis=-2
        )
        if decomposed:
            y = sdpa(q, repeat_kv(k, "k"), repeat_kv(v, "v"))
        else:
            y = b.op(
                "Attention",
                [q, repeat_kv(k, "k"), repeat_kv(v, "v"), mask],
                "sdpa",
                scale=1.0 / math.sqrt(hd),
                softcap=float(cfg.softcap),
                is_causal=0,
                qk_matmul_output_mode=0,
            )
        y = b.op("Transpose", [y], "sdpa_bsnh", perm=[0, 2, 1, 3])
        bsd = shape("bsd", batch_1d, seq_1d, b.ints(-1))
        return b.op("Reshape", [y, bsd], "sdpa_bsd", allowzero=1)

    for i in range(cfg.layers):
        x = _layer(b, i, x, attention, norm)
    x = norm(b, x, "model.norm.weight", "final_norm")
    b.op_multi("MatMul", [x, "lm_head.weight"], ["logits"])


def _build_mobius(b: _GraphBuilder, cfg: DecoderConfig) -> None:
    """The builder form: cached cos/sin, 3-D q/k/v, Attention with past inputs and is_causal=1."""
    cos_cache, sin_cache = rope_caches(cfg)
    b.initializer("cos_cache", cos_cache)
    b.initializer("sin_cache", sin_cache)

    x = b.op("Gather", ["model.embed_tokens.weight", "input_ids"], "embedding", axis=0)

    # Padding mask (B, 1, 1, T), expanded to (B, 1, S, T): ORT's CPU Attention rejects a mask
    # whose query axis is 1 when S > 1 (it does not broadcast it). is_causal=1 (bottom-right
    # aligned when there is a past) adds causality.
    am_bool = b.op("Cast", ["attention_mask"], "attention_mask_bool", to=TensorProto.BOOL)
    mask = b.op("Unsqueeze", [am_bool, b.ints(1, 2)], "pad_mask")
    seq_1d = b.op("Shape", ["input_ids"], "seq_1d", start=1, end=2)
    expand_shape = b.op("Concat", [b.ints(1, 1), seq_1d, b.ints(1)], "mask_expand", axis=0)
    mask = b.op("Expand", [mask, expand_shape], "attn_mask")
    if cfg.sliding_window is not None:
        # Window term on cache positions: key j is visible to query at position q iff j > q - W.
        seq = b.op("Squeeze", [seq_1d], "seq")
        total_1d = b.op("Shape", ["attention_mask"], "total_1d", start=1, end=2)
        total = b.op("Squeeze", [total_1d], "total")
        past = b.op("Sub", [total, seq], "past")
        one = b.ints(1, scalar=True)
        q_idx = b.op("Range", [past, total, one], "q_idx")
        kv_idx = b.op("Range", [b.ints(0, scalar=True), total, one], "kv_idx")
        lo = b.op("Sub", [q_idx, b.ints(cfg.sliding_window, scalar=True)], "window_lo")
        lo = b.op("Unsqueeze", [lo, b.ints(1)], "window_lo_col")
        window = b.op("Greater", [kv_idx, lo], "in_window")  # (S, T)
        mask = b.op("And", [mask, window], "attn_mask_window")  # (B, 1, S, T)

    mrope_cos_sin: list[str] = []
    if cfg.positions == "mrope":
        # Per-stream rows of the caches, mixed per frequency column by Where masks.
        streams = mrope_streams(cfg)
        pos = [
            b.op("Gather", ["position_ids", b.ints(k, scalar=True)], f"pos_{'thw'[k]}", axis=0)
            for k in range(3)
        ]
        is_t = b.initializer("mrope_is_t", streams == 0)
        is_h = b.initializer("mrope_is_h", streams == 1)
        for table in ("cos_cache", "sin_cache"):
            rows = [
                b.op("Gather", [table, p], f"{table}_{'thw'[k]}", axis=0) for k, p in enumerate(pos)
            ]
            hw = b.op("Where", [is_h, rows[1], rows[2]], f"{table}_hw")
            mrope_cos_sin.append(b.op("Where", [is_t, rows[0], hw], f"{table}_mrope"))

    def attention(h: str, prefix: str, i: int) -> str:
        q = b.op("MatMul", [h, f"{prefix}.self_attn.q_proj.weight"], "q")
        k = b.op("MatMul", [h, f"{prefix}.self_attn.k_proj.weight"], "k")
        v = b.op("MatMul", [h, f"{prefix}.self_attn.v_proj.weight"], "v")
        if cfg.qkv_bias:
            q = b.op("Add", [q, f"{prefix}.self_attn.q_proj.bias"], "q_bias")
            k = b.op("Add", [k, f"{prefix}.self_attn.k_proj.bias"], "k_bias")
            v = b.op("Add", [v, f"{prefix}.self_attn.v_proj.bias"], "v_bias")
        if cfg.qk_norm:
            # (B, S, N*H) -> (B, S, N, H) -> RMSNorm over H -> (B, S, N*H), as mobius emits it.
            split = b.ints(0, 0, -1, cfg.head_dim)
            merged = b.ints(0, 0, -1)
            for name in ("q", "k"):
                t = b.op("Reshape", [q if name == "q" else k, split], f"{name}_heads")
                t = _rms_norm(b, t, f"{prefix}.self_attn.{name}_norm.weight", f"{name}_norm")
                t = b.op("Reshape", [t, merged], f"{name}_normed")
                q, k = (t, k) if name == "q" else (q, t)
        rope = {
            "interleaved": int(cfg.interleaved),
            "rotary_embedding_dim": cfg.rotary_dim or 0,
        }
        rope_inputs = ["cos_cache", "sin_cache", "position_ids"]
        if cfg.positions == "mrope":
            rope_inputs = mrope_cos_sin
        q = b.op("RotaryEmbedding", [q, *rope_inputs], "q_rot", num_heads=cfg.heads, **rope)
        k = b.op("RotaryEmbedding", [k, *rope_inputs], "k_rot", num_heads=cfg.kv_heads, **rope)
        past_kv = [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        y, _, _ = b.op_multi(
            "Attention",
            [q, k, v, mask, *past_kv],
            [b.fresh("attn"), f"present.{i}.key", f"present.{i}.value"],
            q_num_heads=cfg.heads,
            kv_num_heads=cfg.kv_heads,
            scale=1.0 / math.sqrt(cfg.head_dim),
            softcap=float(cfg.softcap),
            is_causal=1,
        )
        return y

    for i in range(cfg.layers):
        x = _layer(b, i, x, attention)
    x = _rms_norm(b, x, "model.norm.weight", "final_norm")
    b.op_multi("MatMul", [x, "lm_head.weight"], ["logits"])


def build_decoder(cfg: DecoderConfig) -> onnx.ModelProto:
    """Build the decoder described by ``cfg`` (see the module docstring)."""
    b = _GraphBuilder()
    for name, array in decoder_weights(cfg).items():
        b.initializer(name, array)
    (_build_mobius if cfg.style == "mobius" else _build_torch23)(b, cfg)

    dt, kv, hd = cfg.onnx_dtype, cfg.kv_heads, cfg.head_dim
    int64 = TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("input_ids", int64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", int64, ["batch", "total"]),
        helper.make_tensor_value_info(
            "position_ids",
            int64,
            [3, "batch", "seq"] if cfg.positions == "mrope" else ["batch", "seq"],
        ),
    ]
    outputs = [helper.make_tensor_value_info("logits", dt, ["batch", "seq", cfg.vocab])]
    for i in range(cfg.layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(
                    f"past_key_values.{i}.{kind}", dt, ["batch", kv, "past", hd]
                )
            )
            outputs.append(
                helper.make_tensor_value_info(
                    f"present.{i}.{kind}", dt, ["batch", kv, "past + seq", hd]
                )
            )
    graph = helper.make_graph(
        b.nodes, f"decoder_{cfg.style}", inputs, outputs, initializer=b.initializers
    )
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET_TORCH18 if cfg.style == "torch18" else OPSET)],
        ir_version=IR_VERSION,
        producer_name="epfuse.tests.model_builder",
    )


def with_carried_state(
    model: onnx.ModelProto, shapes: Sequence[tuple[int, ...]] = ((8, 3), (2, 4, 4))
) -> onnx.ModelProto:
    """``model`` plus fixed-size states carried from step to step, as a hybrid stack's conv /
    recurrent layers have (``past_key_values.{n}.state`` (batch, *shape) in, ``present.{n}.state``
    = past * 0.5 + 1 out; layer numbers after the model's own): the interface without torch."""
    model = copy.deepcopy(model)
    graph = model.graph
    dtype = graph.output[0].type.tensor_type.elem_type
    first = sum(1 for i in graph.input if i.name.endswith(".key"))
    half = numpy_helper.from_array(np.array(0.5, helper.tensor_dtype_to_np_dtype(dtype)), "_half")
    one = numpy_helper.from_array(np.array(1.0, helper.tensor_dtype_to_np_dtype(dtype)), "_one")
    graph.initializer.extend([half, one])
    for n, shape in enumerate(shapes, start=first):
        past, present = f"past_key_values.{n}.state", f"present.{n}.state"
        graph.input.append(helper.make_tensor_value_info(past, dtype, ["batch", *shape]))
        graph.output.append(helper.make_tensor_value_info(present, dtype, ["batch", *shape]))
        graph.node.extend(
            [
                helper.make_node("Mul", [past, "_half"], [f"{past}_scaled"]),
                helper.make_node("Add", [f"{past}_scaled", "_one"], [present]),
            ]
        )
    return model
