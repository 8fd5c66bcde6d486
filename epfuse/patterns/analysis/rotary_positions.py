"""Which positions GroupQueryAttention's fused rotary would use, proven against RoPE positions
the graph computes.

Some exports take no ``position_ids`` input: Optimum's Gemma (1, 2, 3) and Nemotron rotate at
``arange(past, past + seq)`` computed from the past's shape; Hugging Face's generation
computes ``cumsum(attention_mask) - 1``. Moving such a rotation into GQA (``do_rotary=1``)
is exact only if the positions GQA rotates at are the graph's on every valid token, and
which positions those are is a property of the kernel, checked on ORT 1.32 CPU:

* on a first prompt (``total_sequence_length == seq``), without ``position_ids``: ``s`` for
  every row; with ``position_ids``: ``position_ids[0, 0] + s`` for *every* row (row 0's
  start, not each row's);
* otherwise (decode, chunked prefill), without ``position_ids``: ``seqlens_k[b] + 1 - seq +
  s``, i.e. row ``b``'s valid length (``sum(attention_mask[b])``) minus ``seq``, plus ``s``;
  with ``position_ids``: every id as given.

So the computed positions are *evaluated* on ORT over probes (prompts, right-padded prompts,
decode with a past, chunked prefill, and decode after a right-padded prompt, whose padding
stays in the concat cache as ``[1]*len + [0]*pad + [1]``), reading the attention mask by value
and everything else only through shapes, and compared on every valid token with:

* ``derived``: GQA's own positions without a ``position_ids`` input (onnxruntime-genai's
  builder form). Positions counted from the mask (``cumsum``) satisfy it; positions counted
  from the cache length do not after a padded prompt (row ``b`` continues at the cache length,
  GQA at the row's length);
* otherwise ``fed``: the positions given to GQA as ``position_ids``, which needs only the first
  prompt to be ``p[0, 0] + s`` on every row (decode and chunks honour every id).

Positions that satisfy neither are refused with the scenario where they differ.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from .._evaluate import ShapeCut, SubgraphEvaluator, _Unprovable, value_dependencies
from .manager import Analysis, Unproven
from .mask_proof import probe_feeds

if TYPE_CHECKING:
    from ..base import RewriteContext


@dataclasses.dataclass(frozen=True)
class ProvenPositions(Analysis):
    """Computed RoPE positions proven to be what fused rotary uses (see the module doc):
    ``ctx.analysis(ProvenPositions, positions, attention_mask, max_seq_len)``, where
    ``attention_mask`` is the 2-D mask GQA's ``seqlens_k`` is built from (the layer's proven
    mask). An :class:`Unproven` says why the rotation stays outside."""

    derived: bool
    """True: GQA's own positions (no ``position_ids`` input needed); False: equal only when
    fed as ``position_ids``."""
    probes: int
    why_not_derived: str | None = None
    """Where the positions leave GQA's own, when ``derived`` is False."""
    per_row: bool = True
    """(batch, seq) at every probe, as GQA's ``position_ids`` must be; False: (1, seq),
    broadcast over the batch."""

    @classmethod
    def compute(
        cls, ctx: RewriteContext, positions: ir.Value, attention_mask: ir.Value, max_seq_len: int
    ) -> ProvenPositions | Unproven:
        return prove_positions(positions, attention_mask, ctx.graph, max_seq_len)


@dataclasses.dataclass(frozen=True)
class _Probe:
    name: str
    past: int
    seq: int
    mask: np.ndarray  # (batch, past + seq) of 0/1, right-padded per row


def _right_padded(name: str, seq: int, past: int, lengths: list[int]) -> _Probe:
    rows = np.arange(past + seq)[None, :] < np.asarray(lengths)[:, None]
    return _Probe(name, past, seq, rows.astype(np.int64))


def _after_padded_prompt(lengths: list[int], step: int) -> _Probe:
    """Decode step ``step`` after a right-padded prompt: ``[1]*len + [0]*pad + [1]*(step+1)``
    (verify's ``padded_decode``): the padding stays in the concat cache."""
    width = max(lengths)
    rows = [[1] * n + [0] * (width - n) + [1] * (step + 1) for n in lengths]
    return _Probe(f"decode after a padded prompt {lengths}", width + step, 1, np.asarray(rows))


