"""Which graph input and output plays which decoder role (tokens, mask, positions, past K/V,
presents, logits), so that two graphs from different builders can be fed the same inputs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.DOUBLE: "float64",
}
_INT_TYPES = {
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
}


@dataclass(frozen=True)
class KVSpec:
    """One past input and its present output."""

    past: str
    present: str
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ModelIO:
    """The roles of a decoder's graph inputs and outputs."""

    input_ids: str
    input_ids_dtype: Any
    attention_mask: str | None
    attention_mask_dtype: Any
    position_ids: str | None
    position_ids_dtype: Any
    kv: tuple[KVSpec, ...]
    logits: str
    dtype: str  # compute dtype: of the KV inputs, else of the logits
    vocab_size: int | None
    position_streams: bool = False
    """The position input is (3, batch, seq): mRoPE temporal/height/width streams."""
    token_kind: str = "ids"
    """"ids": ``input_ids`` holds token ids; "embeds": it is (batch, seq, hidden) embeddings."""
    hidden_size: int | None = None

    def describe(self) -> str:
        """What each role was matched to, for the verify output."""
        tokens = "inputs_embeds" if self.token_kind == "embeds" else "tokens"
        parts = [f"{tokens}={self.input_ids}"]
        parts.append(f"mask={self.attention_mask or '-'}")
        streams = " (3, batch, seq)" if self.position_streams else ""
        parts.append(f"positions={self.position_ids or '-'}{streams}")
        if self.kv:
            parts.append(
                f"{len(self.kv)} past/present ({self.kv[0].past} -> {self.kv[0].present}, ...)"
            )
        parts.append(f"logits={self.logits}")
        return ", ".join(parts)

    @property
    def has_cache(self) -> bool:
        return bool(self.kv)


def _elem_type(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    out: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            out.append(d.dim_value)
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _rank(vi: onnx.ValueInfoProto) -> int | None:
    dims = _dims(vi)
    return None if dims is None else len(dims)


_PASS = ("Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Expand")
_INT_ELEMS = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)


