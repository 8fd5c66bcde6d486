"""Export tiny random-weight Hugging Face decoders to ONNX with a KV cache.

torch and transformers are optional dependencies (the ``export`` extra); they are imported
inside the functions only, so importing this module never needs them.

The exported graph has the interface of a generic ``torch.onnx`` (dynamo) export:

- inputs ``input_ids`` (B, S) int64, ``attention_mask`` (B, P+S) int64,
  ``position_ids`` (B, S) int64, then ``past_key_values.{l}.key`` / ``.value`` (B, Nkv, P, H)
- outputs ``logits`` (B, S, V), then ``present.{l}.key`` / ``.value`` (B, Nkv, P+S, H)

with dynamic ``batch``, ``seq``, ``past`` and ``total`` dimensions.

:func:`export_hf_mrope_decoder` exports the text decoder (+ LM head) of a vision-language model
with 3-D mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the same interface except ``position_ids``,
which is (3, B, S) (temporal, height, width streams).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Example shapes used to trace the export. The past length must be > 1, otherwise torch
# specialises the dimension to a constant.
_EXAMPLE_BATCH = 2
_EXAMPLE_SEQ = 3
_EXAMPLE_PAST = 5

# Standard deviation of the noise added to every RMSNorm weight, so that layers do not share
# identical norm constants (which would let a buggy rewrite mix them up unnoticed).
_NORM_NOISE_STD = 0.1


def tiny_llama_config(**overrides: Any):
    """The configuration of the bundled example model (a 2-layer GQA Llama)."""
    from transformers import LlamaConfig

    from .hf_families import tiny_dims

    return LlamaConfig(**tiny_dims(**{"rope_theta": 10000.0, **overrides}))


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _kv_dims(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    text = _text_config(config)
    num_layers = int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    num_kv = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    return num_layers, num_kv, int(head_dim)


def tiny_qwen2_5_vl_config(**text_overrides: Any):
    """A tiny Qwen2.5-VL (2-layer GQA text decoder with sectioned mRoPE, a 1-block vision
    tower that the text export does not use)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=_tiny_vl_text(text_overrides, [2, 3, 3]),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64
        ),
    )