def _probes(max_seq_len: int) -> list[_Probe]:
    long_past = max(1, min(max_seq_len - 1, 300))
    return [
        _right_padded("prompt", 1, 0, [1]),
        _right_padded("prompt", 7, 0, [7]),
        _right_padded("right-padded prompt", 5, 0, [5, 3]),
        _right_padded("right-padded prompt", 9, 0, [9, 1, 6]),
        _right_padded("decode", 1, 6, [7, 7]),
        _right_padded("decode", 1, long_past, [long_past + 1]),
        _right_padded("chunked prefill", 4, 5, [9]),
        _right_padded("chunked prefill", 3, 8, [11]),
        _after_padded_prompt([5, 3], 0),
        _after_padded_prompt([6, 2, 4], 1),
    ]


def prove_positions(
    positions: ir.Value, attention_mask: ir.Value, graph: ir.Graph, max_seq_len: int
) -> ProvenPositions | Unproven:
    """The proof itself (uncached; rules ask ``ctx.analysis(ProvenPositions, ...)``)."""
    try:
        result = _prove(positions, attention_mask, graph, max_seq_len)
    except _Unprovable as err:
        result = f"the positions could not be evaluated ({err})"
    return Unproven(result) if isinstance(result, str) else result


def _prove(positions, am, graph, max_seq_len) -> ProvenPositions | str:
    cuts: list[ShapeCut] = []
    by_value, _ = value_dependencies(positions, shape_cuts=(graph, cuts))
    others = sorted(v.name or "?" for v in by_value if v is not am)
    if others:
        return f"the positions read {others} by value, not only the attention mask"
    try:
        evaluator = SubgraphEvaluator(
            graph, [positions], inputs=[*graph.inputs, *(c.value for c in cuts)]
        )
    except Exception as err:
        return f"the positions could not be evaluated ({type(err).__name__})"
    probes = _probes(max_seq_len)
    why_not_derived, per_row = None, True
    for probe in probes:
        got = _run(evaluator, graph, cuts, am, probe)
        if isinstance(got, str):
            return got
        batch = probe.mask.shape[0]
        if got.ndim != 2 or got.shape[1] != probe.seq or got.shape[0] not in (1, batch):
            return f"the positions are {list(got.shape)}, not (batch, seq), on a {probe.name}"
        per_row = per_row and got.shape[0] == batch
        got = np.broadcast_to(got, (batch, probe.seq))
        valid = probe.mask[:, probe.past :].astype(bool)  # each new token's own mask entry
        steps = np.arange(probe.seq)[None, :]
        if probe.past == 0:  # a first prompt
            derived = np.broadcast_to(steps, got.shape)
            fed = got[0, 0] + derived
            if not (got[valid] == fed[valid]).all():
                return (
                    f"on a {probe.name} the positions are not position 0's plus the token "
                    "index on every row (what fused rotary uses on a first prompt)"
                )
        else:
            derived = probe.mask.sum(axis=1, keepdims=True) - probe.seq + steps
        if why_not_derived is None and not (got[valid] == derived[valid]).all():
            why_not_derived = (
                f"on a {probe.name} they are not GQA's own (the row's length minus seq, "
                "plus the token index)"
            )
    return ProvenPositions(why_not_derived is None, len(probes), why_not_derived, per_row)


def _run(evaluator, graph, cuts, am, probe: _Probe) -> np.ndarray | str:
    feeds = probe_feeds(
        evaluator.input_names,
        graph,
        cuts,
        am,
        probe.mask,
        probe.mask.shape[0],
        probe.seq,
        probe.past,
        "the positions",
    )
    if isinstance(feeds, str):
        return feeds
    try:
        (got,) = evaluator(feeds)
    except Exception as err:
        return f"the positions failed on a {probe.name} ({type(err).__name__})"
    return np.asarray(got)
