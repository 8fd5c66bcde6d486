"""Which graph input and output plays which decoder role (tokens, mask, positions, past K/V,
presents, logits), so that two graphs from different builders can be fed the same inputs.

The roles are :class:`~epfuse.patterns.analysis.signature.DecoderSignature`'s (the one
implementation, on onnx_ir: verify's runner hands it the model it converted once; a
``ModelProto`` given directly is converted here), and this module refuses what verify cannot
feed (unrecognised inputs, dynamic KV sizes, unequal past/present counts). A hybrid stack's
fixed-size conv/recurrent states are fed like a past: zeros for a first prompt (exactly a
fresh state), the model's own outputs to continue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from epfuse.patterns.analysis.signature import DecoderSignature

_FLOAT_TYPES = {
    ir.DataType.FLOAT: "float32",
    ir.DataType.FLOAT16: "float16",
    ir.DataType.BFLOAT16: "bfloat16",
    ir.DataType.DOUBLE: "float64",
}
_INT_TYPES = {
    ir.DataType.INT64: np.int64,
    ir.DataType.INT32: np.int32,
    ir.DataType.BOOL: np.bool_,
    ir.DataType.FLOAT: np.float32,
    ir.DataType.FLOAT16: np.float16,
}


@dataclass(frozen=True)
class KVSpec:
    """One past input and its present output."""

    past: str
    present: str
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StateSpec:
    """One fixed-size state input (conv window, recurrent state) and its output."""

    past: str
    present: str
    shape: tuple[int, ...]
    """The dims after the batch."""


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
    states: tuple[StateSpec, ...] = ()
    """A hybrid stack's conv/recurrent states (see the module docstring)."""

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
        if self.states:
            first = self.states[0]
            parts.append(f"{len(self.states)} state(s) ({first.past} -> {first.present}, ...)")
        parts.append(f"logits={self.logits}")
        return ", ".join(parts)

    @property
    def has_cache(self) -> bool:
        return bool(self.kv) or bool(self.states)


def discover_io(model: onnx.ModelProto | ir.Model) -> ModelIO:
    """The decoder roles of ``model``'s inputs and outputs (by shape, type and consumer, see
    :mod:`epfuse.patterns.analysis.signature`), as the names and numpy types verify feeds."""
    if isinstance(model, onnx.ModelProto):
        model = ir.from_proto(model)
    graph = model.graph
    sig = DecoderSignature.of(graph)
    if sig.logits is None:
        rest = [v.name for v in graph.outputs if v not in {c.present for c in sig.cache}]
        raise ValueError(f"cannot tell the logits among outputs {rest}")
    if sig.tokens is None:
        inputs = [v.name for v in graph.inputs if not v.is_initializer()]
        raise ValueError(
            "no token input (a (batch, seq) integer input indexing the embedding, or a "
            f"(batch, seq, hidden) inputs_embeds) among {inputs}"
        )
    if sig.token_kind == "embeds" and sig.hidden_size is None:
        raise ValueError(f"{sig.tokens.name}: the hidden size (last dim) must be static")
    if sig.extra_inputs:
        names = [v.name for v in sig.extra_inputs]
        raise ValueError(f"cannot feed unrecognised model inputs {names}")
    presents = [c.present for c in sig.cache if c.present is not None]
    presents += [v for v in sig.extra_outputs if v.shape is not None and len(v.shape) == 4]
    if presents and len(presents) != len(sig.cache):
        raise ValueError(
            f"{len(sig.cache)} past inputs but {len(presents)} present outputs: "
            f"{[c.past.name for c in sig.cache]} vs {[v.name for v in presents]}"
        )
    kv: list[KVSpec] = []
    for c in sig.cache:
        # Past inputs but no presents: the prompt scenarios still run, with an empty past.
        if c.num_heads is None or c.head_size is None:
            raise ValueError(
                f"{c.past.name}: KV heads and head dim must be static, got {c.past.shape}"
            )
        kv.append(
            KVSpec(c.past.name, c.present.name if c.present else "", c.num_heads, c.head_size)
        )

    dtype = _FLOAT_TYPES.get(sig.dtype)
    if dtype is None:
        raise ValueError(f"unsupported compute dtype {sig.dtype} (of the past inputs or logits)")

    def np_type(value: ir.Value | None) -> Any:
        if value is None:
            return None
        t = _INT_TYPES.get(value.dtype)
        if t is None:
            raise ValueError(f"{value.name} has unsupported element type {value.dtype}")
        return t

    mask, positions = sig.attention_mask, sig.position_ids
    return ModelIO(
        input_ids=sig.tokens.name,
        input_ids_dtype=np_type(sig.tokens) if sig.token_kind == "ids" else None,
        attention_mask=mask.name if mask is not None else None,
        attention_mask_dtype=np_type(mask),
        position_ids=positions.name if positions is not None else None,
        position_ids_dtype=np_type(positions),
        kv=tuple(kv),
        logits=sig.logits.name,
        dtype=dtype,
        vocab_size=sig.vocab_size,
        position_streams=sig.position_streams,
        token_kind=sig.token_kind,
        hidden_size=sig.hidden_size,
        states=tuple(StateSpec(st.past.name, st.present.name, st.shape) for st in sig.states),
    )
