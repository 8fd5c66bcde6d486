"""An int8 KV cache (``kv_cache="int8"``): GroupQueryAttention past/present typed int8.

ORT's GroupQueryAttention takes a quantized cache (``k_quant_type``/``v_quant_type``,
``kv_cache_bit_width`` and float ``k_scale``/``v_scale`` inputs 12 and 13); on the CPU EP of
ORT 1.32 int8 (not uint8) with per-tensor and per-channel scales, fp32 and fp16 compute,
known-answer checked by the probe (``gqa.kv_cache_int8``). The kernel quantizes the new
K/V with the given scales and dequantizes the past on the fly: the cache holds a quarter of
the fp32 bytes.

The scales are static (they are initializers: the kernel has no dynamic-scale mode), so they
are *calibrated*: the lowered model (float cache) is run on random-token prompts and each
layer's scale is ``HEADROOM * max|x| / 127`` per (KV head, channel) ("PER_CHANNEL", shape
``(kv_heads, 1, head_size)``). K is rotated in the cache (``do_rotary=1``), and a rotation
moves magnitude between the two channels of a rotary pair with the position, so both channels
of a pair get the scale of ``sqrt(max|k_i|^2 + max|k_j|^2)``, a bound on the pair's norm,
which no rotation changes: a key calibrated at one position is in range at every position. Values beyond the
calibrated range saturate at +-127 steps (the headroom keeps random-token inputs inside it).

Only layers whose past is a graph input read by the GroupQueryAttention alone (or a ``Shape``)
and whose present is a graph output get the int8 cache; others keep the compute dtype and are
named in the report. :func:`float_cache_boundary` wraps a quantized-cache model with float
past/present (quantize in, dequantize out) so verification feeds it the same past as the
unfused reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

KV_CACHES: tuple[str, ...] = ("int8",)
HEADROOM = 1.25
"""Calibrated range times this: random-token maxima plus a quarter before saturation."""
CALIBRATION_TOKENS = 4096
"""Tokens run for calibration: every token id once (a permutation of the vocabulary, so the
first layer's K/V, a function of the token alone, is seen for all of them) up to this many."""
CALIBRATION_LEN = 256
_QMAX = 127.0


def normalize(kv_cache: str | None) -> str | None:
    """None / "auto" / "none" (the compute dtype) or "int8"; ValueError on anything else."""
    if kv_cache is None:
        return None
    value = str(kv_cache).strip().lower()
    if value in ("", "auto", "none"):
        return None
    if value not in KV_CACHES:
        raise ValueError(f"unknown kv_cache {kv_cache!r}; choose int8 (default: the compute dtype)")
    return value


@dataclasses.dataclass
class KVCacheSummary:
    layers: int = 0
    kept: list[str] = dataclasses.field(default_factory=list)
    calibration: str = ""

    def describe(self) -> str:
        text = (
            f"int8 KV cache on {self.layers} layer(s), per-channel scales (kv_heads, 1, "
            f"head_size) calibrated on {self.calibration}, headroom {HEADROOM:g}"
        )
        if self.kept:
            text += f"; kept in the compute dtype: {'; '.join(self.kept)}"
        return text


def _gqa_caches(model: ir.Model):
    """(node, past_k, past_v, present_k, present_v) of each GQA whose cache can be retyped,
    and why the others cannot."""
    found, kept = [], []
    for node in model.graph:
        if node.op_type != "GroupQueryAttention" or node.domain != "com.microsoft":
            continue
        inputs = list(node.inputs)
        past = [inputs[i] if len(inputs) > i else None for i in (3, 4)]
        present = list(node.outputs[1:3])
        name = node.name or "GroupQueryAttention"
        if any(p is None or not p.is_graph_input() for p in past):
            kept.append(f"{name}: past is not a graph input")
            continue
        if any(not p.is_graph_output() for p in present):
            kept.append(f"{name}: present is not a graph output")
            continue
        readers_ok = all(
            (user is node and index in (3, 4)) or user.op_type == "Shape"
            for p in past
            for user, index in p.uses()
        )
        if not readers_ok:
            kept.append(f"{name}: the past is read by another op than this attention")
            continue
        if node.attributes.get_string("k_quant_type", "NONE") != "NONE":
            continue  # already quantized
        found.append((node, *past, *present))
    return found, kept


def _rotary_pairs(node: ir.Node, head_size: int) -> np.ndarray | None:
    """partner[c] = the channel rotated together with c (do_rotary=1), else None."""
    if not node.attributes.get_int("do_rotary", 0):
        return None
    cos = node.inputs[7] if len(node.inputs) > 7 else None
    if cos is None or cos.shape is None or not isinstance(cos.shape[-1], int):
        return None
    half = int(cos.shape[-1])
    partner = np.arange(head_size)
    if node.attributes.get_int("rotary_interleaved", 0):
        partner[: 2 * half] = np.arange(2 * half) ^ 1
    else:
        partner[:half] += half
        partner[half : 2 * half] -= half
    return partner


def _calibrate(model: ir.Model, names: list[str], max_seq_len: int) -> tuple[dict, str]:
    """max |x| over (batch, seq) of each named present output: (kv_heads, head_size)."""
    from epfuse.optimizer.verify.runner import _Runner

    # ORT runs from bytes: external weights are read into memory (in place) for this.
    runner = _Runner(model, ("CPUExecutionProvider",), None)
    io = runner.io
    length = max(1, min(CALIBRATION_LEN, max_seq_len))
    rng = np.random.default_rng(0)
    vocab = io.vocab_size or 32
    tokens = rng.permutation(vocab)[:CALIBRATION_TOKENS]
    if len(tokens) < length:
        tokens = np.resize(tokens, length)
    rows = len(tokens) // length
    present_names = [spec.present for spec in io.kv if spec.present]
    maxima: dict[str, np.ndarray] = {}
    for start in range(0, rows, 4):  # batches of up to 4 prompts
        batch = min(4, rows - start)
        ids = tokens[start * length : (start + batch) * length].reshape(batch, length)
        mask = np.ones((batch, length), np.int64)
        pos = np.tile(np.arange(length, dtype=np.int64), (batch, 1))
        _, presents = runner.run(ids.astype(np.int64), mask, pos, None)
        for name, value in zip(present_names, presents, strict=True):
            if name in names:
                m = np.abs(value.astype(np.float64)).max(axis=(0, 2))
                maxima[name] = np.maximum(maxima.get(name, m), m)
    how = f"{rows} prompt(s) of {length} distinct random tokens ({rows * length} of {vocab} ids)"
    return maxima, how


def quantize_kv_cache(model: ir.Model, max_seq_len: int) -> KVCacheSummary:
    """Retype each eligible GQA's past/present to int8 with calibrated per-channel scales."""
    caches, kept = _gqa_caches(model)
    summary = KVCacheSummary(kept=kept)
    if not caches:
        return summary
    names = [p.name for c in caches for p in c[3:5]]
    maxima, summary.calibration = _calibrate(model, names, max_seq_len)
    for node, past_k, past_v, present_k, present_v in caches:
        scales = []
        for present, is_key in ((present_k, True), (present_v, False)):
            m = maxima[present.name]
            if is_key and (partner := _rotary_pairs(node, m.shape[-1])) is not None:
                paired = partner != np.arange(m.shape[-1])
                m = np.where(paired, np.sqrt(m**2 + m[:, partner] ** 2), m)
            floor = max(float(m.max()), 1.0) * 1e-6
            scale = (np.maximum(m, floor) * HEADROOM / _QMAX).astype(np.float32)
            scale = scale.reshape(m.shape[0], 1, m.shape[1])
            tensor = ir.tensor(scale, name=f"epfuse_kv_scale/{present.name}")
            value = ir.Value(name=tensor.name, const_value=tensor)
            value.dtype, value.shape = ir.DataType.FLOAT, ir.Shape(scale.shape)
            model.graph.register_initializer(value)
            scales.append(value)
        if len(node.inputs) < 14:
            node.resize_inputs(14)
        node.replace_input_with(12, scales[0])
        node.replace_input_with(13, scales[1])
        node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", "PER_CHANNEL")
        node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", "PER_CHANNEL")
        node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
        for value in (past_k, past_v, present_k, present_v):
            value.dtype = ir.DataType.INT8
        summary.layers += 1
    return summary


def _quantized(node: ir.Node) -> bool:
    attr = node.attributes.get("k_quant_type")
    return attr is not None and attr.value != "NONE"


def has_int8_cache(model: ir.Model) -> bool:
    return any(n.op_type == "GroupQueryAttention" and _quantized(n) for n in model.graph)


def float_cache_boundary(model: ir.Model) -> ir.Model:
    """Copy of ``model`` whose int8 past inputs and present outputs are in the compute dtype:
    each past is quantized with the layer's own scales (round to nearest, saturate) before the
    attention reads it, each present dequantized. Verification feeds it the unfused reference's
    float past; the model itself is unchanged inside the boundary (``model`` is returned as
    is when it has no int8 cache; the copy shares its weights)."""
    if not has_int8_cache(model):
        return model
    model = model.clone()
    graph = model.graph
    inputs, outputs = set(graph.inputs), set(graph.outputs)
    qmin = _scalar_initializer(graph, "epfuse_kv_qmin", -128.0)
    qmax = _scalar_initializer(graph, "epfuse_kv_qmax", 127.0)
    f32, int8 = ir.DataType.FLOAT, ir.DataType.INT8
    front: list[ir.Node] = []
    back: list[tuple[ir.Value, ir.Value, ir.Value]] = []  # (int8 present, scale, float output)
    retyped: list[ir.Value] = []
    float_type = None
    for node in list(graph):
        if node.op_type != "GroupQueryAttention" or not _quantized(node):
            continue
        float_type = float_type or _compute_type(graph, node)
        for past_i, present_i, scale_i in ((3, 1, 12), (4, 2, 13)):
            past, present = node.inputs[past_i], node.outputs[present_i]
            scale = node.inputs[scale_i]
            if past in inputs and past.dtype == int8:
                name = past.name
                f = ir.node("Cast", [past], {"to": f32})
                d = ir.node("Div", [f.outputs[0], scale])
                r = ir.node("Round", [d.outputs[0]])
                c = ir.node("Clip", [r.outputs[0], qmin, qmax])
                q = ir.node("Cast", [c.outputs[0]], {"to": int8})
                for step, suffix in ((f, "f32"), (d, "q_d"), (r, "q_r"), (c, "q"), (q, "int8")):
                    step.outputs[0].name = f"{name}__epfuse_{suffix}"
                q.outputs[0].dtype, q.outputs[0].shape = int8, past.shape
                past.replace_all_uses_with(q.outputs[0])
                f.replace_input_with(0, past)  # the quantizing Cast reads the float input
                front += [f, d, r, c, q]
                retyped.append(past)
            if present in outputs and present.dtype == int8:
                back.append((present, scale, ir.Value(shape=present.shape)))
    if not front and not back:
        return model
    float_type = float_type or f32
    for past in retyped:
        # A new type object: onnx-ir's clone shares the values' type objects with the
        # original, so ``past.dtype = ...`` (which edits the type in place) would retype the
        # model this copy was made from.
        past.type = ir.TensorType(float_type)
    first = next(iter(graph), None)
    if first is not None and front:
        graph.insert_before(first, front)
    for present, scale, out in back:
        name = present.name
        cast = ir.node("Cast", [present], {"to": f32})
        cast.outputs[0].name = f"{name}__epfuse_f"
        mul = ir.node("Mul", [cast.outputs[0], scale])
        mul.outputs[0].name = f"{name}__epfuse_m"
        to_float = ir.node("Cast", [mul.outputs[0]], {"to": float_type}, outputs=[out])
        graph.extend([cast, mul, to_float])
        present.name = f"{name}__epfuse_int8"
        out.name, out.dtype = name, float_type
        graph.outputs[graph.outputs.index(present)] = out
    return model


def _scalar_initializer(graph: ir.Graph, name: str, value: float) -> ir.Value:
    tensor = ir.tensor(np.array(value, np.float32), name=name)
    init = ir.Value(name=name, const_value=tensor, type=ir.TensorType(ir.DataType.FLOAT))
    init.shape = ir.Shape([])
    graph.register_initializer(init)
    return init


def _compute_type(graph: ir.Graph, node: ir.Node) -> ir.DataType | None:
    """The attention's float type: its cos cache's, else that of a float weight matrix."""
    if len(node.inputs) > 7 and node.inputs[7] is not None and node.inputs[7].is_initializer():
        return node.inputs[7].dtype
    floats = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    for value in graph.initializers.values():
        if (
            value.dtype in floats
            and value.shape is not None
            and len(value.shape) == 2
            and not (value.name or "").startswith("epfuse_kv")
        ):
            return value.dtype
    return None


__all__ = [
    "HEADROOM",
    "KV_CACHES",
    "KVCacheSummary",
    "float_cache_boundary",
    "has_int8_cache",
    "normalize",
    "quantize_kv_cache",
]
