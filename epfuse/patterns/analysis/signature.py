"""The roles of a decoder's graph inputs and outputs, found from the graph, not from names.

verify feeds two graphs from different builders the same inputs, genai writes the past/present
names into its config, the rules size dummy inputs to probe a subgraph, and the optimizer reads
the compute dtype: all of them need to know which input is the token ids, the mask, the
positions, which past pairs with which present and which is a layer's key or value. This is the
one place that works it out (on onnx_ir), so the four readers cannot disagree:

* a role is decided by shape, dtype and consumers; a name only breaks a tie the graph leaves
  open (two rank-2 integer inputs that no consumer tells apart, key vs value when no attention
  op or transpose says it, the layer order when no consumer orders the caches);
* :func:`input_role` classifies one value from its own shape and consumers (what the probes
  need to size it); :meth:`DecoderSignature.of` resolves the whole graph with it, adding what
  only the whole graph tells (the vocabulary from the logits, the tokens' sequence dim);
* a hybrid stack's conv/recurrent layers (LFM2, Granite-MoE-hybrid, Qwen3-Next) carry a
  fixed-size state from step to step: an input whose dims after the batch are all static, with
  an output of the same dims and dtype, not read as an attention op's past. That is the
  recognised extra state (``states``, a :class:`StateTensor` per input/output pair), never a
  KV past: a past grows along its length axis (a static shared buffer is read by attention);
* nothing here raises on an unusual graph: what is not recognised is listed as extra
  inputs/outputs (``extra_inputs``/``extra_outputs``), and the caller decides whether it can
  live with that.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)
_INTS = (ir.DataType.INT64, ir.DataType.INT32)
_QUANTIZED = (ir.DataType.INT8, ir.DataType.UINT8)  # an int8 KV cache
# Ops a role passes through unchanged in meaning (data input 0).
_PASS = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Expand")
_DEPTH = 6
# Where attention ops read the past and write the present: op -> {input: (kind, output)}.
_CACHE_SLOTS = {
    ("", "Attention"): {4: ("key", 1), 5: ("value", 2)},
    ("com.microsoft", "GroupQueryAttention"): {3: ("key", 1), 4: ("value", 2)},
    ("com.microsoft", "MultiHeadAttention"): {6: ("key", 1), 7: ("value", 2)},
}


def _dims(value: ir.Value | None) -> list[int | str | None] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else (d.value if d.value else None) for d in value.shape]


def _rank(value: ir.Value) -> int | None:
    return None if value.shape is None else len(value.shape)


def _static(dims: list | None, axis: int) -> int | None:
    if dims is None or axis >= len(dims) or not isinstance(dims[axis], int):
        return None
    return dims[axis]


def _reached(value: ir.Value, passes: tuple[str, ...] = _PASS) -> Iterator[tuple[ir.Node, int]]:
    """(consumer, input index) of ``value`` and of pass-through ops applied to it."""
    frontier, seen = [value], {id(value)}
    for _ in range(_DEPTH):
        nxt = []
        for v in frontier:
            for use in v.uses():
                node, index = use.node, use.idx
                yield node, index
                if node.op_type in passes and node.domain == "" and index == 0:
                    for out in node.outputs:
                        if id(out) not in seen:
                            seen.add(id(out))
                            nxt.append(out)
        frontier = nxt


def _const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if value.const_value is not None:
        return tuple(value.const_value.shape)
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return tuple(node.attributes["value"].value.shape)
    return None


def gathered_rows(value: ir.Value) -> list[int]:
    """Rows of the constant 2-D tables that ``value`` indexes (an embedding or cache lookup)."""
    rows = []
    for node, index in _reached(value):
        if node.op_type.startswith("Gather") and index == 1:
            shape = _const_shape(node.inputs[0])
            if shape is not None and len(shape) == 2:
                rows.append(int(shape[0]))
    return rows


def mask_or_position(value: ir.Value) -> bool | None:
    """True: reduced to lengths or made boolean (a mask); False: used as a position (a rotary
    input, GQA's position input, Cos/Sin, a table gather); None: its consumers do not tell."""
    for node, index in _reached(value):
        op = node.op_type
        if op in ("ReduceSum", "Not", "Equal") or (
            op == "Cast" and node.attributes.get_int("to") == ir.DataType.BOOL
        ):
            return True
        if (
            (op == "RotaryEmbedding" and index in (1, 3))
            or (op == "GroupQueryAttention" and index == 9)
            or op in ("Cos", "Sin")
            or (op.startswith("Gather") and index == 1)
        ):
            return False
    return None


def input_role(value: ir.Value) -> str | None:
    """The role one value's own shape, dtype and consumers give it, None when they do not:
    ``past`` (rank-4 float, or int8 for a quantized cache), ``positions3d`` ((3, batch, seq) integer), ``embeds`` (rank-3
    float), ``mask`` or ``ids`` (rank-2 integer: token ids or 2-D positions, both (batch,
    seq)). :meth:`DecoderSignature.of` decides between tokens and positions."""
    dims, dtype = _dims(value), value.dtype
    if dims is None or dtype is None:
        return None
    if dtype in (*FLOATS, *_QUANTIZED) and len(dims) == 4:
        return "past"
    if dtype in FLOATS and len(dims) == 3:
        return "embeds"
    if dtype in _INTS and len(dims) == 3 and dims[0] == 3:
        return "positions3d"
    if dtype in (*_INTS, ir.DataType.BOOL) and len(dims) == 2:
        return "mask" if mask_or_position(value) else "ids"
    return None


@dataclasses.dataclass(frozen=True)
class CacheTensor:
    """One past input (batch, heads, length, head size) and the present output it becomes."""

    past: ir.Value
    present: ir.Value | None
    kind: str | None
    """"key" or "value"; None when neither the graph nor the name tells."""
    layer: int
    heads_axis: int = 1
    length_axis: int = 2
    head_size_axis: int = 3

    def _size(self, axis: int) -> int | None:
        for v in (self.past, self.present):
            size = _static(_dims(v), axis) if v is not None else None
            if size is not None:
                return size
        return None

    @property
    def num_heads(self) -> int | None:
        return self._size(self.heads_axis)

    @property
    def head_size(self) -> int | None:
        return self._size(self.head_size_axis)


@dataclasses.dataclass(frozen=True)
class StateTensor:
    """A fixed-size state input (conv window, recurrent/SSM state) and the output that carries
    it to the next step: same dims (static after the batch) and dtype."""

    past: ir.Value
    present: ir.Value
    shape: tuple[int, ...]
    """The dims after the batch."""


@dataclasses.dataclass(frozen=True)
class DecoderSignature:
    """What each graph input and output of a decoder is (see the module docstring)."""

    tokens: ir.Value | None
    token_kind: str
    """"ids": token ids (batch, seq); "embeds": ``inputs_embeds`` (batch, seq, hidden)."""
    attention_mask: ir.Value | None
    position_ids: ir.Value | None
    position_streams: bool
    """The positions are (3, batch, seq): mRoPE temporal/height/width streams."""
    cache: tuple[CacheTensor, ...]
    """Past inputs in (layer, key before value) order."""
    logits: ir.Value | None
    states: tuple[StateTensor, ...]
    """Fixed-size extra state (conv/recurrent layers of a hybrid stack), in input order."""
    extra_inputs: tuple[ir.Value, ...]
    extra_outputs: tuple[ir.Value, ...]
    dtype: ir.DataType | None
    """The compute dtype: of the past inputs, else of the logits, else the first float output."""
    vocab_size: int | None
    hidden_size: int | None

    @property
    def layers(self) -> list[tuple[CacheTensor, CacheTensor]]:
        """(key, value) per layer, when every cache tensor's kind is known."""
        keys = [c for c in self.cache if c.kind == "key"]
        values = [c for c in self.cache if c.kind == "value"]
        if len(keys) != len(values) or len(keys) + len(values) != len(self.cache):
            return []
        return list(zip(keys, values, strict=True))

    @classmethod
    def of(cls, model: ir.Model | ir.Graph) -> DecoderSignature:
        graph = model.graph if isinstance(model, ir.Model) else model
        return _signature(graph)


def _logits(rest: list[ir.Value]) -> ir.Value | None:
    floats3 = [v for v in rest if _rank(v) == 3 and v.dtype in FLOATS]
    for candidates in (floats3, rest):
        if len(candidates) == 1:
            return candidates[0]
        # Several: the name breaks the tie.
        named = [v for v in candidates if v.name == "logits"] or [
            v for v in candidates if "logits" in (v.name or "").lower()
        ]
        if len(named) == 1:
            return named[0]
    return None


def _fixed(value: ir.Value) -> tuple[int, ...] | None:
    """The dims after the batch when they are all static (a fixed-size state), else None."""
    dims = _dims(value)
    if dims is None or len(dims) < 2 or value.dtype not in FLOATS:
        return None
    rest = dims[1:]
    return tuple(rest) if all(isinstance(d, int) for d in rest) else None  # type: ignore[arg-type]


def _read_as_cache(value: ir.Value) -> bool:
    """An attention op reads ``value`` as its past (a static-shape KV buffer, e.g. genai's
    shared one at a fixed length): a KV cache, whatever its shape says."""
    return any(
        index in _CACHE_SLOTS.get((node.domain, node.op_type), {})
        for node, index in _reached(value)
    )


def _states(inputs: list[ir.Value], outputs: list[ir.Value]) -> list[StateTensor]:
    """Pair each fixed-size float input with an output of the same dims and dtype. Several of
    one shape (a conv window per layer) pair in name order (the layer number, the graph leaves
    it open: every later state depends on every earlier one), then input/output order."""
    groups: dict[tuple, tuple[list[ir.Value], list[ir.Value]]] = {}
    for v in inputs:
        shape = _fixed(v)
        if shape is not None and not _read_as_cache(v):
            groups.setdefault((shape, v.dtype), ([], []))[0].append(v)
    for v in outputs:
        shape = _fixed(v)
        if shape is not None and (shape, v.dtype) in groups:
            groups[(shape, v.dtype)][1].append(v)
    out = []
    for (shape, _), (pasts, presents) in groups.items():
        if len(pasts) != len(presents):
            continue  # not a carried state (e.g. a static-shape decoder's past); left as is

        def order(values: list[ir.Value]) -> list[ir.Value]:
            named = [_named(v.name or "")[0] for v in values]
            if None in named or len(set(named)) != len(named):
                return values
            return [v for _, v in sorted(zip(named, values, strict=True), key=lambda p: p[0])]

        for past, present in zip(order(pasts), order(presents), strict=True):
            out.append(StateTensor(past, present, shape))
    position = {id(v): i for i, v in enumerate(inputs)}
    return sorted(out, key=lambda st: position[id(st.past)])


def _signature(graph: ir.Graph) -> DecoderSignature:
    inputs = [v for v in graph.inputs if not v.is_initializer()]
    states = _states(inputs, list(graph.outputs))
    stateful = {id(v) for st in states for v in (st.past, st.present)}
    inputs = [v for v in inputs if id(v) not in stateful]
    roles = {id(v): input_role(v) for v in inputs}
    pasts = [v for v in inputs if roles[id(v)] == "past"]
    presents = [
        v
        for v in graph.outputs
        if v.dtype in (*FLOATS, *_QUANTIZED) and _rank(v) == 4 and id(v) not in stateful
    ]
    rest = [v for v in graph.outputs if v not in presents]
    logits = _logits(rest)
    vocab = _static(_dims(logits), 2) if logits is not None else None

    ints2 = [v for v in inputs if roles[id(v)] in ("ids", "mask")]
    tokens = None
    if vocab is not None:
        by_table = [v for v in ints2 if vocab in gathered_rows(v)]
        if len(by_table) == 1:
            tokens = by_table[0]
    if tokens is None:
        tabled = [v for v in ints2 if roles[id(v)] == "ids" and gathered_rows(v)]
        for candidates in (tabled, ints2):
            named = [v for v in candidates if v.name == "input_ids"] or [
                v for v in candidates if re.search("input_ids|token", (v.name or "").lower())
            ]
            if len(named) == 1:
                tokens = named[0]
                break
        if tokens is None and len(tabled) == 1 and len(ints2) == 1:
            tokens = tabled[0]
    token_kind, hidden = "ids", None
    if tokens is None:
        embeds = [v for v in inputs if roles[id(v)] == "embeds"]
        if len(embeds) == 1:
            tokens, token_kind = embeds[0], "embeds"
            hidden = _static(_dims(tokens), 2)

    seq_dim = (_dims(tokens) or [None, None])[1] if tokens is not None else None
    mask = positions = None
    for v in ints2:
        if v is tokens:
            continue
        verdict = mask_or_position(v)
        if verdict is None:
            lowered = (v.name or "").lower()
            verdict = True if "mask" in lowered else False if "pos" in lowered else None
        dim = (_dims(v) or [None, None])[1]
        if verdict is None and isinstance(seq_dim, str) and isinstance(dim, str):
            verdict = dim != seq_dim  # the mask spans past + new tokens
        if verdict is True and mask is None:
            mask = v
        elif verdict is False and positions is None:
            positions = v
    streams = [v for v in inputs if roles[id(v)] == "positions3d"]
    if positions is None and len(streams) == 1:
        positions = streams[0]

    cache = _cache(graph, pasts, presents)
    known = {id(v) for v in (tokens, mask, positions) if v is not None} | {id(v) for v in pasts}
    paired = {id(c.present) for c in cache if c.present is not None}
    extra_outputs = [
        v
        for v in graph.outputs
        if v is not logits and id(v) not in paired and id(v) not in stateful
    ]

    dtype = None
    for v in [*pasts, *([logits] if logits is not None else []), *graph.outputs]:
        if v.dtype is not None and v.dtype.is_floating_point():
            dtype = v.dtype
            break
    return DecoderSignature(
        tokens=tokens,
        token_kind=token_kind,
        attention_mask=mask,
        position_ids=positions,
        position_streams=positions is not None and roles[id(positions)] == "positions3d",
        cache=cache,
        logits=logits,
        states=tuple(states),
        extra_inputs=tuple(v for v in inputs if id(v) not in known),
        extra_outputs=tuple(extra_outputs),
        dtype=dtype,
        vocab_size=vocab,
        hidden_size=hidden,
    )


@dataclasses.dataclass
class _Trace:
    kind: str | None = None
    present: ir.Value | None = None
    anchor: int | None = None  # position of the attention (or first) node that reads it


def _trace(past: ir.Value, outputs: set[int], order: dict[int, int]) -> _Trace:
    """What the graph says about one past input: its kind, its present, where it is read."""
    found = _Trace()
    # The past reaches the present through the concat of the new K/V (torch exports) or an
    # attention op that takes it as its past (Attention, GroupQueryAttention).
    passes = (*_PASS, "Concat")
    for node, index in _reached(past, passes):
        slots = _CACHE_SLOTS.get((node.domain, node.op_type), {})
        if index in slots:
            kind, out = slots[index]
            found.kind = found.kind or kind
            if found.anchor is None:
                found.anchor = order.get(id(node))
            if out < len(node.outputs) and id(node.outputs[out]) in outputs:
                found.present = found.present or node.outputs[out]
        if node.op_type == "Concat":
            if found.anchor is None:
                found.anchor = order.get(id(node))
            if id(node.outputs[0]) in outputs:
                found.present = found.present or node.outputs[0]
        if found.kind is None and node.op_type == "Attention" and index in (1, 2):
            found.kind = "key" if index == 1 else "value"
        if found.kind is None and node.op_type == "Transpose":
            perm = node.attributes.get_ints("perm")
            if perm is not None and list(perm[-2:]) == [len(perm) - 1, len(perm) - 2]:
                found.kind = "key"  # K^T of the scores
    return found


_KIND_WORDS = {"key": "key", "k": "key", "value": "value", "v": "value"}


def _named(name: str) -> tuple[int | None, str | None]:
    """(layer, kind) a name says, for tie-breaking: past_key_values.3.key, past_value_3..."""
    numbers = re.findall(r"\d+", name)
    # The last such word: past_key_values.0.value is a value.
    words = [w for w in re.split(r"[^a-z]+", name.lower()) if w in _KIND_WORDS]
    kind = _KIND_WORDS[words[-1]] if words else None
    return (int(numbers[-1]) if numbers else None), kind


def _cache(
    graph: ir.Graph, pasts: list[ir.Value], presents: list[ir.Value]
) -> tuple[CacheTensor, ...]:
    if not pasts:
        return ()
    order = {id(node): i for i, node in enumerate(graph)}
    outputs = {id(v) for v in presents}
    traces = [_trace(v, outputs, order) for v in pasts]
    names = [_named(v.name or "") for v in pasts]
    kinds = [t.kind or n[1] for t, n in zip(traces, names, strict=True)]
    if None in kinds and kinds.count("key") * 2 == len(kinds):
        kinds = [k or "value" for k in kinds]  # the keys are known (transposed): the rest
    if None in kinds:
        # Neither the graph nor the names tell: builders list key then value per layer.
        kinds = ["key" if i % 2 == 0 else "value" for i in range(len(pasts))]

    # Layer order: where each is read in the graph; then the name's layer; then input order.
    anchors = [t.anchor for t in traces]
    layers = [n[0] for n in names]
    if None not in anchors:
        key = lambda i: (anchors[i], i)  # noqa: E731
    elif None not in layers and len(set(names)) == len(names):
        key = lambda i: (layers[i], i)  # noqa: E731
    else:
        key = lambda i: i  # noqa: E731
    per_kind = {
        k: sorted((i for i in range(len(pasts)) if kinds[i] == k), key=key)
        for k in ("key", "value")
    }

    # Presents the graph does not pair go to the unpaired pasts in the same order.
    taken = {id(t.present) for t in traces if t.present is not None}
    spare = [v for v in presents if id(v) not in taken]
    spare_names = [_named(v.name or "") for v in spare]
    if all(n[0] is not None and n[1] is not None for n in spare_names) and len(
        set(spare_names)
    ) == len(spare_names):
        spare = [v for _, v in sorted(zip(spare_names, spare, strict=True), key=lambda p: p[0])]
    entries: list[tuple[int, int, int]] = []  # (layer, key first, past index)
    for kind, indices in per_kind.items():
        for layer, i in enumerate(indices):
            entries.append((layer, 0 if kind == "key" else 1, i))
    entries.sort()
    out = []
    for layer, _, i in entries:
        present = traces[i].present
        if present is None and spare:
            present = spare.pop(0)
        dims = _dims(pasts[i])
        # (batch, length, heads, head size) when only axes 2 and 3 are static.
        bsnh = _static(dims, 1) is None and _static(dims, 2) is not None
        axes = (2, 1, 3) if bsnh else (1, 2, 3)
        out.append(CacheTensor(pasts[i], present, kinds[i], layer, *axes))
    return tuple(out)


def probe_array(
    value: ir.Value, role_mask: ir.Value | None, batch: int, seq: int, past: int
) -> np.ndarray | None:
    """A zero array shaped like ``value``'s role for the given sizes (``role_mask`` is filled by
    the caller), or None if its role is unclear or a size it needs is not static."""
    if value is role_mask or value.dtype is None:
        return None
    role, dims = input_role(value), _dims(value)
    np_dtype = value.dtype.numpy() if value.dtype != ir.DataType.BFLOAT16 else np.float32
    fixed = _fixed(value)
    if fixed is not None:
        # A fixed-size state (a hybrid stack's conv/recurrent state): only the batch varies.
        return np.zeros((batch, *fixed), dtype=np_dtype)
    if role == "past":
        heads, head_size = _static(dims, 1), _static(dims, 3)
        if heads is None or head_size is None:
            return None
        return np.zeros((batch, heads, past, head_size), dtype=np_dtype)
    if role == "mask":
        return np.zeros((batch, past + seq), dtype=np_dtype)
    if role == "ids" and value.dtype in _INTS:
        return np.zeros((batch, seq), dtype=np_dtype)
    if role == "positions3d":
        return np.zeros((3, batch, seq), dtype=np_dtype)
    if role == "embeds":
        hidden = _static(dims, 2)
        return None if hidden is None else np.zeros((batch, seq, hidden), dtype=np_dtype)
    return None
