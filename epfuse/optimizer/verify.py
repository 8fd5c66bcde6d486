"""Numerical equivalence harness: does an optimized decoder compute what the original did?

Both models run on ONNX Runtime CPU sessions over a fixed set of scenarios with fixed seeds:

- ``prompt``: batch 2, ``prompt_len`` new tokens, empty past, all-ones mask.
- ``decode``: the ORIGINAL model runs an unpadded batch-2 prompt of ``decode_past_len`` tokens;
  its presents are the past of both models for 1 new token.
- ``chunk``: same with batch 1, a ``chunk_past_len``-token past and ``chunk_len`` new tokens
  (chunked prefill).
- ``padded``: batch 2, right-padded prompt of lengths ``padded_lens`` (default ``prompt_len``
  and about half of it), mask ``[1]*L + [0]*(prompt_len-L)``, position_ids ``arange``.
- ``padded_decode``: the padded prompt of ``padded_decode_lens`` (default ``padded_lens``), then
  ``padded_decode_steps`` decode steps, each model on its own cache, the prompt's padding kept
  as zeros in the mask. The only built-in scenario where a lost padding mask shows (causality
  hides padded keys from the valid rows of a right-padded prompt); see :class:`Scenario`.

Any batch and lengths can be given as explicit :class:`Scenario` objects (the property tests
draw them). Logits are compared on valid rows ``(b, :L_b)`` and present K/V on valid rows
``(b, :, :past+L_b, :)``, with the tolerance of the model's dtype from
:mod:`epfuse.optimizer.tolerances`. A model without past inputs or present outputs is compared
on prompt scenarios only (the others are reported as skipped).

Model I/O is discovered from each graph by role, so the optimized model may rename inputs:
``input_ids`` (token input), ``attention_mask``, optional ``position_ids``, past inputs (rank-4
inputs whose names contain "past", in graph order) paired with present outputs (rank-4 outputs
whose names contain "present", in graph order), and ``logits`` (the remaining output).

A position input of shape (3, batch, seq) (mRoPE: temporal, height, width streams) is fed
``position_streams(position_ids)`` for the scenario's 2-D token positions, by default the
same position in all three streams (text only). A caller passes its own map, e.g. image-like
positions, as a pure function of the token index so that prompt and continuation agree.

Only onnxruntime and numpy are needed (no torch).
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from epfuse.optimizer.tolerances import Tolerance, tolerance_for

SCENARIOS: tuple[str, ...] = ("prompt", "decode", "chunk", "padded", "padded_decode")
SCENARIO_KINDS: tuple[str, ...] = ("prompt", "continue", "padded_decode")

ModelLike = str | os.PathLike | onnx.ModelProto | Any  # Any: an onnx_ir.Model
PositionStreams = Callable[[np.ndarray], np.ndarray]
"""(batch, seq) token positions -> (3, batch, seq) mRoPE position streams."""


def text_positions(position_ids: np.ndarray) -> np.ndarray:
    """Text-only mRoPE positions: the same position in the T, H and W streams."""
    return np.broadcast_to(position_ids, (3, *position_ids.shape)).copy()


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


# --------------------------------------------------------------------------------------------
# Model I/O discovery


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


# --------------------------------------------------------------------------------------------
# Sessions


def _to_proto(model: ModelLike) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, os.PathLike)):
        return onnx.load(str(model))
    # An onnx_ir.Model (duck-typed so that this module does not need onnx_ir).
    import onnx_ir as ir

    if isinstance(model, ir.Model):
        # ORT gets the model as bytes, so external weights are read into memory (in place).
        ir.external_data.load_to_model(model)
        return ir.serde.serialize_model(model)
    raise TypeError(f"expected a path, onnx.ModelProto or onnx_ir.Model, got {type(model)}")


def _float32_boundary(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of ``model`` whose bfloat16 graph inputs/outputs are float32 (numpy has no bf16).

    A Cast at the boundary is exact for outputs; inputs are fed with bf16-representable values
    (presents of the original model, or integers), so the Cast back is exact too.
    """
    bf16 = onnx.TensorProto.BFLOAT16
    boundary = [vi for vi in [*model.graph.input, *model.graph.output] if _elem_type(vi) == bf16]
    if not boundary:
        return model
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    renames = {vi.name: vi.name + "__epfuse_bf16" for vi in boundary}
    for node in graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    for vi in graph.value_info:
        vi.name = renames.get(vi.name, vi.name)
    casts_in = []
    for vi in graph.input:
        if vi.name in renames:
            casts_in.append(onnx.helper.make_node("Cast", [vi.name], [renames[vi.name]], to=bf16))
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    for vi in graph.output:
        if vi.name in renames:
            graph.node.append(
                onnx.helper.make_node(
                    "Cast", [renames[vi.name]], [vi.name], to=onnx.TensorProto.FLOAT
                )
            )
            vi.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    for node in reversed(casts_in):
        graph.node.insert(0, node)
    return model


