"""Lengths that matter for a pair of models, read from both graphs: every sliding window, every
length threshold (LongRoPE's switch at ``original_max_position_embeddings``) and how many
positions the models can take at all (rows of constant cos/sin caches and position tables).

The default scenarios of ``epfuse verify`` and ``epfuse fuzz`` must run past all of them: a
window lost in the rewrite shows only on a sequence longer than the window, and a user should
never need a flag to catch it. Windows are read the config-free way the optimizer proves masks:

- GroupQueryAttention's ``local_window_size`` (either graph, e.g. an epfuse output or a
  genai/mobius build);
- the mask subgraph of every ONNX ``Attention``, proven by evaluation
  (:func:`epfuse.patterns.analysis.mask_proof.attention_mask_proof`) after the canonicalize stage lifted a
  decomposed attention (opset-18 exports) to one. Only a copy of the model is canonicalized.

Thresholds are constant integer operands (>= 2) of comparisons (Greater, Less, ...): a
LongRoPE switch compares the sequence length with ``original_max_position_embeddings``. A
constant that is not a length threshold only makes the chosen lengths longer, never wrong.
Position limits are the rows of constant 2-D tables gathered by an index that depends on a
graph input (cos/sin caches, learned position embeddings) and of GroupQueryAttention's and
RotaryEmbedding's cos/sin cache inputs (either of LongRoPE's two, when a scalar ``Where``
picks one per call).

It reads onnx_ir models (a ``ModelProto`` is deserialized once); the mask proof canonicalizes
a clone, which shares the weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

_COMPARE = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal")
_MIN_LEN = 7  # the historical default prompt: short models keep their fast scenarios
MAX_THRESHOLD = 1 << 20  # constants beyond this are not sequence lengths a CPU check can reach


@dataclasses.dataclass
class Limits:
    """What the two graphs say about sequence lengths (see the module docstring)."""

    windows: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    """window -> where it was read ("optimized: GroupQueryAttention local_window_size")."""
    thresholds: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    max_positions: int | None = None
    """Positions the models can take (smallest cache / table rows of both graphs), or None."""
    max_positions_source: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def longest(self) -> int:
        """The longest window or threshold the scenarios must pass (0 if none)."""
        return max([*self.windows, *self.thresholds, 0])

    def describe(self) -> str:
        parts = []
        if self.windows:
            parts.append("sliding window " + ", ".join(str(w) for w in sorted(self.windows)))
        if self.thresholds:
            parts.append("length threshold " + ", ".join(str(t) for t in sorted(self.thresholds)))
        if self.max_positions is not None:
            parts.append(f"at most {self.max_positions} positions ({self.max_positions_source})")
        return "; ".join(parts) if parts else "no sliding window or length threshold found"

    def merge(self, other: Limits) -> Limits:
        out = Limits(
            {k: list(v) for k, v in self.windows.items()},
            {k: list(v) for k, v in self.thresholds.items()},
            self.max_positions,
            self.max_positions_source,
            [*self.notes, *other.notes],
        )
        for source, target in ((other.windows, out.windows), (other.thresholds, out.thresholds)):
            for key, where in source.items():
                target.setdefault(key, []).extend(where)
        if other.max_positions is not None and (
            out.max_positions is None or other.max_positions < out.max_positions
        ):
            out.max_positions, out.max_positions_source = (
                other.max_positions,
                other.max_positions_source,
            )
        return out


def read_limits(
    original: ir.Model | onnx.ModelProto, optimized: ir.Model | onnx.ModelProto | None = None
) -> Limits:
    """The windows, thresholds and position limit of both graphs, merged."""
    limits = _read_one(original, "original")
    if optimized is not None:
        limits = limits.merge(_read_one(optimized, "optimized"))
    return limits


def default_lengths(limits: Limits, steps: int = 2) -> dict[str, Any]:
    """Prompt, decode-past and chunk-past lengths past every window and threshold.

    Prompt ``T + 3`` (rows beyond ``T + 1`` see a window of ``T`` and one of ``T + 1``
    differ), decode past ``T + 2``, chunk past ``T + 1`` plus 3 new tokens, where ``T`` is the
    longest window or threshold; capped so that the padded prompt plus ``steps`` decode steps
    fit in the models' positions.

    A length threshold has two sides: with one and no sliding window, the padded decode (each
    model runs its own prompt) stays at or below ``T`` positions, ``steps`` included, so a
    rewrite that takes the long side for every length (LongRoPE's long factors) fails too.
    """
    longest = limits.longest
    prompt = max(_MIN_LEN, longest + 3)
    if limits.max_positions is not None:
        prompt = max(1, min(prompt, limits.max_positions - steps))
    lengths: dict[str, Any] = {
        "prompt_len": prompt,
        "decode_past_len": max(1, prompt - 1),
        "chunk_past_len": max(1, prompt - 2),
    }
    below = max(limits.thresholds, default=0) - steps
    if limits.thresholds and not limits.windows and below >= 2 and below + steps <= prompt:
        lengths["padded_decode_lens"] = (below, (below + 1) // 2)
    return lengths


UNBOUNDED_MAX = 8192
"""Positions a CPU check runs at most where neither graph states a limit (memory: attention
scores grow with the square of the length)."""


def check_length(limits: Limits, total: int, what: str) -> str | None:
    """Why a scenario reaching ``total`` positions is beyond the models (None if it fits)."""
    if limits.max_positions is None and total > UNBOUNDED_MAX:
        return (
            f"{what} needs {total} positions; neither model states a position limit (no cos/sin "
            f"cache), and a CPU check runs at most {UNBOUNDED_MAX}"
        )
    if limits.max_positions is not None and total > limits.max_positions:
        return (
            f"{what} needs {total} positions but the models take at most "
            f"{limits.max_positions} ({limits.max_positions_source})"
        )
    return None


# ----------------------------------------------------------------------------------- reading


def _read_one(model: ir.Model | onnx.ModelProto, label: str) -> Limits:
    try:
        return _read(model, label)
    except Exception as err:  # reading lengths must never stop a comparison
        return Limits(notes=[f"{label}: lengths not read ({type(err).__name__}: {err})"])


def _read(model: ir.Model | onnx.ModelProto, label: str) -> Limits:
    limits = Limits()
    if isinstance(model, onnx.ModelProto):
        try:
            model = ir.serde.deserialize_model(model)
        except Exception as err:  # verify reports the model's real problem when it runs it
            limits.notes.append(f"{label}: graph not read ({type(err).__name__})")
            return limits
    try:
        from .roles import discover_io

        tokens = frozenset({discover_io(model).input_ids})
    except ValueError:
        tokens = frozenset()
    _scan(model.graph, label, limits, positions=True, tokens=tokens)
    if any(n.op_type == "Attention" and n.domain == "" for n in model.graph.all_nodes()) or (
        not any(n.op_type == "GroupQueryAttention" for n in model.graph.all_nodes())
    ):
        _windows_from_masks(model, label, limits)
    return limits


def _scan(
    graph: ir.Graph, label: str, limits: Limits, positions: bool, tokens: frozenset[str]
) -> None:
    """``tokens``: the token inputs, whose embedding table is no position limit."""
    for node in graph.all_nodes():
        if node.op_type == "GroupQueryAttention":
            window = node.attributes.get("local_window_size")
            if window is not None and window.value > 0:
                where = f"{label}: GroupQueryAttention local_window_size"
                limits.windows.setdefault(int(window.value), []).append(where)
            if positions and len(node.inputs) > 7:
                _table_rows(node.inputs[7], f"{label}: GroupQueryAttention cos cache", limits)
        elif positions and node.op_type == "RotaryEmbedding":
            # contrib (x, position_ids, cos_cache, sin_cache); ONNX (x, cos_cache, sin_cache,
            # position_ids) when the position input is given.
            cos = None
            if node.domain == "com.microsoft" and len(node.inputs) > 2:
                cos = node.inputs[2]
            elif node.domain == "" and len(node.inputs) > 3 and node.inputs[3] is not None:
                cos = node.inputs[1]
            if cos is not None:
                _table_rows(cos, f"{label}: RotaryEmbedding cos cache", limits)
        elif positions and node.op_type == "Gather" and len(node.inputs) == 2:
            data, index = node.inputs
            sources = _input_sources(index)
            if data is not None and sources and not sources & tokens:
                _table_rows(data, f"{label}: {data.name or 'table'} rows", limits, min_rows=2)
        if node.op_type in _COMPARE:
            for value in node.inputs:
                threshold = _int_scalar(value)
                if threshold is not None and 2 <= threshold <= MAX_THRESHOLD:
                    where = f"{label}: {node.op_type} with {threshold}"
                    limits.thresholds.setdefault(threshold, []).append(where)


def _table_rows(value: ir.Value | None, where: str, limits: Limits, min_rows: int = 1) -> None:
    array = _const(value)
    if array is None:  # LongRoPE's Where(cond, cache, cache): either has the rows
        from epfuse.patterns.analysis.switched_caches import switched_cache

        switched = switched_cache(value)
        array = switched.when_true if switched is not None else None
    if array is None or array.ndim != 2 or array.dtype.kind != "f" or array.shape[0] < min_rows:
        return
    rows = int(array.shape[0])
    if limits.max_positions is None or rows < limits.max_positions:
        limits.max_positions, limits.max_positions_source = rows, where


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        try:
            return value.const_value.numpy()
        except Exception:
            return None
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].value.numpy()
    return None


def _int_scalar(value: ir.Value | None) -> int | None:
    array = _const(value)
    if array is None or array.size != 1 or array.dtype.kind not in "iu":
        return None
    return int(array.reshape(-1)[0])


def _input_sources(value: ir.Value | None, budget: int = 64) -> set[str]:
    """The graph inputs ``value`` is computed from (near it: a bounded walk up the graph)."""
    seen: set[int] = set()
    found: set[str] = set()
    stack = [value]
    while stack and budget > 0:
        budget -= 1
        v = stack.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            found.add(v.name or "")
            continue
        node = v.producer()
        if node is not None:
            stack.extend(node.inputs)
    return found


def _windows_from_masks(model: ir.Model, label: str, limits: Limits) -> None:
    """Windows of the ONNX Attention masks, proven by evaluation on a canonicalized copy."""
    from epfuse.capabilities import get_ep
    from epfuse.optimizer.api import model_dtype
    from epfuse.optimizer.manager import PassManager
    from epfuse.patterns import RULES, OptimizeOptions, RewriteContext, Stage
    from epfuse.patterns.analysis.mask_proof import MaskProof, attention_mask_proof

    max_len = min(limits.max_positions or 4096, 1 << 16)
    try:
        work = model.clone()  # shares the weights; the canonicalization edits the copy
        ir.external_data.load_to_model(work)
        canonical = tuple(r for r in RULES if r.stage is Stage.CANONICALIZE)
        options = OptimizeOptions(max_seq_len=max_len)
        ep, dtype = get_ep("default"), model_dtype(work)
        PassManager(canonical).run(work, ep, dtype, options)
    except Exception as err:
        limits.notes.append(f"{label}: masks not read ({type(err).__name__}: {err})")
        return
    _scan(work.graph, label, limits, positions=False, tokens=frozenset())
    ctx = RewriteContext(work, ep, dtype, options)  # its analyses: one proof per shared mask
    for node in work.graph:
        if node.op_type != "Attention" or node.domain != "":
            continue
        proven = attention_mask_proof(ctx, node)
        if isinstance(proven, MaskProof):
            if proven.window is not None:
                where = f"{label}: attention mask (evaluated)"
                limits.windows.setdefault(int(proven.window), []).append(where)
        elif proven.reason not in limits.notes:
            limits.notes.append(f"{label}: {node.name or 'Attention'}: {proven.reason}")
