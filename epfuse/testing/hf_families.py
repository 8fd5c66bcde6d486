"""Tiny configurations of Hugging Face decoder families, for real-export tests.

Every config is built locally (no hub access): hidden 64, 4 query heads, 2 KV heads, vocab
256, 2 layers (more where a family needs both sliding and global layers). Each family exists
to exercise one export idiom the optimizer must handle: rope scaling (llama3, linear, yarn),
projection biases, sliding windows, softcapping, q/k norms, fused QKV projections, partial
rotary. ``window`` is the sliding window of the family (None when it has none), so tests can
pick prompt and past lengths beyond it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

SLIDING_WINDOW = 4

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_dims(**overrides: Any) -> dict[str, Any]:
    """The dims every tiny test model shares (2 layers, 4 query / 2 KV heads of 16, hidden 64,
    vocab 256), with ``overrides`` applied: the one place they are written, for any config
    class (``LlamaConfig(**tiny_dims(sliding_window=4))``)."""
    return {**_COMMON, "head_dim": 16, **overrides}


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    make_config: Callable[[], Any]
    window: int | None = None
    """The sliding window of the family's local layers, if any."""
    description: str = ""


def rope_kwargs(theta: float = 1e4, **rope: Any) -> dict[str, Any]:
    """Config keyword arguments for RoPE in the installed transformers' spelling.

    transformers 5.x takes one ``rope_parameters`` dict; 4.x (which Optimum pins) takes
    ``rope_theta``, ``rope_scaling`` (None for the default rope) and ``partial_rotary_factor``
    as separate attributes. The model computed is the same.
    """
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **rope}}
    rope = dict(rope)
    kwargs: dict[str, Any] = {"rope_theta": theta}
    if "partial_rotary_factor" in rope:
        kwargs["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    if rope.get("rope_type", "default") != "default":
        kwargs["rope_scaling"] = rope
    return kwargs


def _llama(**rope: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, head_dim=16, **rope_kwargs(10000.0, **rope))


def _llama3():
    return _llama(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )


def _llama_linear():
    return _llama(rope_type="linear", factor=2.0)


def _llama_yarn():
    return _llama(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**_COMMON, **rope_kwargs())


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, head_dim=16, sliding_window=SLIDING_WINDOW)


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        **_COMMON,
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0,
        query_pre_attn_scalar=24,
    )


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=16)


def _phi3():
    from transformers import Phi3Config

    return Phi3Config(**_COMMON, pad_token_id=0)


def _stablelm():
    from transformers import StableLmConfig

    # StableLM derives head_dim from hidden_size: 128 / 4 heads = 32, so that the rotated half
    # (16 channels, cos width 8) is one the CPU's fused rotary accepts.
    return StableLmConfig(
        **{**_COMMON, "hidden_size": 128}, **rope_kwargs(partial_rotary_factor=0.5)
    )


def _glm():
    from transformers import GlmConfig

    return GlmConfig(
        **_COMMON, head_dim=32, **rope_kwargs(partial_rotary_factor=0.5), pad_token_id=0
    )


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 4},
        head_dim=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=16,
    )


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**_COMMON)


def _phi2():
    from transformers import PhiConfig

    # head_dim 128 / 4 = 32, rotary half of it (cos width 8), as StableLM.
    return PhiConfig(**{**_COMMON, "hidden_size": 128}, **rope_kwargs(partial_rotary_factor=0.5))


def _granite():
    from transformers import GraniteConfig

    return GraniteConfig(
        **_COMMON,
        embedding_multiplier=2.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=4.0,
    )


def _smollm3():
    from transformers import SmolLM3Config

    # Layer 1 of every 2 has no RoPE (NoPE), as SmolLM3's every-4th layer.
    return SmolLM3Config(**_COMMON, no_rope_layer_interval=2, pad_token_id=0)


def _cohere():
    from transformers import CohereConfig

    return CohereConfig(**_COMMON, logit_scale=0.5, pad_token_id=0)


