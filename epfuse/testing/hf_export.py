"""Export tiny random-weight Hugging Face decoders to ONNX with a KV cache.

torch and transformers are optional dependencies (the ``export`` extra); they are imported
inside the functions only, so importing this module never needs them.

The exported graph has the interface of a generic ``torch.onnx`` (dynamo) export:

- inputs ``input_ids`` (B, S) int64, ``attention_mask`` (B, P+S) int64,
  ``position_ids`` (B, S) int64, then ``past_key_values.{l}.key`` / ``.value`` (B, Nkv, P, H)
- outputs ``logits`` (B, S, V), then ``present.{l}.key`` / ``.value`` (B, Nkv, P+S, H)

with dynamic ``batch``, ``seq``, ``past`` and ``total`` dimensions.

Hybrid stacks (Qwen3-Next / Qwen3.5 gated delta-net, LFM2 short-conv, Granite-MoE-hybrid Mamba
layers between attention layers) keep a fixed-size state per non-attention layer instead of a
KV cache: such a layer ``l`` has ``past_key_values.{l}.conv`` (B, channels, kernel) and, where it
keeps one, ``past_key_values.{l}.recurrent`` (B, heads, ...) inputs and ``present.{l}.conv`` /
``present.{l}.recurrent`` outputs of the same shapes (only the batch is dynamic), in layer order
among the attention layers' key/value. Zeros are a first prompt's state, exactly (a causal conv
over zero padding, a scan from a zero state).

:func:`export_hf_mrope_decoder` exports the text decoder (+ LM head) of a vision-language model
with 3-D mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): the same interface except ``position_ids``,
which is (3, B, S) (temporal, height, width streams).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class CacheSlot:
    """One flat past input / present output of the export: a layer's key or value (``shape``
    None: (B, Nkv, P, H)) or a non-attention layer's fixed-size conv or recurrent state
    (``shape``: its dims after the batch)."""

    layer: int
    kind: str  # "key", "value", "conv" or "recurrent"
    shape: tuple[int, ...] | None = None

    @property
    def past_name(self) -> str:
        return f"past_key_values.{self.layer}.{self.kind}"

    @property
    def present_name(self) -> str:
        return f"present.{self.layer}.{self.kind}"

    @property
    def io_names(self) -> tuple[str, str]:
        return self.past_name, self.present_name


def cache_slots(config, model=None) -> list[CacheSlot]:
    """The flat cache of ``config``'s decoder, in export order.

    A plain decoder has a key and a value per layer. A hybrid stack is read the way Hugging
    Face's generation builds its cache, ``DynamicCache(config=config)`` (transformers 5.x): a
    layer whose cache layer keeps conv/recurrent state (``LinearAttentionCacheLayerMixin``)
    contributes those states, sized by one eager forward of ``model`` (built from ``config``
    when not given) on a short prompt, since their shapes are the model's business (conv
    channels and kernel, recurrent heads and state size).
    """
    import torch

    num_layers = _kv_dims(config)[0]
    layer_kinds = _linear_layers(config)
    if not layer_kinds:
        return [CacheSlot(layer, kind) for layer in range(num_layers) for kind in ("key", "value")]
    from transformers import DynamicCache

    if model is None:
        model = _build_model(config, 0, None)[0]
    cache = DynamicCache(config=_text_config(config))
    ids = torch.zeros((1, 2), dtype=torch.int64)
    with torch.no_grad():
        model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            use_cache=True,
            **{_cache_kw(model): cache},
        )
    slots = []
    for layer in range(num_layers):
        if layer not in layer_kinds:
            slots += [CacheSlot(layer, "key"), CacheSlot(layer, "value")]
            continue
        entry = cache.layers[layer]
        if entry.number_of_states != 1:
            raise NotImplementedError(f"layer {layer} keeps {entry.number_of_states} states")
        for kind, states in (("conv", entry.conv_states), ("recurrent", entry.recurrent_states)):
            if states[0] is not None:
                slots.append(CacheSlot(layer, kind, tuple(states[0].shape[1:])))
    return slots


def _linear_layers(config) -> set[int]:
    """The layers whose Hugging Face cache layer keeps conv/recurrent state (no KV)."""
    try:
        from transformers import cache_utils
    except ImportError:  # pragma: no cover - transformers is the caller's
        return set()
    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    types = getattr(_text_config(config), "layer_types", None)
    if mixin is None or not types:
        return set()
    mapping = cache_utils.DYNAMIC_LAYER_TYPE_MAPPING
    out = set()
    for layer, kind in enumerate(types):
        cls = mapping.get(kind)
        if cls is None:
            continue
        if issubclass(cls, mixin):
            if issubclass(cls, cache_utils.DynamicLayer):
                raise NotImplementedError(f"layer {layer}: {kind!r} keeps both KV and state")
            out.add(layer)
    return out


def _cache_kw(model) -> str:
    # transformers >= 5.x renamed ``past_key_values`` to ``cache`` (argument and output field).
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


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


def _make_wrapper(model, slots: Sequence[CacheSlot], text_only: bool = False, config=None):
    """``text_only``: a vision-language model's text decoder and LM head, nothing visual.

    ``slots`` is the flat cache (:func:`cache_slots`); a hybrid stack's cache is
    ``DynamicCache(config=config)``, its conv/recurrent layers pre-filled from the inputs.
    """
    import torch
    from transformers import DynamicCache

    lm_head = model.lm_head if text_only else None
    if text_only:
        model = model.model.language_model
    cache_kw = _cache_kw(model)
    hybrid = any(slot.shape is not None for slot in slots)
    text_config = _text_config(config) if hybrid else None

    class _Wrapper(torch.nn.Module):
        """Flat past tensors in, flat present tensors out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            if hybrid:
                cache = _hybrid_cache(text_config, slots, past)
            else:
                # A plain (full) cache on every layer, as a generic export has: with
                # DynamicCache(config=config), sliding-window layers crop their cache and the
                # export specialises on the example lengths (Mistral with a window < past +
                # seq then fails at run time). Sliding-window masking is still applied from
                # the config.
                cache = DynamicCache()
                for layer in range(len(slots) // 2):
                    cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_kw: cache},
            )
            pkv = getattr(out, cache_kw)
            presents = [_present(pkv.layers[slot.layer], slot.kind) for slot in slots]
            logits = lm_head(out.last_hidden_state) if text_only else out.logits
            return (logits, *presents)

    return _Wrapper().eval()


