"""Which graph input and output plays which decoder role (tokens, mask, positions, past K/V,
presents, logits), so that two graphs from different builders can be fed the same inputs."""

from __future__ import annotations

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


def discover_io(model: onnx.ModelProto) -> ModelIO:
    """Find the decoder roles of ``model``'s inputs and outputs (see module docstring)."""
    graph = model.graph
    init_names = {t.name for t in graph.initializer}
    inputs = [vi for vi in graph.input if vi.name not in init_names]

    def find_input(key: str) -> onnx.ValueInfoProto | None:
        exact = [vi for vi in inputs if vi.name == key]
        if exact:
            return exact[0]
        loose = [vi for vi in inputs if key in vi.name.lower()]
        return loose[0] if loose else None

    ids = find_input("input_ids")
    if ids is None:
        raise ValueError(f"no input_ids input among {[vi.name for vi in inputs]}")
    mask = find_input("attention_mask")
    pos = find_input("position_ids")

    pasts = [vi for vi in inputs if "past" in vi.name.lower() and _rank(vi) == 4]
    presents = [vi for vi in graph.output if "present" in vi.name.lower() and _rank(vi) == 4]
    known = {vi.name for vi in (ids, mask, pos) if vi is not None} | {vi.name for vi in pasts}
    unknown = [vi.name for vi in inputs if vi.name not in known]
    if unknown:
        raise ValueError(f"cannot feed unrecognised model inputs {unknown}")

    rest = [vi for vi in graph.output if vi not in presents]
    logits_candidates = [vi for vi in rest if vi.name == "logits"] or [
        vi for vi in rest if "logits" in vi.name.lower()
    ]
    if not logits_candidates:
        if len(rest) != 1:
            raise ValueError(f"cannot tell the logits among outputs {[vi.name for vi in rest]}")
        logits_candidates = rest
    logits = logits_candidates[0]

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

    logit_dims = _dims(logits)
    vocab = logit_dims[-1] if logit_dims and isinstance(logit_dims[-1], int) else None

    def np_type(vi: onnx.ValueInfoProto | None) -> Any:
        if vi is None:
            return None
        t = _INT_TYPES.get(_elem_type(vi))
        if t is None:
            raise ValueError(f"{vi.name} has unsupported element type {_elem_type(vi)}")
        return t

    return ModelIO(
        input_ids=ids.name,
        input_ids_dtype=np_type(ids),
        attention_mask=mask.name if mask is not None else None,
        attention_mask_dtype=np_type(mask),
        position_ids=pos.name if pos is not None else None,
        position_ids_dtype=np_type(pos),
        kv=tuple(kv),
        logits=logits.name,
        dtype=dtype,
        vocab_size=vocab,
        position_streams=pos is not None and _is_streams(pos),
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