def tiny_qwen3_vl_config(**text_overrides: Any):
    """A tiny Qwen3-VL (interleaved mRoPE, q/k norms)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=_tiny_vl_text(text_overrides, [4, 2, 2]),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64
        ),
    )


def _tiny_vl_text(overrides: dict[str, Any], mrope_section: list[int]) -> dict[str, Any]:
    from .hf_families import tiny_dims

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section}
    return tiny_dims(**{"rope_parameters": rope, **overrides})


def _build_model(
    config,
    seed: int,
    initializer_range: float | None,
    dtype: str = "float32",
    auto_class: str = "AutoModelForCausalLM",
):
    """Deterministically build the random-weight causal LM for ``config`` and ``seed``.

    Weights are drawn in float32 and then cast to ``dtype``, so a float16 model is the rounded
    float32 model of the same seed.
    """
    import torch
    import transformers

    config = copy.deepcopy(config)
    text = _text_config(config)
    if initializer_range is None:
        # HF's default 0.02 makes attention almost uniform on tiny models, which hides
        # masking and position bugs; 1/sqrt(hidden) gives realistic attention sharpness.
        initializer_range = 1.0 / math.sqrt(text.hidden_size)
    config.initializer_range = initializer_range
    if text is not config:
        text.initializer_range = initializer_range

    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32)
    model = model.float().eval()

    gen = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                weight = getattr(module, "weight", None)
                if isinstance(weight, torch.nn.Parameter):
                    # Llama-style norms init to 1 (-> 1 + N(0, 0.1)); Gemma-style norms init
                    # to 0 and scale by (1 + w), which gets the same effective spread.
                    noise = torch.randn(weight.shape, generator=gen) * _NORM_NOISE_STD
                    weight.add_(noise.to(weight.dtype))
    return model.to(_torch_dtype(dtype)), config


def hf_model(
    config, seed: int = 0, *, initializer_range: float | None = None, dtype: str = "float32"
):
    """The seeded torch causal LM that :func:`export_hf_decoder` exports (for ``generate``)."""
    return _build_model(config, seed, initializer_range, dtype)[0]


def _torch_dtype(dtype: str):
    import torch

    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            dtype
        ]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}") from None


def _make_wrapper(model, num_layers: int, text_only: bool = False):
    """``text_only``: a vision-language model's text decoder and LM head, nothing visual."""
    import torch
    from transformers import DynamicCache

    lm_head = model.lm_head if text_only else None
    if text_only:
        model = model.model.language_model
    # transformers >= 5.x renamed ``past_key_values`` to ``cache`` (argument and output field).
    cache_kw = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    class _Wrapper(torch.nn.Module):
        """Flat past tensors in, flat present tensors out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            # A plain (full) cache on every layer, as a generic export has: with
            # DynamicCache(config=config), sliding-window layers crop their cache and the
            # export specialises on the example lengths (Mistral with a window < past + seq
            # then fails at run time). Sliding-window masking is still applied from the config.
            cache = DynamicCache()
            for layer in range(num_layers):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_kw: cache},
            )
            pkv = getattr(out, cache_kw)
            presents = [
                t
                for layer in range(num_layers)
                for t in (pkv.layers[layer].keys, pkv.layers[layer].values)
            ]
            logits = lm_head(out.last_hidden_state) if text_only else out.logits
            return (logits, *presents)

    return _Wrapper().eval()


def past_input_names(num_layers: int) -> list[str]:
    return [
        f"past_key_values.{layer}.{kv}" for layer in range(num_layers) for kv in ("key", "value")
    ]


def present_output_names(num_layers: int) -> list[str]:
    return [f"present.{layer}.{kv}" for layer in range(num_layers) for kv in ("key", "value")]


@contextlib.contextmanager
def _quiet():
    """Silence the exporter's prints, warnings and log messages (captured, shown on failure)."""
    buf = io.StringIO()
    loggers = [logging.getLogger(n) for n in ("torch", "torch.onnx", "onnxscript", "transformers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(buf),
            contextlib.redirect_stderr(buf),
        ):
            warnings.simplefilter("ignore")
            yield buf
    except Exception as exc:
        captured = buf.getvalue()
        if captured:
            exc.add_note("exporter output:\n" + captured[-8000:])
        raise
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def export_hf_decoder(
    config,
    path: str | Path,
    *,
    opset: int = 23,
    seed: int = 0,
    initializer_range: float | None = None,
    dtype: str = "float32",
    dynamo: bool = True,
) -> Path:
    """Export a random-weight decoder built from ``config`` to a single ONNX file at ``path``.

    Weights are seeded with ``seed`` (see :func:`hf_reference` for the same model in torch).
    ``initializer_range`` defaults to ``1/sqrt(hidden_size)``. ``dtype`` (``float32``,
    ``float16`` or ``bfloat16``) is the dtype of the weights, KV cache and logits; the weights
    are the float32 ones of the same seed, rounded. ``dynamo=False`` uses torch.onnx's
    TorchScript exporter (a traced graph, ``dynamic_axes``; the exporter Optimum drives) with the
    same interface. Returns the written path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model, config = _build_model(config, seed, initializer_range, dtype)
    wrapper = _make_wrapper(model, _kv_dims(config)[0])
    return _export(wrapper, path, config, seed, opset, dtype, mrope=False, dynamo=dynamo)


def _export(
    wrapper,
    path: Path,
    config,
    seed: int,
    opset: int,
    dtype: str,
    *,
    mrope: bool,
    dynamo: bool = True,
) -> Path:
    """torch.onnx export of a flat-cache wrapper with dynamic batch/seq/past (dynamo, or the
    TorchScript exporter when ``dynamo`` is false)."""
    import torch

    num_layers, num_kv, head_dim = _kv_dims(config)
    b, s, p = _EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST
    vocab = int(_text_config(config).vocab_size)
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (b, s), generator=gen, dtype=torch.int64)
    attention_mask = torch.ones((b, p + s), dtype=torch.int64)
    bd, sd, pd, td = (torch.export.Dim(n) for n in ("batch", "seq", "past", "total"))
    if mrope:
        # Distinct streams, so that nothing specialises on T == H == W.
        position_ids = torch.stack([torch.arange(p, p + s) + k for k in range(3)])
        position_ids = position_ids[:, None, :].expand(3, b, s).contiguous()
        position_dims = {1: bd, 2: sd}
    else:
        position_ids = torch.arange(p, p + s, dtype=torch.int64).unsqueeze(0).expand(b, s)
        position_ids = position_ids.contiguous()
        position_dims = {0: bd, 1: sd}
    past = tuple(
        torch.randn((b, num_kv, p, head_dim), generator=gen).to(_torch_dtype(dtype))
        for _ in range(2 * num_layers)
    )
    dynamic_shapes = (
        {0: bd, 1: sd},
        {0: bd, 1: td},
        position_dims,
        tuple({0: bd, 2: pd} for _ in range(2 * num_layers)),
    )
    input_names = ["input_ids", "attention_mask", "position_ids", *past_input_names(num_layers)]
    output_names = ["logits", *present_output_names(num_layers)]
    if not dynamo:
        # The TorchScript exporter takes named axes per input and output instead of Dims.
        axes = {
            name: {axis: dim.__name__ for axis, dim in dims.items()}
            for name, dims in zip(input_names[:3], dynamic_shapes[:3], strict=True)
        }
        axes.update({name: {0: "batch", 2: "past"} for name in input_names[3:]})
        axes["logits"] = {0: "batch", 1: "seq"}
        axes.update({name: {0: "batch", 2: "total"} for name in output_names[1:]})
        with _quiet(), torch.no_grad():
            torch.onnx.export(
                wrapper,
                (input_ids, attention_mask, position_ids, *past),
                str(path),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=axes,
                opset_version=opset,
                dynamo=False,
            )
        return path
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (input_ids, attention_mask, position_ids, *past),
            input_names=input_names,
            output_names=output_names,
            dynamic_shapes=dynamic_shapes,
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
        program.save(str(path), external_data=False)
    return path


def hf_reference(
    config,
    seed: int,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray | None = None,
    past: Sequence[np.ndarray] | None = None,
    *,
    initializer_range: float | None = None,
    dtype: str = "float32",
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Run the same seeded torch model that :func:`export_hf_decoder` exports.

    ``past`` is the flat list ``[k0, v0, k1, v1, ...]`` of (B, Nkv, P, H) arrays (empty or
    None for a prompt). ``position_ids`` defaults to the mask's cumulative sum minus one.
    Returns ``(logits, presents)`` as float32 numpy arrays (computed in ``dtype``), presents
    flat in the same order as the exported graph's outputs.
    """
    import torch

    tdtype = _torch_dtype(dtype)
    model, config = _build_model(config, seed, initializer_range, dtype)
    num_layers, num_kv, head_dim = _kv_dims(config)
    wrapper = _make_wrapper(model, num_layers)

    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    mask = torch.from_numpy(np.asarray(attention_mask, dtype=np.int64))
    if position_ids is None:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    else:
        pos = torch.from_numpy(np.asarray(position_ids, dtype=np.int64))
    if past:
        past_t = [torch.from_numpy(np.asarray(t, dtype=np.float32)).to(tdtype) for t in past]
    else:
        empty = (ids.shape[0], num_kv, 0, head_dim)
        past_t = [torch.zeros(empty, dtype=tdtype) for _ in range(2 * num_layers)]
    with torch.no_grad():
        out = wrapper(ids, mask, pos, *past_t)
    return out[0].float().numpy(), [t.float().numpy() for t in out[1:]]


def export_hf_mrope_decoder(
    config,
    path: str | Path,
    *,
    opset: int = 23,
    seed: int = 0,
    initializer_range: float | None = None,
    dtype: str = "float32",
) -> Path:
    """Export the text decoder + LM head of a vision-language ``config`` (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL) with (3, B, S) ``position_ids``; otherwise as :func:`export_hf_decoder`.

    The vision tower is built (random) but not exported: image features would enter as input
    embeddings, which does not change the decoder's attention or its mRoPE.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model, config = _build_model(
        config, seed, initializer_range, dtype, auto_class="AutoModelForImageTextToText"
    )
    wrapper = _make_wrapper(model, _kv_dims(config)[0], text_only=True)
    return _export(wrapper, path, config, seed, opset, dtype, mrope=True)


def hf_mrope_reference(
    config,
    seed: int,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    past: Sequence[np.ndarray] | None = None,
    *,
    initializer_range: float | None = None,
    dtype: str = "float32",
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The torch model :func:`export_hf_mrope_decoder` exports, run on (3, B, S) positions."""
    import torch

    tdtype = _torch_dtype(dtype)
    model, config = _build_model(
        config, seed, initializer_range, dtype, auto_class="AutoModelForImageTextToText"
    )
    num_layers, num_kv, head_dim = _kv_dims(config)
    wrapper = _make_wrapper(model, num_layers, text_only=True)
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    mask = torch.from_numpy(np.asarray(attention_mask, dtype=np.int64))
    pos = torch.from_numpy(np.asarray(position_ids, dtype=np.int64))
    if past:
        past_t = [torch.from_numpy(np.asarray(t, dtype=np.float32)).to(tdtype) for t in past]
    else:
        empty = (ids.shape[0], num_kv, 0, head_dim)
        past_t = [torch.zeros(empty, dtype=tdtype) for _ in range(2 * num_layers)]
    with torch.no_grad():
        out = wrapper(ids, mask, pos, *past_t)
    return out[0].float().numpy(), [t.float().numpy() for t in out[1:]]