def _hybrid_cache(text_config, slots: Sequence[CacheSlot], past: Sequence[Any]):
    """``DynamicCache(config=...)`` holding ``past``: key/value through ``update``, conv and
    recurrent states as a layer that has seen a previous step (so the model continues from them,
    on the same code path for every length; zeros are an exact first prompt)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=text_config)
    by_layer: dict[int, dict[str, Any]] = {}
    for slot, tensor in zip(slots, past, strict=True):
        by_layer.setdefault(slot.layer, {})[slot.kind] = tensor
    for layer, tensors in by_layer.items():
        if "key" in tensors:
            cache.update(tensors["key"], tensors["value"], layer)
            continue
        entry = cache.layers[layer]
        ref = tensors.get("conv", tensors.get("recurrent"))
        entry.dtype, entry.device = ref.dtype, ref.device
        if "conv" in tensors:
            # clone: the cache copies the new state into it in place.
            entry.conv_states[0] = tensors["conv"].clone()
            entry.conv_kernel_size[0] = int(tensors["conv"].shape[-1])
            entry.is_conv_states_initialized[0] = True
        if "recurrent" in tensors:
            entry.recurrent_states[0] = tensors["recurrent"].clone()
            entry.is_recurrent_states_initialized[0] = True
        entry.has_previous_state[0] = True
    return cache


def _present(layer, kind: str):
    if kind == "key":
        return layer.keys
    if kind == "value":
        return layer.values
    return (layer.conv_states if kind == "conv" else layer.recurrent_states)[0]


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
    slots = cache_slots(config, model)
    wrapper = _make_wrapper(model, slots, config=config)
    return _export(wrapper, path, config, seed, opset, dtype, slots, mrope=False, dynamo=dynamo)


def _export(
    wrapper,
    path: Path,
    config,
    seed: int,
    opset: int,
    dtype: str,
    slots: Sequence[CacheSlot],
    *,
    mrope: bool,
    dynamo: bool = True,
) -> Path:
    """torch.onnx export of a flat-cache wrapper with dynamic batch/seq/past (dynamo, or the
    TorchScript exporter when ``dynamo`` is false)."""
    import torch

    _, num_kv, head_dim = _kv_dims(config)
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
    # A state is only batch-dynamic; random values, so nothing specialises on zeros.
    past = tuple(
        torch.randn(
            (b, num_kv, p, head_dim) if slot.shape is None else (b, *slot.shape), generator=gen
        ).to(_torch_dtype(dtype))
        for slot in slots
    )
    dynamic_shapes = (
        {0: bd, 1: sd},
        {0: bd, 1: td},
        position_dims,
        tuple({0: bd, 2: pd} if slot.shape is None else {0: bd} for slot in slots),
    )
    input_names = ["input_ids", "attention_mask", "position_ids"]
    input_names += [slot.past_name for slot in slots]
    output_names = ["logits", *(slot.present_name for slot in slots)]
    # The dynamo exporter returns a program to save and takes Dims; the TorchScript one
    # writes the file itself and takes named axes per input and output.
    dynamic: dict[str, Any] = {"dynamic_shapes": dynamic_shapes, "verbose": False}
    if not dynamo:
        axes = {
            name: {axis: dim.__name__ for axis, dim in dims.items()}
            for name, dims in zip(input_names[:3], dynamic_shapes[:3], strict=True)
        }
        for slot in slots:
            kv = slot.shape is None
            axes[slot.past_name] = {0: "batch", 2: "past"} if kv else {0: "batch"}
            axes[slot.present_name] = {0: "batch", 2: "total"} if kv else {0: "batch"}
        axes["logits"] = {0: "batch", 1: "seq"}
        dynamic = {"f": str(path), "dynamic_axes": axes}
    with _quiet(), torch.no_grad():
        program = torch.onnx.export(
            wrapper,
            (input_ids, attention_mask, position_ids, *past),
            input_names=input_names,
            output_names=output_names,
            opset_version=opset,
            dynamo=dynamo,
            **dynamic,
        )
        if dynamo:
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
    None for a prompt; a hybrid stack's in :func:`cache_slots` order, zero states for a
    prompt). ``position_ids`` defaults to the mask's cumulative sum minus one.
    Returns ``(logits, presents)`` as float32 numpy arrays (computed in ``dtype``), presents
    flat in the same order as the exported graph's outputs.
    """
    import torch

    tdtype = _torch_dtype(dtype)
    model, config = _build_model(config, seed, initializer_range, dtype)
    _, num_kv, head_dim = _kv_dims(config)
    slots = cache_slots(config, model)
    wrapper = _make_wrapper(model, slots, config=config)

    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    mask = torch.from_numpy(np.asarray(attention_mask, dtype=np.int64))
    if position_ids is None:
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
    else:
        pos = torch.from_numpy(np.asarray(position_ids, dtype=np.int64))
    if past:
        past_t = [torch.from_numpy(np.asarray(t, dtype=np.float32)).to(tdtype) for t in past]
    else:
        past_t = [
            torch.zeros(
                (ids.shape[0], *((num_kv, 0, head_dim) if slot.shape is None else slot.shape)),
                dtype=tdtype,
            )
            for slot in slots
        ]
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
    slots = cache_slots(config)
    wrapper = _make_wrapper(model, slots, text_only=True)
    return _export(wrapper, path, config, seed, opset, dtype, slots, mrope=True)


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
    wrapper = _make_wrapper(model, cache_slots(config), text_only=True)
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