def _gpt_oss():
    from transformers import GptOssConfig

    # experts_implementation="batched_mm": transformers 5.x's default (grouped_mm) calls the
    # custom op transformers::grouped_mm_fallback, which torch.onnx cannot translate, and
    # "eager" loops over the experts hit (data-dependent: GuardOnDataDependentSymNode).
    # batched_mm gathers each token's expert weights and runs batched MatMuls instead.
    return GptOssConfig(
        **{**_COMMON, "intermediate_size": 64},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        experts_implementation="batched_mm",
        **rope_kwargs(
            150000.0,
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=128,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    )


def _nemotron():
    from transformers import NemotronConfig

    # Nemotron: LayerNorm1P (weight + 1), squared-ReLU MLP, partial rotary 0.5. head_dim 32 so
    # that the rotated half (16 channels, cos width 8) is one the CPU's fused rotary accepts.
    return NemotronConfig(
        **tiny_dims(head_dim=32), **rope_kwargs(partial_rotary_factor=0.5), pad_token_id=0
    )


def _olmo():
    from transformers import OlmoConfig

    # OLMo (1): LayerNorm without weights, Q/K/V clamped to +-clip_qkv before attention.
    return OlmoConfig(
        **_COMMON, clip_qkv=0.5, **rope_kwargs(), pad_token_id=0, bos_token_id=1, eos_token_id=2
    )


def _olmo3():
    from transformers import Olmo3Config

    # OLMo-3: OLMo-2's q/k RMSNorm over all heads, sliding layers between full ones.
    return Olmo3Config(
        **tiny_dims(),
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gemma():
    from transformers import GemmaConfig

    # Gemma 1: RMSNorm with (1 + weight), embeddings scaled by sqrt(hidden), GeLU-tanh MLP.
    return GemmaConfig(**tiny_dims(), **rope_kwargs())


def _ernie4_5():
    from transformers import Ernie4_5Config

    # Ernie 4.5: interleaved rotary (cos/sin repeat_interleave'd, rotate every two).
    return Ernie4_5Config(**tiny_dims(), **rope_kwargs(), pad_token_id=0)


def _hunyuan_dense():
    from transformers import HunYuanDenseV1Config

    # HunYuan dense: per-head q/k RMSNorm applied *after* RoPE.
    return HunYuanDenseV1Config(**tiny_dims(), **rope_kwargs(), pad_token_id=0)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama3", _llama3, description="Llama, rope_type llama3"),
        Family("llama-linear", _llama_linear, description="Llama, rope_type linear"),
        Family("llama-yarn", _llama_yarn, description="Llama, rope_type yarn (attention factor)"),
        Family("qwen2", _qwen2, description="q/k/v projection biases"),
        Family("mistral", _mistral, SLIDING_WINDOW, "sliding window on every layer"),
        Family("gemma2", _gemma2, SLIDING_WINDOW, "softcaps, alternating sliding layers"),
        Family("qwen3", _qwen3, description="per-head q/k RMSNorm before RoPE"),
        Family("phi3", _phi3, description="fused qkv_proj split into Q, K, V"),
        Family("stablelm", _stablelm, description="partial rotary, LayerNorm, biases"),
        Family("gemma3", _gemma3, SLIDING_WINDOW, "q/k norm, local RoPE base, sliding layers"),
        Family("glm", _glm, description="partial interleaved rotary (half of head_dim 32)"),
        Family("olmo2", _olmo2, description="q/k RMSNorm over all heads before reshape"),
        Family("nemotron", _nemotron, description="LayerNorm1P, squared ReLU, partial rotary"),
        Family("olmo", _olmo, description="weightless LayerNorm, Q/K/V clipped (clip_qkv)"),
        Family("olmo3", _olmo3, SLIDING_WINDOW, "OLMo-2 q/k norm, alternating sliding layers"),
        Family("gemma", _gemma, description="(1 + weight) RMSNorm, scaled embeddings, GeLU"),
        Family("ernie4_5", _ernie4_5, description="interleaved rotary on repeated halves"),
        Family("hunyuan-dense", _hunyuan_dense, description="q/k RMSNorm after RoPE"),
    )
}