class _Runner:
    """An ORT CPU session for one model plus its discovered I/O roles."""

    def __init__(
        self,
        model: ModelLike,
        providers: Sequence[str],
        session_options: ort.SessionOptions | None,
        position_streams: PositionStreams | None = None,
    ):
        proto = _to_proto(model)
        self.io = discover_io(proto)
        self.position_streams = position_streams or text_positions
        proto = _float32_boundary(proto)
        if session_options is None:
            session_options = ort.SessionOptions()
            session_options.log_severity_level = 3
        self.session = ort.InferenceSession(
            proto.SerializeToString(), sess_options=session_options, providers=list(providers)
        )

    def run(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        position_ids: np.ndarray,
        past: Sequence[np.ndarray] | None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        io = self.io
        feed: dict[str, np.ndarray] = {io.input_ids: input_ids.astype(io.input_ids_dtype)}
        if io.attention_mask is not None:
            feed[io.attention_mask] = attention_mask.astype(io.attention_mask_dtype)
        if io.position_ids is not None:
            feed[io.position_ids] = position_feed(io, position_ids, self.position_streams)
        batch = input_ids.shape[0]
        for i, spec in enumerate(io.kv):
            if past is None:
                value = np.zeros((batch, spec.num_kv_heads, 0, spec.head_dim), np.float32)
            else:
                value = past[i]
            feed[spec.past] = value.astype(_feed_float(io.dtype))
        names = [io.logits] + [spec.present for spec in io.kv if spec.present]
        outs = self.session.run(names, feed)
        return outs[0], list(outs[1:])


def position_feed(
    io: ModelIO, positions: np.ndarray, streams: PositionStreams | None = None
) -> np.ndarray:
    """The ``position_ids`` feed for a scenario's 2-D (batch, seq) token positions.

    A model whose position input is (3, batch, seq) (mRoPE) gets ``streams(positions)``,
    by default :func:`text_positions` (the same positions in the T, H and W streams).
    """
    if io.position_streams:
        positions = (streams or text_positions)(positions)
    return np.ascontiguousarray(positions).astype(io.position_ids_dtype)


def _feed_float(dtype: str) -> Any:
    return {"float16": np.float16, "float64": np.float64}.get(dtype, np.float32)


# --------------------------------------------------------------------------------------------
# Results


@dataclass
class OutputComparison:
    """One compared output of one scenario.

    ``max_rel_err`` is ``max |d| / (|expected| + atol)`` (atol keeps near-zero elements from
    dominating); ``ratio`` is ``max |d| / (atol + rtol * |expected|)``: the comparison passes
    when ``ratio <= 1`` (and nothing is NaN/inf where the original is finite).
    """

    scenario: str
    output: str
    kind: str  # "logits" or "kv"
    shape: tuple[int, ...]
    max_abs_err: float
    max_rel_err: float
    ratio: float
    passed: bool
    note: str = ""


@dataclass
class ScenarioResult:
    name: str
    comparisons: list[OutputComparison] = field(default_factory=list)
    skipped: str | None = None  # reason
    error: str | None = None  # an exception while running a model

    @property
    def passed(self) -> bool:
        if self.skipped is not None:
            return True
        return self.error is None and all(c.passed for c in self.comparisons)


@dataclass
class VerificationResult:
    dtype: str
    tolerance: Tolerance
    scenarios: list[ScenarioResult]

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.scenarios)

    def __bool__(self) -> bool:
        return self.passed

    def scenario(self, name: str) -> ScenarioResult:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

    def failed_scenarios(self) -> list[str]:
        return [s.name for s in self.scenarios if not s.passed]

    def __str__(self) -> str:
        tol = self.tolerance
        head = (
            f"equivalence {'PASSED' if self.passed else 'FAILED'} "
            f"(dtype {self.dtype}, atol {tol.atol:g}, rtol {tol.rtol:g}; "
            f"ratio = max|d| / (atol + rtol*|ref|), pass if <= 1)"
        )
        rows = [("scenario", "output", "shape", "max_abs", "max_rel", "ratio", "ok")]
        for s in self.scenarios:
            if s.skipped is not None:
                rows.append((s.name, f"skipped: {s.skipped}", "", "", "", "", "-"))
                continue
            if s.error is not None:
                rows.append((s.name, f"ERROR: {s.error}", "", "", "", "", "FAIL"))
                continue
            for c in _summarise(s.comparisons):
                rows.append(
                    (
                        s.name,
                        c.output + (f" ({c.note})" if c.note else ""),
                        "x".join(map(str, c.shape)),
                        f"{c.max_abs_err:.3g}",
                        f"{c.max_rel_err:.3g}",
                        f"{c.ratio:.3g}",
                        "ok" if c.passed else "FAIL",
                    )
                )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head]
        for j, r in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(line.rstrip() for line in lines)


