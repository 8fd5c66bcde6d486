"""Prove, by evaluating the graph, which mask an attention layer applies.

Exporters build the attention mask from the 2-D ``attention_mask`` input with dozens of index
ops (And/LessOrEqual/GatherND/Expand at opset 23, Where/arithmetic forms at opset 18). Rather
than match each form, the mask subgraph is checked to read graph inputs only as allowed (one
rank-2 integer input by value; everything else only through its shape) and is then *run* on a
grid of shapes and right-padded masks. A ``Shape`` of an intermediate value whose inferred
shape is static sizes and input dims is fed from those dims (``_evaluate.ShapeCut``): the
mask is evaluated, not the layers a key it is sliced to is computed from. The grid includes decode steps whose total length
reaches ``max_seq_len``, so a sliding window anywhere in the supported context is seen.

The effective mask (the mask input combined with the ``is_causal`` attribute) must match,
on every probe and every valid query row, one of:

* ``causal_padding``: key j visible to query i iff ``j <= past + i`` and ``attention_mask[b, j]``;
* ``sliding_window`` of width W: additionally ``j > past + i - W`` (W keys including the
  current one, Hugging Face's ``sliding_window``).

Anything else (a bias, a non-causal mask, a mask read from another input) is unproven, and the
layer keeps its original attention.

:class:`MaskProof` is the typed result, asked through the run's analyses
(``ctx.analysis(MaskProof, ...)``, :func:`attention_mask_proof` for an ``Attention`` node), so
every layer reading one mask shares one evaluation.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from .._evaluate import ShapeCut, SubgraphEvaluator, _Unprovable, value_dependencies
from .._graph import attr, input_at
from .manager import Analysis, Unproven
from .signature import probe_array

if TYPE_CHECKING:
    from ..base import RewriteContext

MASKED_BELOW = -1.0e4  # an additive mask entry at or below this counts as "masked"


@dataclasses.dataclass(frozen=True)
class MaskProof(Analysis):
    """The proven mask of a mask value: ``ctx.analysis(MaskProof, mask, is_causal, aligned)``
    (``aligned``: the layer has past inputs and ``is_causal``; see :func:`attention_mask_proof`
    for an ``Attention`` node's). An :class:`Unproven` says why the layer keeps its attention.
    """

    kind: str  # "causal_padding" | "sliding_window"
    attention_mask: ir.Value
    window: int | None = None
    probes: int = 0

    def describe(self) -> str:
        if self.kind == "sliding_window":
            return f"causal + padding + sliding window {self.window}"
        return "causal + padding"

    @classmethod
    def compute(
        cls, ctx: RewriteContext, mask: ir.Value, is_causal: bool, aligned: bool, max_seq_len: int
    ) -> MaskProof | Unproven:
        return prove_mask(mask, ctx.graph, max_seq_len, is_causal=is_causal, has_past=aligned)


def _probes(max_seq_len: int) -> list[tuple[int, int, int, list[int]]]:
    """(batch, seq, past, valid lengths per row) covering prompts, decode and chunks."""
    long_past = max(1, max_seq_len - 1)
    mid = max(1, min(max_seq_len // 2, 300))
    grid = [
        (1, 1, 0, [1]),
        (2, 5, 0, [5, 3]),
        (3, 9, 0, [9, 1, 6]),
        (1, 33, 0, [33]),
        (2, 1, 6, [7, 7]),
        (2, 1, 6, [7, 4]),
        (1, 4, 5, [9]),
        (2, 3, 8, [11, 6]),
        (1, 1, long_past, [long_past + 1]),
        (1, 1, mid, [mid + 1]),
        (1, 2, long_past - 1, [long_past + 1]),
    ]
    return [p for p in grid if p[1] + p[2] <= max(max_seq_len, 40)]


def _expected(batch, seq, past, lengths, window):
    total = past + seq
    i = np.arange(seq)[:, None] + past
    j = np.arange(total)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    pad = np.arange(total)[None, :] < np.asarray(lengths)[:, None]  # (B, T)
    return allowed[None, :, :] & pad[:, None, :]  # (B, S, T)


def _valid_rows(seq, past, lengths):
    rows = np.arange(seq)[None, :] + past
    return rows < np.asarray(lengths)[:, None]  # (B, S)


def _to_allowed(mask: np.ndarray) -> np.ndarray | None:
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype.kind == "f":
        ok = (mask == 0) | (mask <= MASKED_BELOW)
        if not ok.all():
            return None
        return mask == 0
    return None


def attention_mask_proof(ctx: RewriteContext, node: ir.Node) -> MaskProof | Unproven:
    """The proven mask of an ONNX ``Attention`` node (cached in the run's analyses)."""
    mask, is_causal, has_past = _attention_mask(node)
    if mask is None:
        return Unproven(_NO_MASK)
    # has_past only aligns is_causal; without it the answer is the same either way.
    max_seq_len = ctx.options.max_seq_len
    return ctx.analysis(MaskProof, mask, is_causal, has_past and is_causal, max_seq_len)


_NO_MASK = "the layer has no attention-mask input, so padding cannot be read from one"


def _attention_mask(node: ir.Node) -> tuple[ir.Value | None, bool, bool]:
    return input_at(node, 3), bool(attr(node, "is_causal", 0)), input_at(node, 4) is not None


def prove_mask(
    mask: ir.Value,
    graph: ir.Graph,
    max_seq_len: int,
    *,
    is_causal: bool = False,
    has_past: bool = False,
) -> MaskProof | Unproven:
    """The proven mask of an additive (or boolean) mask value, or why it is unproven
    (uncached: a run asks ``ctx.analysis(MaskProof, ...)``).

    The canonicalization of a layer that is not yet an ``Attention`` (the softmax NaN guard
    of torch's SDPA) asks this of the mask it is about to hand to one.
    """
    try:
        result = _analyze(mask, graph, is_causal, has_past, max_seq_len)
    except _Unprovable as err:
        result = str(err)
    return Unproven(result) if isinstance(result, str) else result


def _analyze(mask, graph, is_causal, has_past, max_seq_len) -> MaskProof | str:
    cuts: list[ShapeCut] = []
    by_value, _by_shape = value_dependencies(mask, shape_cuts=(graph, cuts))
    if len(by_value) != 1:
        names = sorted(v.name or "?" for v in by_value)
        return f"the mask is computed from {names or 'no input'}, not from one 2-D attention mask"
    (am,) = by_value
    if (
        am.shape is None
        or len(am.shape) != 2
        or am.dtype
        not in (
            ir.DataType.INT64,
            ir.DataType.INT32,
            ir.DataType.BOOL,
        )
    ):
        return f"the mask is computed from {am.name!r}, which is not a 2-D integer attention mask"
    try:
        evaluator = SubgraphEvaluator(
            graph, [mask], inputs=[*graph.inputs, *(c.value for c in cuts)]
        )
    except Exception as err:
        return f"the mask subgraph could not be evaluated ({type(err).__name__})"
    probes = _probes(max_seq_len)
    observed = []
    for batch, seq, past, lengths in probes:
        allowed = _run_probe(
            evaluator, graph, cuts, am, batch, seq, past, lengths, is_causal, has_past
        )
        if isinstance(allowed, str):
            return allowed
        observed.append(((batch, seq, past, lengths), allowed))

    def matches(window: int | None) -> bool:
        for (batch, seq, past, lengths), allowed in observed:
            valid = _valid_rows(seq, past, lengths)
            expected = _expected(batch, seq, past, lengths, window)
            if not (allowed[valid] == expected[valid]).all():
                return False
        return True

    if matches(None):
        return MaskProof("causal_padding", am, None, len(probes))
    widths = {
        _fit_window(allowed, seq, past, lengths) for (_, seq, past, lengths), allowed in observed
    }
    widths.discard(None)
    if len(widths) == 1:
        (window,) = widths
        if matches(window):
            return MaskProof("sliding_window", am, window, len(probes))
    return "the mask is not causal + padding (with or without one sliding window)"


def probe_feeds(
    names, graph: ir.Graph, cuts, am, mask: np.ndarray, batch: int, seq: int, past: int, what: str
) -> dict[str, np.ndarray] | str:
    """Feeds for one probe of a subgraph that reads the graph inputs ``names``: each
    :class:`ShapeCut` its vector (sized from the probe's inputs), the attention mask ``am``
    the probe's ``mask`` rows, every other input a ``probe_array`` of (batch, seq, past); or
    why one cannot be sized (``what`` names what is probed). The mask and the RoPE-position
    proofs probe this way."""
    inputs = {v.name: v for v in graph.inputs}
    by_cut = {c.value.name: c for c in cuts}

    def shape_of(name: str):
        if inputs[name] is am:
            return mask.shape
        array = probe_array(inputs[name], am, batch, seq, past)
        return None if array is None else array.shape

    feeds = {}
    for name in names:
        if name in by_cut:
            vector = by_cut[name].vector(shape_of)
            if vector is None:
                return f"cannot size the shape {name!r} reads to probe {what}"
            feeds[name] = vector
        elif inputs[name] is am:
            feeds[name] = mask.astype(am.dtype.numpy())
        elif (array := probe_array(inputs[name], am, batch, seq, past)) is not None:
            feeds[name] = array
        else:
            return f"cannot size input {name!r} to probe {what}"
    return feeds


def _run_probe(evaluator, graph, cuts, am, batch, seq, past, lengths, is_causal, has_past):
    """The effective (batch, seq, total) visibility of one probe, or why it is unusable."""
    rows = np.arange(past + seq)[None, :] < np.asarray(lengths)[:, None]
    feeds = probe_feeds(evaluator.input_names, graph, cuts, am, rows, batch, seq, past, "the mask")
    if isinstance(feeds, str):
        return feeds
    try:
        (out,) = evaluator(feeds)
    except Exception as err:
        return f"the mask subgraph failed on a probe ({type(err).__name__})"
    allowed = _to_allowed(np.asarray(out))
    if allowed is None:
        return "the mask holds values other than 0 and -inf (an attention bias)"
    if allowed.ndim != 4:
        return f"the mask has rank {allowed.ndim}, expected 4"
    try:
        allowed = np.broadcast_to(allowed, (batch, allowed.shape[1], seq, past + seq))
    except ValueError:
        return "the mask does not broadcast to (batch, heads, seq, total)"
    if not (allowed == allowed[:, :1]).all():
        return "the mask differs between heads"
    allowed = allowed[:, 0]
    if is_causal:
        if not has_past and past != 0:
            return "is_causal without past inputs is aligned differently across EPs"
        allowed = allowed & _expected(batch, seq, past, [past + seq] * batch, None)
    return allowed


def _fit_window(allowed, seq, past, lengths) -> int | None:
    """Visible keys of the first valid row that sees fewer than all its causal keys."""
    valid = _valid_rows(seq, past, lengths)
    for b in range(allowed.shape[0]):
        for i in range(seq):
            if not valid[b, i]:
                continue
            visible = np.flatnonzero(allowed[b, i])
            if len(visible) == 0:
                return None
            width = past + i - visible[0] + 1
            if width < past + i + 1:
                return int(width)
    return None