MORE_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("phi2", _phi2, description="partial rotary, LayerNorm, parallel attention + MLP"),
        Family("granite", _granite, description="embedding/attention/residual multipliers"),
        Family("smollm3", _smollm3, description="NoPE layers between RoPE layers"),
        Family("cohere", _cohere, description="interleaved rotary, mean-centred LayerNorm"),
    )
}
"""Families added for the exporters issue (Optimum's list); not yet in the dynamo family tests."""

ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **MORE_FAMILIES}


def _mixtral():
    from transformers import MixtralConfig

    # batched_mm experts: see _gpt_oss.
    return MixtralConfig(
        **_COMMON,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation="batched_mm",
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # norm_topk_prob=False: the top-k softmax weights are used as they are (not renormalized),
    # the router semantics Mixtral does not cover.
    return Qwen3MoeConfig(
        **_COMMON,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        experts_implementation="batched_mm",
    )


def _phimoe():
    from transformers import PhimoeConfig

    # PhiMoE routes with sparsemixer (two masked-softmax ArgMax rounds, no TopK), which ORT's
    # use_sparse_mixer MoE does not compute: the experts stay as exported (Kept, NOT_PROVEN).
    # No jitter: the router is deterministic at inference anyway, and a random-weight model
    # must not depend on it. batched_mm experts: see _gpt_oss.
    return PhimoeConfig(
        **tiny_dims(),
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        input_jitter_noise=0.0,
        experts_implementation="batched_mm",
    )


MOE_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("mixtral", _mixtral, description="4 experts, top 2, renormalized, [gate|up] SwiGLU"),
        Family("qwen3-moe", _qwen3_moe, description="4 experts, top 2, softmax weights as is"),
    )
}
"""Mixture-of-experts families (tests/families/test_moe.py); transformers 5.x only."""

KEPT_EXPERTS_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (Family("phimoe", _phimoe, description="4 experts, sparsemixer top 2 (no TopK)"),)
}
"""MoE families whose experts are kept (tests/families/test_moe.py); transformers 5.x only."""

SINK_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "gpt-oss",
            _gpt_oss,
            SLIDING_WINDOW,
            "per-head attention sinks, alternating sliding/full layers, YaRN, clamped-SwiGLU experts",
        ),
    )
}
"""Families with attention sinks (tests/families/test_gpt_oss.py); transformers 5.x only."""


def _longrope_factors(half: int) -> dict[str, list[float]]:
    """Distinct short and long factors per frequency (LongRoPE's searched rescale factors
    are per frequency; equal lists would hide a swapped cache)."""
    short = [1.0 + 0.05 * i for i in range(half)]
    long = [1.5 + 0.4 * i for i in range(half)]
    return {"short_factor": short, "long_factor": long}


LONGROPE_ORIGINAL_MAX = 16
"""original_max_position_embeddings of the LongRoPE families: small, so prompts and pasts of
a few tens of tokens cross Hugging Face's short/long switch."""


def _phi3_longrope(hidden: int = 64, partial: float = 1.0):
    import transformers
    from transformers import Phi3Config

    head_dim = hidden // _COMMON["num_attention_heads"]
    half = int(head_dim * partial) // 2
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope = rope_kwargs(
            rope_type="longrope",
            partial_rotary_factor=partial,
            original_max_position_embeddings=LONGROPE_ORIGINAL_MAX,
            **_longrope_factors(half),
        )
    else:  # 4.x's Phi3Config takes exactly {type, short_factor, long_factor}
        rope = {
            "rope_theta": 1e4,
            "partial_rotary_factor": partial,
            "rope_scaling": {"type": "longrope", **_longrope_factors(half)},
        }
    # max_position_embeddings 4x the original: the attention factor
    # sqrt(1 + ln 4 / ln 16) = 1.22 scales cos/sin (Hugging Face's attention_scaling).
    return Phi3Config(
        **{**_COMMON, "hidden_size": hidden, "max_position_embeddings": 4 * LONGROPE_ORIGINAL_MAX},
        original_max_position_embeddings=LONGROPE_ORIGINAL_MAX,
        pad_token_id=0,
        **rope,
    )