def _summarise(comparisons: list[OutputComparison]) -> list[OutputComparison]:
    """Logits plus failing presents individually; passing presents folded into their worst."""
    out = [c for c in comparisons if c.kind != "kv" or not c.passed]
    passing = [c for c in comparisons if c.kind == "kv" and c.passed]
    if len(passing) == 1:
        out.append(passing[0])
    elif passing:
        worst = max(passing, key=lambda c: c.ratio)
        note = f"worst of {len(passing)} passing presents"
        out.append(dataclasses.replace(worst, note=f"{worst.note}; {note}".lstrip("; ")))
    return out


def _compare(
    scenario: str,
    output: str,
    kind: str,
    expected: np.ndarray,
    actual: np.ndarray,
    tol: Tolerance,
    shape: tuple[int, ...] | None = None,
) -> OutputComparison:
    """Element-wise comparison of two (already sliced) arrays; ``shape`` is only reported."""
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(actual, dtype=np.float64)
    shape = tuple(expected.shape) if shape is None else shape
    if expected.shape != actual.shape:
        note = f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        return OutputComparison(
            scenario, output, kind, shape, math.inf, math.inf, math.inf, False, note
        )
    if expected.size == 0:
        return OutputComparison(scenario, output, kind, shape, 0.0, 0.0, 0.0, True)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(actual - expected)
        # Identical non-finite values (inf == inf, NaN where the original has NaN) agree.
        same_nonfinite = ~np.isfinite(expected) & (
            (actual == expected) | (np.isnan(actual) & np.isnan(expected))
        )
        diff = np.where(same_nonfinite, 0.0, diff)
        diff = np.where(np.isnan(diff), math.inf, diff)
        ref = np.where(np.isfinite(expected), np.abs(expected), 0.0)
        max_abs = float(diff.max())
        max_rel = float((diff / (ref + tol.atol)).max())
        ratio = float((diff / (tol.atol + tol.rtol * ref)).max())
    return OutputComparison(
        scenario, output, kind, shape, max_abs, max_rel, ratio, bool(ratio <= 1.0)
    )


# --------------------------------------------------------------------------------------------
# Scenarios