class _Graph:
    """Consumers and constants of a graph, for finding roles by what consumes an input."""

    def __init__(self, graph: onnx.GraphProto):
        self.consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                if name:
                    self.consumers.setdefault(name, []).append((node, i))
        self.shapes = {t.name: tuple(t.dims) for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant":
                for a in node.attribute:
                    if a.name == "value":
                        self.shapes[node.output[0]] = tuple(a.t.dims)

    def reached(self, name: str, depth: int = 6) -> list[tuple[onnx.NodeProto, int]]:
        """(consumer, input index) of ``name`` and of pass-through ops (Cast, Reshape...)
        applied to it, up to ``depth`` such ops deep."""
        out: list[tuple[onnx.NodeProto, int]] = []
        frontier, seen = [name], {name}
        for _ in range(depth):
            nxt = []
            for value in frontier:
                for node, i in self.consumers.get(value, []):
                    out.append((node, i))
                    if node.op_type in _PASS and i == 0:
                        for o in node.output:
                            if o not in seen:
                                seen.add(o)
                                nxt.append(o)
            frontier = nxt
        return out

    def gathered_rows(self, name: str) -> list[int]:
        """Rows of the constant 2-D tables that ``name`` indexes (an embedding lookup)."""
        rows = []
        for node, i in self.reached(name):
            if node.op_type.startswith("Gather") and i == 1:
                dims = self.shapes.get(node.input[0])
                if dims is not None and len(dims) == 2:
                    rows.append(int(dims[0]))
        return rows

    def looks_like_mask(self, name: str) -> bool | None:
        """True: reduced to lengths or made boolean (a mask); False: used as a position
        (rotary input, a gather into a table, Cos/Sin); None: no telling."""
        for node, i in self.reached(name):
            if node.op_type in ("ReduceSum", "Not", "Equal") or (
                node.op_type == "Cast" and any(a.name == "to" and a.i == 9 for a in node.attribute)
            ):
                return True
            if (
                (node.op_type == "RotaryEmbedding" and i in (1, 3))
                or (node.op_type == "GroupQueryAttention" and i == 9)
                or node.op_type in ("Cos", "Sin")
                or (node.op_type.startswith("Gather") and i == 1)
            ):
                return False
        return None


def _kv_order(names: list[str]) -> list[int]:
    """Indices of ``names`` sorted by (layer number, key before value) when every name says
    both, else graph order (builders differ in how they interleave keys and values)."""
    keys = []
    for name in names:
        numbers = re.findall(r"\d+", name)
        words = set(re.split(r"[^a-z]+", name.lower()))
        kind = (
            0 if "key" in words or "k" in words else 1 if "value" in words or "v" in words else None
        )
        if not numbers or kind is None:
            return list(range(len(names)))
        keys.append((int(numbers[-1]), kind))
    if len(set(keys)) != len(keys):
        return list(range(len(names)))
    return sorted(range(len(names)), key=lambda i: keys[i])


def discover_io(model: onnx.ModelProto) -> ModelIO:
    """Find the decoder roles of ``model``'s inputs and outputs by shape, type and consumer.

    - tokens: the rank-2 integer input that indexes a constant table with as many rows as
      the logits have columns (the embedding); else the one named like ``input_ids``; a
      model without one takes ``inputs_embeds``: a rank-3 float input (batch, seq, hidden);
    - mask vs positions (the other rank-2 integer inputs): positions share the tokens'
      sequence dim or feed RoPE (RotaryEmbedding, GQA's position input, Cos/Sin, a table
      gather); the mask is reduced to lengths or cast to bool; where consumers do not tell,
      the name (``mask``/``pos``), then the dims (the mask spans past + new tokens); a
      (3, batch, seq) integer input is mRoPE positions;
    - past K/V: rank-4 float inputs, presents: rank-4 float outputs, paired in (layer,
      key/value) order when the names say it, else in graph order;
    - logits: the remaining output (the rank-3 one, or the one named ``logits``).
    """
    graph = model.graph
    init_names = {t.name for t in graph.initializer}
    inputs = [vi for vi in graph.input if vi.name not in init_names]
    g = _Graph(graph)

    def is_float(vi: onnx.ValueInfoProto) -> bool:
        return _elem_type(vi) in _FLOAT_TYPES

    def is_int(vi: onnx.ValueInfoProto) -> bool:
        return _elem_type(vi) in (*_INT_ELEMS, onnx.TensorProto.BOOL)

    pasts = [vi for vi in inputs if is_float(vi) and _rank(vi) == 4]
    presents = [vi for vi in graph.output if is_float(vi) and _rank(vi) == 4]
    rest = [vi for vi in graph.output if vi not in presents]
    logits_candidates = (
        [vi for vi in rest if vi.name == "logits"]
        or [vi for vi in rest if "logits" in vi.name.lower()]
        or [vi for vi in rest if _rank(vi) == 3 and is_float(vi)]
        or (rest if len(rest) == 1 else [])
    )
    if len(logits_candidates) != 1:
        raise ValueError(f"cannot tell the logits among outputs {[vi.name for vi in rest]}")
    logits = logits_candidates[0]
    logit_dims = _dims(logits)
    vocab = logit_dims[-1] if logit_dims and isinstance(logit_dims[-1], int) else None

    ints2 = [vi for vi in inputs if is_int(vi) and _rank(vi) == 2]
    streams = [vi for vi in inputs if is_int(vi) and _is_streams(vi)]
    embeds = [vi for vi in inputs if is_float(vi) and _rank(vi) == 3]
    ids = None
    if vocab is not None:
        by_table = [vi for vi in ints2 if vocab in g.gathered_rows(vi.name)]
        if len(by_table) == 1:
            ids = by_table[0]
    if ids is None:
        named = [vi for vi in ints2 if vi.name == "input_ids"] or [
            vi for vi in ints2 if "input_ids" in vi.name.lower() or "token" in vi.name.lower()
        ]
        ids = named[0] if named else None
    if ids is None:
        tabled = [vi for vi in ints2 if g.gathered_rows(vi.name)]
        if len(tabled) == 1 and len(ints2) == 1:
            ids = tabled[0]
    token_kind = "ids"
    hidden = None
    if ids is None:
        if len(embeds) != 1:
            raise ValueError(
                "no token input (a (batch, seq) integer input indexing the embedding, or a "
                f"(batch, seq, hidden) inputs_embeds) among {[vi.name for vi in inputs]}"
            )
        ids, token_kind = embeds[0], "embeds"
        dims = _dims(ids)
        hidden = dims[-1] if dims and isinstance(dims[-1], int) else None
        if hidden is None:
            raise ValueError(f"{ids.name}: the hidden size (last dim) must be static")

    seq_dim = (_dims(ids) or [None, None])[1]
    mask = pos = None
    for vi in [vi for vi in ints2 if vi is not ids]:
        dim = (_dims(vi) or [None, None])[1]
        verdict = g.looks_like_mask(vi.name)
        if verdict is None:
            lowered = vi.name.lower()
            verdict = True if "mask" in lowered else False if "pos" in lowered else None
        if verdict is None and isinstance(seq_dim, str) and isinstance(dim, str):
            verdict = dim != seq_dim  # the mask spans past + new tokens
        if verdict is True and mask is None:
            mask = vi
        elif verdict is False and pos is None:
            pos = vi
    if pos is None and len(streams) == 1:
        pos = streams[0]

    known = {vi.name for vi in (ids, mask, pos) if vi is not None} | {vi.name for vi in pasts}
    unknown = [vi.name for vi in inputs if vi.name not in known]
    if unknown:
        raise ValueError(f"cannot feed unrecognised model inputs {unknown}")

    pasts = [pasts[i] for i in _kv_order([vi.name for vi in pasts])]
    presents = [presents[i] for i in _kv_order([vi.name for vi in presents])]
    kv: list[KVSpec] = []
    if pasts and presents:
        if len(pasts) != len(presents):
            raise ValueError(
                f"{len(pasts)} past inputs but {len(presents)} present outputs: "
                f"{[vi.name for vi in pasts]} vs {[vi.name for vi in presents]}"
            )
        for past_vi, present_vi in zip(pasts, presents, strict=True):
            heads, head_dim = _kv_dims(past_vi, present_vi)
            kv.append(KVSpec(past_vi.name, present_vi.name, heads, head_dim))
    elif pasts:
        # Past inputs but no presents: the prompt scenarios still run, with an empty past.
        for past_vi in pasts:
            heads, head_dim = _kv_dims(past_vi, None)
            kv.append(KVSpec(past_vi.name, "", heads, head_dim))

    dtype_vi = pasts[0] if pasts else logits
    dtype = _FLOAT_TYPES.get(_elem_type(dtype_vi))
    if dtype is None:
        raise ValueError(f"{dtype_vi.name} has unsupported element type {_elem_type(dtype_vi)}")

    def np_type(vi: onnx.ValueInfoProto | None) -> Any:
        if vi is None:
            return None
        t = _INT_TYPES.get(_elem_type(vi))
        if t is None:
            raise ValueError(f"{vi.name} has unsupported element type {_elem_type(vi)}")
        return t

    return ModelIO(
        input_ids=ids.name,
        input_ids_dtype=np_type(ids) if token_kind == "ids" else None,
        attention_mask=mask.name if mask is not None else None,
        attention_mask_dtype=np_type(mask),
        position_ids=pos.name if pos is not None else None,
        position_ids_dtype=np_type(pos),
        kv=tuple(kv),
        logits=logits.name,
        dtype=dtype,
        vocab_size=vocab,
        position_streams=pos is not None and _is_streams(pos),
        token_kind=token_kind,
        hidden_size=hidden,
    )


def _is_streams(vi: onnx.ValueInfoProto) -> bool:
    dims = _dims(vi)
    return dims is not None and len(dims) == 3 and dims[0] == 3


def _kv_dims(
    past_vi: onnx.ValueInfoProto, present_vi: onnx.ValueInfoProto | None
) -> tuple[int, int]:
    for vi in (past_vi, present_vi):
        if vi is None:
            continue
        dims = _dims(vi)
        if dims and isinstance(dims[1], int) and isinstance(dims[3], int):
            return dims[1], dims[3]
    raise ValueError(f"{past_vi.name}: KV heads and head dim must be static, got {_dims(past_vi)}")