def _phi4_mini_longrope():
    # Phi-4-mini: partial rotary 0.75. head_dim 64 (hidden 256 / 4 heads) rotates 48
    # channels, cos width 24: a multiple of 8, which the CPU's fused rotary needs.
    return _phi3_longrope(hidden=256, partial=0.75)


LONGROPE_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "phi3-longrope",
            _phi3_longrope,
            description="Phi-3.5-mini: LongRoPE short/long factors switched at run time",
        ),
        Family(
            "phi4-mini-longrope",
            _phi4_mini_longrope,
            description="Phi-4-mini: LongRoPE with partial rotary 0.75",
        ),
    )
}
"""LongRoPE families (tests/families/test_longrope.py): Hugging Face picks the long or short
factors per call (max(position_ids) + 1 > original_max_position_embeddings)."""

# --- Hybrid stacks: attention layers between layers that keep a fixed-size state (one block). ---


def _qwen3_next():
    from transformers import Qwen3NextConfig

    # One gated delta-net layer, one gated full-attention layer; dense MLPs (mlp_only_layers)
    # so the experts do not stand in the way of what is tested here. head_dim 64 with the real
    # partial rotary factor 0.25: 16 rotated channels (cos width 8, as StableLM).
    return Qwen3NextConfig(
        **tiny_dims(head_dim=64),
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        mlp_only_layers=[0, 1],
        **rope_kwargs(partial_rotary_factor=0.25),
    )


def _qwen3_next_attention():
    # Qwen3-Next with only its gated full-attention layers: the delta-net layers cannot be
    # exported (tests/families/test_hybrid.py), the attention with its output gate
    # sigmoid(gate) * attn and per-head q/k norms can.
    config = _qwen3_next()
    config.layer_types = ["full_attention", "full_attention"]
    return config


def _qwen3_5():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **tiny_dims(head_dim=64),
        layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        **rope_kwargs(partial_rotary_factor=0.25),
    )


def _lfm2():
    from transformers import Lfm2Config

    # conv, attention, conv: the last conv state is computed from the attention's output.
    return Lfm2Config(
        **tiny_dims(num_hidden_layers=3),
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        **rope_kwargs(),
    )


def _granite_moe_hybrid():
    from transformers import GraniteMoeHybridConfig

    # Granite-4.0-H's layout in small: a Mamba-2 layer, then an attention layer without RoPE
    # (position_embedding_type None, as the released models), experts plus a shared MLP; a
    # second Mamba layer after the attention, so its state depends on the attention's output.
    return GraniteMoeHybridConfig(
        **tiny_dims(),
        layer_types=["full_attention", "linear_attention"],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        experts_implementation="batched_mm",
    )


HYBRID_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3-next",
            _qwen3_next,
            description="gated delta-net + gated full attention (q/k norm, partial rotary)",
        ),
        Family(
            "qwen3-next-attention",
            _qwen3_next_attention,
            description="Qwen3-Next's gated full-attention layers alone (output gate, q/k norm)",
        ),
        Family("qwen3.5", _qwen3_5, description="Qwen3.5 text: gated delta-net + gated attention"),
        Family("lfm2", _lfm2, description="short-conv layers + attention (q/k norm)"),
        Family(
            "granite-moe-hybrid",
            _granite_moe_hybrid,
            description="Mamba-2 layers + NoPE attention, experts + shared MLP",
        ),
    )
}
"""Hybrid stacks (tests/families/test_hybrid.py); transformers 5.x only. Each has an attention
layer and a layer that keeps conv/recurrent state, exported as extra inputs/outputs."""