@dataclass(frozen=True)
class _Case:
    """Inputs of one scenario step plus the valid lengths of each batch row."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    position_ids: np.ndarray
    past_len: int
    new_lens: tuple[int, ...]  # valid new tokens per row


def _tokens(rng: np.random.Generator, shape: tuple[int, ...], vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=shape, dtype=np.int64)


def _prompt_case(
    rng: np.random.Generator, batch: int, lens: Sequence[int], vocab: int, width: int | None = None
) -> _Case:
    width = width or max(lens)
    ids = _tokens(rng, (batch, width), vocab)
    mask = np.zeros((batch, width), np.int64)
    for b, n in enumerate(lens):
        mask[b, :n] = 1
    pos = np.tile(np.arange(width, dtype=np.int64), (batch, 1))
    return _Case(ids, mask, pos, 0, tuple(lens))


def _continue_case(rng: np.random.Generator, batch: int, past: int, new: int, vocab: int) -> _Case:
    ids = _tokens(rng, (batch, new), vocab)
    mask = np.ones((batch, past + new), np.int64)
    pos = np.tile(np.arange(past, past + new, dtype=np.int64), (batch, 1))
    return _Case(ids, mask, pos, past, (new,) * batch)


@dataclass(frozen=True)
class Scenario:
    """One comparison scenario with explicit batch and lengths (build with the classmethods).

    - ``prompt``: batch ``len(lens)``, empty past, row ``b`` has ``lens[b]`` valid tokens and is
      right-padded to ``max(lens)``; positions ``arange``.
    - ``continue``: the ORIGINAL model runs an unpadded ``past_len``-token prompt of batch
      ``len(lens)``; its presents are the past of both models for ``new_len`` new tokens
      (decode when ``new_len == 1``, chunked prefill otherwise). ``past_len == 0`` is a prompt.
    - ``padded_decode``: each model runs the right-padded prompt of ``lens`` and then ``steps``
      single-token decode steps on its OWN presents. Row ``b``'s mask at step ``t`` is
      ``[1]*lens[b] + [0]*(max(lens)-lens[b]) + [1]*(t+1)``: the prompt's padding stays in the
      concat cache. Only logits and the prompt part of the presents (``:lens[b]``) are
      compared, because a GroupQueryAttention model writes the new token at its row's length
      (``seqlens_k``), a concat cache at the end. This is what catches a lost padding mask: in
      a right-padded prompt causality already hides padded keys from valid queries. The
      scenario is skipped when the ORIGINAL model's rows do not each equal the same row run
      alone (e.g. a sliding window counted over cache slots, padding included).
    """

    name: str
    kind: str
    lens: tuple[int, ...]
    past_len: int = 0
    new_len: int = 1
    steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in SCENARIO_KINDS:
            raise ValueError(f"unknown scenario kind {self.kind!r}; known: {SCENARIO_KINDS}")
        if self.past_len < 0 or self.new_len < 1 or self.steps < 1:
            raise ValueError(f"{self.name}: need past_len >= 0, new_len >= 1, steps >= 1")
        if not self.lens or min(self.lens) < 1:
            raise ValueError(f"{self.name}: lens must be non-empty and >= 1, got {self.lens}")

    @property
    def batch(self) -> int:
        return len(self.lens)

    @classmethod
    def prompt(cls, lens: Sequence[int], name: str | None = None) -> Scenario:
        lens = tuple(int(n) for n in lens)
        return cls(name or f"prompt{list(lens)}", "prompt", lens)

    @classmethod
    def continuation(
        cls, batch: int, past_len: int, new_len: int, name: str | None = None
    ) -> Scenario:
        kind = "decode" if new_len == 1 else "chunk"
        label = name or f"{kind}[b={batch},past={past_len},new={new_len}]"
        return cls(label, "continue", (new_len,) * batch, past_len=past_len, new_len=new_len)

    @classmethod
    def padded_decode(
        cls, lens: Sequence[int], steps: int = 2, name: str | None = None
    ) -> Scenario:
        lens = tuple(int(n) for n in lens)
        return cls(name or f"padded_decode{list(lens)}x{steps}", "padded_decode", lens, steps=steps)


def _compare_step(
    scenario: str,
    case: _Case,
    original: _Runner,
    optimized: _Runner,
    past: Sequence[np.ndarray] | None,
    tol: Tolerance,
) -> ScenarioResult:
    result = ScenarioResult(scenario)
    try:
        ref_logits, ref_presents = original.run(
            case.input_ids, case.attention_mask, case.position_ids, past
        )
    except Exception as exc:
        result.error = f"original model failed: {type(exc).__name__}: {_first_line(exc)}"
        return result
    try:
        opt_logits, opt_presents = optimized.run(
            case.input_ids, case.attention_mask, case.position_ids, past
        )
    except Exception as exc:
        result.error = f"optimized model failed: {type(exc).__name__}: {_first_line(exc)}"
        return result

    def valid_rows(x: np.ndarray, axis: int, offset: int) -> np.ndarray:
        # Concatenate each row's valid slice along ``axis`` (padding rows hold garbage).
        parts = []
        for b, n in enumerate(case.new_lens):
            index: list[Any] = [slice(None)] * x.ndim
            index[0] = slice(b, b + 1)
            index[axis] = slice(0, offset + n)
            parts.append(x[tuple(index)].reshape(-1))
        return np.concatenate(parts)

    logits_name = original.io.logits
    result.comparisons.append(
        _compare_valid(
            scenario, logits_name, "logits", ref_logits, opt_logits, tol, valid_rows, 1, 0
        )
    )
    names = [spec.present for spec in original.io.kv if spec.present]
    if len(opt_presents) != len(ref_presents):
        result.error = (
            f"optimized model has {len(opt_presents)} present outputs, "
            f"original has {len(ref_presents)}"
        )
        return result
    for name, ref, opt in zip(names, ref_presents, opt_presents, strict=True):
        result.comparisons.append(
            _compare_valid(scenario, name, "kv", ref, opt, tol, valid_rows, 2, case.past_len)
        )
    return result


def _compare_valid(
    scenario: str,
    name: str,
    kind: str,
    ref: np.ndarray,
    opt: np.ndarray,
    tol: Tolerance,
    valid_rows: Any,
    axis: int,
    offset: int,
) -> OutputComparison:
    """Compare the valid rows of ``ref`` and ``opt`` (whole tensors when shapes differ)."""
    if ref.shape != opt.shape:
        return _compare(scenario, name, kind, ref, opt, tol)
    return _compare(
        scenario,
        name,
        kind,
        valid_rows(ref, axis, offset),
        valid_rows(opt, axis, offset),
        tol,
        shape=tuple(ref.shape),
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def builtin_scenarios(
    prompt_len: int = 7,
    decode_past_len: int = 6,
    chunk_past_len: int = 5,
    chunk_len: int = 3,
    padded_lens: tuple[int, ...] | None = None,
    padded_decode_lens: tuple[int, ...] | None = None,
    padded_decode_steps: int = 2,
) -> dict[str, Scenario]:
    """The named default scenarios (see the module docstring) for the given lengths."""
    if padded_lens is None:
        padded_lens = (prompt_len, (prompt_len + 1) // 2)
    if padded_decode_lens is None:
        padded_decode_lens = padded_lens
    return {
        "prompt": Scenario.prompt((prompt_len, prompt_len), name="prompt"),
        "decode": Scenario.continuation(2, decode_past_len, 1, name="decode"),
        "chunk": Scenario.continuation(1, chunk_past_len, chunk_len, name="chunk"),
        "padded": Scenario.prompt(padded_lens, name="padded"),
        "padded_decode": Scenario.padded_decode(
            padded_decode_lens, padded_decode_steps, name="padded_decode"
        ),
    }


def compare_models(
    original: ModelLike,
    optimized: ModelLike,
    *,
    scenarios: Iterable[str | Scenario] = SCENARIOS,
    prompt_len: int = 7,
    decode_past_len: int = 6,
    chunk_past_len: int = 5,
    chunk_len: int = 3,
    padded_lens: tuple[int, ...] | None = None,
    padded_decode_lens: tuple[int, ...] | None = None,
    padded_decode_steps: int = 2,
    seed: int = 0,
    tolerance: Tolerance | None = None,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    session_options: ort.SessionOptions | None = None,
    position_streams: PositionStreams | None = None,
) -> VerificationResult:
    """Run ``original`` and ``optimized`` over ``scenarios`` and compare logits and presents.

    Models are paths, ``onnx.ModelProto`` or ``onnx_ir.Model``. ``scenarios`` holds names of
    the built-in scenarios (:data:`SCENARIOS`, sized by the length arguments) and/or explicit
    :class:`Scenario` objects (any batch and lengths). Sequence lengths can be raised (e.g.
    ``prompt_len`` / ``decode_past_len`` beyond a sliding window). ``padded_lens`` defaults to
    ``(prompt_len, (prompt_len + 1) // 2)``, ``padded_decode_lens`` to ``padded_lens``.
    ``tolerance`` overrides the dtype's entry in :data:`epfuse.optimizer.tolerances.TOLERANCES`.
    ``position_streams`` maps the scenario's (batch, seq) positions to (3, batch, seq) mRoPE
    streams for a model whose position input has that shape (default :func:`text_positions`).
    """
    named = builtin_scenarios(
        prompt_len,
        decode_past_len,
        chunk_past_len,
        chunk_len,
        padded_lens,
        padded_decode_lens,
        padded_decode_steps,
    )
    plan: list[Scenario] = []
    unknown = []
    for item in scenarios:
        if isinstance(item, Scenario):
            plan.append(item)
        elif item in named:
            plan.append(named[item])
        else:
            unknown.append(item)
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; known: {SCENARIOS}")

    ref = _Runner(original, providers, session_options, position_streams)
    try:
        opt = _Runner(optimized, providers, session_options, position_streams)
    except Exception as exc:
        # A model that does not load (e.g. an unknown attribute) is a failed verification.
        message = f"optimized model failed to load: {type(exc).__name__}: {_first_line(exc)}"
        tol = tolerance or tolerance_for(ref.io.dtype)
        return VerificationResult(
            dtype=ref.io.dtype,
            tolerance=tol,
            scenarios=[ScenarioResult(s.name, error=message) for s in plan],
        )
    if len(ref.io.kv) != len(opt.io.kv):
        raise ValueError(
            f"original has {len(ref.io.kv)} past/present pairs, optimized has {len(opt.io.kv)}"
        )
    if ref.io.dtype != opt.io.dtype:
        raise ValueError(f"dtype differs: original {ref.io.dtype}, optimized {opt.io.dtype}")
    tol = tolerance or tolerance_for(ref.io.dtype)
    vocab = ref.io.vocab_size or opt.io.vocab_size or 32
    has_cache = all(spec.present for spec in ref.io.kv) and ref.io.has_cache

    results = []
    for scenario in plan:
        rng = np.random.default_rng([seed, _scenario_seed(scenario.name)])
        results.append(_run_scenario(scenario, rng, ref, opt, tol, vocab, has_cache))
    return VerificationResult(dtype=ref.io.dtype, tolerance=tol, scenarios=results)


def _scenario_seed(name: str) -> int:
    """Inputs depend only on (seed, scenario name), not on which other scenarios run."""
    return SCENARIOS.index(name) if name in SCENARIOS else zlib.crc32(name.encode())


def _run_scenario(
    scenario: Scenario,
    rng: np.random.Generator,
    ref: _Runner,
    opt: _Runner,
    tol: Tolerance,
    vocab: int,
    has_cache: bool,
) -> ScenarioResult:
    name = scenario.name
    if scenario.kind == "prompt":
        case = _prompt_case(rng, scenario.batch, scenario.lens, vocab)
        return _compare_step(name, case, ref, opt, None, tol)
    if not has_cache:
        return ScenarioResult(name, skipped="model has no KV cache")
    if scenario.kind == "padded_decode":
        return _padded_decode(scenario, rng, ref, opt, tol, vocab)
    batch, past_len, new = scenario.batch, scenario.past_len, scenario.new_len
    past = None
    if past_len:
        first = _prompt_case(rng, batch, (past_len,) * batch, vocab)
        try:
            _, past = ref.run(first.input_ids, first.attention_mask, first.position_ids, None)
        except Exception as exc:
            return ScenarioResult(
                name,
                error=f"original model failed on the {past_len}-token prompt: "
                f"{type(exc).__name__}: {_first_line(exc)}",
            )
    case = _continue_case(rng, batch, past_len, new, vocab)
    return _compare_step(name, case, ref, opt, past, tol)


def _padded_decode(
    scenario: Scenario,
    rng: np.random.Generator,
    ref: _Runner,
    opt: _Runner,
    tol: Tolerance,
    vocab: int,
) -> ScenarioResult:
    """See :class:`Scenario`: padded prompt, then decode steps on each model's own cache."""
    name, lens, batch = scenario.name, scenario.lens, scenario.batch
    prompt = _prompt_case(rng, batch, lens, vocab)
    tokens = _tokens(rng, (batch, scenario.steps), vocab)
    result = ScenarioResult(name)

    def steps(runner: _Runner, rows: Sequence[int] | None) -> list[tuple[np.ndarray, list]]:
        """Prompt + decode steps for ``rows`` (None: the padded batch; else unpadded rows)."""
        if rows is None:
            ids, mask, pos = prompt.input_ids, prompt.attention_mask, prompt.position_ids
        else:
            (b,) = rows
            n = lens[b]
            ids, mask = prompt.input_ids[b : b + 1, :n], np.ones((1, n), np.int64)
            pos = prompt.position_ids[b : b + 1, :n]
        outs = [runner.run(ids, mask, pos, None)]
        for t in range(scenario.steps):
            past = outs[-1][1]
            if rows is None:
                mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
                pos = np.array([[n + t] for n in lens], dtype=np.int64)
                ids = tokens[:, t : t + 1]
            else:
                mask = np.ones((1, lens[b] + t + 1), np.int64)
                pos = np.array([[lens[b] + t]], dtype=np.int64)
                ids = tokens[b : b + 1, t : t + 1]
            outs.append(runner.run(ids, mask, pos, past))
        return outs

    try:
        ref_out = steps(ref, None)
        alone = [steps(ref, [b]) for b in range(batch)]
    except Exception as exc:
        result.error = f"original model failed: {type(exc).__name__}: {_first_line(exc)}"
        return result
    # In contract only if the original computes each padded row as that row alone would.
    for b in range(batch):
        for t in range(1, scenario.steps + 1):
            check = _compare(name, "logits", "logits", alone[b][t][0][0], ref_out[t][0][b], tol)
            if not check.passed:
                result.skipped = (
                    f"the original's row {b} after its padded prompt differs from the row run "
                    f"alone (max err {check.max_abs_err:.3g}): padding holes change its result "
                    "(e.g. a sliding window over cache slots)"
                )
                return result
    try:
        opt_out = steps(opt, None)
    except Exception as exc:
        result.error = f"optimized model failed: {type(exc).__name__}: {_first_line(exc)}"
        return result
    logits = ref.io.logits
    for t in range(1, scenario.steps + 1):
        ref_logits, opt_logits = ref_out[t][0], opt_out[t][0]
        comparison = _compare(name, logits, "logits", ref_logits, opt_logits, tol)
        comparison.note = f"step {t}"
        result.comparisons.append(comparison)
    # The prompt's rows of the final cache: the new tokens sit at different slots (see above).
    ref_presents, opt_presents = ref_out[-1][1], opt_out[-1][1]
    if len(ref_presents) != len(opt_presents):
        result.error = "optimized model has a different number of present outputs"
        return result
    names = [spec.present for spec in ref.io.kv if spec.present]
    for present, r, o in zip(names, ref_presents, opt_presents, strict=True):
        if r.shape != o.shape:
            comparison = _compare(name, present, "kv", r, o, tol)
        else:
            comparison = _compare(
                name,
                present,
                "kv",
                np.concatenate([r[b, :, : lens[b]].reshape(-1) for b in range(batch)]),
                np.concatenate([o[b, :, : lens[b]].reshape(-1) for b in range(batch)]),
                tol,
                shape=tuple(r.shape),
            )
        comparison.note = "prompt rows"
        result.comparisons.append(comparison)
    return result


def assert_equivalent(
    original: ModelLike, optimized: ModelLike, **kwargs: Any
) -> VerificationResult:
    """:func:`compare_models`, raising ``AssertionError`` with the result table on failure."""
    result = compare_models(original, optimized, **kwargs)
    if not result.passed:
        raise AssertionError("optimized model is not equivalent to the original\n" + str(result))
    return result


__all__ = [
    "SCENARIOS",
    "KVSpec",
    "ModelIO",
    "OutputComparison",
    "Scenario",
    "ScenarioResult",
    "VerificationResult",
    "assert_equivalent",
    "builtin_scenarios",
    "compare_models",
    "discover_io",
    "text_positions",
]


def _main(argv: Sequence[str] | None = None) -> int:
    """``python -m epfuse.optimizer.verify ORIGINAL OPTIMIZED``: print the comparison table."""
    import argparse

    parser = argparse.ArgumentParser(description="Compare an optimized decoder to its original.")
    parser.add_argument("original", type=Path)
    parser.add_argument("optimized", type=Path)
    parser.add_argument("--prompt-len", type=int, default=7)
    args = parser.parse_args(argv)
    result = compare_models(args.original, args.optimized, prompt_len=args.prompt_len)
    print(result)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(_main())
